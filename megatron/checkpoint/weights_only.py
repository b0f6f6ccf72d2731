"""no_save_optim: checkpoints that keep the weights, the LR schedule and the run's state but no optimizer state.

DeepSpeed's engine always writes its optimizer state: in the model-states file's ``optimizer`` entry without ZeRO,
and in ``zero_pp_rank_*_optim_states.pt`` partitions with ZeRO 1 / 2 and DeepSpeed's bf16 optimizer. Every file it
writes goes through its ``checkpoint_engine`` (the seam async_save uses too), so for the length of one save
``weights_only`` puts a filter in front of it that drops the optimizer: the ``optimizer`` entry is written as None
and the optimizer partitions are not written at all (a checkpoint of this project's 160M model shrinks to a third).

Resuming from such a checkpoint (megatron.checkpoint.engine.load_checkpoint, which reads ``no_save_optim`` from its
neox_args.json) loads the weights, the iteration, the LR schedule and the data position, and starts the optimizer
afresh (Adam's moments at zero; with 16-bit training the fp32 master weights are taken from the saved 16-bit
weights), with a note saying so. ZeRO-3 keeps the weights themselves in the optimizer partitions, so validation
refuses no_save_optim with ZeRO stage 3.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

OPTIMIZER_PARTITION_KEY = "optimizer_state_dict"
"""The entry of DeepSpeed's optimizer partition files (``_save_zero_checkpoint``): a file holding it is not written."""
OPTIMIZER_KEY = "optimizer"
"""The model-states file's (and the non-ZeRO expert optimizer file's) optimizer entry: written as None."""


def without_optimizer(state: Any) -> Any:
    """What a weights-only checkpoint writes of ``state`` (one file's content): None for an optimizer partition (the
    file is skipped), the same dict with ``optimizer`` None for a file that holds the optimizer beside other state,
    else ``state`` itself."""
    if not isinstance(state, dict):
        return state
    if OPTIMIZER_PARTITION_KEY in state:
        return None
    if state.get(OPTIMIZER_KEY) is not None:
        return {**state, OPTIMIZER_KEY: None}
    return state


class WeightsOnlyWriter:
    """DeepSpeed's checkpoint engine ``inner`` (its own, or async_save's BackgroundWriter), with every file's optimizer
    state dropped on its way to ``inner.save``; everything else is ``inner``'s."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def save(self, state_dict: Any, path: str) -> None:
        kept = without_optimizer(state_dict)
        if kept is not None:
            self.inner.save(kept, path)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@contextlib.contextmanager
def weights_only(engine, enabled: bool = True) -> Iterator[None]:
    """During the block, ``engine``'s checkpoint files are written without optimizer state (nothing changes when not
    ``enabled``)."""
    if not enabled:
        yield
        return
    inner = engine.checkpoint_engine
    engine.checkpoint_engine = WeightsOnlyWriter(inner)
    try:
        yield
    finally:
        engine.checkpoint_engine = inner
