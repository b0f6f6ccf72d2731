"""The run's base weight decay, read from the config without torch (the config's validation asks for it before any
process starts; the optimizer and the weight-decay schedule use it too)."""
from typing import Any


def base_weight_decay(neox_args: Any) -> float:
    """The optimizer's weight decay: optimizer.params.weight_decay, else weight_decay."""
    params = (neox_args.optimizer or {}).get("params") or {}
    return float(params.get("weight_decay", neox_args.weight_decay))
