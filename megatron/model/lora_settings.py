"""The `lora` config section: LoRA adapters (Hu et al., as Hugging Face peft computes them) on this model's
tensor-parallel linear layers, and the rules of its keys. The adapters themselves are megatron.model.lora's (this
module does not import torch, as megatron.model.config does not).

    lora: {r: 8, alpha: 16, dropout: 0.05, target_modules: [query_key_value, dense], layers_to_transform: [0, 1]}

Each targeted layer computes W x + (alpha / r) B A dropout(x) with W (and its bias) frozen, A [r, in] started
kaiming-uniform and B [out, r] at zero (peft's initialisation: the untrained adapter is the base model exactly).
The targets are named as this model's layers are: query_key_value and dense (attention), linear1 and linear2 (the
MLP; GPT-NeoX's older names dense_h_to_4h and dense_4h_to_h are accepted for them; with a gated activation linear1 is
the fused [up | gate] projection)."""

import difflib
from typing import Any, Dict, List, Mapping, Optional, Tuple

TARGET_MODULES: Dict[str, str] = {"query_key_value": "attention.query_key_value", "dense": "attention.dense",
                                  "linear1": "mlp.linear1", "linear2": "mlp.linear2"}
"""A target's name -> its module's path inside a transformer layer."""
TARGET_ALIASES = {"dense_h_to_4h": "linear1", "dense_4h_to_h": "linear2"}
"""GPT-NeoX's older MLP names."""
DEFAULTS: Dict[str, Any] = {"r": 8, "alpha": 8, "dropout": 0.0, "target_modules": ["query_key_value"],
                            "layers_to_transform": None}
"""peft's LoraConfig defaults (r 8, lora_alpha 8, lora_dropout 0, and for GPT-NeoX models query_key_value)."""
PEFT_NAMES = {"lora_alpha": "alpha", "lora_dropout": "dropout", "rank": "r"}
"""peft's names of the keys, accepted for them."""
QUANTIZED_KEYS = ("load_in_4bit", "load_in_8bit", "bnb_4bit_quant_type", "bnb_4bit_compute_dtype",
                  "bnb_4bit_use_double_quant", "bnb_4bit_quant_storage", "quantization", "quantize_base", "qlora",
                  "bits")
"""Keys that ask for a quantized (QLoRA) base: refused, the base trains in the run's precision."""
NOT_IMPLEMENTED = {"use_dora": "DoRA", "use_rslora": "rank-stabilised scaling", "modules_to_save": "fully trained "
                   "extra modules", "bias": "trained biases", "rank_pattern": "per-layer ranks",
                   "alpha_pattern": "per-layer alphas", "init_lora_weights": "other initialisations"}


def normalized_lora(value: Optional[Mapping[str, Any]]) -> Optional[Dict[str, Any]]:
    """The section with peft's key names read as ours, target aliases as this model's names and the defaults
    filled in; None when LoRA is off (None or {})."""
    if not value or not isinstance(value, Mapping):
        return value or None
    out = {PEFT_NAMES.get(key, key): item for key, item in value.items()}
    targets = out.get("target_modules", DEFAULTS["target_modules"])
    if isinstance(targets, str):
        targets = [targets]
    if isinstance(targets, (list, tuple)):
        out["target_modules"] = sorted({TARGET_ALIASES.get(t, t) for t in targets}, key=str)
    layers = out.get("layers_to_transform")
    if isinstance(layers, int) and not isinstance(layers, bool):
        out["layers_to_transform"] = [layers]
    return {**DEFAULTS, **out}


def lora_problems(value: Any, num_layers: int, attention_types: Tuple[str, ...] = (), moe_layers: Tuple[int, ...] = ()
                  ) -> List[str]:
    """What is wrong with a (normalized) lora section for this model, each problem naming lora's key."""
    if value is None:
        return []
    if not isinstance(value, Mapping):
        return [f"lora={value!r} must be a dict such as {{r: 8, alpha: 16, target_modules: [query_key_value]}}"]
    problems = []
    for key in value:
        if key in DEFAULTS:
            continue
        if key in QUANTIZED_KEYS or "4bit" in str(key) or "8bit" in str(key):
            problems.append(f"lora.{key}: QLoRA (a quantized base model, bitsandbytes) is not implemented; the base "
                            f"weights are frozen in the run's precision. Remove lora.{key}")
        elif key in NOT_IMPLEMENTED:
            problems.append(f"lora.{key}: {NOT_IMPLEMENTED[key]} are not implemented; remove lora.{key}")
        else:
            guesses = difflib.get_close_matches(str(key), list(DEFAULTS) + list(PEFT_NAMES), n=2, cutoff=0.5)
            hint = f"; did you mean {' or '.join(guesses)}?" if guesses else f"; lora takes {', '.join(DEFAULTS)}"
            problems.append(f"lora.{key} is not a LoRA setting{hint}")
    rank = value.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        problems.append(f"lora.r={rank!r} must be an integer >= 1 (the adapters' rank)")
    alpha = value.get("alpha")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
        problems.append(f"lora.alpha={alpha!r} must be a number > 0 (the adapters are scaled by alpha / r)")
    dropout = value.get("dropout")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        problems.append(f"lora.dropout={dropout!r} must be a number in [0, 1)")
    targets = value.get("target_modules")
    if not isinstance(targets, (list, tuple)) or not targets:
        problems.append(f"lora.target_modules={targets!r} must be a list of {', '.join(TARGET_MODULES)}")
        targets = []
    for target in targets:
        if target not in TARGET_MODULES:
            guesses = difflib.get_close_matches(str(target), list(TARGET_MODULES) + list(TARGET_ALIASES), n=2,
                                                cutoff=0.5)
            hint = f"did you mean {' or '.join(guesses)}? " if guesses else ""
            problems.append(f"lora.target_modules: {target!r} is not a layer of this model; {hint}the targets are "
                            f"{', '.join(TARGET_MODULES)} (or GPT-NeoX's dense_h_to_4h / dense_4h_to_h)")
    layers = value.get("layers_to_transform")
    if layers is not None:
        if not isinstance(layers, (list, tuple)) or not layers or any(
                isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_layers for i in layers):
            problems.append(f"lora.layers_to_transform={layers!r} must be null (every layer) or a list of layer "
                            f"numbers from 0 to num_layers - 1 = {num_layers - 1}")
            layers = None
    chosen = range(num_layers) if layers is None else layers
    others = sorted({attention_types[i] for i in chosen if i < len(attention_types)
                     and attention_types[i] in ("mamba", "rwkv", "gmlp", "amlp")})
    if others:
        problems.append(f"lora: {', '.join(others)} layers have no query_key_value / dense / linear1 / linear2 "
                        f"(attention_config); choose transformer layers with lora.layers_to_transform")
    moe = sorted(set(moe_layers) & set(chosen))
    if moe and {"linear1", "linear2"} & set(targets):
        problems.append(f"lora.target_modules: the MLP of layers {moe} is a mixture of experts, whose experts LoRA "
                        f"does not adapt; target query_key_value / dense only, or leave those layers out with "
                        f"lora.layers_to_transform")
    return problems
