"""residual + dropout(x + bias) with Philox dropout: the keep mask is a function of (seed, element
index), so the backward regenerates it instead of storing it.

x is seen as [rows, width]. Each forward program takes a [BLOCK_M, BLOCK_N] tile (grid: row tiles
x column blocks) as four column quarters of BLOCK_N // 4: one Philox call (tl.rand4x) gives the
four random numbers of an element of quarter 0 and the elements at the same place in quarters
1..3, keyed by the index of the quarter-0 element, so each element gets its own draw and Philox
runs once per four elements. The mask therefore depends on BLOCK_N, which the forward and the
backward share (megatron.fused_kernels.launch_config). The backward's programs each own one column
block of a group of row tiles (grid: groups x column blocks), write dx and sum it over their rows
in registers: the bias gradient comes out as [groups, width] fp32 partials that the caller sums.
"""
import triton
import triton.language as tl

# Whether these kernels were built for Triton's CPU interpreter (TRITON_INTERPRET at import).
BUILT_FOR_INTERPRETER = triton.knobs.runtime.interpret


@triton.jit
def _tile(first_row, rows, cols, width, BLOCK_M: tl.constexpr):
    """(element offsets, mask) of the [BLOCK_M, len(cols)] tile starting at row ``first_row``."""
    row = first_row + tl.arange(0, BLOCK_M).to(tl.int64)
    mask = (row < rows)[:, None] & (cols < width)[None, :]
    return row[:, None] * width + cols[None, :], mask


@triton.jit
def _keep_quarters(seed, offsets, p):
    """Keep masks of the four quarters whose quarter-0 elements have these offsets (one Philox call)."""
    u0, u1, u2, u3 = tl.rand4x(seed, offsets)
    return u0 >= p, u1 >= p, u2 >= p, u3 >= p


@triton.jit
def _forward_quarter(x_ptr, b_ptr, r_ptr, y_ptr, offsets, mask, cols, width, keep, scale,
                     HAS_BIAS: tl.constexpr, DROPOUT: tl.constexpr):
    v = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        v += tl.load(b_ptr + cols, mask=cols < width, other=0.0).to(tl.float32)[None, :]
    if DROPOUT:
        v = tl.where(keep, v * scale, 0.0)
    y = tl.load(r_ptr + offsets, mask=mask, other=0.0).to(tl.float32) + v
    tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def bias_dropout_add_forward(
    x_ptr, b_ptr, r_ptr, y_ptr, seed_ptr, rows, width, p, scale,
    HAS_BIAS: tl.constexpr, DROPOUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    QUARTER: tl.constexpr = BLOCK_N // 4
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, QUARTER)
    first = tl.program_id(0).to(tl.int64) * BLOCK_M
    offsets, mask = _tile(first, rows, cols, width, BLOCK_M)
    if DROPOUT:
        k0, k1, k2, k3 = _keep_quarters(tl.load(seed_ptr), offsets, p)
    else:
        k0, k1, k2, k3 = mask, mask, mask, mask
    _forward_quarter(x_ptr, b_ptr, r_ptr, y_ptr, offsets, mask, cols, width, k0, scale, HAS_BIAS, DROPOUT)
    offsets, mask = _tile(first, rows, cols + QUARTER, width, BLOCK_M)
    _forward_quarter(x_ptr, b_ptr, r_ptr, y_ptr, offsets, mask, cols + QUARTER, width, k1, scale, HAS_BIAS,
                     DROPOUT)
    offsets, mask = _tile(first, rows, cols + 2 * QUARTER, width, BLOCK_M)
    _forward_quarter(x_ptr, b_ptr, r_ptr, y_ptr, offsets, mask, cols + 2 * QUARTER, width, k2, scale, HAS_BIAS,
                     DROPOUT)
    offsets, mask = _tile(first, rows, cols + 3 * QUARTER, width, BLOCK_M)
    _forward_quarter(x_ptr, b_ptr, r_ptr, y_ptr, offsets, mask, cols + 3 * QUARTER, width, k3, scale, HAS_BIAS,
                     DROPOUT)


@triton.jit
def _backward_quarter(dy_ptr, dx_ptr, offsets, mask, keep, scale, db_acc):
    dx = tl.where(keep, tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(tl.float32) * scale, 0.0)
    tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    return db_acc + dx


@triton.jit
def dropout_backward(
    dy_ptr, dx_ptr, seed_ptr, db_partial_ptr, rows, width, p, scale,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dx = dy * keep * scale, keep regenerated from the forward's seed; fp32 column sums of dx (the bias
    gradient) over this program's row tiles to db_partial."""
    QUARTER: tl.constexpr = BLOCK_N // 4
    group = tl.program_id(0)
    groups = tl.num_programs(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, QUARTER)
    seed = tl.load(seed_ptr)
    acc0 = tl.zeros([BLOCK_M, QUARTER], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_M, QUARTER], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_M, QUARTER], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_M, QUARTER], dtype=tl.float32)
    for first in range(group * BLOCK_M, rows, groups * BLOCK_M):
        offsets, mask = _tile(first, rows, cols, width, BLOCK_M)
        k0, k1, k2, k3 = _keep_quarters(seed, offsets, p)
        acc0 = _backward_quarter(dy_ptr, dx_ptr, offsets, mask, k0, scale, acc0)
        offsets, mask = _tile(first, rows, cols + QUARTER, width, BLOCK_M)
        acc1 = _backward_quarter(dy_ptr, dx_ptr, offsets, mask, k1, scale, acc1)
        offsets, mask = _tile(first, rows, cols + 2 * QUARTER, width, BLOCK_M)
        acc2 = _backward_quarter(dy_ptr, dx_ptr, offsets, mask, k2, scale, acc2)
        offsets, mask = _tile(first, rows, cols + 3 * QUARTER, width, BLOCK_M)
        acc3 = _backward_quarter(dy_ptr, dx_ptr, offsets, mask, k3, scale, acc3)
    if HAS_BIAS:
        partial = db_partial_ptr + group * width
        tl.store(partial + cols, tl.sum(acc0, axis=0), mask=cols < width)
        tl.store(partial + cols + QUARTER, tl.sum(acc1, axis=0), mask=cols + QUARTER < width)
        tl.store(partial + cols + 2 * QUARTER, tl.sum(acc2, axis=0), mask=cols + 2 * QUARTER < width)
        tl.store(partial + cols + 3 * QUARTER, tl.sum(acc3, axis=0), mask=cols + 3 * QUARTER < width)
