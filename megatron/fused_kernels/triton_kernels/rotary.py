"""Rotary embedding (rotate-half layout) on the first rotary dims of each head; one program per
(token, head) row. BACKWARD applies the transposed rotation, so one kernel serves both passes.
"""
import triton
import triton.language as tl

# Whether these kernels were built for Triton's CPU interpreter (TRITON_INTERPRET at import).
BUILT_FOR_INTERPRETER = triton.knobs.runtime.interpret


@triton.jit
def rotary_kernel(
    x_ptr, cos_ptr, sin_ptr, y_ptr, batch, seq, heads, head_dim, rot_half, pass_width,
    SEQ_FIRST: tl.constexpr, BACKWARD: tl.constexpr, HAS_PASS: tl.constexpr,
    BLOCK_ROT: tl.constexpr, BLOCK_PASS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    if SEQ_FIRST:
        pos = row // (batch * heads)
    else:
        pos = (row // heads) % seq
    base = row * head_dim
    i = tl.arange(0, BLOCK_ROT)
    m = i < rot_half
    x1 = tl.load(x_ptr + base + i, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + base + rot_half + i, mask=m, other=0.0).to(tl.float32)
    table = pos * (2 * rot_half)
    c1 = tl.load(cos_ptr + table + i, mask=m, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + table + rot_half + i, mask=m, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + table + i, mask=m, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + table + rot_half + i, mask=m, other=0.0).to(tl.float32)
    if BACKWARD:
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    tl.store(y_ptr + base + i, y1.to(y_ptr.dtype.element_ty), mask=m)
    tl.store(y_ptr + base + rot_half + i, y2.to(y_ptr.dtype.element_ty), mask=m)
    if HAS_PASS:
        j = tl.arange(0, BLOCK_PASS)
        mp = j < pass_width
        rest = tl.load(x_ptr + base + 2 * rot_half + j, mask=mp, other=0.0)
        tl.store(y_ptr + base + 2 * rot_half + j, rest, mask=mp)
