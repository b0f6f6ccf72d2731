"""The async-save benchmark's two configs are accepted and differ only in async_save, and its reading of the
metrics takes each save's pause and the step after it (the table itself is produced by hand: two training
launches of a model with a sizeable checkpoint are too slow for the suite)."""

import pytest

from bench.async_save import MODES, measure, parse_args, train_config
from bench.train_throughput import write_data
from megatron.neox_arguments import NeoXArgs


def test_benchmark_configs_differ_only_in_async_save(tmp_path):
    args = parse_args(["--size", "tiny", "--seq", "32"])
    data = write_data(str(tmp_path), 4096)
    configs = {name: NeoXArgs.from_dict(train_config(args, flag, data, str(tmp_path))).to_dict()
               for name, flag in MODES.items()}
    sync, background = configs.values()
    assert (sync["async_save"], background["async_save"]) == (False, True)
    assert {k for k in sync if sync[k] != background[k]} == {"async_save", "save"}  # each its own directory
    assert sync["checkpoint_factor"] == args.every and sync["wall_clock_breakdown"]


def test_measure_reads_the_pause_and_the_step_during_the_write():
    records = [{"iteration": i, "iteration_time_s": 1.0} for i in range(1, 8)]
    records[3]["iteration_time_s"] = 1.5  # iteration 4: right after the save at 3
    records[3]["time_ms/save"] = 200.0
    records[6]["iteration_time_s"] = 1.5  # iteration 7: right after the save at 6
    records[6]["time_ms/save"] = 400.0
    result = measure(records, every=3, steps=7)
    assert result == pytest.approx({"pause": 0.3, "during": 1.5, "quiet": 1.0, "per_iteration": (4 * 1.0 + 2 * 1.5 + 0.6) / 6})
