"""checkpoint_validation_with_forward_pass: a checkpoint records the model's loss on a fixed sequence, and a run that
loads it computes that loss again and stops when it is not the same.

GPT-NeoX (megatron/checkpointing.py) runs the model in eval mode on the tokens 0, 1, ..., seq_length (one row per
micro-batch sample), keeps the first row's logits in the checkpoint's client state and, after a load, asserts that the
logits are close (torch.isclose), warning when they are close but not equal. Here the same fixed sequence goes through
the evaluation path (megatron.training.step.evaluate: the sequential model or the pipeline engine's eval_batch, every
tensor / pipeline / data-parallel layout) and its language-model loss is what is kept, under ``VALIDATION_KEY``: one
number instead of a seq_length x vocabulary tensor in every checkpoint, and still a function of every logit through
the softmax. A loaded checkpoint that reproduces it to ``tolerance`` passes with a note (saying by how much it differs
when not exactly: another layout sums in another order); one that does not is a CheckpointError naming both losses.

The loss of preference training (DPO, KTO, reward models) needs pairs and reference log-probabilities that a fixed
sequence does not have: validation refuses the key with those train_impl values.
"""
import itertools
from typing import Any, Dict, Mapping, Optional

import torch

from megatron.errors import CheckpointError
from megatron.initialize import RunContext
from megatron.training.batches import ModelBatches
from megatron.training.step import evaluate

VALIDATION_KEY = "checkpoint_validation_loss"
"""The client-state entry holding the loss on the fixed sequence."""
TOLERANCE = {"fp32": 1e-4}
"""The relative difference a reload may show: fp32 sums in another order (another parallel layout) differ in the
6th-7th digit; 16-bit weights and activations round far more (DEFAULT_16BIT_TOLERANCE)."""
DEFAULT_16BIT_TOLERANCE = 2e-2


def tolerance(precision: Optional[str]) -> float:
    """The relative difference between the saved and the reloaded loss that still passes."""
    return TOLERANCE.get(precision or "fp32", DEFAULT_16BIT_TOLERANCE)


def fixed_sequence_batches(neox_args, ctx: RunContext) -> ModelBatches:
    """Micro-batches of GPT-NeoX's validation input: the tokens 0..seq_length (modulo the vocabulary), one row per
    micro-batch sample; read by model-parallel rank 0 and shared as every batch is."""
    text = (torch.arange(neox_args.seq_length + 1) % ctx.tokenizer.vocab_size).repeat(
        neox_args.train_micro_batch_size_per_gpu, 1)
    reads = ctx.parallel_state.get_model_parallel_rank() == 0
    samples = itertools.repeat({"text": text}) if reads else None
    return ModelBatches(neox_args, ctx, samples, source="checkpoint_validation_with_forward_pass's fixed sequence")


def validation_loss(neox_args, engine, ctx: RunContext) -> float:
    """The model's loss on the fixed sequence (eval mode: no dropout), the same on every rank."""
    return evaluate(neox_args, engine, fixed_sequence_batches(neox_args, ctx), 1)["lm_loss"]


def validation_state(neox_args, engine, ctx: RunContext) -> Dict[str, Any]:
    """What a checkpoint saves for the check: {VALIDATION_KEY: loss}, or {} when the key is off."""
    if not neox_args.checkpoint_validation_with_forward_pass:
        return {}
    return {VALIDATION_KEY: validation_loss(neox_args, engine, ctx)}


def check_loaded_checkpoint(neox_args, engine, ctx: RunContext, path: Optional[str],
                            client_state: Mapping[str, Any], is_logging_rank: bool) -> Optional[float]:
    """After loading checkpoint ``path``: its saved loss computed again. Returns the reloaded loss (None when the key
    is off, nothing was loaded, or the checkpoint saved none, which is said); raises CheckpointError when it differs
    by more than the tolerance of the run's precision."""
    if not neox_args.checkpoint_validation_with_forward_pass or path is None:
        return None
    saved = client_state.get(VALIDATION_KEY)
    if saved is None:
        if is_logging_rank:
            print(f"note: checkpoint_validation_with_forward_pass is set but checkpoint {path} holds no validation "
                  f"loss (it was saved without the key); not checked", flush=True)
        return None
    loaded = validation_loss(neox_args, engine, ctx)
    allowed = tolerance(neox_args.precision)
    difference = abs(loaded - saved) / max(abs(saved), 1e-12)
    if not difference <= allowed:  # also NaN
        raise CheckpointError(
            f"checkpoint {path} does not reproduce its saved loss on checkpoint_validation_with_forward_pass's fixed "
            f"sequence: saved {saved!r}, after loading {loaded!r} (relative difference {difference:.3g}, allowed "
            f"{allowed:g} in {neox_args.precision or 'fp32'}). The files do not hold the model that saved them, or "
            f"this run builds another model from them (compare the precision, attention and fused-kernel settings "
            f"with the checkpoint's neox_args.json); set checkpoint_validation_with_forward_pass: false to load it "
            f"anyway")
    if is_logging_rank:
        how = "exactly" if loaded == saved else f"to a relative {difference:.2g} (allowed {allowed:g})"
        print(f"checkpoint validation: {path} reproduces its saved loss {saved:.6f} on the fixed sequence {how}",
              flush=True)
    return loaded
