"""The worker's side of a DeepSpeed autotuning experiment (the launcher's side is megatron.launch.autotuner)."""
import torch.distributed as dist

from megatron.mpu.host_collectives import barrier


def finish_experiment() -> None:
    """In a worker whose engine ended an autotuning experiment with exit(): leave the process group together
    (a gloo rank that exits right after a collective may otherwise abort)."""
    if dist.is_available() and dist.is_initialized():
        barrier()
        dist.destroy_process_group()
