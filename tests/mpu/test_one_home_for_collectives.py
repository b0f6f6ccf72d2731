"""No collective is called outside megatron/mpu/ (the one home for values that cross ranks,
megatron.mpu.host_collectives): a collective elsewhere would pick its own device, and an NCCL group refuses a host
tensor ("No backend type associated with device type cpu"). An AST scan, no processes.

A call counts as a collective when its name is one (all_reduce, broadcast, all_gather*, reduce_scatter*,
all_to_all*, gather*, scatter*, reduce, barrier, send / recv, isend / irecv, batch_isend_irecv, *_object*) and it is
called on a communication module: ``torch.distributed`` or ``deepspeed.comm`` under any import name, a variable of
the usual names (dist, comm, ...) or one assigned from ``collectives()``, or ``collectives()`` itself. Importing a
collective's name from those modules counts too, and so does ``getattr(<module>, "<collective>")``. ``torch.gather``
or ``tensor.scatter_`` are tensor operations, not collectives, and are left alone."""
import ast
import re
from pathlib import Path
from typing import List, Set

REPO = Path(__file__).resolve().parents[2]
HOME = "megatron/mpu/"
SCANNED = ("megatron", "train.py", "generate.py", "eval.py", "tools")

COLLECTIVE = re.compile(r"^(all_reduce|all_gather|reduce_scatter|all_to_all|broadcast|gather|scatter|reduce|barrier"
                        r"|monitored_barrier|send|recv|isend|irecv|batch_isend_irecv|inference_all_reduce"
                        r"|allgather_fn|reduce_scatter_fn)(_.*)?$|_object")
COMM_MODULES = ("torch.distributed", "deepspeed.comm")
CONVENTIONAL = {"dist", "distributed", "comm", "ds_comm", "torch_dist", "c10d"}
COLLECTIVES_FACTORY = "collectives"
PENDING: dict = {}
"""Files whose collectives are known and owned by another change: each entry must still be needed (the test says when
it no longer is), so that the list only shrinks."""


def _dotted(node: ast.AST) -> str:
    """'a.b.c' for a Name / Attribute chain, '' for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else ""
    return ""


def _is_comm_module(dotted: str) -> bool:
    return any(dotted == m or dotted.startswith(m + ".") for m in COMM_MODULES)


def stray_collectives(source: str, filename: str = "<source>") -> List[str]:
    """'file:line: what' for every collective that ``source`` calls or imports (module docstring)."""
    tree = ast.parse(source, filename)
    aliases: Set[str] = set(CONVENTIONAL)
    found: List[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _is_comm_module(alias.name) and alias.asname:
                    aliases.add(alias.asname)
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if _is_comm_module(full) and not COLLECTIVE.search(alias.name):
                    aliases.add(alias.asname or alias.name)
                elif _is_comm_module(node.module) and COLLECTIVE.search(alias.name):
                    found.append(f"{filename}:{node.lineno}: imports {full}")
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) \
                and _dotted(node.value.func).split(".")[-1] == COLLECTIVES_FACTORY:
            aliases.update(t.id for t in node.targets if isinstance(t, ast.Name))

    def is_comm(receiver: ast.AST) -> bool:
        if isinstance(receiver, ast.Call):
            return _dotted(receiver.func).split(".")[-1] == COLLECTIVES_FACTORY
        dotted = _dotted(receiver)
        return dotted in aliases or _is_comm_module(dotted) or dotted.split(".")[0] in aliases and "." in dotted \
            and dotted.split(".")[-1] in ("distributed_c10d", "comm")

    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Attribute) and COLLECTIVE.search(func.attr) and is_comm(func.value):
            found.append(f"{filename}:{node.lineno}: {_dotted(func) or func.attr}(...)")
        elif isinstance(func, ast.Name) and func.id == "getattr" and len(node.args) >= 2 \
                and is_comm(node.args[0]) and isinstance(node.args[1], ast.Constant) \
                and isinstance(node.args[1].value, str) and COLLECTIVE.search(node.args[1].value):
            found.append(f"{filename}:{node.lineno}: getattr(..., {node.args[1].value!r})")
    return found


def scanned_files() -> List[Path]:
    files: List[Path] = []
    for entry in SCANNED:
        path = REPO / entry
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path] if path.exists() else []
    return [f for f in files if not f.relative_to(REPO).as_posix().startswith(HOME)]


def test_the_scan_finds_a_stray_collective():
    stray = ("import torch\nimport torch.distributed as dist\nfrom deepspeed import comm as c2\n"
             "from megatron.mpu.deepspeed_comm import collectives\n"
             "def f(x, group):\n"
             "    dist.all_reduce(x)\n"
             "    torch.distributed.barrier()\n"
             "    c2.broadcast_object_list([x], src=0)\n"
             "    collectives().all_gather_into_tensor(x, x)\n"
             "    comm = collectives()\n"
             "    comm.reduce_scatter_tensor(x, x, group=group)\n"
             "    getattr(comm, 'all_gather_single')(x, x)\n")
    found = stray_collectives(stray, "stray.py")
    assert [line.split(":")[1] for line in found] == ["6", "7", "8", "9", "11", "12"], found
    assert stray_collectives("from torch.distributed import all_gather_object\n") \
        == ["<source>:1: imports torch.distributed.all_gather_object"]
    # tensor operations with collective-like names, and the home's own functions, are not collectives
    fine = ("import torch\nimport torch.distributed as dist\nfrom megatron.mpu.host_collectives import all_reduce\n"
            "def f(x, i):\n    torch.gather(x, 0, i); x.scatter_(0, i, x); all_reduce([1.0])\n"
            "    dist.get_rank(); dist.get_world_size(); dist.is_initialized(); dist.ReduceOp.MAX\n")
    assert stray_collectives(fine) == []


def test_no_collective_outside_megatron_mpu():
    files = scanned_files()
    assert any(f.name == "training.py" for f in files) and not any(HOME in f.as_posix() for f in files)
    found = [hit for f in files for hit in stray_collectives(f.read_text(encoding="utf-8"),
                                                              f.relative_to(REPO).as_posix())]
    resolved = [name for name in PENDING if not any(hit.startswith(name + ":") for hit in found)]
    assert not resolved, f"no collective left in {resolved}: remove them from PENDING"
    found = [hit for hit in found if hit.split(":")[0] not in PENDING]
    assert not found, ("collectives outside megatron/mpu/ (use megatron.mpu.host_collectives, which puts the "
                       "tensor on the group's device):\n  " + "\n  ".join(found))
