"""Which DeepSpeed accelerator the test processes get: DeepSpeed's CPU accelerator only where there is no CUDA.

DeepSpeed picks its accelerator once, when it is first imported in a process, from DS_ACCELERATOR or else from
the hardware. Forcing "cpu" on a machine with a GPU sets it against the project, which trains on CUDA wherever
torch sees it (megatron.initialize): DeepSpeed's CPU Adam then reads CUDA pointers on the host (a segfault), its
activation checkpointing keeps CUDA tensors "in CPU memory", and its engine moves the model back to the host. So
every test process (pytest's, run_distributed's workers, the deepy.py launches) takes its DS_ACCELERATOR from
here; a test that must run on the CPU of a GPU machine hides the GPUs (CUDA_VISIBLE_DEVICES=) as well."""

import os
from typing import Dict, Mapping, Optional


def deepspeed_accelerator_env(has_cuda: Optional[bool] = None,
                              environ: Mapping[str, str] = os.environ) -> Dict[str, str]:
    """The DS_ACCELERATOR entry for a test process, to merge over its environment before it imports deepspeed:
    DS_ACCELERATOR as ``environ`` has it (someone chose), else {"DS_ACCELERATOR": "cpu"} where there is no CUDA
    device (``has_cuda``, by default torch's answer), else nothing (DeepSpeed picks CUDA itself)."""
    if "DS_ACCELERATOR" in environ:
        return {"DS_ACCELERATOR": environ["DS_ACCELERATOR"]}
    if has_cuda is None:
        import torch

        has_cuda = torch.cuda.is_available()
    return {} if has_cuda else {"DS_ACCELERATOR": "cpu"}
