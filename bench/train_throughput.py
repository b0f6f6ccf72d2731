#!/usr/bin/env python
"""Training throughput: this project (through deepy.py) against Hugging Face transformers'
GPTNeoXForCausalLM with a plain AdamW loop, and a minimal hand-written PyTorch GPT (SDPA, fused AdamW),
the practical limit. Same model shape, batch, sequence length, precision and token data for all three.

    python bench/train_throughput.py                 # small: 6 layers, hidden 512, seq 512, vocab 50k
    python bench/train_throughput.py --size large    # 12 layers, hidden 768 (125M-class)
    python bench/train_throughput.py --steps 5 --warmup 2 --repeats 3 --precision bf16

Each contender runs --repeats times in its own process (the order turning every repeat); a run times
--steps optimizer steps after --warmup steps; the table gives the median over runs of the median step
time, tokens/s from it, the peak resident memory of the process tree (on a GPU: the peak allocated GPU
memory), and ratios to (b) and (c). On a GPU it adds TFLOP/s and MFU (the project's formula in
megatron/observability/flops.py); --fused turns on flash attention and the fused Triton kernels for this project (the
label names what the 'flash' layers ran: flash-attn, or PyTorch SDPA where flash-attn does not import).
A run that fails or outlives its share of --time-budget is killed with its processes; the table is printed
all the same, the failed contender's row says so, the reason follows the table, and the exit code is 1."""

import argparse
import json
import os
import re
import sys
import tempfile
import time
from typing import Dict, List, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import (REPO, last_json_line, machine_description, measure_command, median,  # noqa: E402
                          print_table, train_with_deepy)

SIZES = {
    "tiny": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4},       # smoke test of the script
    "small": {"num_layers": 6, "hidden_size": 512, "num_attention_heads": 8},
    "large": {"num_layers": 12, "hidden_size": 768, "num_attention_heads": 12},   # 125M-class
    "1B": {"num_layers": 16, "hidden_size": 2048, "num_attention_heads": 16},     # ~1.1B with the 50k vocab
}
VOCAB = 50304  # GPT-2's 50257 padded to a multiple of 128, as GPT-NeoX pads it
# --fused: what a GPU user switches on (the Triton kernels need a GPU; on CPU only through TRITON_INTERPRET)
RESERVE_S = 20  # --time-budget: seconds kept for each run still to come
FUSED_OPTIONS = {"attention_config": [[["flash"], "all"]], "layernorm_fusion": True, "rope_fusion": True,
                 "bias_gelu_fusion": True, "bias_dropout_fusion": True}


def model_shape(args) -> Dict:
    return {**SIZES[args.size], "seq_length": args.seq, "vocab_size": VOCAB}


def write_data(directory: str, num_tokens: int, seed: int = 0) -> Dict[str, str]:
    """Random tokens as a Megatron dataset, and a word-level tokenizer of exactly VOCAB tokens."""
    import numpy as np
    from tokenizers import Tokenizer, models

    from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder

    rng = np.random.default_rng(seed)
    prefix = os.path.join(directory, "random_text_document")
    builder = MMapIndexedDatasetBuilder(prefix, dtype=np.uint16)
    for _ in range(max(num_tokens // 4096, 1)):
        builder.add_item(rng.integers(1, VOCAB, size=4096, dtype=np.uint16))
        builder.end_document()
    builder.finalize()
    vocab = {"<|endoftext|>": 0, **{f"t{i}": i for i in range(1, VOCAB)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    path = os.path.join(directory, "tokenizer.json")
    tokenizer.save(path)
    return {"data_path": prefix, "vocab_file": path}


def ours_config(args, data: Dict[str, str], directory: str) -> Dict:
    """The project's YAML config for the benchmark (the same model as the competitors build)."""
    shape = model_shape(args)
    config = {
        "num_layers": shape["num_layers"], "hidden_size": shape["hidden_size"],
        "num_attention_heads": shape["num_attention_heads"], "seq_length": args.seq,
        "max_position_embeddings": args.seq, "pos_emb": "rotary", "rotary_pct": 0.25, "gpt_j_residual": True,
        "no_weight_tying": True, "norm": "layernorm", "activation": "gelu", "make_vocab_size_divisible_by": 128,
        "tokenizer_type": "HFTokenizer", "vocab_file": data["vocab_file"], "data_path": data["data_path"],
        "split": "100,0,0", "train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
        "train_iters": args.warmup + args.steps, "optimizer": {"type": "Adam", "params": {"lr": 1.0e-4}},
        "zero_optimization": {"stage": 0}, "gradient_clipping": 1.0, "num_gpus": 1, "num_workers": 0,
        "log_interval": 1, "steps_per_print": 1000000, "eval_interval": 1000000, "eval_iters": 0,
        "log_dir": os.path.join(directory, "logs"), "distributed_backend": "nccl", "seed": 1,
        "hidden_dropout": 0.0, "attention_dropout": 0.0, "do_test": False, "weight_decay": 0.0,
    }
    if args.precision == "bf16":
        config["bf16"] = {"enabled": True}
    if args.fused:  # GPU: flash-attn (SDPA where it is not installed) and the Triton kernels
        config.update(FUSED_OPTIONS)
    return config


def ours(args, data: Dict[str, str], directory: str, timeout: float) -> Dict:
    records, result = train_with_deepy(ours_config(args, data, directory), directory, "bench", args.port, timeout)
    times = [r["iteration_time_s"] for r in records if r["iteration"] > args.warmup]
    out = {"step_time": median(times), "peak_rss_mb": result["peak_rss_mb"]}
    if "gpu_max_allocated_gb" in records[-1]:
        out["peak_gpu_mb"] = records[-1]["gpu_max_allocated_gb"] * 1024
    return out


def competitor(args, kind: str, timeout: float) -> Dict:
    shape = model_shape(args)
    cmd = [sys.executable, os.path.join(REPO, "bench", "train_competitors.py"), kind, "--shape", json.dumps(shape),
           "--batch", str(args.batch), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--precision", args.precision]
    result = measure_command(cmd, timeout=timeout)
    if result["returncode"] != 0:
        raise RuntimeError(f"{kind} failed:\n{result['stderr'][-3000:]}")
    return {**last_json_line(result["stdout"]), "peak_rss_mb": result["peak_rss_mb"]}


ERROR_LINE = re.compile(r"\b(\w+(Error|Exception)|Killed|out of memory)\b")


def failure_reason(error: BaseException) -> str:
    """One line for the table: the last error line of the run's output (e.g. the RuntimeError a rank died of)."""
    lines = [line.replace("[rank0]:", "").strip() for line in str(error).splitlines() if line.strip()]
    found = next((line for line in reversed(lines) if ERROR_LINE.search(line)), lines[0] if lines else "")
    named = ERROR_LINE.match(found) is not None
    return (found if named else f"{type(error).__name__}: {found}")[:300].replace("|", "/")


def run_timeout(args, start: float, runs_left_after: int) -> float:
    """Seconds the next run may take: the rest of --time-budget less RESERVE_S for each run still to come (so that
    one hanging contender cannot take the others' time), or an hour without a budget."""
    if args.time_budget is None:
        return 3600.0
    remaining = args.time_budget - (time.monotonic() - start)
    return remaining - RESERVE_S * runs_left_after


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--fused", action="store_true",
                        help="this project with flash attention and the fused Triton kernels (GPU)")
    parser.add_argument("--port", type=int, default=29731)
    parser.add_argument("--only", default="ours,hf,torch", help="comma list of contenders to run")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds for all runs together: each run is killed when it would leave less than "
                             f"{RESERVE_S} s per run still to come, and the table shows it as failed")
    return parser.parse_args(argv)


def run_all(args, contenders: List[str]) -> Tuple[Dict[str, List[Dict]], Dict[str, List[str]]]:
    """Every contender --repeats times, the order turning every repeat (no contender always goes first); returns
    ({name: results of the runs that finished}, {name: why each failed run failed}). A failed run does not stop
    the others."""
    runs: Dict[str, List[Dict]] = {c: [] for c in contenders}
    failures: Dict[str, List[str]] = {c: [] for c in contenders}
    start, total = time.monotonic(), args.repeats * len(contenders)
    with tempfile.TemporaryDirectory() as directory:
        data = write_data(directory, args.batch * args.seq * (args.warmup + args.steps + 2) * 2)
        for repeat in range(args.repeats):
            turn = repeat % len(contenders)
            for index, name in enumerate(contenders[turn:] + contenders[:turn]):
                timeout = run_timeout(args, start, total - (repeat * len(contenders) + index) - 1)
                try:
                    if timeout <= 0:
                        raise TimeoutError("not started: the time budget is spent")
                    result = ours(args, data, directory, timeout) if name == "ours" else \
                        competitor(args, name, timeout)
                except (RuntimeError, TimeoutError, ValueError, KeyError, OSError) as error:
                    failures[name].append(failure_reason(error))
                    output = str(error).splitlines()
                    print(f"run {repeat + 1}/{args.repeats} {name}: FAILED: {failures[name][-1]}"
                          + ("\n" + "\n".join(output[-40:]) if len(output) > 1 else ""), flush=True)
                    continue
                runs[name].append(result)
                print(f"run {repeat + 1}/{args.repeats} {name}: step {result['step_time']:.3f}s, "
                      f"peak {result['peak_rss_mb']:.0f} MB", flush=True)
    return runs, failures


def attention_label(args, on_gpu: bool) -> str:
    """What the 'flash' layers of --fused run: flash-attn only for CUDA fp16/bf16 calls, PyTorch SDPA otherwise."""
    from megatron.model.flash import flash_attention_backend

    return flash_attention_backend() if on_gpu and args.precision == "bf16" else "PyTorch SDPA"


def main(argv=None) -> int:
    args = parse_args(argv)
    tokens_per_step = args.batch * args.seq
    contenders = [c for c in ("ours", "hf", "torch") if c in args.only.split(",")]
    runs, failures = run_all(args, contenders)
    summary = {name: {key: median([r[key] for r in rs]) for key in rs[0]} for name, rs in runs.items() if rs}
    import torch

    on_gpu = torch.cuda.is_available()
    labels = {"ours": "(a) this project (deepy.py)", "hf": "(b) transformers GPTNeoX + AdamW",
              "torch": "(c) minimal PyTorch GPT (SDPA, fused AdamW)"}
    if args.fused:
        labels["ours"] += f", 'flash' layers on {attention_label(args, on_gpu)} + fused kernels"

    def speed_ratio(name: str, other: str) -> str:
        """Throughput of `name` over `other` (> 1: faster); '-' when `other` did not run."""
        return f"{summary[other]['step_time'] / summary[name]['step_time']:.2f}" if other in summary else "-"

    shape = model_shape(args)
    header = ["contender", "tokens/s", "step ms", "peak GPU MB" if on_gpu else "peak RSS MB", "speed vs (b)",
              "speed vs (c)"]
    if on_gpu:
        from megatron.observability.flops import mfu, peak_tflops, tflops_per_device, training_flops_per_token
        from megatron.model.config import ModelConfig

        per_token = training_flops_per_token(ModelConfig(
            **{k: shape[k] for k in ("num_layers", "hidden_size", "num_attention_heads")}, seq_length=args.seq,
            padded_vocab_size=VOCAB))
        peak = peak_tflops("bfloat16" if args.precision == "bf16" else "fp32")
        header += ["TFLOP/s", "MFU"]
    rows = []
    for name in contenders:
        failed = f" ({len(failures[name])} of {args.repeats} runs failed)" if failures[name] else ""
        if name not in summary:
            rows.append([labels[name] + " - FAILED"] + ["-"] * (len(header) - 1))
            continue
        s = summary[name]
        peak_mb = s.get("peak_gpu_mb") if on_gpu else s["peak_rss_mb"]
        row = [labels[name] + failed, f"{tokens_per_step / s['step_time']:,.0f}", f"{s['step_time'] * 1000:.0f}",
               "n/a" if peak_mb is None else f"{peak_mb:,.0f}",
               speed_ratio(name, "hf"), speed_ratio(name, "torch")]
        if on_gpu:
            achieved = tflops_per_device(per_token, tokens_per_step / s["step_time"], 1)
            utilisation = mfu(achieved, peak)
            row += [f"{achieved:.1f}", f"{utilisation:.1%}" if utilisation is not None else "n/a"]
        rows.append(row)
    print_table(f"Training throughput: {args.size} ({shape['num_layers']} layers, hidden {shape['hidden_size']}, "
                f"seq {args.seq}, vocab {VOCAB}, batch {args.batch}, {args.precision}) on {machine_description()}",
                header, rows)
    for name in contenders:
        for reason in failures[name]:
            print(f"failed: {labels[name]}: {reason}", flush=True)
    return 1 if any(failures.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
