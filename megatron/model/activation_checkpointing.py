"""Activation checkpointing through DeepSpeed (``deepspeed.checkpointing``).

DeepSpeed keeps its checkpointing settings and its RNG tracker in its own module state; this module is
the one place that configures them from the ModelConfig and the ParallelState. When checkpointing is on, the
model draws model-parallel dropout from DeepSpeed's tracker, so that recomputation in the backward pass
replays exactly the dropout masks of the forward pass.

Options (one setting with DeepSpeed's ``activation_checkpointing`` dict, see megatron.neox_arguments.derivation):
checkpoint_activations (on/off), checkpoint_num_layers (transformer layers per checkpoint),
partition_activations (split saved inputs across the model-parallel group), contiguous_checkpointing
(needs partition_activations), checkpoint_in_cpu (keep the saved inputs in CPU memory; on DeepSpeed's CPU
accelerator they are there already), synchronize_each_layer, profile_backward, number_checkpoints.
"""
from __future__ import annotations

from typing import Callable

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator

from megatron.model.config import ModelConfig
from megatron.mpu.deepspeed_comm import init_deepspeed_comm
from megatron.mpu.random import model_parallel_seed


def configure_activation_checkpointing(config: ModelConfig, parallel_state) -> None:
    """Configure DeepSpeed's activation checkpointing with our ParallelState as its mpu (the option
    combinations are checked by ModelConfig.problems)."""
    if not deepspeed.comm.is_initialized():
        if not torch.distributed.is_initialized():
            raise RuntimeError("checkpoint_activations needs an initialised torch.distributed world "
                               "(DeepSpeed's activation checkpointing communicates through deepspeed.comm)")
        init_deepspeed_comm(torch.distributed.get_backend(), dist_init_required=False)
    deepspeed.checkpointing.configure(
        mpu_=parallel_state,
        partition_activations=config.partition_activations,
        contiguous_checkpointing=config.contiguous_checkpointing,
        num_checkpoints=config.activation_checkpoints,
        checkpoint_in_cpu=config.checkpoint_in_cpu and (config.partition_activations or not _on_cpu_accelerator()),
        synchronize=config.synchronize_each_layer,
        profile=config.profile_backward,
    )


def _on_cpu_accelerator() -> bool:
    """On DeepSpeed's CPU accelerator the activations already live in CPU memory, and DeepSpeed 0.19's
    cpu_checkpointing without partition_activations empties the very tensor it means to keep there (its "copy" to
    the CPU is the tensor itself), so the backward fails: there checkpoint_in_cpu is satisfied as it is and is not
    passed on (with partition_activations DeepSpeed copies the partition, and it is)."""
    return get_accelerator().device_name() == "cpu"


def checkpointing_rng_tracker(config: ModelConfig, parallel_state):
    """DeepSpeed's RNG tracker, seeded like ``model_parallel_seed`` (the default stream is left as is)."""
    tracker = deepspeed.checkpointing.get_cuda_rng_tracker()
    with torch.random.fork_rng():  # seed the tracker only; leave the default stream alone
        model_parallel_seed(config.seed, parallel_state, tracker)
    return tracker


def checkpoint_function() -> Callable:
    """DeepSpeed's checkpoint (honours partition / contiguous / cpu settings from ``configure``)."""
    return deepspeed.checkpointing.checkpoint
