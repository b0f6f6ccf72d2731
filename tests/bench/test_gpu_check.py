"""bench/gpu_check.py and what it runs cannot rot: the CPU dry run goes through every section at tiny shapes; the
pieces that only matter on a GPU machine (time limits that kill a hung section with its children, the carried
DeepSpeed wheels, fused-kernel candidates, a failed run still giving its table) are checked without one."""
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from bench import carried_wheels, gpu_check, train_throughput

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_cpu_dry_run_runs_every_section(tmp_path):
    out = subprocess.run([sys.executable, "bench/gpu_check.py", "--cpu-dry-run", "--out", str(tmp_path)], cwd=REPO,
                         capture_output=True, text=True, timeout=600)
    print(out.stdout[-3000:])
    assert out.returncode == 0, out.stdout[-5000:] + out.stderr[-3000:]
    files = {p.name: p.read_text() for p in tmp_path.iterdir()}
    assert sorted(files) == ["0_summary.txt", "1_env.txt", "2_nccl_smoke.txt", "3_pytest_gpu.txt", "4_kernels.txt",
                             "5_model_step.txt", "6_training.txt", "7_optimizer_ring.txt"]
    assert "torch " in files["1_env.txt"] and "TORCH_CUDA_ARCH_LIST" in files["1_env.txt"]
    smoke = files["2_nccl_smoke.txt"]
    assert "| (a) this project (deepy.py), 'flash' layers on PyTorch SDPA + fused kernels | " in smoke
    assert "tests/fused_kernels/test_layer_norm.py: " in files["3_pytest_gpu.txt"]
    table = files["4_kernels.txt"]
    for op in ("layer_norm", "rms_norm", "upper_triang_softmax", "masked_softmax", "rotary", "bias_gelu",
               "bias_dropout_add", "swiglu", "cross_entropy"):
        assert op in table
    rows = [line for line in table.splitlines() if " triton " in line and " pytorch " in line and "flag runs" in line]
    assert len(rows) == 13 and "FAILED" not in table, table  # every case, both implementations
    assert files["5_model_step.txt"].count("syncs/step") == 4
    assert "| (c) minimal PyTorch GPT" in files["6_training.txt"]
    extras = files["7_optimizer_ring.txt"]
    assert extras.count("asked ") == 3 and "wrapped by" in extras, extras  # FusedAdam, torch, FusedAdam
    assert "ring" in extras.lower(), extras
    assert files["0_summary.txt"].count(" ok ") == 8


def test_a_hung_step_is_killed_with_its_children_and_the_next_still_runs(tmp_path):
    pid_file = tmp_path / "pid"
    hang = gpu_check.Step("hang", lambda s: ["bash", "-c", f"sleep 60 & echo $! > {pid_file}; wait"], 1.0)
    after = gpu_check.Step("after", lambda s: ["echo", f"given {s:.1f} s"], 1.0)
    sections = [gpu_check.Section(1, "1_a.txt", "a", [hang]), gpu_check.Section(2, "2_b.txt", "b", [after])]
    lock = tmp_path / "extensions" / "fused_adam" / "lock"  # as a JIT build killed midway leaves it
    lock.parent.mkdir(parents=True)
    lock.write_text("")
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions")}
    results = gpu_check.run_sections(sections, 2.0, env, str(tmp_path), gpu_check.time.monotonic(), [],
                                     min_step_s=0.2)
    assert results[0][2] == "TIMED OUT after 1 s (killed; removed 1 JIT build lock(s))" and not lock.exists()
    assert results[1][2] == "ok" and "given" in (tmp_path / "2_b.txt").read_text()
    child = int(pid_file.read_text())  # the hung step's own child, killed with it (read before it was killed)
    for _ in range(50):
        state = Path(f"/proc/{child}/stat")
        if not state.exists() or state.read_text().rsplit(")", 1)[1].split()[0] == "Z":
            break
        gpu_check.time.sleep(0.1)
    else:
        pytest.fail(f"the hung step's child {child} is still running")
    assert "TIMED OUT" in (tmp_path / "0_summary.txt").read_text()


def test_gpu_test_paths_find_the_gpu_marked_files():
    paths = gpu_check.gpu_test_paths()
    assert "tests/fused_kernels" in paths and "tests/optim/test_optimizers.py" in paths
    assert not any(p.startswith("tests/fused_kernels/") for p in paths)  # the folder covers its files


def _wheel(folder: Path, name: str, members) -> Path:
    path = folder / name
    with zipfile.ZipFile(path, "w") as wheel:
        for member in members:
            wheel.writestr(member, "")
    return path


def test_carried_wheels_install_deepspeed_and_only_the_missing_dependencies(tmp_path):
    _wheel(tmp_path, "deepspeed-0.19.8-py3-none-any.whl", ["deepspeed/__init__.py", "deepspeed-0.19.8.data/x",
                                                          "deepspeed-0.19.8.dist-info/RECORD"])
    _wheel(tmp_path, "hjson-3.1.0-py3-none-any.whl", ["hjson/__init__.py", "hjson-3.1.0.dist-info/RECORD"])
    _wheel(tmp_path, "typing_extensions-4.16.0-py3-none-any.whl", ["typing_extensions.py"])
    assert carried_wheels.wheel_modules(str(tmp_path / "deepspeed-0.19.8-py3-none-any.whl")) == ["deepspeed"]
    chosen = carried_wheels.wheels_to_install(str(tmp_path), importable=lambda module: module != "hjson")
    assert [os.path.basename(p) for p in chosen] == ["deepspeed-0.19.8-py3-none-any.whl",
                                                     "hjson-3.1.0-py3-none-any.whl"]


def test_kernel_table_times_both_implementations_and_says_what_the_flag_runs():
    # its own process, as gpu_check runs it: Triton's interpreter must be on before anything imports triton
    run = subprocess.run([sys.executable, "bench/kernel_table.py", "--tiny"], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    table = run.stdout
    assert run.returncode == 0, table + run.stderr[-3000:]
    from megatron.fused_kernels import kernel_candidates

    for candidate in kernel_candidates():  # each op's row names what its flag runs on CUDA
        rows = [line for line in table.splitlines() if line.startswith(candidate.op.replace("_masked", ""))]
        assert rows and all(f"flag runs {candidate.on_cuda}" in line for line in rows), (candidate.op, table)
    assert "compiled kernels" in table

def test_a_failed_contender_still_gives_the_table_and_names_the_reason(monkeypatch, capsys):
    def ours(*args):
        raise RuntimeError("bench: deepy.py failed:\n[rank0]:   File x\n"
                           "[rank0]: RuntimeError: No backend type associated with device type cpu\n[rank0]: exit")

    monkeypatch.setattr(train_throughput, "write_data", lambda directory, tokens: {})
    monkeypatch.setattr(train_throughput, "ours", ours)
    monkeypatch.setattr(train_throughput, "competitor", lambda args, kind, timeout: {"step_time": 0.5,
                                                                                    "peak_rss_mb": 10.0})
    code = train_throughput.main(["--size", "tiny", "--seq", "8", "--batch", "1", "--repeats", "1",
                                  "--only", "ours,torch"])
    out = capsys.readouterr().out
    assert code == 1
    assert "| (a) this project (deepy.py) - FAILED | - |" in out
    assert "| (c) minimal PyTorch GPT (SDPA, fused AdamW) | 16 | 500 |" in out
    assert "failed: (a) this project (deepy.py): RuntimeError: No backend type associated with device type cpu" \
        in out


def _fake_python(tmp_path: Path, script: str) -> dict:
    (tmp_path / "python").write_text(f"#!/usr/bin/env bash\n{script}\n")
    (tmp_path / "python").chmod(0o755)
    return {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}


def test_gpu_train_sh_goes_on_after_a_failed_size_and_names_it(tmp_path):
    env = _fake_python(tmp_path, 'echo "table for $*"; [[ "$*" == *"--size 1B"* ]]')  # 125M fails, 1B passes
    out = subprocess.run(["bash", "bench/gpu_train.sh", "--steps", "1"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 1
    assert out.stdout.count("table for bench/train_throughput.py") == 2  # the 1B run after the failed 125M
    assert len(re.findall(r"--steps 1\b", out.stdout)) == 4  # the arguments reach every run
    assert out.stdout.strip().endswith("gpu_train.sh: failed: 125M (exit 1)")


def test_gpu_train_sh_refuses_an_unknown_size(tmp_path):
    out = subprocess.run(["bash", "bench/gpu_train.sh"], cwd=REPO, env={**_fake_python(tmp_path, "exit 0"),
                                                                        "GPU_TRAIN_SIZES": "7B"},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "unknown size '7B' (known: " in out.stderr


def test_the_sections_nominal_budgets_fit_the_whole_budget():
    """A step's limit is what is left less the later steps' nominal shares: shares adding up to more than the
    budget would skip the first sections before anything ran."""
    for dry, budget in ((False, gpu_check.GPU_BUDGET_S), (True, gpu_check.DRY_BUDGET_S)):
        total = sum(step.budget_s for section in gpu_check.plan(dry) for step in section.steps)
        assert total <= budget, (dry, total, budget)
    numbers = [section.number for section in gpu_check.plan(False)]
    assert numbers == sorted(numbers) and len(numbers) + 1 <= 8  # with 0_summary.txt: what a GPU machine returns
