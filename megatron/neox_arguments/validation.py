"""The rules a GPT-NeoX config must satisfy, each returning messages that name the key, the value and
what is allowed. Nothing here looks at the local machine: deepy.py often runs on a head node without
GPUs, so device-dependent checks (fp16 needs CUDA) run where the workers start
(`megatron.model.config.precision_device_problems`, called by megatron.initialize)."""

import dataclasses
import difflib
import os
from typing import Any, Callable, Iterable, List, Optional, Set, Tuple

from megatron.checkpoint.s3_location import s3_problems
from megatron.data import data_efficiency
from megatron.data.curriculum import curriculum_problems, enabled as curriculum_enabled
from megatron.model.config import NO_PACKED_DOCUMENT_TYPES, ModelConfig, recurrent_only_warning, softmax_fusion_warning
from megatron.model.random_ltd_settings import random_ltd_problems
from megatron.mup.rules import mup_run_problems
from megatron.neox_arguments.autotuning import autotuning_problems, zero_stage_space_problems
from megatron.neox_arguments.groups import NeoXArgsSchema
from megatron.neox_arguments.groups.model import NeoXArgsModel
from megatron.observability.comms_logging import comms_logger_problems
from megatron.optim.weight_decay import base_weight_decay
from megatron.optim.zero_offload import offload_problems
from megatron.training_schedule import decay_and_warmup_iters, schedule_length, training_iterations, wsd_decay_iters

TRANSFORMER_ENGINE_LAYERS = ("te_columnparallel", "te_rowparallel", "te_layernorm_mlp", "te_mha", "te_fp8_mha")
TRANSFORMER_ENGINE_FP8_SETTINGS = ("te_fp8_format", "te_fp8_wgrad", "te_fp8_amax_history_len",
                                   "te_fp8_amax_compute_algo", "te_fp8_margin")
REQUIRED_MODEL_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "seq_length")
DERIVED_ONLY = ("data_parallel_size", "deepspeed_config", "is_pipe_parallel", "save_iters", "precision_choice")
COMPRESSED_OPTIMIZERS = {"onebitadam": "OneBitAdam", "zerooneadam": "ZeroOneAdam", "onebitlamb": "OneBitLamb"}
"""DeepSpeed's 1-bit / 0-1 optimizers (optimizer.type lower-cased -> its spelling), refused with the reason."""

_MODEL_DEFAULTS = {f.name: f.default for f in dataclasses.fields(NeoXArgsModel)}


def _not_default(key: str) -> Callable[[Any], bool]:
    return lambda value: value != _MODEL_DEFAULTS[key]


# (key, predicate on its value that means "this feature is switched on", what to tell the user)
NOT_SUPPORTED_YET: Tuple[Tuple[str, Callable[[Any], bool], str], ...] = (
    ("comet_experiment", lambda v: v is not None, "comet_experiment is GPT-NeoX's run-time comet object, not a "
                                                  "config key; use use_comet and the comet_* keys"),
    ("use_tutel", bool,
     "use_tutel=true is not supported: tutel cannot be installed as a dependency (the package is not on the Python "
     "package registry, PyPI: it installs from its GitHub repository and builds CUDA kernels, so it needs CUDA). "
     "Remove use_tutel; DeepSpeed's MoE layer (moe_type deepspeed) runs without it and moe_type megablocks is the "
     "dropless layer"),
    ("norm", lambda v: v.startswith("te_"), "Transformer-Engine norms (te_rmsnorm, te_layernorm) are not "
                                            "supported yet; use rmsnorm or layernorm"),
    ("use_bnb_optimizer", bool, "bitsandbytes optimizers (use_bnb_optimizer) are not supported yet: GPT-NeoX uses "
                                 "bitsandbytes' 8-bit Adam, a CUDA kernel that no CPU test here can run; use "
                                 "Adam (or CPU_Adam with ZeRO-Offload)"),
    ("lazy_mpu_init", bool, "lazy_mpu_init is not supported: it makes initialize_megatron() leave the model-parallel "
                             "groups unset and return a function for an outside program to finish them; a deepy.py "
                             "run has no such program (GPT-NeoX's own train.py would run with the groups unset); "
                             "delete the key"),
    ("amp", lambda v: v is not None and v.get("enabled", False),
     "apex AMP (amp) is not supported: DeepSpeed's amp section runs NVIDIA apex, a CUDA extension; use the bf16 "
     "or fp16 dicts"),
    ("curriculum_seqlen", lambda v: v != 0,
     "curriculum_seqlen is GPT-NeoX's run-time record of the current curriculum length, not a setting: the length "
     "of each step comes from curriculum_learning (and is logged as curriculum_seqlen); delete the key"),
    ("sparse_attention", lambda v: v is not None, "DeepSpeed's sparse_attention section is not supported yet; "
                                                  "set sparsity_config and name the sparse layer types (sparse_fixed, "
                                                  "sparse_variable, bigbird, bslongformer) in attention_config"),
    ("sparse_gradients", bool, "sparse_gradients was removed from DeepSpeed; delete the key"),
    ("elasticity", lambda v: v is not None, "elastic training was removed from DeepSpeed; set the batch sizes directly"),
    ("compression_training", lambda v: v is not None, "the DeepSpeed compression library was removed; delete the key"),
    ("output_layer_parallelism", lambda v: v != "column", "only output_layer_parallelism 'column' exists (GPT-NeoX "
                                                         "defines no other value either)"),
    *((key, bool, f"Transformer Engine layers ({key}) are not supported yet") for key in TRANSFORMER_ENGINE_LAYERS),
    *((key, _not_default(key),
       f"Transformer Engine FP8 settings ({key}) are not supported yet (they only apply to Transformer Engine "
       f"layers); leave it at {_MODEL_DEFAULTS[key]!r} or delete the key") for key in TRANSFORMER_ENGINE_FP8_SETTINGS),
    ("deepspeed", lambda v: not v, "DeepSpeed is the engine here; there is no path without it (delete the key)"),
    ("deepspeed_activation_checkpointing", lambda v: not v,
     "activation checkpointing is always DeepSpeed's (the key is deprecated in GPT-NeoX); set "
     "checkpoint_activations: false to train without checkpointing"),
)

NOT_SUPPORTED_SETTINGS: Tuple[Tuple[str, Tuple[str, ...]], ...] = (
    ("GPT-NeoX's weight serving to a vLLM fork that shares the model's GPU memory (serve_model_weights; the "
     "rollout server here, tools/rollout_server.py, loads the newest checkpoint in save instead)",
     ("serve_model_weights", "weight_server_port")),
)
"""(feature that is not supported yet, the arguments that only that feature reads): each is refused when set to
anything but its default, since nothing would read it."""


def validated_model(args: NeoXArgsSchema) -> Optional[ModelConfig]:
    """The ModelConfig of derived ``args`` that validation checks, built once for model_problems and
    fusion_flag_warnings; None while a key of the model's shape is missing (model_problems names it)."""
    if any(getattr(args, name) is None for name in REQUIRED_MODEL_FIELDS):
        return None
    return ModelConfig.from_neox_args(args)


def fusion_flag_warnings(config: Optional[ModelConfig]) -> List[str]:
    """What to tell the user about fusion flags, and transformer-layer settings on an all-recurrent model,
    that are accepted but cannot take effect (megatron.model.config.softmax_fusion_warning and
    recurrent_only_warning); ``config``: validated_model's."""
    if config is None:
        return []
    message = softmax_fusion_warning(config)
    recurrent = recurrent_only_warning(config)
    return ([message + "; set it to false to silence this warning"] if message else []) + \
        ([recurrent] if recurrent else [])


def unknown_key_problems(keys: Iterable[str], known: Set[str], origin: dict) -> List[str]:
    """Each unknown key with its file and the closest known names."""
    problems = []
    for key in keys:
        if key in known:
            continue
        guesses = difflib.get_close_matches(key, sorted(known), n=3, cutoff=0.6)
        hint = f"; did you mean {' or '.join(repr(g) for g in guesses)}?" if guesses else ""
        problems.append(f"unknown argument '{key}' in {origin.get(key, 'the config')}{hint}")
    return problems


def derived_only_problems(provided: Set[str]) -> List[str]:
    return [f"'{key}' is computed from other arguments and cannot be set" for key in DERIVED_ONLY if key in provided]


def not_supported_problems(args: NeoXArgsSchema) -> List[str]:
    problems = []
    for key, switched_on, message in NOT_SUPPORTED_YET:
        value = getattr(args, key)
        if value is not None and switched_on(value):
            problems.append(f"{key}={value!r}: {message}")
    return problems


def not_supported_setting_problems(args: NeoXArgsSchema) -> List[str]:

    defaults = {f.name: f.default for f in dataclasses.fields(args)}
    problems = []
    for feature, names in NOT_SUPPORTED_SETTINGS:
        for name in names:
            value = getattr(args, name)
            if value != defaults[name]:
                problems.append(f"{name}={value!r} is a setting of {feature}, which is not supported yet; remove it "
                                f"(or set it to its default {defaults[name]!r})")
    return problems


def model_problems(args: NeoXArgsSchema, config: Optional[ModelConfig]) -> List[str]:
    """The model's own rules (megatron.model.config.ModelConfig.problems of ``config``, validated_model's)
    plus the GPT-NeoX keys around them."""
    if config is None:
        return [f"'{name}' is required (the model shape); set it in a config file"
                for name in REQUIRED_MODEL_FIELDS if getattr(args, name) is None]
    problems = config.problems()
    problems += packed_document_problems(args, config)
    problems += data_efficiency_problems(args, config)
    if args.make_vocab_size_divisible_by < 1:
        problems.append(f"make_vocab_size_divisible_by={args.make_vocab_size_divisible_by} must be >= 1")
    if args.soft_prompt_tuning is not None:
        allowed = {"enabled", "n_tokens", "init_string", "init_range"}
        extra = set(args.soft_prompt_tuning) - allowed
        if extra:
            problems.append(f"soft_prompt_tuning has unknown keys {sorted(extra)}; allowed: {sorted(allowed)}")
        init_string = args.soft_prompt_tuning.get("init_string")
        if init_string is not None and not isinstance(init_string, str):
            problems.append(f"soft_prompt_tuning.init_string={init_string!r} must be a string (its tokens' "
                            f"embeddings start the soft prompt)")
    return problems


def data_efficiency_problems(args: NeoXArgsSchema, config: ModelConfig) -> List[str]:
    """DeepSpeed's data_efficiency section: its structure, data_sampling's curriculum (megatron.data.data_efficiency)
    and data_routing's random-LTD on this model (megatron.model.random_ltd_settings)."""
    section = args.data_efficiency
    problems = data_efficiency.structure_problems(section)
    if problems:
        return problems
    problems += data_efficiency.sampling_problems(section, curriculum_enabled(args.curriculum_learning),
                                                  args.train_impl, args.dataset_impl, args.pipe_parallel_size,
                                                  args.rampup_batch_size is not None)
    routing = data_efficiency.routing_section(section)
    problems += random_ltd_problems(routing, config, args.train_impl)
    packed = args.inter_document_attention_masking or (args.reset_attention_mask and args.reset_position_ids)
    if routing is not None and packed:
        problems.append("data_efficiency.data_routing.random_ltd with packed documents (inter_document_attention_"
                        "masking, or reset_attention_mask with reset_position_ids): their attention finds the "
                        "documents from the whole sequence; turn those off")
    return problems


def packed_document_problems(args: NeoXArgsSchema, config: ModelConfig) -> List[str]:
    """inter_document_attention_masking: what packed documents (megatron.model.packed_attention) do not serve."""
    if not args.inter_document_attention_masking:
        return []
    why = "with inter_document_attention_masking is not supported"
    problems = []
    other = sorted(set(config.attention_types) & set(NO_PACKED_DOCUMENT_TYPES))
    if other:
        problems.append(f"attention_config layer types {other} {why} (they do not attend by document); use "
                        f"attention layers or set inter_document_attention_masking to false")
    if args.context_parallel_size > 1:
        problems.append(f"context_parallel_size={args.context_parallel_size} {why} (ring attention masks by position "
                        f"only); set context_parallel_size to 1")
    if config.soft_prompt_tokens is not None:
        problems.append(f"soft_prompt_tuning {why} (the prompt would join the first document only); disable it")
    return problems


def training_problems(args: NeoXArgsSchema) -> List[str]:
    problems = []
    lengths = [f"{name}={getattr(args, name)}" for name in ("train_iters", "train_epochs", "train_samples")
               if getattr(args, name) is not None]
    if len(lengths) > 1:
        problems.append(f"{' and '.join(lengths)} are {'both' if len(lengths) == 2 else 'all'} set; train_iters, "
                        f"train_samples and train_epochs are three ways to give the run's length, set one")
    if args.exit_duration_in_mins is not None and args.exit_duration_in_mins <= 0:
        problems.append(f"exit_duration_in_mins={args.exit_duration_in_mins} must be > 0 (minutes)")
    for name in ("train_iters", "train_epochs", "train_samples"):
        value = getattr(args, name)
        if value is not None and value < 1:
            problems.append(f"{name}={value} must be >= 1")
    if args.lr is not None and args.lr < 0:
        problems.append(f"lr={args.lr} must be >= 0 (the optimizer's learning rate)")
    if args.min_lr < 0:
        problems.append(f"min_lr={args.min_lr} must be >= 0")
    if args.lr is not None and args.min_lr > args.lr:
        problems.append(f"min_lr={args.min_lr} must be <= lr={args.lr}")
    if not 0 <= args.warmup <= 1:
        problems.append(f"warmup={args.warmup} is a fraction of training and must be in [0, 1]")
    if args.lr_decay_fraction is not None and not 0 < args.lr_decay_fraction <= 1:
        problems.append(f"lr_decay_fraction={args.lr_decay_fraction} must be in (0, 1]")
    for name in ("eval_interval", "log_interval", "checkpoint_num_layers"):
        value = getattr(args, name)
        if value is not None and value < 1:
            problems.append(f"{name}={value} must be >= 1")
    if args.checkpoint_factor is not None and args.checkpoint_factor < 1:
        problems.append(f"checkpoint_factor={args.checkpoint_factor} must be >= 1")
    if args.checkpoint_scale == "log" and args.checkpoint_factor is not None and args.checkpoint_factor < 2:
        problems.append("checkpoint_scale='log' needs checkpoint_factor >= 2")
    if not 0 <= args.hidden_dropout < 1 or not 0 <= args.attention_dropout < 1:
        problems.append(f"hidden_dropout={args.hidden_dropout} and attention_dropout={args.attention_dropout} "
                        f"must be in [0, 1)")
    problems += _split_problems(args.split)
    problems += non_persistent_problems(args)
    problems += s3_problems(args.s3_path, args.s3_chunk_size, args.save,
                            args.s3_chunk_size != type(args).__dataclass_fields__["s3_chunk_size"].default)
    if args.checkpoint_validation_with_forward_pass and args.train_impl != "normal":
        problems.append(f"checkpoint_validation_with_forward_pass with train_impl={args.train_impl!r} is not "
                        f"supported yet: the check compares the language-model loss of a fixed sequence, and this "
                        f"objective's loss needs preference pairs (and reference log-probabilities) that it does not "
                        f"have; set it to false")
    problems += gradient_noise_scale_problems(args) + profile_problems(args) + autoresume_problems(args)
    if args.no_save_optim and args.zero_stage == 3:
        problems.append("no_save_optim=true with ZeRO stage 3: stage 3 keeps the weights themselves in its optimizer "
                        "partitions, so a checkpoint without them would hold no weights; use ZeRO stage 0-2 or save "
                        "the optimizer state")
    if args.lora and args.zero_stage == 3 and args.model_parallel_size > 1:
        problems.append(f"lora with zero_optimization.stage=3 and model_parallel_size={args.model_parallel_size}: not "
                        f"supported yet: ZeRO-3 keeps the adapters in its partitioned files, which this project reads "
                        f"(merge_lora.py, export_lora_to_peft.py, generate.py) at model_parallel_size 1 only; use "
                        f"ZeRO stage 1 or 2 with tensor parallelism, or model_parallel_size 1 with ZeRO-3")
    if args.lora and args.pipe_parallel_size > 1 and args.train_impl in ("dpo", "kto") and not (
            args.precompute_model_name or (args.train_impl == "dpo" and args.dpo_reference_free)):
        problems.append(f"lora with train_impl {args.train_impl!r} and pipe_parallel_size={args.pipe_parallel_size}: "
                        f"not implemented yet. Under LoRA the reference model is the policy with its adapters off, "
                        f"and the reference log-probabilities are computed where the labels are read, on the last "
                        f"pipeline stage, which holds its own layers only. Precompute them (text_gen_type "
                        f"'precompute' and precompute_model_name){', set dpo_reference_free' if args.train_impl == 'dpo' else ''}"
                        f", or use pipe_parallel_size 0 or 1")
    problems += curriculum_problems(args.curriculum_learning, args.seq_length, args.train_impl,
                                    args.sequence_parallel, args.model_parallel_size)
    problems += comms_logger_problems(args.comms_logger)
    problems += autotuning_problems(args)
    problems += mup_run_problems(args)
    problems += _data_path_problems(args)
    if args.optimizer_type in COMPRESSED_OPTIMIZERS:
        problems.append(f"optimizer.type={COMPRESSED_OPTIMIZERS[args.optimizer_type]!r}: DeepSpeed's "
                        f"communication-compressed optimizers need its compressed-allreduce backends (NCCL or MPI "
                        f"with CUDA; there is no gloo path for CPU ranks), and the installed DeepSpeed (0.19) no "
                        f"longer ships them or the optimizers; use type Adam")
    elif args.optimizer_type == "lamb":
        problems.append("optimizer.type='Lamb' (DeepSpeed's FusedLamb, a CUDA op) is not supported yet; use Adam")
    elif args.optimizer_type not in ("adam", "cpu_adam", "cpu_torch_adam", "sm3", "madgrad_wd", "sgd", "lion"):
        problems.append(f"optimizer.type={args.optimizer_type!r} must be one of Adam, CPU_Adam, CPU_torch_Adam, SM3, "
                        f"madgrad_wd, SGD, Lion")
    return problems


def autoresume_problems(args: NeoXArgsSchema) -> List[str]:
    """adlr_autoresume (megatron.training.autoresume): its interval is its setting, at least one iteration."""
    interval = args.adlr_autoresume_interval
    default = type(args).__dataclass_fields__["adlr_autoresume_interval"].default
    if not args.adlr_autoresume:
        return [] if interval == default else [
            f"adlr_autoresume_interval={interval!r} is a setting of adlr_autoresume; set adlr_autoresume: true or "
            f"remove it"]
    return [] if interval >= 1 else [f"adlr_autoresume_interval={interval} must be >= 1 (iterations between two "
                                     f"questions to the scheduler)"]


def gradient_noise_scale_problems(args: NeoXArgsSchema) -> List[str]:
    """log_gradient_noise_scale (megatron.observability.gradient_noise_scale): its settings need it on; the large
    batch is at least two steps, and the small one a fixed train_batch_size."""
    defaults = {f.name: f.default for f in dataclasses.fields(args)}
    if not args.log_gradient_noise_scale:
        return [f"{name}={getattr(args, name)!r} is a setting of log_gradient_noise_scale; set "
                f"log_gradient_noise_scale: true or remove it"
                for name in ("gradient_noise_scale_n_batches", "gradient_noise_scale_cpu_offload")
                if getattr(args, name) != defaults[name]]
    problems = []
    if args.gradient_noise_scale_n_batches < 2:
        problems.append(f"gradient_noise_scale_n_batches={args.gradient_noise_scale_n_batches} must be >= 2: the "
                        f"large batch of the gradient noise scale is that many steps' gradients")
    if args.rampup_batch_size is not None:
        problems.append("log_gradient_noise_scale with rampup_batch_size is not supported yet: the estimate compares "
                        "gradients of a fixed train_batch_size with their mean over gradient_noise_scale_n_batches "
                        "steps; remove one of them")
    return problems


def profile_problems(args: NeoXArgsSchema) -> List[str]:
    """profile (megatron.observability.profiler): its steps need it on, are in order, and the traces a directory."""
    defaults = {f.name: f.default for f in dataclasses.fields(args)}
    steps = ("profile_step_start", "profile_step_stop")
    if not args.profile:
        return [f"{name}={getattr(args, name)!r} is a setting of profile; set profile: true or remove it"
                for name in steps if getattr(args, name) != defaults[name]]
    problems = []
    start, stop = args.profile_step_start, args.profile_step_stop
    if not 0 <= start <= stop:
        problems.append(f"profile_step_start={start} and profile_step_stop={stop}: need 0 <= start <= stop (the "
                        f"steps taken before the first and the last profiled step)")
    elif args.train_iters is not None and start >= args.train_iters:
        problems.append(f"profile_step_start={start} is not below train_iters={args.train_iters}: no step would be "
                        f"profiled; lower it")
    if not (args.tensorboard_dir or args.log_dir):
        problems.append("profile=true writes one torch.profiler trace per rank into <tensorboard_dir>/profile or "
                        "<log_dir>/profile; set tensorboard_dir or log_dir")
    return problems


def non_persistent_problems(args: NeoXArgsSchema) -> List[str]:
    """Megatron-LM's non-persistent checkpoints (megatron.checkpoint.non_persistent): type 'global' only, its
    keys together, and a directory of its own."""
    kind, interval, directory = (args.non_persistent_ckpt_type, args.non_persistent_save_interval,
                                 args.non_persistent_global_ckpt_dir)
    if kind in ("local", "in_memory"):
        return [f"non_persistent_ckpt_type={kind!r} is not supported yet (Megatron-LM marks it TBD too); use "
                f"'global' (non_persistent_global_ckpt_dir)"]
    problems = []
    if interval is not None and interval < 1:
        problems.append(f"non_persistent_save_interval={interval} must be >= 1")
    if interval is not None and kind is None:
        problems.append(f"non_persistent_save_interval={interval} needs non_persistent_ckpt_type: global")
    if directory is not None and kind is None:
        problems.append(f"non_persistent_global_ckpt_dir={directory!r} needs non_persistent_ckpt_type: global")
    if interval is not None and not args.save:
        problems.append(f"non_persistent_save_interval={interval} needs save (the run's checkpoint directory)")
    if directory is not None and any(d and os.path.abspath(directory) == os.path.abspath(d)
                                     for d in (args.save, args.load)):
        problems.append(f"non_persistent_global_ckpt_dir={directory!r} is the save / load directory; it keeps only "
                        f"its newest checkpoint, so give it a directory of its own (default: {{save}}/non_persistent)")
    return problems


WSD_ONLY = ("lr_wsd_decay_style", "lr_wsd_decay_iters", "lr_wsd_decay_samples")
SAMPLE_LENGTHS = {"lr_warmup_samples": ("lr_warmup_iters", "warmup"),
                  "lr_decay_samples": ("lr_decay_iters", "lr_decay_fraction"),
                  "lr_wsd_decay_samples": ("lr_wsd_decay_iters",)}
"""Megatron-LM's learning-rate lengths in samples, with the keys that give the same length otherwise."""


def sample_length_problems(args: NeoXArgsSchema, changed: Set[str]) -> List[str]:
    """lr_*_samples: only with train_samples (Megatron-LM's rule: a run counted in iterations counts its schedule
    in iterations), never with a key that gives the same length another way, and in range."""
    problems = []
    for name, others in SAMPLE_LENGTHS.items():
        value = getattr(args, name)
        if value is None:
            continue
        if args.train_samples is None:
            problems.append(f"{name}={value} counts the schedule in samples, which needs the run's length as "
                            f"train_samples (as in Megatron-LM); with train_iters or train_epochs use {others[0]}")
        problems += [f"{name}={value} and {other}={getattr(args, other)} are both set; they give one length (in "
                     f"samples, in iterations), keep one" for other in others if other in changed]
        least = 0 if name == "lr_warmup_samples" else 1
        if value < least:
            problems.append(f"{name}={value} must be >= {least}")
    return problems


def lr_schedule_problems(args: NeoXArgsSchema, provided: Set[str]) -> List[str]:
    """The Megatron-LM schedule keys (warmup in iterations and its start value, wsd, decoupled_lr, the
    weight-decay schedule): each set only where it is read, and in range."""
    defaults = {f.name: f.default for f in dataclasses.fields(args)}
    changed = {name for name in provided if getattr(args, name) != defaults[name]}  # to_dict() round-trips
    problems = sample_length_problems(args, changed)
    if args.lr_warmup_iters is not None and "warmup" in changed:
        problems.append(f"lr_warmup_iters={args.lr_warmup_iters} and warmup={args.warmup} are both set; they are "
                        f"two ways to give the warmup length (iterations, fraction of the decay), keep one")
    if args.lr_warmup_iters is not None and args.lr_warmup_iters < 0:
        problems.append(f"lr_warmup_iters={args.lr_warmup_iters} must be >= 0")
    if args.lr_warmup_init is not None and args.lr is not None and not 0 <= args.lr_warmup_init <= args.lr:
        problems.append(f"lr_warmup_init={args.lr_warmup_init} must be in [0, lr={args.lr}]")
    if args.lr_decay_style != "wsd":
        problems += [f"{name} is only read by lr_decay_style 'wsd' (lr_decay_style is {args.lr_decay_style!r}); "
                     f"remove it or set lr_decay_style: wsd" for name in WSD_ONLY if name in changed]
    elif args.lr_wsd_decay_iters is None and args.lr_wsd_decay_samples is None:
        problems.append("lr_decay_style 'wsd' needs lr_wsd_decay_iters (the length of its final decay, in "
                        "iterations) or, with train_samples, lr_wsd_decay_samples")
    elif args.lr_wsd_decay_iters is not None and args.lr_wsd_decay_iters < 1:
        problems.append(f"lr_wsd_decay_iters={args.lr_wsd_decay_iters} must be >= 1")
    elif not problems and args.train_batch_size and (
            args.train_iters is not None or (args.train_samples is not None and not rampup_problems(args))):

        decay, warmup = decay_and_warmup_iters(args, schedule_length(args, training_iterations(args)))
        if wsd_decay_iters(args) > decay - warmup:
            given = "lr_wsd_decay_samples" if args.lr_wsd_decay_samples is not None else "lr_wsd_decay_iters"
            problems.append(f"{given}={getattr(args, given)} is longer than the decay iterations after "
                            f"warmup ({decay:g} - {warmup:g}); the stable phase would start inside the warmup")
    if args.decoupled_min_lr is not None and args.decoupled_lr is None:
        problems.append(f"decoupled_min_lr={args.decoupled_min_lr} needs decoupled_lr (the peak rate of the input "
                        f"and output layers)")
    if args.decoupled_lr is not None:
        floor = args.min_lr if args.decoupled_min_lr is None else args.decoupled_min_lr
        if args.decoupled_lr < 0 or floor < 0 or floor > args.decoupled_lr:
            problems.append(f"decoupled_lr={args.decoupled_lr} and decoupled_min_lr={args.decoupled_min_lr} (unset: "
                            f"min_lr) must be >= 0 with decoupled_min_lr <= decoupled_lr")
        if args.lr_warmup_init is not None and args.lr_warmup_init > args.decoupled_lr:
            problems.append(f"lr_warmup_init={args.lr_warmup_init} must be <= decoupled_lr={args.decoupled_lr}")
    for name in ("start_weight_decay", "end_weight_decay"):
        value = getattr(args, name)
        if value is not None and value < 0:
            problems.append(f"{name}={value} must be >= 0")

    try:
        base = base_weight_decay(args)
    except (TypeError, ValueError, AttributeError):
        return problems  # a malformed optimizer dict; building the optimizer names it
    start = base if args.start_weight_decay is None else args.start_weight_decay
    end = base if args.end_weight_decay is None else args.end_weight_decay
    if args.weight_decay_incr_style == "constant" and start != end:
        problems.append(f"start_weight_decay={start} and end_weight_decay={end} differ but weight_decay_incr_style is "
                        f"'constant'; set weight_decay_incr_style: linear or cosine")
    return problems


def rampup_problems(args: NeoXArgsSchema) -> List[str]:
    """rampup_batch_size [start, increment, samples]: whole micro-batches per data-parallel rank at every
    size, and only where the batch can change between steps."""
    ramp = args.rampup_batch_size
    if ramp is None:
        return []
    if len(ramp) != 3 or any(isinstance(v, bool) or not isinstance(v, int) for v in ramp):
        return [f"rampup_batch_size={ramp!r} must be three integers [start, increment, samples]"]
    start, increment, samples = ramp
    problems = []
    if args.train_samples is None and (args.train_iters is not None or args.train_epochs is not None):
        problems.append("rampup_batch_size needs the run's length as train_samples (as in Megatron-LM): under a ramp "
                        "iterations and samples differ; replace train_iters / train_epochs by train_samples")
    if args.scheduler is not None:
        problems.append("rampup_batch_size with a DeepSpeed `scheduler` dict is not supported: its schedulers count "
                        "steps, not samples; use the built-in schedule (lr_decay_style, ...)")
    global_batch, micro, dp = args.train_batch_size, args.train_micro_batch_size_per_gpu, args.data_parallel_size
    if start < 1 or increment < 1 or samples < 0:
        problems.append(f"rampup_batch_size={ramp}: start and increment must be >= 1 and samples >= 0")
    elif global_batch is not None and micro is not None and dp is not None:
        unit = micro * dp
        if start > global_batch or (global_batch - start) % increment:
            problems.append(f"rampup_batch_size={ramp}: the batch must grow from start={start} to train_batch_size="
                            f"{global_batch} in whole increments of {increment}")
        if start % unit or increment % unit:
            problems.append(f"rampup_batch_size={ramp}: start and increment must be multiples of "
                            f"train_micro_batch_size_per_gpu x data-parallel size = {micro} x {dp} = {unit} (the "
                            f"ramp changes the number of micro-batches, not their size)")
    return problems


DPO_SETTINGS = ("dpo_fp32", "dpo_reference_free", "dpo_beta")
KTO_SETTINGS = ("kto_fp32", "kto_desirable_weight", "kto_undesirable_weight", "kto_beta")
PAIRWISE_PATHS = tuple(f"{kind}_{split}_{label}data_paths" for split in ("train", "valid", "test")
                       for label in ("", "label_") for kind in ("pos", "neg"))


def post_training_problems(args: NeoXArgsSchema) -> List[str]:
    """train_impl 'dpo' / 'rm' and dataset_impl 'pairwise' (megatron/post_training): which keys go together, and
    the layouts they run on (DPO's frozen reference model is a sequential copy of the policy, on the last pipeline
    stage under pipeline parallelism; a reward model's value head is replicated over whole sequences)."""
    defaults = {f.name: f.default for f in dataclasses.fields(args)}
    problems = []
    for impl, settings in (("dpo", DPO_SETTINGS), ("kto", KTO_SETTINGS)):
        if args.train_impl != impl:
            problems += [f"{name}={getattr(args, name)!r} is a setting of train_impl '{impl}'; set train_impl: "
                         f"{impl} or remove it" for name in settings if getattr(args, name) != defaults[name]]
    problems += _kto_problems(args) + _precompute_problems(args) + _reinforce_problems(args)
    if args.z_loss < 0 or (args.z_loss and args.train_impl != "rm"):
        problems.append(f"z_loss={args.z_loss} (with train_impl={args.train_impl!r}): z_loss is the reward model's "
                        f"z-loss coefficient (train_impl 'rm', as in GPT-NeoX) and must be >= 0; set train_impl: rm "
                        f"or remove z_loss")
    if args.dataset_impl != "pairwise":
        problems += [f"{name} is pairwise data: set dataset_impl: pairwise or remove it"
                     for name in PAIRWISE_PATHS if getattr(args, name)]
        if args.train_impl in ("dpo", "rm"):
            problems.append(f"train_impl {args.train_impl!r} trains on chosen / rejected pairs: set dataset_impl: "
                            f"pairwise with pos_train_data_paths and neg_train_data_paths")
        return problems
    if args.train_impl not in ("dpo", "rm"):
        problems.append(f"dataset_impl 'pairwise' is read by train_impl 'dpo' and 'rm' only (train_impl="
                        f"{args.train_impl!r} would train on it as plain text); set train_impl: dpo or rm")
    if args.pack_impl != "unpacked":
        problems.append(f"pack_impl={args.pack_impl!r}: dataset_impl 'pairwise' takes one chosen / rejected pair per "
                        f"sample; set pack_impl: unpacked")
    if args.train_epochs is not None:
        problems.append("train_epochs with dataset_impl 'pairwise' is not supported yet; set train_iters")
    if not args.pos_train_data_paths and not args.neg_train_data_paths and args.do_train is not False:
        problems.append("dataset_impl 'pairwise' needs pos_train_data_paths (chosen) and neg_train_data_paths "
                        "(rejected)")
    for name in ("data_path", "train_data_paths", "valid_data_paths", "test_data_paths"):
        if getattr(args, name):
            problems.append(f"{name} is not read with dataset_impl 'pairwise'; give pos_*/neg_* data paths instead")
    for split in ("train", "valid", "test"):
        for label in ("", "label_"):
            pos, neg = getattr(args, f"pos_{split}_{label}data_paths"), getattr(args, f"neg_{split}_{label}data_paths")
            if bool(pos) != bool(neg):
                have, missing = ("pos", "neg") if pos else ("neg", "pos")
                problems.append(f"{have}_{split}_{label}data_paths is set but {missing}_{split}_{label}data_paths is "
                                f"not: every chosen (pos_*) dataset needs its rejected (neg_*) one")
            elif pos and len(pos) != len(neg):
                problems.append(f"pos_{split}_{label}data_paths has {len(pos)} entries but neg_{split}_{label}"
                                f"data_paths has {len(neg)}")
        data, labels = getattr(args, f"pos_{split}_data_paths"), getattr(args, f"pos_{split}_label_data_paths")
        if labels and (not data or len(labels) != len(data)):
            problems.append(f"pos_{split}_label_data_paths has {len(labels)} entries but pos_{split}_data_paths has "
                            f"{len(data or [])}")
    if args.train_impl == "rm" and args.sequence_parallel:
        problems.append("train_impl 'rm' with sequence_parallel is not supported yet (the value head scores whole "
                        "sequences); set sequence_parallel: false")
    if args.train_impl == "dpo":
        if args.dpo_beta <= 0:
            problems.append(f"dpo_beta={args.dpo_beta} must be > 0")
    return problems


def _precompute_problems(args: NeoXArgsSchema) -> List[str]:
    """text_gen_type 'precompute' writes the reference log-probabilities of the data that DPO (pairwise) or KTO
    with precompute_model_name reads (megatron.post_training.precompute)."""
    name = args.precompute_model_name
    if args.text_gen_type == "precompute":
        problems = [] if name else ["text_gen_type 'precompute' needs precompute_model_name (the suffix of the "
                                    "files it writes: {data path}_{precompute_model_name})"]
        pairwise = args.dataset_impl == "pairwise" and args.pos_train_data_paths
        if not pairwise and not (args.train_impl == "kto" and args.train_data_paths):
            problems.append("text_gen_type 'precompute' computes the reference log-probabilities of the data of a DPO "
                            "or KTO run: use that run's config (dataset_impl: pairwise with the pos_* / neg_* data "
                            "paths, or train_impl: kto with train_data_paths)")
        return problems
    if name and args.train_impl not in ("dpo", "kto"):
        return [f"precompute_model_name={name!r} is read by train_impl 'dpo' and 'kto' (precomputed reference "
                f"log-probabilities) and text_gen_type 'precompute' (which writes them)"]
    return []


REINFORCE_SETTINGS = ("fp32_reinforce", "kl_div_beta", "kl_impl", "reinforce_leave_one_out")
ONLINE_SETTINGS = ("online_dataserver_ips", "online_dataserver_ports")
ONLINE_UNREAD_PATHS = ("data_path", *(f"{split}_{kind}data_paths" for split in ("train", "valid", "test")
                                      for kind in ("", "label_")))


def _reinforce_problems(args: NeoXArgsSchema) -> List[str]:
    """train_impl 'reinforce' trains on dataset_impl 'online' rollouts and nothing else reads them
    (megatron.post_training.reinforce, megatron.data.online_dataset)."""
    defaults = {f.name: f.default for f in dataclasses.fields(args)}
    problems = []
    if args.train_impl != "reinforce":
        problems += [f"{name}={getattr(args, name)!r} is a setting of train_impl 'reinforce'; set train_impl: "
                     f"reinforce or remove it" for name in REINFORCE_SETTINGS if getattr(args, name) != defaults[name]]
        if args.dataset_impl == "online":
            problems.append(f"dataset_impl 'online' (rollouts with rewards) is read by train_impl 'reinforce' only, "
                            f"not {args.train_impl!r}; set train_impl: reinforce")
    elif args.dataset_impl != "online":
        problems.append(f"train_impl 'reinforce' trains on rollouts from a rollout server: set dataset_impl: online "
                        f"(with online_dataserver_ips / online_dataserver_ports), not {args.dataset_impl!r}")
    if args.dataset_impl != "online":
        return problems + [f"{name}={getattr(args, name)!r} is a setting of dataset_impl 'online'; set dataset_impl: "
                           f"online or remove it" for name in ONLINE_SETTINGS if getattr(args, name) != defaults[name]]
    if args.kl_div_beta < 0:
        problems.append(f"kl_div_beta={args.kl_div_beta} must be >= 0 (0: no KL term and no reference model)")
    if args.pipe_parallel_size > 1 or args.context_parallel_size > 1:
        problems.append(f"dataset_impl 'online' with pipe_parallel_size={args.pipe_parallel_size} / "
                        f"context_parallel_size={args.context_parallel_size} is not supported yet (each rollout is "
                        f"fetched once, by the rank that trains on it); set both to 1 or 0")
    if args.train_epochs is not None:
        problems.append("train_epochs with dataset_impl 'online' has no meaning (the server decides the data); set "
                        "train_iters")
    dp = args.data_parallel_size
    for name in ONLINE_SETTINGS:
        value = getattr(args, name)
        if isinstance(value, list) and dp and len(value) != dp:
            problems.append(f"{name} has {len(value)} entries for {dp} data-parallel ranks: give one per "
                            f"data-parallel rank (rank i asks entry i), or one value for all")
    ports = args.online_dataserver_ports
    if any(not 0 < int(port) < 65536 for port in (ports if isinstance(ports, list) else [ports])):
        problems.append(f"online_dataserver_ports={ports!r}: ports are 1..65535")
    return problems


def online_data_warnings(args: NeoXArgsSchema) -> List[str]:
    """Data paths a dataset_impl 'online' run does not read (GPT-NeoX's example config sets them, and GPT-NeoX
    ignores them too)."""
    if args.dataset_impl != "online":
        return []
    unread = [name for name in ONLINE_UNREAD_PATHS if getattr(args, name)]
    return [f"{', '.join(unread)}: not read with dataset_impl 'online' (the rollout server supplies the data); "
            f"remove them to silence this warning"] if unread else []


def _kto_problems(args: NeoXArgsSchema) -> List[str]:
    """train_impl 'kto': completions with a desirable / undesirable reward each (megatron.post_training.kto)."""
    splits = ("train", "valid", "test")
    if args.train_impl != "kto":
        return [f"{split}_reward_data_paths is read by train_impl 'kto' only; set train_impl: kto or remove it"
                for split in splits if getattr(args, f"{split}_reward_data_paths")]
    problems = []
    if args.dataset_impl != "gpt2":
        problems.append(f"train_impl 'kto' reads dataset_impl 'gpt2' (completions with rewards), not "
                        f"{args.dataset_impl!r}")
    if args.pack_impl != "unpacked":
        problems.append(f"pack_impl={args.pack_impl!r}: train_impl 'kto' takes one completion (one reward) per "
                        f"sample; set pack_impl: unpacked")
    if not args.train_data_paths:
        problems.append("train_impl 'kto' needs train_data_paths (with train_label_data_paths) and "
                        "train_reward_data_paths (preprocess_data_with_chat_template.py --reward-key)")
    for split in splits:
        paths, rewards = getattr(args, f"{split}_data_paths"), getattr(args, f"{split}_reward_data_paths")
        if paths and not rewards:
            problems.append(f"train_impl 'kto' needs {split}_reward_data_paths beside {split}_data_paths (one "
                            f"desirable / undesirable reward per completion)")
        elif rewards and len(rewards) != len(paths or []):
            problems.append(f"{split}_reward_data_paths has {len(rewards)} entries but {split}_data_paths has "
                            f"{len(paths or [])}")
    micro = args.train_micro_batch_size_per_gpu
    if micro is not None and (micro < 2 or micro % 2):
        problems.append(f"train_micro_batch_size_per_gpu={micro}: train_impl 'kto' estimates its KL reference "
                        f"point from the other half of each micro-batch; use an even size >= 2")
    if args.kto_beta <= 0:
        problems.append(f"kto_beta={args.kto_beta} must be > 0")
    return problems


def _split_problems(split: str) -> List[str]:
    try:
        parts = [float(p) for p in split.replace("/", ",").split(",") if p.strip()]
    except ValueError:
        return [f"split={split!r} must be comma-separated numbers such as '969, 30, 1'"]
    if not 1 <= len(parts) <= 3 or any(p < 0 for p in parts) or sum(parts) <= 0:
        return [f"split={split!r} must be 1 to 3 non-negative numbers with a positive sum"]
    return []


def _data_path_problems(args: NeoXArgsSchema) -> List[str]:
    problems = []
    separate = {s: getattr(args, f"{s}_data_paths") for s in ("train", "valid", "test")}
    given = [s for s, paths in separate.items() if paths]
    if args.data_path is not None and given:
        problems.append(f"data_path and {', '.join(s + '_data_paths' for s in given)} are both set; use data_path "
                        f"(split by 'split') or the separate lists, not both")
    if given and len(given) != 3:
        missing = [f"{s}_data_paths" for s in separate if s not in given]
        problems.append(f"{', '.join(s + '_data_paths' for s in given)} set without {', '.join(missing)}; "
                        f"give all three lists")
    for split_name, paths in separate.items():
        if args.dataset_impl == "pairwise":
            paths = getattr(args, f"pos_{split_name}_data_paths")
        weights = getattr(args, f"{split_name}_data_weights")
        if weights is not None:
            if not paths:
                problems.append(f"{split_name}_data_weights is set but {split_name}_data_paths is not")
            elif len(weights) != len(paths):
                problems.append(f"{split_name}_data_weights has {len(weights)} entries but {split_name}_data_paths "
                                f"has {len(paths)}")
            elif any(not isinstance(w, (int, float)) or isinstance(w, bool) or w < 0 for w in weights):
                problems.append(f"{split_name}_data_weights={weights} must be non-negative numbers")
        labels = getattr(args, f"{split_name}_label_data_paths")
        if labels is not None and paths and len(labels) != len(paths):
            problems.append(f"{split_name}_label_data_paths has {len(labels)} entries but {split_name}_data_paths "
                            f"has {len(paths)}")
    return problems


def context_parallel_problems(args: NeoXArgsSchema) -> List[str]:
    """context_parallel_size: the data-side rules (the model's are ModelConfig's, reported with the model's)."""
    cp = args.context_parallel_size
    if cp < 1:
        return [f"context_parallel_size={cp} must be >= 1"]
    if cp == 1:
        return []
    why = f"with context_parallel_size={cp} is not supported yet"
    problems = []
    if args.reset_attention_mask:
        problems.append(f"reset_attention_mask {why} (ring attention masks by position only); set it to false")
    if args.zero_stage == 3 and (args.zero_optimization or {}).get("reduce_scatter", True) is False:
        problems.append(f"zero_optimization.reduce_scatter=false with stage 3 {why} (the gradients of stage 3 under "
                        f"context parallelism are scaled for its reduce-scatter's average, megatron.training.loop."
                        f"_partition_over_data_and_context); keep reduce_scatter true (the default)")
    if curriculum_enabled(args.curriculum_learning):
        problems.append(f"curriculum_learning {why} (the curriculum cuts whole sequences, the batch is already "
                        f"split); disable it")
    if args.rampup_batch_size is not None and args.pipe_parallel_size >= 1:
        problems.append(f"rampup_batch_size with pipe_parallel_size={args.pipe_parallel_size} {why} (the pipeline "
                        f"engine counts each context rank's chunks as samples of their own, and the ramp's batch "
                        f"sizes are not scaled for it); use pipe_parallel_size 0 or remove rampup_batch_size")
    return problems


def parallelism_problems(args: NeoXArgsSchema) -> List[str]:
    problems = []
    if args.pipe_parallel_size < 0 or args.model_parallel_size < 1:
        problems.append(f"pipe_parallel_size={args.pipe_parallel_size} must be >= 0 and model_parallel_size="
                        f"{args.model_parallel_size} >= 1")
    problems += context_parallel_problems(args)
    if not isinstance(args.zero_stage, int):
        problems += zero_stage_space_problems(args.zero_stage, args.autotuning_run)
    elif args.zero_stage not in (0, 1, 2, 3):
        problems.append(f"zero_optimization.stage={args.zero_stage} must be 0, 1, 2 or 3")
    elif args.zero_stage >= 2 and args.pipe_parallel_size >= 1:
        problems.append(f"zero_optimization.stage={args.zero_stage} cannot be combined with pipeline parallelism "
                        f"(pipe_parallel_size={args.pipe_parallel_size}): DeepSpeed's pipeline engine supports ZeRO "
                        f"0 and 1 only; use stage 1 or pipe_parallel_size 0")
    method = args.pipe_partition_method
    if method not in ("parameters", "uniform") and not method.startswith("type:"):
        problems.append(f"pipe_partition_method={method!r} must be 'parameters', 'uniform' or 'type:REGEX'")
    if (args.comment or args.account) and args.launcher != "slurm":
        problems.append(f"comment / account are slurm options; launcher is {args.launcher!r}")
    problems += offload_problems(args.zero_stage, args.zero_optimization, args.optimizer_type,
                                 args.deepspeed_extra_args)
    return problems
