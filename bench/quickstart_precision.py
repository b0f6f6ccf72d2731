#!/usr/bin/env python
"""The quickstart (configs/quickstart.yml, 300 steps on the stdlib corpus) in fp32 and in bf16, side by side:
what ``precision: auto`` chooses on this machine, the loss each reaches (the last logged training loss and the
last evaluation) and how fast each trains (median step time after the first 10 steps, and the whole run).

    python tools/datasets/prepare_data.py                  # once: data/stdlib/
    python bench/quickstart_precision.py --repeats 2

Both runs train the same config from the same seed, each in its own process through deepy.py, the order turning
every repeat; checkpoints and logs go to a temporary directory. bf16 is DeepSpeed's bf16 path (fp32 master
weights in its optimizer)."""

import argparse
import os
import sys
import tempfile
import time
from typing import Dict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import REPO, machine_description, median, median_of_turning_runs, print_table  # noqa: E402
from bench.common import train_with_deepy  # noqa: E402

PRECISIONS = {"fp32": "fp32", "bf16": "bfloat16"}
SKIPPED_STEPS = 10


def quickstart_config(precision: str, directory: str, iters: int) -> Dict:
    """configs/quickstart.yml with ``precision`` and its checkpoints and logs under ``directory``."""
    import yaml

    with open(os.path.join(REPO, "configs", "quickstart.yml"), encoding="utf-8") as handle:
        config = yaml.safe_load(handle)
    run = os.path.join(directory, precision)
    config.update({"precision": PRECISIONS[precision], "save": run, "load": None, "log_dir": os.path.join(run, "logs"),
                   "train_iters": iters, "checkpoint_factor": iters,
                   "vocab_file": os.path.join(REPO, config["vocab_file"]),
                   "data_path": os.path.join(REPO, config["data_path"])})
    return config


def measure(precision: str, args, directory: str) -> Dict[str, float]:
    start = time.perf_counter()
    config = quickstart_config(precision, directory, args.iters)
    records, result = train_with_deepy(config, directory, precision, args.port)
    wall = time.perf_counter() - start
    train = [r for r in records if r.get("type", "train") == "train" and r.get("lm_loss") is not None]
    steps = [r["iteration_time_s"] for r in train if r["iteration"] > SKIPPED_STEPS]
    return {"step_time": median(steps), "wall": wall, "loss": train[-1]["lm_loss"],
            "peak_rss_mb": result["peak_rss_mb"]}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--port", type=int, default=29761)
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if not os.path.exists(os.path.join(REPO, "data", "stdlib", "tokenizer.json")):
        sys.exit("data/stdlib/ is missing: run python tools/datasets/prepare_data.py first")
    from megatron.utils.bf16_speed import auto_precision

    choice = auto_precision()
    with tempfile.TemporaryDirectory() as directory:
        summary = median_of_turning_runs(
            list(PRECISIONS), args.repeats, lambda name: measure(name, args, directory),
            lambda r: f"step {r['step_time'] * 1000:.0f} ms, run {r['wall']:.0f} s, last loss {r['loss']:.4f}")
    fp32 = summary["fp32"]
    rows = [[name, f"{s['loss']:.4f}", f"{s['step_time'] * 1000:.1f}", f"{s['wall']:.0f}",
             f"{s['peak_rss_mb']:,.0f}", f"{fp32['step_time'] / s['step_time']:.2f}"] for name, s in summary.items()]
    print_table(f"Quickstart, {args.iters} steps, fp32 and bf16 on {machine_description()}; {choice.reason}",
                ["precision", "last training loss", "step ms (median after step 10)", "run s (launch included)",
                 "peak RSS MB", "step speed vs fp32"], rows)


if __name__ == "__main__":
    main()
