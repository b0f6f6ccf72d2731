"""NeoXArgsDeepspeedConfig: Keys passed through to the DeepSpeed config JSON.

Fields, types, defaults and docs follow the GPT-NeoX argument reference."""

from dataclasses import dataclass
from typing import Literal, Optional


@dataclass
class NeoXArgsDeepspeedConfig:
    """Keys passed through to the DeepSpeed config JSON."""

    deepspeed: bool = True
    """
    boolean flag to enable DeepSpeed (Always True)
    """

    train_batch_size: Optional[int] = None
    """
    The effective training batch size. This is the amount of data samples that leads to one step of
    model update. train_batch_size is aggregated by the batch size that a single GPU processes in one
    forward/backward pass (a.k.a., train_step_batch_size), the gradient accumulation steps (a.k.a.,
    gradient_accumulation_steps), and the number of GPUs.
    """

    train_micro_batch_size_per_gpu: Optional[int] = None
    """
    Batch size to be processed by one GPU in one step (without gradient accumulation). When specified,
    gradient_accumulation_steps is automatically calculated using train_batch_size and number of GPUs.
    Should not be concurrently specified with gradient_accumulation_steps in the configuration JSON.
    """

    gradient_accumulation_steps: int = 1
    """
    Number of training steps to accumulate gradients before averaging and applying them. This feature is
    sometimes useful to improve scalability since it results in less frequent communication of gradients
    between steps. Another impact of this feature is the ability to train with larger batch sizes per
    GPU. When specified, train_step_batch_size is automatically calculated using train_batch_size and
    number of GPUs. Should not be concurrently specified with train_step_batch_size in the configuration
    JSON.
    """

    optimizer: Optional[dict] = None
    """
    dict containing the keys type and params type: The optimizer name. DeepSpeed natively supports Adam,
    AdamW, OneBitAdam, Lamb, and OneBitLamb optimizers (See here for details) and will import other
    optimizers from torch. params: Dictionary of parameters to instantiate optimizer. The parameter
    names must match the optimizer constructor signature (e.g., for Adam).
    """

    scheduler: Optional[dict] = None
    """
    dict containing the keys type and params type: The scheduler name. See here
    (https://deepspeed.readthedocs.io/en/latest/schedulers.html) for list of support schedulers. params:
    Dictionary of parameters to instantiate scheduler. The parameter names should match scheduler
    constructor signature. Here: WarmupLR, WarmupDecayLR or WarmupCosineLR; DeepSpeed builds it instead of
    the built-in schedule (so lr_decay_style, warmup, min_lr, ... are refused beside it), warmup_max_lr is lr,
    and its state is saved in and resumed from checkpoints.
    """

    fp32_allreduce: bool = False
    """
    During gradient averaging perform allreduce with 32 bit values
    """

    prescale_gradients: bool = False
    """
    Scale gradients before doing allreduce
    """

    gradient_predivide_factor: float = 1.0
    """
    Before gradient averaging predivide gradients by a specified factor, can sometimes help with fp16
    stability when scaling to large numbers of GPUs
    """

    sparse_gradients: bool = False
    """
    Enable sparse compression of torch.nn.Embedding gradients.
    """

    fp16: Optional[dict] = None
    """
    Configuration for using mixed precision/FP16 training that leverages NVIDIA’s Apex package.
    Dictionary options as described in Deepspeed documentation: https://www.deepspeed.ai/docs/config-
    json/#fp16-training-options
    """

    bf16: Optional[dict] = None
    """
    Configuration for using bfloat16 floating-point format as an alternative to FP16. BFLOAT16 requires
    hardware support (e.g., NVIDIA A100). Dictionary options as described in Deepspeed documentation:
    https://www.deepspeed.ai/docs/config-json/#bfloat16-training-options
    """

    amp: Optional[dict] = None
    """
    Configuration for using automatic mixed precision (AMP) training that leverages NVIDIA’s Apex AMP
    package. Dictionary as described in Deepspeed documentation: https://www.deepspeed.ai/docs/config-
    json/#automatic-mixed-precision-amp-training-options
    """

    gradient_clipping: float = 1.0
    """
    Enable gradient clipping with provided value
    """

    zero_optimization: Optional[dict] = None
    """
    Configuration for using ZeRO optimization. Multi-level dictionary as described in Deepspeed
    documentation: https://www.deepspeed.ai/docs/config-json/#zero-optimization-options
    ZeRO-Offload: offload_optimizer (stages 1-3) and offload_param (stage 3) with device cpu, or nvme with
    nvme_path (needs DeepSpeed's async_io op, which builds where libaio is installed: apt-get install
    libaio-dev; refused where the workers start otherwise). Offloading the optimizer needs optimizer type
    CPU_Adam, or deepspeed_extra_args {zero_force_ds_cpu_optimizer: false}.
    """

    curriculum_learning: Optional[dict] = None
    """
    Sequence-length warmup (DeepSpeed's legacy curriculum learning, as GPT-NeoX passes it): with enabled: true,
    each training step k uses the first L(k) tokens of every sample (tokens, position ids, attention mask, labels
    and loss mask are cut; evaluation uses full samples), L(k) from DeepSpeed's CurriculumScheduler: keys
    curriculum_type ('seqlen', the only type), min_difficulty, max_difficulty (at most seq_length),
    schedule_type fixed_linear / fixed_root (schedule_config: total_curriculum_step, difficulty_step, and
    root_degree for fixed_root) or fixed_discrete (schedule_config: difficulty, a list of lengths, and max_step,
    the last step of each but the last). Example: {enabled: true, curriculum_type: seqlen, min_difficulty: 64,
    max_difficulty: 2048, schedule_type: fixed_linear, schedule_config: {total_curriculum_step: 20000,
    difficulty_step: 8}}. The length is logged as curriculum_seqlen and the schedule resumes exactly from
    checkpoints. Only with train_impl 'normal'.
    """

    curriculum_seqlen: int = 0
    """
    GPT-NeoX's internal record of the current curriculum length; not a setting (refused unless 0): the length
    comes from curriculum_learning and is logged as curriculum_seqlen in the train records.
    """

    steps_per_print: int = 10
    """
    With wall_clock_breakdown: how often DeepSpeed prints its timings (forward, backward, step...; with a pipeline
    also its own `steps: N loss: X` line). Without it DeepSpeed is given an interval no run reaches, so that the
    pipeline engine's loss line does not repeat this project's: the training loss, throughput and (with
    wall_clock_breakdown) timings are logged every log_interval steps.
    """

    wall_clock_breakdown: bool = False
    """
    Enable timing of the latency of forward/backward/update training phases.
    """

    dump_state: bool = False
    """
    Print out state information of DeepSpeed object after initialization.
    """

    flops_profiler: Optional[dict] = None
    """
    Configuration for using FLOPS profiler. Dictionary as described in Deepspeed documentation:
    https://www.deepspeed.ai/docs/config-json/#flops-profiler
    The profile is printed (or written to output_file) by rank 0 at DeepSpeed's global step profile_step,
    which counts from 0 (profile_step: 1 profiles iteration 2).
    """

    communication_data_type: Optional[Literal['fp32', 'fp16', 'bf16']] = None
    """
    During gradient averaging, perform communication with selected data type. By default it will be
    determined by selected regime
    """

    autotuning: Optional[dict] = None
    """
    Configuration for using autotuning. Dictionary as described in Deepspeed documentation:
    https://www.deepspeed.ai/docs/config-json/#autotuning
    Read by DeepSpeed's autotuner when autotuning_run is set (it needs enabled: true; without autotuning_run,
    enabled: true is refused, since DeepSpeed's engine would stop training after end_profile_step). Keys: fast,
    metric (throughput, latency, flops), start_profile_step / end_profile_step (end < train_iters), tuner_type
    (gridsearch, random, model_based), tuner_early_stopping, tuner_num_trials, max_train_batch_size,
    min/max_train_micro_batch_size_per_gpu, num_tuning_micro_batch_sizes, mp_size (= model_parallel_size),
    results_dir (default autotuning_results) and exps_dir (default autotuning_exps), both emptied first unless
    overwrite: false, arg_mappings (accepted; the experiment's config carries the same values), model_info. The
    stages searched are zero_optimization.stage as a list or 'all'. On CPU ranks the autotuner's memory model sees
    the machine's RAM: bound the micro batch with max_train_micro_batch_size_per_gpu.
    """

    activation_checkpointing: Optional[dict] = None
    """
    Configuration for using activation checkpointing. Dictionary as described in Deepspeed
    documentation: https://www.deepspeed.ai/docs/config-json/#activation-checkpointing
    """

    sparse_attention: Optional[dict] = None
    """
    Configuration for using sparse attention. Dictionary as described in Deepspeed documentation:
    https://www.deepspeed.ai/docs/config-json/#sparse-attention
    """

    data_efficiency: Optional[dict] = None
    """
    DeepSpeed's Data Efficiency library, as described in Deepspeed documentation:
    https://www.deepspeed.ai/docs/config-json/#data-efficiency (a part runs when it and every section above it
    say enabled: true). data_routing.random_ltd: random layerwise token dropping on the transformer layers of
    random_ltd_layer_id (0-based; total_layer_num = num_layers; random_ltd_schedule fixed_linear from min_value to
    max_value = seq_length tokens), scheduled by DeepSpeed's RandomLTDScheduler, logged as random_ltd_kept_tokens
    and random_ltd_layer_tokens, resumed exactly; needs positions added at the embedding (pos_emb learned,
    sinusoidal or none) and pipe_parallel_size <= 1. data_sampling.curriculum_learning: DeepSpeed's
    DeepSpeedDataSampler draws each global batch from the training samples whose difficulty (curriculum_metrics
    seqlen / vocab_rarity, analysed offline by tools/datasets/analyze_difficulty.py) is within the metric's
    schedule (difficulty_type value or percentile, schedule_type fixed_linear / fixed_root / fixed_discrete);
    logged as data_efficiency_difficulty/<metric>, resumed exactly. Distinct from curriculum_learning (which cuts
    samples to a scheduled length); both at once are refused when a seqlen metric is used. See docs/training.md.
    """

    tensorboard: Optional[dict] = None
    """
    Configuration for using tensorboard. Dictionary as described in Deepspeed documentation:
    https://www.deepspeed.ai/docs/config-json/#monitoring-module-tensorboard-wandb-csv
    DeepSpeed's monitors (tensorboard, wandb, csv_monitor) receive the engine's timers and learning rate and
    every training and evaluation record of this project ('Train/Samples/lm_loss', ...), on rank 0.
    """

    wandb: Optional[dict] = None
    """
    Configuration for using wandb.
    """

    csv_monitor: Optional[dict] = None
    """
    Configuration for using csv_monitor (DeepSpeed's; keys enabled, output_path, job_name): one csv file per
    metric in output_path/job_name, fed as the tensorboard section says.
    """

    elasticity: Optional[dict] = None
    """
    Configuration for using elastic training. Dictionary as described in Deepspeed documentation:
    https://www.deepspeed.ai/docs/config-json/#elastic-training-config-v01-and-v02
    """

    comms_logger: Optional[dict] = None
    """
    Configuration for using communication logger. Dictionary as described in Deepspeed documentation:
    https://www.deepspeed.ai/docs/config-json/#communication-logging
    Counts DeepSpeed's collectives and this project's tensor-parallel ones. The summary (op, message size,
    count, latency, bandwidth; cumulative) is printed by rank 0 and written to metrics.jsonl ('comms' records)
    at the end of training and, with prof_interval: N (a key of this project, not passed to DeepSpeed), every
    N iterations.
    """

    compression_training: Optional[dict] = None
    """
    Configuration for using compression training. Dictionary as described in Deepspeed documentation:
    https://www.deepspeed.ai/docs/config-json/#compression
    """

    checkpoint: Optional[dict] = None
    """
    Configuration for using checkpointing. Dictionary as described in Deepspeed documentation:
    https://www.deepspeed.ai/docs/config-json/#checkpoint-options
    load_universal and writer are refused: DeepSpeed would read checkpoint files with a loader of its own,
    past this project's safe reader (megatron.neox_arguments.deepspeed_config.UNSAFE_LOADING_KEYS).
    """

    data_types: Optional[dict] = None
    """
    Configuration for using data types. Dictionary as described in Deepspeed documentation:
    https://www.deepspeed.ai/docs/config-json/#data-type-options
    """

    deepspeed_extra_args: Optional[dict] = None
    """
    Dictionary of extra arguments to be included in the yaml config file. This can be used for any
    argument not included in the above list. Keys may add to the DeepSpeed config but never contradict it:
    a key that is an argument of this group (fp16, zero_optimization, ...) is merged into that argument and
    validated with it; a contradicting value is an error naming the key path and both values.
    """
