"""Training FLOPs per token, TFLOP/s per device and model FLOPs utilisation (MFU), with ONE formula.

Notation (ModelConfig's fields): h = hidden_size, L = num_layers, s = seq_length, V = padded_vocab_size,
a = num_attention_heads, k = num_kv_heads (None means a), d = h / a (head size), f = MLP width (below).
A matrix multiply of (m x n) by (n x p) costs 2 m n p FLOPs (one multiply and one add per term).

Forward FLOPs per token:

    per layer:  QKV projections        2 h (a d + 2 k d)          (grouped-query attention: k K/V heads)
                attention scores QK^T  2 s h                      (full s x s square, see below)
                attention over values  2 s h                      (full square)
                output projection      2 h h
                MLP                    2 h f x 3 (gated) or 2 h f x 2 (plain)
    once:       logits                 2 h V

    forward = L * (2 h (a d + 2 k d) + 4 s h + 2 h^2 + 2 h f m) + 2 h V,   m = 3 gated, 2 plain

Layers of attention_config type 'mamba' or 'rwkv' replace that per-layer term with their own (and a hybrid
stack sums each layer's), so ``forward = sum over layers of layer(type) + 2 h V``:

    mamba (D = inner width, N = 16 state channels, K = 4 conv width, R = dt_rank = ceil(h / 16)):
                in_proj  h -> 2D           2 h 2D
                conv1d (depthwise)         2 K D
                x_proj   D -> R + 2N       2 D (R + 2N)
                dt_proj  R -> D            2 R D
                selective scan             6 D N     (per step and state channel: exp(dt A) h (2),
                                                      + dt B x (2), C . h (2); exp itself not counted)
                out_proj D -> h            2 D h
        mamba = 6 h D + 2 K D + 2 D (R + 2N) + 2 R D + 6 D N

    rwkv (C = h, A = dim_att in heads of N = head_size, F = ffn_dim, 32 / 64 = the token-shift / decay
    low-rank widths):
                token-shift mixing         2 C (5 x 32) + 5 x 2 (32) C = 640 C
                receptance, key, value, gate   4 x 2 C A
                decay low-rank             2 C 64 + 2 (64) A
                WKV                        5 A N     (per head and step: r S (2 N^2), S = diag(w) S + k^T v
                                                      (3 N^2); the bonus term is O(N))
                output   A -> C            2 A C
                channel mix                2 C F (key) + 2 F C (value) + 2 C^2 (receptance)
        rwkv = 640 C + 10 C A + 128 C + 128 A + 5 A N + 4 C F + 2 C^2

    gmlp / amlp (F = 4 h, d = gmlp_attn_dim; megatron.model.gmlp's layer):
                input_linear h -> 2F       2 h 2F
                spatial projection         2 s F     (the causal s x s mix counted as the full square)
                output_linear F -> h       2 F h
                amlp's attention           2 (2F) 3d + 4 s d + 2 d F

    Mamba and RWKV do not depend on s: a recurrent layer's work per token is the same at any context length. The
    formulas count the recurrences themselves, not what the chunked training forms compute in their place
    (the chunked scan's log-depth passes, the chunked WKV's [T, T] products), as the attention term counts
    the s x s square whatever kernel computes it.

Training = forward + backward = 3 x forward; with activation checkpointing the forward is recomputed
during backward, so 4 x forward (checkpoint_activations; recompute_method 'block' recomputes only the layers
it checkpoints); selective recompute adds the attention core's forward (4 s h per token and attention layer)
once more.

Choices, stated so the numbers can be compared:
* Causal attention is counted as the full s x s square, as Megatron-LM's and PaLM's MFU formulas do;
  the causally masked work a kernel can skip is about half of the two attention terms.
* Every attention layer is counted as global attention over s tokens (local windows are not special-cased);
  mamba and rwkv layers have their own formulas (above); norms, biases, softmax, activations, rotary
  embeddings and the embedding lookup are not counted (they are O(h) per token).
* MLP width f follows GPT-NeoX's rule as this project's model implements it (ModelConfig.ffn_width):
  inner = intermediate_size if set, else int(expansion_factor * h) if set, else 4 h.
  Plain activations: f = inner rounded up to a multiple of mlp_multiple_of; 2 matrices (h->f, f->h).
  Gated activations (swiglu, geglu, reglu, bilinear, glu): f = int(inner * 2 / 3) // 2 rounded up to
  mlp_multiple_of, with 3 matrices' worth of work (gate h->f, up h->f, down f->h), so a gated MLP with the
  same `inner` costs about as much as the plain one.

Mixture of experts: the layers of ``config.moe_layers`` count, instead of the dense MLP, the router (2 h E) and
the MLPs of the moe_top_k experts each token reaches (active parameters, not all E experts):
k x 2 h F x 3 (GLU experts) or x 2 (plain), F = expert_ffn_width (moe_mlp_flops_per_token); DeepSpeed's residual
MoE (moe_type deepspeed, moe_use_residual) adds its dense MLP and the 2-way mixing coefficient (2 h 2). Tokens
dropped by a capacity limit are still counted (the model's FLOPs, not the work done).

MFU = achieved FLOP/s per device / peak dense FLOP/s of the device for the training dtype. Peaks come from
DEVICE_PEAK_TFLOPS (vendor datasheets, dense figures, never the 2:4 sparsity ones), overridden by the
argument `override` or the environment variable NEOX_PEAK_TFLOPS. On CPU there is no meaningful peak:
peak_tflops returns None and MFU is reported as not applicable."""

import os
import re
from typing import Dict, List, Optional, Tuple

import torch

from megatron.model.config import GATED_ACTIVATIONS, GMLP_FF_MULT, MAMBA_CONV_WIDTH, MAMBA_STATE_SIZE, ModelConfig
from megatron.model.rwkv import TIME_DECAY_EXTRA_DIM, TIME_MIX_EXTRA_DIM

PEAK_ENV_VAR = "NEOX_PEAK_TFLOPS"

# (regex on torch.cuda.get_device_name(), {dtype: dense peak TFLOP/s}); first match wins, so specific
# names (PCIe, NVL) come before the general ones. Sources: NVIDIA / AMD datasheets.
DEVICE_PEAK_TFLOPS: Tuple[Tuple[str, Dict[str, float]], ...] = (
    (r"\bH100\b.*\bNVL\b|\bH200\b.*\bNVL\b", {}),   # NVL parts: datasheet quotes pairs; set NEOX_PEAK_TFLOPS
    (r"\bH100\b.*PCIe", {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.0}),
    (r"\bH100\b", {"bf16": 989.0, "fp16": 989.0, "tf32": 494.5, "fp32": 67.0}),   # SXM (HBM3)
    (r"\bH200\b", {"bf16": 989.0, "fp16": 989.0, "tf32": 494.5, "fp32": 67.0}),   # SXM
    (r"\bA100\b", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),   # SXM and PCIe
    (r"\bA10\b", {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}),     # not A10G, not A100
    (r"\bL4\b", {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),      # not L40/L40S
    (r"\bV100\b.*PCIE", {"fp16": 112.0, "fp32": 14.0}),                           # no bf16 / tf32
    (r"\bV100", {"fp16": 125.0, "fp32": 15.7}),                                   # SXM2
    (r"\bMI250X\b", {"bf16": 383.0, "fp16": 383.0, "fp32": 95.7}),                # fp32 on matrix cores
    (r"\bMI300X\b", {"bf16": 1307.4, "fp16": 1307.4, "tf32": 653.7, "fp32": 163.4}),
)


def forward_flops_per_token(config: ModelConfig) -> int:
    """Forward-pass FLOPs per token of the transformer described by ``config`` (formula in the module doc)."""
    if config.padded_vocab_size is None:
        raise ValueError("padded_vocab_size is not set yet: build the tokenizer before computing FLOPs, or set "
                         "padded_vocab_size")
    return sum(layer_flops_per_token(config)) + 2 * config.hidden_size * config.padded_vocab_size


def layer_flops_per_token(config: ModelConfig) -> List[int]:
    """Forward FLOPs per token of each layer, in order."""
    per_type = {"mamba": mamba_layer_flops, "rwkv": rwkv_layer_flops}
    types = config.attention_types or ("global",) * config.num_layers
    return [per_type[kind](config) if kind in per_type else gmlp_layer_flops(config, layer)
            if kind in ("gmlp", "amlp") else attention_layer_flops(config, layer)
            for layer, kind in enumerate(types)]


def block_recomputed_layers(config: ModelConfig, first: int) -> List[int]:
    """The layers recompute_method 'block' checkpoints: the first ``first`` of each pipeline stage, the layers
    split evenly over the stages (as the default partition method balances them)."""
    stages = max(config.pipe_parallel_size, 1)
    bounds = [config.num_layers * stage // stages for stage in range(stages + 1)]
    return [layer for start, end in zip(bounds, bounds[1:]) for layer in range(start, min(start + first, end))]


def gmlp_layer_flops(config: ModelConfig, layer: int) -> int:
    """Forward FLOPs per token of a gMLP / aMLP layer (megatron.observability.flops' convention: 2 per multiply-add, the
    causal spatial mix counted as the full s x s square)."""
    h, s, d = config.hidden_size, config.seq_length, config.gmlp_attn_dim
    ff = GMLP_FF_MULT * h
    flops = 2 * h * 2 * ff + 2 * s * ff + 2 * ff * h
    if config.attention_types[layer] == "amlp":
        flops += 2 * 2 * ff * 3 * d + 2 * 2 * s * d + 2 * d * ff
    return flops


def attention_layer_flops(config: ModelConfig, layer: int = 0) -> int:
    """Forward FLOPs per token of transformer layer number ``layer`` (attention + its MLP, dense or MoE)."""
    h, s, heads, head = config.hidden_size, config.seq_length, config.num_attention_heads, config.head_dim
    qkv = 2 * h * (heads * head + 2 * config.kv_heads * head)
    attention = 2 * s * h + 2 * s * h
    dense = 2 * h * h
    mlp = 2 * h * config.ffn_width * (3 if config.gated_mlp else 2)
    mlp = moe_mlp_flops_per_token(config) if layer in config.moe_layers else mlp
    return qkv + attention + dense + mlp


def moe_mlp_flops_per_token(config: ModelConfig) -> int:
    """Forward FLOPs per token of one MoE MLP: the router (2 h E) and the k experts the token reaches (active
    parameters only), each 2 h F x 3 (GLU experts) or x 2 (plain), F = expert_ffn_width."""
    h, experts, k = config.hidden_size, config.moe_num_experts, config.moe_top_k
    glu = config.expert_activation in GATED_ACTIVATIONS
    expert = 2 * h * config.expert_ffn_width * (3 if glu else 2)
    residual = expert + 2 * h * 2 if config.moe_type == "deepspeed" and config.moe_use_residual else 0
    return 2 * h * experts + k * expert + residual


def mamba_scan_flops(config: ModelConfig) -> int:
    """The selective scan's share of a Mamba layer: 6 D N (module docstring)."""
    return 6 * config.mamba_inner * MAMBA_STATE_SIZE


def mamba_layer_flops(config: ModelConfig) -> int:
    """Forward FLOPs per token of one Mamba layer (module docstring)."""
    h, d, r, n, k = config.hidden_size, config.mamba_inner, config.mamba_dt_rank, MAMBA_STATE_SIZE, MAMBA_CONV_WIDTH
    projections = 2 * h * 2 * d + 2 * d * (r + 2 * n) + 2 * r * d + 2 * d * h
    return projections + 2 * k * d + mamba_scan_flops(config)


def rwkv_wkv_flops(config: ModelConfig) -> int:
    """The WKV recurrence's share of an RWKV layer: 5 A N (module docstring)."""
    return 5 * config.rwkv_dim_att * config.rwkv_head_size


def rwkv_layer_flops(config: ModelConfig) -> int:
    """Forward FLOPs per token of one RWKV layer (module docstring)."""
    c, a, f = config.hidden_size, config.rwkv_dim_att, config.rwkv_ffn_dim
    shift = 2 * c * 5 * TIME_MIX_EXTRA_DIM + 5 * 2 * TIME_MIX_EXTRA_DIM * c
    projections = 4 * 2 * c * a + 2 * a * c
    decay = 2 * c * TIME_DECAY_EXTRA_DIM + 2 * TIME_DECAY_EXTRA_DIM * a
    channel_mix = 2 * c * f + 2 * f * c + 2 * c * c
    return shift + projections + decay + rwkv_wkv_flops(config) + channel_mix


def training_flops_per_token(config: ModelConfig) -> int:
    """3 x forward (forward + backward), or 4 x forward when activations are recomputed
    (checkpoint_activations); with recompute_method 'block', 3 x forward plus the forward of the layers it
    checkpoints; with recompute_granularity 'selective', 3 x forward plus the attention core
    (the two s x s products, 4 s h per token) of every attention layer once more."""
    first = config.recompute_block_layers
    if first is not None:
        layers = layer_flops_per_token(config)
        return 3 * forward_flops_per_token(config) + sum(layers[i] for i in block_recomputed_layers(config, first))
    if config.checkpoint_activations:
        return 4 * forward_flops_per_token(config)
    extra = 0
    if config.recompute_granularity == "selective":
        types = config.attention_types or ("global",) * config.num_layers
        extra = sum(4 * config.seq_length * config.hidden_size for kind in types if kind not in ("mamba", "rwkv"))
    return 3 * forward_flops_per_token(config) + extra


def tflops_per_device(flops_per_token: float, tokens_per_second: float, num_devices: int) -> float:
    """Achieved TFLOP/s of each device: all devices together process `tokens_per_second` tokens."""
    if num_devices < 1:
        raise ValueError(f"num_devices must be >= 1, got {num_devices}")
    return flops_per_token * tokens_per_second / num_devices / 1e12


def peak_dtype(precision: str, allow_tf32: bool = False) -> str:
    """The peak-table column for neox_args.precision ('fp32' becomes 'tf32' when TF32 matmuls are on)."""
    table = {"fp16": "fp16", "bfloat16": "bf16", "bf16": "bf16", "fp32": "tf32" if allow_tf32 else "fp32"}
    if precision not in table:
        raise ValueError(f"precision {precision!r} is not one of fp32, fp16, bfloat16")
    return table[precision]


def lookup_peak_tflops(device_name: str, dtype: str) -> Optional[float]:
    """Dense peak TFLOP/s of a device (by its CUDA/ROCm name) for a dtype; None if unknown or unsupported."""
    for pattern, peaks in DEVICE_PEAK_TFLOPS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return peaks.get(dtype)
    return None


def _cuda_tf32_enabled() -> bool:
    return bool(torch.backends.cuda.matmul.allow_tf32)


def peak_tflops(precision: str, override: Optional[float] = None, device_name: Optional[str] = None) -> Optional[float]:
    """Peak TFLOP/s per device for MFU: `override`, else $NEOX_PEAK_TFLOPS, else the table entry for this
    process's CUDA device (or `device_name`). None on CPU, and for devices or dtypes not in the table."""
    if override is not None:
        if override <= 0:
            raise ValueError(f"peak TFLOP/s override must be positive, got {override}")
        return float(override)
    env = os.environ.get(PEAK_ENV_VAR)
    if env:
        try:
            value = float(env)
        except ValueError:
            raise ValueError(f"{PEAK_ENV_VAR}={env!r} is not a number (peak dense TFLOP/s of one device)") from None
        if value <= 0:
            raise ValueError(f"{PEAK_ENV_VAR}={env!r} must be positive")
        return value
    allow_tf32 = False
    if device_name is None:
        if not torch.cuda.is_available():
            return None  # CPU: MFU is not applicable
        device_name = torch.cuda.get_device_name()
        allow_tf32 = _cuda_tf32_enabled()
    return lookup_peak_tflops(device_name, peak_dtype(precision, allow_tf32))


def mfu(achieved_tflops_per_device: float, peak: Optional[float]) -> Optional[float]:
    """Model FLOPs utilisation in [0, 1] (achieved / peak), None when there is no peak (CPU, unknown device)."""
    if peak is None:
        return None
    return achieved_tflops_per_device / peak
