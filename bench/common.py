"""Shared pieces of the benchmarks: child-process measurement, medians and the results table.

Every contender runs in its own process, started through `measure_command`, so that its peak memory
(the largest resident set of the process tree, from getrusage) is measured the same way for all."""

import json
import os
import statistics
import subprocess
import sys
from typing import Callable, Dict, List, Optional, Sequence, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def measure_command(cmd: Sequence[str], env: Optional[Dict[str, str]] = None, timeout: float = 3600) -> Dict:
    """Run `cmd` in a fresh wrapper process; returns {'returncode', 'stdout', 'stderr', 'peak_rss_mb'}. Past
    `timeout` seconds the wrapper and everything it started are killed and TimeoutError is raised."""
    wrapper = ("import json, resource, subprocess, sys\n"
               "cmd = json.loads(sys.argv[1])\n"
               "p = subprocess.run(cmd, capture_output=True, text=True)\n"
               "peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024\n"
               "print(json.dumps({'returncode': p.returncode, 'stdout': p.stdout, 'stderr': p.stderr,"
               " 'peak_rss_mb': peak}))\n")
    full_env = {**os.environ, "PYTHONPATH": pythonpath_with_repo(), **(env or {})}
    process = subprocess.Popen([sys.executable, "-c", wrapper, json.dumps(list(cmd))], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=full_env, cwd=REPO)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(process.pid)
        process.communicate()
        raise TimeoutError(f"timed out after {timeout:.0f} s: {' '.join(cmd)[:200]}") from None
    if process.returncode != 0:
        raise RuntimeError(f"measurement wrapper failed: {stderr}")
    return json.loads(stdout)


def pythonpath_with_repo() -> str:
    """The repository first, then whatever PYTHONPATH already holds (e.g. DeepSpeed installed from carried wheels
    by bench/gpu_check.py)."""
    return os.pathsep.join([REPO] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != REPO])


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and every process below it (a timed-out run must not keep the GPU busy). The tree is read
    from /proc before anything is killed, so that orphans are not missed (where there is no /proc: `pid` only)."""
    import signal

    for process in [pid] + descendants(pid):
        try:
            os.kill(process, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def descendants(pid: int) -> List[int]:
    """The processes below `pid` (children, theirs, ...), from the parent ids in /proc/<pid>/stat."""
    children: Dict[int, List[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                parent = int(handle.read().rsplit(")", 1)[1].split()[1])  # after "pid (comm) state"
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


def train_with_deepy(config: Dict, directory: str, name: str, port: int,
                     timeout: float = 3600) -> Tuple[List[Dict], Dict]:
    """Write `config` as <directory>/<name>.yml and train it through `deepy.py train.py` (measured by
    measure_command, killed after `timeout` seconds); returns (the run's 'train' records of metrics.jsonl,
    measure_command's result). The metrics file is removed, so that the next run in `directory` starts a fresh
    one."""
    import yaml

    path = os.path.join(directory, f"{name}.yml")
    with open(path, "w") as handle:
        yaml.safe_dump(config, handle)
    result = measure_command([sys.executable, "deepy.py", "train.py", path, "--master_port", str(port)],
                             timeout=timeout)
    if result["returncode"] != 0:
        raise RuntimeError(f"{name}: deepy.py failed:\n{result['stdout'][-3000:]}\n{result['stderr'][-3000:]}")
    metrics = os.path.join(config["log_dir"], "metrics.jsonl")
    with open(metrics) as handle:
        records = [json.loads(line) for line in handle if '"train"' in line]
    os.remove(metrics)
    return records, result


def plain_train_config(shape: Dict, seq: int, batch: int, iters: int, data: Dict[str, str], directory: str) -> Dict:
    """A deepy.py config that trains a ``shape`` (num_layers, hidden_size, ...) GPT with LayerNorm and GeLU for
    ``iters`` steps of ``batch`` x ``seq`` random tokens on one rank, logging every step, without evaluation."""
    return {
        **shape, "seq_length": seq, "max_position_embeddings": seq,
        "norm": "layernorm", "activation": "gelu", "no_weight_tying": True, "make_vocab_size_divisible_by": 128,
        "tokenizer_type": "HFTokenizer", "vocab_file": data["vocab_file"], "data_path": data["data_path"],
        "split": "100,0,0", "train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1,
        "train_iters": iters, "optimizer": {"type": "Adam", "params": {"lr": 1.0e-4}},
        "zero_optimization": {"stage": 0}, "gradient_clipping": 1.0, "num_gpus": 1, "num_workers": 0,
        "log_interval": 1, "steps_per_print": 1000000, "eval_interval": 1000000, "eval_iters": 0,
        "log_dir": os.path.join(directory, "logs"), "distributed_backend": "nccl", "seed": 1,
        "hidden_dropout": 0.0, "attention_dropout": 0.0, "do_test": False, "weight_decay": 0.0,
    }


def step_time_and_peak(records: List[Dict], result: Dict, warmup: int) -> Dict:
    """{'step_time': median seconds of the steps after `warmup`, 'peak_mb': peak GPU memory on a GPU, else the
    process tree's peak resident memory} of one train_with_deepy run."""
    out = {"step_time": median([r["iteration_time_s"] for r in records if r["iteration"] > warmup]),
           "peak_mb": result["peak_rss_mb"]}
    if "gpu_max_allocated_gb" in records[-1]:
        out["peak_mb"] = records[-1]["gpu_max_allocated_gb"] * 1024
    return out


def gpu_or_tiny(description: str, tiny_help: str, argv=None) -> bool:
    """The --tiny flag of a GPU check (bench/gpu_check.py's sections): True to run at real sizes on the GPU, False
    for the CPU dry run at tiny shapes (also without CUDA), which then sets TRITON_INTERPRET=1 for the Triton
    kernels (before anything imports triton)."""
    import argparse

    import torch

    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help=tiny_help)
    tiny = parser.parse_args(argv).tiny  # parsed first: --help and bad flags are answered on every machine
    on_gpu = torch.cuda.is_available() and not tiny
    if not on_gpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return on_gpu


def last_json_line(text: str) -> Dict:
    """Workers print their result as the last JSON line of stdout."""
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise ValueError(f"no JSON result in output:\n{text[-3000:]}")


def median(values: List[float]) -> float:
    return statistics.median(values)


def median_of_turning_runs(names: Sequence[str], repeats: int, measure: Callable[[str], Dict[str, float]],
                           describe: Callable[[Dict[str, float]], str]) -> Dict[str, Dict[str, float]]:
    """Run `measure(name)` `repeats` times for every name, the order turning every repeat (no contender always goes
    first), printing `describe(result)` after each; returns {name: {key: median over the repeats}}."""
    runs: Dict[str, List[Dict[str, float]]] = {name: [] for name in names}
    for repeat in range(repeats):
        turn = repeat % len(names)
        for name in list(names[turn:]) + list(names[:turn]):
            result = measure(name)
            runs[name].append(result)
            print(f"run {repeat + 1}/{repeats} {name}: {describe(result)}", flush=True)
    return {name: {key: median([r[key] for r in rs]) for key in rs[0]} for name, rs in runs.items()}


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub-markdown table (pasted into the README as is); returns the text it printed."""
    lines = [f"### {title}", "", "| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def machine_description() -> str:
    """Where and when a table was measured, for its title: date, commit, the device (on a CPU: its model, cores,
    and the fp32 / bf16 rates of a 1024 x 1024 matmul, measured now), torch and Python, and the load average when
    the table was printed (other jobs on a shared machine slow the absolute figures, not the ratios)."""
    import platform
    import time

    import torch

    if torch.cuda.is_available():
        device = torch.cuda.get_device_name(0)
    else:
        from megatron.utils.bf16_speed import cpu_bf16_flags, cpu_matmul_rates

        fp32, bf16 = cpu_matmul_rates()
        flags = ", ".join(cpu_bf16_flags()) or "no bf16 flags"
        device = (f"{cpu_model()} ({os.cpu_count()} cores, {flags}; 1024x1024 matmul {fp32:.0f} GFLOP/s fp32, "
                  f"{bf16:.0f} bf16)")
    load = f", load average {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""
    return (f"{time.strftime('%Y-%m-%d')}, commit {git_commit()}, {device}, torch {torch.__version__}, "
            f"Python {platform.python_version()}{load}")


def cpu_model() -> str:
    """The CPU's model name (Linux /proc/cpuinfo), else the platform's processor string."""
    import platform

    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit() -> str:
    """The checkout's commit (short), with '+changes' when the work tree differs from it; 'unknown' outside git."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("+changes" if dirty else "")
