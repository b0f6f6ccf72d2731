"""What the model hands to DeepSpeed's activation checkpointing (through its ModelConfig) is what the config
says, whether it was written as the top-level flags or as DeepSpeed's activation_checkpointing dict."""

import pytest

from tests.distributed_helpers import run_distributed
from tests.neox_arguments.helpers import tiny


def _configured(rank: int, world_size: int, overrides):
    import deepspeed

    from megatron.model.activation_checkpointing import configure_activation_checkpointing
    from megatron.model.config import ModelConfig
    from megatron.mpu import ParallelState

    args = tiny(checkpoint_activations=True, **overrides)
    state = ParallelState(pipe_parallel_size=0, model_parallel_size=1)
    configure_activation_checkpointing(ModelConfig.from_neox_args(args), state)
    module = deepspeed.runtime.activation_checkpointing.checkpointing
    result = (module.PARTITION_ACTIVATIONS, module.CPU_CHECKPOINT, module.SYNCHRONIZE, module.PROFILE_TIME,
              module.num_layers)
    state.destroy()
    return result


@pytest.mark.slow
@pytest.mark.parametrize("overrides,expected", [
    ({"activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True,
                                   "synchronize_checkpoint_boundary": True, "profile": True,
                                   "number_checkpoints": 7}}, (True, True, True, True, 7)),
    ({"partition_activations": True, "checkpoint_in_cpu": True, "num_layers": 5, "checkpoint_num_layers": 2},
     (True, True, False, False, 3)),
    ({}, (False, False, False, False, 2)),
])
def test_deepspeed_checkpointing_is_configured_from_either_place(overrides, expected):
    assert run_distributed(_configured, world_size=1, args=(overrides,)) == [expected]
