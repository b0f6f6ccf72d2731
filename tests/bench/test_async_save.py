"""The async-save benchmark's two configs are accepted and differ only in async_save, and its reading of the
metrics takes each save's pause and the steps after it (the table itself is produced by hand: two training
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


def test_measure_reads_the_pause_and_each_step_after_a_save():
    records = [{"iteration": i, "iteration_time_s": 1.0} for i in range(1, 10)]
    for iteration, pause in ((5, 200.0), (9, 400.0)):  # right after the saves at 4 and 8
        records[iteration - 1]["iteration_time_s"] = 1.5
        records[iteration - 1]["time_ms/save"] = pause
    records[5]["iteration_time_s"] = 1.2  # iteration 6: the second step after the save at 4
    records[2]["iteration_time_s"] = 0.9  # iteration 3: before the first save
    result = measure(records, every=4, steps=9)
    # pytest >= 9.2's approx refuses nested containers: the lists are compared on their own
    assert set(result) == {"pause", "pauses", "after", "before", "steady", "per_iteration"}
    assert result["pauses"] == pytest.approx([0.2, 0.4]) and result["after"] == pytest.approx([1.5, 1.2, 1.0])
    assert {key: result[key] for key in ("pause", "before", "steady", "per_iteration")} == pytest.approx(
        {"pause": 0.3, "before": 1.0, "steady": 1.0, "per_iteration": (4 * 1.0 + 0.9 + 2 * 1.5 + 1.2 + 0.6) / 8})
