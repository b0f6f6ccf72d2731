"""The rules a GPT-NeoX config must satisfy, each returning messages that name the key, the value and
what is allowed. Nothing here looks at the local machine: deepy.py often runs on a head node without
GPUs, so device-dependent checks (fp16 needs CUDA) run where the workers start (see `check_device`)."""

import difflib
from typing import TYPE_CHECKING, Any, Callable, Iterable, List, Set, Tuple

from megatron.neox_arguments.derivation import ATTENTION_TYPES

if TYPE_CHECKING:
    from megatron.neox_arguments.arguments import NeoXArgs

REQUIRED_MODEL_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "seq_length")
DERIVED_ONLY = ("data_parallel_size", "deepspeed_config", "is_pipe_parallel")
BUILT_ATTENTION_TYPES = ("global", "local", "flash")
SPLIT_OPTIONS = ("grouped", "spaced")

# (key, predicate on its value that means "this feature is switched on", what to tell the user)
NOT_SUPPORTED_YET: Tuple[Tuple[str, Callable[[Any], bool], str], ...] = (
    ("train_impl", lambda v: v != "normal", "only train_impl 'normal' (language-model pretraining) is built; "
                                             "dpo / rm / kto are not supported yet"),
    ("dataset_impl", lambda v: v != "gpt2", "only dataset_impl 'gpt2' is built; 'pairwise' is not supported yet"),
    ("use_mup", bool, "muP (use_mup) is not supported yet"),
    ("coord_check", bool, "coord_check (muP coordinate check) is not supported yet"),
    ("save_base_shapes", bool, "save_base_shapes (muP) is not supported yet"),
    ("moe_num_experts", lambda v: v > 1, "mixture of experts (moe_num_experts > 1) is not supported yet"),
    ("norm", lambda v: v.startswith("te_"), "Transformer-Engine norms (te_rmsnorm, te_layernorm) are not "
                                            "supported yet; use rmsnorm or layernorm"),
    ("s3_path", lambda v: v is not None, "uploading checkpoints to S3 (s3_path) is not supported yet"),
    ("adlr_autoresume", bool, "adlr_autoresume is not supported yet"),
    ("use_bnb_optimizer", bool, "bitsandbytes optimizers (use_bnb_optimizer) are not supported yet"),
    ("use_tutel", bool, "tutel MoE (use_tutel) is not supported yet"),
    ("onnx_safe", bool, "onnx_safe is not supported yet"),
    ("lazy_mpu_init", bool, "lazy_mpu_init is not supported yet"),
    ("log_gradient_noise_scale", bool, "log_gradient_noise_scale is not supported yet"),
    ("profile", bool, "nsys profiling (profile) is not supported yet"),
    ("amp", lambda v: v is not None and v.get("enabled", False),
     "apex AMP (amp) is not supported; use the bf16 or fp16 dicts"),
    ("autotuning", lambda v: v is not None, "DeepSpeed autotuning is not supported yet"),
    ("autotuning_run", lambda v: v is not None, "DeepSpeed autotuning (autotuning_run) is not supported yet"),
    ("curriculum_learning", lambda v: v is not None and v.get("enabled", False),
     "curriculum_learning is not supported yet"),
    ("data_efficiency", lambda v: v is not None, "DeepSpeed data_efficiency is not supported yet"),
    ("sparse_attention", lambda v: v is not None, "DeepSpeed sparse_attention is not supported yet"),
    ("sparsity_config", lambda v: v is not None, "sparse attention (sparsity_config) is not supported yet"),
    ("checkpoint_validation_with_forward_pass", bool,
     "checkpoint_validation_with_forward_pass is not supported yet"),
    ("text_gen_type", lambda v: v == "precompute", "text_gen_type 'precompute' is not supported yet"),
    ("sparse_gradients", bool, "sparse_gradients was removed from DeepSpeed; delete the key"),
    ("elasticity", lambda v: v is not None, "elastic training was removed from DeepSpeed; set the batch sizes directly"),
    ("compression_training", lambda v: v is not None, "the DeepSpeed compression library was removed; delete the key"),
    ("num_unique_layers", lambda v: v is not None, "parameter sharing (num_unique_layers) is not supported yet"),
    ("soft_prompt_tuning", lambda v: v is not None and v.get("init_string"),
     "soft_prompt_tuning.init_string is not supported yet; use init_range"),
    ("no_save_optim", bool, "no_save_optim is not supported yet (DeepSpeed always saves optimizer states)"),
    ("output_layer_parallelism", lambda v: v != "column", "only output_layer_parallelism 'column' is built"),
    ("deepspeed", lambda v: not v, "DeepSpeed is the engine here; there is no path without it (delete the key)"),
    ("deepspeed_activation_checkpointing", lambda v: not v,
     "activation checkpointing is always DeepSpeed's (the key is deprecated in GPT-NeoX); set "
     "checkpoint_activations: false to train without checkpointing"),
)

NOT_SUPPORTED_SETTINGS: Tuple[Tuple[str, Tuple[str, ...]], ...] = (
    ("muP (use_mup)", ("base_shapes_file", "mup_init_scale", "mup_attn_temp", "mup_output_temp",
                       "mup_embedding_mult", "mup_rp_embedding_mult", "mup_width_scale")),
    ("mixture of experts (moe_num_experts > 1)",
     ("expert_interval", "moe_top_k", "moe_loss_coeff", "moe_train_capacity_factor", "moe_eval_capacity_factor",
      "moe_min_capacity", "moe_token_dropping", "create_moe_param_group", "moe_use_residual",
      "moe_expert_parallel_size", "moe_type", "moe_glu", "moe_lbl_in_fp32", "moe_jitter_eps",
      "enable_expert_tensor_parallelism")),
    ("Mamba layers (attention type 'mamba')",
     ("mamba_selective_scan_fusion", "mamba_causal_conv_fusion", "mamba_inner_func_fusion",
      "mamba_selective_fp32_params", "mamba_use_bias_in_conv", "mamba_use_bias_in_linears")),
    ("RWKV layers (attention type 'rwkv')", ("dim_att", "head_size", "ffn_dim")),
    ("gMLP / aMLP layers (attention types 'gmlp', 'amlp')", ("gmlp_attn_dim",)),
    ("gradient noise scale logging (log_gradient_noise_scale)",
     ("gradient_noise_scale_n_batches", "gradient_noise_scale_cpu_offload")),
    ("nsys profiling (profile)", ("profile_step_start", "profile_step_stop")),
    ("adlr_autoresume", ("adlr_autoresume_interval",)),
    ("uploading checkpoints to S3 (s3_path)", ("s3_chunk_size",)),
    ("DPO / KTO training (train_impl 'dpo' / 'kto')",
     ("dpo_fp32", "dpo_reference_free", "dpo_beta", "kto_fp32", "kto_desirable_weight", "kto_undesirable_weight",
      "kto_beta")),
    ("precomputing logprobs (text_gen_type 'precompute')", ("precompute_model_name",)),
    ("curriculum_learning", ("curriculum_seqlen",)),
    ("parameter sharing (num_unique_layers)", ("param_sharing_style",)),
)
"""(feature that is not supported yet, the arguments that only that feature reads): each is refused when set to
anything but its default, since nothing would read it."""


SOFTMAX_FUSION_FLAGS = ("scaled_upper_triang_masked_softmax_fusion", "scaled_masked_softmax_fusion")


def fusion_flag_problems(neox_args) -> List[str]:
    """Problems for fusion flags that are on although the model has no op for them to replace."""
    problems = []
    norm = getattr(neox_args, "norm", "layernorm") or "layernorm"
    if getattr(neox_args, "layernorm_fusion", False) and norm != "layernorm":
        problems.append(f"layernorm_fusion=true fuses norm='layernorm', but norm={norm!r}; "
                        + ("use rmsnorm_fusion instead" if norm == "rmsnorm" else "set layernorm_fusion to false"))
    if getattr(neox_args, "rmsnorm_fusion", False) and norm != "rmsnorm":
        problems.append(f"rmsnorm_fusion=true fuses norm='rmsnorm', but norm={norm!r}; "
                        + ("use layernorm_fusion instead" if norm == "layernorm" else "set rmsnorm_fusion to false"))
    pos_emb = getattr(neox_args, "pos_emb", "learned") or "learned"
    if getattr(neox_args, "rope_fusion", False) and pos_emb != "rotary":
        problems.append(f"rope_fusion=true fuses rotary embeddings, but pos_emb={pos_emb!r}; "
                        "set rope_fusion to false")
    activation = getattr(neox_args, "activation", "gelu") or "gelu"
    if getattr(neox_args, "bias_gelu_fusion", False) and activation != "gelu":
        problems.append(f"bias_gelu_fusion=true fuses activation='gelu', but activation={activation!r}; "
                        "set bias_gelu_fusion to false")
    if getattr(neox_args, "use_flashattn_swiglu", False) and activation != "swiglu":
        problems.append(f"use_flashattn_swiglu=true replaces activation='swiglu', but activation={activation!r}; "
                        "set use_flashattn_swiglu to false")
    config = list(getattr(neox_args, "attention_config", None) or [])
    softmax_flags = [flag for flag in SOFTMAX_FUSION_FLAGS if getattr(neox_args, flag, False)]
    if softmax_flags and config and all(kind == "flash" for kind in config):
        flags = " / ".join(softmax_flags)
        problems.append(f"{flags}=true fuses the attention softmax, but every layer uses 'flash' attention "
                        "(which computes its own softmax); set it to false or use 'global' layers")
    return problems


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


def not_supported_problems(args: "NeoXArgs") -> List[str]:
    problems = []
    for key, switched_on, message in NOT_SUPPORTED_YET:
        value = getattr(args, key)
        if value is not None and switched_on(value):
            problems.append(f"{key}={value!r}: {message}")
    return problems


def not_supported_setting_problems(args: "NeoXArgs") -> List[str]:
    import dataclasses

    defaults = {f.name: f.default for f in dataclasses.fields(args)}
    problems = []
    for feature, names in NOT_SUPPORTED_SETTINGS:
        for name in names:
            value = getattr(args, name)
            if value != defaults[name]:
                problems.append(f"{name}={value!r} is a setting of {feature}, which is not supported yet; remove it "
                                f"(or set it to its default {defaults[name]!r})")
    return problems


def model_problems(args: "NeoXArgs") -> List[str]:
    problems = [f"'{name}' is required (the model shape); set it in a config file"
                for name in REQUIRED_MODEL_FIELDS if getattr(args, name) is None]
    if problems:
        return problems
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
        if getattr(args, name) < 1:
            problems.append(f"{name}={getattr(args, name)} must be >= 1")
    if problems:
        return problems
    heads, kv = args.num_attention_heads, args.num_kv_heads
    mp = args.model_parallel_size
    if args.hidden_size % heads:
        problems.append(f"hidden_size={args.hidden_size} must be divisible by num_attention_heads={heads}")
    if heads % mp:
        problems.append(f"num_attention_heads={heads} must be divisible by model_parallel_size={mp}")
    if kv is not None:
        if kv < 1 or kv > heads or heads % kv:
            problems.append(f"num_kv_heads={kv} must divide num_attention_heads={heads} (1 <= num_kv_heads <= heads)")
        elif kv % mp:
            problems.append(f"num_kv_heads={kv} must be divisible by model_parallel_size={mp}")
    if args.max_position_embeddings < args.seq_length:
        problems.append(f"max_position_embeddings={args.max_position_embeddings} must be >= "
                        f"seq_length={args.seq_length}")
    if args.pos_emb == "rotary" and not 0 < args.rotary_pct <= 1:
        problems.append(f"rotary_pct={args.rotary_pct} must be in (0, 1]")
    if args.num_unique_layers is not None:
        if args.pipe_parallel_size >= 1:
            problems.append(f"num_unique_layers={args.num_unique_layers} only works with pipe_parallel_size=0 "
                            f"(got {args.pipe_parallel_size})")
        elif args.num_unique_layers < 1 or args.num_layers % args.num_unique_layers:
            problems.append(f"num_layers={args.num_layers} must be divisible by "
                            f"num_unique_layers={args.num_unique_layers}")
    if args.param_sharing_style not in SPLIT_OPTIONS:
        problems.append(f"param_sharing_style={args.param_sharing_style!r} must be one of {SPLIT_OPTIONS}")
    if isinstance(args.attention_config, list) and all(isinstance(t, str) for t in args.attention_config):
        if len(args.attention_config) != args.num_layers:
            problems.append(f"attention_config expands to {len(args.attention_config)} layers but num_layers="
                            f"{args.num_layers}; the counts in attention_config must add up to num_layers")
        for kind in sorted(set(args.attention_config)):
            if kind not in ATTENTION_TYPES:
                problems.append(f"attention_config: unknown attention type {kind!r}; choose from "
                                f"{', '.join(ATTENTION_TYPES)}")
            elif kind not in BUILT_ATTENTION_TYPES:
                problems.append(f"attention_config: attention type {kind!r} is not supported yet; built types are "
                                f"{', '.join(BUILT_ATTENTION_TYPES)}")
    if args.sliding_window_width is not None and args.sliding_window_width < 1:
        problems.append(f"sliding_window_width={args.sliding_window_width} must be >= 1")
    if args.gpt_j_tied and not args.gpt_j_residual:
        problems.append("gpt_j_tied=true needs gpt_j_residual=true")
    if args.intermediate_size is not None and args.intermediate_size < 1:
        problems.append(f"intermediate_size={args.intermediate_size} must be >= 1")
    if args.mlp_multiple_of < 1:
        problems.append(f"mlp_multiple_of={args.mlp_multiple_of} must be >= 1")
    if args.soft_prompt_tuning is not None:
        allowed = {"enabled", "n_tokens", "init_string", "init_range"}
        extra = set(args.soft_prompt_tuning) - allowed
        if extra:
            problems.append(f"soft_prompt_tuning has unknown keys {sorted(extra)}; allowed: {sorted(allowed)}")
    problems += fusion_flag_problems(args)
    if args.sequence_parallel and mp == 1:
        problems.append("sequence_parallel=true needs model_parallel_size > 1")
    return problems


def training_problems(args: "NeoXArgs") -> List[str]:
    problems = []
    if args.train_iters is not None and args.train_epochs is not None:
        problems.append(f"train_iters={args.train_iters} and train_epochs={args.train_epochs} are both set; "
                        f"set one")
    for name in ("train_iters", "train_epochs"):
        value = getattr(args, name)
        if value is not None and value < 1:
            problems.append(f"{name}={value} must be >= 1")
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
    problems += _data_path_problems(args)
    if args.optimizer_type not in ("adam", "onebitadam", "cpu_adam", "cpu_torch_adam", "sm3", "madgrad_wd",
                                   "sgd", "lion"):
        problems.append(f"optimizer.type={args.optimizer_type!r} must be one of Adam, OneBitAdam, CPU_Adam, "
                        f"CPU_torch_Adam, SM3, madgrad_wd, SGD, Lion")
    return problems


def _split_problems(split: str) -> List[str]:
    try:
        parts = [float(p) for p in split.replace("/", ",").split(",") if p.strip()]
    except ValueError:
        return [f"split={split!r} must be comma-separated numbers such as '969, 30, 1'"]
    if not 1 <= len(parts) <= 3 or any(p < 0 for p in parts) or sum(parts) <= 0:
        return [f"split={split!r} must be 1 to 3 non-negative numbers with a positive sum"]
    return []


def _data_path_problems(args: "NeoXArgs") -> List[str]:
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


def parallelism_problems(args: "NeoXArgs") -> List[str]:
    problems = []
    if args.pipe_parallel_size < 0 or args.model_parallel_size < 1:
        problems.append(f"pipe_parallel_size={args.pipe_parallel_size} must be >= 0 and model_parallel_size="
                        f"{args.model_parallel_size} >= 1")
    if not isinstance(args.zero_stage, int):
        problems.append(f"zero_stage={args.zero_stage!r}: lists and 'all' are for DeepSpeed autotuning, which is "
                        f"not supported yet; use 0, 1, 2 or 3")
    elif args.zero_stage not in (0, 1, 2, 3):
        problems.append(f"zero_optimization.stage={args.zero_stage} must be 0, 1, 2 or 3")
    elif args.zero_stage >= 2 and args.pipe_parallel_size >= 1:
        problems.append(f"zero_optimization.stage={args.zero_stage} cannot be combined with pipeline parallelism "
                        f"(pipe_parallel_size={args.pipe_parallel_size}): DeepSpeed's pipeline engine supports ZeRO "
                        f"0 and 1 only; use stage 1 or pipe_parallel_size 0")
    method = args.pipe_partition_method
    if method not in ("parameters", "uniform") and not method.startswith("type:"):
        problems.append(f"pipe_partition_method={method!r} must be 'parameters', 'uniform' or 'type:REGEX'")
    if args.pipe_parallel_size >= 1:
        for flag in ("log_grad_norm", "log_grad_pct_zeros", "log_optimizer_states"):
            if getattr(args, flag):
                problems.append(f"{flag}=true is not supported with pipe_parallel_size >= 1 yet (DeepSpeed's "
                                f"pipeline engine frees the gradients inside train_batch)")
    if (args.comment or args.account) and args.launcher != "slurm":
        problems.append(f"comment / account are slurm options; launcher is {args.launcher!r}")
    return problems
