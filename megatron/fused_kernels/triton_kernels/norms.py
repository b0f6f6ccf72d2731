"""LayerNorm and RMSNorm over the last dimension: forward one program per row, backward a fixed
number of programs that each walk a strided set of rows and keep their weight/bias gradient
partials in registers (written once per program and summed by the caller).

IS_RMS selects RMSNorm (no mean subtraction). Statistics and arithmetic are fp32.
"""
import triton
import triton.language as tl

# Whether these kernels were built for Triton's CPU interpreter (TRITON_INTERPRET at import).
BUILT_FOR_INTERPRETER = triton.knobs.runtime.interpret


@triton.jit
def norm_forward(
    x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, width, eps,
    IS_RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    in_row = cols < width
    x = tl.load(x_ptr + row * width + cols, mask=in_row, other=0.0).to(tl.float32)
    if IS_RMS:
        centered = x
    else:
        mean = tl.sum(x, axis=0) / width
        centered = tl.where(in_row, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centered * centered, axis=0) / width + eps)
    y = centered * rstd
    if HAS_WEIGHT:
        y = y * tl.load(w_ptr + cols, mask=in_row, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y = y + tl.load(b_ptr + cols, mask=in_row, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * width + cols, y.to(y_ptr.dtype.element_ty), mask=in_row)
    if not IS_RMS:
        tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def norm_backward(
    dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_partial_ptr, db_partial_ptr, rows, width,
    IS_RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
):
    """dx per row; per-program fp32 partial sums of dweight = dy * xhat and dbias = dy."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    in_row = cols < width
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=in_row, other=0.0).to(tl.float32)
    else:
        w = tl.where(in_row, 1.0, 0.0)
    dw_acc = tl.zeros([BLOCK], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK], dtype=tl.float32)
    for row in range(pid, rows, programs):
        offset = tl.cast(row, tl.int64) * width
        x = tl.load(x_ptr + offset + cols, mask=in_row, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offset + cols, mask=in_row, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        if IS_RMS:
            xhat = x * rstd
        else:
            xhat = tl.where(in_row, (x - tl.load(mean_ptr + row)) * rstd, 0.0)
        wdy = w * dy
        c1 = tl.sum(xhat * wdy, axis=0) / width
        if IS_RMS:
            dx = (wdy - xhat * c1) * rstd
        else:
            c2 = tl.sum(wdy, axis=0) / width
            dx = (wdy - (xhat * c1 + c2)) * rstd
        tl.store(dx_ptr + offset + cols, dx.to(dx_ptr.dtype.element_ty), mask=in_row)
        dw_acc += dy * xhat
        db_acc += dy
    if HAS_WEIGHT:
        tl.store(dw_partial_ptr + pid * width + cols, dw_acc, mask=in_row)
    if HAS_BIAS:
        tl.store(db_partial_ptr + pid * width + cols, db_acc, mask=in_row)
