"""Learning-rate schedule: linear warmup, then constant / linear / cosine / exponential decay.

The schedule, with `it` the number of optimizer steps taken, `W` the warmup iterations and `T` the decay
iterations (GPT-NeoX: T = lr_decay_iters, else train_iters; W = warmup x T, which may be fractional):

* warmup, it <= W (and W > 0): lr * it / W (from 0, as GPT-NeoX; min_lr does not apply here)
* after warmup, with progress p = (it - W) / (T - W) clamped to [0, 1] (p = 1 when T <= W):
    constant:     lr
    linear:       min_lr + (lr - min_lr) * (1 - p)
    cosine:       min_lr + (lr - min_lr) * (1 + cos(pi p)) / 2
    exponential:  lr * 0.5 ** p    (halves over the decay, as GPT-NeoX's exp(-0.693 p))
  and never below min_lr. After T iterations the rate stays where the decay ended.

Linear decays to min_lr (GPT-NeoX decays to 0 and clips at min_lr; the two agree when min_lr = 0).

Every optimizer parameter group gets lr x group["lr_mult"] (default 1).

Checkpoints hold start_lr, warmup_iter, end_iter, decay_style, min_lr and num_iters (GPT-NeoX's keys).
On load, num_iters always comes from the checkpoint. For the other values:
override_lr_scheduler keeps this run's values; use_checkpoint_lr_scheduler takes the checkpoint's;
with neither, they must agree or loading fails; setting both is an error.

DeepSpeed drives the scheduler: pass it as deepspeed.initialize(lr_scheduler=...) and the engine calls
step() after every optimizer step and saves/loads state_dict() in its checkpoints."""

import math
from typing import Any, Dict, List, Optional

import torch

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

    def get_lr(self, iteration: Optional[int] = None) -> float:
        """The base learning rate (before lr_mult) at `iteration` (default: the current one)."""
        it = self.num_iters if iteration is None else iteration
        if self.warmup_iter > 0 and it <= self.warmup_iter:
            return self.start_lr * it / self.warmup_iter
        if self.decay_style == "constant":
            return self.start_lr
        span = self.end_iter - self.warmup_iter
        progress = 1.0 if span <= 0 else min(max((it - self.warmup_iter) / span, 0.0), 1.0)
        if self.decay_style == "linear":
            lr = self.min_lr + (self.start_lr - self.min_lr) * (1.0 - progress)
        elif self.decay_style == "cosine":
            lr = self.min_lr + (self.start_lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
        else:  # exponential
            lr = self.start_lr * 0.5 ** progress
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


def decay_iterations(neox_args: Any) -> int:
    """T: lr_decay_iters (NeoXArgs derives it from lr_decay_fraction x train_iters), else train_iters."""
    if getattr(neox_args, "lr_decay_iters", None) is not None:
        return max(1, int(neox_args.lr_decay_iters))
    train_iters = getattr(neox_args, "train_iters", None)
    if train_iters is None:
        raise ValueError("the learning-rate schedule needs train_iters or lr_decay_iters (with train_epochs, "
                         "the training loop must set train_iters from the dataset size first)")
    fraction = getattr(neox_args, "lr_decay_fraction", None)
    if fraction is not None:
        return max(1, int(fraction * train_iters))
    return max(1, int(train_iters))


def build_lr_scheduler(neox_args: Any, optimizer: torch.optim.Optimizer) -> AnnealingLR:
    """The AnnealingLR that GPT-NeoX's config describes (lr, min_lr, warmup, lr_decay_style, ...).

    Call it after build_optimizer and before deepspeed.initialize; iteration 0 sets lr to the warmup start."""
    if neox_args.lr is None:
        raise ValueError("no learning rate: set optimizer.params.lr (or lr)")
    total = decay_iterations(neox_args)
    warmup = float(getattr(neox_args, "warmup", 0.0) or 0.0)
    if not 0.0 <= warmup <= 1.0:
        raise ValueError(f"warmup={warmup} must be a fraction of the decay iterations in [0, 1]")
    return AnnealingLR(optimizer, start_lr=neox_args.lr, warmup_iter=warmup * total, total_iters=total,
                       decay_style=neox_args.lr_decay_style, min_lr=neox_args.min_lr,
                       override_lr_scheduler=bool(neox_args.override_lr_scheduler),
                       use_checkpoint_lr_scheduler=bool(neox_args.use_checkpoint_lr_scheduler))
