"""Activation checkpointing through DeepSpeed (``deepspeed.checkpointing``).

DeepSpeed keeps its checkpointing settings and its RNG tracker in its own module state; this module is
the one place that configures them from neox_args and the ParallelState. When checkpointing is on, the
model draws model-parallel dropout from DeepSpeed's tracker, so that recomputation in the backward pass
replays exactly the dropout masks of the forward pass.

Options: checkpoint_activations (on/off), checkpoint_num_layers (transformer layers per checkpoint),
partition_activations (split saved inputs across the model-parallel group), contiguous_checkpointing
(needs partition_activations), checkpoint_in_cpu, synchronize_each_layer, profile_backward.
"""
from __future__ import annotations

from typing import Callable

import deepspeed
import torch

from megatron.deepspeed_comm import init_deepspeed_comm
from megatron.mpu.random import model_parallel_seed


def checkpointing_enabled(neox_args) -> bool:
    return bool(getattr(neox_args, "checkpoint_activations", False))


def configure_activation_checkpointing(neox_args, parallel_state) -> None:
    """Configure DeepSpeed's activation checkpointing with our ParallelState as its mpu."""
    if not deepspeed.comm.is_initialized():
        if not torch.distributed.is_initialized():
            raise RuntimeError("checkpoint_activations needs an initialised torch.distributed world "
                               "(DeepSpeed's activation checkpointing communicates through deepspeed.comm)")
        init_deepspeed_comm(torch.distributed.get_backend(), dist_init_required=False)
    partition = bool(getattr(neox_args, "partition_activations", False))
    contiguous = bool(getattr(neox_args, "contiguous_checkpointing", False))
    if contiguous and not partition:
        raise ValueError("contiguous_checkpointing needs partition_activations=True")
    if partition and getattr(neox_args, "sequence_parallel", False) and \
            parallel_state.get_model_parallel_world_size() > 1:
        raise ValueError("partition_activations with sequence_parallel is not supported: the checkpointed "
                         "activations already differ across model-parallel ranks")
    deepspeed.checkpointing.configure(
        mpu_=parallel_state,
        partition_activations=partition,
        contiguous_checkpointing=contiguous,
        num_checkpoints=number_of_checkpoints(neox_args),
        checkpoint_in_cpu=bool(getattr(neox_args, "checkpoint_in_cpu", False)),
        synchronize=bool(getattr(neox_args, "synchronize_each_layer", False)),
        profile=bool(getattr(neox_args, "profile_backward", False)),
    )


def number_of_checkpoints(neox_args) -> int:
    """How many checkpoints DeepSpeed keeps contiguous buffers for: activation_checkpointing.number_checkpoints,
    which NeoXArgs derives as ceil(num_layers / checkpoint_num_layers) unless the config sets more."""
    section = getattr(neox_args, "activation_checkpointing", None) or {}
    if section.get("number_checkpoints"):
        return int(section["number_checkpoints"])
    return -(-int(neox_args.num_layers) // max(int(getattr(neox_args, "checkpoint_num_layers", 1) or 1), 1))


def checkpointing_rng_tracker(neox_args, parallel_state):
    """DeepSpeed's RNG tracker, seeded like ``model_parallel_seed`` (the default stream is left as is)."""
    tracker = deepspeed.checkpointing.get_cuda_rng_tracker()
    with torch.random.fork_rng():  # seed the tracker only; leave the default stream alone
        model_parallel_seed(int(getattr(neox_args, "seed", 1234)), parallel_state, tracker)
    return tracker


def checkpoint_function() -> Callable:
    """DeepSpeed's checkpoint (honours partition / contiguous / cpu settings from ``configure``)."""
    return deepspeed.checkpointing.checkpoint
