"""Small shared pieces of the Hugging Face mappings: refusing what a target cannot represent (judged from the
model's ModelConfig), reading tensors of a state dict, and the rotary settings of a Hugging Face config."""
from __future__ import annotations

import os
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch

from megatron.errors import ConversionError
from megatron.model.config import ModelConfig
from megatron.model.rope_scaling import normalized_rope_scaling, rope_scaling_problems
from megatron.utils.optional_deps import require


def transformers_module() -> Any:
    """transformers, or one clear error naming the requirements file (it is an optional extra)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return require("transformers", "Hugging Face checkpoint conversion (tools/ckpts)", "transformers")


def check_output_dir(output_dir: str, flag: str = "--output_dir") -> None:
    """Refuse, before any checkpoint is read, an output directory that is a file, lies under a file, or cannot be
    created or written (the conversion would otherwise fail at its end with FileExistsError / NotADirectoryError)."""
    path = os.path.abspath(output_dir)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConversionError(f"{flag} {output_dir} is an existing file, not a directory; name a new directory (or "
                              f"an existing one) to write into")
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ConversionError(f"{flag} {output_dir} cannot be created: {existing} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConversionError(f"{flag} {output_dir} cannot be written: this user may not write in {existing}")


def refuse_unrepresentable(target: str, problems: List[str]) -> None:
    """One ConversionError listing everything ``target`` cannot represent."""
    if problems:
        raise ConversionError(f"this model cannot be written as {target}:\n  " + "\n  ".join(problems))


def common_problems(config: ModelConfig) -> List[str]:
    """Options no Hugging Face target here represents."""
    problems = []
    kinds = set(config.attention_types)
    if not kinds <= {"global", "flash"}:
        problems.append(f"attention_config {sorted(kinds)}: only global/flash attention converts")
    if config.pos_emb != "rotary":
        problems.append(f"pos_emb={config.pos_emb!r}: only rotary position embeddings convert")
    if config.use_qk_layernorm:
        problems.append("use_qk_layernorm=true has no Hugging Face equivalent here")
    if config.num_unique_layers is not None:
        problems.append(f"num_unique_layers={config.num_unique_layers}: parameter-shared layers have no Hugging "
                        f"Face equivalent here")
    if config.soft_prompt_tokens is not None:
        problems.append("soft_prompt_tuning is enabled (the soft prompt has no Hugging Face equivalent)")
    if config.use_mup:
        problems.append("use_mup=true: muP's attention scale (1/head_dim), embedding and output multipliers are not "
                        "converted to Hugging Face yet")
    return problems


def moe_refusal(config: ModelConfig) -> List[str]:
    """A mixture of experts has no place in a dense Hugging Face architecture."""
    if config.moe_num_experts > 1:
        return [f"mixture of experts (moe_num_experts={config.moe_num_experts}): only --architecture mixtral "
                f"(MixtralForCausalLM) holds experts"]
    return []


def _hf_rope_dict(config: Any) -> Dict[str, Any]:
    """A Hugging Face config's RoPE settings as one dict (transformers 5's rope_parameters, 4.x's rope_scaling)."""
    params: Dict[str, Any] = dict(getattr(config, "rope_parameters", None) or {})
    scaling = getattr(config, "rope_scaling", None)
    if isinstance(scaling, Mapping) and scaling.get("rope_type", scaling.get("type", "default")) != "default":
        for key, value in scaling.items():
            params.setdefault(key, value)
    if "type" in params:
        params.setdefault("rope_type", params.pop("type"))
    return params


def rope_settings(config: Any) -> Tuple[float, float]:
    """(rope_theta, partial_rotary_factor) of a Hugging Face config (transformers 4.x and 5.x spellings)."""
    params = _hf_rope_dict(config)
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        theta = getattr(config, "rotary_emb_base", 10000.0)
    pct = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    if pct is None:
        pct = getattr(config, "rotary_pct", 1.0)
    return float(theta), float(pct)


def rope_scaling_from_hf(config: Any) -> Optional[Dict[str, Any]]:
    """Our rope_scaling (megatron.model.rope_scaling) of a Hugging Face config, or None without scaling; a
    ConversionError naming config.json's key for what this model does not compute."""
    params = {key: value for key, value in _hf_rope_dict(config).items()
              if key not in ("rope_theta", "partial_rotary_factor") and value is not None}
    scaling = normalized_rope_scaling(params)
    if scaling is None or scaling.get("rope_type", "default") == "default":
        return None
    problems = rope_scaling_problems(scaling, "rotary")
    if problems:
        raise ConversionError("config.json's rope scaling (rope_parameters / rope_scaling) does not convert:\n  "
                              + "\n  ".join(problems))
    return scaling


def rope_parameters(theta: float, pct: Optional[float] = None,
                    scaling: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
    """A Hugging Face rope_parameters dict, with our rope_scaling's type and parameters when given; ``pct`` is
    always written when given (GPTNeoXConfig's default partial_rotary_factor is 0.25, not 1)."""
    params: Dict[str, Any] = {"rope_type": "default", **(scaling or {}), "rope_theta": float(theta)}
    if pct is not None:
        params["partial_rotary_factor"] = float(pct)
    return params


def take(state: Mapping[str, torch.Tensor], name: str, source: str) -> torch.Tensor:
    """``state[name]`` or a ConversionError naming the missing tensor and where it was looked for."""
    if name not in state:
        raise ConversionError(f"{source} has no tensor {name!r}")
    return state[name]
