#!/usr/bin/env python
"""Packed documents: memory of attending per document (inter_document_attention_masking) against GPT-NeoX's dense
per-document mask (reset_attention_mask alone: a [batch, 1, seq, seq] bool mask, and SDPA's masked path).

One training step (forward, loss, backward) of the same small model on one packed sequence of documents of random
lengths, each contender in its own process (spawned): the growth of the peak resident memory during the step above
the resident memory before it (the masks and score blocks are transient), the largest tensor of the sequence's
[seq, seq] shape that any op produced (recorded by a TorchDispatchMode in a second, unmeasured step: the check the
tests make), the step time and the loss, which the two paths share (the same documents; positions restart in both).

    python bench/packed_attention_memory.py                   # seq 8192, documents of 64..1024 tokens, 2 layers
    python bench/packed_attention_memory.py --seq 2048 --layers 1 --hidden 32 --heads 2

Prints a Markdown table with the date, commit and machine. The dense row grows with seq^2 (the bool mask, SDPA's
float mask and, on the CPU, its [heads, seq, seq] scores per layer); the packed row with the longest document."""

import argparse
import datetime
import os
import subprocess
import sys
import time
from typing import Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import machine_description, print_table  # noqa: E402
from bench.context_parallel_memory import _peak_rss, _restart_peak_rss  # noqa: E402

CONTENDERS = {"dense mask (reset_attention_mask)": False, "packed (inter_document_attention_masking)": True}
EOD = 0


def document_lengths(seq: int, shortest: int, longest: int, seed: int = 0) -> List[int]:
    """Random document lengths in [shortest, longest] that fill ``seq`` tokens (the last one cut to fit)."""
    import random

    rng, lengths = random.Random(seed), []
    while sum(lengths) < seq:
        lengths.append(min(rng.randint(shortest, longest), seq - sum(lengths)))
    return lengths


def packed_text(seq: int, lengths: List[int], vocab: int):
    """[1, seq + 1] random token ids whose documents of ``lengths`` end with EOD."""
    import torch

    text = torch.randint(1, vocab, (1, seq + 1), generator=torch.Generator().manual_seed(0))
    for end in torch.tensor(lengths).cumsum(0)[:-1]:
        text[0, end - 1] = EOD
    return text


def _largest_square(model, inputs, labels, seq: int) -> int:
    """Bytes of the largest op output whose last two dimensions are [seq, seq], over one forward and backward."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    largest = 0

    class Squares(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            nonlocal largest
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.dim() >= 2 and tuple(t.shape[-2:]) == (seq, seq):
                    largest = max(largest, t.numel() * t.element_size())
            return out

    with Squares():
        model.loss_fn(model(inputs), labels).backward()
    return largest


def _step(args, packed: bool, queue) -> None:
    os.environ.update({"OMP_NUM_THREADS": str(args.threads), "DS_ACCELERATOR": "cpu"})
    import torch

    from megatron.model.batch import BatchOptions, get_batch
    from megatron.model.config import ModelConfig
    from megatron.model.gpt2_model import build_model
    from megatron.mpu import SingleProcessState

    torch.set_num_threads(args.threads)
    state = SingleProcessState()
    config = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                         seq_length=args.seq, padded_vocab_size=1024, pos_emb="rotary", hidden_dropout=0.0,
                         attention_dropout=0.0)
    torch.manual_seed(0)
    model = build_model(config, state)
    options = BatchOptions(documents=True) if packed else BatchOptions(reset_position_ids=True,
                                                                        reset_attention_mask=True)
    text = packed_text(args.seq, document_lengths(args.seq, args.shortest, args.longest), 1024)
    before = _restart_peak_rss()
    start = time.perf_counter()
    inputs, labels = get_batch(options, {"text": text}, state, eod_token=EOD)  # the dense mask is built here
    loss = model.loss_fn(model(inputs), labels)
    loss.backward()
    seconds = time.perf_counter() - start
    peak = _peak_rss() - before
    largest = _largest_square(model, inputs, labels, args.seq)
    queue.put((peak / 1024, largest / 2 ** 20, seconds, loss.item()))


def measure(args, packed: bool) -> Dict[str, float]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_step, args=(args, packed, queue))
    proc.start()
    peak_mb, square_mb, seconds, loss = queue.get(timeout=3600)
    proc.join()
    return {"peak_mb": peak_mb, "square_mb": square_mb, "seconds": seconds, "loss": loss}


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def parse_args(argv: Optional[List[str]] = None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--shortest", type=int, default=64, help="shortest document (tokens)")
    parser.add_argument("--longest", type=int, default=1024, help="longest document (tokens)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    if not 1 <= args.shortest <= args.longest:
        parser.error(f"--shortest {args.shortest} and --longest {args.longest}: need 1 <= shortest <= longest")
    return args


def main(argv: Optional[List[str]] = None) -> str:
    args = parse_args(argv)
    results = {name: measure(args, packed) for name, packed in CONTENDERS.items()}
    rows = [[name, f"{r['peak_mb']:.0f}", f"{r['square_mb']:.1f}", f"{r['seconds']:.2f}", f"{r['loss']:.6f}"]
            for name, r in results.items()]
    title = (f"Packed documents, seq {args.seq} (documents of {args.shortest}..{args.longest} tokens), {args.layers} "
             f"layers, hidden {args.hidden}, {args.heads} heads: one training step "
             f"({datetime.date.today().isoformat()}, commit {commit()}, {machine_description()})")
    return print_table(title, ["attention", "peak RSS growth MB", "largest [seq, seq] tensor MB", "step s", "loss"],
                       rows)


if __name__ == "__main__":
    main()
