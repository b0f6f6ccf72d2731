#!/usr/bin/env python
"""Worker entry point for training; launch it through deepy.py:

    python deepy.py train.py configs/quickstart.yml

Exit status: 0 finished, 1 another rank was lost, 2 bad input (config, data, checkpoint, tokenizer), 3 training
diverged (a non-finite loss, fp16 overflow without end), 128 + N stopped by signal N (relaunch to resume).
"""

import sys

import torch

from megatron.errors import EXIT_DIVERGED, CheckpointError, ConfigError, DataError, TokenizerError, TrainingDiverged
from megatron.neox_arguments import NeoXArgs
from megatron.utils.host_memory import reuse_freed_host_memory


def keep_host_memory_for_reuse() -> None:
    """On a CPU run, glibc's malloc keeps freed memory for the next step (megatron.utils.host_memory)."""
    if not torch.cuda.is_available():
        reuse_freed_host_memory()


def main() -> int:
    from megatron.launch.signals import interrupted_exit_code
    from megatron.utils.optional_deps import MissingOptionalDependency

    neox_args = None
    try:
        neox_args = NeoXArgs.consume_neox_args()
        keep_host_memory_for_reuse()
        from megatron.training.loop import pretrain

        summary = pretrain(neox_args)
    except (ConfigError, CheckpointError, DataError, TokenizerError, MissingOptionalDependency) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except TrainingDiverged as err:
        print(f"error: training diverged at {err}", file=sys.stderr, flush=True)
        return EXIT_DIVERGED
    except SystemExit as stop:
        if neox_args is None or neox_args.autotuning_run is None or stop.code not in (None, 0):
            raise
        # DeepSpeed's engine ends an autotuning experiment with exit() on every rank, after writing its metrics
        from megatron.training.autotuning_experiment import finish_experiment

        finish_experiment()
        return 0
    except RuntimeError as err:
        from megatron.initialize import lost_rank_message

        lost = lost_rank_message(err, neox_args) if neox_args is not None else None
        if lost is None:
            raise
        print(f"error: {lost}", file=sys.stderr, flush=True)
        return 1
    if "signal" in summary:  # saved and stopped by a signal: not a finished run (megatron.launch.signals)
        return interrupted_exit_code(summary["signal"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
