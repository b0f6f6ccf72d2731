"""Tensor-parallel layers, collectives, cross entropy (also chunked with the head's matmul) and batch broadcast at
TP=2 against TP=1."""

import pytest
import torch
import torch.nn.functional as F

from megatron.mpu import (
    ColumnParallelLinear,
    ParallelState,
    RNGStatesTracker,
    RowParallelLinear,
    SingleProcessState,
    VocabParallelEmbedding,
    broadcast_data,
    gather_from_sequence_parallel_region,
    model_parallel_seed,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    shard_of,
    vocab_parallel_cross_entropy,
)
from megatron.mpu.chunked_cross_entropy import linear_cross_entropy, weighted_linear_cross_entropy
from tests.distributed_helpers import run_distributed


def _seeded_normal(seed: int):
    def init(t: torch.Tensor) -> None:
        torch.nn.init.normal_(t, std=0.5, generator=torch.Generator().manual_seed(seed))

    return init


def _mlp_and_loss(ps, x, tokens, targets, sequence_parallel=False, loss="logits"):
    """loss 'logits': the head's logits and vocab_parallel_cross_entropy; 'weighted' / 'per_token': the head's input
    and weight through megatron.mpu.chunked_cross_entropy in chunks of 3 tokens (not dividing the 8)."""
    emb = VocabParallelEmbedding(16, 8, ps, _seeded_normal(1), sequence_parallel=sequence_parallel)
    col = ColumnParallelLinear(8, 12, ps, _seeded_normal(2), sequence_parallel=sequence_parallel)
    row = RowParallelLinear(12, 8, ps, _seeded_normal(3), sequence_parallel=sequence_parallel)
    head = ColumnParallelLinear(8, 16, ps, _seeded_normal(4), bias=False)
    with torch.no_grad():
        row.bias.fill_(0.25)
    group = ps.get_model_parallel_group()
    h = emb(tokens) + x if not sequence_parallel else emb(tokens) + scatter_to_sequence_parallel_region(x, group)
    h = row(torch.tanh(col(h)))
    if sequence_parallel:
        h = gather_from_sequence_parallel_region(h, group, tensor_parallel_output_grad=False)
    if loss == "logits":
        logits = head(h)
        loss = vocab_parallel_cross_entropy(logits, targets, group).mean()
    else:
        with torch.no_grad():
            logits = head(h)
        if loss == "weighted":
            loss = weighted_linear_cross_entropy(head.local_input(h), head.weight, targets, torch.ones(targets.shape),
                                                 group, chunk_tokens=3) / targets.numel()
        else:
            loss = linear_cross_entropy(head.local_input(h), head.weight, targets, group, chunk_tokens=3).mean()
    loss.backward()
    return loss, logits, emb, col, row, head


def _tp2_equals_tp1(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 4, 8, requires_grad=True)
    tokens = torch.randint(0, 16, (2, 4))
    targets = torch.randint(0, 16, (2, 4))
    ref = _mlp_and_loss(SingleProcessState(), x, tokens, targets)
    ref_xgrad = x.grad.clone()
    for sp, loss in ((False, "logits"), (True, "logits"), (False, "weighted"), (True, "per_token")):
        x.grad = None
        ps = ParallelState(pipe_parallel_size=0, model_parallel_size=2)
        out = _mlp_and_loss(ps, x, tokens, targets, sequence_parallel=sp, loss=loss)
        torch.testing.assert_close(out[0], ref[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out[1], ref[1].chunk(2, dim=-1)[rank], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(x.grad, ref_xgrad, rtol=1e-5, atol=1e-6)
        emb, col, row, head = out[2:]
        r_emb, r_col, r_row, r_head = ref[2:]
        torch.testing.assert_close(emb.weight.grad, shard_of(r_emb.weight.grad, 0, rank, 2), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(col.weight.grad, shard_of(r_col.weight.grad, 0, rank, 2), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(col.bias.grad, shard_of(r_col.bias.grad, 0, rank, 2), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(row.weight.grad, shard_of(r_row.weight.grad, 1, rank, 2), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(row.bias.grad, r_row.bias.grad, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(head.weight.grad, shard_of(r_head.weight.grad, 0, rank, 2), rtol=1e-5, atol=1e-6)

        # Sequence-parallel collectives are each other's inverse and sum correctly.
        group = ps.get_model_parallel_group()
        y = torch.arange(2 * 4 * 3, dtype=torch.float32).view(2, 4, 3) * (rank + 1)
        rs = reduce_scatter_to_sequence_parallel_region(y, group)
        torch.testing.assert_close(rs, (y / (rank + 1) * 3).chunk(2, dim=1)[rank])
        torch.testing.assert_close(gather_from_sequence_parallel_region(rs, group), y / (rank + 1) * 3)

        # Default stream: same on both TP ranks; model-parallel stream: different per TP rank.
        tracker = RNGStatesTracker()
        model_parallel_seed(11, ps, tracker)
        shared = torch.rand(4)
        with tracker.fork():
            own = torch.rand(4)
        both = [torch.empty(8), torch.empty(8)]
        torch.distributed.all_gather(both, torch.cat([shared, own]), group=group)
        assert torch.equal(both[0][:4], both[1][:4]) and not torch.equal(both[0][4:], both[1][4:])

        data = {"text": torch.arange(10).view(2, 5) if rank == 0 else None}
        got = broadcast_data(["text"], data if rank == 0 else None, torch.int64, ps)
        assert torch.equal(got["text"], torch.arange(10).view(2, 5))
        ps.destroy()


@pytest.mark.slow
def test_tp2_layers_match_tp1():
    run_distributed(_tp2_equals_tp1, world_size=2)


def test_vocab_parallel_cross_entropy_matches_torch():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11, requires_grad=True)
    target = torch.randint(0, 11, (3, 5))
    before = logits.detach().clone()
    ours = vocab_parallel_cross_entropy(logits, target, None)
    ref = F.cross_entropy(logits.view(-1, 11), target.view(-1), reduction="none").view(3, 5)
    torch.testing.assert_close(ours, ref)
    g = torch.randn(3, 5)
    (gl,) = torch.autograd.grad(ours, logits, g)
    (gr,) = torch.autograd.grad(ref, logits, g)
    torch.testing.assert_close(gl, gr)
    torch.testing.assert_close(logits.detach(), before, rtol=0, atol=0)  # the in-place backward spared them
    half = logits.detach().bfloat16().requires_grad_()  # computed in fp32, gradient back in bf16
    (gh,) = torch.autograd.grad(vocab_parallel_cross_entropy(half, target, None), half, g)
    assert gh.dtype == torch.bfloat16


def test_sharded_cross_entropy_function_matches_torch_on_one_shard():
    """The function used when the vocabulary is split (with one shard here): its fused forward and its
    in-place backward must equal PyTorch's, including targets outside the shard."""
    from megatron.mpu.cross_entropy import _VocabParallelCrossEntropy

    torch.manual_seed(1)
    logits = torch.randn(4, 6, 13, requires_grad=True)
    target = torch.randint(0, 13, (4, 6))
    ours = _VocabParallelCrossEntropy.apply(logits, target, None, False)
    ref = F.cross_entropy(logits.view(-1, 13), target.view(-1), reduction="none").view(4, 6)
    torch.testing.assert_close(ours, ref)
    g = torch.randn(4, 6)
    (gl,) = torch.autograd.grad(ours, logits, g)
    (gr,) = torch.autograd.grad(ref, logits, g)
    torch.testing.assert_close(gl, gr)


def test_shard_of_chunks_keeps_each_block_share():
    full = torch.arange(8)
    assert shard_of(full, 0, 1, 2, chunks=2).tolist() == [2, 3, 6, 7]
    assert shard_of(full, 0, 0, 2).tolist() == [0, 1, 2, 3]


def test_rng_tracker_fork_is_separate_stream():
    tracker = RNGStatesTracker()
    tracker.add("a", 7)
    torch.manual_seed(1)
    before = torch.rand(3)
    torch.manual_seed(1)
    with tracker.fork("a"):
        forked = torch.rand(3)
    after = torch.rand(3)
    torch.testing.assert_close(after, before)  # the default stream did not advance
    torch.manual_seed(7)
    torch.testing.assert_close(forked, torch.rand(3))
    with pytest.raises(ValueError):
        tracker.add("a", 8)


def test_cross_entropy_keep_dtype_stays_in_half_precision():
    torch.manual_seed(0)
    logits = torch.randn(4, 7, 32)
    target = torch.randint(0, 32, (4, 7))
    half = vocab_parallel_cross_entropy(logits.bfloat16().requires_grad_(), target, None, keep_dtype=True)
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), vocab_parallel_cross_entropy(logits, target, None),
                               rtol=3e-2, atol=3e-2)
