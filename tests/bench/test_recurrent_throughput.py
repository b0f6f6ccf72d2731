"""The recurrent-layer benchmark's configs are ones the project accepts, its decoding measurement runs and sees
a state that grows with the context for attention only, and the script prints its table — for one layer type,
its deepy.py launch replaced by the records one returns (the configs of all three are checked above). Speeds
are read by hand, not asserted (2 shared cores)."""
import sys

import pytest

from bench.recurrent_throughput import LAYERS, decode, parse_args, train_config
from bench.train_throughput import write_data
from megatron.neox_arguments import NeoXArgs

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


def test_benchmark_prints_the_table(monkeypatch, capsys):
    """The script end to end for one layer type, its deepy.py launch replaced by the records one returns (the
    launch itself is bench/train_throughput.py's smoke test's, tests/bench/test_train_throughput.py)."""
    import bench.recurrent_throughput as script

    launched = []

    def fake_launch(config, directory, name, port):
        launched.append(config)
        records = [{"iteration": i, "iteration_time_s": 0.5} for i in range(1, config["train_iters"] + 1)]
        return records, {"peak_rss_mb": 123.0}

    monkeypatch.setattr(script, "train_with_deepy", fake_launch)
    monkeypatch.setattr(sys, "argv", ["recurrent_throughput.py", "--size", "tiny", "--seq", "32", "--steps", "1",
                                      "--warmup", "1", "--context", "32", "--new", "2", "--only", "mamba"])
    script.main()
    assert [c["attention_config"] for c in launched] == [script.LAYERS["mamba"]["attention_config"]]
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [row.split("|")[1].strip() for row in rows] == ["mamba"]
    assert float(rows[0].split("|")[3].replace(",", "")) == 2 * 32 / 0.5  # train tokens/s: batch x seq / step
    assert float(rows[0].split("|")[4].replace(",", "")) == 123.0
