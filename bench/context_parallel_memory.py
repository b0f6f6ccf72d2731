#!/usr/bin/env python
"""Context parallelism: activation memory per rank of one long sequence at context_parallel_size 1 and 2.

One training step (forward, loss, backward) of the same model on one sequence, at CP=1 on one process and at
CP=2 on two gloo processes (ring attention, megatron.model.ring_attention). Per rank it reports the
activations kept for the backward pass (the bytes of every distinct tensor autograd saves, counted by
torch.autograd.graph.saved_tensors_hooks, weights excluded: exact, unlike the process's resident memory on a
shared machine),
the growth of the peak resident memory during the step, and the step time.

    python bench/context_parallel_memory.py                  # 4 layers, hidden 256, 8 heads, seq 8192
    python bench/context_parallel_memory.py --seq 16384 --layers 2

Every activation is [batch, seq / C, ...] per rank, and ring attention keeps only q, k, v, its output and the
log-sum-exp (no score matrix), so the activations per rank halve at CP=2: a sequence twice as long fits in the
same memory."""

import argparse
import os
import resource
import sys
import time
from typing import Dict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import machine_description, print_table  # noqa: E402


def _step(rank: int, world: int, port: int, args, queue) -> None:
    os.environ.update({"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"})
    import torch
    import torch.distributed as dist

    from megatron.model import BatchOptions, build_model, get_batch
    from megatron.model_config import ModelConfig
    from megatron.mpu import ParallelState, SingleProcessState

    torch.set_num_threads(1)
    state = SingleProcessState()
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        state = ParallelState(pipe_parallel_size=0, model_parallel_size=1, context_parallel_size=world)
    config = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                         seq_length=args.seq, padded_vocab_size=1024, pos_emb="rotary", context_parallel_size=world)
    model = build_model(config, state)
    text = torch.randint(0, 1024, (1, args.seq + 1), generator=torch.Generator().manual_seed(0))
    inputs, labels = get_batch(BatchOptions(), {"text": text}, state)
    saved: Dict[int, int] = {}
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}  # saved too, but not activations

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in weights:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model.loss_fn(model(inputs), labels)
    loss.backward()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    queue.put((rank, sum(saved.values()) / 2 ** 20, peak / 1024, seconds, loss.item()))
    if world > 1:
        dist.barrier()
        state.destroy()
        dist.destroy_process_group()


def measure(world: int, args, port: int) -> Dict[str, float]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_step, args=(rank, world, port, args, queue)) for rank in range(world)]
    for proc in procs:
        proc.start()
    results = [queue.get(timeout=3600) for _ in procs]
    for proc in procs:
        proc.join()
    return {"saved_mb": max(r[1] for r in results), "peak_mb": max(r[2] for r in results),
            "seconds": max(r[3] for r in results), "loss": results[0][4]}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--port", type=int, default=29731)
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    rows, base = [], None
    for cp in (1, 2):
        result = measure(cp, args, args.port + cp)
        base = base or result
        rows.append([cp, f"{result['saved_mb']:,.0f}", f"{result['saved_mb'] / base['saved_mb']:.2f}",
                     f"{result['peak_mb']:,.0f}", f"{result['seconds']:.2f}", f"{result['loss']:.5f}"])
    print_table(f"Activation memory per rank, one sequence of {args.seq} tokens ({args.layers} layers, hidden "
                f"{args.hidden}, {args.heads} heads, fp32; {machine_description()})",
                ["context_parallel_size", "saved activations MB / rank", "vs CP=1", "peak RSS growth MB / rank",
                 "step s", "loss"], rows)


if __name__ == "__main__":
    main()
