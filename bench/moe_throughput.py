#!/usr/bin/env python
"""Mixture-of-experts training throughput, side by side (same batch, sequence and precision; SwiGLU MLPs):

  (a) the dense model with the same active parameters per token: one SwiGLU MLP of width k x F;
  (b) the dropless MoE (moe_type megablocks): E SwiGLU experts of width F in every layer, top-k routing;
  (c) DeepSpeed's MoE layer (moe_type deepspeed) with the same experts, router and top-k, capacity factor 1
      with token dropping, no residual MLP;
  (d) transformers' MixtralForCausalLM of the same shape (random weights, fused torch.optim.AdamW; its own attention
      and RMSNorm, bench/train_competitors.py).

(a)-(c) train through deepy.py on the same data.

    python bench/moe_throughput.py                          # small: 6 layers, hidden 512, 8 experts, top-2
    python bench/moe_throughput.py --steps 4 --warmup 2 --repeats 3

(b) and (c) hold E / k times the MLP parameters of (a) but compute about as much per token (plus the router and
the sorting / dispatch). Each contender runs --repeats times in its own process, the order turning every repeat;
the table gives medians of the median step time after --warmup steps, tokens/s from it and the peak resident
memory of the process tree."""

import argparse
import json
import os
import sys
import tempfile
from typing import Dict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import (REPO, last_json_line, machine_description, measure_command, median,  # noqa: E402
                          median_of_turning_runs, print_table, train_with_deepy)
from bench.train_throughput import SIZES, model_shape, ours_config, write_data  # noqa: E402

LABELS = {"dense": "(a) dense, same active parameters", "megablocks": "(b) dropless MoE (megablocks)",
          "deepspeed": "(c) DeepSpeed MoE layer (token dropping)", "mixtral": "(d) transformers MixtralForCausalLM"}


def contender_config(name: str, args, data: Dict[str, str], directory: str) -> Dict:
    """The deepy.py config of one contender (module docstring)."""
    base = ours_config(args, data, directory)
    base.update({"pipe_parallel_size": 0, "gpt_j_residual": False, "use_bias_in_mlp": False, "activation": "swiglu"})
    if name == "dense":  # GPT-NeoX's width rule for a gated MLP: int(intermediate_size * 2 / 3) // 2
        base["intermediate_size"] = 3 * args.top_k * args.expert_width
        return base
    # the dropless experts take intermediate_size as their width, DeepSpeed's layer the dense MLP's rule
    width = args.expert_width if name == "megablocks" else 3 * args.expert_width
    base.update({"intermediate_size": width, "moe_num_experts": args.experts, "moe_top_k": args.top_k,
                 "moe_expert_interval": 1, "moe_type": name, "moe_router_type": "topk", "moe_loss_coeff": 0.01})
    if name == "deepspeed":
        base.update({"moe_token_dropping": True, "moe_train_capacity_factor": 1.0, "moe_use_residual": False})
    return base


def measure(name: str, args, data: Dict[str, str], directory: str) -> Dict:
    if name == "mixtral":
        return mixtral(args)
    records, result = train_with_deepy(contender_config(name, args, data, directory), directory, name, args.port)
    times = [r["iteration_time_s"] for r in records if r["iteration"] > args.warmup]
    dropped = [v for r in records for k, v in r.items() if k.startswith("moe_dropped/")]
    return {"step_time": median(times), "peak_rss_mb": result["peak_rss_mb"],
            "dropped": sum(dropped) / len(dropped) if dropped else 0.0}


def mixtral(args) -> Dict:
    """(d): transformers' Mixtral of the same shape in its own process."""
    shape = {**model_shape(args), "num_experts": args.experts, "top_k": args.top_k,
             "expert_width": args.expert_width}
    cmd = [sys.executable, os.path.join(REPO, "bench", "train_competitors.py"), "mixtral", "--shape", json.dumps(shape),
           "--batch", str(args.batch), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--precision", args.precision]
    result = measure_command(cmd)
    if result["returncode"] != 0:
        raise RuntimeError(f"mixtral failed:\n{result['stderr'][-3000:]}")
    return {"step_time": last_json_line(result["stdout"])["step_time"], "peak_rss_mb": result["peak_rss_mb"],
            "dropped": 0.0}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top_k", type=int, default=2)
    parser.add_argument("--expert_width", type=int, default=None,
                        help="each expert's MLP width (default 2 x hidden: the dense MLP (a) is then 4 x hidden)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--fused", action="store_true")
    parser.add_argument("--port", type=int, default=29751)
    parser.add_argument("--only", default="dense,megablocks,deepspeed,mixtral", help="comma list of contenders to run")
    args = parser.parse_args(argv)
    if args.expert_width is None:
        args.expert_width = 2 * SIZES[args.size]["hidden_size"]
    return args


def main() -> None:
    args = parse_args()
    tokens_per_step = args.batch * args.seq
    contenders = [c for c in LABELS if c in args.only.split(",")]
    with tempfile.TemporaryDirectory() as directory:
        data = write_data(directory, tokens_per_step * (args.warmup + args.steps + 2) * 2)
        summary = median_of_turning_runs(
            contenders, args.repeats, lambda name: measure(name, args, data, directory),
            lambda r: f"step {r['step_time']:.3f}s, peak {r['peak_rss_mb']:.0f} MB")
    rows = []
    for name, s in summary.items():  # ratios to the dense model (a) and to transformers' Mixtral (d)
        rows.append([LABELS[name], f"{tokens_per_step / s['step_time']:,.0f}", f"{s['step_time'] * 1000:.0f}",
                     f"{s['peak_rss_mb']:,.0f}", f"{s['dropped']:.1%}"]
                    + [f"{summary[other]['step_time'] / s['step_time']:.2f}" if other in summary else "-"
                       for other in ("dense", "mixtral")])
    shape = SIZES[args.size]
    print_table(f"MoE training throughput: {shape['num_layers']} layers, hidden {shape['hidden_size']}, "
                f"{args.experts} SwiGLU experts of width {args.expert_width}, top-{args.top_k} (dense width "
                f"{args.top_k * args.expert_width}), seq {args.seq}, batch {args.batch}, {args.precision} on "
                f"{machine_description()}",
                ["contender", "tokens/s", "step ms", "peak RSS MB", "routes dropped", "speed vs (a)", "speed vs (d)"],
                rows)


if __name__ == "__main__":
    main()
