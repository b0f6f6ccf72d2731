"""GPT-NeoX checkpoints written the way GPT-NeoX writes them, from a Hugging Face model's weights, without this
project's converter: the oracle side of the layout tests.

Written from GPT-NeoX's code (EleutherAI/gpt-neox: megatron/checkpoint/engine.py save_ds_checkpoint,
megatron/model/gpt2_model.py / transformer.py / norms.py / word_embeddings.py, and the inverse of
tools/ckpts/convert_neox_to_hf.py) and DeepSpeed's engine:
  * ``global_step{N}/`` with, for pipe_parallel_size 0, ``mp_rank_{t:02d}_model_states.pt`` whose ``module`` keys
    are ``sequential.{slot}.{name}`` (SequentialWrapper), or for pipe_parallel_size >= 1 one
    ``layer_{slot:02d}-model_{t:02d}-model_states.pt`` per slot (0 embedding, i + 2 layer i, L + 3 NormPipe,
    L + 4 untied ParallelLinearPipe) and ``mp_rank_*`` files with ``module`` None;
  * client state: ``iteration``, ``args`` (eight values), ``random_rng_state``, ``np_rng_state``,
    ``torch_rng_state``, ``cuda_rng_state``, ``rng_tracker_states`` (CUDA generator states: 16-byte tensors);
  * ``configs/<name>.yml`` (the user's YAML, GPT-NeoX's dashed keys) and DeepSpeed's ``latest``; no COMPLETE,
    no neox_args.json;
  * tensors: LayerNorm weight/bias, RMSNorm ``scale`` (never an offset); multi-head QKV rows per head
    [q | k | v] (Hugging Face GPTNeoX's), each rank consecutive heads; grouped-query QKV rows per rank
    [its queries | its keys | its values]; gated linear1 per rank [its up rows | its gate rows]; row-parallel
    weights split by columns; rotary inv_freq only with rotary_save_freqs_buffer.
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import torch

GPT_NEOX_DS_KEYS = ("buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
                    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd",
                    "sparse_tensor_module_names", "skipped_steps", "global_steps", "global_samples", "dp_world_size",
                    "mp_world_size", "ds_config", "ds_version")


def _rows(t: torch.Tensor, tp: int) -> List[torch.Tensor]:
    return [c.clone() for c in t.chunk(tp, dim=0)]


def _cols(t: torch.Tensor, tp: int) -> List[torch.Tensor]:
    return [c.clone().contiguous() for c in t.chunk(tp, dim=1)]


def _same(t: torch.Tensor, tp: int) -> List[torch.Tensor]:
    return [t.clone() for _ in range(tp)]


def neox_slots_from_gptneox(hf, tp: int, rotary_save_freqs: bool = False) -> Dict[int, List[Dict[str, torch.Tensor]]]:
    """{slot: per-rank state dicts} of a GPTNeoXForCausalLM as GPT-NeoX's model holds it (layernorm, gelu). With
    the parallel residual GPT-NeoX adds every rank's attention.dense / mlp.linear2 bias before one all-reduce
    (RowParallelLinear(parallel_output=True)), so each rank holds bias / tp (its converter sums them)."""
    sd = {k: v.detach().float() for k, v in hf.state_dict().items()}
    c = hf.config
    summed = (lambda t, n: [t / n for _ in range(n)]) if c.use_parallel_residual else _same
    layers = c.num_hidden_layers
    slots: Dict[int, List[Dict[str, torch.Tensor]]] = {0: [{"word_embeddings.weight": w} for w in
                                                           _rows(sd["gpt_neox.embed_in.weight"], tp)]}
    head_dim = c.hidden_size // c.num_attention_heads
    rope = c.rope_parameters
    rot = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    for i in range(layers):
        p = f"gpt_neox.layers.{i}."
        per_rank = [dict() for _ in range(tp)]
        parts = {
            "input_layernorm.weight": _same(sd[p + "input_layernorm.weight"], tp),
            "input_layernorm.bias": _same(sd[p + "input_layernorm.bias"], tp),
            "attention.query_key_value.weight": _rows(sd[p + "attention.query_key_value.weight"], tp),
            "attention.query_key_value.bias": _rows(sd[p + "attention.query_key_value.bias"], tp),
            "attention.dense.weight": _cols(sd[p + "attention.dense.weight"], tp),
            "attention.dense.bias": summed(sd[p + "attention.dense.bias"], tp),
            "post_attention_layernorm.weight": _same(sd[p + "post_attention_layernorm.weight"], tp),
            "post_attention_layernorm.bias": _same(sd[p + "post_attention_layernorm.bias"], tp),
            "mlp.linear1.weight": _rows(sd[p + "mlp.dense_h_to_4h.weight"], tp),
            "mlp.linear1.bias": _rows(sd[p + "mlp.dense_h_to_4h.bias"], tp),
            "mlp.linear2.weight": _cols(sd[p + "mlp.dense_4h_to_h.weight"], tp),
            "mlp.linear2.bias": summed(sd[p + "mlp.dense_4h_to_h.bias"], tp),
        }
        if rotary_save_freqs:
            inv = 1.0 / (rope["rope_theta"] ** (torch.arange(0, rot, 2).float() / rot))
            parts["attention.rotary_emb.inv_freq"] = _same(inv, tp)
        for name, shards in parts.items():
            for rank in range(tp):
                per_rank[rank][name] = shards[rank]
        slots[i + 2] = per_rank
    slots[layers + 3] = [{"norm.weight": w, "norm.bias": b} for w, b in
                         zip(_same(sd["gpt_neox.final_layer_norm.weight"], tp),
                             _same(sd["gpt_neox.final_layer_norm.bias"], tp))]
    if not c.tie_word_embeddings:
        head = sd.get("embed_out.weight", sd.get("lm_head.weight"))
        slots[layers + 4] = [{"final_linear.weight": w} for w in _rows(head, tp)]
    return slots


def neox_slots_from_llama(hf, tp: int) -> Dict[int, List[Dict[str, torch.Tensor]]]:
    """{slot: per-rank state dicts} of a LlamaForCausalLM (with GQA: num_kv_heads < heads) as GPT-NeoX's model
    holds it (rmsnorm without offset, swiglu, no biases)."""
    sd = {k: v.detach().float() for k, v in hf.state_dict().items()}
    c = hf.config
    assert c.num_key_value_heads < c.num_attention_heads, "GPT-NeoX's multi-head layout is per head (use gptneox)"
    slots: Dict[int, List[Dict[str, torch.Tensor]]] = {0: [{"word_embeddings.weight": w} for w in
                                                           _rows(sd["model.embed_tokens.weight"], tp)]}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        q, k, v = (_rows(sd[p + f"self_attn.{x}_proj.weight"], tp) for x in "qkv")
        up, gate = _rows(sd[p + "mlp.up_proj.weight"], tp), _rows(sd[p + "mlp.gate_proj.weight"], tp)
        o, down = _cols(sd[p + "self_attn.o_proj.weight"], tp), _cols(sd[p + "mlp.down_proj.weight"], tp)
        slots[i + 2] = [{
            "input_layernorm.scale": sd[p + "input_layernorm.weight"].clone(),
            "attention.query_key_value.weight": torch.cat((q[r], k[r], v[r])),
            "attention.dense.weight": o[r],
            "post_attention_layernorm.scale": sd[p + "post_attention_layernorm.weight"].clone(),
            "mlp.linear1.weight": torch.cat((up[r], gate[r])),
            "mlp.linear2.weight": down[r],
        } for r in range(tp)]
    layers = c.num_hidden_layers
    slots[layers + 3] = [{"norm.scale": sd["model.norm.weight"].clone()} for _ in range(tp)]
    if not c.tie_word_embeddings:
        slots[layers + 4] = [{"final_linear.weight": w} for w in _rows(sd["lm_head.weight"], tp)]
    return slots


def _client_state(iteration: int, args: Dict, mp_world: int, tp: int, pp: int) -> Dict:
    ds = {key: None for key in GPT_NEOX_DS_KEYS}
    ds.update(buffer_names=[], skipped_steps=0, global_steps=iteration, global_samples=iteration * 8,
              dp_world_size=1, mp_world_size=mp_world, ds_config={}, ds_version="0.19.8")
    return {**ds, "iteration": iteration, "args": args, "random_rng_state": random.getstate(),
            "np_rng_state": np.random.get_state(), "torch_rng_state": torch.get_rng_state(),
            "cuda_rng_state": torch.zeros(16, dtype=torch.uint8),
            "rng_tracker_states": {"model-parallel-rng": torch.zeros(16, dtype=torch.uint8)}}


def write_gpt_neox_checkpoint(save_dir: Path, slots: Dict[int, List[Dict[str, torch.Tensor]]], yaml_text: str,
                              args: Dict, pp: int, iteration: int = 10, dtype: Optional[torch.dtype] = None) -> Path:
    """Write ``slots`` as GPT-NeoX's ``save_dir/global_step{iteration}`` for pipe_parallel_size ``pp`` (the tensor
    split is the slots'); ``args`` is the client state's `args`, ``yaml_text`` the config GPT-NeoX copies."""
    tp = len(slots[0])
    path = save_dir / f"global_step{iteration}"
    (path / "configs").mkdir(parents=True, exist_ok=True)
    cast = (lambda t: t.to(dtype)) if dtype is not None else (lambda t: t)
    if pp == 0:
        for rank in range(tp):
            module = {f"sequential.{slot}.{name}": cast(t) for slot in sorted(slots)
                      for name, t in slots[slot][rank].items()}
            torch.save({"module": module, **_client_state(iteration, args, tp, tp, pp)},
                       path / f"mp_rank_{rank:02d}_model_states.pt")
    else:
        for slot, per_rank in slots.items():
            for rank, state in enumerate(per_rank):
                torch.save({k: cast(v) for k, v in state.items()},
                           path / f"layer_{slot:02d}-model_{rank:02d}-model_states.pt")
        for mp_rank in range(pp * tp):
            torch.save({"module": None, **_client_state(iteration, args, pp * tp, tp, pp)},
                       path / f"mp_rank_{mp_rank:02d}_model_states.pt")
    (path / "configs" / "model.yml").write_text(yaml_text)
    (save_dir / "latest").write_text(f"global_step{iteration}")
    return path


def gpt_neox_yaml(values: Dict) -> str:
    """A GPT-NeoX config file: JSON-like YAML with dashed keys, as GPT-NeoX's own configs are written."""
    lines = ["# GPT-NeoX config", "{"]
    for key, value in values.items():
        lines.append(f'  "{key.replace("_", "-")}": {_yaml(value)},')
    lines.append("}")
    return "\n".join(lines) + "\n"


def _yaml(value) -> str:
    import json

    if isinstance(value, float):  # YAML 1.1 (PyYAML) reads 1e-06 as a string: write 1.0e-06, as GPT-NeoX's configs do
        text = repr(value)
        return text.replace("e", ".0e") if "e" in text and "." not in text else text
    return json.dumps(value)
