#!/usr/bin/env python
"""The GPU check: one command, at most ~9 minutes on one H100 / H200, that runs the GPU-only paths in priority
order, each section in its own process with its own time limit (a hang in one cannot eat the others), each
written to its own file as it goes (at most 7 files) and echoed here:

    1_env.txt          GPU, driver, torch / CUDA / NCCL / Triton against the pins, DeepSpeed (carried or not),
                       flash-attn and the other optional packages, TORCH_CUDA_ARCH_LIST   (bench/gpu_env.py)
    2_nccl_smoke.txt   a one-GPU training run through deepy.py with distributed_backend nccl, bf16, --fused:
                       real NCCL, a few steps                        (bench/train_throughput.py --only ours)
    3_pytest_gpu.txt   the `gpu`-marked tests with DS_ACCELERATOR=cuda (pytest -m gpu, xdist -n 4 if present)
    4_kernels.txt      each fused op at real sizes: error vs fp32, time vs PyTorch       (bench/kernel_table.py)
    5_model_step.txt   a 12x768 bf16 model step: ms, peak GiB, MFU, host syncs by file:line (bench/model_step.py)
    6_training.txt     the 125M and 1B training comparison of bench/gpu_train.sh (ours vs a plain PyTorch GPT,
                       and transformers where it imports), one repeat (--train-sizes picks the sizes)
    7_optimizer_ring.txt  DeepSpeed's FusedAdam against torch's fused AdamW through the training engine
                       (bench/optimizer_step.py), and ring attention at 32k tokens: peak memory and time per
                       simulated rank against SDPA on the whole sequence (bench/context_parallel_memory.py --gpu)
    0_summary.txt      each section: ok / FAILED / TIMED OUT, seconds, file

    python bench/gpu_check.py                          # on the GPU machine; files under $OUT (else a new folder)
    python bench/gpu_check.py --only 4,5               # some sections again
    python bench/gpu_check.py --prepare-wheels         # on a CPU machine with pip: DeepSpeed's wheels into .whl/
    python bench/gpu_check.py --cpu-dry-run            # the same steps at tiny shapes on CPU (tests run this)

A GPU machine whose torch / Triton differ from the pins runs with its own (1_env.txt says which ran); where
DeepSpeed does not import, the check installs it from the carried wheels (--wheels, default .whl/) into a
temporary folder on its processes' PYTHONPATH. The dry run uses gloo (the project picks it without CUDA), Triton
under TRITON_INTERPRET=1, no sync counting, and only collects the gpu-marked tests. Sections' time limits roll
forward: a section may use what the ones before it left unused, never what the ones after it are given; one that
runs out is killed with every process it started (and the lock a killed JIT build leaves in TORCH_EXTENSIONS_DIR
is removed, so that the next build does not wait on it). The exit code is 0 only when every section passed."""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, TextIO, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import carried_wheels  # noqa: E402
from bench.common import REPO, kill_tree  # noqa: E402
from bench.gpu_env import CARRIED_ENV  # noqa: E402

GPU_BUDGET_S = 530  # of the 9 minutes; the rest is start-up and the carried-wheel install
DRY_BUDGET_S = 400  # a limit for a slow CI machine, not a target (the dry run takes well under a minute)
MIN_STEP_S = 5
NOISE = re.compile(r"warnings\.warn\(|warner\(PytestBenchmarkWarning|PytestBenchmarkWarning: Benchmarks are "
                   r"automatically disabled|\[launch\.py:\d+:main\] 0 (NV_|NCCL_)")


@dataclass
class Step:
    """One process of a section: `command(seconds it may take)`, its nominal share of the budget, extra env."""
    title: str
    command: Callable[[float], List[str]]
    budget_s: float
    env: Dict[str, str] = field(default_factory=dict)


@dataclass
class Section:
    number: int
    file: str
    title: str
    steps: List[Step]


def gpu_test_paths() -> List[str]:
    """Test files (and folders whose conftest.py marks tests) with the `gpu` marker: new GPU tests join by
    themselves."""
    found = set()
    for folder, _, files in os.walk(os.path.join(REPO, "tests")):
        for name in files:
            if name.endswith(".py") and (name.startswith("test_") or name == "conftest.py"):
                with open(os.path.join(folder, name), encoding="utf-8") as handle:
                    if "mark.gpu" in handle.read():
                        found.add(os.path.relpath(folder if name == "conftest.py" else
                                                  os.path.join(folder, name), REPO))
    return sorted(p for p in found if not any(p.startswith(other + os.sep) for other in found))


def plan(dry: bool, train_sizes: Tuple[str, ...] = ("125M", "1B")) -> List[Section]:
    """The sections in priority order, with GPU sizes or (dry) tiny ones; their nominal budgets add up to
    GPU_BUDGET_S on a GPU. Measured on an H200 (2026-11-28): env 8 s, smoke 65 s (FusedAdam's first JIT build
    included), gpu tests 93 s, kernels 20 s, model step 15 s, 125M training 61 s, optimizers 22 s, ring 10 s."""
    py = sys.executable
    xdist = not dry and _module_exists("xdist")
    smoke = (["--seq", "8", "--batch", "1", "--steps", "1", "--warmup", "0", "--precision", "fp32"] if dry else
             ["--seq", "256", "--batch", "2", "--steps", "2", "--warmup", "1", "--precision", "bf16"])
    pytest = [py, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider"] + \
        (["--collect-only", "-q"] if dry else ["-rfEs", "--tb=short"] + (["-n", "4"] if xdist else []))
    tiny = ["--tiny"] if dry else []
    train = (["--size", "tiny", "--seq", "8", "--batch", "1", "--precision", "fp32", "--steps", "1", "--warmup",
              "0", "--repeats", "1", "--only", "torch"] if dry else ["--repeats", "1", "--steps", "6", "--warmup", "2"])

    def budgeted(args: List[str], margin: float) -> Callable[[float], List[str]]:
        return lambda seconds: args + ["--time-budget", f"{max(seconds - margin, 1):.0f}"]

    def training(size: str, budget: float) -> Step:
        return Step(f"bench/gpu_train.sh {size}", budgeted(["bash", "bench/gpu_train.sh"] + train, 10), budget,
                    {"GPU_TRAIN_SIZES": size, "PYTHON": py})

    train_budget = {"125M": 70, "1B": 120}  # measured 61 s for 125M on an H200; 1B needs more
    return [
        Section(1, "1_env.txt", "environment", [Step("bench/gpu_env.py", lambda s: [py, "bench/gpu_env.py"],
                                                     20)]),
        Section(2, "2_nccl_smoke.txt", "one-GPU training smoke run (distributed_backend nccl, --fused)", [
            Step("bench/train_throughput.py --only ours", budgeted(
                [py, "bench/train_throughput.py", "--size", "tiny", "--repeats", "1", "--only", "ours", "--fused",
                 *smoke], 10), 60 if dry else 80)]),
        Section(3, "3_pytest_gpu.txt", "gpu-marked tests" + (" (collected only)" if dry else ""), [
            Step("pytest -m gpu", lambda s: pytest + gpu_test_paths(), 30 if dry else 100,
                 {"DS_ACCELERATOR": "cpu" if dry else "cuda"})]),
        Section(4, "4_kernels.txt", "fused kernels vs PyTorch", [
            Step("bench/kernel_table.py", lambda s: [py, "bench/kernel_table.py", *tiny], 30 if dry else 40)]),
        Section(5, "5_model_step.txt", "model step", [
            Step("bench/model_step.py", lambda s: [py, "bench/model_step.py", *tiny], 40 if dry else 30)]),
        Section(6, "6_training.txt", "training comparison (bench/gpu_train.sh)",
                [training("125M", 110)] if dry else [training(size, train_budget[size]) for size in train_sizes]),
        Section(7, "7_optimizer_ring.txt", "FusedAdam vs torch's fused AdamW; ring attention at 32k tokens", [
            Step("bench/optimizer_step.py", lambda s: [py, "bench/optimizer_step.py", *tiny], 30 if dry else 40),
            Step("bench/context_parallel_memory.py", lambda s: [py, "bench/context_parallel_memory.py",
                                                                "--gpu-dry-run" if dry else "--gpu"], 30)]),
    ]


def _module_exists(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def child_env(dry: bool, carried: Optional[str]) -> Dict[str, str]:
    env = dict(os.environ)
    path = [REPO] + ([carried] if carried else []) + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env.update(PYTHONPATH=os.pathsep.join(path), TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1",
               OMP_NUM_THREADS="1" if dry else env.get("OMP_NUM_THREADS", "8"),
               TORCH_EXTENSIONS_DIR=env.get("TORCH_EXTENSIONS_DIR",  # DeepSpeed's JIT ops, built once for all
                                            os.path.join(tempfile.gettempdir(), "gpu_check_torch_extensions")))
    if dry:
        env.update(TRITON_INTERPRET="1", DS_ACCELERATOR="cpu")
    if carried:
        env[CARRIED_ENV] = carried
        env["PATH"] = os.path.join(carried, "bin") + os.pathsep + env.get("PATH", "")
    return env


def ensure_deepspeed(wheels: str, say: Callable[[str], None]) -> Optional[str]:
    """None when DeepSpeed imports; else the temporary folder its carried wheels were installed into."""
    if carried_wheels.deepspeed_imports(child_env(False, None)):
        say("deepspeed imports here: the carried wheels are not needed")
        return None
    if not os.path.isdir(wheels) or not any(n.startswith("deepspeed-") for n in os.listdir(wheels)):
        say(f"deepspeed does not import and {wheels}/ holds no deepspeed wheel: on a machine with pip run "
            f"`python bench/gpu_check.py --prepare-wheels` and bring {wheels}/ along; sections needing it fail")
        return None
    target = tempfile.mkdtemp(prefix="gpu_check_site_")
    installed = carried_wheels.install_missing(wheels, target)
    ok = carried_wheels.deepspeed_imports(child_env(False, target))
    say(f"installed from {wheels}/ into {target}: {', '.join(installed)}; import deepspeed "
        f"{'works' if ok else 'STILL FAILS'}")
    return target


def _children_cpu_s() -> float:
    """User + system seconds of the finished child processes (the dry run's cost on a busy machine)."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def remove_build_locks(env: Dict[str, str]) -> str:
    """Delete the lock files a killed JIT build (DeepSpeed's FusedAdam, through torch.utils.cpp_extension) leaves
    in TORCH_EXTENSIONS_DIR: the next section's build would otherwise wait on them forever."""
    import glob

    folder = env.get("TORCH_EXTENSIONS_DIR")
    locks = glob.glob(os.path.join(folder, "**", "lock"), recursive=True) if folder else []
    for lock in locks:
        os.remove(lock)
    return f"; removed {len(locks)} JIT build lock(s)" if locks else ""


def run_step(step: Step, timeout: float, env: Dict[str, str], log: TextIO) -> Tuple[str, float]:
    """Run one step (its output to `log` and stdout, minus NOISE), killed with all it started after `timeout`
    seconds; returns (status, seconds)."""
    command = step.command(timeout)
    header = f"--- {step.title}: {' '.join(command)}  (limit {timeout:.0f} s)"
    for stream in (log, sys.stdout):
        print(header, file=stream, flush=True)
    start, cpu = time.monotonic(), _children_cpu_s()
    process = subprocess.Popen(command, cwd=REPO, env={**env, **step.env}, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True)

    def copy() -> None:
        for line in process.stdout:
            if not NOISE.search(line):
                log.write(line)
                log.flush()
                sys.stdout.write(line)
                sys.stdout.flush()

    reader = threading.Thread(target=copy, daemon=True)
    reader.start()
    try:
        code = process.wait(timeout=timeout)
        status = "ok" if code == 0 else f"FAILED (exit {code})"
    except subprocess.TimeoutExpired:
        kill_tree(process.pid)
        process.wait()
        status = f"TIMED OUT after {timeout:.0f} s (killed{remove_build_locks(env)})"
    reader.join(timeout=10)
    seconds, cpu = time.monotonic() - start, _children_cpu_s() - cpu
    for stream in (log, sys.stdout):
        print(f"--- {step.title}: {status}, {seconds:.0f} s (CPU time {cpu:.0f} s)", file=stream, flush=True)
    return status, seconds


def run_sections(sections: List[Section], budget: float, env: Dict[str, str], out: str, start: float,
                 preamble: List[str], min_step_s: float = MIN_STEP_S) -> List[Tuple[Section, Step, str, float]]:
    """Each step's limit: what is left of `budget` less the nominal budgets of the steps after it (a step left
    under `min_step_s` is skipped)."""
    steps = [(section, step) for section in sections for step in section.steps]
    results = []
    for index, (section, step) in enumerate(steps):
        path = os.path.join(out, section.file)
        first = step is section.steps[0]
        with open(path, "w" if first else "a", encoding="utf-8") as log:
            if first:
                banner = f"=== {section.number} {section.title}"
                for stream in (log, sys.stdout):
                    print("\n".join([banner] + (preamble if section.number == 1 else [])), file=stream, flush=True)
            limit = budget - (time.monotonic() - start) - sum(s.budget_s for _, s in steps[index + 1:])
            if limit < min_step_s:
                status, seconds = "SKIPPED (no time left)", 0.0
                print(f"--- {step.title}: {status}", file=log, flush=True)
            else:
                status, seconds = run_step(step, limit, env, log)
        results.append((section, step, status, seconds))
        write_summary(results, out, budget, start)
    return results


def write_summary(results, out: str, budget: float, start: float) -> str:
    lines = [f"gpu_check: {time.monotonic() - start:.0f} s of {budget:.0f}; files in {out}"]
    lines += [f"{section.number} {step.title:40s} {status:36s} {seconds:5.0f} s  {section.file}"
              for section, step, status, seconds in results]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "0_summary.txt"), "w", encoding="utf-8") as handle:
        handle.write(text)
    return text


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu-dry-run", action="store_true", help="tiny shapes on CPU: the call paths, no numbers")
    parser.add_argument("--out", default=None, help="output folder (default $OUT, else a new temporary folder)")
    parser.add_argument("--only", default=None, help="comma list of section numbers to run (e.g. 4,5)")
    parser.add_argument("--budget", type=float, default=None,
                        help=f"seconds for all sections (default {GPU_BUDGET_S}; dry run {DRY_BUDGET_S})")
    parser.add_argument("--train-sizes", default="125M,1B",
                        help="comma list of bench/gpu_train.sh sizes for section 6 (125M, 1B; default both)")
    parser.add_argument("--wheels", default=os.path.join(REPO, ".whl"),
                        help="folder of carried wheels installed where DeepSpeed does not import (default .whl/)")
    parser.add_argument("--prepare-wheels", nargs="?", const=os.path.join(REPO, ".whl"), default=None,
                        metavar="DIR", help="fill DIR (default .whl/) with DeepSpeed's wheels for the GPU machine")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.prepare_wheels is not None:
        return carried_wheels.prepare(args.prepare_wheels)
    start = time.monotonic()
    dry = args.cpu_dry_run
    if not dry and subprocess.run([sys.executable, "-c", "import sys, torch; sys.exit(not torch.cuda.is_available())"],
                                  check=False).returncode != 0:
        print("gpu_check: no CUDA device here; on a CPU machine run `python bench/gpu_check.py --cpu-dry-run`")
        return 2
    out = args.out or os.environ.get("OUT") or tempfile.mkdtemp(prefix="gpu_check_")
    os.makedirs(out, exist_ok=True)
    preamble: List[str] = []
    if dry:
        preamble.append("dry run on CPU: carried wheels not checked")
    env = child_env(dry, None if dry else ensure_deepspeed(args.wheels, preamble.append))
    print(f"gpu_check: {'CPU dry run' if dry else 'GPU'}; files in {out}", flush=True)
    sizes = tuple(size for size in args.train_sizes.split(",") if size)
    unknown = sorted(set(sizes) - {"125M", "1B"})
    if unknown:
        print(f"gpu_check: --train-sizes {','.join(unknown)}: unknown (125M, 1B)")
        return 2
    sections = plan(dry, sizes)
    if args.only:
        wanted = {int(n) for n in args.only.split(",")}
        sections = [s for s in sections if s.number in wanted]
        if 1 not in wanted:  # else 1_env.txt has it
            print("\n".join(preamble), flush=True)
    budget = args.budget or (DRY_BUDGET_S if dry else GPU_BUDGET_S)
    results = run_sections(sections, budget, env, out, start, preamble)
    print("\n=== summary\n" + write_summary(results, out, budget, start), flush=True)
    return 0 if all(status == "ok" for _, _, status, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
