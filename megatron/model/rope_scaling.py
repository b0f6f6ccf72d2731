"""RoPE scaling as Hugging Face names it in config.json (`rope_scaling` / transformers 5's `rope_parameters`):
the kinds this model computes and the rules of their parameters. The frequencies themselves are
megatron.model.positional's (this module does not import torch, as megatron.model.config does not).

    rope_scaling: {rope_type: llama3, factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0,
                   original_max_position_embeddings: 8192}

`type` is accepted for `rope_type` (older config.json files); `rope_type: default` is no scaling. The base and
the rotated share of each head stay GPT-NeoX's own keys (rotary_emb_base, rotary_pct), so `rope_theta` and
`partial_rotary_factor` are refused here with the key to use. GPT-NeoX itself has no RoPE-scaling argument."""

import difflib
from typing import Any, Dict, List, Mapping, Optional, Tuple

ROPE_SCALING_TYPES = ("linear", "dynamic", "yarn", "llama3")
REQUIRED: Dict[str, Tuple[str, ...]] = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
OPTIONAL: Dict[str, Tuple[str, ...]] = {
    "yarn": ("original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "truncate"),
}
OWN_KEYS = {"rope_theta": "rotary_emb_base", "partial_rotary_factor": "rotary_pct"}
"""Hugging Face's keys for what GPT-NeoX's own arguments say."""
UNSUPPORTED_TYPES = {"longrope": "per-frequency short / long factors", "proportional": "proportional rotation",
                     "mrope": "multimodal sections"}


def normalized_rope_scaling(value: Optional[Mapping[str, Any]]) -> Optional[Dict[str, Any]]:
    """The dict with `type` read as `rope_type`, or None for no scaling (None, {}, rope_type 'default')."""
    if not value:
        return None
    out = dict(value)
    if "type" in out and "rope_type" not in out:
        out["rope_type"] = out.pop("type")
    elif "type" in out and out["type"] == out["rope_type"]:
        del out["type"]
    return None if out.get("rope_type") == "default" and set(out) == {"rope_type"} else out


def rope_scaling_problems(value: Any, pos_emb: str, rotary_dim: int = 0) -> List[str]:
    """What is wrong with a rope_scaling value (already normalized), each problem naming rope_scaling's key;
    ``rotary_dim``: the rotated channels per head, when known."""
    if value is None:
        return []
    if not isinstance(value, Mapping):
        return [f"rope_scaling={value!r} must be a dict such as {{rope_type: linear, factor: 2.0}}"]
    kind = value.get("rope_type")
    if kind not in ROPE_SCALING_TYPES:
        why = f" ({UNSUPPORTED_TYPES[kind]} are not implemented)" if kind in UNSUPPORTED_TYPES else ""
        return [f"rope_scaling.rope_type={kind!r}{why}: choose one of {', '.join(ROPE_SCALING_TYPES)}"]
    problems = []
    if pos_emb != "rotary":
        problems.append(f"rope_scaling scales rotary embeddings, but pos_emb={pos_emb!r}; set pos_emb: rotary")
    allowed = ("rope_type",) + REQUIRED[kind] + OPTIONAL.get(kind, ())
    for key in value:
        if key in allowed:
            continue
        if key in OWN_KEYS:
            problems.append(f"rope_scaling.{key}: set {OWN_KEYS[key]} instead (GPT-NeoX's argument for it)")
            continue
        guesses = difflib.get_close_matches(str(key), allowed, n=2, cutoff=0.6)
        hint = f"; did you mean {' or '.join(guesses)}?" if guesses else f"; {kind} takes {', '.join(allowed[1:])}"
        problems.append(f"rope_scaling.{key} is not a parameter of rope_type {kind!r}{hint}")
    problems += [f"rope_scaling.{key} is required with rope_type {kind!r}" for key in REQUIRED[kind]
                 if key not in value]
    for key in ("factor", "low_freq_factor", "high_freq_factor", "attention_factor", "beta_fast", "beta_slow",
                "mscale", "mscale_all_dim"):
        number = value.get(key)
        if key in value and (isinstance(number, bool) or not isinstance(number, (int, float)) or number <= 0):
            problems.append(f"rope_scaling.{key}={number!r} must be a number > 0")
    original = value.get("original_max_position_embeddings")
    if original is not None and (isinstance(original, bool) or not isinstance(original, int) or original <= 0):
        problems.append(f"rope_scaling.original_max_position_embeddings={original!r} must be an integer > 0")
    if "truncate" in value and not isinstance(value["truncate"], bool):
        problems.append(f"rope_scaling.truncate={value['truncate']!r} must be true or false")
    if kind == "dynamic" and rotary_dim == 2:  # its base exponent is rotary_dim / (rotary_dim - 2)
        problems.append("rope_scaling.rope_type 'dynamic' needs more than 2 rotated channels per head (head size x "
                        "rotary_pct)")
    if kind == "llama3" and not problems and value["high_freq_factor"] <= value["low_freq_factor"]:
        problems.append(f"rope_scaling.high_freq_factor={value['high_freq_factor']} must be greater than "
                        f"low_freq_factor={value['low_freq_factor']}")
    return problems
