#!/usr/bin/env python
"""One bf16 GPT-NeoX model step (forward + backward, no optimizer, no DeepSpeed) of a ~125M model on one GPU,
for several attention / fusion settings: median step time, peak GPU memory, TFLOP/s and MFU (the project's
formula, megatron/observability/flops.py), and the host synchronisations of one step by file:line, counted with
torch.cuda.set_sync_debug_mode("warn") (every sync of the hot path shows up there).

    python bench/model_step.py          # on a CUDA GPU (bench/gpu_check.py runs it)
    python bench/model_step.py --tiny   # CPU: a 2-layer model under TRITON_INTERPRET=1, no sync counting
"""
from __future__ import annotations

import collections
import os
import sys
import time
import traceback
import warnings
from typing import Callable, Counter, Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.common import gpu_or_tiny  # noqa: E402

FUSED = dict(layernorm_fusion=True, rope_fusion=True, bias_gelu_fusion=True, bias_dropout_fusion=True)


def variants(layers: int, flash_backend: str) -> Dict[str, dict]:
    return {
        "unfused, global attention (SDPA)": dict(),
        f"fused flags, 'flash' layers on {flash_backend}": dict(attention_config=["flash"] * layers, **FUSED),
        "fused flags + upper_triang softmax fusion": dict(scaled_upper_triang_masked_softmax_fusion=True, **FUSED),
        "unfused, attention_softmax_in_fp32": dict(attention_softmax_in_fp32=True),
    }


def host_syncs(step: Callable[[], None], repo: str) -> Counter:
    """file:line -> count of the host synchronisations one call of `step` makes (CUDA only)."""
    syncs: Counter = collections.Counter()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for w in caught:
        if "synchroniz" in str(w.message):
            syncs[f"{os.path.relpath(w.filename, repo)}:{w.lineno}"] += 1
    return syncs


def run_variant(name: str, extra: dict, shape: dict, on_gpu: bool, repo: str) -> None:
    from megatron.observability.flops import mfu, peak_tflops, tflops_per_device, training_flops_per_token
    from megatron.model.gpt2_model import build_model
    from megatron.model.batch import masks_and_position_ids
    from megatron.model.config import ModelConfig
    from megatron.mpu import SingleProcessState

    device = "cuda" if on_gpu else "cpu"
    layers, seq, batch, vocab = shape["layers"], shape["seq"], shape["batch"], shape["vocab"]
    config = ModelConfig(num_layers=layers, hidden_size=shape["hidden"], num_attention_heads=shape["heads"],
                         seq_length=seq, max_position_embeddings=seq, padded_vocab_size=vocab, pos_emb="rotary",
                         rotary_pct=0.25, gpt_j_residual=True, no_weight_tying=True, precision="bfloat16", **extra)
    model = build_model(config, SingleProcessState()).to(device)
    tokens = torch.randint(1, vocab, (batch, seq + 1), device=device)
    attention_mask, loss_mask, positions = masks_and_position_ids(tokens[:, :-1], None, False)
    inputs, labels = (tokens[:, :-1], positions, attention_mask), (tokens[:, 1:].contiguous(), loss_mask)

    def step() -> None:
        model.loss_fn(model(inputs), labels).backward()

    syncs: Counter = collections.Counter()
    if on_gpu:  # on CPU (--tiny) the one timed step is all: the interpreted kernels are slow
        for _ in range(2):
            step()
        syncs = host_syncs(step, repo)
        torch.cuda.reset_peak_memory_stats()
    times: List[float] = []
    for _ in range(5 if on_gpu else 1):
        start = time.perf_counter()
        step()
        if on_gpu:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    seconds = sorted(times)[len(times) // 2]
    achieved = tflops_per_device(training_flops_per_token(config), batch * seq / seconds, 1)
    utilisation = mfu(achieved, peak_tflops("bfloat16"))
    peak = f"{torch.cuda.max_memory_allocated() / 2**30:5.1f} GiB" if on_gpu else "    - GiB"
    flash_used = all(getattr(layer.attention, "flash", None) is not None for layer in model.layers
                     if hasattr(layer, "attention")) and "attention_config" in extra
    print(f"{name:58s} {seconds * 1000:8.1f} ms  peak {peak}  {achieved:6.1f} TFLOP/s  MFU "
          f"{'n/a' if utilisation is None else f'{utilisation:.1%}':>6s}  flash-attn called: {flash_used}  "
          f"syncs/step {sum(syncs.values())}: {dict(syncs.most_common(6))}", flush=True)


def main(argv=None) -> int:
    on_gpu = gpu_or_tiny(__doc__, "CPU dry run: a 2-layer model, one step per variant", argv)
    from megatron.model.flash import flash_attention_backend

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    shape = dict(layers=12, hidden=768, heads=12, seq=2048, batch=8, vocab=50304) if on_gpu else \
        dict(layers=2, hidden=16, heads=2, seq=8, batch=1, vocab=64)
    backend = flash_attention_backend() if on_gpu else "PyTorch SDPA"
    print(f"bf16 GPT {shape['layers']}x{shape['hidden']}, {shape['heads']} heads, seq {shape['seq']}, batch "
          f"{shape['batch']}, vocab {shape['vocab']}: fwd+bwd (no optimizer); MFU against the dense bf16 peak")
    failed = 0
    for name, extra in variants(shape["layers"], backend).items():
        try:
            run_variant(name, extra, shape, on_gpu, repo)
        except Exception as exc:  # noqa: BLE001  one variant failing must not hide the others
            failed += 1
            print(f"{name:58s} FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:200]}", flush=True)
            traceback.print_exc(limit=4)
        finally:
            if on_gpu:
                torch.cuda.empty_cache()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
