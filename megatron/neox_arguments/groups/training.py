"""NeoXArgsTraining: Data, checkpoints, iteration counts, regularisation and precision-related training knobs.

Fields, types, defaults and docs follow the GPT-NeoX argument reference."""

from dataclasses import dataclass
from typing import List, Literal, Optional


@dataclass
class NeoXArgsTraining:
    """Data, checkpoints, iteration counts, regularisation and precision-related training knobs."""

    data_path: Optional[str] = None
    """
    Path to combined dataset to split.
    """

    use_shared_fs: bool = True
    """
    Whether to use a shared filesystem for data loading. If False, local rank 0 on all nodes will
    preprocess the data, otherwise only global rank 0 will preprocess the data. This is implemented in
    megatron/data/gpt2_dataset.py::_build_index_mappings.
    """

    data_cache_path: Optional[str] = None
    """
    Directory for the cached index maps (Megatron-LM's data_cache_path). Unset, they are written beside the data,
    as GPT-NeoX does; set it when the data directory is read-only (a shared data set, a read-only mount). Created
    when missing.
    """

    train_data_paths: Optional[list] = None
    """
    List of paths to train datasets.
    """

    train_label_data_paths: Optional[list] = None
    """
    List of paths to train label datasets (not shifted by 1 yet!).
    """

    train_reward_data_paths: Optional[list] = None
    """
    List of paths to train reward datasets (train_impl "kto"): one reward per sequence of train_data_paths, its
    sign marking the completion desirable or undesirable ({prefix}_{key}_reward_document from
    preprocess_data_with_chat_template.py --reward-key).
    """

    test_data_paths: Optional[list] = None
    """
    List of paths to test datasets.
    """

    test_label_data_paths: Optional[list] = None
    """
    List of paths to test label datasets (not shifted by 1 yet!).
    """

    test_reward_data_paths: Optional[list] = None
    """
    List of paths to test reward datasets
    """

    valid_data_paths: Optional[list] = None
    """
    List of paths to validation datasets.
    """

    valid_label_data_paths: Optional[list] = None
    """
    List of paths to validation label datasets (not shifted by 1 yet!).
    """

    valid_reward_data_paths: Optional[list] = None
    """
    List of paths to validation reward datasets
    """

    pos_train_data_paths: Optional[list] = None
    """
    List of paths to the chosen sequences of preference pairs (dataset_impl 'pairwise'), pair k with sequence k
    of neg_train_data_paths; e.g. {prefix}_chosen_document from preprocess_data_with_chat_template.py.
    """

    neg_train_data_paths: Optional[list] = None
    """
    List of paths to positive and negative training datasets.
    """

    pos_train_label_data_paths: Optional[list] = None
    """
    List of paths to the label datasets of pos_train_data_paths (-100 where no loss is taken), e.g.
    {prefix}_chosen_label_document.
    """

    neg_train_label_data_paths: Optional[list] = None
    """
    List of paths to positive and negative training label datasets (not shifted by 1 yet!).
    """

    pos_valid_data_paths: Optional[list] = None
    """
    List of paths to the chosen sequences of validation preference pairs (dataset_impl 'pairwise').
    """

    neg_valid_data_paths: Optional[list] = None
    """
    List of paths to positive and negative validation datasets.
    """

    pos_valid_label_data_paths: Optional[list] = None
    """
    List of paths to the label datasets of pos_valid_data_paths.
    """

    neg_valid_label_data_paths: Optional[list] = None
    """
    List of paths to positive and negative validation label datasets (not shifted by 1 yet!).
    """

    pos_test_data_paths: Optional[list] = None
    """
    List of paths to the chosen sequences of test preference pairs (dataset_impl 'pairwise').
    """

    neg_test_data_paths: Optional[list] = None
    """
    List of paths to positive and negative test datasets.
    """

    pos_test_label_data_paths: Optional[list] = None
    """
    List of paths to the label datasets of pos_test_data_paths.
    """

    neg_test_label_data_paths: Optional[list] = None
    """
    List of paths to positive and negative test label datasets (not shifted by 1 yet!).
    """

    train_data_weights: Optional[list] = None
    """
    List of 'weights' that decide how often to sample from each training dataset when blending datasets.
    If None, defaults to equal weighting. Should be a list the same length as `train_data_paths`
    """

    valid_data_weights: Optional[list] = None
    """
    List of 'weights' that decide how often to sample from each validation dataset when blending
    datasets. If None, defaults to equal weighting. Should be a list the same length as
    `valid_data_paths`
    """

    test_data_weights: Optional[list] = None
    """
    List of 'weights' that decide how often to sample from each test dataset when blending datasets. If
    None, defaults to equal weighting. Should be a list the same length as `test_data_paths`
    """

    weight_by_num_documents: bool = False
    """
    If True, Builds dataset weights from a multinomial distribution over groups of data according to the
    number of documents in each group. WARNING: setting this to True will override any user provided
    weights We sample from a group according to the probability p(L) ∝ |L| ** α, where p(L) is the
    probability of sampling from a given group, |L| is the number of examples in that datapoint, and α
    is a coefficient that acts to upsample data from underrepresented groups Hence α (`alpha`) allows us
    to control how much to 'boost' the probability of training on low-resource groups. See
    https://arxiv.org/abs/1911.02116 for more details
    """

    weighted_sampler_alpha: float = 1.0
    """
    Alpha value for `weight_by_num_documents`. Only has an effect if `weight_by_num_documents` = True.
    when alpha = 1, the probability of sampling from a given group = n_samples / total_samples as alpha
    -> 0, the probability of sampling from all groups becomes equal, and number of documents has no
    effect as alpha -> inf, the probability of sampling from the groups with *the most samples* -> 1
    """

    data_impl: Literal['infer', 'mmap', 'cached'] = 'infer'
    """
    Implementation of indexed datasets, can be one of "infer", "cached", or "mmap"
    """

    pack_impl: Literal['packed', 'pack_until_overflow', 'unpacked'] = 'packed'
    """
    Packing implementation, can be one of "packed", "pack_until_overflow", or "unpacked". warning:
    pack_until_overflow is very naive and will likely have issues with pretraining scale datasets
    """

    dataset_impl: Literal['gpt2', 'pairwise', 'online'] = 'gpt2'
    """
    Dataset implementation, can be one of "gpt2", "pairwise", or "online". "pairwise" reads chosen / rejected
    pairs from the pos_* / neg_* data paths, one pair per sample (needs pack_impl "unpacked" and train_impl
    "dpo" or "rm"); "online" fetches rollouts (prompt, completions, rewards) from a rollout server as training
    reads them (GPT-NeoX's protocol; tools/rollout_server.py serves them on CPU or GPU), for train_impl
    "reinforce".
    """

    train_impl: Literal['normal', 'dpo', 'rm', 'kto', 'reinforce'] = 'normal'
    """
    Training implementation, can be one of "normal", "dpo", "kto", "reinforce", or "rm". "dpo" trains on
    dataset_impl "pairwise" against a frozen reference model (the policy's weights when the run starts); "rm"
    trains a reward model (a scalar value head, Bradley-Terry loss) on dataset_impl "pairwise"; "kto" trains
    on completions with train_reward_data_paths (desirable or not) against DPO's reference model; "reinforce"
    trains on dataset_impl "online" rollouts with GPT-NeoX's REINFORCE loss (kl_div_beta, kl_impl,
    reinforce_leave_one_out, fp32_reinforce; docs/post-training.md).
    """

    dpo_fp32: bool = True
    """
    Whether to cast logits to fp32 for DPO loss calculation (else the log-softmax runs in the logits' dtype).
    """

    dpo_reference_free: bool = False
    """
    Whether to use reference-free DPO (the reference log-probabilities are 0 and no reference model is built).
    """

    dpo_beta: float = 0.1
    """
    Beta value for DPO: loss = -log sigmoid(beta * ((policy - reference log-prob) of chosen minus that of
    rejected)); the logged rewards are beta * (policy - reference log-prob).
    """

    kto_fp32: bool = True
    """
    Whether to cast logits to fp32 for KTO loss calculation.
    """

    kto_desirable_weight: float = 1.0
    """
    Weight for desirable loss in KTO. Might help if you have unbalanced desirable and undesirable
    classes.
    """

    kto_undesirable_weight: float = 1.0
    """
    Weight for undesirable loss in KTO. Might help if you have unbalanced desirable and undesirable
    classes.
    """

    kto_beta: float = 0.1
    """
    Beta value for KTO
    """

    fp32_reinforce: bool = True
    """
    Whether to compute the REINFORCE loss's log-softmax (policy and reference) in fp32 rather than in the
    logits' dtype (train_impl 'reinforce').
    """

    kl_div_beta: float = 0.1
    """
    Weight of the KL term of the REINFORCE loss, per completion token, against a frozen reference model (the
    policy's weights when the run started, saved with each checkpoint); 0 drops the term and builds no reference.
    """

    kl_impl: Literal['abs', 'mse', 'kl', 'full'] = 'mse'
    """
    The REINFORCE loss's KL term per completion token, with d = log p - log q the policy's minus the reference's
    log-probability of the token: "kl" d, "abs" |d|, "mse" d^2 / 2, or "full" the exact KL(p || q) over the whole
    vocabulary at that position.
    """

    reinforce_leave_one_out: bool = False
    """
    The REINFORCE baseline: true subtracts from each completion's reward the mean reward of the other completions
    of its prompt (RLOO, arXiv 2402.14740); false subtracts the mean of the last 100 prompts' mean rewards.
    """

    z_loss: float = 0.0
    """
    Z-loss coefficient of reward-model training (train_impl 'rm'; arXiv 2204.02311): z_loss x mean(r_chosen^2 +
    r_rejected^2) is added to the Bradley-Terry loss, keeping the rewards near 0, as GPT-NeoX does. Must be >= 0;
    refused with another train_impl.
    """

    allow_chopped: bool = True
    """
    WARNING: if your packing impl is packed, this is ignored. Allow chopped samples in the dataset. (e.g
    if your sequence length is 1024 and you have a sample of length 1026, it will be chopped to 1024). False
    leaves such samples (with dataset_impl "pairwise": such pairs) out, and the log says how many.
    """

    mmap_warmup: bool = False
    """
    Warm up mmap files.
    """

    save: Optional[str] = None
    """
    Output directory to save checkpoints to.
    """

    s3_path: Optional[str] = None
    """
    Path to s3 bucket for saving checkpoints: s3://<bucket>[/<prefix>]. Each complete checkpoint of save is
    uploaded there (rank 0, in the background; COMPLETE last; an interrupted upload is finished at the next save or
    start), and a run whose save holds no checkpoint resumes from the newest complete one there. Needs boto3 (requirements/requirements-s3.txt); credentials and endpoint come from boto3's environment
    (AWS_*). See docs/checkpoints.md, "Uploading to S3".
    """

    s3_chunk_size: int = 104857600
    """
    The number of bytes in each file chunk when uploading to s3. Defaults to 100MiB. Files larger than this are
    sent as multipart uploads of such parts (AWS S3 needs at least 5 MiB).
    """

    config_files: Optional[dict] = None
    """
    Store of original config files mapping config filename to file contents
    """

    load: Optional[str] = None
    """
    Directory containing a model checkpoint.
    """

    checkpoint_validation_with_forward_pass: bool = False
    """
    save input and output of a forward pass with the checkpoint and validate after load: each checkpoint keeps the
    model's loss on GPT-NeoX's fixed sequence (tokens 0..seq_length, eval mode) in its client state, and a run that
    loads it (train.py) computes it again and stops with a CheckpointError naming both losses when they differ by
    more than 1e-4 (fp32) or 2e-2 (bf16 / fp16) relative (megatron.training.checkpoint_validation). Language models
    (train_impl normal) only.
    """

    checkpoint_scale: Literal['linear', 'log'] = 'linear'
    """
    How step at which checkpoints are saved should scale. "linear" implies 1 checkpoint will be saved at
    every multiple of `checkpoint-factor`, while "log" implies that the number of steps between each
    checkpoint will be multiplied by `checkpoint-factor` at each step, starting from step 1.
    """

    checkpoint_factor: Optional[int] = None
    """
    Acts as a multiplier on either the "log" or "linear" checkpoint spacing. With `checkpoint-
    scale="linear"`, `checkpoint-factor=20`, and `train-iters=100`, checkpoints will be saved at steps
    [20, 40, 60, 80, 100]. With `checkpoint-scale="log"`, `checkpoint-factor=2`, and `train-iters=100`,
    checkpoints will be saved at steps [1, 2, 4, 8, 16, 32, 64, 100]. Note that the last checkpoint step
    is always saved.
    """

    extra_save_iters: Optional[list] = None
    """
    Additional iterations when a checkpoint should be saved. Must be a list of ints or `None`.
    """

    no_save_optim: bool = False
    """
    Do not save current optimizer: checkpoints keep the weights, the LR schedule, the iteration and the data position
    but no optimizer state (megatron.checkpoint.weights_only). A run resuming from one loads those and starts the
    optimizer afresh, with a note saying so (16-bit runs take their fp32 master weights from the saved 16-bit ones).
    Not with ZeRO stage 3, which keeps the weights in its optimizer partitions.
    """

    no_save_rng: bool = False
    """
    Do not save current rng state.
    """

    no_load_optim: bool = False
    """
    Do not load optimizer when loading checkpoint.
    """

    no_load_rng: bool = False
    """
    Do not load rng state when loading checkpoint.
    """

    finetune: bool = False
    """
    Load model for finetuning. Do not load optimizer or rng state from checkpoint and set iteration to
    0. Assumed when loading a release checkpoint.
    """

    batch_size: Optional[int] = None
    """
    training microbatch size per gpu
    """

    train_iters: Optional[int] = None
    """
    Number of iterations to run for training.
    """

    train_epochs: Optional[int] = None
    """
    Number of epochs to run for training. Do not specify both train_epochs and train_iters. Not
    currently compatible with data reweighing, pairwise datasets, and packing other than 'packed'
    """

    train_samples: Optional[int] = None
    """
    Number of samples to train on (Megatron-LM's --train-samples), instead of train_iters or
    train_epochs (set one of the three): the run takes ceil(train_samples / train_batch_size) iterations,
    so its last batch may hold more samples than are left. Schedule lengths (lr_decay_iters,
    lr_warmup_iters, checkpoint_factor, ...) stay in iterations; the learning-rate lengths can be given in
    samples instead (lr_decay_samples, lr_warmup_samples, lr_wsd_decay_samples).
    """

    eval_iters: int = 100
    """
    Number of iterations to run for evaluation validation/test for.
    """

    keep_last_n_checkpoints: Optional[int] = None
    """
    Number of last checkpoints to keep
    """

    async_save: bool = False
    """
    Megatron-LM's --async-save: write checkpoints in the background while training goes on. Each rank copies
    its state to CPU memory at the save (the only pause) and a writer thread writes and fsyncs the files; the
    checkpoint becomes COMPLETE and `latest` moves only after every rank has finished writing, so a crash
    mid-write leaves the previous checkpoint as the one resumed from. The writes are spread over 75% of the
    time to the next save (so that no one step bears them) and go past the page cache (O_DIRECT). A save that
    comes while the previous one is still being written waits for it, as does the end of the run. Needs host
    memory for one copy of the rank's checkpoint (weights and optimizer state), kept from one save to the next.
    """

    non_persistent_save_interval: Optional[int] = None
    """
    Megatron-LM's --non-persistent-save-interval: every this many iterations (other than persistent saves) save
    a non-persistent checkpoint (needs non_persistent_ckpt_type 'global' and save): written like a persistent
    one (atomic, also with async_save) into non_persistent_global_ckpt_dir, which keeps only the newest. A
    resumed run continues from it when it is newer than the persistent checkpoint it would resume from.
    """

    non_persistent_ckpt_type: Optional[Literal['global', 'local', 'in_memory']] = None
    """
    Megatron-LM's --non-persistent-ckpt-type: 'global' (a checkpoint in a shared directory,
    non_persistent_global_ckpt_dir) or unset (none; resuming reads no non-persistent directory). 'local' and
    'in_memory' (TBD in Megatron-LM too) are not supported yet.
    """

    non_persistent_global_ckpt_dir: Optional[str] = None
    """
    Megatron-LM's --non-persistent-global-ckpt-dir: the directory of the 'global' non-persistent checkpoints;
    default `{save}/non_persistent` (without save, `{load}/non_persistent`). Not the save directory itself
    (it keeps only its newest checkpoint).
    """

    eval_interval: int = 1000
    """
    Interval between running evaluation on validation set.
    """

    split: str = '969, 30, 1'
    """
    Comma_separated list of proportions for training, validation, and test split. For example the split
    90,5,5 will use 90% of data for training, 5% for validation and 5% for test.
    """

    vocab_file: Optional[str] = None
    """
    Path to the vocab file.
    """

    merge_file: Optional[str] = None
    """
    Path to the BPE merge file.
    """

    num_workers: int = 2
    """
    Dataloader number of workers.
    """

    rampup_batch_size: Optional[List[int]] = None
    """
    Batch-size ramp-up [start, increment, samples] (Megatron-LM's --rampup-batch-size): the global batch
    starts at `start` and grows by `increment` after every samples / ((train_batch_size - start) /
    increment) samples consumed until it reaches train_batch_size. The micro batch stays
    train_micro_batch_size_per_gpu; the number of micro-batches (gradient accumulation) changes, so start
    and increment must be multiples of micro batch x data-parallel size and train_batch_size - start a
    multiple of increment. The learning-rate schedule then advances by samples (each step by its batch
    / train_batch_size iterations; lr_decay_iters, warmup and lr_wsd_decay_iters keep counting full-batch
    iterations, lr_decay_samples, lr_warmup_samples and lr_wsd_decay_samples samples); with train_samples the run ends when those samples are consumed. Logged as batch_size.
    With pipeline parallelism DeepSpeed's pipeline engine runs each step's micro-batch count (evaluation
    keeps the full batch's). Not with train_epochs or a DeepSpeed `scheduler` dict yet.
    """

    exit_interval: Optional[int] = None
    """
    Exit the program after the iteration is divisible by this value: a checkpoint is saved (when save is set)
    and the process exits with status 0, without the end-of-training validation and test evaluations (the
    run is not finished; relaunch the same command to continue).
    """

    exit_duration_in_mins: Optional[float] = None
    """
    Stop training once this many minutes have passed since training started (Megatron-LM's
    --exit-duration-in-mins), e.g. just under a cluster job's time limit: after the first iteration that
    ends past it (every rank agrees, the slowest clock decides) a checkpoint is saved when `save` is set
    and the run exits with status 0 without the final validation / test evaluation; launched again it resumes there.
    """

    attention_dropout: float = 0.0
    """
    Post attention dropout probability.
    """

    hidden_dropout: float = 0.0
    """
    Dropout probability for hidden state transformer.
    """

    weight_decay: float = 0.1
    """
    Weight decay coefficient for L2 regularization.
    """

    checkpoint_activations: bool = False
    """
    Checkpoint activation to allow for training with larger models, sequences, and batch sizes.
    """

    checkpoint_num_layers: int = 1
    """
    Chunk size (number of layers) for checkpointing.
    """

    recompute_granularity: Optional[Literal['full', 'selective']] = None
    """
    Megatron-LM's --recompute-granularity. 'full' is checkpoint_activations (whole transformer layers,
    recompute_num_layers per chunk, as checkpoint_num_layers); 'selective' recomputes only the attention
    core (softmax(QK^T)V with its dropout) in the backward pass, keeping every other activation: much of the
    memory of long sequences for a small part of the compute. Selective is not combined with
    checkpoint_activations, recompute_method or recompute_num_layers.
    """

    recompute_method: Optional[Literal['uniform', 'block']] = None
    """
    Megatron-LM's --recompute-method, with recompute_granularity 'full': 'uniform' checkpoints every chunk
    of recompute_num_layers layers (GPT-NeoX's checkpoint_num_layers); 'block' checkpoints only the first
    recompute_num_layers transformer layers of each pipeline stage (of the whole model without pipeline
    parallelism), one layer per checkpoint, and runs the others without recomputation: less recompute
    for more memory, tuned per stage.
    """

    recompute_num_layers: Optional[int] = None
    """
    Megatron-LM's --recompute-num-layers, with recompute_granularity 'full': with method 'uniform' the layers
    per checkpointed chunk (the same setting as checkpoint_num_layers; set one of them), with method 'block'
    the layers checkpointed per pipeline stage (default 1).
    """

    deepspeed_activation_checkpointing: bool = True
    """
    Deprecated (always true): activation checkpointing is always DeepSpeed's.
    """

    contiguous_checkpointing: bool = False
    """
    Contiguous memory checkpointing for activations.
    """

    checkpoint_in_cpu: bool = False
    """
    Move the activation checkpoints to CPU.
    """

    synchronize_each_layer: bool = False
    """
    does a synchronize at the beginning and end of each checkpointed layer.
    """

    profile_backward: bool = False
    """
    Enables backward pass profiling for checkpointed layers.
    """

    partition_activations: bool = False
    """
    Partition Activations across GPUs before checkpointing.
    """

    clip_grad: float = 1.0
    """
    Gradient clipping based on global L2 norm.
    """

    hysteresis: int = 2
    """
    hysteresis for dynamic loss scaling
    """

    dynamic_loss_scale: Optional[bool] = None
    """
    flag indicating whether dynamic loss scale is used
    """

    loss_scale: Optional[float] = None
    """
    Static loss scaling, positive power of 2 values can improve fp16 convergence. If None, dynamic loss
    scaling is used.
    """

    loss_scale_window: float = 1000.0
    """
    Window over which to raise/lower dynamic scale.
    """

    min_scale: float = 1.0
    """
    Minimum loss scale for dynamic loss scale.
    """

    char_level_ppl: bool = False
    """
    Whether to calculate character level perplexity as well as token level perplexity. (may incur a time
    cost)
    """

    use_mup: bool = False
    """
    Whether to use Microsoft's Mup https://github.com/microsoft/mup (muP, the maximal update
    parametrization, built here in megatron/mup/): hyperparameters tuned at a small base width transfer to
    wide models. Each parameter's width multipliers against the base model come from base_shapes_file;
    matrix-like weights are initialised with std / sqrt(fan-in multiplier) and learn at lr / fan-in multiplier with
    Adam (mup's MuAdam; SGD follows MuSGD), attention scores are q.k / head_dim, and the output head divides its
    input by the width multiplier. Needs optimizer type Adam, CPU_Adam, CPU_torch_Adam or SGD, attention and
    MLP layers (not gmlp, amlp, mamba, rwkv, a mixture of experts or a reward model), the built-in LR schedule;
    works with pipeline and tensor parallelism. Not converted to Hugging Face yet.
    """

    coord_check: bool = False
    """
    Whether to generate a "coord check" plot to verify mup's implementation in neox. With use_mup, train.py
    trains models of widths num_attention_heads x 2^p (p = 2..8) under the standard parametrization and muP
    for 3 Adam steps on the first training batch, records each module's mean |output|, writes
    coord_check.csv, coord_check.json (with the fitted slopes of log activation over log width) and
    coord_check.png (needs matplotlib, requirements-mup.txt; without it the plot is refused with a message)
    into log_dir, and stops.
    """

    save_base_shapes: bool = False
    """
    Whether to save base shapes for mup. This will save the shapes to the path specified in base-shapes-
    file. The config's model is the base and a copy mup_width_scale times wider tells which dimensions are
    width; the file (mup's YAML format, whole-tensor shapes, one file for any parallel layout) is written and
    train.py stops (after the coord check if coord_check is set), as in GPT-NeoX.
    """

    base_shapes_file: Optional[str] = None
    """
    Path to the base shapes to save to/load from. Required with use_mup; read when the model is built (a file
    written for another architecture is refused, naming the parameters that differ).
    """

    mup_init_scale: float = 1.0
    """
    Initialization scale: All the parameters are multiplied by this value (every weight matrix and embedding
    table; norms and biases keep their constant initialisation). With use_mup only.
    """

    mup_attn_temp: float = 1.0
    """
    Attention temperature: Reciprocal of the multiplier applied to the input to attention softmax: the scores
    are q.k / (head_dim x mup_attn_temp). With use_mup only.
    """

    mup_output_temp: float = 1.0
    """
    Output temperature: Reciprocal of the multiplier applied to the input to softmax that produces the
    distribution over output tokens: the output head's input is divided by (width multiplier x
    mup_output_temp). With use_mup only.
    """

    mup_embedding_mult: float = 1.0
    """
    Scalar by which we multiply the output of the embedding layer. With use_mup only.
    """

    mup_rp_embedding_mult: float = 1.0
    """
    Scalar by which we multiply vectors representing relative position: as in GPT-NeoX, the learned or
    sinusoidal position embeddings (refused with other pos_emb). With use_mup only.
    """

    mup_width_scale: int = 2
    """
    What to scale width by when creating the delta model for mup (save_base_shapes; an integer >= 2)
    """
