"""residual + dropout(x + bias) with Philox dropout (tl.rand): the keep mask is a function of
(seed, element index), so the backward regenerates it instead of storing it.
"""
import triton
import triton.language as tl

# Whether these kernels were built for Triton's CPU interpreter (TRITON_INTERPRET at import).
BUILT_FOR_INTERPRETER = triton.knobs.runtime.interpret


@triton.jit
def _keep(seed_ptr, offs, p):
    seed = tl.load(seed_ptr)
    return tl.rand(seed, offs.to(tl.int32)) >= p


@triton.jit
def bias_dropout_add_forward(
    x_ptr, b_ptr, r_ptr, y_ptr, seed_ptr, n, width, p, scale,
    HAS_BIAS: tl.constexpr, DROPOUT: tl.constexpr, BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    v = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
    if HAS_BIAS:
        v += tl.load(b_ptr + offs % width, mask=m, other=0.0).to(tl.float32)
    if DROPOUT:
        v = tl.where(_keep(seed_ptr, offs, p), v * scale, 0.0)
    y = tl.load(r_ptr + offs, mask=m, other=0.0).to(tl.float32) + v
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def dropout_backward(dy_ptr, dx_ptr, seed_ptr, n, p, scale, BLOCK: tl.constexpr):
    """dx = dy * keep * scale, with keep regenerated from the forward's seed."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    dy = tl.load(dy_ptr + offs, mask=m, other=0.0).to(tl.float32)
    dx = tl.where(_keep(seed_ptr, offs, p), dy * scale, 0.0)
    tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=m)
