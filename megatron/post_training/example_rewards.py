"""Reward functions for trying online REINFORCE (tools/rollout_server.py --reward MODULE:FUNCTION): small, and
obviously learnable, so a tiny model shows the loop working (docs/post-training.md's worked example). A real run
names its own function the same way: ``reward(prompts, completions) -> one number per completion``."""

from typing import List


def letter_e_count(prompts: List[str], completions: List[str]) -> List[float]:
    """How many times the letter 'e' occurs in each completion."""
    return [float(completion.count("e")) for completion in completions]
