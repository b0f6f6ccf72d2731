"""The context-parallel memory benchmark's GPU check runs its steps at small sizes on the CPU (so that it cannot rot
before a GPU runs it) and its rows are refused by name when unknown (its CPU table is produced by hand: the 32k
launches take minutes; what it measures is tested in tests/model/test_ring_attention.py)."""
import pytest

from bench.context_parallel_memory import gpu_ring_attention, parse_args


def test_gpu_check_dry_run_prints_every_row():
    table = gpu_ring_attention(seq=64, heads=4, kv_heads=2, head_dim=8, device="cpu")
    for row in ("SDPA, whole sequence", "CP=2 (cpu_flash), rank 1", "CP=2 (scores), rank 1"):
        assert row in table
    last = table.splitlines()[-1].split("|")[-2].split(" / ")
    assert len(last) == 4 and all(float(e) < 0.1 for e in last), last


def test_unknown_rows_are_refused(capsys):
    assert parse_args(["--kernels", "fused"]).kernels == "fused"
    with pytest.raises(SystemExit):
        parse_args(["--kernels", "fused,flashy"])
    assert "--kernels: flashy unknown; choose from fused, scores" in capsys.readouterr().err
