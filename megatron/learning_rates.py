"""Learning-rate schedule: linear warmup, then constant / linear / cosine / exponential decay.

It gives GPT-NeoX's AnnealingLR values (its megatron/learning_rates.py, with its fix #1379 for step 0) from
iteration 0 to the end of the decay, and holds the final value after that. With `it` the number of
optimizer steps taken, `lr` the peak rate, `T` the decay iterations and `W` the warmup iterations
(T and W from megatron.training_schedule.TrainingSchedule: T = int(lr_decay_fraction x train_iters) when
lr_decay_fraction is given, as GPT-NeoX's docs say, else lr_decay_iters, else train_iters, at least 1;
GPT-NeoX's code prefers lr_decay_iters when both are set. W = warmup x T, which may be fractional; a
schedule built directly with W > T warms up to W and then holds lr):

* warmup, W > 0 and it <= W: lr * max(1, it) / W. Iteration 0 gets lr / W like iteration 1 (GPT-NeoX
  #1379; before it the first step had lr 0); min_lr does not apply here. When 0 < W < 1 this would be
  lr / W > lr at iteration 0; the rate is capped at lr there (GPT-NeoX is not).
* after warmup, W < it <= T, with p = (it - W) / (T - W) in (0, 1]:
    constant:     lr
    linear:       max(lr * (1 - p), min_lr)                  toward 0, clipped at min_lr: with min_lr > 0
                                                             it reaches min_lr at p = 1 - min_lr / lr
    cosine:       min_lr + (lr - min_lr) * (1 + cos(pi p)) / 2   from lr down to min_lr at T
    exponential:  max(lr * exp(-0.693 p), min_lr)            about halves by T (GPT-NeoX's constant 0.693,
                                                             not ln 2)
  With W = 0 iteration 0 is p = 0, i.e. lr.
* after the decay, it > T: the value at T, held. GPT-NeoX differs here for two styles: its
  cosine rises again (cos(pi p) for p > 1, a bug) and its exponential keeps falling toward min_lr.
  Constant and linear (already clipped at min_lr) agree with it.

DeepSpeed drives the scheduler, as in GPT-NeoX: pass it as deepspeed.initialize(lr_scheduler=...); it
is built at iteration 0 (or restored from a checkpoint), and the engine calls step() right after each
optimizer step that was applied (not after an fp16 overflow skip). So the optimizer step taken after
k steps uses the rate at it = k, the same alignment as GPT-NeoX's training loop; with W >= 1 the first
two steps both use lr / W. DeepSpeed also saves/loads state_dict() in its checkpoints.

Every optimizer parameter group gets the rate x group["lr_mult"] (default 1).

Checkpoints hold start_lr, warmup_iter, end_iter, decay_style, min_lr and num_iters (GPT-NeoX's keys).
On load, num_iters always comes from the checkpoint. For the other values:
override_lr_scheduler keeps this run's values; use_checkpoint_lr_scheduler takes the checkpoint's;
with neither, they must agree or loading fails; setting both is an error."""

import math
from typing import Any, Dict, List, Optional

import torch

from megatron.training_schedule import TrainingSchedule

DECAY_STYLES = ("constant", "linear", "cosine", "exponential")
CHECKED_KEYS = ("start_lr", "warmup_iter", "end_iter", "decay_style", "min_lr")
"""State entries that are configuration (compared on load); num_iters is progress and always restored."""


class AnnealingLR:
    """Sets the learning rate of every parameter group of `optimizer` from the iteration count."""

    def __init__(self, optimizer: torch.optim.Optimizer, start_lr: float, warmup_iter: float, total_iters: int,
                 decay_style: str, last_iter: int = 0, min_lr: float = 0.0, override_lr_scheduler: bool = False,
                 use_checkpoint_lr_scheduler: bool = False) -> None:
        if override_lr_scheduler and use_checkpoint_lr_scheduler:
            raise ValueError("override_lr_scheduler and use_checkpoint_lr_scheduler are both true; the first "
                             "ignores the checkpoint's schedule and the second uses it, so choose one")
        if decay_style not in DECAY_STYLES:
            raise ValueError(f"lr_decay_style={decay_style!r} is not one of {', '.join(DECAY_STYLES)}")
        if total_iters < 1:
            raise ValueError(f"the learning-rate schedule needs at least one decay iteration, got {total_iters}")
        if warmup_iter < 0:
            raise ValueError(f"warmup iterations must be >= 0, got {warmup_iter}")
        if min_lr < 0 or start_lr < 0:
            raise ValueError(f"lr={start_lr} and min_lr={min_lr} must be >= 0")
        if min_lr > start_lr:
            raise ValueError(f"min_lr={min_lr} is larger than lr={start_lr}")
        self.optimizer = optimizer
        self.start_lr = float(start_lr)
        self.min_lr = float(min_lr)
        self.warmup_iter = float(warmup_iter)
        self.end_iter = int(total_iters)
        self.decay_style = decay_style
        self.override_lr_scheduler = override_lr_scheduler
        self.use_checkpoint_lr_scheduler = use_checkpoint_lr_scheduler
        self.num_iters = int(last_iter)
        self._apply()

    def get_lr(self, iteration: Optional[float] = None) -> float:
        """The base learning rate (before lr_mult) at `iteration` (default: the current one)."""
        it = self.num_iters if iteration is None else iteration
        warmup, end = self.warmup_iter, self.end_iter
        it = min(max(it, 0), max(end, warmup))  # after the decay ends the rate stays at its value there
        if warmup > 0 and it <= warmup:
            return self.start_lr * min(max(it, 1), warmup) / warmup
        if self.decay_style == "constant":
            return self.start_lr
        progress = (it - warmup) / (end - warmup)  # in [0, 1]: here warmup < it <= end, or it = 0 = warmup
        if self.decay_style == "linear":
            lr = self.start_lr * (1.0 - progress)
        elif self.decay_style == "cosine":
            lr = self.min_lr + (self.start_lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
        else:  # exponential, with GPT-NeoX's constant 0.693 (about ln 2)
            lr = self.start_lr * math.exp(-0.693 * progress)
        return max(lr, self.min_lr)

    def get_last_lr(self) -> List[float]:
        """The learning rate of each parameter group, as torch's schedulers report it."""
        return [group["lr"] for group in self.optimizer.param_groups]

    def step(self, step_num: Optional[int] = None) -> None:
        """Advance one iteration (or jump to `step_num`) and set the groups' learning rates."""
        self.num_iters = self.num_iters + 1 if step_num is None else int(step_num)
        self._apply()

    def _apply(self) -> None:
        lr = self.get_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)

    def state_dict(self) -> Dict[str, Any]:
        return {"start_lr": self.start_lr, "warmup_iter": self.warmup_iter, "end_iter": self.end_iter,
                "decay_style": self.decay_style, "min_lr": self.min_lr, "num_iters": self.num_iters}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        missing = [key for key in CHECKED_KEYS + ("num_iters",) if key not in state]
        if missing:
            raise ValueError(f"the checkpoint's learning-rate scheduler state lacks {missing}; it has {sorted(state)}")
        mismatched = [key for key in CHECKED_KEYS if not _same(getattr(self, key), state[key])]
        if mismatched and not (self.override_lr_scheduler or self.use_checkpoint_lr_scheduler):
            details = ", ".join(f"{key}: config {getattr(self, key)!r} vs checkpoint {state[key]!r}"
                                for key in mismatched)
            raise ValueError(f"the learning-rate schedule in the checkpoint differs from the config ({details}); "
                             f"set override_lr_scheduler: true to use the config's values, or "
                             f"use_checkpoint_lr_scheduler: true to use the checkpoint's")
        if self.use_checkpoint_lr_scheduler:
            self.start_lr = float(state["start_lr"])
            self.warmup_iter = float(state["warmup_iter"])
            self.end_iter = int(state["end_iter"])
            self.decay_style = str(state["decay_style"])
            self.min_lr = float(state["min_lr"])
        self.num_iters = int(state["num_iters"])
        self._apply()


def _same(ours: Any, theirs: Any) -> bool:
    if isinstance(ours, float) or isinstance(theirs, float):
        try:
            return math.isclose(float(ours), float(theirs), rel_tol=1e-9, abs_tol=1e-15)
        except (TypeError, ValueError):
            return False
    return ours == theirs


def build_lr_scheduler(neox_args: Any, schedule: TrainingSchedule, optimizer: torch.optim.Optimizer) -> AnnealingLR:
    """The AnnealingLR that GPT-NeoX's config describes: lr, min_lr, lr_decay_style and the override rules from
    the config; the decay and warmup iterations from the run's TrainingSchedule.

    Call it after build_optimizer and before deepspeed.initialize; it starts at iteration 0 (lr / W with
    warmup, lr without)."""
    if neox_args.lr is None:
        raise ValueError("no learning rate: set optimizer.params.lr (or lr)")
    return AnnealingLR(optimizer, start_lr=neox_args.lr, warmup_iter=schedule.warmup_iters,
                       total_iters=schedule.decay_iters, decay_style=neox_args.lr_decay_style,
                       min_lr=neox_args.min_lr, override_lr_scheduler=bool(neox_args.override_lr_scheduler),
                       use_checkpoint_lr_scheduler=bool(neox_args.use_checkpoint_lr_scheduler))
