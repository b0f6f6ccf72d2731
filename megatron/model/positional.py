"""Positional encodings: rotary (rotate-half, as Hugging Face GPT-NeoX), sinusoidal, ALiBi slopes and
biases, and T5-style relative position buckets (rpe).

Positions are absolute token indices, so the same code serves a full forward and incremental
decoding with a KV cache (queries start at the cache's length).
"""
from __future__ import annotations

import math
from typing import Any, List, Mapping, Optional, Tuple

import torch
from torch import nn

from megatron.mpu import shard_of


class RotaryEmbedding(nn.Module):
    """cos/sin tables for rotary embeddings on the first ``rot_dim`` channels of each head.

    The tables are computed once, in fp32, for positions 0 .. ``max_positions`` - 1 and kept outside the
    module's buffers: ``model.to(bfloat16)`` must not round the angles (at position 2000 a bf16 inverse
    frequency is off by whole radians), and slicing a table costs nothing per layer and decoded token.
    ``inv_freq`` is a non-persistent buffer; with rotary_save_freqs_buffer the attention layer writes it
    into checkpoints as GPT-NeoX does (``attention.rotary_emb.inv_freq``)."""

    def __init__(self, rot_dim: int, base: float, max_positions: int = 0,
                 scaling: Optional[Mapping[str, Any]] = None) -> None:
        super().__init__()
        if rot_dim % 2 != 0 or rot_dim <= 0:
            raise ValueError(f"rotary dimension (head size x rotary_pct) must be even and > 0, got {rot_dim}")
        self.rot_dim, self.base, self.scaling, self.max_positions = rot_dim, base, scaling, max_positions
        inv_freq, self.attention_factor = rotary_frequencies(rot_dim, base, scaling, max_positions)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._inv_freq_fp32 = inv_freq.clone()
        self._cos, self._sin = self._angles(torch.arange(max_positions), inv_freq)

    def _angles(self, positions: torch.Tensor, inv_freq: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float32).unsqueeze(-1) * inv_freq.to(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        if self.attention_factor != 1.0:  # YaRN: Hugging Face scales cos and sin, so q.k by its square
            return emb.cos() * self.attention_factor, emb.sin() * self.attention_factor
        return emb.cos(), emb.sin()

    def forward(self, positions: torch.Tensor, end: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [len(positions), rot_dim] in fp32; ``end``: the length of the sequence the positions
        belong to (dynamic NTK scaling's frequencies depend on it past max_position_embeddings, as Hugging
        Face's: a forward computes them for its own last position + 1)."""
        inv_freq = self._inv_freq_fp32
        if end is not None and end > self.max_positions and (self.scaling or {}).get("rope_type") == "dynamic":
            inv_freq, _ = rotary_frequencies(self.rot_dim, self.base, self.scaling, self.max_positions, end)
        return self._angles(positions, inv_freq)

    def tables(self, offset: int, length: int, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [length, rot_dim] (fp32) for positions offset .. offset + length - 1."""
        if offset + length > self._cos.size(0):
            return self.forward(torch.arange(offset, offset + length, device=device), offset + length)
        if self._cos.device != device:
            self._cos, self._sin = self._cos.to(device), self._sin.to(device)
        return self._cos[offset:offset + length], self._sin[offset:offset + length]

    def tables_at(self, positions: torch.Tensor, end: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [len(positions), rot_dim] (fp32) for arbitrary positions (a context-parallel rank's chunks),
        all below ``end``: the caller knows that bound on the host (the sequence's length), so the choice between
        the table and computing the angles never reads ``positions`` back from the device."""
        if end > self._cos.size(0):
            return self.forward(positions, end)
        if self._cos.device != positions.device:
            self._cos, self._sin = self._cos.to(positions.device), self._sin.to(positions.device)
        return self._cos[positions], self._sin[positions]


def rotary_inv_freq(rot_dim: int, base: float) -> torch.Tensor:
    """The rotary inverse frequencies base^(-2i / rot_dim), fp32 (GPT-NeoX's RotaryEmbedding.inv_freq)."""
    return 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))


def rotary_frequencies(rot_dim: int, base: float, scaling: Optional[Mapping[str, Any]], positions: int,
                       seq_len: Optional[int] = None) -> Tuple[torch.Tensor, float]:
    """(inverse frequencies fp32, attention factor) of rotary embeddings with Hugging Face's RoPE scaling
    ``scaling`` (megatron.model.rope_scaling; None: plain rotary), computed as transformers'
    modeling_rope_utils.ROPE_INIT_FUNCTIONS do (tests compare them). ``positions``: the model's
    max_position_embeddings; ``seq_len``: the sequence length dynamic NTK scaling is computed for."""
    if not scaling:
        return rotary_inv_freq(rot_dim, base), 1.0
    kind, factor = scaling["rope_type"], float(scaling["factor"])
    if kind == "linear":
        return rotary_inv_freq(rot_dim, base) / factor, 1.0
    if kind == "dynamic":
        seq = max(seq_len or positions, positions)
        scaled_base = base * ((factor * seq / positions) - (factor - 1)) ** (rot_dim / (rot_dim - 2))
        return rotary_inv_freq(rot_dim, scaled_base), 1.0
    if kind == "llama3":
        return _llama3_inv_freq(rot_dim, base, scaling), 1.0
    if kind == "yarn":
        return _yarn_frequencies(rot_dim, base, scaling, positions)
    raise ValueError(f"rope_scaling.rope_type={kind!r} is not implemented")


def _llama3_inv_freq(rot_dim: int, base: float, scaling: Mapping[str, Any]) -> torch.Tensor:
    """Llama 3.1's scaling: long wavelengths divided by factor, short ones kept, a smooth blend between."""
    inv_freq = rotary_inv_freq(rot_dim, base)
    factor, low, high = (float(scaling[k]) for k in ("factor", "low_freq_factor", "high_freq_factor"))
    old_context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_context / high) * ~(wavelen > old_context / low)
    return torch.where(medium, blended, scaled)


def _yarn_frequencies(rot_dim: int, base: float, scaling: Mapping[str, Any], positions: int
                      ) -> Tuple[torch.Tensor, float]:
    """YaRN (Peng et al. 2023): interpolated and extrapolated frequencies ramped between the dimensions that turn
    beta_slow and beta_fast times over the original context, and its attention factor."""
    factor = float(scaling["factor"])
    original = int(scaling.get("original_max_position_embeddings") or positions)

    def mscale(scale: float, weight: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * weight * math.log(scale) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        if scaling.get("mscale") and scaling.get("mscale_all_dim"):
            attention = mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"])
        else:
            attention = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (rot_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(scaling.get("beta_fast") or 32), correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rot_dim - 1)
    if low == high:
        high += 0.001  # as Hugging Face: no division by zero
    ramp = torch.clamp((torch.arange(rot_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    pos_freqs = base ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention)


def sinusoidal_inv_freq(dim: int, base: float = 10000.0) -> torch.Tensor:
    """The sinusoidal embedding's inverse frequencies, fp32 (GPT-NeoX's SinusoidalPositionalEmbedding.inv_freq)."""
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.size(-1)`` channels of ``x`` [b, heads, s, d]; the rest pass through."""
    rot_dim = cos.size(-1)
    rot, rest = x[..., :rot_dim], x[..., rot_dim:]
    rotated = (rot.float() * cos + rotate_half(rot.float()) * sin).to(x.dtype)
    return torch.cat((rotated, rest), dim=-1) if rest.size(-1) else rotated


def sinusoidal_embedding(positions: torch.Tensor, dim: int, base: float = 10000.0) -> torch.Tensor:
    """[..., dim] embedding: sin of the position frequencies, then cos (Vaswani et al.)."""
    angles = positions.float().unsqueeze(-1) * sinusoidal_inv_freq(dim, base).to(positions.device)
    return torch.cat((angles.sin(), angles.cos()), dim=-1)[..., :dim]


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """ALiBi head slopes (Press et al.): a geometric sequence from 2^(-8/n); for a head count that is
    not a power of two, the closest power's slopes plus every other slope of the next power."""
    def power_of_two(n: int) -> List[float]:
        start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
        return [start * start ** i for i in range(n)]

    if math.log2(num_heads).is_integer():
        slopes = power_of_two(num_heads)
    else:
        closest = 2 ** math.floor(math.log2(num_heads))
        slopes = power_of_two(closest) + power_of_two(2 * closest)[0::2][: num_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32)


def alibi_bias(slopes: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """[heads, q, k] additive bias -slope * (q_pos - k_pos)."""
    distance = (q_pos.unsqueeze(-1) - k_pos.unsqueeze(0)).float()
    return -slopes.view(-1, 1, 1) * distance


def relative_position_bucket(relative: torch.Tensor, num_buckets: int, max_distance: int) -> torch.Tensor:
    """Causal T5 bucket of ``relative`` = k_pos - q_pos (only <= 0 matters): exact buckets for small
    distances, logarithmic ones up to ``max_distance``."""
    n = (-relative).clamp(min=0)
    max_exact = num_buckets // 2
    is_small = n < max_exact
    large = max_exact + (
        torch.log(n.float().clamp(min=1) / max_exact) / math.log(max_distance / max_exact)
        * (num_buckets - max_exact)
    ).long()
    large = large.clamp(max=num_buckets - 1)
    return torch.where(is_small, n, large)


class RelativePositionBias(nn.Module):
    """T5-style relative position bias as GPT-NeoX's ParallelRelativePositionBias: a learned table ``weight``
    [num_buckets, this rank's heads] (the heads split over tensor-parallel ranks), looked up by the causal
    bucket of each query-key distance and scaled by sqrt(head_dim). The model builds one and shares it
    between all its layers, as GPT-NeoX does."""

    def __init__(self, num_buckets: int, max_distance: int, heads: int, head_dim: int, tp_rank: int, tp: int,
                 init_fn) -> None:
        super().__init__()

        self.num_buckets, self.max_distance = num_buckets, max_distance
        self.scale = math.sqrt(head_dim)
        self.weight = nn.Parameter(torch.empty(num_buckets, heads // tp))
        with torch.no_grad():
            full = torch.empty(num_buckets, heads)
            init_fn(full)
            self.weight.copy_(shard_of(full, 1, tp_rank, tp))
        self.weight.model_parallel = tp > 1
        self.weight.partition_dim = 1

    def forward(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """[this rank's heads, q, k] additive bias."""
        buckets = relative_position_bucket(k_pos.unsqueeze(0) - q_pos.unsqueeze(-1), self.num_buckets,
                                           self.max_distance)
        return self.weight[buckets].permute(2, 0, 1) * self.scale
