"""The MoE benchmark's contenders of this project are configs it accepts, with the same SwiGLU MLP width active
per token, and transformers' Mixtral is built with the same shape (the speed figures are read by hand: 2 shared
cores make wall-clock assertions unreliable)."""
import torch

from bench.moe_throughput import contender_config, parse_args
from bench.train_throughput import write_data
from megatron.model.config import ModelConfig
from megatron.neox_arguments import NeoXArgs


def test_contenders_are_valid_and_compute_alike(tmp_path):
    args = parse_args(["--size", "tiny", "--seq", "32", "--experts", "4", "--top_k", "2", "--expert_width", "48"])
    data = write_data(str(tmp_path), 4096)
    configs = {}
    for name in ("dense", "megablocks", "deepspeed"):
        neox_args = NeoXArgs.from_dict(contender_config(name, args, data, str(tmp_path)))
        configs[name] = ModelConfig.from_neox_args(neox_args, padded_vocab_size=50304)
    assert configs["dense"].ffn_width == 2 * 48 and configs["dense"].moe_layers == ()
    for name in ("megablocks", "deepspeed"):
        config = configs[name]
        assert config.moe_type == name and config.moe_layers == (0, 1) and config.expert_ffn_width == 48
        assert config.moe_top_k == 2 and config.moe_router_type == "topk" and config.expert_activation == "swiglu"
    assert configs["dense"].activation == "swiglu"
    assert configs["deepspeed"].moe_token_dropping and not configs["deepspeed"].moe_use_residual


def test_mixtral_has_the_same_shape():
    from bench.train_competitors import build_mixtral

    shape = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32, "vocab_size": 128,
             "num_experts": 4, "top_k": 2, "expert_width": 48}
    model, optimizer, loss_of = build_mixtral(shape, torch.device("cpu"))
    experts = model.model.layers[0].mlp.experts
    assert tuple(experts.gate_up_proj.shape) == (4, 2 * 48, 64) and model.config.num_experts_per_tok == 2
    assert len(model.model.layers) == 2
    tokens = torch.randint(0, 128, (2, 32))
    loss = loss_of(tokens, tokens)
    assert torch.isfinite(loss)
    # at its fastest: torch's fused AdamW (as the project's own Adam on CPU), which steps here
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.defaults["fused"], optimizer.defaults
    before = experts.gate_up_proj.detach().clone()
    loss.backward()
    optimizer.step()
    assert not torch.equal(before, experts.gate_up_proj)
