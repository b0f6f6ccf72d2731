#!/usr/bin/env python
"""LoRA against full fine-tuning of the same model: the median step time and the peak memory of each, trained through
deepy.py train.py (as bench/recompute_memory.py: random tokens, the median step time after --warmup steps, peak GPU
memory on a GPU, else the peak resident memory of the process tree).

The full fine-tuning run trains the model from its initialisation and saves it; the LoRA run starts its adapters on
that checkpoint (load + finetune: true, the base frozen, the optimizer holding the adapters only). The LoRA run does
less work per step (no weight gradients or optimizer state for the base) but still the whole forward pass and the
backward through the activations.

    python bench/lora_step.py                          # 4 layers, hidden 256, seq 512, batch 4, r 8 on all targets
    python bench/lora_step.py --size medium --repeats 3

Prints one markdown table row per mode, under a title with the date, the commit and the machine."""

import argparse
import os
import sys
import tempfile
from typing import Dict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import (machine_description, median, plain_train_config, print_table,  # noqa: E402
                          step_time_and_peak, train_with_deepy)
from bench.train_throughput import write_data  # noqa: E402

SIZES = {"tiny": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4},     # smoke test of the script
         "small": {"num_layers": 4, "hidden_size": 256, "num_attention_heads": 8},
         "medium": {"num_layers": 8, "hidden_size": 1024, "num_attention_heads": 16}}
LORA = {"r": 8, "alpha": 16, "target_modules": ["query_key_value", "dense", "linear1", "linear2"]}
MODES = ("full fine-tuning", "LoRA")


def train_config(args, mode: str, data: Dict[str, str], directory: str) -> Dict:
    """The deepy.py config of one mode; the full run saves the base the LoRA run loads."""
    base = os.path.join(directory, "base")
    config = {**plain_train_config(SIZES[args.size], args.seq, args.batch, args.warmup + args.steps, data, directory),
              "pos_emb": "rotary", "precision": args.precision}
    if args.precision == "bfloat16":
        config["bf16"] = {"enabled": True}
    if mode == "LoRA":
        return {**config, "lora": {**LORA, "r": args.rank}, "load": base, "finetune": True}
    return {**config, "save": base, "checkpoint_factor": args.warmup + args.steps}


def trainable_parameters(config: Dict) -> int:
    """The parameters the optimizer holds in a run of ``config`` (its model built once, on the CPU)."""
    from megatron.model.config import ModelConfig
    from megatron.model.gpt2_model import build_model
    from megatron.mpu import SingleProcessState
    from megatron.neox_arguments import NeoXArgs

    args = NeoXArgs.from_dict({k: v for k, v in config.items() if k not in ("load", "save", "finetune")})
    model = build_model(ModelConfig.from_neox_args(args, padded_vocab_size=128), SingleProcessState())
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rank", type=int, default=LORA["r"])
    parser.add_argument("--precision", choices=("fp32", "bfloat16"), default="fp32")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--port", type=int, default=29761)
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    runs = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as directory:
        data = write_data(directory, args.batch * args.seq * (args.warmup + args.steps + 2) * 2)
        for repeat in range(args.repeats):
            for mode in MODES:  # the full run first: it writes the base the LoRA run loads
                config = train_config(args, mode, data, directory)
                records, result = train_with_deepy(config, directory, mode.split()[0].lower(), args.port)
                runs[mode].append({**step_time_and_peak(records, result, args.warmup),
                                   "trainable": trainable_parameters(config)})
                print(f"run {repeat + 1}/{args.repeats} {mode}: step {runs[mode][-1]['step_time']:.3f}s, peak "
                      f"{runs[mode][-1]['peak_mb']:,.0f} MB", flush=True)
    full_step, full_peak = (median([r[key] for r in runs[MODES[0]]]) for key in ("step_time", "peak_mb"))
    rows = []
    for mode in MODES:
        step, peak = (median([r[key] for r in runs[mode]]) for key in ("step_time", "peak_mb"))
        rows.append([mode, f"{runs[mode][0]['trainable']:,}", f"{peak:,.0f}", f"{peak - full_peak:+,.0f}",
                     f"{step:.3f}", f"{step / full_step:.2f}"])
    shape = SIZES[args.size]
    print_table(f"LoRA (r {args.rank}, alpha {LORA['alpha']}, {', '.join(LORA['target_modules'])}) vs full "
                f"fine-tuning: {args.size} ({shape['num_layers']} layers, hidden {shape['hidden_size']}), seq "
                f"{args.seq}, batch {args.batch}, {args.precision}, on {machine_description()}",
                ["mode", "trained parameters", "peak MB", "vs full MB", "step s", "step time vs full"], rows)


if __name__ == "__main__":
    main()
