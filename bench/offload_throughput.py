#!/usr/bin/env python
"""ZeRO-Offload: step time and peak memory of the same training with and without offloading (DeepSpeed's
zero_optimization.offload_optimizer / offload_param to CPU), all through deepy.py with optimizer CPU_Adam (the
optimizer DeepSpeed requires when it offloads the optimizer, so only the offloading differs).

    python bench/offload_throughput.py                      # small model (6 layers, hidden 512), 1 rank
    python bench/offload_throughput.py --size tiny --steps 2 --warmup 1 --repeats 1     # smoke test

Contenders: ZeRO-2, ZeRO-2 + optimizer offloaded, ZeRO-3, ZeRO-3 + optimizer and parameters offloaded. Each runs
--repeats times (the order turning every repeat); the table gives medians of the median step time and the peak
memory: on a GPU the peak allocated GPU memory (what offloading saves), on CPU the peak resident memory of the
largest process (on CPU "offloading" moves tensors from CPU memory to CPU memory, so it shows the bookkeeping's
cost, not a saving)."""

import argparse
import os
import sys
import tempfile
from typing import Dict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import (machine_description, median, median_of_turning_runs, print_table,  # noqa: E402
                          train_with_deepy)
from bench.train_throughput import SIZES, ours_config, write_data  # noqa: E402

CONTENDERS = {
    "zero2": ("(a) ZeRO-2", {"stage": 2}),
    "zero2_offload": ("(b) ZeRO-2, optimizer offloaded to CPU", {"stage": 2, "offload_optimizer": {"device": "cpu"}}),
    "zero3": ("(c) ZeRO-3", {"stage": 3}),
    "zero3_offload": ("(d) ZeRO-3, optimizer and parameters offloaded to CPU",
                      {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}),
}


def contender_config(name: str, args, data: Dict[str, str], directory: str) -> Dict:
    """The training benchmark's config with this contender's ZeRO section and CPU_Adam."""
    return {**ours_config(args, data, directory), "zero_optimization": CONTENDERS[name][1],
            "optimizer": {"type": "CPU_Adam", "params": {"lr": 1.0e-4}}}


def run(args, name: str, data: Dict[str, str], directory: str) -> Dict:
    records, result = train_with_deepy(contender_config(name, args, data, directory), directory, name, args.port)
    times = [r["iteration_time_s"] for r in records if r["iteration"] > args.warmup]
    gpu = records[-1].get("gpu_max_allocated_gb")
    return {"step_time": median(times), "peak_mb": gpu * 1024 if gpu is not None else result["peak_rss_mb"],
            "loss": records[-1]["lm_loss"]}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--fused", action="store_true")
    parser.add_argument("--port", type=int, default=29741)
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    names = list(CONTENDERS)
    with tempfile.TemporaryDirectory() as directory:
        data = write_data(directory, args.batch * args.seq * (args.warmup + args.steps + 2) * 2)
        summary = median_of_turning_runs(
            names, args.repeats, lambda name: run(args, name, data, directory),
            lambda r: f"step {r['step_time']:.3f}s, peak {r['peak_mb']:.0f} MB, last loss {r['loss']:.6f}")
    on_gpu = "cuda" in os.environ.get("DS_ACCELERATOR", "cuda") and _cuda()
    rows = []
    for name in names:
        base = summary["zero2" if name.startswith("zero2") else "zero3"]
        s = summary[name]
        rows.append([CONTENDERS[name][0], f"{s['step_time'] * 1000:.0f}", f"{s['peak_mb']:,.0f}",
                     f"{base['step_time'] / s['step_time']:.2f}", f"{s['loss']:.6f}"])
    print_table(f"ZeRO-Offload, {args.size} model, seq {args.seq}, batch {args.batch}, {args.precision}, on "
                f"{machine_description()}",
                ["contender", "step ms", "peak GPU MB" if on_gpu else "peak RSS MB", "speed vs no offload",
                 "last loss"], rows)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    main()
