"""Mamba layers (attention_config type 'mamba'): GPT-NeoX's pre-norm residual block around a selective
state-space mixer (Gu & Dao, 2023, Algorithm 2), in pure PyTorch, tensor-parallel, with O(1) decoding.

Block: ``x + drop(mixer(norm(x)))`` (``norm`` is the config's norm; hidden_dropout on the mixer's output).
Mixer, for one token stream (d = the inner width ``mamba_inner``, n = 16 state channels, k = 4 conv width,
r = ``mamba_dt_rank``)::

    x, z   = in_proj(h).chunk(2)                 # [b, s, d] each (in_proj's rows are [x | z])
    x      = silu(conv1d(x))                     # causal depthwise conv of width k over time
    dt, B, C = x_proj(x).split([r, n, n])        # data-dependent step and input/output maps
    dt     = softplus(dt_proj.weight @ dt + dt_proj.bias)       # [b, s, d]
    h_t    = exp(dt_t A) * h_{t-1} + dt_t B_t x_t                # state [b, d, n], A = -exp(A_log)
    y_t    = C_t . h_t + D x_t
    out    = out_proj(y * silu(z))

Parameter names and shapes are GPT-NeoX's (``norm.*``, ``mixer.in_proj``, ``mixer.conv1d`` [d, 1, k],
``mixer.x_proj``, ``mixer.dt_proj``, ``mixer.A_log`` [d, n], ``mixer.D``, ``mixer.out_proj``), as are the
initialisations (dt_proj's weight uniform in +-r^-0.5 and bias the inverse softplus of a log-uniform step in
[0.001, 0.1]; A_log = log(1..n); D = 1; conv1d as torch's Conv1d default) and the registration order.

Tensor parallelism: the inner channels are split across ranks (in_proj column-parallel with its [x | z]
halves each split, so the full tensor is mamba_ssm's and Hugging Face's [x | z]; conv1d, dt_proj, A_log
and D hold the rank's channels; out_proj row-parallel). x_proj is row-parallel and its output is summed over
the ranks, so every rank's dt, B and C are those of the whole layer: TP=N computes what TP=1 computes.
(GPT-NeoX's mixer skips that sum and chunks each rank's in_proj rows into x and z, so its model_parallel_size
> 1 Mamba is another function: such checkpoints are refused, megatron.checkpoint.engine.gpt_neox_mamba_problem.)

The selective scan (``selective_scan``) takes one of two forms. On CPU (the default there) ``StepScan``: the
recurrence one in-place multiply-add per step over the [b, n, d] state, in blocks of ``STEP_BLOCK`` steps
recomputed in its hand-written backward (the recurrence run backwards); Mamba-1's per-(channel, state) decays
make every form elementwise over [b, s, d, n] tensors, and on CPU the fewest passes over cache-sized buffers
win (in one process, 1 thread, CPU time, the 4-layer hidden-256 model's training step went from 0.35x to
0.99x the attention model's with it and the convolution below). Elsewhere it is matmul-shaped, in the
state-space-duality form (Dao & Gu, 2024)
written out for Mamba-1's per-channel, per-state A: the sequence is cut into chunks of ``SCAN_CHUNK`` steps; in
a chunk the cumulative sums of dt give the log decays a_t = A (cum_t - m) (m: half the chunk's total, so that
|a| stays within half its range), and with P_t = C_t exp(a_t), K_s = B_s exp(-a_s) each channel's outputs
from inside the chunk are one masked matmul, y_t = sum_{s <= t} (P_t . K_s) dt_s x_s, since
exp(a_t - a_s) = exp(A (cum_t - cum_s)) is the decay from s to t. The state entering each chunk comes from a
recurrence across chunks only (one [b, d, n] multiply-add per chunk) and reaches the chunk's outputs through one
more matmul with P. Forward and backward are matmuls and a few elementwise passes, not a scan over steps.
The log-space factors exp(+-a) stay finite only while |A| x (a chunk's sum of dt) / 2 <= ``LOG_SPACE_LIMIT``;
where a sequence's steps are too large for that (it is checked on the host per call: dt of a trained model
can reach the tens), the chunk is halved, and below 4 steps the scan falls back to the form that is stable at
any step size: inside a chunk a log-depth (Hillis-Steele) scan over the step pairs (exp(dt A), dt B x), which
only ever multiplies decays <= 1, each chunk recomputed in the backward (activation checkpointing). Decoding
(a forward of one step) takes that stable path in the matmul form. All equal ``selective_scan_reference`` (the per-step
recurrence), which tests check in fp32 and bf16: outputs, last state and every gradient.

Kernels (GPU, optional, requirements/requirements-mamba.txt): mamba_causal_conv_fusion calls
causal_conv1d's ``causal_conv1d_fn``, mamba_selective_scan_fusion mamba_ssm's ``selective_scan_fn`` and
mamba_inner_func_fusion its ``mamba_inner_fn`` (the whole mixer after in_proj) on full forwards (training,
prompts); decoding steps and inputs with left padding always take the PyTorch path. A flag whose package
does not import, or that finds no CUDA device, is refused when the model is built; mamba_causal_conv_fusion
with a per-rank inner width that is not a multiple of 8 (which causal_conv1d's kernel refuses for this layer's
channel-last input) is refused when the config is read (megatron.model.config).

mamba_selective_fp32_params keeps A_log and D in fp32 when the model is cast to half precision (the scan
always reads them in fp32, as GPT-NeoX and mamba_ssm do).

Decoding (``KVCache``): each layer keeps its last k - 1 conv inputs [b, k - 1, d] and its SSM state
[b, d, n]; a forward continues from them, so a new token costs O(1) whatever the context. Left-padded slots
(``KVCache.padding``) enter neither: their conv input and scan input are zero, which leaves the zero state
unchanged, as if the row started at its first real token.
"""
from __future__ import annotations

import importlib
import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import checkpoint

from megatron.model.checkpoint_layout import MAMBA_LAYER, install_hooks
from megatron.model.config import MAMBA_CONV_WIDTH, MAMBA_STATE_SIZE, ModelConfig
from megatron.model.kv_cache import KVCache
from megatron.model.norms import build_norm
from megatron.model.recurrent_common import hidden_dropout, pad_mask
from megatron.mpu import ColumnParallelLinear, RowParallelLinear, copy_to_model_parallel_region
from megatron.mpu.layers import _fill_shard

SCAN_CHUNK = 32
"""Time steps per chunk of the selective scan (the size of the matmuls inside a chunk; for the stable form,
2 ** its depth)."""
LOG_SPACE_LIMIT = 30.0
"""The largest |A| x (a chunk's sum of dt) / 2 the matmul form takes: its factors exp(+-a) stay within
exp(+-30) ~ 1e13, and their products within fp32's range (module docstring)."""
STEP_BLOCK = 32
"""Steps per block of ``StepScan`` (its [block, b, n, d] buffers: small enough to stay in cache)."""
MIN_MATMUL_CHUNK = 4
"""Below this chunk size (steps too large for the log-space factors) the stable scan runs instead."""
LOG2_E = 1.0 / math.log(2.0)
DT_MIN, DT_MAX, DT_INIT_FLOOR = 0.001, 0.1, 1e-4


# --------------------------------------------------------------------------------------------------
# The selective scan and the causal convolution
# --------------------------------------------------------------------------------------------------
def _scan_chunk(u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                h0: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(C . h_t for each step [b, T, d], the last state [b, d, n]) of one chunk, starting from h0."""
    decay = torch.exp(delta.unsqueeze(-1) * A)                          # [b, T, d, n], in (0, 1]
    inject = (delta * u).unsqueeze(-1) * B.unsqueeze(2)                 # [b, T, d, n]
    steps, shift = u.size(1), 1
    while shift < steps:  # Hillis-Steele: after the pass for shift s each step has folded in 2s steps
        inject = torch.cat([inject[:, :shift], inject[:, shift:] + decay[:, shift:] * inject[:, :-shift]], dim=1)
        decay = torch.cat([decay[:, :shift], decay[:, shift:] * decay[:, :-shift]], dim=1)
        shift *= 2
    states = inject + decay * h0.unsqueeze(1)                           # [b, T, d, n]
    return torch.einsum("btdn,btn->btd", states, C), states[:, -1].clone()  # not a view: frees states


SCAN_FORMS = ("steps", "matmul")
"""``selective_scan``'s forms: "steps" (the CPU default) and "matmul" (with its stable fallback; elsewhere)."""


def selective_scan(u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   D: Optional[torch.Tensor] = None, z: Optional[torch.Tensor] = None,
                   delta_bias: Optional[torch.Tensor] = None, delta_softplus: bool = True,
                   initial_state: Optional[torch.Tensor] = None, chunk_size: Optional[int] = None,
                   form: Optional[str] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(y [b, s, d] in u's dtype, last state [b, d, n] fp32) of the selective SSM (see module docstring).

    u, delta, z: [b, s, d]; A: [d, n]; B, C: [b, s, n]; D, delta_bias: [d]; initial_state [b, d, n] (zeros
    when None). Computed in fp32. ``form`` (one of SCAN_FORMS; None: "steps" on CPU, "matmul" elsewhere):
    "steps" is ``StepScan`` in blocks of ``chunk_size`` steps (default STEP_BLOCK), "matmul" the matmul form in
    chunks of ``chunk_size`` (default SCAN_CHUNK) where the steps allow it (``matmul_chunk``), otherwise (and
    for one step: decoding) chunk by chunk with the stable scan (checkpointed when gradients are needed)."""
    if form is None:
        form = "steps" if u.device.type == "cpu" else "matmul"
    if form not in SCAN_FORMS:
        raise ValueError(f"selective_scan: form={form!r} is not one of {SCAN_FORMS}")
    if chunk_size is None:
        chunk_size = STEP_BLOCK if form == "steps" else SCAN_CHUNK
    dtype = u.dtype
    u, delta, A, B, C = u.float(), delta.float(), A.float(), B.float(), C.float()
    if delta_bias is not None:
        delta = delta + delta_bias.float()
    if delta_softplus:
        delta = F.softplus(delta)
    b, s, d = u.shape
    state = initial_state.float() if initial_state is not None else u.new_zeros(b, d, A.size(1))
    chunk = matmul_chunk(delta, A, chunk_size) if s > 1 and form == "matmul" else None
    if form == "steps" and s > 0:
        y, state = StepScan.apply(u, delta, A, B, C, state, max(chunk_size, 1))
    elif chunk is not None:
        y, state = _matmul_scan(u, delta, A, B, C, state, chunk)
    else:
        y, state = _stable_scan(u, delta, A, B, C, state, chunk_size)
    if D is not None:
        y = y + u * D.float()
    if z is not None:
        y = y * F.silu(z.float())
    return y.to(dtype), state


def matmul_chunk(delta: torch.Tensor, A: torch.Tensor, chunk_size: int) -> Optional[int]:
    """The largest chunk size, from ``chunk_size`` halving down to MIN_MATMUL_CHUNK, at which the matmul form's
    log-space factors stay within LOG_SPACE_LIMIT for these steps delta [b, s, d] (softplus applied) and A
    [d, n]; None when none does (or chunk_size is below the minimum). One read back to the host."""
    b, s, d = delta.shape
    rate = A.abs().amax(dim=-1)                                           # [d]: the fastest decay per channel
    sizes = []
    while chunk_size >= MIN_MATMUL_CHUNK:
        sizes.append(chunk_size)
        chunk_size //= 2
    if not sizes:
        return None
    bounds = torch.stack([(_chunked(delta, size).sum(dim=2) * rate).amax() / 2 for size in sizes]).tolist()
    return next((size for size, bound in zip(sizes, bounds) if bound <= LOG_SPACE_LIMIT), None)


def _chunked(t: torch.Tensor, chunk: int) -> torch.Tensor:
    """[b, s, k] -> [b, chunks, chunk, k], the last chunk padded with zeros (a zero step leaves the state as it
    is: decay exp(0) = 1, nothing injected)."""
    pad = (-t.size(1)) % chunk
    if pad:
        t = F.pad(t, (0, 0, 0, pad))
    return t.view(t.size(0), -1, chunk, t.size(-1))


def _matmul_scan(u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                 state: torch.Tensor, chunk: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(C . h_t for each step [b, s, d], the last state [b, d, n]) in the matmul form (module docstring), from
    ``state``; fp32 inputs whose steps ``matmul_chunk`` accepted at ``chunk``."""
    b, s, d = u.shape
    dt = _chunked(delta, chunk).transpose(2, 3)                           # [b, c, d, Q]
    x = _chunked(delta * u, chunk).transpose(2, 3).unsqueeze(-1)          # [b, c, d, Q, 1]: dt_s x_s
    cum = dt.cumsum(dim=-1)
    total = cum[..., -1:]                                                 # [b, c, d, 1]
    middle = total / 2
    log_decay = (cum - middle).unsqueeze(-1) * A.unsqueeze(1)             # [b, c, d, Q, n], |.| <= limit
    P = _chunked(C, chunk).unsqueeze(2) * torch.exp(log_decay)            # C_t exp(a_t)
    K = _chunked(B, chunk).unsqueeze(2) * torch.exp(-log_decay)           # B_s exp(-a_s)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=u.device).tril()
    inside = (P @ K.transpose(-1, -2)).masked_fill(~causal, 0.0) @ x     # [b, c, d, Q, 1]
    # each chunk's end state from a zero start, and its whole decay; then the states entering the chunks
    ends = torch.exp((total - middle) * A) * (K.transpose(-1, -2) @ x).squeeze(-1)  # [b, c, d, n]
    decays = torch.exp(total * A)                                         # [b, c, d, n]
    entering = []
    for decay, end in zip(decays.unbind(1), ends.unbind(1)):  # unbind: indexing [:, c] would zero-fill per chunk
        entering.append(state)
        state = decay * state + end
    # the entering state decays by exp(A cum_t) = exp(a_t) exp(A m) to step t
    carried = P @ (torch.exp(middle * A) * torch.stack(entering, dim=1)).unsqueeze(-1)
    y = (inside + carried).squeeze(-1).transpose(2, 3).reshape(b, -1, d)[:, :s]
    return y, state


class StepScan(torch.autograd.Function):
    """(C . h_t for each step [b, s, d], the last state [b, d, n]) of fp32 inputs u, delta (softplus applied)
    [b, s, d], A [d, n], B, C [b, s, n], from the state h0 [b, d, n], in blocks of ``block`` steps: the
    recurrence one step at a time, as one in-place multiply-add per step over the [b, n, d] state, with a
    hand-written backward (the same recurrence run backwards) instead of autograd's graph of ~s small nodes.

    Why on CPU: Mamba-1's decays exp(dt A) are per (channel, state), so every form handles [b, s, d, n] tensors
    elementwise; the matmul form needs ~a dozen passes over them (and Q x larger intra-chunk products), this
    one two in the forward (decays, inputs; then the steps and one batched matmul for C . h) and about six in the
    backward, all in the [s, b, n, d] layout (the long inner-channel axis innermost, so the broadcasts over n
    vectorise) and in place where possible. Only the state entering each block is saved: the backward recomputes
    a block's decays and states just before it needs them, into [block, b, n, d] buffers allocated once per call
    that stay in cache (a fresh [s, b, n, d] buffer cost more in page faults than a pass over it), and the
    memory kept for the backward is that of a [s / block, b, n, d] state. Stable at any step size (decays
    <= 1)."""

    @staticmethod
    def forward(ctx, u, delta, A, B, C, h0, block: int):
        dt = delta.transpose(0, 1).unsqueeze(2).contiguous()              # [s, b, 1, d]
        dt_x = (delta * u).transpose(0, 1).unsqueeze(2).contiguous()      # [s, b, 1, d]
        B_t = B.transpose(0, 1).unsqueeze(-1).contiguous()                # [s, b, n, 1]
        C_t = C.transpose(0, 1).unsqueeze(-2).contiguous()                # [s, b, 1, n]
        A_t = A.t().contiguous()                                          # [n, d]
        A2_t = A_t * LOG2_E                                               # for exp2 (StepScan._states)
        y = dt.new_empty(dt.shape)                                        # [s, b, 1, d]
        h = h0.transpose(1, 2).contiguous()                               # [b, n, d]
        entering = []
        buffers = StepScan._buffers(dt, B_t, block)
        for part in _blocks(dt.size(0), block):
            entering.append(h)
            states = StepScan._states(dt[part], dt_x[part], B_t[part], A2_t, h, *buffers)[0]
            torch.matmul(C_t[part], states, out=y[part])                  # C_t . h_t
            h = states[-1].clone()
        ctx.block = block
        ctx.save_for_backward(u, delta, A_t, dt, dt_x, B_t, C_t, torch.stack(entering))
        return y.squeeze(2).transpose(0, 1), h.transpose(1, 2)

    @staticmethod
    def _buffers(dt, B_t, block: int):
        """Two [block, b, n, d] buffers, reused by every block of one forward or backward."""
        shape = (min(block, dt.size(0)), dt.size(1), B_t.size(2), dt.size(3))
        return dt.new_empty(shape), dt.new_empty(shape)

    @staticmethod
    def _states(dt, dt_x, B_t, A2_t, h, decay, states):
        """(states h_t, decays exp(dt_t A)) [T, b, n, d] of one block from the state h before it, written into
        the first T steps of the buffers ``decay`` and ``states``. A2_t is A log2(e) [n, d]: exp2 costs a third
        of exp on CPU (torch 2.13, AVX512), and the decays were the scan's costliest pass."""
        decay = torch.exp2(torch.mul(dt, A2_t, out=decay[:dt.size(0)]), out=decay[:dt.size(0)])
        states = torch.mul(B_t, dt_x, out=states[:dt.size(0)])           # dt_t x_t B_t, then h_t
        for state, step_decay in zip(states.unbind(0), decay.unbind(0)):
            h = state.addcmul_(step_decay, h)                             # h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t
        return states, decay

    @staticmethod
    @once_differentiable
    def backward(ctx, dy, d_last):
        u, delta, A_t, dt, dt_x, B_t, C_t, entering = ctx.saved_tensors
        A2_t = A_t * LOG2_E                                               # as the forward's, for the recompute
        dy_t = dy.transpose(0, 1).unsqueeze(2).contiguous()               # [s, b, 1, d]
        d_dt_x, d_dt = torch.empty_like(dt), torch.empty_like(dt)         # [s, b, 1, d]
        d_B, d_C = torch.empty_like(B_t), torch.empty_like(B_t)           # [s, b, n, 1]
        d_A = torch.zeros_like(A_t)
        carry = d_last.transpose(1, 2)                                    # dL/dh at the end of the block
        buffers = StepScan._buffers(dt, B_t, ctx.block)
        grad_buffer = torch.empty_like(buffers[0])
        for index, part in reversed(list(enumerate(_blocks(dt.size(0), ctx.block)))):
            h0 = entering[index]
            states, decay = StepScan._states(dt[part], dt_x[part], B_t[part], A2_t, h0, *buffers)
            grad = torch.mul(C_t[part].transpose(-1, -2), dy_t[part],     # dL/dh_t from y_t ...
                             out=grad_buffer[:len(states)])
            grad[-1] += carry
            grads, decays = grad.unbind(0), decay.unbind(0)
            for t in range(len(grads) - 1, 0, -1):                       # ... plus what h_t passes on to h_{t+1}
                grads[t - 1].addcmul_(decays[t], grads[t])
            carry = decay[0] * grad[0]
            torch.matmul(B_t[part].transpose(-1, -2), grad, out=d_dt_x[part])
            torch.matmul(grad, dt_x[part].transpose(-1, -2), out=d_B[part])
            torch.matmul(states, dy_t[part].transpose(-1, -2), out=d_C[part])
            # dL/d(dt_t A) = grad_t * decay_t * h_{t-1}, in place of grad; its product with dt in place of decay
            d_log_decay = grad.mul_(decay)
            d_log_decay[1:].mul_(states[:-1])
            d_log_decay[0].mul_(h0)
            d_A += torch.mul(d_log_decay, dt[part], out=decay).sum((0, 1))
            torch.sum(d_log_decay.mul_(A_t), dim=2, keepdim=True, out=d_dt[part])
        d_dt_x, d_dt = d_dt_x.squeeze(2).transpose(0, 1), d_dt.squeeze(2).transpose(0, 1)
        return (d_dt_x * delta, d_dt + d_dt_x * u, d_A.t(), d_B.squeeze(-1).transpose(0, 1),
                d_C.squeeze(-1).transpose(0, 1), carry.transpose(1, 2), None)


def _blocks(steps: int, block: int):
    """The slices of ``steps`` steps in blocks of ``block`` (the last one shorter)."""
    return [slice(start, min(start + block, steps)) for start in range(0, steps, block)]


def _stable_scan(u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                 state: torch.Tensor, chunk_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(C . h_t for each step [b, s, d], the last state) chunk by chunk with ``_scan_chunk``, stable at any step
    size; each chunk is recomputed in the backward (only one chunk's [b, chunk, d, n] states alive)."""
    b, s, d = u.shape
    outputs = []
    recompute = torch.is_grad_enabled() and any(t.requires_grad for t in (u, delta, A, B, C, state))
    for start in range(0, s, chunk_size):
        part = slice(start, start + chunk_size)
        args = (u[:, part], delta[:, part], A, B[:, part], C[:, part], state)
        y, state = checkpoint(_scan_chunk, *args, use_reentrant=False) if recompute else _scan_chunk(*args)
        outputs.append(y)
    return (torch.cat(outputs, dim=1) if outputs else u.new_zeros(b, 0, d)), state


def selective_scan_reference(u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                             C: torch.Tensor, D: Optional[torch.Tensor] = None, z: Optional[torch.Tensor] = None,
                             delta_bias: Optional[torch.Tensor] = None, delta_softplus: bool = True,
                             initial_state: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """The same function as ``selective_scan``, one time step at a time (the definition; tests compare)."""
    dtype = u.dtype
    u, delta, A, B, C = u.float(), delta.float(), A.float(), B.float(), C.float()
    if delta_bias is not None:
        delta = delta + delta_bias.float()
    if delta_softplus:
        delta = F.softplus(delta)
    b, s, d = u.shape
    h = initial_state.float() if initial_state is not None else u.new_zeros(b, d, A.size(1))
    ys = []
    for t in range(s):
        h = torch.exp(delta[:, t, :, None] * A) * h + (delta[:, t] * u[:, t])[:, :, None] * B[:, t, None, :]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, t]))
    y = torch.stack(ys, dim=1) if ys else u.new_zeros(b, 0, d)
    if D is not None:
        y = y + u * D.float()
    if z is not None:
        y = y * F.silu(z.float())
    return y.to(dtype), h


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                  previous: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(depthwise causal convolution of x [b, s, d] with weight [d, 1, k], the last k - 1 inputs [b, k - 1, d]).

    ``previous`` holds the k - 1 inputs before x (zeros when None: the sequence starts here)."""
    b, s, d = x.shape
    width = weight.size(-1)
    if previous is None and x.device.type == "cpu" and s >= width:  # training and prompts on CPU
        return ZeroStartConv.apply(x, weight.squeeze(1).t(), bias), x[:, s - (width - 1):].clone()
    if previous is None:
        previous = x.new_zeros(b, width - 1, d)
    window = torch.cat([previous.to(x.dtype), x], dim=1)                   # [b, k - 1 + s, d]
    tail = window[:, window.size(1) - (width - 1):]
    if s <= width or window.device.type == "cpu":
        # k multiply-adds per channel (decoding steps, and continuations on CPU; training takes ZeroStartConv, the
        # same sums with their own backward): for decoding steps a conv call costs ~100x more on CPU, and on CPU
        # the depthwise conv's backward took 1.3 s per layer at [2, 512, 512] (oneDNN), this one milliseconds;
        # one shifted [b, s, d] multiply-add per tap (a product over unfold's [b, s, d, k] and its sum over the
        # inner k took 4x longer, forward and backward)
        taps = weight.squeeze(1).t()                                      # [k, d]
        out = window[:, :s] * taps[0] if bias is None else torch.addcmul(bias, window[:, :s], taps[0])
        for j in range(1, width):
            out = torch.addcmul(out, window[:, j:j + s], taps[j])         # [b, s, d]
        return out, tail
    out = F.conv1d(window.transpose(1, 2), weight, bias, groups=d)        # [b, d, s]
    return out.transpose(1, 2), tail


class ZeroStartConv(torch.autograd.Function):
    """The depthwise causal convolution of x [b, s, d] (s >= k) with taps [k, d] and bias [d] (or None), from
    zeros before the sequence (training, prompts), as k in-place multiply-adds into one output on shifted
    slices, and the same in its backward: no zero-padded window, and none of the zero-filled [b, s + k - 1, d]
    gradients that autograd's slice and concatenation backwards write per tap."""

    @staticmethod
    def forward(ctx, x, taps, bias):
        s, width = x.size(1), taps.size(0)
        out = torch.mul(x, taps[-1]) if bias is None else torch.addcmul(bias, x, taps[-1])
        for j in range(width - 1):
            shift = width - 1 - j                                         # tap j reads the input shift steps back
            out[:, shift:].addcmul_(x[:, :s - shift], taps[j])
        ctx.save_for_backward(x, taps)
        ctx.has_bias = bias is not None
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, taps = ctx.saved_tensors
        s, width = x.size(1), taps.size(0)
        d_x = torch.mul(grad, taps[-1])
        d_taps = torch.empty_like(taps)
        buffer = torch.empty(grad.numel(), dtype=grad.dtype, device=grad.device)
        for j in range(width):
            shift = width - 1 - j
            if shift:
                d_x[:, :s - shift].addcmul_(grad[:, shift:], taps[j])
            product = buffer[:grad.size(0) * (s - shift) * grad.size(2)].view(grad.size(0), s - shift, -1)
            # contiguous: torch's sum over the outer dims of a strided slice took 10x longer
            torch.sum(torch.mul(grad[:, shift:], x[:, :s - shift], out=product), dim=(0, 1), out=d_taps[j])
        return d_x, d_taps, grad.sum((0, 1)) if ctx.has_bias else None


# --------------------------------------------------------------------------------------------------
# GPU kernels (optional)
# --------------------------------------------------------------------------------------------------
MAMBA_KERNELS = {"mamba_selective_scan_fusion": ("mamba_ssm.ops.selective_scan_interface", "selective_scan_fn"),
                 "mamba_causal_conv_fusion": ("causal_conv1d", "causal_conv1d_fn"),
                 "mamba_inner_func_fusion": ("mamba_ssm.ops.selective_scan_interface", "mamba_inner_fn")}
"""flag -> (module, function) of the kernel it switches on."""


def mamba_kernel_problems(config: ModelConfig, cuda_available: bool) -> list:
    """Each Mamba fusion flag that is on but cannot run here (no CUDA, or its package does not import)."""
    problems = []
    for flag, (module, name) in MAMBA_KERNELS.items():
        if not getattr(config, flag):
            continue
        if not cuda_available:
            problems.append(f"{flag}=true needs a CUDA GPU (its kernel is CUDA-only) and this worker has none; set "
                            f"it to false to use the PyTorch selective scan and convolution")
            continue
        try:
            getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as exc:
            problems.append(f"{flag}=true needs {module.split('.')[0]}.{name}, which does not import ({exc}); "
                            f"install it with: pip install -r requirements/requirements-mamba.txt")
    return problems


def _kernel(flag: str):
    module, name = MAMBA_KERNELS[flag]
    return getattr(importlib.import_module(module), name)


# --------------------------------------------------------------------------------------------------
# Modules
# --------------------------------------------------------------------------------------------------
def _conv_init(width: int):
    bound = 1.0 / math.sqrt(width)  # torch's Conv1d default (kaiming_uniform a=sqrt(5)) for a depthwise conv
    return lambda t, g: torch.nn.init.uniform_(t, -bound, bound, generator=g)


def _dt_bias_init(t: torch.Tensor, g: torch.Generator) -> None:
    """The inverse softplus of a step drawn log-uniformly in [DT_MIN, DT_MAX] (mamba_ssm's dt init)."""
    dt = torch.exp(torch.rand(t.shape, generator=g) * (math.log(DT_MAX) - math.log(DT_MIN)) + math.log(DT_MIN))
    dt = dt.clamp(min=DT_INIT_FLOOR)
    t.copy_(dt + torch.log(-torch.expm1(-dt)))


class ParallelMambaMixer(nn.Module):
    """The selective SSM mixer of one layer over this rank's inner channels (see module docstring)."""

    def __init__(self, config: ModelConfig, parallel_state, initializer, layer_number: int) -> None:
        super().__init__()
        self.layer_number = layer_number
        tp, rank = parallel_state.get_model_parallel_world_size(), parallel_state.get_model_parallel_rank()
        self.group = parallel_state.get_model_parallel_group() if tp > 1 else None
        d, r, n, k = config.mamba_inner, config.mamba_dt_rank, MAMBA_STATE_SIZE, MAMBA_CONV_WIDTH
        self.d_local, self.dt_rank, self.d_state = d // tp, r, n
        linear_bias = config.mamba_use_bias_in_linears
        self.in_proj = ColumnParallelLinear(config.hidden_size, 2 * d, parallel_state,
                                            initializer.weight(layer_number, "mixer.in_proj"), bias=linear_bias,
                                            chunks=2)
        self.conv1d = nn.Conv1d(self.d_local, self.d_local, k, groups=self.d_local,
                                bias=config.mamba_use_bias_in_conv)
        self._shard(self.conv1d.weight, (d, 1, k), initializer.custom(layer_number, "mixer.conv1d.weight",
                                                                     _conv_init(k)), rank, tp)
        if self.conv1d.bias is not None:
            self._shard(self.conv1d.bias, (d,), initializer.custom(layer_number, "mixer.conv1d.bias",
                                                                   _conv_init(k)), rank, tp)
        self.x_proj = RowParallelLinear(d, r + 2 * n, parallel_state, initializer.weight(layer_number, "mixer.x_proj"),
                                        bias=linear_bias)
        self.dt_proj = nn.Linear(r, self.d_local, bias=True)
        std = r ** -0.5
        self._shard(self.dt_proj.weight, (d, r), initializer.custom(
            layer_number, "mixer.dt_proj.weight", lambda t, g: torch.nn.init.uniform_(t, -std, std, generator=g)),
            rank, tp)
        self._shard(self.dt_proj.bias, (d,), initializer.custom(layer_number, "mixer.dt_proj.bias", _dt_bias_init),
                    rank, tp)
        self.A_log = nn.Parameter(torch.log(torch.arange(1, n + 1, dtype=torch.float32)).repeat(self.d_local, 1))
        self.D = nn.Parameter(torch.ones(self.d_local))
        for param in (self.A_log, self.D):
            param._no_weight_decay = True  # as GPT-NeoX and mamba_ssm
            param.mamba_fp32 = config.mamba_selective_fp32_params  # build_model keeps these in fp32
        for param in (self.conv1d.weight, self.conv1d.bias, self.dt_proj.weight, self.dt_proj.bias, self.A_log,
                      self.D):
            if param is not None:
                param.model_parallel = tp > 1
        self.out_proj = RowParallelLinear(d, config.hidden_size, parallel_state,
                                          initializer.output_weight(layer_number, "mixer.out_proj"), bias=linear_bias)
        self.scan_kernel = _kernel("mamba_selective_scan_fusion") if config.mamba_selective_scan_fusion else None
        self.conv_kernel = _kernel("mamba_causal_conv_fusion") if config.mamba_causal_conv_fusion else None
        self.inner_kernel = _kernel("mamba_inner_func_fusion") if config.mamba_inner_func_fusion else None

    @staticmethod
    def _shard(param: torch.Tensor, full_shape, init_fn, rank: int, tp: int) -> None:
        _fill_shard(param, full_shape, init_fn, 0, rank, tp)

    def forward(self, h: torch.Tensor, cache: Optional[KVCache] = None) -> torch.Tensor:
        """h [b, s, hidden] -> [b, s, hidden]; continues from and updates ``cache``'s state of this layer."""
        xz = self.in_proj(h)                                              # [b, s, 2 * d_local]: [x | z]
        if cache is None and self.inner_kernel is not None and xz.is_cuda:
            return self._fused_inner(xz)
        pads = pad_mask(cache, h)
        state = cache.recurrent_state(self.layer_number) if cache is not None else None
        x, z = xz.chunk(2, dim=-1)
        if pads is not None:
            x = x.masked_fill(pads.unsqueeze(-1), 0.0)
        conv_state, ssm_state = state if state is not None else (None, None)
        x, conv_state = self._conv(x, conv_state)
        if pads is not None:
            x = x.masked_fill(pads.unsqueeze(-1), 0.0)
        x_dbl = copy_to_model_parallel_region(self.x_proj(x), self.group)  # summed over ranks; grads summed back
        dt, B, C = x_dbl.split([self.dt_rank, self.d_state, self.d_state], dim=-1)
        dt = F.linear(dt, self.dt_proj.weight)                            # [b, s, d_local]; bias added in the scan
        A = -torch.exp(self.A_log.float())
        y, ssm_state = self._scan(x, dt, A, B, C, z, ssm_state)
        if cache is not None:
            cache.set_recurrent_state(self.layer_number, (conv_state, ssm_state))
        return self.out_proj(y)

    def _conv(self, x: torch.Tensor, previous: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        if self.conv_kernel is not None and previous is None and x.is_cuda:
            width = self.conv1d.weight.size(-1)
            tail = F.pad(x, (0, 0, max(width - 1 - x.size(1), 0), 0))[:, -(width - 1):]
            out = self.conv_kernel(x.transpose(1, 2), self.conv1d.weight.squeeze(1), self.conv1d.bias, activation="silu")
            return out.transpose(1, 2), tail
        out, tail = causal_conv1d(x, self.conv1d.weight, self.conv1d.bias, previous)
        return F.silu(out), tail

    def _scan(self, x, dt, A, B, C, z, initial_state):
        if self.scan_kernel is not None and initial_state is None and x.is_cuda:
            # mamba_ssm's layout: [b, d, s] for u, delta, z and [b, n, s] for B, C
            y, last = self.scan_kernel(x.transpose(1, 2).contiguous(), dt.transpose(1, 2).contiguous(), A,
                                       B.transpose(1, 2).contiguous(), C.transpose(1, 2).contiguous(),
                                       self.D.float(), z=z.transpose(1, 2).contiguous(),
                                       delta_bias=self.dt_proj.bias.float(), delta_softplus=True,
                                       return_last_state=True)
            return y.transpose(1, 2), last
        return selective_scan(x, dt, A, B, C, self.D, z=z, delta_bias=self.dt_proj.bias, initial_state=initial_state)

    def _fused_inner(self, xz: torch.Tensor) -> torch.Tensor:
        """mamba_ssm's mamba_inner_fn: conv, x_proj, dt_proj, scan and out_proj in one kernel (TP=1: the
        config refuses it with model_parallel_size > 1, as x_proj's output would need a sum over ranks). It
        returns no state, so forwards with a decoding state take the PyTorch path."""
        out = self.inner_kernel(xz.transpose(1, 2).contiguous(), self.conv1d.weight, self.conv1d.bias,
                                self.x_proj.weight, self.dt_proj.weight, self.out_proj.weight, self.out_proj.bias,
                                -torch.exp(self.A_log.float()), None, None, self.D.float(),
                                delta_bias=self.dt_proj.bias.float(), delta_softplus=True)
        return out


class ParallelMambaResidualLayer(nn.Module):
    """GPT-NeoX's Mamba layer: ``x + drop(mixer(norm(x)))``, called with (hidden, mask) like every block."""

    def __init__(self, config: ModelConfig, parallel_state, initializer, layer_number: int, rng_tracker,
                 rpe=None) -> None:
        super().__init__()
        self.layer_number = layer_number
        self.norm = build_norm(config, config.hidden_size)
        self.mixer = ParallelMambaMixer(config, parallel_state, initializer, layer_number)
        self.hidden_dropout = config.hidden_dropout
        install_hooks(self, MAMBA_LAYER, config, parallel_state)

    def forward(self, args: Tuple[torch.Tensor, Optional[torch.Tensor]], kv_cache: Optional[KVCache] = None):
        hidden, mask = args  # the attention mask is not read: the recurrence is causal by construction
        out = self.mixer(self.norm(hidden), kv_cache)
        return hidden + hidden_dropout(out, self.hidden_dropout, self.training), mask
