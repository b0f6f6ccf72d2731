"""Sequence-length curriculum: GPT-NeoX's `curriculum_learning` with curriculum_type 'seqlen'.

Each training step k (1-based) uses the first `seqlen(k)` tokens of every sample, where seqlen(k) is the difficulty
DeepSpeed's CurriculumScheduler (deepspeed.runtime.data_pipeline.curriculum_scheduler) gives for step k, as
GPT-NeoX asks it (`update_difficulty(iteration + 1)`); tokens, position ids, the attention mask, labels and the
loss mask are cut to it (megatron.model.batch.truncate_batch). DeepSpeed's engine no longer reads a top-level
`curriculum_learning` section (DeepSpeed 0.19 refuses it), so the scheduler is driven here and the section is kept
out of the DeepSpeed config.

The scheduler is stateful (it stops updating once the difficulty reaches max_difficulty), so its state is saved
with each checkpoint; a checkpoint without it (GPT-NeoX's) is resumed by replaying steps 1..iteration, which is
exact too.
"""
from __future__ import annotations

import copy
from typing import Any, Dict, List, Optional

SCHEDULE_KEYS = {
    "fixed_linear": ("total_curriculum_step", "difficulty_step"),
    "fixed_root": ("total_curriculum_step", "difficulty_step", "root_degree"),
    "fixed_discrete": ("difficulty", "max_step"),
}
"""DeepSpeed's schedule types that need no Python callback, with the schedule_config keys each reads."""

STATE_KEY = "curriculum_learning"
"""Where the scheduler's state lives in a checkpoint's client state."""


def enabled(config: Optional[dict]) -> bool:
    return bool(config) and bool(config.get("enabled", False))


def _positive_ints(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, int) and v > 0 for v in value)


def curriculum_problems(config: Optional[dict], seq_length: Optional[int], train_impl: str,
                        sequence_parallel: bool = False, model_parallel_size: int = 1) -> List[str]:
    """What is wrong with an enabled curriculum_learning section (DeepSpeed's asserts, as messages naming the key)."""
    if not enabled(config):
        return []
    where = "curriculum_learning"
    problems = []
    kind = config.get("curriculum_type", "seqlen")
    if kind != "seqlen":
        problems.append(f"{where}.curriculum_type={kind!r}: only 'seqlen' (sequence-length warmup) is built")
    if train_impl != "normal":
        problems.append(f"{where} with train_impl={train_impl!r}: the sequence-length curriculum cuts language-"
                        f"modelling batches only (as GPT-NeoX); use train_impl 'normal' or disable it")
    low, high = config.get("min_difficulty"), config.get("max_difficulty")
    for name, value in (("min_difficulty", low), ("max_difficulty", high)):
        if not isinstance(value, int) or value < 1:
            problems.append(f"{where}.{name}={value!r} must be a positive integer (a sequence length in tokens)")
    if isinstance(low, int) and isinstance(high, int):
        if low > high:
            problems.append(f"{where}.min_difficulty={low} must be <= max_difficulty={high}")
        if seq_length is not None and high > seq_length:
            problems.append(f"{where}.max_difficulty={high} is longer than seq_length={seq_length}; set it to "
                            f"seq_length so that the curriculum ends at full-length samples")
    schedule = config.get("schedule_type")
    if schedule not in SCHEDULE_KEYS:
        extra = " ('custom' needs a Python schedule function, which a config cannot give)" \
            if schedule == "custom" else ""
        problems.append(f"{where}.schedule_type={schedule!r} must be one of {', '.join(SCHEDULE_KEYS)}{extra}")
        return problems
    settings = config.get("schedule_config")
    if not isinstance(settings, dict):
        return problems + [f"{where}.schedule_config must be a dict with {', '.join(SCHEDULE_KEYS[schedule])}"]
    missing = [key for key in SCHEDULE_KEYS[schedule] if key not in settings]
    if missing:
        return problems + [f"{where}.schedule_config lacks {', '.join(missing)} (needed by schedule_type "
                           f"{schedule!r})"]
    if schedule == "fixed_discrete":
        lengths, steps = settings["difficulty"], settings["max_step"]
        if not _positive_ints(lengths) or not _positive_ints(steps) or len(lengths) != len(steps) + 1:
            problems.append(f"{where}.schedule_config: difficulty={lengths!r} and max_step={steps!r} must be lists "
                            f"of positive integers, difficulty one longer than max_step (its last entry holds for "
                            f"all later steps)")
        elif isinstance(high, int) and max(lengths) > high:
            problems.append(f"{where}.schedule_config.difficulty={lengths!r} goes beyond max_difficulty={high}")
        seqlens = lengths if isinstance(lengths, list) else []
    else:
        for key in SCHEDULE_KEYS[schedule]:
            value = settings[key]
            kinds = (int, float) if key == "root_degree" else (int,)
            if not isinstance(value, kinds) or isinstance(value, bool) or value <= 0:
                what = "number" if key == "root_degree" else "integer"
                problems.append(f"{where}.schedule_config.{key}={value!r} must be a positive {what}")
        step = settings["difficulty_step"]
        seqlens = [step, high] if isinstance(step, int) else []
    if sequence_parallel and model_parallel_size > 1:
        odd = [n for n in seqlens if isinstance(n, int) and n % model_parallel_size]
        if odd:
            problems.append(f"{where} with sequence_parallel: every curriculum length must divide over "
                            f"model_parallel_size={model_parallel_size} ranks ({odd} do not); use a difficulty_step "
                            f"/ difficulties that are multiples of it")
    return problems


class SeqlenCurriculum:
    """The sequence length of each training step, from DeepSpeed's CurriculumScheduler."""

    def __init__(self, config: dict) -> None:
        from deepspeed.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler

        self.config = copy.deepcopy(config)
        self.scheduler = CurriculumScheduler(copy.deepcopy(config))

    def seqlen_for_step(self, step: int) -> int:
        """The length of step `step` (1-based, DeepSpeed's global_steps + 1); steps must be asked in order."""
        return int(self.scheduler.update_difficulty(step))

    def state_dict(self) -> Dict[str, Any]:
        return copy.deepcopy(self.scheduler.state)

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.scheduler.state = copy.deepcopy(state)

    def _same_schedule(self, state: Dict[str, Any]) -> bool:
        mine = self.scheduler.state
        return all(state.get(key) == mine.get(key) for key in mine if key != "current_difficulty")

    def resume(self, iteration: int, state: Optional[Dict[str, Any]] = None) -> None:
        """Continue after `iteration` steps: from the checkpoint's state when it holds this schedule, else (a
        GPT-NeoX checkpoint, or a schedule changed since) by replaying steps 1..iteration."""
        if state is not None and self._same_schedule(state):
            self.load_state_dict(state)
            return
        high = self.scheduler.state["max_difficulty"]
        for step in range(1, iteration + 1):
            if self.seqlen_for_step(step) >= high:
                break  # the scheduler no longer changes once it reaches max_difficulty
