"""Row-wise scaled softmax kernels with causal or explicit masking; one program per row.

All arithmetic is in fp32 whatever the storage dtype. The whole row is one block, which
covers the key lengths a GPT uses (a 32k-key row is 128 KiB of fp32 registers spread
over the program's warps).
"""
import triton
import triton.language as tl

# Whether these kernels were built for Triton's CPU interpreter (TRITON_INTERPRET at import).
BUILT_FOR_INTERPRETER = triton.knobs.runtime.interpret


@triton.jit
def causal_softmax_forward(x_ptr, y_ptr, scale, seq_q, seq_k, BLOCK: tl.constexpr):
    """y = softmax(scale * x) where key j is visible to query i iff j <= i + (seq_k - seq_q)."""
    row = tl.program_id(0).to(tl.int64)
    query = row % seq_q
    cols = tl.arange(0, BLOCK)
    in_row = cols < seq_k
    visible = in_row & (cols <= query + (seq_k - seq_q))
    x = tl.load(x_ptr + row * seq_k + cols, mask=in_row, other=0.0).to(tl.float32) * scale
    x = tl.where(visible, x, float("-inf"))
    e = tl.where(visible, tl.exp(x - tl.max(x, axis=0)), 0.0)
    y = e / tl.sum(e, axis=0)
    tl.store(y_ptr + row * seq_k + cols, y.to(y_ptr.dtype.element_ty), mask=in_row)


@triton.jit
def masked_softmax_forward(
    x_ptr, mask_ptr, y_ptr, scale, heads, seq_q, seq_k,
    mask_stride_b, mask_stride_h, mask_stride_q, mask_stride_k,
    FILL: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK: tl.constexpr,
):
    """y = softmax(masked_fill(scale * x, mask, FILL)) for x [batch, heads, seq_q, seq_k].

    The mask (nonzero = hidden) may broadcast over batch, heads or queries through zero strides.
    """
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    in_row = cols < seq_k
    x = tl.load(x_ptr + row * seq_k + cols, mask=in_row, other=0.0).to(tl.float32) * scale
    if HAS_MASK:
        b = row // (heads * seq_q)
        h = (row // seq_q) % heads
        q = row % seq_q
        m_ptr = mask_ptr + b * mask_stride_b + h * mask_stride_h + q * mask_stride_q
        hidden = tl.load(m_ptr + cols * mask_stride_k, mask=in_row, other=0) != 0
        x = tl.where(hidden, FILL, x)
    x = tl.where(in_row, x, float("-inf"))
    e = tl.where(in_row, tl.exp(x - tl.max(x, axis=0)), 0.0)
    y = e / tl.sum(e, axis=0)
    tl.store(y_ptr + row * seq_k + cols, y.to(y_ptr.dtype.element_ty), mask=in_row)


@triton.jit
def softmax_backward(
    dy_ptr, y_ptr, dx_ptr, mask_ptr, scale, heads, seq_q, seq_k,
    mask_stride_b, mask_stride_h, mask_stride_q, mask_stride_k,
    HAS_MASK: tl.constexpr, BLOCK: tl.constexpr,
):
    """dx = scale * y * (dy - sum(dy * y)), zero where the mask hid the input (masked_fill has no gradient there)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    in_row = cols < seq_k
    y = tl.load(y_ptr + row * seq_k + cols, mask=in_row, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + row * seq_k + cols, mask=in_row, other=0.0).to(tl.float32)
    dx = scale * y * (dy - tl.sum(dy * y, axis=0))
    if HAS_MASK:
        b = row // (heads * seq_q)
        h = (row // seq_q) % heads
        q = row % seq_q
        m_ptr = mask_ptr + b * mask_stride_b + h * mask_stride_h + q * mask_stride_q
        hidden = tl.load(m_ptr + cols * mask_stride_k, mask=in_row, other=0) != 0
        dx = tl.where(hidden, 0.0, dx)
    tl.store(dx_ptr + row * seq_k + cols, dx.to(dx_ptr.dtype.element_ty), mask=in_row)
