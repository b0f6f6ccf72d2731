"""The one home for values that cross ranks outside the model's tensor-parallel autograd path: flags, counts,
metrics, norms, a rank's finding, python objects.

Why: a process group moves tensors only on the devices its backend serves. NCCL serves CUDA tensors only (so does a
group created with ``backend="cuda:gloo"``, which is how the tests reproduce NCCL's rule on CPU); gloo serves CPU
tensors. A flag held on the host and handed to an NCCL group raises "No backend type associated with device type
cpu" (the first GPU run died of exactly that after iteration 1). Every function here

* puts its tensor on the group's communication device (``communication_device``): the current CUDA device for a
  group that serves CUDA only, the CPU for one that serves the CPU;
* runs a tensor collective through ``megatron.mpu.deepspeed_comm.collectives()`` (deepspeed.comm once it is started, so
  that DeepSpeed's comms logger counts it beside ZeRO's; torch.distributed otherwise);
* hands the result back where the caller holds it: host values come back as CPU tensors (one device-to-host copy,
  the only host sync) or python objects; a tensor already on the group's device is reduced in place and stays
  there (no host sync).

Without a distributed world, or over a group of one rank, each function is the identity and sends nothing (a single
GPU pays no copy for the per-step stop flag).

Object collectives use torch.distributed's pickling ones, never deepspeed.comm's: DeepSpeed 0.19's comms logger
(``comms_logger.prof_all``) has no bandwidth formula for all_gather_object and ends the process with exit(0) when
it meets one, and it has no gather_object at all. Under NCCL they stage the pickles on the *current* CUDA device:
megatron.initialize sets it to the rank's local device before the world starts.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Union

import torch
import torch.distributed as dist

from megatron.mpu.deepspeed_comm import collectives

Values = Union[torch.Tensor, Sequence[float]]

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
_CPU_BACKENDS = ("gloo", "mpi", "ccl")  # backends that serve CPU tensors when named alone


def world_size(group=None) -> int:
    """Ranks in ``group`` (None: the default group); 1 without a distributed world."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def _served_device_types(group) -> List[str]:
    """The device types ``group``'s backends move, from the process group itself (``_device_types``, torch >= 2.2)
    or, failing that, from its backend's name ("nccl", "gloo", "cpu:gloo,cuda:nccl", "cuda:gloo", ...)."""
    process_group = group if group is not None else dist.group.WORLD
    types = getattr(process_group, "_device_types", None)
    if types:
        return [torch.device(t).type for t in types]
    name = str(dist.get_backend(group)).lower()
    if ":" in name:  # "device:backend" pairs
        return [pair.split(":")[0].strip() for pair in name.split(",")]
    if name in _CPU_BACKENDS:
        return ["cpu"]
    by_backend = {backend: device for device, backend in dist.Backend.default_device_backend_map.items()}
    return [by_backend.get(name, "cuda")]


def communication_device(group=None) -> torch.device:
    """The device ``group`` (None: the default group) communicates on: the CPU when its backends serve it (gloo; a
    "cpu:gloo,cuda:nccl" group too: host values need no copy), else the current device of the first device type it
    serves (the current CUDA device for NCCL or "cuda:gloo"). The CPU without a distributed world."""
    if not (dist.is_available() and dist.is_initialized()):
        return torch.device("cpu")
    types = _served_device_types(group)
    if "cpu" in types:
        return torch.device("cpu")
    kind = types[0]
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(kind)


def _on(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` itself when it is contiguous on ``device``'s type, else a contiguous copy there."""
    if tensor.device.type == device.type:
        return tensor.contiguous()
    return tensor.to(device).contiguous()


def _back(result: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return result if result.device == like.device else result.to(like.device)


def _reduce_op(op: str):
    try:
        return _REDUCE_OPS[op]
    except KeyError:
        raise ValueError(f"reduce op {op!r}: use one of {sorted(_REDUCE_OPS)}") from None


def all_reduce(values: Values, op: str = "sum", group=None, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``values`` (a tensor, or python numbers as a ``dtype`` tensor on the CPU) reduced with ``op`` ("sum", "max",
    "min") over ``group``, returned on the device ``values`` were on. Use the returned tensor: a tensor on the
    group's device is reduced in place, any other is reduced through a copy on the group's device."""
    tensor = values if isinstance(values, torch.Tensor) else torch.tensor(list(values), dtype=dtype)
    if world_size(group) == 1:
        _reduce_op(op)
        return tensor
    moved = _on(tensor, communication_device(group))
    collectives().all_reduce(moved, op=_reduce_op(op), group=group)
    return _back(moved, tensor)


def broadcast(tensor: torch.Tensor, src: int, group=None) -> torch.Tensor:
    """``tensor`` as global rank ``src`` holds it, on every rank of ``group``, on the device ``tensor`` is on (every
    rank passes a tensor of the same shape and dtype). Use the returned tensor (see all_reduce)."""
    if world_size(group) == 1:
        return tensor
    moved = _on(tensor, communication_device(group))
    collectives().broadcast(moved, src=src, group=group)
    return _back(moved, tensor)


def all_gather(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Every rank's ``tensor`` (same shape on every rank) concatenated along the first dimension in rank order, on
    the device ``tensor`` is on."""
    world = world_size(group)
    if world == 1:
        return tensor
    moved = _on(tensor, communication_device(group))
    parts = [torch.empty_like(moved) for _ in range(world)]
    collectives().all_gather(parts, moved, group=group)
    return _back(torch.cat(parts), tensor)


def barrier(group=None) -> None:
    """Wait for every rank of ``group``; on a CUDA group on the current device (torch would guess one, and warn)."""
    if world_size(group) == 1:
        return
    device = communication_device(group)
    if device.type == "cuda":
        collectives().barrier(group=group, device_ids=[device.index])
    else:
        collectives().barrier(group=group)


def broadcast_object(obj: Any, src: int, group=None) -> Any:
    """The picklable ``obj`` of global rank ``src``, on every rank of ``group`` (the others' ``obj`` is ignored)."""
    if world_size(group) == 1:
        return obj
    shared = [obj]
    dist.broadcast_object_list(shared, src=src, group=group, device=communication_device(group))
    return shared[0]


def all_gather_object(obj: Any, group=None) -> List[Any]:
    """Every rank's picklable ``obj``, in the rank order of ``group``, on every rank."""
    world = world_size(group)
    if world == 1:
        return [obj]
    gathered: List[Any] = [None] * world
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


def gather_object(obj: Any, dst: int, group=None) -> Optional[List[Any]]:
    """Every rank's picklable ``obj`` in the rank order of ``group`` on global rank ``dst``; None on the others."""
    world = world_size(group)
    if world == 1:
        return [obj]
    rank = dist.get_rank()
    gathered: Optional[List[Any]] = [None] * world if rank == dst else None
    dist.gather_object(obj, gathered, dst=dst, group=group)
    return gathered
