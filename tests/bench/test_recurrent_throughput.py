"""The recurrent-layer benchmark's configs are ones the project accepts, its decoding measurement runs and sees
a state that grows with the context for attention only, and (slow) the script prints its table — for one layer
type (each type's training is a deepy.py launch, ~15 s in CI; the configs of all three are checked above). Speeds
are read by hand, not asserted (2 shared cores)."""
import subprocess
import sys
from pathlib import Path

import pytest

from bench.recurrent_throughput import LAYERS, decode, parse_args, train_config
from bench.train_throughput import write_data
from megatron.neox_arguments import NeoXArgs
from tests.e2e.launch import free_port

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("kind", list(LAYERS))
def test_benchmark_configs_are_valid(tmp_path, kind):
    args = parse_args(["--size", "tiny", "--seq", "32"])
    neox_args = NeoXArgs.from_dict(train_config(args, kind, write_data(str(tmp_path), 4096), str(tmp_path)))
    assert neox_args.attention_config == [{"attention": "global"}.get(kind, kind)] * 2


def test_decoding_state_grows_with_the_context_for_attention_only():
    small = {kind: decode(parse_args(["--size", "tiny", "--context", "8", "--new", "2"]), kind) for kind in LAYERS}
    large = {kind: decode(parse_args(["--size", "tiny", "--context", "64", "--new", "2"]), kind) for kind in LAYERS}
    assert large["attention"]["state_mb"] > 4 * small["attention"]["state_mb"]
    for kind in ("mamba", "rwkv"):
        assert large[kind]["state_mb"] == small[kind]["state_mb"] > 0
        assert large[kind]["token_time"] > 0


@pytest.mark.slow
def test_benchmark_prints_the_table():
    out = subprocess.run([sys.executable, "bench/recurrent_throughput.py", "--size", "tiny", "--seq", "32",
                          "--steps", "1", "--warmup", "1", "--context", "32", "--new", "2", "--only", "mamba",
                          "--port", str(free_port())],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [row.split("|")[1].strip() for row in rows] == ["mamba"]
    assert float(rows[0].split("|")[3].replace(",", "")) > 0  # train tokens/s
