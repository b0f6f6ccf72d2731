"""This project's checkpoints written before GPT-NeoX's layout ("flat": embedding.* / layers.N.* names and
pipeline files layer_00 .. layer_{L+2}; "slots": GPT-NeoX's slots with the earlier tensor names and
grouped-query QKV rows per kv group) are read as they are for generation and conversion, and
tools/ckpts/upgrade_checkpoint.py rewrites them into GPT-NeoX's layout for training."""
import json
import math
from pathlib import Path

import pytest
import torch

from megatron.errors import ConversionError
from megatron.checkpoint.neox_checkpoint import flat_state_dict, read_checkpoint, write_checkpoint
from megatron.checkpoint.tensor_parallel import split_full
from megatron.checkpoint.format import OURS, OURS_OLD
from megatron.model.gpt2_model import build_model
from megatron.model.config import ModelConfig
from megatron.mpu import SingleProcessState
from tests.checkpoint_conversion.helpers import our_logits, our_model, random_tokens
from tests.tools.tool_runner import load_tool

ARGS = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_kv_heads=2, seq_length=16,
            max_position_embeddings=16, padded_vocab_size=96, pos_emb="rotary", norm="rmsnorm",
            use_bias_in_norms=True, activation="swiglu", intermediate_size=96, no_weight_tying=True)


def _old_names(name: str, value: torch.Tensor, tp: int) -> tuple:
    """One rank's tensor under the names and layout this project used before GPT-NeoX's."""
    if name.endswith("norm.scale"):
        return name[:-len("scale")] + "weight", value
    if name.endswith("norm.offset"):
        return name[:-len("offset")] + "bias", value
    if name.endswith("attention.rpe.weight"):
        return name[:-len(".weight")], value * math.sqrt(ARGS["hidden_size"] // ARGS["num_attention_heads"])
    if "attention.query_key_value." in name:  # [Q_r | K_r | V_r] -> per kv group [its queries, key, value]
        heads, kv, d = ARGS["num_attention_heads"] // tp, ARGS["num_kv_heads"] // tp, 8
        q, k, v = value.split([heads * d, kv * d, kv * d])
        rest = tuple(value.shape[1:])
        groups = [q.reshape(kv, heads // kv, d, *rest), k.reshape(kv, 1, d, *rest), v.reshape(kv, 1, d, *rest)]
        return name, torch.cat(groups, dim=1).reshape(-1, *rest)
    return name, value


def write_old_checkpoint(save_dir: Path, state: dict, config: ModelConfig, layout: str, tp: int, pp: int) -> Path:
    """An old-layout checkpoint as DeepSpeed's engine saved this project's model then (independent of the
    converter: the names and layouts of before, written out here)."""
    from megatron.model.gpt2_model import slot_prefixes

    path = save_dir / "global_step7"
    (path / "configs").mkdir(parents=True)
    layers = config.num_layers
    ranks = [dict() for _ in range(tp)]
    for name, full in state.items():
        for rank, piece in enumerate(split_full(name, full, tp, config)):
            old, value = _old_names(name, piece.clone(), tp)
            ranks[rank][old] = value
    client = {"iteration": 7, "consumed_train_samples": 56, "lr_scheduler": {"num_iters": 7, "start_lr": 1e-3}}
    if pp == 0:
        for rank, module in enumerate(ranks):
            if layout == "slots":
                prefixes = {p: s for s, p in slot_prefixes(layers).items()}
                module = {f"sequential.{prefixes[p]}.{k[len(p):]}": v for k, v in module.items()
                          for p in prefixes if k.startswith(p)}
            torch.save({"module": module, **client}, path / f"mp_rank_{rank:02d}_model_states.pt")
    else:
        old_index = {0: 0, layers + 3: layers + 1, layers + 4: layers + 2, **{i + 2: i + 1 for i in range(layers)}}
        for slot, prefix in slot_prefixes(layers).items():
            index = old_index[slot] if layout == "flat" else slot
            for rank, module in enumerate(ranks):
                part = {k[len(prefix):]: v for k, v in module.items() if k.startswith(prefix)}
                if part:
                    torch.save(part, path / f"layer_{index:02d}-model_{rank:02d}-model_states.pt")
        for mp in range(tp * pp):
            torch.save({"module": None, **client}, path / f"mp_rank_{mp:02d}_model_states.pt")
    args = dict(ARGS, model_parallel_size=tp, pipe_parallel_size=pp)  # neox_args.json without checkpoint_layout
    (path / "neox_args.json").write_text(json.dumps(args))
    (path / "configs" / "model.yml").write_text("num_layers: 2\n")
    (path / "COMPLETE").write_text("7\n")
    (path / "rng_state_rank0.pt").write_bytes(b"rng")
    (save_dir / "latest").write_text("global_step7")
    return path


@pytest.fixture(scope="module")
def reference():
    config = ModelConfig(**ARGS)
    torch.manual_seed(0)
    model = build_model(config, SingleProcessState()).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)  # norms and offsets away from 1 / 0
    return config, flat_state_dict(model.state_dict(), config), our_logits(model, random_tokens(seq=16))


@pytest.mark.parametrize("layout,tp,pp", [("flat", 1, 0), ("flat", 2, 2), ("slots", 2, 0), ("slots", 1, 1)])
def test_old_layouts_read_as_they_are_and_upgrade(reference, tmp_path, layout, tp, pp):
    config, state, logits = reference
    old = write_old_checkpoint(tmp_path / "old", state, config, layout, tp, pp)
    ckpt = read_checkpoint(str(old))
    assert ckpt.kind == OURS_OLD and ckpt.layout == (tp, pp)
    assert sorted(ckpt.state) == sorted(state)
    torch.testing.assert_close(our_logits(our_model(ckpt.config, ckpt.state), random_tokens(seq=16)), logits,
                               rtol=0, atol=1e-5)

    tool = load_tool("tools/ckpts/upgrade_checkpoint.py")
    assert tool.main(["--input_dir", str(tmp_path / "old"), "--output_dir", str(tmp_path / "new")]) == 0
    new = tmp_path / "new" / "global_step7"
    upgraded = read_checkpoint(str(new))
    assert upgraded.kind == OURS and upgraded.layout == (tp, pp)
    for name, tensor in state.items():
        torch.testing.assert_close(upgraded.state[name], tensor, rtol=0, atol=1e-6, msg=name)
    assert (new / "COMPLETE").is_file() and (tmp_path / "new" / "latest").read_text() == "global_step7"
    assert (new / "rng_state_rank0.pt").read_bytes() == b"rng" and (new / "configs" / "model.yml").is_file()
    client = torch.load(new / "mp_rank_00_model_states.pt", weights_only=False)
    assert client["iteration"] == 7 and client["consumed_train_samples"] == 56
    assert client["lr_scheduler"] == {"num_iters": 7, "start_lr": 1e-3} and client["optimizer"] is None
    # the same files write_checkpoint writes for this split
    fresh = Path(write_checkpoint(str(tmp_path / "fresh"), upgraded.state, upgraded.config, upgraded.args, {}, 7))
    names = sorted(p.name for p in new.glob("*model_states.pt"))
    assert names == sorted(p.name for p in fresh.glob("*model_states.pt"))


def test_upgrading_a_current_checkpoint_is_refused(reference, tmp_path):
    from megatron.checkpoint_conversion.upgrade import upgrade_checkpoint

    config, state, _ = reference
    write_checkpoint(str(tmp_path / "ckpt"), state, config, dict(ARGS), {})
    with pytest.raises(ConversionError, match="already: nothing to upgrade"):
        upgrade_checkpoint(str(tmp_path / "ckpt"), str(tmp_path / "out"))


def test_old_per_layer_rpe_tables_that_differ_are_refused(tmp_path):
    config = ModelConfig(**dict(ARGS, pos_emb="rpe"))
    state = flat_state_dict(build_model(config, SingleProcessState()).state_dict(), config)
    state["layers.1.attention.rpe.weight"] = state["layers.1.attention.rpe.weight"] + 1.0
    old = write_old_checkpoint(tmp_path, state, config, "flat", 1, 0)
    json_args = json.loads((old / "neox_args.json").read_text())
    (old / "neox_args.json").write_text(json.dumps(dict(json_args, pos_emb="rpe")))
    with pytest.raises(ConversionError, match="different rpe tables.*shares one"):
        read_checkpoint(str(old))
