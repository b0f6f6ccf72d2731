"""FLOPs per token against arithmetic written out by hand, the peak table, overrides and MFU."""

import pytest
import torch

from megatron.observability.flops import (
    forward_flops_per_token,
    lookup_peak_tflops,
    mfu,
    peak_dtype,
    peak_tflops,
    tflops_per_device,
    training_flops_per_token,
)
from megatron.model.config import ModelConfig


def _config(**overrides) -> ModelConfig:
    values = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, padded_vocab_size=128)
    return ModelConfig(**{**values, **overrides})


def test_tiny_dense_model_by_hand():
    # h = 64, a = 4, d = 16, k = 4, s = 32, V = 128, gelu -> f = 4h = 256
    qkv = 2 * 64 * (64 + 2 * 4 * 16)  # 24576
    attention = 2 * 32 * 64 + 2 * 32 * 64  # 8192
    dense = 2 * 64 * 64  # 8192
    mlp = 2 * 64 * 256 * 2  # 65536
    logits = 2 * 64 * 128  # 16384
    forward = 2 * (qkv + attention + dense + mlp) + logits
    assert forward == 229376
    assert forward_flops_per_token(_config()) == 229376
    assert training_flops_per_token(_config()) == 3 * 229376 == 688128
    assert training_flops_per_token(_config(checkpoint_activations=True)) == 4 * 229376
    # selective recompute: the attention core (8192 per layer) of both layers once more
    assert training_flops_per_token(_config(recompute_granularity="selective")) == 3 * 229376 + 2 * attention
    # recompute_method 'block': one of the two layers (qkv + attention + dense + mlp = 106496) once more; with
    # two pipeline stages of one layer each, both layers
    block = dict(checkpoint_activations=True, recompute_method="block", recompute_num_layers=1)
    assert training_flops_per_token(_config(**block)) == 3 * 229376 + 106496
    assert training_flops_per_token(_config(**block, pipe_parallel_size=2)) == 3 * 229376 + 2 * 106496


def test_grouped_query_attention_counts_fewer_kv_heads():
    # k = 2: qkv = 2 * 64 * (64 + 2 * 2 * 16) = 16384, 8192 less per layer than with k = 4
    assert forward_flops_per_token(_config(num_kv_heads=2)) == 229376 - 2 * 8192


def test_gated_mlp_counts_three_matrices_of_the_gated_width():
    # swiglu, inner = 4h = 256: f = int(256 * 2 / 3) // 2 = 170 // 2 = 85; 3 matrices: 2 * 64 * 85 * 3 = 32640
    config = _config(activation="swiglu")
    assert (config.ffn_width, config.gated_mlp) == (85, True)
    assert forward_flops_per_token(config) == 229376 - 2 * 65536 + 2 * 32640


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"activation": "swiglu", "mlp_multiple_of": 16},
        {"activation": "geglu", "intermediate_size": 300},
        {"expansion_factor": 3.0, "mlp_multiple_of": 64},
    ],
)
def test_mlp_flops_use_the_width_the_model_builds(overrides):
    from megatron.model.gpt2_model import build_model
    from megatron.mpu import SingleProcessState

    config = _config(**overrides)
    model = build_model(config, SingleProcessState())
    down = model.layers[0].mlp.linear2.weight  # [hidden, width]
    assert down.shape[1] == config.ffn_width


def test_tiny_mamba_model_by_hand():
    # h = 64, D = 2h = 128, R = ceil(64 / 16) = 4, N = 16, K = 4
    in_proj, conv, x_proj, dt_proj = 2 * 64 * 256, 2 * 4 * 128, 2 * 128 * (4 + 32), 2 * 4 * 128
    scan, out_proj = 6 * 128 * 16, 2 * 128 * 64
    layer = in_proj + conv + x_proj + dt_proj + scan + out_proj
    assert layer == 72704
    assert forward_flops_per_token(_config(attention_config=[[["mamba"], 2]])) == 2 * 72704 + 2 * 64 * 128 == 161792


def test_tiny_rwkv_model_by_hand():
    # C = A = 64, N = 64 / 4 heads = 16, F = int(3.5 * 64) // 32 * 32 = 224
    shift = 2 * 64 * 160 + 5 * 2 * 32 * 64
    projections = 4 * 2 * 64 * 64 + 2 * 64 * 64
    decay = 2 * 64 * 64 + 2 * 64 * 64
    wkv = 5 * 64 * 16
    channel_mix = 2 * 64 * 224 * 2 + 2 * 64 * 64
    layer = shift + projections + decay + wkv + channel_mix
    assert layer == 168960
    assert forward_flops_per_token(_config(attention_config=[[["rwkv"], 2]])) == 2 * 168960 + 2 * 64 * 128 == 354304


def test_hybrid_stack_sums_its_layers():
    mamba = (161792 - 16384) // 2
    rwkv = (354304 - 16384) // 2
    attention = (229376 - 16384) // 2
    config = _config(num_layers=3, attention_config=["mamba", "global", "rwkv"])
    assert forward_flops_per_token(config) == mamba + attention + rwkv + 16384


@pytest.mark.parametrize("kind", ["mamba", "rwkv"])
def test_recurrent_formulas_match_torch_flop_counter(kind):
    """One decoding step (the recurrence itself) through torch's FlopCounterMode, which counts matmuls and
    convolutions: it sees every projection as the formula does, and of the recurrence only the read-out
    (C . h: 2 D N; r S: 2 A N), which the formula counts within its 6 D N / 5 A N; a decoding step's causal
    conv is K elementwise multiply-adds (megatron.model.mamba.causal_conv1d), which it does not count. A full forward
    is not compared: on CPU its conv is multiply-adds too, and its scan runs in the chunked, matmul-shaped form
    (state-space duality), whose matmuls do more arithmetic than the recurrence by design (the masked products within
    a chunk); the formula counts the recurrence's work, the model's FLOPs that MFU is measured against."""
    from torch.utils.flop_counter import FlopCounterMode

    from megatron.observability.flops import mamba_scan_flops, rwkv_wkv_flops
    from megatron.model.kv_cache import KVCache
    from megatron.model.gpt2_model import build_model
    from megatron.mpu import SingleProcessState

    config = _config(attention_config=[[[kind], 2]])
    model = build_model(config, SingleProcessState()).eval()
    token = torch.tensor([[5]])
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model((token, torch.zeros_like(token), None), kv_cache=KVCache(max_length=1))
    if kind == "mamba":
        recurrence, read_out = mamba_scan_flops(config), 2 * config.mamba_inner * 16
        elementwise = 2 * 4 * config.mamba_inner  # the conv
    else:
        recurrence, read_out = rwkv_wkv_flops(config), 2 * config.rwkv_dim_att * config.rwkv_head_size
        elementwise = 0
    assert counter.get_total_flops() == forward_flops_per_token(config) - 2 * (recurrence - read_out + elementwise)


def test_missing_vocab_is_an_error():
    with pytest.raises(ValueError, match="padded_vocab_size"):
        forward_flops_per_token(_config(padded_vocab_size=None))


def test_tflops_and_mfu():
    # 688128 FLOPs/token x 1e6 tokens/s over 4 devices = 0.172032 TFLOP/s each
    achieved = tflops_per_device(688128, 1.0e6, 4)
    assert achieved == pytest.approx(0.172032)
    assert mfu(achieved, 312.0) == pytest.approx(0.172032 / 312.0)
    assert mfu(achieved, None) is None
    with pytest.raises(ValueError):
        tflops_per_device(1.0, 1.0, 0)


@pytest.mark.parametrize(
    "name, dtype, peak",
    [
        ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
        ("NVIDIA A100 80GB PCIe", "tf32", 156.0),
        ("NVIDIA H100 80GB HBM3", "bf16", 989.0),
        ("NVIDIA H100 PCIe", "fp16", 756.0),
        ("NVIDIA H100 NVL", "bf16", None),
        ("NVIDIA H200", "fp32", 67.0),
        ("NVIDIA A10", "bf16", 125.0),
        ("NVIDIA A10G", "bf16", None),
        ("NVIDIA L4", "fp16", 121.0),
        ("NVIDIA L40S", "bf16", None),
        ("Tesla V100-SXM2-32GB", "fp16", 125.0),
        ("Tesla V100-PCIE-16GB", "fp16", 112.0),
        ("Tesla V100-SXM2-16GB", "bf16", None),
        ("AMD Instinct MI250X", "bf16", 383.0),
        ("AMD Instinct MI300X", "bf16", 1307.4),
    ],
)
def test_peak_table(name, dtype, peak):
    assert lookup_peak_tflops(name, dtype) == peak


def test_peak_dtype_and_overrides(monkeypatch):
    assert peak_dtype("bfloat16") == "bf16" and peak_dtype("fp32", allow_tf32=True) == "tf32"
    with pytest.raises(ValueError):
        peak_dtype("int8")
    monkeypatch.delenv("NEOX_PEAK_TFLOPS", raising=False)
    assert peak_tflops("bfloat16", device_name="NVIDIA H100 80GB HBM3") == 989.0
    assert peak_tflops("bfloat16", override=100.0, device_name="NVIDIA H100 80GB HBM3") == 100.0
    monkeypatch.setenv("NEOX_PEAK_TFLOPS", "42.5")
    assert peak_tflops("fp32") == 42.5
    monkeypatch.setenv("NEOX_PEAK_TFLOPS", "fast")
    with pytest.raises(ValueError, match="NEOX_PEAK_TFLOPS"):
        peak_tflops("fp32")


def test_cpu_has_no_peak(monkeypatch):
    monkeypatch.delenv("NEOX_PEAK_TFLOPS", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert peak_tflops("bfloat16") is None


def test_moe_layers_count_the_router_and_the_top_k_experts_only():
    from megatron.observability.flops import forward_flops_per_token
    from megatron.model.config import ModelConfig

    base = dict(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, padded_vocab_size=100,
                intermediate_size=128)
    dense = forward_flops_per_token(ModelConfig(**base))
    for k in (1, 2):
        moe = forward_flops_per_token(ModelConfig(**base, moe_num_experts=8, moe_top_k=k, expert_interval=2))
        # layers 0 and 2 are MoE: each swaps one dense MLP (2 x 64 x 128 x 2) for the router and k experts
        per_layer = 2 * 64 * 8 + k * 2 * 64 * 128 * 2 - 2 * 64 * 128 * 2
        assert moe - dense == 2 * per_layer
    glu = ModelConfig(**base, moe_num_experts=4, moe_top_k=2, expert_interval=4, moe_glu=True, activation="silu")
    plain = ModelConfig(**base, moe_num_experts=4, moe_top_k=2, expert_interval=4, activation="silu")
    assert forward_flops_per_token(glu) - forward_flops_per_token(plain) == 2 * 2 * 64 * 128


def test_deepspeed_residual_moe_counts_its_dense_mlp():
    from megatron.observability.flops import moe_mlp_flops_per_token
    from megatron.model.config import ModelConfig

    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, padded_vocab_size=100,
                intermediate_size=128, moe_num_experts=4, moe_top_k=2, moe_type="deepspeed", moe_router_type="topk")
    plain = moe_mlp_flops_per_token(ModelConfig(**base, moe_use_residual=False))
    residual = moe_mlp_flops_per_token(ModelConfig(**base, moe_use_residual=True))
    assert plain == 2 * 64 * 4 + 2 * (2 * 64 * 128 * 2)
    assert residual - plain == 2 * 64 * 128 * 2 + 2 * 64 * 2


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_deepspeed_flops_profiler_agrees_with_the_formula_per_module(activation):
    """DeepSpeed's flops profiler (config section flops_profiler) counts what the model's forward really calls:
    every transformer layer, its attention and its MLP, and the whole model agree with the formula within 5%
    (the formula leaves out norms, biases and activations, O(h) per token)."""
    from deepspeed.profiling.flops_profiler import FlopsProfiler
    from deepspeed.profiling.flops_profiler.profiler import get_module_flops

    from megatron.observability.flops import attention_layer_flops
    from megatron.model.gpt2_model import build_model
    from megatron.mpu import SingleProcessState
    from tests.model.helpers import random_batch

    config = _config(hidden_size=128, seq_length=128, padded_vocab_size=512, activation=activation)
    model = build_model(config, SingleProcessState())
    inputs, _ = random_batch(batch=2, seq=128, vocab=512)
    tokens = 2 * 128
    h, s = config.hidden_size, config.seq_length
    profiler = FlopsProfiler(model)
    profiler.start_profile()
    try:
        with torch.no_grad():
            model(inputs)
        layers = [m for m in model.modules() if type(m).__name__ == "ParallelTransformerLayer"]
        assert len(layers) == config.num_layers
        measured = {"model": profiler.get_total_flops(), "layer": get_module_flops(layers[0]),
                    "attention": get_module_flops(layers[0].attention), "mlp": get_module_flops(layers[0].mlp)}
    finally:
        profiler.end_profile()
    formula = {"model": forward_flops_per_token(config) * tokens, "layer": attention_layer_flops(config) * tokens,
               "attention": (2 * h * 3 * h + 4 * s * h + 2 * h * h) * tokens,
               "mlp": 2 * h * config.ffn_width * (3 if config.gated_mlp else 2) * tokens}
    for part, flops in formula.items():
        assert measured[part] == pytest.approx(flops, rel=0.05), part
