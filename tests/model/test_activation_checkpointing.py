"""Activation checkpointing (DeepSpeed, configured with our ParallelState) gives the same loss and
gradients as the plain model at TP=2, dropout included (the RNG streams are replayed)."""

import pytest
import torch

from megatron.model import build_model
from megatron.mpu import ParallelState, RNGStatesTracker, SingleProcessState
from tests.distributed_helpers import run_distributed
from tests.model.helpers import random_batch, tiny_config


def _loss_and_grads(model, inputs, labels):
    torch.manual_seed(5)
    loss = model.loss_fn(model(inputs), labels)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _bytes_kept_for_backward(model, inputs, labels) -> int:
    """Bytes of the tensors autograd keeps from one training forward for the backward pass (each time one is
    saved; recomputation keeps only the checkpoints' inputs)."""
    total = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model.loss_fn(model(inputs), labels)
    kept = total  # the backward's recomputation saves again, briefly, one checkpoint at a time
    loss.backward()
    return kept


def _compare(rank: int, world_size: int) -> None:
    inputs, labels = random_batch()
    common = dict(num_layers=3, attention_dropout=0.2, hidden_dropout=0.2, model_parallel_size=2)
    for extra in (
        dict(),
        dict(partition_activations=True, checkpoint_num_layers=2),
        dict(partition_activations=True, checkpoint_in_cpu=True),
        dict(sequence_parallel=True),
        dict(checkpoint_activations=False, recompute_granularity="selective"),  # the attention core only
    ):
        state = ParallelState(pipe_parallel_size=0, model_parallel_size=2)
        plain_args = tiny_config(**common, sequence_parallel=extra.get("sequence_parallel", False))
        plain = build_model(plain_args, state)
        # A tracker passed in is replaced by DeepSpeed's, whose streams the recomputation replays.
        ckpt = build_model(tiny_config(**{"checkpoint_activations": True, **common, **extra}), state,
                           RNGStatesTracker())
        ckpt.load_state_dict(plain.state_dict())
        loss_a, grads_a = _loss_and_grads(plain, inputs, labels)
        loss_b, grads_b = _loss_and_grads(ckpt, inputs, labels)
        torch.testing.assert_close(loss_b, loss_a, rtol=1e-6, atol=1e-6)
        for name, grad in grads_a.items():
            torch.testing.assert_close(grads_b[name], grad, rtol=1e-5, atol=1e-6, msg=f"{extra} {name}")
        state.destroy()
    saved = {}
    for name, extra in (("none", {}), ("selective", dict(recompute_granularity="selective")),
                        ("full", dict(checkpoint_activations=True))):
        state = ParallelState(pipe_parallel_size=0, model_parallel_size=2)
        saved[name] = _bytes_kept_for_backward(build_model(tiny_config(**common, seq_length=64, **extra), state),
                                               *random_batch(seq=64))
        state.destroy()
    # the attention core's [batch, heads, seq, seq] scores, probabilities and dropout mask go; full keeps less still
    assert saved["full"] < saved["selective"] < saved["none"] - 3 * 2 * 2 * 64 * 64 * 4, saved
    state = ParallelState(pipe_parallel_size=0, model_parallel_size=2)
    with pytest.raises(ValueError, match="partition_activations"):
        build_model(
            tiny_config(
                checkpoint_activations=True, partition_activations=True, sequence_parallel=True, model_parallel_size=2
            ),
            state,
        )
    with pytest.raises(ValueError, match="partition_activations"):
        build_model(tiny_config(checkpoint_activations=True, contiguous_checkpointing=True), state)
    state.destroy()


@pytest.mark.slow
def test_checkpointed_equals_plain_with_dropout_at_tp2():
    run_distributed(_compare, world_size=2)


def test_checkpointing_needs_a_world_and_valid_options():
    with pytest.raises(RuntimeError, match="torch.distributed"):
        build_model(tiny_config(checkpoint_activations=True), SingleProcessState())
