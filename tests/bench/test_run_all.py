"""bench/run_all.py: every script it runs exists and takes its flags (parsed by the script's own argument parser, or
declared in it),
the default set is estimated at 20 minutes or less, and the tables are picked out of a benchmark's output as
bench.common.print_table prints them. bench/quickstart_precision.py's two configs are the quickstart's but for the
precision (the timings themselves are read by hand: 2 shared cores make wall-clock assertions unreliable)."""
import importlib
import os

import pytest

from bench.common import print_table
from bench.run_all import DEFAULT_SET, EXTRA_SET, REPO, main, tables


@pytest.mark.parametrize("entry", DEFAULT_SET + EXTRA_SET, ids=lambda b: b.name)
def test_each_command_parses(entry):
    script = entry.argv[0]
    assert os.path.isfile(os.path.join(REPO, script))
    module = importlib.import_module(script[:-3].replace("/", "."))
    if hasattr(module, "parse_args"):
        module.parse_args(list(entry.argv[1:]))
    else:  # the parser is built inside main: each flag is one it declares
        with open(os.path.join(REPO, script), encoding="utf-8") as handle:
            source = handle.read()
        for flag in (a for a in entry.argv[1:] if a.startswith("--")):
            assert f'"{flag}"' in source, f"{script} declares no {flag}"


def test_the_default_set_fits_20_minutes_and_names_are_unique():
    assert sum(b.minutes for b in DEFAULT_SET) <= 20
    names = [b.name for b in DEFAULT_SET + EXTRA_SET]
    assert len(names) == len(set(names))
    assert main(["--list"]) == 0


def test_tables_are_picked_out_of_the_output(capsys):
    print("run 1/2 dense: step 1.0s")
    first = print_table("first", ["a", "b"], [["1", "2"]])
    print("a note after the table")
    second = print_table("second", ["c"], [["3"], ["4"]])
    assert tables(capsys.readouterr().out) == [first, second]


def test_quickstart_precision_configs_differ_only_in_precision(tmp_path):
    from bench.quickstart_precision import quickstart_config
    from megatron.neox_arguments import NeoXArgs

    fp32, bf16 = (quickstart_config(p, str(tmp_path), 300) for p in ("fp32", "bf16"))
    different = {k for k in fp32 if fp32[k] != bf16[k]}
    assert different == {"precision", "save", "log_dir"}
    assert NeoXArgs.from_dict(bf16).precision == "bfloat16" and NeoXArgs.from_dict(fp32).precision == "fp32"
