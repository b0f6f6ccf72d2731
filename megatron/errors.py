"""The project's exception types, at the ground floor: every package raises these, and a caller (train.py, the tools)
catches them from one place. Each names the file, key or flag that is wrong and what to do about it.

* ConfigError: every problem found in a config, collected and raised together, so a user fixes them all in one round
  instead of one per launch; NeoXConfigWarning for what is accepted, as GPT-NeoX accepts it, but does not do what it
  seems to.
* CheckpointError: a checkpoint that cannot be loaded into this run.
* DataError: a data file or data option that is missing, corrupt or inconsistent.
* TokenizerError: a tokenizer that cannot be built from the given arguments.
* TrainingDiverged: a non-finite loss, or fp16 overflow that never ends (train.py exits EXIT_DIVERGED, 3).
* ConversionError: a checkpoint or configuration that cannot be converted (the command-line tools print it and exit 2).

May import: nothing of megatron."""

from typing import Iterable, List


class ConfigError(ValueError):
    """One or more problems with the user's configuration; str() lists them all."""

    def __init__(self, problems: Iterable[str]):
        self.problems: List[str] = list(problems)
        super().__init__(self._render())

    def _render(self) -> str:
        if len(self.problems) == 1:
            return f"Invalid NeoX configuration: {self.problems[0]}"
        lines = [f"Invalid NeoX configuration ({len(self.problems)} problems):"]
        lines += [f"  - {p}" for p in self.problems]
        return "\n".join(lines)


class NeoXConfigWarning(UserWarning):
    """Something in a config that is accepted, as GPT-NeoX accepts it, but does not do what it seems to
    (a fusion flag with nothing to fuse, a hostfile that does not exist); raised once, when the config loads."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded into this run; the message says which and why."""


class DataError(ValueError):
    """A data file or data option is missing, corrupt or inconsistent; the message names it and the fix."""


class TokenizerError(ValueError):
    """A tokenizer cannot be built from the given arguments (bad type, missing or unreadable file)."""


class TrainingDiverged(FloatingPointError):
    """Training cannot make progress numerically (a non-finite loss, the fp16 loss scale overflowing step after
    step): train.py prints the message, without a traceback, and exits with EXIT_DIVERGED."""


EXIT_DIVERGED = 3  # train.py's (and so deepy.py's) exit status for TrainingDiverged: 0 done, 1 lost rank, 2 bad input


class ConversionError(ValueError):
    """A checkpoint or configuration that cannot be converted; the message names the file or option and
    what to do about it."""
