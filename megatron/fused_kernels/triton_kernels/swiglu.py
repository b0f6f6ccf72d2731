"""SwiGLU: y = silu(gate) * up, elementwise; gate and up may be row-strided views (e.g. the two
halves of one projection) as long as their last dim is contiguous.
"""
import triton
import triton.language as tl

# Whether these kernels were built for Triton's CPU interpreter (TRITON_INTERPRET at import).
BUILT_FOR_INTERPRETER = triton.knobs.runtime.interpret


@triton.jit
def swiglu_forward(g_ptr, u_ptr, y_ptr, n, width, g_row_stride, u_row_stride, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    row = offs // width
    col = offs % width
    g = tl.load(g_ptr + row * g_row_stride + col, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * u_row_stride + col, mask=m, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def swiglu_backward(
    dy_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, n, width, g_row_stride, u_row_stride, BLOCK: tl.constexpr
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    row = offs // width
    col = offs % width
    g = tl.load(g_ptr + row * g_row_stride + col, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * u_row_stride + col, mask=m, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + offs, mask=m, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    dg = dy * u * sig * (1.0 + g * (1.0 - sig))
    du = dy * g * sig
    tl.store(dg_ptr + offs, dg.to(dg_ptr.dtype.element_ty), mask=m)
    tl.store(du_ptr + offs, du.to(du_ptr.dtype.element_ty), mask=m)
