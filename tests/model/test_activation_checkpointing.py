"""Activation checkpointing (DeepSpeed, configured with our ParallelState) gives the same loss and
gradients as the plain model at TP=2, dropout included (the RNG streams are replayed), and recomputes exactly the
layers it checkpoints (recompute_method 'block': only the first recompute_num_layers); partition_activations halves
the inputs the checkpoints keep, and cpu_checkpointing moves them off the GPU."""

import pytest
import torch

from megatron.model.gpt2_model import build_model
from megatron.mpu import ParallelState, RNGStatesTracker, SingleProcessState
from tests.distributed_helpers import run_distributed
from tests.model.helpers import random_batch, tiny_config


def _loss_and_grads(model, inputs, labels):
    torch.manual_seed(5)
    loss = model.loss_fn(model(inputs), labels)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


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


def _layer_calls(model) -> list:
    """A list that counts the forward calls of each of ``model.layers`` (recomputation calls a layer again)."""
    calls = [0] * len(model.layers)
    for i, layer in enumerate(model.layers):
        layer.register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    return calls


def _compare(rank: int, world_size: int) -> None:
    inputs, labels = random_batch()
    common = dict(num_layers=3, attention_dropout=0.2, hidden_dropout=0.2, model_parallel_size=2)
    for extra, calls in (
        (dict(), [2, 2, 2]),
        (dict(partition_activations=True, checkpoint_num_layers=2), [2, 2, 2]),
        (dict(partition_activations=True, checkpoint_in_cpu=True), [2, 2, 2]),
        (dict(sequence_parallel=True), [2, 2, 2]),
        (dict(checkpoint_activations=False, recompute_granularity="selective"), [1, 1, 1]),  # the attention core
        (dict(recompute_method="block", recompute_num_layers=2), [2, 2, 1]),  # only the first 2 layers recompute
        # LoRA dropout: a row-parallel target's masks come from the tracker's stream, which recomputation replays
        (dict(lora=dict(r=4, alpha=8, dropout=0.3, target_modules=["query_key_value", "dense", "linear1", "linear2"])),
         [2, 2, 2]),
    ):
        state = ParallelState(pipe_parallel_size=0, model_parallel_size=2)
        plain_args = tiny_config(**common, sequence_parallel=extra.get("sequence_parallel", False),
                                 lora=extra.get("lora"))
        plain = build_model(plain_args, state)
        # A tracker passed in is replaced by DeepSpeed's, whose streams the recomputation replays.
        ckpt = build_model(tiny_config(**{"checkpoint_activations": True, **common, **extra}), state,
                           RNGStatesTracker())
        ckpt.load_state_dict(plain.state_dict())
        counted = _layer_calls(ckpt)
        loss_a, grads_a = _loss_and_grads(plain, inputs, labels)
        loss_b, grads_b = _loss_and_grads(ckpt, inputs, labels)
        assert counted == calls, (extra, counted)
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
    return _saved_activation_bytes(rank, world_size, "cpu")  # in the same processes: a spawn costs seconds


@pytest.mark.slow
def test_checkpointed_equals_plain_with_dropout_at_tp2_and_partitioning_halves_the_saved_inputs():
    """Each of the 4 checkpoints of the second model keeps its [4, 16, 32] fp32 input (8 KiB); partitioned over 2
    ranks, half of it, with equal losses. checkpoint_in_cpu on the CPU accelerator keeps them where they are (and
    trains: DeepSpeed's own CPU copy would empty them)."""
    results = run_distributed(_compare, world_size=2)[0]
    full = 4 * 16 * 32 * 4
    assert results["checkpointed"][0] == 4 * full
    assert results["partitioned"][0] == 4 * full // 2
    assert results["partitioned_in_cpu"][0] == results["partitioned"][0]
    losses = {name: loss for name, (_, loss) in results.items()}
    assert len(set(losses.values())) == 1, losses


def test_checkpointing_needs_a_world_and_valid_options():
    with pytest.raises(RuntimeError, match="torch.distributed"):
        build_model(tiny_config(checkpoint_activations=True), SingleProcessState())


def _data_of(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor that holds a checkpoint's saved input: DeepSpeed's copy in ``saved_data`` (a partition, or the
    blocking copy to the CPU), or, where DeepSpeed 0.19 offloads asynchronously (cpu_checkpointing on CUDA: the input
    is emptied and marked ``ds_offload_id``), its offload engine's: the newest input and any copy still in flight
    stay on the GPU (keep_last / forward stash), the others in pinned host memory; else the input itself."""
    kept = getattr(tensor, "saved_data", None)
    if kept is not None:
        return kept
    token = getattr(tensor, "ds_offload_id", None)
    if token is None:
        return tensor
    from deepspeed.runtime.activation_checkpointing import checkpointing

    engine = checkpointing._cpu_offload_engine
    if token in engine._keep_last:
        return engine._keep_last[token]
    if token in engine._fwd_stash:
        return engine._fwd_stash[token][0]
    return engine._tracker[token][0]


def saved_checkpoint_bytes(model, inputs, labels, device_type: str):
    """(bytes that DeepSpeed's checkpoints keep on ``device_type`` for the backward of one step, the loss): the
    floating-point inputs (activations; not masks or DeepSpeed's size records) saved by every CheckpointFunction
    node of the autograd graph."""
    loss = model.loss_fn(model(inputs), labels)
    total, seen, stack = 0, set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if "CheckpointFunction" in type(node).__name__:
            for tensor in node.deepspeed_saved_tensors:
                kept = _data_of(tensor) if torch.is_tensor(tensor) else None
                if torch.is_tensor(kept) and kept.is_floating_point() and kept.device.type == device_type:
                    total += kept.numel() * kept.element_size()
        stack.extend(next_node for next_node, _ in node.next_functions)
    loss.backward()
    return total, loss.item()


SAVED_CASES = {"checkpointed": {}, "partitioned": dict(partition_activations=True),
               "in_cpu": dict(checkpoint_in_cpu=True), "partitioned_in_cpu": dict(partition_activations=True,
                                                                                   checkpoint_in_cpu=True)}


def _saved_activation_bytes(rank: int, world_size: int, device_type: str, num_layers: int = 4):
    """{case: (saved bytes on device_type, loss)} for the SAVED_CASES at TP=world_size."""
    inputs, labels = random_batch(batch=4, seq=16)
    if device_type == "cuda":
        inputs, labels = [tuple(t.cuda() for t in part) for part in (inputs, labels)]
    results = {}
    for name, extra in SAVED_CASES.items():
        state = ParallelState(pipe_parallel_size=0, model_parallel_size=world_size)
        torch.manual_seed(0)
        config = tiny_config(num_layers=num_layers, model_parallel_size=world_size, checkpoint_activations=True,
                             **extra)
        model = build_model(config, state, RNGStatesTracker())
        results[name] = saved_checkpoint_bytes(model.to(device_type), inputs, labels, device_type)
        state.destroy()
    return results


@pytest.mark.gpu
def test_cpu_checkpointing_moves_the_saved_inputs_off_the_gpu():
    """8 checkpoints of [4, 16, 32] fp32 inputs: all on the GPU without checkpoint_in_cpu; with it DeepSpeed 0.19
    copies them to the host asynchronously and keeps only the newest (which the first recomputation needs at once)
    and the one whose copy may still be in flight on the GPU (DeepSpeed's CUDA accelerator: tests.accelerator)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    results = run_distributed(_saved_activation_bytes, world_size=1, args=("cuda", 8))[0]
    full = 4 * 16 * 32 * 4
    print({name: saved for name, (saved, _) in results.items()})
    assert results["checkpointed"][0] == 8 * full
    assert results["in_cpu"][0] <= 2 * full
    assert results["in_cpu"][1] == pytest.approx(results["checkpointed"][1], rel=1e-6)
