"""The training benchmark's config is one the project accepts (also with --fused, the GPU settings) and the
script runs end to end, printing the side-by-side table (its speed figures are read by hand, not asserted:
2 shared cores make wall-clock assertions unreliable)."""
import subprocess
import sys
from pathlib import Path

import pytest

from bench.train_throughput import FUSED_OPTIONS, ours_config, parse_args, write_data
from megatron.neox_arguments import NeoXArgs
from tests.e2e.launch import free_port

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("fused", [False, True])
def test_benchmark_config_is_valid(tmp_path, fused):
    args = parse_args(["--size", "tiny", "--seq", "32"] + (["--fused"] if fused else []))
    data = write_data(str(tmp_path), 4096)
    neox_args = NeoXArgs.from_dict(ours_config(args, data, str(tmp_path)))
    assert neox_args.num_layers == 2 and neox_args.seq_length == 32
    assert (neox_args.attention_config == ["flash", "flash"]) == fused
    assert all(getattr(neox_args, key) == fused for key in FUSED_OPTIONS if key != "attention_config")


@pytest.mark.slow
def test_benchmark_prints_the_table_for_three_contenders():
    out = subprocess.run([sys.executable, "bench/train_throughput.py", "--size", "tiny", "--seq", "32", "--batch", "2",
                          "--steps", "1", "--warmup", "1", "--repeats", "1", "--port", str(free_port())],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| (")]
    assert [row.split("|")[1].strip()[:3] for row in rows] == ["(a)", "(b)", "(c)"]
    for row in rows:
        tokens_per_s = float(row.split("|")[2].replace(",", ""))
        assert tokens_per_s > 0
