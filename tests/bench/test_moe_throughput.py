"""The MoE benchmark's three contenders are configs the project accepts, with the same active MLP width (the
speed figures are read by hand: 2 shared cores make wall-clock assertions unreliable)."""
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
        assert config.moe_top_k == 2 and config.moe_router_type == "topk"
    assert configs["deepspeed"].moe_token_dropping and not configs["deepspeed"].moe_use_residual
