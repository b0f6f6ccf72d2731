"""CUDA tensors on a machine without CUDA, for checking where host-side code puts what it hands to a collective.

The setting: a distributed world whose default group was created with ``backend="cuda:gloo"``. Such a group serves
CUDA tensors only, exactly NCCL's rule: a CPU tensor handed to it raises "No backend type associated with device
type cpu" (torch checks it, not this module). Code that puts its tensors on the group's device must therefore make
CUDA tensors, which a CPU-only torch cannot hold. ``emulated_cuda_world`` makes them exist:

* ``tensor.to("cuda")``, factories with ``device="cuda"`` and every operation on such tensors give
  ``EmulatedCudaTensor``: a tensor whose device *is* ``cuda:0`` (``tensor.device``, ``tensor.is_cuda``), whose data
  lives in a CPU tensor inside it; mixing it with a CPU tensor in one operation raises as CUDA does (0-dim CPU
  tensors excepted, as on CUDA); ``.cpu()`` / ``.item()`` give the data back;
* ``torch.cuda.current_device()`` is 0;
* the collectives of ``torch.distributed`` run a call whose tensors are all emulated CUDA tensors on a gloo *shadow*
  group of the same ranks, on their data: the values really cross ranks, as NCCL would move them. A call with any
  other tensor goes to the real CUDA-only group untouched, which raises torch's own error for a CPU tensor. A
  barrier (NCCL has one) runs on the shadow group;
* torch's object collectives (pickles staged in a byte tensor on a device: the ``device`` argument where there is
  one, else torch's choice for the group, the current CUDA device for a CUDA-only group) cannot run their own code
  on emulated tensors (they index with device tensors, and name the device without an index, which a CPU-only
  torch refuses). They run on the shadow group when staged on CUDA, and on the real group (which raises) when
  staged on the CPU.

Every collective call is recorded as (name, [device type of each tensor handed to it, or of the staging device of
an object collective]) so that a test can say which ran and on what; and every host sync (a value or a copy read
back from an emulated CUDA tensor: ``.item()``, ``.cpu()``, ``bool()``, ...) by its operation's name, as
``torch.cuda.set_sync_debug_mode`` would see it."""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import warnings
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

CUDA = torch.device("cuda", 0)
COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
               "all_to_all_single", "gather", "scatter", "reduce", "send", "recv", "isend", "irecv", "barrier")
OBJECT_COLLECTIVES = ("broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
                      "send_object_list", "recv_object_list")


class EmulatedCudaTensor(torch.Tensor):
    """A tensor on ``cuda:0`` whose data is the CPU tensor ``inner`` (operations run under EmulatedCuda)."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=CUDA,
                                                   strides=inner.stride(), requires_grad=False)

    def __init__(self, inner: torch.Tensor) -> None:
        self.inner = inner

    def __repr__(self) -> str:
        return f"EmulatedCudaTensor({self.inner})"

    # torch reads a scalar back under a device guard, which a CPU-only torch has not for CUDA: through .item()
    def __float__(self) -> float:
        return float(self.item())

    def __int__(self) -> int:
        return int(self.item())

    def __bool__(self) -> bool:
        return bool(self.item())

    def __index__(self) -> int:
        return int(self.item())

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"{func} on an emulated CUDA tensor outside emulated_cuda_world")


def _unwrap(x):
    return x.inner if isinstance(x, EmulatedCudaTensor) else x


HOST_READS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default)


@dataclasses.dataclass
class Emulation:
    """What happened inside emulated_cuda_world: the collective calls and the host syncs (module docstring)."""

    calls: List[Tuple[str, List[str]]] = dataclasses.field(default_factory=list)
    host_syncs: List[str] = dataclasses.field(default_factory=list)


class EmulatedCuda(TorchDispatchMode):
    """Runs every operation on the data of emulated CUDA tensors; makes ``device="cuda"`` give one."""

    def __init__(self, record: Emulation) -> None:
        super().__init__()
        self.record = record

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        asked = kwargs.get("device")
        asked = None if asked is None else torch.device(asked).type
        if asked == "cuda":
            kwargs["device"] = torch.device("cpu")
        leaves, _ = tree_flatten((args, kwargs))
        on_cuda = [x for x in leaves if isinstance(x, EmulatedCudaTensor)]
        on_cpu = [x for x in leaves if isinstance(x, torch.Tensor) and not isinstance(x, EmulatedCudaTensor)
                  and x.dim() > 0]
        copies = func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default)
        to_host = (func is torch.ops.aten._to_copy.default and asked == "cpu") or (
            func is torch.ops.aten.copy_.default and not isinstance(args[0], EmulatedCudaTensor))
        if on_cuda and (func in HOST_READS or to_host):
            self.record.host_syncs.append(str(func))
        if on_cuda and on_cpu and not copies:
            raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                               f"cuda:0 and cpu! ({func})")
        out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
        if func is torch.ops.aten.copy_.default and isinstance(args[0], EmulatedCudaTensor):
            return args[0]
        wrap = asked == "cuda" or (asked is None and bool(on_cuda))
        if not wrap:
            return out
        return tree_map(lambda o: EmulatedCudaTensor(o) if type(o) is torch.Tensor else o, out)


# TorchDispatchMode wraps __torch_dispatch__ in torch._disable_dynamo, whose first call imports torch._dynamo (seconds
# per process); nothing here is compiled: the plain function
EmulatedCuda.__torch_dispatch__ = getattr(EmulatedCuda.__torch_dispatch__, "__wrapped__",
                                          EmulatedCuda.__torch_dispatch__)


def _shadow_call(real, shadows: Dict[Tuple[int, ...], object], args, kwargs, unwrap: bool = True):
    bound = inspect.signature(real).bind(*args, **kwargs)
    group = bound.arguments.get("group")
    ranks = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    if ranks not in shadows:
        raise AssertionError(f"emulated_cuda_world has no gloo shadow of the group of ranks {ranks}")
    bound.arguments["group"] = shadows[ranks]
    bound.arguments.pop("device_ids", None)  # gloo's barrier takes none
    if not unwrap:  # object lists are filled in place: pass the caller's own
        return real(*bound.args, **bound.kwargs)
    return real(*tree_map(_unwrap, bound.args), **tree_map(_unwrap, bound.kwargs))


@contextlib.contextmanager
def _recorded_collectives(record: "Emulation", shadows: Optional[Dict[Tuple[int, ...], object]]) -> Iterator[None]:
    """torch.distributed's collectives record their calls; with ``shadows`` they run emulated CUDA tensors there
    (module docstring), without (a real CUDA device) they only record."""
    calls = record.calls
    saved = {}
    inside_object_collective = []  # its own tensor collectives, on the shadow group, are not the caller's

    def emulated(name, real):
        def collective(*args, **kwargs):
            if inside_object_collective:
                return real(*args, **kwargs)
            tensors = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
            calls.append((name, [t.device.type for t in tensors]))
            if shadows is not None and (
                    name == "barrier" or (tensors and all(isinstance(t, EmulatedCudaTensor) for t in tensors))):
                return _shadow_call(real, shadows, args, kwargs)
            return real(*args, **kwargs)  # the CUDA-only group judges it
        return collective

    def emulated_objects(name, real):
        def object_collective(*args, **kwargs):
            bound = inspect.signature(real).bind(*args, **kwargs)
            device = bound.arguments.get("device") or c10d._get_object_coll_device(bound.arguments.get("group"))
            calls.append((name, [torch.device(device).type]))
            inside_object_collective.append(name)
            try:
                if shadows is None or torch.device(device).type != "cuda":
                    return real(*args, **kwargs)  # the CUDA-only group judges it
                bound.arguments.pop("device", None)  # the shadow group stages on the CPU
                return _shadow_call(real, shadows, bound.args, bound.kwargs, unwrap=False)
            finally:
                inside_object_collective.pop()
        return object_collective

    for names, wrap in ((COLLECTIVES, emulated), (OBJECT_COLLECTIVES, emulated_objects)):
        for name in names:
            real = getattr(c10d, name)
            saved[name] = real
            patched = wrap(name, real)
            setattr(c10d, name, patched)
            setattr(dist, name, patched)
    try:
        yield
    finally:
        for name, real in saved.items():
            setattr(c10d, name, real)
            setattr(dist, name, real)


@contextlib.contextmanager
def emulated_cuda_world(shadows: Dict[Tuple[int, ...], object]) -> Iterator[Emulation]:
    """Inside, CUDA tensors exist (module docstring); yields the record of collective calls and host syncs.
    ``shadows``: a gloo group for each tuple of global ranks whose group the code inside uses (every rank creates
    them beforehand: ``dist.new_group(ranks, backend="gloo")``)."""
    record = Emulation()
    lazy_init, current_device = torch.cuda._lazy_init, torch.cuda.current_device
    torch.cuda._lazy_init = lambda: None  # torch asks for CUDA before it dispatches .to("cuda")
    torch.cuda.current_device = lambda: 0
    try:
        with _recorded_collectives(record, shadows), EmulatedCuda(record):
            yield record
    finally:
        torch.cuda._lazy_init, torch.cuda.current_device = lazy_init, current_device


@contextlib.contextmanager
def real_cuda_world() -> Iterator[Emulation]:
    """The same record on a machine with CUDA (a real CUDA-only group moves the tensors itself): collective calls,
    and host syncs as torch.cuda.set_sync_debug_mode("warn") reports them."""
    record = Emulation()
    previous = torch.cuda.get_sync_debug_mode()

    def note(message, category, filename, lineno, file=None, line=None):
        # "called a synchronizing CUDA operation"; gloo's own staging of CUDA tensors is the transport's (NCCL has
        # none), not the caller's
        if "synchroniz" in str(message) and "torch/distributed" not in filename.replace("\\", "/"):
            record.host_syncs.append(f"{filename}:{lineno}: {message}")

    with warnings.catch_warnings(), _recorded_collectives(record, None):
        warnings.simplefilter("always")
        warnings.showwarning = note
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield record
        finally:
            torch.cuda.set_sync_debug_mode(previous)
