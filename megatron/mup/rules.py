"""What muP (use_mup and its keys) accepts, as messages naming the key and the fix. No torch here: the model's
rules run inside ModelConfig.problems, the run's rules inside NeoXArgs validation."""
from __future__ import annotations

from typing import Any, List

from megatron.mup.shapes import BaseShapesError, base_hidden_size, read_base_shapes

MODEL_KEYS = ("mup_init_scale", "mup_attn_temp", "mup_output_temp", "mup_embedding_mult", "mup_rp_embedding_mult")
"""The muP settings the model reads (ModelConfig fields), each 1.0 by default."""
RUN_KEYS = ("coord_check", "save_base_shapes", "base_shapes_file", "mup_width_scale")
"""The muP settings of the run (megatron.training.mup_run), defaults False, False, None, 2."""
RUN_DEFAULTS = {"coord_check": False, "save_base_shapes": False, "base_shapes_file": None, "mup_width_scale": 2}
MUP_OPTIMIZERS = ("adam", "cpu_adam", "cpu_torch_adam", "sgd")
"""Optimizers with a muP learning-rate rule: the Adams (mup's MuAdam) and SGD (MuSGD)."""
UNSUPPORTED_LAYERS = ("gmlp", "amlp", "mamba", "rwkv")


def mup_model_problems(config: Any) -> List[str]:
    """The model's side: muP is built for attention + MLP layers with a vocabulary head."""
    if not config.use_mup:
        return [f"{key}={getattr(config, key)!r} is a muP setting and only takes effect with use_mup: true; set "
                f"use_mup: true or remove it" for key in MODEL_KEYS if getattr(config, key) != 1.0]
    problems = [f"use_mup with {kind} layers is not supported yet (muP is built for attention and MLP layers); "
                f"use attention layer types" for kind in sorted(set(config.attention_types) & set(UNSUPPORTED_LAYERS))]
    if config.moe_num_experts > 1:
        problems.append("use_mup with a mixture of experts (moe_num_experts > 1) is not supported yet")
    if config.value_head:
        problems.append("use_mup with train_impl 'rm' (a reward model's value head) is not supported yet")
    for key in ("mup_attn_temp", "mup_output_temp", "mup_init_scale"):
        if not getattr(config, key) > 0:
            problems.append(f"{key}={getattr(config, key)!r} must be > 0")
    if config.mup_rp_embedding_mult != 1.0 and config.pos_emb not in ("learned", "sinusoidal"):
        problems.append(f"mup_rp_embedding_mult={config.mup_rp_embedding_mult!r} multiplies learned or sinusoidal "
                        f"position embeddings (as GPT-NeoX's), and pos_emb={config.pos_emb!r} has none; remove it")
    return problems


def mup_run_problems(args: Any) -> List[str]:
    """The run's side: base shapes, the coordinate check, the optimizer."""
    if not args.use_mup:
        return [f"{key}={getattr(args, key)!r} is a muP setting and only takes effect with use_mup: true; set "
                f"use_mup: true or remove it" for key in RUN_KEYS if getattr(args, key) != RUN_DEFAULTS[key]]
    problems = []
    path = args.base_shapes_file
    if not path:
        problems.append("use_mup needs base_shapes_file: the file save_base_shapes: true writes from the base-width "
                        "config, which runs at other widths read")
    elif not args.save_base_shapes:
        try:
            base_hidden_size(read_base_shapes(path), path)
        except BaseShapesError as exc:
            problems.append(str(exc))
    if not args.save_base_shapes and args.mup_width_scale != RUN_DEFAULTS["mup_width_scale"]:
        problems.append(f"mup_width_scale={args.mup_width_scale!r} only applies with save_base_shapes: true (the width "
                        f"of the delta model the base shapes are written from); remove it")
    if args.save_base_shapes and not (isinstance(args.mup_width_scale, int) and args.mup_width_scale >= 2):
        problems.append(f"mup_width_scale={args.mup_width_scale!r} must be an integer >= 2 (the delta model that tells "
                        f"the width dimensions apart is hidden_size x mup_width_scale wide)")
    kind = str((args.optimizer or {}).get("type", "")).lower()
    if args.optimizer and kind not in MUP_OPTIMIZERS:
        problems.append(f"use_mup with optimizer.type={args.optimizer.get('type')!r} is not supported: muP's "
                        f"learning-rate rules are built for Adam, CPU_Adam, CPU_torch_Adam (mup's MuAdam) and SGD "
                        f"(MuSGD)")
    if args.scheduler:
        problems.append("use_mup with a DeepSpeed scheduler dict is not supported: DeepSpeed's schedulers set one "
                        "learning rate for every parameter group, undoing muP's per-group rates; use the built-in "
                        "schedule (lr_decay_style, warmup)")
    return problems
