"""Loading a trained model for generation and evaluation (generate.py, eval.py).

The model is wrapped by deepspeed.initialize exactly as in training, so every checkpoint layout the
trainer writes (ZeRO stages, tensor and pipeline parallelism) loads the same way; only the weights are
read from the checkpoint."""

from typing import Tuple

from megatron.checkpointing import CheckpointError, load_checkpoint, resolve_checkpoint
from megatron.initialize import RunContext, initialize_megatron


def setup_for_inference(neox_args, require_checkpoint: bool = True) -> Tuple[object, RunContext, int]:
    """(DeepSpeed engine in eval mode, run context, the checkpoint's iteration)."""
    from megatron.training import setup_model_and_optimizer

    ctx = initialize_megatron(neox_args)
    if require_checkpoint and resolve_checkpoint(neox_args) is None:
        raise CheckpointError(f"no checkpoint to load: set load to a directory written by train.py "
                              f"(load={neox_args.load!r}), or iteration to one of its global_stepN")
    engine, _, _ = setup_model_and_optimizer(neox_args, ctx)
    iteration, _ = load_checkpoint(neox_args, engine, weights_only=True)
    engine.eval()
    return engine, ctx, iteration
