#!/usr/bin/env python
"""Activation recomputation: the memory / time trade-off of recompute_granularity none, selective, full and block.

Each mode trains the same model through deepy.py train.py (as bench/train_throughput.py: random tokens, the
median step time after --warmup steps, the peak resident memory of the process tree, or peak GPU memory on a
GPU). 'selective' recomputes only the attention core (scores, softmax, dropout, product with v) in the
backward pass; 'full' recomputes whole transformer layers (checkpoint_activations, one layer per chunk);
'block' (recompute_method block, recompute_num_layers 1) recomputes only the first layer and keeps the
activations of the others.

    python bench/recompute_memory.py                      # 4 layers, hidden 256, seq 1024, batch 4
    python bench/recompute_memory.py --size medium --seq 2048 --repeats 3

The score matrices the selective mode drops grow with seq^2, so its saving grows with the sequence length;
full recomputation keeps only each layer's input, at the cost of a second forward pass."""

import argparse
import os
import sys
import tempfile
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import (machine_description, median, print_table, step_time_and_peak,  # noqa: E402
                          train_with_deepy)
from bench.train_throughput import write_data  # noqa: E402

SIZES = {"tiny": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4},     # smoke test of the script
         "small": {"num_layers": 4, "hidden_size": 256, "num_attention_heads": 8},
         "medium": {"num_layers": 6, "hidden_size": 512, "num_attention_heads": 8}}
MODES = {"none": {}, "selective": {"recompute_granularity": "selective"},
         "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
         "block": {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1}}


def train_config(args, mode: str, data: Dict[str, str], directory: str) -> Dict:
    """The deepy.py config of one mode; attention dropout on, so that the recomputation has masks to replay."""
    return {
        **SIZES[args.size], **MODES[mode], "seq_length": args.seq, "max_position_embeddings": args.seq,
        "pos_emb": "rotary", "norm": "layernorm", "activation": "gelu", "no_weight_tying": True,
        "make_vocab_size_divisible_by": 128, "tokenizer_type": "HFTokenizer", "vocab_file": data["vocab_file"],
        "data_path": data["data_path"], "split": "100,0,0", "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1, "train_iters": args.warmup + args.steps,
        "optimizer": {"type": "Adam", "params": {"lr": 1.0e-4}}, "zero_optimization": {"stage": 0},
        "gradient_clipping": 1.0, "num_gpus": 1, "num_workers": 0, "log_interval": 1, "steps_per_print": 1000000,
        "eval_interval": 1000000, "eval_iters": 0, "log_dir": os.path.join(directory, "logs"),
        "distributed_backend": "nccl", "seed": 1, "hidden_dropout": 0.0, "attention_dropout": 0.1,
        "do_test": False, "weight_decay": 0.0,
    }


def train(args, mode: str, data: Dict[str, str], directory: str) -> Dict:
    records, result = train_with_deepy(train_config(args, mode, data, directory), directory, mode, args.port)
    return step_time_and_peak(records, result, args.warmup)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--port", type=int, default=29753)
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    modes = list(MODES)
    runs: Dict[str, List[Dict]] = {mode: [] for mode in modes}
    tokens_per_step = args.batch * args.seq
    with tempfile.TemporaryDirectory() as directory:
        data = write_data(directory, tokens_per_step * (args.warmup + args.steps + 2) * 2)
        for repeat in range(args.repeats):
            turn = repeat % len(modes)
            for mode in modes[turn:] + modes[:turn]:  # rotate the order: no mode always runs first
                runs[mode].append(train(args, mode, data, directory))
                print(f"run {repeat + 1}/{args.repeats} {mode}: step {runs[mode][-1]['step_time']:.3f}s, peak "
                      f"{runs[mode][-1]['peak_mb']:,.0f} MB", flush=True)
    base_step, base_peak = (median([r[key] for r in runs["none"]]) for key in ("step_time", "peak_mb"))
    rows = []
    for mode in modes:
        step, peak = (median([r[key] for r in runs[mode]]) for key in ("step_time", "peak_mb"))
        rows.append([mode, f"{peak:,.0f}", f"{peak - base_peak:+,.0f}", f"{step:.3f}", f"{step / base_step:.2f}",
                     f"{tokens_per_step / step:,.0f}"])
    shape = SIZES[args.size]
    print_table(f"Activation recomputation: {args.size} ({shape['num_layers']} layers, hidden {shape['hidden_size']}, "
                f"{shape['num_attention_heads']} heads), seq {args.seq}, batch {args.batch}, fp32, attention dropout "
                f"0.1, on {machine_description()}",
                ["recompute", "peak MB", "vs none MB", "step s", "step time vs none", "tokens/s"], rows)


if __name__ == "__main__":
    main()
