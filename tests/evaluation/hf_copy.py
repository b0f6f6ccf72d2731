"""A Hugging Face GPTNeoXForCausalLM folder (weights + tokenizer) holding the weights of our sequential
model, so that lm-eval's own 'hf' model can score the same network. Our fused QKV is HF's per-head layout
and our rotary is HF's rotate-half, so the copy is a renaming (as tests/model/test_hf_gptneox_layout.py)."""
from pathlib import Path
from typing import Dict

import torch


def _hf_name(ours: str) -> str:
    if ours == "embedding.word_embeddings.weight":
        return "gpt_neox.embed_in.weight"
    if ours == "head.final_linear.weight":
        return "embed_out.weight"
    if ours.startswith("final_norm.norm."):
        return "gpt_neox.final_layer_norm." + ours.rsplit(".", 1)[1]
    name = ours.replace("layers.", "gpt_neox.layers.", 1)
    return name.replace("mlp.linear1", "mlp.dense_h_to_4h").replace("mlp.linear2", "mlp.dense_4h_to_h")


def write_hf_copy(state: Dict[str, torch.Tensor], args: Dict[str, object], tokenizer_file: str, eos_token: str,
                  out_dir: Path) -> Path:
    """``state``: our GPT2ModelSequential state dict (fp32); ``args``: the model's config values."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, PreTrainedTokenizerFast

    state = {k: v.float() for k, v in state.items() if not k.endswith("inv_freq")}
    tied = not args.get("no_weight_tying", False)
    embed = state["embedding.word_embeddings.weight"]
    hidden = int(args["hidden_size"])
    inner = state["layers.0.mlp.linear1.weight"].shape[0]
    config = GPTNeoXConfig(vocab_size=embed.shape[0], hidden_size=hidden, num_hidden_layers=int(args["num_layers"]),
                           num_attention_heads=int(args["num_attention_heads"]), intermediate_size=inner,
                           rotary_pct=float(args.get("rotary_pct", 1.0)),
                           rotary_emb_base=float(args.get("rotary_emb_base", 10000)),
                           max_position_embeddings=int(args.get("max_position_embeddings") or args["seq_length"]),
                           layer_norm_eps=float(args.get("layernorm_epsilon", 1e-5)),
                           use_parallel_residual=bool(args.get("gpt_j_residual", False)), hidden_act="gelu",
                           tie_word_embeddings=tied)
    hf = GPTNeoXForCausalLM(config).eval()
    renamed = {_hf_name(k): v for k, v in state.items()}
    if "embed_out.weight" in renamed:
        head_key = "lm_head.weight" if "lm_head.weight" in dict(hf.named_parameters()) else "embed_out.weight"
        renamed[head_key] = renamed.pop("embed_out.weight")
    missing, unexpected = hf.load_state_dict(renamed, strict=False)
    missing = [m for m in missing if not (tied and m in ("lm_head.weight", "embed_out.weight"))]
    assert not missing and not unexpected, (missing, unexpected)
    if tied:
        hf.tie_weights()
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=tokenizer_file, eos_token=eos_token)
    hf.config.eos_token_id = hf.config.bos_token_id = tokenizer.eos_token_id
    hf.generation_config.eos_token_id = hf.generation_config.bos_token_id = tokenizer.eos_token_id
    hf.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def sequential_state(checkpoint: Path, num_layers: int) -> Dict[str, torch.Tensor]:
    """Our sequential model's state dict from a checkpoint folder (global_stepN) written with
    model_parallel_size 1: the module of mp_rank_00_model_states.pt without a pipeline, or the per-layer
    files (layer_NN-model_00-model_states.pt) of a pipeline."""
    layer_files = sorted(checkpoint.glob("layer_*-model_00-model_states.pt"))
    if not layer_files:
        return torch.load(checkpoint / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["module"]
    state = {}
    for path in layer_files:
        index = int(path.name.split("-")[0][len("layer_"):])
        if index == 0:
            prefix = "embedding."
        elif index <= num_layers:
            prefix = f"layers.{index - 1}."
        elif index == num_layers + 1:
            prefix = "final_norm."
        else:
            prefix = "head."
        for name, tensor in torch.load(path, map_location="cpu", weights_only=False).items():
            state[prefix + name] = tensor
    return state
