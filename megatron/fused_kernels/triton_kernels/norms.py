"""LayerNorm and RMSNorm over the last dimension (IS_RMS selects RMSNorm: no mean subtraction).
Statistics and arithmetic are fp32; block sizes and warps come from
:mod:`megatron.fused_kernels.launch_config`, chosen so that no variant spills registers.

Rows that fit one block (width <= the launch config's single-block limit):

- ``norm_forward``: each program normalises a [BLOCK_M, BLOCK_N] tile of whole rows held in
  registers (several rows per program at small widths, so each program moves enough bytes).
- ``norm_backward``: a fixed number of programs, each walking a strided set of row tiles: dx per
  row, and the weight/bias gradient partials summed over its rows in registers, written once
  per program to a [programs, width] fp32 buffer that the caller sums (deterministic: no atomics).
  Reads x and dy once, writes dx once.

Wider rows (the row does not fit one block without spilling; e.g. hidden 16384): the reduction is
split over column chunks of BLOCK_N.

- ``norm_forward_chunked``: one program per row; pass 1 merges per-chunk mean and M2 (Chan's
  parallel variance, stable), pass 2 re-reads the row (from L2) and writes y.
- ``norm_backward_dx_chunked``: one program per row; pass 1 the two row sums, pass 2 dx.
- ``norm_backward_dwdb``: the weight/bias gradient partials over [groups, column blocks] programs,
  each summing dy * xhat and dy over its rows (x and dy read a second time, as PyTorch's own
  LayerNorm backward does).
"""
import triton
import triton.language as tl

# Whether these kernels were built for Triton's CPU interpreter (TRITON_INTERPRET at import).
BUILT_FOR_INTERPRETER = triton.knobs.runtime.interpret


@triton.jit
def _row_tile(first, rows, cols, width, BLOCK_M: tl.constexpr):
    """Rows ``first`` .. ``first + BLOCK_M`` of a [rows, width] tensor at columns ``cols``: (row indices,
    which rows exist, element mask, element offsets)."""
    row = first + tl.arange(0, BLOCK_M).to(tl.int64)
    in_rows = row < rows
    mask = in_rows[:, None] & (cols < width)[None, :]
    return row, in_rows, mask, row[:, None] * width + cols[None, :]


@triton.jit
def norm_forward(
    x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, rows, width, eps,
    IS_RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    cols = tl.arange(0, BLOCK_N)
    in_row = cols < width
    row, in_rows, mask, offsets = _row_tile(tl.program_id(0).to(tl.int64) * BLOCK_M, rows, cols, width, BLOCK_M)
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if IS_RMS:
        centered = x
    else:
        mean = tl.sum(x, axis=1) / width
        centered = tl.where(mask, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centered * centered, axis=1) / width + eps)
    y = centered * rstd[:, None]
    if HAS_WEIGHT:
        y = y * tl.load(w_ptr + cols, mask=in_row, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        y = y + tl.load(b_ptr + cols, mask=in_row, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)
    if not IS_RMS:
        tl.store(mean_ptr + row, mean, mask=in_rows)
    tl.store(rstd_ptr + row, rstd, mask=in_rows)


@triton.jit
def norm_forward_chunked(
    x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, width, eps,
    IS_RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = row * width
    zero = tl.sum(tl.zeros([BLOCK_N], dtype=tl.float32), axis=0)
    count, mean, m2 = zero, zero, zero
    for start in range(0, width, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        in_row = cols < width
        x = tl.load(x_ptr + base + cols, mask=in_row, other=0.0).to(tl.float32)
        if IS_RMS:
            m2 += tl.sum(x * x, axis=0)
        else:
            n_chunk = tl.minimum(width - start, BLOCK_N).to(tl.float32)
            chunk_mean = tl.sum(x, axis=0) / n_chunk
            centered = tl.where(in_row, x - chunk_mean, 0.0)
            chunk_m2 = tl.sum(centered * centered, axis=0)
            total = count + n_chunk
            delta = chunk_mean - mean
            mean += delta * (n_chunk / total)
            m2 += chunk_m2 + delta * delta * (count * n_chunk / total)
            count = total
    rstd = 1.0 / tl.sqrt(m2 / width + eps)
    for start in range(0, width, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        in_row = cols < width
        x = tl.load(x_ptr + base + cols, mask=in_row, other=0.0).to(tl.float32)
        if IS_RMS:
            y = x * rstd
        else:
            y = (x - mean) * rstd
        if HAS_WEIGHT:
            y = y * tl.load(w_ptr + cols, mask=in_row, other=0.0).to(tl.float32)
        if HAS_BIAS:
            y = y + tl.load(b_ptr + cols, mask=in_row, other=0.0).to(tl.float32)
        tl.store(y_ptr + base + cols, y.to(y_ptr.dtype.element_ty), mask=in_row)
    if not IS_RMS:
        tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _load_xhat(x_ptr, mean_ptr, rstd_ptr, row, in_rows, offsets, mask, IS_RMS: tl.constexpr):
    """(the normalised input of a tile, zero outside ``mask``; its rows' rstd as a column)."""
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.load(rstd_ptr + row, mask=in_rows, other=0.0)[:, None]
    if IS_RMS:
        return x * rstd, rstd
    mean = tl.load(mean_ptr + row, mask=in_rows, other=0.0)[:, None]
    return tl.where(mask, (x - mean) * rstd, 0.0), rstd


@triton.jit
def _store_partials(dw_partial_ptr, db_partial_ptr, index, width, cols, dw_acc, db_acc,
                    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Row ``index`` of the [groups, width] partial buffers: the accumulators summed over their rows."""
    if HAS_WEIGHT:
        tl.store(dw_partial_ptr + index * width + cols, tl.sum(dw_acc, axis=0), mask=cols < width)
    if HAS_BIAS:
        tl.store(db_partial_ptr + index * width + cols, tl.sum(db_acc, axis=0), mask=cols < width)


@triton.jit
def norm_backward(
    dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_partial_ptr, db_partial_ptr, rows, width,
    IS_RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dx per row; per-program fp32 partial sums of dweight = dy * xhat and dbias = dy."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    in_row = cols < width
    dw_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for first in range(pid * BLOCK_M, rows, programs * BLOCK_M):
        row, in_rows, mask, offsets = _row_tile(first, rows, cols, width, BLOCK_M)
        xhat, rstd = _load_xhat(x_ptr, mean_ptr, rstd_ptr, row, in_rows, offsets, mask, IS_RMS)
        dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        if HAS_WEIGHT:
            wdy = tl.load(w_ptr + cols, mask=in_row, other=0.0).to(tl.float32)[None, :] * dy
        else:
            wdy = dy
        c1 = tl.sum(xhat * wdy, axis=1) / width
        if IS_RMS:
            dx = (wdy - xhat * c1[:, None]) * rstd
        else:
            c2 = tl.sum(wdy, axis=1) / width
            dx = (wdy - (xhat * c1[:, None] + c2[:, None])) * rstd
        tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if HAS_WEIGHT:
            dw_acc += dy * xhat
        if HAS_BIAS:
            db_acc += dy
    _store_partials(dw_partial_ptr, db_partial_ptr, pid, width, cols, dw_acc, db_acc, HAS_WEIGHT, HAS_BIAS)


@triton.jit
def _chunk_xhat_wdy(dy_ptr, x_ptr, w_ptr, base, cols, width, mean, rstd, HAS_WEIGHT: tl.constexpr):
    """(xhat, weight * dy) of one column chunk of a row, zero past the row's end (mean is 0 for RMSNorm)."""
    in_row = cols < width
    x = tl.load(x_ptr + base + cols, mask=in_row, other=0.0).to(tl.float32)
    wdy = tl.load(dy_ptr + base + cols, mask=in_row, other=0.0).to(tl.float32)
    if HAS_WEIGHT:
        wdy = wdy * tl.load(w_ptr + cols, mask=in_row, other=0.0).to(tl.float32)
    return tl.where(in_row, (x - mean) * rstd, 0.0), wdy


@triton.jit
def norm_backward_dx_chunked(
    dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, width,
    IS_RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dx of one row, the row sums taken over column chunks (pass 1) before dx is written (pass 2)."""
    row = tl.program_id(0).to(tl.int64)
    base = row * width
    rstd = tl.load(rstd_ptr + row)
    if IS_RMS:
        mean = 0.0
    else:
        mean = tl.load(mean_ptr + row)
    zero = tl.sum(tl.zeros([BLOCK_N], dtype=tl.float32), axis=0)
    sum_xhat_wdy, sum_wdy = zero, zero
    for start in range(0, width, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        xhat, wdy = _chunk_xhat_wdy(dy_ptr, x_ptr, w_ptr, base, cols, width, mean, rstd, HAS_WEIGHT)
        sum_xhat_wdy += tl.sum(xhat * wdy, axis=0)
        if not IS_RMS:
            sum_wdy += tl.sum(wdy, axis=0)
    c1 = sum_xhat_wdy / width
    c2 = sum_wdy / width
    for start in range(0, width, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        xhat, wdy = _chunk_xhat_wdy(dy_ptr, x_ptr, w_ptr, base, cols, width, mean, rstd, HAS_WEIGHT)
        dx = (wdy - (xhat * c1 + c2)) * rstd
        tl.store(dx_ptr + base + cols, dx.to(dx_ptr.dtype.element_ty), mask=cols < width)


@triton.jit
def norm_backward_dwdb(
    dy_ptr, x_ptr, mean_ptr, rstd_ptr, dw_partial_ptr, db_partial_ptr, rows, width,
    IS_RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Partial sums of dy * xhat and dy over the rows of group program_id(0), for the columns of block
    program_id(1); written to row program_id(0) of the [groups, width] partial buffers."""
    group = tl.program_id(0)
    groups = tl.num_programs(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_row = cols < width
    dw_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for first in range(group * BLOCK_M, rows, groups * BLOCK_M):
        row, in_rows, mask, offsets = _row_tile(first, rows, cols, width, BLOCK_M)
        dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        if HAS_WEIGHT:
            xhat, _ = _load_xhat(x_ptr, mean_ptr, rstd_ptr, row, in_rows, offsets, mask, IS_RMS)
            dw_acc += dy * xhat
        if HAS_BIAS:
            db_acc += dy
    _store_partials(dw_partial_ptr, db_partial_ptr, group, width, cols, dw_acc, db_acc, HAS_WEIGHT, HAS_BIAS)
