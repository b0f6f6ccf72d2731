#!/usr/bin/env python
"""The training loss in chunks of tokens against the whole [tokens, vocab] logits: peak memory and step time.

Each contender trains the same model (bench/train_throughput.py's 'small' by default: 6 layers, hidden 512, 8 heads,
vocab 50304, rotary 0.25, GPT-J residual, untied head) on the same random tokens, in its own process (started
through bench.common.measure_command: the peak resident memory of the process is measured the same way for all);
a step is forward, loss, backward and a torch AdamW step, timed after --warmup steps. On a GPU the model runs
there and the peak is the peak allocated GPU memory. Contenders:

* unchunked: ``loss_fn(model(inputs))``, the logits whole (vocab_parallel_cross_entropy keeps their fp32
  log-softmax for the backward);
* chunked: ``loss_fn(model(inputs, defer_logits=True))``, what training runs (megatron.training.step.loss_of): the head
  and the cross entropy a chunk of tokens at a time, gradients computed in the forward pass;
* per-token chunks (the DPO / KTO path): the same chunks, per-token losses whose backward recomputes each
  chunk's logits (one more matmul of the head's size).

    python bench/chunked_loss_memory.py                       # small, seq 2048, batch 4, fp32
    python bench/chunked_loss_memory.py --repeats 3 --only unchunked,chunked
    python bench/chunked_loss_memory.py --size tiny --seq 64 --steps 1 --warmup 1   # smoke test

The model is built directly (no DeepSpeed engine): the contenders differ in the loss alone. On a shared machine the
step times drift between runs; --head-repeats N also times the head and loss alone (forward and backward of
[batch x seq, hidden] x [vocab, hidden], the only work that differs) N times per contender, interleaved in one
process, which the drift cannot favour."""

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import (REPO, last_json_line, machine_description, measure_command,  # noqa: E402
                          median_of_turning_runs, print_table)
from bench.train_throughput import SIZES, VOCAB as GPT2_VOCAB  # noqa: E402

CONTENDERS = {"unchunked": "whole logits (vocab_parallel_cross_entropy)",
              "chunked": "chunked, gradients in the forward (training's loss)",
              "per_token": "chunked, per-token, backward recomputes (DPO / KTO)"}


def model_config(args):
    from megatron.model.config import ModelConfig

    precision = "bfloat16" if args.precision == "bf16" else "fp32"
    return ModelConfig(**SIZES[args.size], seq_length=args.seq, max_position_embeddings=args.seq,
                       padded_vocab_size=args.vocab, pos_emb="rotary", rotary_pct=0.25, gpt_j_residual=True,
                       no_weight_tying=True, norm="layernorm", activation="gelu", hidden_dropout=0.0,
                       attention_dropout=0.0, precision=precision)


def loss_of(model, contender: str, inputs, labels):
    """One micro-batch's loss as `contender` computes it."""
    from megatron.model.head import token_cross_entropy

    if contender == "unchunked":
        return model.loss_fn(model(inputs), labels)
    if contender == "chunked":
        return model.loss_fn(model(inputs, defer_logits=True), labels)
    tokens, mask = labels[0], labels[1].float()
    losses = token_cross_entropy(model(inputs, defer_logits=True), tokens, None)
    return (losses * mask).sum() / mask.sum().clamp(min=1.0)


def worker(args) -> Dict[str, float]:
    """Train `args.contender` for warmup + steps steps in this process (on the GPU where there is one): the median
    step time, the loss of step 1 and, on a GPU, the peak allocated GPU memory."""
    import torch

    from megatron.model.gpt2_model import build_model
    from megatron.model.batch import masks_and_position_ids
    from megatron.mpu import SingleProcessState

    torch.set_num_threads(args.threads)
    torch.manual_seed(1)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model(model_config(args), SingleProcessState()).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    times, first_loss = [], None
    for step in range(args.warmup + args.steps):
        text = torch.randint(1, args.vocab, (args.batch, args.seq + 1), generator=gen).to(device)
        mask, loss_mask, positions = masks_and_position_ids(text[:, :-1], None, False)
        start = time.perf_counter()
        loss = loss_of(model, args.contender, (text[:, :-1], positions, mask), (text[:, 1:], loss_mask))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        first_loss = loss.item() if first_loss is None else first_loss  # also waits for the GPU
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    timed = sorted(times[args.warmup:])
    out = {"step_time": timed[len(timed) // 2], "first_loss": first_loss}
    if device.type == "cuda":
        out["peak_gpu_mb"] = torch.cuda.max_memory_allocated() / 2 ** 20
    return out


def head_and_loss_times(args) -> Dict[str, float]:
    """Median seconds of the head and loss alone (forward + backward) per contender, turning in one process (on the
    GPU where there is one)."""
    import torch

    from megatron.model.head import DeferredLogits, masked_cross_entropy_sum, token_cross_entropy
    from megatron.mpu import vocab_parallel_cross_entropy

    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    tokens, width = args.batch * args.seq, SIZES[args.size]["hidden_size"]
    hidden = torch.randn(tokens, width, generator=gen).to(device, dtype).requires_grad_()
    weight = (torch.randn(args.vocab, width, generator=gen) * width ** -0.5).to(device, dtype).requires_grad_()
    target = torch.randint(0, args.vocab, (tokens,), generator=gen).to(device)
    mask = torch.ones(tokens, device=device)
    runs = {"unchunked": lambda: torch.sum(vocab_parallel_cross_entropy(hidden @ weight.t(), target, None) * mask),
            "chunked": lambda: masked_cross_entropy_sum(DeferredLogits(hidden, weight), target, mask, None),
            "per_token": lambda: torch.sum(token_cross_entropy(DeferredLogits(hidden, weight), target, None) * mask)}
    names = [name for name in CONTENDERS if name in args.only.split(",")]
    times: Dict[str, List[float]] = {name: [] for name in names}
    for repeat in range(args.head_repeats):
        for name in names[repeat % len(names):] + names[:repeat % len(names)]:
            start = time.perf_counter()
            runs[name]().backward()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
            hidden.grad = weight.grad = None
    return {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}


def measure(args, contender: str) -> Dict[str, float]:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", contender, *worker_flags(args)]
    result = measure_command(cmd, env={"OMP_NUM_THREADS": str(args.threads), "DS_ACCELERATOR": "cpu"})
    if result["returncode"] != 0:
        raise RuntimeError(f"{contender} failed:\n{result['stderr'][-3000:]}")
    out = last_json_line(result["stdout"])
    return {**out, "peak_mb": out.pop("peak_gpu_mb", result["peak_rss_mb"])}  # on a GPU its memory


def worker_flags(args) -> List[str]:
    return ["--size", args.size, "--seq", str(args.seq), "--batch", str(args.batch), "--vocab", str(args.vocab),
            "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--precision", args.precision, "--threads", str(args.threads)]


def on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=GPT2_VOCAB, help="padded vocabulary size")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each contender")
    parser.add_argument("--only", default=",".join(CONTENDERS), help="comma list of contenders to run")
    parser.add_argument("--head-repeats", type=int, default=0,
                        help="also time the head and loss alone this many times per contender, interleaved")
    parser.add_argument("--worker", choices=sorted(CONTENDERS), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.worker:
        args.contender = args.worker
        print(json.dumps(worker(args)))
        return
    names = [name for name in CONTENDERS if name in args.only.split(",")]
    summary = median_of_turning_runs(
        names, args.repeats, lambda name: measure(args, name),
        lambda r: f"step {r['step_time']:.2f} s, peak {r['peak_mb']:,.0f} MB, loss {r['first_loss']:.4f}")
    heads = head_and_loss_times(args) if args.head_repeats else {}
    base = summary.get("unchunked")
    rows = []
    for name in names:
        s = summary[name]
        vs = (f"{s['peak_mb'] / base['peak_mb'] - 1:+.0%}", f"{s['step_time'] / base['step_time']:.2f}") if base \
            else ("-", "-")
        head = f"{heads[name]:.2f}" if heads else "-"
        if heads and "unchunked" in heads:
            head += f" ({heads[name] / heads['unchunked']:.2f})"
        rows.append([CONTENDERS[name], f"{s['peak_mb']:,.0f}", vs[0], f"{s['step_time']:.2f}", vs[1], head,
                     f"{s['first_loss']:.6f}"])
    shape = SIZES[args.size]
    print_table(f"Chunked linear + cross entropy: {args.size} ({shape['num_layers']} layers, hidden "
                f"{shape['hidden_size']}), vocab {args.vocab}, seq {args.seq}, batch {args.batch} "
                f"({args.batch * args.seq:,} tokens), {args.precision}, {args.threads} thread(s), median of "
                f"{args.repeats} run(s) x {args.steps} steps; {datetime.date.today()}, commit {commit()}, on "
                f"{machine_description()}",
                ["loss", "peak GPU MB" if on_gpu() else "peak RSS MB", "peak vs whole", "step s", "step time vs whole",
                 f"head + loss s (vs whole), median of {args.head_repeats}", "loss of step 1"], rows)


if __name__ == "__main__":
    main()
