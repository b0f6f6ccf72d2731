"""RWKV layers (attention_config type 'rwkv'): GPT-NeoX's RWKV-6 ("Finch") block in PyTorch, tensor-parallel,
with a chunked parallel time mix for training and the recurrence for decoding.

Block (GPT-NeoX's ``RWKVResidualLayer``; layer 0 first normalises its input with ``ln1``, in place of RWKV's
``ln0``)::

    x = drop_a(x + att(ln1(x)))        # attention_dropout, on the sum as in GPT-NeoX
    x = drop_h(x + ffn(ln2(x)))        # hidden_dropout

ln1 / ln2 are LayerNorms (eps 1e-5) whatever ``norm`` says, as in GPT-NeoX. With C = hidden_size, A =
``rwkv_dim_att`` split into H = num_attention_heads heads of N = ``rwkv_head_size``, F = ``rwkv_ffn_dim``,
and ``shift(x)_t = x_{t-1}`` (zero before the first token)::

    time mix (att):   dx = shift(x) - x
                      m_w, m_k, m_v, m_r, m_g = tanh((x + dx * maa_x) @ maa_w1) @ maa_w2      (5 x [b, s, C])
                      x_* = x + dx * (maa_* + m_*)
                      r, k, v = receptance(x_r), key(x_k), value(x_v);  g = silu(gate(x_g))  [b, s, A]
                      w = time_decay + tanh(x_w @ decay_w1) @ decay_w2;  decay = exp(-exp(w))
                      per head, state S [N, N]:  y_t = r_t (S + diag(u) k_t^T v_t),
                                                 S   = diag(decay_t) S + k_t^T v_t     (u = time_faaaa)
                      out = output(GroupNorm_H(y) * g)
    channel mix (ffn): k = relu(key(x + dx * maa_k))^2;  out = sigmoid(receptance(x + dx * maa_r)) * value(k)

Parameter names, shapes and their initial values (the layer-dependent time-mix, decay and bonus tables) are
GPT-NeoX's; the linear layers start from the config's init_method (output and ffn.value from
output_layer_init_method) where GPT-NeoX keeps torch's default.

Training runs ``wkv_chunked``: the sequence in chunks of ``WKV_CHUNK`` steps; inside a chunk the output is a
masked [T, T] product whose decays exp(sum_{tau < j < t} log w_j) are cumulative sums of log decays taken over
each span directly (all <= 0, so nothing overflows at any decay speed, and no difference of two large sums
loses precision), and the state passes from chunk to chunk. It equals
``wkv_recurrent`` (the definition, also the decoding step), which tests check.

Tensor parallelism: heads are split across ranks (receptance, key, value, gate column-parallel; output
row-parallel; time_decay, decay_w2's columns, time_faaaa and ln_x hold the rank's channels); the channel mix's
key is column- and value row-parallel. The time-mix tables over C (maa_*, maa_w1 / w2, decay_w1) and the
channel mix's receptance are replicated: each rank computes them from the replicated input, and the
gradients reaching them from the rank's heads are summed over the ranks (copy_to_model_parallel_region).

Decoding (``KVCache``): each layer keeps (last ln1 output [b, C], WKV state [b, H_local, N, N], last ln2
output [b, C]); left-padded slots are zeroed after the norms, which keeps the zero state and a zero token
shift, as if the row started at its first real token.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from megatron.model.checkpoint_layout import RWKV_LAYER, install_hooks
from megatron.model.config import ModelConfig
from megatron.model.kv_cache import KVCache
from megatron.model.norms import LayerNorm
from megatron.model.recurrent_common import hidden_dropout, pad_mask
from megatron.mpu import ColumnParallelLinear, RowParallelLinear, copy_to_model_parallel_region, shard_of
from megatron.mpu.layers import _fill_shard

WKV_CHUNK = 16
"""Time steps per chunk of the parallel time mix."""
TIME_MIX_EXTRA_DIM, TIME_DECAY_EXTRA_DIM = 32, 64
"""Ranks of the data-dependent token-shift and decay projections (GPT-NeoX's RWKV-6)."""
LN_X_EPS = 1e-5 * 8 ** 2
LN_EPS = 1e-5


# --------------------------------------------------------------------------------------------------
# WKV: the recurrence and its chunked form. r, k, v, log_decay: [b, H, s, N]; u [H, N]; state [b, H, N, N]
# --------------------------------------------------------------------------------------------------
def wkv_recurrent(r: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor, u: torch.Tensor,
                  state: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(y [b, H, s, N], last state) one step at a time (fp32): the definition, and the decoding step."""
    r, k, v, log_decay, u = r.float(), k.float(), v.float(), log_decay.float(), u.float()
    b, h, s, n = r.shape
    state = state.float() if state is not None else r.new_zeros(b, h, n, n)
    ys = []
    for t in range(s):
        kv = k[:, :, t, :, None] * v[:, :, t, None, :]                       # [b, H, N, N]
        ys.append(torch.einsum("bhi,bhij->bhj", r[:, :, t], state + u[..., None] * kv))
        state = torch.exp(log_decay[:, :, t, :, None]) * state + kv
    y = torch.stack(ys, dim=2) if ys else r.new_zeros(b, h, 0, n)
    return y, state


def wkv_chunked(r: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor, u: torch.Tensor,
                state: Optional[torch.Tensor] = None, chunk: int = WKV_CHUNK) -> Tuple[torch.Tensor, torch.Tensor]:
    """The same function as ``wkv_recurrent``, chunk-parallel (see module docstring); fp32."""
    r, k, v, log_decay, u = r.float(), k.float(), v.float(), log_decay.float(), u.float()
    b, h, s, n = r.shape
    state = state.float() if state is not None else r.new_zeros(b, h, n, n)
    if s == 0:
        return r.new_zeros(b, h, 0, n), state
    pad = -s % chunk  # trailing steps with k = v = 0 and decay 1 change neither outputs nor the state
    if pad:
        r, k, v, log_decay = (F.pad(t, (0, 0, 0, pad)) for t in (r, k, v, log_decay))
    c = (s + pad) // chunk
    r, k, v, log_decay = (t.reshape(b, h, c, chunk, n) for t in (r, k, v, log_decay))
    # Every sum of log decays below is summed directly, never the difference of two cumulative sums: with fast
    # decays those reach -1e4 and their difference would lose ~1e-3 of its value to fp32 rounding.
    earlier = F.pad(log_decay[:, :, :, :-1], (0, 0, 1, 0))                     # x_{t-1} (0 at t = 0)
    excl = earlier.cumsum(dim=3)                                               # L_{t-1} = sum_{j < t} x_j
    later = F.pad(log_decay[:, :, :, 1:], (0, 0, 0, 1))                        # x_{tau+1} (0 at the end)
    after = later.flip(3).cumsum(dim=3).flip(3)                                # L_T - L_tau = sum_{j > tau} x_j
    # within a chunk: y_t = sum_{tau < t} (r_t exp(sum_{tau < j < t} x_j) . k_tau) v_tau + (r_t u . k_t) v_t,
    # the inner sums as a cumulative sum over t of x_{t-1} where t - 1 > tau
    between = earlier.unsqueeze(4).expand(b, h, c, chunk, chunk, n)            # [b, H, c, t, tau, N]
    strictly_between = torch.ones(chunk, chunk, dtype=torch.bool, device=r.device).tril(-2)
    between = between.masked_fill(~strictly_between[:, :, None], 0.0).cumsum(dim=3)
    past = torch.ones(chunk, chunk, dtype=torch.bool, device=r.device).tril(-1)
    decay = torch.exp(between.masked_fill(~past[:, :, None], float("-inf")))
    scores = (r.unsqueeze(4) * decay * k.unsqueeze(3)).sum(-1)                 # [b, H, c, t, tau]
    scores = scores + torch.diag_embed((r * u[:, None, None] * k).sum(-1))
    y = scores @ v                                                             # [b, H, c, T, N]
    # from chunk to chunk: S' = diag(exp(L_T)) S + sum_tau (k_tau exp(L_T - L_tau))^T v_tau
    total = log_decay.sum(dim=3)                                               # L_T: [b, H, c, N]
    added = torch.einsum("bhcti,bhctj->bhcij", k * torch.exp(after), v)
    kept = torch.exp(total).unsqueeze(-1)                                      # [b, H, c, N, 1]
    starts = []
    for index in range(c):
        starts.append(state)
        state = kept[:, :, index] * state + added[:, :, index]
    y = y + torch.einsum("bhcti,bhcij->bhctj", r * torch.exp(excl), torch.stack(starts, dim=2))
    return y.reshape(b, h, c * chunk, n)[:, :, :s], state


# --------------------------------------------------------------------------------------------------
# Modules
# --------------------------------------------------------------------------------------------------
def _ratios(layer_number: int, num_layers: int) -> Tuple[float, float]:
    """GPT-NeoX's (ratio_0_to_1, ratio_1_to_almost0) of a layer, which shape its initial tables."""
    return layer_number / max(num_layers - 1, 1), 1.0 - layer_number / num_layers


def _channel_ramp(size: int) -> torch.Tensor:
    return (torch.arange(size, dtype=torch.float32) / size).view(1, 1, size)


def _uniform(bound: float):
    return lambda t, g: torch.nn.init.uniform_(t, -bound, bound, generator=g)


def _param(full: torch.Tensor, dim: Optional[int], rank: int, tp: int) -> nn.Parameter:
    """A parameter holding ``full`` (dim None: replicated) or this rank's slice of it along ``dim``."""
    param = nn.Parameter(full.clone() if dim is None else shard_of(full, dim, rank, tp).clone())
    param.model_parallel = dim is not None and tp > 1
    return param


class RWKVTimeMix(nn.Module):
    """RWKV-6's time mix (the attention substitute) over this rank's heads."""

    def __init__(self, config: ModelConfig, parallel_state, initializer, layer_number: int) -> None:
        super().__init__()
        tp, rank = parallel_state.get_model_parallel_world_size(), parallel_state.get_model_parallel_rank()
        self.group = parallel_state.get_model_parallel_group() if tp > 1 else None
        hidden, dim, heads = config.hidden_size, config.rwkv_dim_att, config.num_attention_heads
        self.local_heads, self.head_size = heads // tp, config.rwkv_head_size
        ratio_0_to_1, ratio_1_to_almost0 = _ratios(layer_number, config.num_layers)
        ramp = _channel_ramp(hidden)
        with torch.no_grad():
            shift = 1.0 - torch.pow(ramp, ratio_1_to_almost0)
            half = 1.0 - torch.pow(ramp, 0.5 * ratio_1_to_almost0)
            self.time_maa_x = _param(shift, None, rank, tp)
            self.time_maa_w = _param(shift, None, rank, tp)
            self.time_maa_k = _param(shift, None, rank, tp)
            self.time_maa_v = _param(1.0 - (torch.pow(ramp, ratio_1_to_almost0) + 0.3 * ratio_0_to_1), None, rank, tp)
            self.time_maa_r = _param(half, None, rank, tp)
            self.time_maa_g = _param(half, None, rank, tp)
            self.time_maa_w1 = self._seeded(initializer, layer_number, "att.time_maa_w1",
                                            (hidden, TIME_MIX_EXTRA_DIM * 5), None, rank, tp)
            self.time_maa_w2 = self._seeded(initializer, layer_number, "att.time_maa_w2",
                                            (5, TIME_MIX_EXTRA_DIM, hidden), None, rank, tp)
            n = torch.arange(dim, dtype=torch.float32) / max(dim - 1, 1)
            decay_speed = -6 + 5 * n ** (0.7 + 1.3 * ratio_0_to_1)
            self.time_decay = _param(decay_speed.view(1, 1, dim), 2, rank, tp)
            self.time_decay_w1 = self._seeded(initializer, layer_number, "att.time_decay_w1",
                                              (hidden, TIME_DECAY_EXTRA_DIM), None, rank, tp)
            self.time_decay_w2 = self._seeded(initializer, layer_number, "att.time_decay_w2",
                                              (TIME_DECAY_EXTRA_DIM, dim), 1, rank, tp)
            zigzag = ((torch.arange(dim) + 1) % 3 - 1).float() * 0.1
            bonus = ratio_0_to_1 * (1 - n) + zigzag
            self.time_faaaa = _param(bonus.view(heads, self.head_size), 0, rank, tp)

        def column(name: str) -> ColumnParallelLinear:
            return ColumnParallelLinear(hidden, dim, parallel_state, initializer.weight(layer_number, name), bias=False)

        self.receptance, self.key, self.value = column("att.receptance"), column("att.key"), column("att.value")
        self.output = RowParallelLinear(dim, hidden, parallel_state,
                                        initializer.output_weight(layer_number, "att.output"), bias=False)
        self.gate = column("att.gate")
        self.ln_x = nn.GroupNorm(self.local_heads, dim // tp, eps=LN_X_EPS)
        for param in self.ln_x.parameters():
            param.model_parallel = tp > 1

    @staticmethod
    def _seeded(initializer, layer_number: int, name: str, shape, dim: Optional[int], rank: int, tp: int):
        full = torch.empty(shape)
        initializer.custom(layer_number, name, _uniform(1e-4))(full)  # GPT-NeoX's U(-1e-4, 1e-4)
        return _param(full, dim, rank, tp)

    def forward(self, x: torch.Tensor, previous: Optional[torch.Tensor], state: Optional[torch.Tensor]
                ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(output [b, s, C], last input [b, C], WKV state) from x [b, s, C] (ln1's output) and the state."""
        b, s, hidden = x.shape
        dx = _shift(x, previous) - x
        mixed = torch.tanh((x + dx * self.time_maa_x) @ self.time_maa_w1)                    # [b, s, 5 * 32]
        mixed = torch.einsum("bsfe,fec->fbsc", mixed.view(b, s, 5, TIME_MIX_EXTRA_DIM), self.time_maa_w2)
        m_w, m_k, m_v, m_r, m_g = mixed.unbind(0)
        r = self.receptance(x + dx * (self.time_maa_r + m_r))
        k = self.key(x + dx * (self.time_maa_k + m_k))
        v = self.value(x + dx * (self.time_maa_v + m_v))
        g = F.silu(self.gate(x + dx * (self.time_maa_g + m_g)))
        x_w = x + dx * (self.time_maa_w + m_w)
        low_rank = copy_to_model_parallel_region(torch.tanh(x_w @ self.time_decay_w1), self.group)
        w = self.time_decay + low_rank @ self.time_decay_w2                                  # [b, s, A_local]
        heads = lambda t: t.float().view(b, s, self.local_heads, self.head_size).transpose(1, 2)  # noqa: E731
        wkv = wkv_chunked if s > 1 else wkv_recurrent
        y, state = wkv(heads(r), heads(k), heads(v), -torch.exp(heads(w)), self.time_faaaa, state)
        y = y.transpose(1, 2).reshape(b * s, -1)                                             # [b * s, A_local]
        y = self.ln_x(y.to(x.dtype)).view(b, s, -1)
        return self.output(y * g), x[:, -1], state


class RWKVChannelMix(nn.Module):
    """RWKV's channel mix (the MLP substitute): squared-ReLU key, sigmoid receptance gate."""

    def __init__(self, config: ModelConfig, parallel_state, initializer, layer_number: int) -> None:
        super().__init__()
        tp, rank = parallel_state.get_model_parallel_world_size(), parallel_state.get_model_parallel_rank()
        hidden, ffn = config.hidden_size, config.rwkv_ffn_dim
        _, ratio_1_to_almost0 = _ratios(layer_number, config.num_layers)
        with torch.no_grad():
            shift = 1.0 - torch.pow(_channel_ramp(hidden), ratio_1_to_almost0)
            self.time_maa_k = _param(shift, None, rank, tp)
            self.time_maa_r = _param(shift, None, rank, tp)
        self.key = ColumnParallelLinear(hidden, ffn, parallel_state, initializer.weight(layer_number, "ffn.key"),
                                        bias=False)
        self.receptance = nn.Linear(hidden, hidden, bias=False)  # replicated: its gate multiplies the full output
        _fill_shard(self.receptance.weight, (hidden, hidden), initializer.weight(layer_number, "ffn.receptance"), 0,
                    0, 1)
        self.value = RowParallelLinear(ffn, hidden, parallel_state,
                                       initializer.output_weight(layer_number, "ffn.value"), bias=False)

    def forward(self, x: torch.Tensor, previous: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        """(output [b, s, C], last input [b, C]) from x [b, s, C] (ln2's output)."""
        dx = _shift(x, previous) - x
        k = torch.relu(self.key(x + dx * self.time_maa_k)) ** 2
        return torch.sigmoid(self.receptance(x + dx * self.time_maa_r)) * self.value(k), x[:, -1]


def _shift(x: torch.Tensor, previous: Optional[torch.Tensor]) -> torch.Tensor:
    """x shifted one step later in time: x_{t-1}, with ``previous`` (or zeros) before the first step."""
    first = previous.to(x.dtype).unsqueeze(1) if previous is not None else torch.zeros_like(x[:, :1])
    return torch.cat([first, x[:, :-1]], dim=1)


class RWKVResidualLayer(nn.Module):
    """GPT-NeoX's RWKV layer (see module docstring), called with (hidden, mask) like every block."""

    def __init__(self, config: ModelConfig, parallel_state, initializer, layer_number: int, rng_tracker,
                 rpe=None) -> None:
        super().__init__()
        self.layer_number = layer_number
        self.ln1 = LayerNorm(config.hidden_size, LN_EPS)
        self.ln2 = LayerNorm(config.hidden_size, LN_EPS)
        self.att = RWKVTimeMix(config, parallel_state, initializer, layer_number)
        self.ffn = RWKVChannelMix(config, parallel_state, initializer, layer_number)
        self.attention_dropout, self.hidden_dropout = config.attention_dropout, config.hidden_dropout
        install_hooks(self, RWKV_LAYER, config, parallel_state)

    def forward(self, args: Tuple[torch.Tensor, Optional[torch.Tensor]], kv_cache: Optional[KVCache] = None):
        x, mask = args  # the attention mask is not read: the recurrence is causal by construction
        pads = pad_mask(kv_cache, x)
        state = kv_cache.recurrent_state(self.layer_number) if kv_cache is not None else None
        att_prev, wkv_state, ffn_prev = state if state is not None else (None, None, None)
        if self.layer_number == 0:
            x = self.ln1(x)
        att, att_prev, wkv_state = self.att(_zero_pads(self.ln1(x), pads), att_prev, wkv_state)
        x = hidden_dropout(x + att, self.attention_dropout, self.training)
        ffn, ffn_prev = self.ffn(_zero_pads(self.ln2(x), pads), ffn_prev)
        x = hidden_dropout(x + ffn, self.hidden_dropout, self.training)
        if kv_cache is not None:
            kv_cache.set_recurrent_state(self.layer_number, (att_prev, wkv_state, ffn_prev))
        return x, mask


def _zero_pads(x: torch.Tensor, pads: Optional[torch.Tensor]) -> torch.Tensor:
    return x if pads is None else x.masked_fill(pads.unsqueeze(-1), 0.0)
