"""Per-token cross entropy over [tokens, vocab] logits: one program per token, looping over the
vocabulary in blocks with an online log-sum-exp, so any vocabulary size fits. The backward
recomputes softmax from the saved log-sum-exp. Ignored tokens get loss 0 and no gradient; a
target outside [0, vocab) gives NaN (checked without a host sync).
"""
import triton
import triton.language as tl

# Whether these kernels were built for Triton's CPU interpreter (TRITON_INTERPRET at import).
BUILT_FOR_INTERPRETER = triton.knobs.runtime.interpret


@triton.jit
def cross_entropy_forward(
    logits_ptr, targets_ptr, loss_ptr, lse_ptr, vocab, row_stride, ignore_index, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * row_stride
    total = tl.sum(tl.zeros([BLOCK], dtype=tl.float32), axis=0)
    running_max = total - float("inf")
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        v = tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(v, axis=0))
        total = total * tl.exp(running_max - new_max) + tl.sum(tl.exp(v - new_max), axis=0)
        running_max = new_max
    lse = running_max + tl.log(total)
    target = tl.load(targets_ptr + row)
    in_vocab = (target >= 0) & (target < vocab)
    target_logit = tl.load(base + tl.where(in_vocab, target, 0)).to(tl.float32)
    loss = tl.where(in_vocab, lse - target_logit, float("nan"))
    loss = tl.where(target == ignore_index, 0.0, loss)
    tl.store(loss_ptr + row, loss)
    tl.store(lse_ptr + row, lse)


@triton.jit
def cross_entropy_backward(
    logits_ptr, targets_ptr, lse_ptr, dloss_ptr, dlogits_ptr, vocab, row_stride, ignore_index,
    BLOCK: tl.constexpr,
):
    """dlogits = (softmax(logits) - onehot(target)) * dloss, zero for ignored tokens."""
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * row_stride
    target = tl.load(targets_ptr + row)
    lse = tl.load(lse_ptr + row)
    scale = tl.where(target == ignore_index, 0.0, tl.load(dloss_ptr + row).to(tl.float32))
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        in_vocab = cols < vocab
        v = tl.load(base + cols, mask=in_vocab, other=0.0).to(tl.float32)
        prob = tl.exp(v - lse)
        d = (prob - tl.where(cols == target, 1.0, 0.0)) * scale
        tl.store(dlogits_ptr + row * vocab + cols, d.to(dlogits_ptr.dtype.element_ty), mask=in_vocab)
