"""Linear + cross entropy over chunks of tokens (megatron.mpu.chunked_cross_entropy) against the unchunked head and
loss: equal losses and gradients in fp32 for any chunk size, and no [tokens, vocab] tensor ever allocated. The
tensor-parallel case is in tests/mpu/test_layers.py (its TP=2 spawn)."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from megatron.mpu import vocab_parallel_cross_entropy
from megatron.mpu.chunked_cross_entropy import (
    CHUNK_ALIGNMENT,
    default_chunk_tokens,
    exp_in_place,
    linear_cross_entropy,
    weighted_linear_cross_entropy,
)

ROWS, SEQ, HIDDEN, VOCAB = 3, 8, 16, 37
CHUNKS = [1, 5, 7, 24, 1000, None]  # 5 and 7 do not divide the 24 tokens; None is the default (one chunk here)


def _case(dtype=torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(ROWS, SEQ, HIDDEN, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(VOCAB, HIDDEN, generator=gen) * 0.5).to(dtype).requires_grad_()
    target = torch.randint(0, VOCAB, (ROWS, SEQ), generator=gen)
    mask = (torch.rand(ROWS, SEQ, generator=gen) > 0.3).float()
    return hidden, weight, target, mask


def _close(got: torch.Tensor, want: torch.Tensor, what: str, tol: float = 1e-6) -> None:
    print(f"{what}: max abs diff {(got.float() - want.float()).abs().max().item():.2e}")
    torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=what)


def test_weighted_loss_and_gradients_equal_the_unchunked_ones():
    hidden, weight, target, mask = _case()
    plain = torch.sum(vocab_parallel_cross_entropy(F.linear(hidden, weight), target, None) * mask)
    want = torch.autograd.grad(plain * 0.37, (hidden, weight))
    for chunk in CHUNKS:
        loss = weighted_linear_cross_entropy(hidden, weight, target, mask, chunk_tokens=chunk)
        got = torch.autograd.grad(loss * 0.37, (hidden, weight))
        _close(loss, plain, f"loss, chunk {chunk}")
        _close(got[0], want[0], f"input gradient, chunk {chunk}")
        _close(got[1], want[1], f"weight gradient, chunk {chunk}")


def test_per_token_losses_and_gradients_equal_the_unchunked_ones():
    hidden, weight, target, _ = _case(seed=1)
    upstream = torch.randn(ROWS, SEQ, generator=torch.Generator().manual_seed(2))
    plain = vocab_parallel_cross_entropy(F.linear(hidden, weight), target, None)
    want = torch.autograd.grad(plain, (hidden, weight), upstream)
    for chunk in CHUNKS:
        losses = linear_cross_entropy(hidden, weight, target, chunk_tokens=chunk)
        got = torch.autograd.grad(losses, (hidden, weight), upstream)
        assert losses.shape == target.shape and losses.dtype == torch.float32
        _close(losses, plain, f"losses, chunk {chunk}")
        _close(got[0], want[0], f"input gradient, chunk {chunk}")
        _close(got[1], want[1], f"weight gradient, chunk {chunk}")


def test_gradients_only_where_wanted_and_none_without_grad():
    hidden, weight, target, mask = _case(seed=3)
    frozen = weight.detach()
    plain = torch.sum(vocab_parallel_cross_entropy(F.linear(hidden, frozen), target, None) * mask)
    (want,) = torch.autograd.grad(plain, hidden)
    (got,) = torch.autograd.grad(weighted_linear_cross_entropy(hidden, frozen, target, mask, chunk_tokens=5), hidden)
    _close(got, want, "input gradient with a frozen weight")
    (got,) = torch.autograd.grad(linear_cross_entropy(hidden, frozen, target, chunk_tokens=5).sum(), hidden)
    (want,) = torch.autograd.grad(vocab_parallel_cross_entropy(F.linear(hidden, frozen), target, None).sum(), hidden)
    _close(got, want, "per-token input gradient with a frozen weight")
    with torch.no_grad():
        loss = weighted_linear_cross_entropy(hidden, weight, target, mask, chunk_tokens=5)
        losses = linear_cross_entropy(hidden, weight, target, chunk_tokens=5)
    assert loss.grad_fn is None and losses.grad_fn is None
    _close(loss, plain.detach(), "loss under no_grad")


@pytest.mark.parametrize("keep_dtype", [False, True])
def test_bfloat16_matches_the_unchunked_loss_in_its_precision(keep_dtype):
    hidden, weight, target, mask = _case(torch.bfloat16, seed=4)
    plain = torch.sum(vocab_parallel_cross_entropy(F.linear(hidden, weight), target, None,
                                                   keep_dtype=keep_dtype).float() * mask)
    want = torch.autograd.grad(plain, (hidden, weight))
    loss = weighted_linear_cross_entropy(hidden, weight, target, mask, keep_dtype=keep_dtype, chunk_tokens=7)
    got = torch.autograd.grad(loss, (hidden, weight))
    assert loss.dtype == torch.float32 and [g.dtype for g in got] == [torch.bfloat16] * 2
    tol = 3e-2 if keep_dtype else 1e-2
    torch.testing.assert_close(loss, plain, rtol=tol, atol=tol)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.float(), w.float(), rtol=tol, atol=tol)


class LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an operation returned while active (forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        sizes = [t.numel() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        self.largest = max([self.largest, *sizes])
        return out


def test_no_tokens_by_vocab_tensor_is_ever_made():
    tokens, hidden_size, vocab, chunk = 64, 4, 50, 8  # [tokens, vocab] 3200 elements; a chunk's 400
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(tokens, hidden_size, generator=gen, requires_grad=True)
    weight = torch.randn(vocab, hidden_size, generator=gen, requires_grad=True)
    target = torch.randint(0, vocab, (tokens,), generator=gen)
    runs = {"weighted": lambda: weighted_linear_cross_entropy(hidden, weight, target, torch.ones(tokens),
                                                               chunk_tokens=chunk),
            "per-token": lambda: linear_cross_entropy(hidden, weight, target, chunk_tokens=chunk).sum(),
            "unchunked": lambda: vocab_parallel_cross_entropy(F.linear(hidden, weight), target, None).sum()}
    largest = {}
    for name, run in runs.items():
        with LargestTensor() as mode:
            run().backward()
        largest[name] = mode.largest
    print(largest)
    assert largest["unchunked"] >= tokens * vocab  # the check sees the logits where they exist
    assert largest["weighted"] == largest["per-token"] == chunk * vocab


def test_default_chunk_keeps_a_chunks_logits_within_budget():
    assert default_chunk_tokens(50304) == 1280  # 1334 tokens' fp32 logits fit in 256 MiB; 128-aligned
    assert default_chunk_tokens(50304 // 8) % CHUNK_ALIGNMENT == 0
    assert default_chunk_tokens(10 ** 9) == 1


def test_cpu_chunks_stay_below_glibcs_fresh_mapping_size():
    """On a CPU a chunk's fp32 logits stay within CPU_CHUNK_LOGITS_BYTES (16 MiB: glibc maps 32 MiB afresh on every
    allocation), but a chunk has at least hidden-size tokens: the quickstart's 1024 tokens x 8192 vocabulary go in
    two chunks of 512, and the largest tensor the bf16 loss makes is one chunk's logits."""
    assert default_chunk_tokens(8192, 128, cpu=True) == 512
    assert default_chunk_tokens(50304, 768, cpu=True) == 768  # 83 tokens would fit: the hidden-size floor
    assert default_chunk_tokens(8192, 128) == 8192  # elsewhere CHUNK_LOGITS_BYTES alone
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(1024, 8, generator=gen).bfloat16().requires_grad_()
    weight = torch.randn(8192, 8, generator=gen).bfloat16().requires_grad_()
    target = torch.randint(0, 8192, (1024,), generator=gen)
    with LargestTensor() as mode:
        weighted_linear_cross_entropy(hidden, weight, target, torch.ones(1024)).backward()
    assert mode.largest == 512 * 8192


def test_bad_shapes_are_refused_with_the_shapes():
    hidden, weight, target, mask = _case()
    with pytest.raises(ValueError, match=r"hidden \(3, 8, 16\) does not match target \(3, 7\)"):
        linear_cross_entropy(hidden, weight, target[:, :7])
    with pytest.raises(ValueError, match=r"weight \(37, 15\) is not \[vocabulary shard, 16\]"):
        weighted_linear_cross_entropy(hidden, weight[:, :15], target, mask)
    with pytest.raises(ValueError, match="chunk_tokens must be >= 1"):
        linear_cross_entropy(hidden, weight, target, chunk_tokens=0)
    with pytest.raises(ValueError, match="token_weights has 23 elements"):
        weighted_linear_cross_entropy(hidden, weight, target, mask.reshape(-1)[:23])


@pytest.mark.gpu
def test_on_a_gpu_the_chunked_loss_matches_the_whole_one_in_a_fraction_of_the_memory():
    """125M-class head at 16k tokens in bf16: the chunked loss and gradients agree with the unchunked ones and its
    peak is a small fraction of theirs (printed with both times: the GPU run's record)."""
    tokens, width, vocab = 16384, 768, 50304
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(tokens, width, device="cuda", generator=gen).bfloat16().requires_grad_()
    weight = (torch.randn(vocab, width, device="cuda", generator=gen) * width ** -0.5).bfloat16().requires_grad_()
    target = torch.randint(0, vocab, (tokens,), device="cuda", generator=gen)
    mask = (torch.rand(tokens, device="cuda", generator=gen) > 0.1).float()
    runs = {"unchunked": lambda: torch.sum(vocab_parallel_cross_entropy(F.linear(hidden, weight), target, None) * mask),
            "chunked": lambda: weighted_linear_cross_entropy(hidden, weight, target, mask)}
    results = {}
    for name, run in list(runs.items()) * 2:  # the second round is timed
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        loss = run()
        grads = torch.autograd.grad(loss, (hidden, weight))
        end.record()
        torch.cuda.synchronize()
        results[name] = (loss, grads, (torch.cuda.max_memory_allocated() - base) / 2 ** 20, start.elapsed_time(end))
    for name, (_, _, peak, ms) in results.items():
        print(f"{name}: peak above inputs {peak:,.0f} MiB, forward + backward {ms:.2f} ms")
    (loss, grads, peak, _), (want, want_grads, want_peak, _) = results["chunked"], results["unchunked"]
    torch.testing.assert_close(loss, want, rtol=1e-3, atol=1e-3)
    for name, got, ref in zip(("input", "weight"), grads, want_grads):  # bf16: compare as vectors
        error = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
        print(f"{name} gradient: relative L2 error {error:.1e}")
        assert error < 1e-2
    assert peak < want_peak / 4


def test_exp_in_place_is_exp_to_float_rounding_where_the_loss_uses_it():
    """The loss exponentiates logits minus their row maximum (<= 0) through exp2 in fp32: within 2^-24 |x| (the
    rounding of x log2 e) plus exp2's own ulps of exp, exactly 1 at 0; half precision keeps exp itself."""
    x = torch.cat([torch.linspace(-40.0, 0.0, 100_001), torch.zeros(3)])
    got, want = exp_in_place(x.clone()), torch.exp(x.double())
    relative = ((got.double() - want) / want).abs()
    bound = 2.0 ** -24 * x.abs().double() + 2.0 ** -21
    print(f"worst relative error {relative.max().item():.2e}; worst against the bound "
          f"{(relative / bound).max().item():.2f}")
    assert torch.all(relative <= bound) and torch.all(got[-3:] == 1.0)
    half = torch.linspace(-8.0, 0.0, 101).bfloat16()
    assert torch.equal(exp_in_place(half.clone()), torch.exp(half))
