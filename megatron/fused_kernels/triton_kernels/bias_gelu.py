"""GeLU(x + bias), tanh approximation (Megatron's) or exact erf; the backward recomputes
x + bias instead of storing it.

x is seen as [rows, width]. The forward's programs each take a [BLOCK_M, BLOCK_N] tile (grid:
row tiles x column blocks), so the bias is loaded once per tile and no element index is divided
by the width (the earlier flat-block kernels did a 64-bit modulo per element, a software routine on
GPUs: the likely reason they lost to PyTorch on the H200, at ~0.3 elements/ns both passes).
The backward's programs each own one column block of a group of row tiles (grid: groups x
column blocks): they write dx and sum it over their rows in registers, giving the bias gradient
as [groups, width] fp32 partials that the caller sums (no second pass over dx, no atomics).
"""
import triton
import triton.language as tl

# Whether these kernels were built for Triton's CPU interpreter (TRITON_INTERPRET at import).
BUILT_FOR_INTERPRETER = triton.knobs.runtime.interpret

# Globals read inside @triton.jit functions must be constexpr.
SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
INV_SQRT_2 = tl.constexpr(0.7071067811865476)
INV_SQRT_2PI = tl.constexpr(0.3989422804014327)
TANH_COEFF = tl.constexpr(0.044715)


@triton.jit
def _tanh(z):
    """tanh through exp (tl.math has none); |z| >= 15 is +-1 in fp32, so clamp to keep exp finite."""
    z = tl.minimum(tl.maximum(z, -15.0), 15.0)
    return 1.0 - 2.0 / (tl.exp(2.0 * z) + 1.0)


@triton.jit
def _gelu(v, EXACT: tl.constexpr):
    if EXACT:
        return 0.5 * v * (1.0 + tl.math.erf(v * INV_SQRT_2))
    return 0.5 * v * (1.0 + _tanh(SQRT_2_OVER_PI * v * (1.0 + TANH_COEFF * v * v)))


@triton.jit
def _gelu_grad(v, EXACT: tl.constexpr):
    if EXACT:
        return 0.5 * (1.0 + tl.math.erf(v * INV_SQRT_2)) + v * INV_SQRT_2PI * tl.exp(-0.5 * v * v)
    t = _tanh(SQRT_2_OVER_PI * v * (1.0 + TANH_COEFF * v * v))
    return 0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * SQRT_2_OVER_PI * (1.0 + 3.0 * TANH_COEFF * v * v)


@triton.jit
def _tile(first_row, rows, cols, width, BLOCK_M: tl.constexpr):
    """(element offsets, mask) of the [BLOCK_M, len(cols)] tile starting at row ``first_row``."""
    row = first_row + tl.arange(0, BLOCK_M).to(tl.int64)
    mask = (row < rows)[:, None] & (cols < width)[None, :]
    return row[:, None] * width + cols[None, :], mask


@triton.jit
def bias_gelu_forward(
    x_ptr, b_ptr, y_ptr, rows, width,
    HAS_BIAS: tl.constexpr, EXACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offsets, mask = _tile(tl.program_id(0).to(tl.int64) * BLOCK_M, rows, cols, width, BLOCK_M)
    v = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        v += tl.load(b_ptr + cols, mask=cols < width, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offsets, _gelu(v, EXACT).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def bias_gelu_backward(
    dy_ptr, x_ptr, b_ptr, dx_ptr, db_partial_ptr, rows, width,
    HAS_BIAS: tl.constexpr, EXACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dx = dy * gelu'(x + bias) over this program's row tiles; their fp32 column sums to db_partial."""
    group = tl.program_id(0)
    groups = tl.num_programs(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    if HAS_BIAS:
        bias = tl.load(b_ptr + cols, mask=cols < width, other=0.0).to(tl.float32)[None, :]
    db_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for first in range(group * BLOCK_M, rows, groups * BLOCK_M):
        offsets, mask = _tile(first, rows, cols, width, BLOCK_M)
        v = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            v += bias
        dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        dx = dy * _gelu_grad(v, EXACT)
        tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if HAS_BIAS:
            db_acc += dx
    if HAS_BIAS:
        tl.store(db_partial_ptr + group * width + cols, tl.sum(db_acc, axis=0), mask=cols < width)
