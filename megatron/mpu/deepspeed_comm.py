"""Starting deepspeed.comm, the one way every part of the project does it.

On CPU, DeepSpeed 0.19 loads a shared-memory all-reduce op that leaves one 69 MB /dev/shm buffer per
rank behind after every run (a machine that runs the tests fills /dev/shm within hours) and is compiled
for about a minute on first use; it is switched off so that gloo's all-reduce is used instead."""

import deepspeed
import deepspeed.comm as ds_comm
import deepspeed.ops
import torch


def init_deepspeed_comm(dist_backend: str, **kwargs) -> None:
    """deepspeed.init_distributed, without the CPU shared-memory op (see module docstring)."""
    if not torch.cuda.is_available():
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend=dist_backend, **kwargs)


def collectives():
    """The module the project's own collectives go through: ``deepspeed.comm`` once it is started, so that its
    comms_logger (config section ``comms_logger``) times and counts them beside ZeRO's and the pipeline engine's;
    ``torch.distributed`` in a world started without DeepSpeed (unit tests), whose calls have the same form."""
    return ds_comm if ds_comm.is_initialized() else torch.distributed
