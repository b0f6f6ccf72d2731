"""NeoXArgsOther: Process-level settings: backend, seeds, ranks, what to run.

Fields, types, defaults and docs follow the GPT-NeoX argument reference."""

from dataclasses import dataclass
from typing import Literal, Optional


@dataclass
class NeoXArgsOther:
    """Process-level settings: backend, seeds, ranks, what to run."""

    distributed_backend: Literal['nccl', 'gloo', 'mpi'] = 'nccl'
    """
    Which backend to use for distributed training.
    """

    distributed_timeout_minutes: float = 10.0
    """
    How long a collective operation (and the start, when the ranks meet) waits for the other ranks before it fails
    (Megatron-LM's distributed-timeout-minutes; fractions allowed), for the world and the data / tensor / pipeline
    groups (groups DeepSpeed makes itself, as the pipeline engine's, keep torch's 30 minutes). A rank that dies
    makes the others stop at once with an error naming the lost connection; one that hangs, after this long.
    """

    local_rank: Optional[int] = None
    """
    local rank passed from distributed launcher.
    """

    rank: Optional[int] = None
    """
    global rank of process being run (passed in via distributed launcher)
    """

    lazy_mpu_init: bool = False
    """
    If set to True, initialize_megatron() skips DDP initialization and returns function to complete it
    instead. Also turns on use-cpu-initialization flag. This is for external DDP manager.
    """

    short_seq_prob: float = 0.1
    """
    Probability of producing a short sequence.
    """

    eod_mask_loss: bool = False
    """
    Mask loss for the end of document tokens.
    """

    adlr_autoresume: bool = False
    """
    Enable auto-resume on adlr cluster. NVIDIA's ADLR clusters tell a job that its time is up through
    userlib.auto_resume.AutoResume, imported from the directory in the environment variable SUBMIT_SCRIPTS (or the
    Python path; a run without it is refused at start). When the scheduler asks, the run saves a checkpoint, rank 0
    requests a resubmission and every rank exits with status 0 (megatron/training/autoresume.py).
    """

    adlr_autoresume_interval: int = 1000
    """
    Intervals over which check for auto-resume termination signal (iterations; every rank asks, the answers are
    agreed across ranks). Needs adlr_autoresume: true.
    """

    seed: int = 1234
    """
    Random seed used for python, numpy, pytorch, and cuda.
    """

    onnx_safe: bool = False
    """
    Use workarounds for known problems with Torch ONNX exporter: as in GPT-NeoX, the GeLU (activation gelu, and
    geglu's and the experts' here) is computed as x * 0.5 * (1 + erf(x / sqrt(2))), the same function from ops every
    ONNX opset has (ONNX's Gelu operator needs opset 20). Not with bias_gelu_fusion.
    """

    deepscale: bool = False
    """
    (Deprecated) enable DeepSpeed (helper flag for user code, no impact on DeepSpeed backend)'
    """

    deepscale_config: Optional[str] = None
    """
    (Deprecated) deepscale json configuration file.
    """

    deepspeed_mpi: bool = False
    """
    Run via MPI, this will attempt to discover the necessary variables to initialize torch distributed
    from the MPI environment: each worker reads its rank, local rank and world size from OMPI_COMM_WORLD_*
    (Open MPI), MV2_COMM_WORLD_* (MVAPICH) or PMI_* (MPICH, Intel MPI) first; no mpi4py is needed. Workers
    started by mpirun read them without it too. Implies force_multi.
    """

    deepspeed_slurm: bool = False
    """
    Run via SLURM, this will attempt to discover the necessary variables to initialize torch distributed
    from the SLURM environment: each worker reads SLURM_PROCID, SLURM_LOCALID and SLURM_NTASKS first.
    Implies force_multi, so that srun starts the workers even on one node. Use with launcher: slurm.
    """

    user_script: Optional[str] = None
    """
    user script to be run
    """

    iteration: Optional[int] = None
    """
    Set during training
    """

    do_train: Optional[bool] = None
    """
    Set during training
    """

    do_valid: Optional[bool] = None
    """
    Set during training
    """

    do_test: Optional[bool] = None
    """
    Set during training
    """

    save_iters: Optional[list] = None
    """
    Set during training (GPT-NeoX's run-time list of the iterations to save at); here the training
    schedule (megatron/training_schedule.py) computes it from checkpoint_factor, checkpoint_scale and
    extra_save_iters, and setting it is refused.
    """

    global_num_gpus: Optional[int] = None
    """
    Set during launching
    """

    reset_position_ids: bool = False
    """
    Restart position ids after each end-of-document token (older GPT-NeoX argument, still honoured).
    """

    reset_attention_mask: bool = False
    """
    Block attention across end-of-document tokens (older GPT-NeoX argument, still honoured). Alone it builds a
    [batch, 1, seq, seq] mask; with reset_position_ids it means the same as inter_document_attention_masking and
    takes its path (no seq x seq mask), except in models with gmlp / amlp / mamba / rwkv layers, which keep the mask.
    """

    inter_document_attention_masking: bool = False
    """
    Packed documents: each document of a packed sequence (documents end at the tokenizer's end-of-document token)
    attends only to itself, at positions restarting from 0, as if it were run alone, without building a seq x seq
    mask (attention per document: flash-attn's varlen kernel where installed, else PyTorch SDPA document by
    document). The name of GPT-NeoX's open PR #1416. Refused with context_parallel_size > 1, soft_prompt_tuning and
    gmlp / amlp / mamba / rwkv layers; KV-cache generation takes single documents as before.
    """
