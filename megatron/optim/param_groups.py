"""The optimizer's parameter groups: which parameters decay, the MoE experts' group, decoupled_lr's groups of the
input-embedding and output-layer weights, and the weight decay the optimizer starts from. Both the optimizer
(megatron.optim.optimizers) and the LR schedule (megatron.optim.learning_rates, which sets each group's lr and weight
decay every step) read these, so they live below both."""

from typing import Any, Dict, List, Tuple

from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
from torch import nn

from megatron.model.parameter_marks import EMBEDDING_OR_OUTPUT_FLAG, MOE_EXPERT_FLAG, NO_DECAY_FLAG

DECOUPLED_GROUP = "decoupled_lr"
"""Parameter-group flag (set by get_param_groups): the group holds input-embedding or output-layer weights and
follows decoupled_lr / decoupled_min_lr (megatron.optim.learning_rates)."""

def _excluded_from_decay(module: nn.Module, name: str, param: nn.Parameter) -> bool:
    return ("Norm" in type(module).__name__ or name == "bias" or name.endswith("_bias")
            or bool(getattr(param, NO_DECAY_FLAG, False)))


MOE_GROUP_NAME = "moe_experts"


def get_param_groups(model: nn.Module, weight_decay: float, moe_param_group: bool = False,
                     decoupled_lr: bool = False) -> List[Dict[str, Any]]:
    """[{params to decay, weight_decay}, {params not to decay, weight_decay: 0}], empty groups dropped.

    Not decayed: every parameter of a module whose class name contains "Norm" (LayerNorm, RMSNorm, ...),
    biases, and parameters flagged `_no_weight_decay`. Parameters that do not require grad are left out;
    a parameter shared by several modules (tied embeddings) appears once.
    With ``moe_param_group`` (create_moe_param_group) the experts' weights (flagged ``_moe_expert``) form a third
    group of their own, named ``moe_experts``, decayed with ``weight_decay`` (they are weight matrices; they never
    share a group with the norms and biases).
    With ``decoupled_lr`` the parameters flagged ``_embedding_or_output`` form decay / no-decay groups of their own,
    after the others, marked ``decoupled_lr: True`` (megatron.learning_rates gives them decoupled_lr)."""
    buckets: Dict[Tuple[str, bool], List[nn.Parameter]] = {}
    seen = set()
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if id(param) in seen or not param.requires_grad:
                continue
            seen.add(id(param))
            if moe_param_group and getattr(param, MOE_EXPERT_FLAG, False):
                kind = "experts"
            elif weight_decay != 0.0 and not _excluded_from_decay(module, name, param):
                kind = "decay"
            else:
                kind = "no_decay"
            own = decoupled_lr and bool(getattr(param, EMBEDDING_OR_OUTPUT_FLAG, False))
            buckets.setdefault((kind, own), []).append(param)
    settings = {"decay": {"weight_decay": float(weight_decay)}, "no_decay": {"weight_decay": 0.0},
                "experts": {"weight_decay": float(weight_decay), "name": MOE_GROUP_NAME}}
    groups = []
    for own in (False, True):
        for kind in ("decay", "no_decay", "experts"):
            if buckets.get((kind, own)):
                groups.append({"params": buckets[(kind, own)], **settings[kind],
                               **({DECOUPLED_GROUP: True} if own else {})})
    return groups


def deepspeed_moe_param_groups(model: nn.Module, weight_decay: float,
                               decoupled_lr: bool = False) -> List[Dict[str, Any]]:
    """create_moe_param_group with DeepSpeed's MoE layer (moe_type deepspeed) or expert parallelism:
    ``get_param_groups``' decay and no-decay groups, each with its experts moved to a group of their own marked ``moe`` (DeepSpeed's
    split_params_into_different_moe_groups_for_optimizer, which its engine and ZeRO expect: expert gradients
    are reduced over the expert-data-parallel group)."""
    groups = get_param_groups(model, weight_decay, decoupled_lr=decoupled_lr)
    plain = [group for group in groups if not group.get(DECOUPLED_GROUP)]
    for group in groups:
        name = ("decay" if group["weight_decay"] else "no_decay") if len(plain) == 2 else "params"
        group["name"] = name + ("_decoupled" if group.get(DECOUPLED_GROUP) else "")
    return [group for group in split_params_into_different_moe_groups_for_optimizer(groups) if group["params"]]
