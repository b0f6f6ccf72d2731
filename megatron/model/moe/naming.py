"""The global names of the experts' parameters under expert parallelism (moe_expert_parallel_size EP > 1).

Both expert-parallel layers (DeepSpeed's, deepspeed_layer.py; the dropless one, expert_parallel.py) keep a rank's
E / EP experts as DeepSpeed's ``deepspeed_moe.experts.deepspeed_experts.{l}``, l the local index: expert l of
expert-parallel rank r is global expert r x E / EP + l. With tensor parallelism too (model_parallel_size T > 1), the
dropless layer's tensor-parallel rank t holds the block t x E / T .. (t+1) x E / T - 1, shared out over its
expert-parallel group, so its local expert l is global expert t x E / T + r x E / (EP x T) + l: the layer says where
its experts start (``first_expert``); DeepSpeed's layer holds the same experts on every tensor-parallel rank
(replicated). Per-parameter logs (log_grad_norm & co.) name an expert's
parameter by its global expert, so the ranks' experts are told apart and carry the names they have at EP=1 (where
local is global), as DeepSpeed's per-expert checkpoint files name them."""
from __future__ import annotations

import re
from typing import Dict

from torch import nn

EXPERTS = "deepspeed_moe.experts.deepspeed_experts."
"""The part of a parameter name that marks one of DeepSpeed's MoE experts (followed by the local index)."""

_LOCAL = re.compile(re.escape(EXPERTS) + r"(\d+)\.")


def is_expert_name(name: str) -> bool:
    """Whether ``name`` is a parameter of one of DeepSpeed's MoE experts (held by one expert-parallel rank)."""
    return EXPERTS in name


def global_expert_name(name: str, first_expert: int) -> str:
    """``name`` with its local expert index l replaced by the global one, first_expert + l."""
    return _LOCAL.sub(lambda m: f"{EXPERTS}{first_expert + int(m.group(1))}.", name)


def global_expert_names(model: nn.Module, parallel_state) -> Dict[str, str]:
    """{parameter name: its name with the global expert index} of the experts of ``model``'s expert-parallel
    layers (none without expert parallelism: local is global there)."""
    out = {}
    for prefix, module in model.named_modules():
        if getattr(module, "ep_size", 1) <= 1 or not hasattr(module, "deepspeed_moe"):
            continue
        first = getattr(module, "first_expert", None)
        if first is None:  # DeepSpeed's layer: the expert-parallel rank's share of all experts
            first = parallel_state.get_expert_parallel_rank() * module.num_local_experts
        for name, _ in module.named_parameters(prefix=prefix):
            if is_expert_name(name):
                out[name] = global_expert_name(name, first)
    return out
