"""Row-wise scaled softmax kernels with causal or explicit masking; one program per row.

All arithmetic is in fp32 whatever the storage dtype. Rows up to the launch config's single-block
limit (:mod:`megatron.fused_kernels.launch_config`) are one block held in registers; longer rows
(e.g. 32k keys, which would spill) take the ``*_chunked`` kernels, which split the reduction over
column chunks: the forward keeps a running max and rescaled sum (online softmax) in pass 1 and
writes the output in pass 2; the backward sums dy * y in pass 1 and writes dx in pass 2 (the
second pass re-reads the row, from L2). The causal forward skips the chunks past the last
visible key in pass 1.
"""
import triton
import triton.language as tl

# Whether these kernels were built for Triton's CPU interpreter (TRITON_INTERPRET at import).
BUILT_FOR_INTERPRETER = triton.knobs.runtime.interpret


@triton.jit
def _causal_limit(row, seq_q, seq_k):
    """The number of keys the query of this row sees (key j is visible iff j <= query + seq_k - seq_q)."""
    return tl.minimum(row % seq_q + (seq_k - seq_q) + 1, seq_k)


@triton.jit
def _masked_scores(x_ptr, m_ptr, base, cols, scale, seq_k, mask_stride_k, FILL: tl.constexpr,
                   HAS_MASK: tl.constexpr):
    """scale * x with hidden keys set to FILL and keys past the row's end to -inf."""
    in_row = cols < seq_k
    x = tl.load(x_ptr + base + cols, mask=in_row, other=0.0).to(tl.float32) * scale
    if HAS_MASK:
        hidden = tl.load(m_ptr + cols * mask_stride_k, mask=in_row, other=0) != 0
        x = tl.where(hidden, FILL, x)
    return tl.where(in_row, x, float("-inf"))


@triton.jit
def _mask_row_pointer(mask_ptr, row, heads, seq_q, mask_stride_b, mask_stride_h, mask_stride_q):
    b = row // (heads * seq_q)
    h = (row // seq_q) % heads
    q = row % seq_q
    return mask_ptr + b * mask_stride_b + h * mask_stride_h + q * mask_stride_q


@triton.jit
def causal_softmax_forward(x_ptr, y_ptr, scale, seq_q, seq_k, BLOCK: tl.constexpr):
    """y = softmax(scale * x) where key j is visible to query i iff j <= i + (seq_k - seq_q)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    in_row = cols < seq_k
    visible = cols < _causal_limit(row, seq_q, seq_k)
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
    m_ptr = _mask_row_pointer(mask_ptr, row, heads, seq_q, mask_stride_b, mask_stride_h, mask_stride_q)
    x = _masked_scores(x_ptr, m_ptr, row * seq_k, cols, scale, seq_k, mask_stride_k, FILL, HAS_MASK)
    e = tl.exp(x - tl.max(x, axis=0))
    y = e / tl.sum(e, axis=0)
    tl.store(y_ptr + row * seq_k + cols, y.to(y_ptr.dtype.element_ty), mask=cols < seq_k)


@triton.jit
def _load_y_dy(y_ptr, dy_ptr, base, cols, seq_k):
    in_row = cols < seq_k
    y = tl.load(y_ptr + base + cols, mask=in_row, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + base + cols, mask=in_row, other=0.0).to(tl.float32)
    return y, dy


@triton.jit
def _store_grad(dx_ptr, m_ptr, base, cols, seq_k, mask_stride_k, y, dy, dot, scale, HAS_MASK: tl.constexpr):
    """dx = scale * y * (dy - dot) at these columns, zero where the mask hid the input."""
    in_row = cols < seq_k
    dx = scale * y * (dy - dot)
    if HAS_MASK:
        hidden = tl.load(m_ptr + cols * mask_stride_k, mask=in_row, other=0) != 0
        dx = tl.where(hidden, 0.0, dx)
    tl.store(dx_ptr + base + cols, dx.to(dx_ptr.dtype.element_ty), mask=in_row)


@triton.jit
def softmax_backward(
    dy_ptr, y_ptr, dx_ptr, mask_ptr, scale, heads, seq_q, seq_k,
    mask_stride_b, mask_stride_h, mask_stride_q, mask_stride_k,
    HAS_MASK: tl.constexpr, BLOCK: tl.constexpr,
):
    """dx = scale * y * (dy - sum(dy * y)), zero where the mask hid the input (masked_fill has no gradient there)."""
    row = tl.program_id(0).to(tl.int64)
    base = row * seq_k
    cols = tl.arange(0, BLOCK)
    y, dy = _load_y_dy(y_ptr, dy_ptr, base, cols, seq_k)
    m_ptr = _mask_row_pointer(mask_ptr, row, heads, seq_q, mask_stride_b, mask_stride_h, mask_stride_q)
    _store_grad(dx_ptr, m_ptr, base, cols, seq_k, mask_stride_k, y, dy, tl.sum(dy * y, axis=0), scale, HAS_MASK)


@triton.jit
def causal_softmax_forward_chunked(x_ptr, y_ptr, scale, seq_q, seq_k, BLOCK: tl.constexpr):
    """causal_softmax_forward for rows longer than one block."""
    row = tl.program_id(0).to(tl.int64)
    base = row * seq_k
    visible_keys = _causal_limit(row, seq_q, seq_k)
    zero = tl.sum(tl.zeros([BLOCK], dtype=tl.float32), axis=0)
    running_max, total = zero - float("inf"), zero
    for start in range(0, visible_keys, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        visible = cols < visible_keys
        x = tl.load(x_ptr + base + cols, mask=visible, other=0.0).to(tl.float32) * scale
        x = tl.where(visible, x, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(x, axis=0))
        total = total * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
        running_max = new_max
    for start in range(0, seq_k, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        visible = cols < visible_keys
        x = tl.load(x_ptr + base + cols, mask=visible, other=0.0).to(tl.float32) * scale
        y = tl.where(visible, tl.exp(x - running_max) / total, 0.0)
        tl.store(y_ptr + base + cols, y.to(y_ptr.dtype.element_ty), mask=cols < seq_k)


@triton.jit
def masked_softmax_forward_chunked(
    x_ptr, mask_ptr, y_ptr, scale, heads, seq_q, seq_k,
    mask_stride_b, mask_stride_h, mask_stride_q, mask_stride_k,
    FILL: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK: tl.constexpr,
):
    """masked_softmax_forward for rows longer than one block."""
    row = tl.program_id(0).to(tl.int64)
    base = row * seq_k
    m_ptr = _mask_row_pointer(mask_ptr, row, heads, seq_q, mask_stride_b, mask_stride_h, mask_stride_q)
    zero = tl.sum(tl.zeros([BLOCK], dtype=tl.float32), axis=0)
    running_max, total = zero - float("inf"), zero
    for start in range(0, seq_k, BLOCK):
        x = _masked_scores(x_ptr, m_ptr, base, start + tl.arange(0, BLOCK), scale, seq_k, mask_stride_k, FILL,
                           HAS_MASK)
        new_max = tl.maximum(running_max, tl.max(x, axis=0))
        total = total * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
        running_max = new_max
    for start in range(0, seq_k, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = _masked_scores(x_ptr, m_ptr, base, cols, scale, seq_k, mask_stride_k, FILL, HAS_MASK)
        y = tl.exp(x - running_max) / total
        tl.store(y_ptr + base + cols, y.to(y_ptr.dtype.element_ty), mask=cols < seq_k)


@triton.jit
def softmax_backward_chunked(
    dy_ptr, y_ptr, dx_ptr, mask_ptr, scale, heads, seq_q, seq_k,
    mask_stride_b, mask_stride_h, mask_stride_q, mask_stride_k,
    HAS_MASK: tl.constexpr, BLOCK: tl.constexpr,
):
    """softmax_backward for rows longer than one block."""
    row = tl.program_id(0).to(tl.int64)
    base = row * seq_k
    dot = tl.sum(tl.zeros([BLOCK], dtype=tl.float32), axis=0)
    for start in range(0, seq_k, BLOCK):
        y, dy = _load_y_dy(y_ptr, dy_ptr, base, start + tl.arange(0, BLOCK), seq_k)
        dot += tl.sum(dy * y, axis=0)
    m_ptr = _mask_row_pointer(mask_ptr, row, heads, seq_q, mask_stride_b, mask_stride_h, mask_stride_q)
    for start in range(0, seq_k, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        y, dy = _load_y_dy(y_ptr, dy_ptr, base, cols, seq_k)
        _store_grad(dx_ptr, m_ptr, base, cols, seq_k, mask_stride_k, y, dy, dot, scale, HAS_MASK)
