"""NeoXArgsLogging: Console, tensorboard, wandb and comet logging, profiling.

Fields, types, defaults and docs follow the GPT-NeoX argument reference."""

from dataclasses import dataclass
from typing import Any, Optional


@dataclass
class NeoXArgsLogging:
    """Console, tensorboard, wandb and comet logging, profiling."""

    use_wandb: Optional[bool] = None
    """
    Flag indicating if wandb is to be used.
    """

    wandb_group: Optional[str] = None
    """
    Weights and Biases group name - used to group together "runs".
    """

    wandb_run_name: Optional[str] = None
    """
    Weights and Biases run name (deepy.py --wandb_run_name); wandb picks a random name when unset.
    """

    wandb_team: Optional[str] = None
    """
    Team name for Weights and Biases.
    """

    wandb_project: str = 'neox'
    """
    wandb project name
    """

    wandb_host: str = 'https://api.wandb.ai'
    """
    url of the wandb host
    """

    wandb_init_all_ranks: bool = False
    """
    Initialize wandb on all ranks.
    """

    git_hash: str = '62c9738a'
    """
    current git hash of repository
    """

    log_dir: Optional[str] = None
    """
    Directory to save logs to.
    """

    tensorboard_dir: Optional[str] = None
    """
    Write TensorBoard logs to this directory.
    """

    use_comet: Optional[bool] = None
    """
    Flag indicating if comet is to be used.
    """

    comet_workspace: Optional[str] = None
    """
    Comet workspace name, if not configured Comet Experiments will be created in the user configured
    default workspace.
    """

    comet_project: Optional[str] = None
    """
    Comet project name, if not configured Comet Experiments will be created in the Uncategorized
    Experiments project.
    """

    comet_experiment_name: Optional[str] = None
    """
    Custom name for the Comet experiment. If not provided, a random name is used.
    """

    comet_tags: Optional[list] = None
    """
    List of tags to attach to the created Comet Experiment.
    """

    comet_others: Optional[dict] = None
    """
    Custom metadata to attach to the created Comet Experiment.
    """

    log_interval: int = 100
    """
    Interval between logging.
    """

    log_grad_pct_zeros: bool = False
    """
    Log the percentage of zeros for the gradient of each parameter to wandb / tensorboard (useful for
    debugging). Values are of whole parameters under the sequential model's names, the same with tensor and
    pipeline parallelism (every rank logs every stage's parameters); with moe_expert_parallel_size > 1 every
    rank's experts are logged, each under its global expert index (``...deepspeed_experts.{e}...``).
    """

    log_param_norm: bool = False
    """
    Log the frob norm of the parameters to wandb / tensorboard (useful for debugging), and their total
    (param_norm_total), before the optimizer step; with tensor and pipeline parallelism as log_grad_pct_zeros.
    """

    log_grad_norm: bool = False
    """
    Log the frob norm of the gradients to wandb / tensorboard (useful for debugging), and their total
    (grad_norm_total), before clipping; with tensor and pipeline parallelism as log_grad_pct_zeros (under the
    pipeline engine they are read inside train_batch, after the gradient reduction and before the optimizer
    step).
    """

    log_optimizer_states: bool = False
    """
    Log the frob norm of the optimizer states to wandb / tensorboard (useful for debugging), as they are
    before the optimizer step; with tensor and pipeline parallelism as log_grad_pct_zeros.
    """

    log_gradient_noise_scale: bool = False
    """
    Whether to log the gradient noise scale when training (cf. https://arxiv.org/abs/1812.06162 for explanation):
    McCandlish et al.'s simple noise scale tr(Sigma) / |G|^2, estimated as GPT-NeoX does from each step's gradient
    (B_small = train_batch_size) and their mean over gradient_noise_scale_n_batches steps, smoothed by moving
    averages, and logged as noise_scale (metrics.jsonl, TensorBoard, W&B) from the first complete window on
    (megatron.observability.gradient_noise_scale). Every parallel layout; not with rampup_batch_size.
    """

    gradient_noise_scale_n_batches: int = 5
    """
    Number of batches to accumulate gradients for in the gradient noise scale logger (>= 2; one copy of the
    gradient is buffered meanwhile).
    """

    gradient_noise_scale_cpu_offload: bool = False
    """
    Whether to offload the buffered gradients to cpu when measuring gradient noise scale.
    """

    memory_profiling: bool = False
    """
    Whether to take a memory snapshot of the model. Useful for debugging memory issues.
    """

    memory_profiling_path: Optional[str] = None
    """
    Path to save memory snapshot to.
    """

    profile: bool = False
    """
    Enable nsys profiling. When using this option, nsys options should be specified in commandline. An
    example nsys commandline is ``` nsys profile -s none -t nvtx,cuda -o <path/to/output_file> --force-
    overwrite true --capture-range=cudaProfilerApi --capture-range-end=stop ```. Here, on any device, the steps
    from profile_step_start to profile_step_stop are also recorded by torch.profiler: each rank writes
    rank{R}.<timestamp>.pt.trace.json into <tensorboard_dir>/profile (else <log_dir>/profile; one of them must be
    set), for TensorBoard's profiler plugin, Perfetto or chrome://tracing; with CUDA each of those steps is an NVTX
    range inside cudaProfilerStart / cudaProfilerStop (megatron.observability.profiler).
    """

    profile_step_start: int = 10
    """
    Step to start profiling at: the first profiled step is the one taken after this many steps (logged as
    iteration profile_step_start + 1), as in GPT-NeoX.
    """

    profile_step_stop: int = 12
    """
    Step to stop profiling at: the last profiled step is the one taken after this many steps (logged as iteration
    profile_step_stop + 1); >= profile_step_start.
    """

    peak_theoretical_tflops: Optional[float] = None
    """
    Peak dense TFLOP/s of one device, for MFU; overrides the device table of megatron/observability/flops.py and the
    NEOX_PEAK_TFLOPS environment variable.
    """

    comet_experiment: Optional[Any] = None
    """
    GPT-NeoX's run-time comet experiment object (set by its logger, not a config key): setting it is refused;
    use_comet and the comet_* keys configure comet.
    """
