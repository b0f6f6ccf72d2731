"""The preprocessing benchmark runs end to end and prints its table for 1 and 2 workers (its figures are
read by hand: wall-clock assertions are unreliable on 2 shared cores)."""
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_benchmark_prints_rows_for_one_and_two_workers():
    out = subprocess.run([sys.executable, "bench/preprocess_throughput.py", "--size-mb", "0.3", "--repeats", "1"],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in out.stdout.splitlines() if line.startswith("| ") and
            line.split("|")[1].strip().isdigit()]
    assert [int(row[0]) for row in rows] == [1, 2]
    for row in rows:
        tool, bare = (float(cell.replace(",", "")) for cell in row[1:3])
        assert tool > 0 and bare > 0
