#!/usr/bin/env python
"""Which Adam trains faster on one GPU: DeepSpeed's FusedAdam (which DeepSpeed wraps in its flat fused
FP16_Optimizer for bf16 / fp16 without ZeRO) or torch's fused AdamW (which it wraps in FP16_UnfusedOptimizer there).
megatron.optim.optimizers.adam_implementation makes the choice; this measures both through setup_model_and_optimizer as
training builds the engine (bf16, ZeRO 0, gradient clipping 1.0, a 12 x 768 GPT at vocab 50304, seq 2048, micro-batch
8), FusedAdam, then torch, then FusedAdam again (the first may pay for warm-up), and prints for each the optimizer
DeepSpeed wraps, the wrapper, the median step and engine.step() times, peak memory and the losses.

    python bench/optimizer_step.py          # on a CUDA GPU (bench/gpu_check.py runs it)
    python bench/optimizer_step.py --tiny   # CPU: a tiny model, both rows with the CPU choice (the call path only)
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.common import gpu_or_tiny  # noqa: E402


def _random_batch(batch: int, seq: int, vocab: int, seed: int):
    """((tokens, position_ids, attention_mask), (labels, loss_mask)) from seeded random tokens."""
    from megatron.model.batch import masks_and_position_ids

    text = torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(seed))
    tokens, labels = text[:, :-1], text[:, 1:]
    mask, loss_mask, positions = masks_and_position_ids(tokens, None, False)
    return (tokens, positions, mask), (labels, loss_mask)


def main(argv=None) -> int:
    on_gpu = gpu_or_tiny(__doc__, "CPU dry run: tiny model, a step or two", argv)
    import megatron.optim.optimizers as optimizers
    from megatron.initialize import initialize_megatron
    from megatron.neox_arguments import NeoXArgs
    from megatron.training.setup import setup_model_and_optimizer
    from megatron.training_schedule import TrainingSchedule

    layers, hidden, heads, seq, batch, vocab, warmup, steps = \
        (12, 768, 12, 2048, 8, 50304, 3, 10) if on_gpu else (2, 64, 4, 32, 2, 128, 1, 2)
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    if on_gpu:
        torch.cuda.set_device(0)
    backend = "nccl" if on_gpu else "gloo"
    store = torch.distributed.HashStore()  # one rank, no launcher, no port
    torch.distributed.init_process_group(backend, store=store, rank=0, world_size=1)
    args = NeoXArgs.from_dict({
        "num_layers": layers, "hidden_size": hidden, "num_attention_heads": heads, "seq_length": seq,
        "max_position_embeddings": seq, "pos_emb": "rotary", "rotary_pct": 0.25, "gpt_j_residual": True,
        "no_weight_tying": True, "norm": "layernorm", "activation": "gelu", "make_vocab_size_divisible_by": 128,
        "hidden_dropout": 0.0, "attention_dropout": 0.0, "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1, "optimizer": {"type": "Adam", "params": {"lr": 1.0e-4}},
        "weight_decay": 0.01, "zero_optimization": {"stage": 0}, "gradient_clipping": 1.0,
        "bf16": {"enabled": True}, "num_gpus": 1, "train_iters": warmup + steps, "seed": 1234,
        "distributed_backend": backend})
    ctx = initialize_megatron(args, build_tokenizer_fn=lambda _: SimpleNamespace(vocab_size=vocab, eod=0))
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name() if on_gpu else 'cpu'}, "
          f"TORCH_CUDA_ARCH_LIST={os.environ.get('TORCH_CUDA_ARCH_LIST')!r}, "
          f"the rule on CUDA: {optimizers.adam_implementation(args, 'cuda')}", flush=True)
    batches = [_random_batch(batch, seq, vocab, seed=i) for i in range(warmup + steps)]
    batches = [tuple(tuple(t.to(ctx.device) for t in part) for part in b) for b in batches]

    def sync() -> None:
        if on_gpu:
            torch.cuda.synchronize()

    def measure(choice: str) -> None:
        chosen = optimizers.adam_implementation
        optimizers.adam_implementation = lambda a, device: choice if device == "cuda" else chosen(a, device)
        try:
            torch.manual_seed(0)
            engine, _, _ = setup_model_and_optimizer(args, ctx, TrainingSchedule.from_neox_args(args))
        finally:
            optimizers.adam_implementation = chosen
        if on_gpu:
            torch.cuda.reset_peak_memory_stats()
        step_s, optimizer_s, losses = [], [], []
        for i, (inputs, labels) in enumerate(batches):
            sync()
            start = time.perf_counter()
            loss = engine.module.loss_fn(engine(inputs), labels)
            engine.backward(loss)
            sync()
            backward_done = time.perf_counter()
            engine.step()
            sync()
            end = time.perf_counter()
            losses.append(float(loss.detach()))
            if i >= warmup:
                step_s.append(end - start)
                optimizer_s.append(end - backward_done)
        peak = torch.cuda.max_memory_allocated() / 2**30 if on_gpu else float("nan")
        print(f"asked {choice:32s} basic {type(engine.basic_optimizer).__name__:10s} wrapped by "
              f"{type(engine.optimizer).__name__:22s} step {1e3 * statistics.median(step_s):7.1f} ms  engine.step "
              f"{1e3 * statistics.median(optimizer_s):7.1f} ms  peak {peak:5.2f} GiB  "
              f"losses {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
        del engine
        if on_gpu:
            torch.cuda.empty_cache()

    for choice in (optimizers.DEEPSPEED_FUSED_ADAM, optimizers.TORCH_FUSED_ADAM, optimizers.DEEPSPEED_FUSED_ADAM):
        measure(choice)
    return 0


if __name__ == "__main__":
    sys.exit(main())
