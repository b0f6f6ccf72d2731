"""The one exception type for configuration problems.

Every problem found in a config is collected first and raised together, so a user fixes them all in one
round instead of one per launch."""

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
