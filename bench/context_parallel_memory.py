#!/usr/bin/env python
"""Context parallelism: activation memory per rank of one long sequence at context_parallel_size 1 and 2.

One training step (forward, loss, backward) of the same model on one sequence, at CP=1 on one process and at
CP=2 on two gloo processes (ring attention, megatron.model.ring_attention), the latter with each ring step
through the fused attention kernel ("fused": PyTorch's CPU flash-attention kernel here, flash / memory-efficient
on CUDA) and, for comparison, through its whole fp32 score block ("scores": what every device but the CPU did
before, [S/C, S/C] per step and head). Per rank it reports the activations kept for the backward pass (the bytes
of every distinct tensor autograd saves, counted by torch.autograd.graph.saved_tensors_hooks, weights excluded:
exact, unlike the process's resident memory on a shared machine), the growth of the peak resident memory during
the step above the resident memory before it (where the score blocks show: they are transient), and the step
time.

    python bench/context_parallel_memory.py                  # seq 32768, 2 layers, hidden 64, 1 head
    python bench/context_parallel_memory.py --seq 8192 --layers 4 --hidden 256 --heads 8 --kernels fused

Every activation is [batch, seq / C, ...] per rank, and ring attention keeps only q, k, v, its output and the
log-sum-exp, so the activations per rank halve at CP=2; the fused steps also keep the transient memory O(S / C),
while the score blocks grow with (S / C)^2 (heads x (S / C)^2 x 4 bytes per step, 1 GiB per head at 32k tokens).

    python bench/context_parallel_memory.py --gpu            # on a CUDA machine: the ring attention alone

times one forward and backward of causal attention over 32k tokens (bf16, 32 heads of 128) on one GPU: SDPA over
the whole sequence, and ring attention at CP=2 with both ranks simulated one after the other on that GPU
(megatron.model.ring_simulation: the same kernels, blocks and merges, no communication), printing each one's
peak memory, time and error against an fp32 reference."""

import argparse
import os
import re
import resource
import sys
import time
from typing import Dict, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import machine_description, print_table  # noqa: E402

KERNELS = {"fused": None, "scores": "scores"}  # row name -> ring attention's kernel (None: its own choice)


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as status:
        return int(re.search(rf"{key}:\s+(\d+)", status.read()).group(1))


def _restart_peak_rss() -> int:
    """The resident kB now, the peak restarted from it (Linux's clear_refs); elsewhere the peak so far (a step
    that stays below an earlier peak then shows no growth)."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        return _status_kb("VmRSS")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _peak_rss() -> int:
    """The peak resident kB since _restart_peak_rss."""
    try:
        return _status_kb("VmHWM")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _step(rank: int, world: int, port: int, args, kernel: Optional[str], queue) -> None:
    os.environ.update({"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"})
    import functools

    import torch
    import torch.distributed as dist

    from megatron.model.batch import BatchOptions, get_batch
    from megatron.model import attention
    from megatron.model.gpt2_model import build_model
    from megatron.model.ring_attention import ring_attention
    from megatron.model.config import ModelConfig
    from megatron.mpu import ParallelState, SingleProcessState

    torch.set_num_threads(1)
    state = SingleProcessState()
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        state = ParallelState(pipe_parallel_size=0, model_parallel_size=1, context_parallel_size=world)
    if kernel:  # the attention layers call ring_attention with the kernel of their device: this row names one
        attention.ring_attention = functools.partial(ring_attention, kernel=kernel)
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

    before = _restart_peak_rss()
    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model.loss_fn(model(inputs), labels)
    loss.backward()
    seconds = time.perf_counter() - start
    peak = _peak_rss() - before
    queue.put((rank, sum(saved.values()) / 2 ** 20, peak / 1024, seconds, loss.item()))
    if world > 1:
        dist.barrier()
        state.destroy()
        dist.destroy_process_group()


def measure(world: int, args, port: int, kernel: Optional[str] = None) -> Dict[str, float]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_step, args=(rank, world, port, args, kernel, queue)) for rank in range(world)]
    for proc in procs:
        proc.start()
    results = [queue.get(timeout=3600) for _ in procs]
    for proc in procs:
        proc.join()
    return {"saved_mb": max(r[1] for r in results), "peak_mb": max(r[2] for r in results),
            "seconds": max(r[3] for r in results), "loss": results[0][4]}


def gpu_ring_attention(seq: int = 32768, heads: int = 32, kv_heads: int = 32, head_dim: int = 128,
                       cp: int = 2, device: str = "cuda") -> str:
    """On one CUDA device: one forward and backward of causal attention over ``seq`` tokens in bf16, as SDPA over
    the whole sequence and as ring attention at context_parallel_size ``cp`` with each rank simulated in turn
    (its own chunks, the ring's keys and values and gradient buffers prepared beforehand as a rank would hold or
    receive them; no communication), then each rank's steps through their whole score blocks (``scores``, the
    computation before the fused kernels). Prints a table of peak memory above what was allocated before the
    call, time, and max error of output and gradients against SDPA in fp32; returns it. ``device="cpu"`` runs the
    same at small sizes as a dry run (no memory figures)."""
    import torch
    import torch.nn.functional as F

    from megatron.model.ring_attention import choose_kernel
    from megatron.model.ring_simulation import SimulatedContextParallel

    cuda = device == "cuda"
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, heads, seq, head_dim, device=device, generator=gen)
    k, v = (torch.randn(1, kv_heads, seq, head_dim, device=device, generator=gen) for _ in range(2))
    grad = torch.randn(1, heads, seq, head_dim, device=device, generator=gen)

    def sdpa(q, k, v, grad):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=kv_heads < heads)
        out.backward(grad)
        return (out.detach(), *(t.grad for t in leaves))

    def measured(run):
        """(run's result, peak GiB above what was allocated before it, seconds) of its second call."""
        run()  # warm-up
        if not cuda:
            start = time.perf_counter()
            return run(), float("nan"), time.perf_counter() - start
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        result = run()
        torch.cuda.synchronize()
        return result, (torch.cuda.max_memory_allocated() - base) / 2 ** 30, time.perf_counter() - start

    def error(got, want) -> str:
        return f"{(got.float() - want.float()).abs().max().item():.1e}"

    reference = sdpa(q, k, v, grad)  # fp32: the memory-efficient kernel, O(seq) memory
    q, k, v, grad = (t.bfloat16() for t in (q, k, v, grad))
    result, peak, seconds = measured(lambda: sdpa(q, k, v, grad))
    rows = [["SDPA, whole sequence (CP=1)", f"{peak:.2f}", f"{seconds * 1000:.0f}",
             " / ".join(error(a, b) for a, b in zip(result, reference))]]
    del result
    for kernel in (choose_kernel(q), "scores"):
        ranks = SimulatedContextParallel(q, k, v, cp)
        try:
            for rank in range(cp):
                part_grad = ranks.share(grad, rank)
                (out, dq), peak, seconds = measured(lambda: ranks.run_rank(rank, part_grad, kernel))
                want = [ranks.share(t, rank) for t in reference[:2]]
                rows.append([f"ring attention CP={cp} ({kernel}), rank {rank}", f"{peak:.2f}",
                             f"{seconds * 1000:.0f}", f"{error(out, want[0])} / {error(dq, want[1])}"])
            dk, dv = ranks.key_value_grads(k)  # every rank ran twice (warm-up, measured): twice the gradients
            rows[-1][-1] += f" / {error(dk / 2, reference[2])} / {error(dv / 2, reference[3])}"
        except torch.cuda.OutOfMemoryError as oom:
            rows.append([f"ring attention CP={cp} ({kernel})", "out of memory", "-", str(oom).split(".")[0]])
        del ranks
        if cuda:
            torch.cuda.empty_cache()
    return print_table(f"Causal attention, {seq} tokens, bf16, {heads} heads ({kv_heads} kv) of {head_dim}, one "
                       f"forward and backward ({machine_description()})",
                       ["attention", "peak GiB", "fwd+bwd ms",
                        "max error vs fp32: out / dq (a rank's positions) / dk / dv (the last rank's row: all ranks')"],
                       rows)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=1)
    parser.add_argument("--kernels", default="fused,scores",
                        help=f"the CP=2 rows, comma-separated: {', '.join(KERNELS)}")
    parser.add_argument("--port", type=int, default=29731)
    parser.add_argument("--gpu", action="store_true", help="ring attention alone on one CUDA device (see above)")
    parser.add_argument("--gpu-dry-run", action="store_true", help="--gpu's steps at small sizes on the CPU")
    args = parser.parse_args(argv)
    unknown = set(args.kernels.split(",")) - set(KERNELS)
    if unknown:
        parser.error(f"--kernels: {', '.join(sorted(unknown))} unknown; choose from {', '.join(KERNELS)}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.gpu or args.gpu_dry_run:
        gpu_ring_attention(**({} if args.gpu else dict(seq=512, heads=4, kv_heads=2, head_dim=16, device="cpu")))
        return
    rows, base = [], None
    for cp, name in [(1, "-")] + [(2, name) for name in args.kernels.split(",")]:
        result = measure(cp, args, args.port + len(rows), KERNELS.get(name))
        base = base or result
        rows.append([cp, name, f"{result['saved_mb']:,.0f}", f"{result['saved_mb'] / base['saved_mb']:.2f}",
                     f"{result['peak_mb']:,.0f}", f"{result['seconds']:.1f}", f"{result['loss']:.5f}"])
    print_table(f"Activation memory per rank, one sequence of {args.seq} tokens ({args.layers} layers, hidden "
                f"{args.hidden}, {args.heads} heads, fp32; {machine_description()})",
                ["context_parallel_size", "ring step", "saved activations MB / rank", "vs CP=1",
                 "peak RSS growth MB / rank", "step s", "loss"], rows)


if __name__ == "__main__":
    main()
