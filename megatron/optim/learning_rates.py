"""Learning-rate schedule: linear warmup, then constant / linear / cosine / exponential / inverse-sqrt /
warmup-stable-decay; optionally a separate rate for the input and output layers and a weight-decay ramp.

It gives GPT-NeoX's AnnealingLR values (its megatron/learning_rates.py, with its fix #1379 for step 0) from
iteration 0 to the end of the decay, and holds the final value after that. With `it` the number of
optimizer steps taken, `lr` the peak rate, `T` the decay iterations and `W` the warmup iterations
(T and W from megatron.training_schedule.TrainingSchedule: T = int(lr_decay_fraction x train_iters) when
lr_decay_fraction is given, as GPT-NeoX's docs say, else lr_decay_iters, else train_iters, at least 1;
GPT-NeoX's code prefers lr_decay_iters when both are set. W = lr_warmup_iters when set, else warmup x T,
which may be fractional; a schedule built directly with W > T warms up to W and then holds lr):

* warmup, W > 0 and it <= W: lr * max(1, it) / W. Iteration 0 gets lr / W like iteration 1 (GPT-NeoX
  #1379; before it the first step had lr 0); min_lr does not apply here. When 0 < W < 1 this would be
  lr / W > lr at iteration 0; the rate is capped at lr there (GPT-NeoX is not).
  With lr_warmup_init = i set (Megatron-LM's warmup): i + (lr - i) * it / W, so the first step uses i.
* after warmup, W < it <= T, with p = (it - W) / (T - W) in (0, 1]:
    constant:     lr
    linear:       max(lr * (1 - p), min_lr)                  toward 0, clipped at min_lr: with min_lr > 0
                                                             it reaches min_lr at p = 1 - min_lr / lr
    cosine:       min_lr + (lr - min_lr) * (1 + cos(pi p)) / 2   from lr down to min_lr at T
    exponential:  max(lr * exp(-0.693 p), min_lr)            about halves by T (GPT-NeoX's constant 0.693,
                                                             not ln 2)
    inverse_sqrt: max(lr * sqrt(max(W, 1) / max(it, 1)), min_lr)   Megatron-LM's inverse-square-root
    wsd:          lr while it <= T - D (D = lr_wsd_decay_iters), then with r = (it - T + D) / D
                  min_lr + (lr - min_lr) * c(r), c = 1 - r (linear), (1 + cos(pi r)) / 2 (cosine) or
                  2 * 0.5^r - 1 (exponential): Megatron-LM's warmup-stable-decay, reaching min_lr at T
  With W = 0 iteration 0 is p = 0, i.e. lr.
* after the decay, it > T: the value at T, held. GPT-NeoX differs here for two styles: its
  cosine rises again (cos(pi p) for p > 1, a bug) and its exponential keeps falling toward min_lr.
  Constant and linear (already clipped at min_lr) agree with it. (Megatron-LM drops every style but
  constant to min_lr after T; inverse_sqrt and wsd hold their value at T here, which for wsd is min_lr.)

DeepSpeed drives the scheduler, as in GPT-NeoX: pass it as deepspeed.initialize(lr_scheduler=...); it
is built at iteration 0 (or restored from a checkpoint), and the engine calls step() right after each
optimizer step that was applied (not after an fp16 overflow skip). So the optimizer step taken after
k steps uses the rate at it = k, the same alignment as GPT-NeoX's training loop; with W >= 1 the first
two steps both use lr / W. DeepSpeed also saves/loads state_dict() in its checkpoints.

Megatron-LM's sample-based lengths (lr_decay_samples, lr_warmup_samples, lr_wsd_decay_samples, with
train_samples) arrive as T, W and D in full batches (samples / train_batch_size, possibly fractional; see
megatron.training_schedule): every formula above depends on `it` only through ratios with them (and the
max(it, 1) of the first step), so the rate after k full batches equals Megatron-LM's after k x train_batch_size
samples.

With rampup_batch_size the schedule advances by samples (Megatron-LM's rule): `it` is the samples consumed /
the full global batch, so a step of batch b moves it by b / train_batch_size (num_samples, an integer, is
the count; the training loop sets next_batch before each step).

Every optimizer parameter group gets the rate x group["lr_mult"] (default 1). Groups flagged
`decoupled_lr` (the input embedding and output layer weights, when decoupled_lr is set) follow the same
schedule with decoupled_lr as peak and decoupled_min_lr (default min_lr) as minimum, as Megatron-LM's.
With a weight-decay schedule (WeightDecaySchedule: start_weight_decay -> end_weight_decay over train_iters)
each group's weight_decay is set to its value x group["wd_mult"] (default 1 for groups that start with
decay, 0 for the norms and biases, which never decay).

Checkpoints hold start_lr, warmup_iter, end_iter, decay_style, min_lr and num_iters (GPT-NeoX's keys),
and the settings above (EXTRA_CHECKED_KEYS; a checkpoint without them has them off).
On load, num_iters always comes from the checkpoint. For the other values:
override_lr_scheduler keeps this run's values; use_checkpoint_lr_scheduler takes the checkpoint's;
with neither, they must agree or loading fails; setting both is an error."""

import math
from typing import Any, Dict, List, Optional

import torch

from megatron.optim.param_groups import DECOUPLED_GROUP
from megatron.optim.weight_decay import base_weight_decay
from megatron.training_schedule import TrainingSchedule

DECAY_STYLES = ("constant", "linear", "cosine", "exponential", "inverse_sqrt", "wsd")
WSD_DECAY_STYLES = ("exponential", "linear", "cosine")
WD_INCR_STYLES = ("constant", "linear", "cosine")
CHECKED_KEYS = ("start_lr", "warmup_iter", "end_iter", "decay_style", "min_lr")
"""State entries that are configuration (compared on load); num_iters is progress and always restored."""
EXTRA_CHECKED_KEYS: Dict[str, Any] = {"warmup_init": None, "wsd_decay_style": "exponential", "wsd_decay_iters": None,
                                      "decoupled_lr": None, "decoupled_min_lr": None, "start_wd": None,
                                      "end_wd": None, "wd_incr_style": None, "wd_incr_iters": None}
"""Configuration this project adds to GPT-NeoX's state, with the value that means "not used": a checkpoint
without them (GPT-NeoX's, or one saved before they existed) holds these values."""


class WeightDecaySchedule:
    """Weight decay from start_wd to end_wd over `incr_iters` iterations, then end_wd (Megatron-LM's
    weight_decay_incr_style): constant (start_wd = end_wd), linear start + (end - start) * r, or cosine
    start + (end - start) * (1 + cos(pi (1 - r))) / 2, with r = it / incr_iters."""

    def __init__(self, start_wd: float, end_wd: float, style: str, incr_iters: int) -> None:
        if style not in WD_INCR_STYLES:
            raise ValueError(f"weight_decay_incr_style={style!r} is not one of {', '.join(WD_INCR_STYLES)}")
        if start_wd < 0 or end_wd < 0:
            raise ValueError(f"start_weight_decay={start_wd} and end_weight_decay={end_wd} must be >= 0")
        if style == "constant" and start_wd != end_wd:
            raise ValueError(f"weight_decay_incr_style 'constant' needs start_weight_decay={start_wd} equal to "
                             f"end_weight_decay={end_wd}; set weight_decay_incr_style linear or cosine to change it")
        if incr_iters < 1:
            raise ValueError(f"the weight-decay schedule needs at least one iteration, got {incr_iters}")
        self.start_wd, self.end_wd, self.style, self.incr_iters = float(start_wd), float(end_wd), style, int(incr_iters)

    def get(self, iteration: float) -> float:
        if iteration >= self.incr_iters or self.style == "constant":
            return self.end_wd
        ratio = max(iteration, 0) / self.incr_iters
        coeff = ratio if self.style == "linear" else 0.5 * (math.cos(math.pi * (1.0 - ratio)) + 1.0)
        return self.start_wd + coeff * (self.end_wd - self.start_wd)

    def state(self) -> Dict[str, Any]:
        return {"start_wd": self.start_wd, "end_wd": self.end_wd, "wd_incr_style": self.style,
                "wd_incr_iters": self.incr_iters}


class AnnealingLR:
    """Sets the learning rate (and, with a WeightDecaySchedule, the weight decay) of every parameter group of
    `optimizer` from the iteration count."""

    def __init__(self, optimizer: torch.optim.Optimizer, start_lr: float, warmup_iter: float, total_iters: float,
                 decay_style: str, last_iter: int = 0, min_lr: float = 0.0, override_lr_scheduler: bool = False,
                 use_checkpoint_lr_scheduler: bool = False, warmup_init: Optional[float] = None,
                 wsd_decay_style: str = "exponential", wsd_decay_iters: Optional[float] = None,
                 decoupled_lr: Optional[float] = None, decoupled_min_lr: Optional[float] = None,
                 weight_decay: Optional[WeightDecaySchedule] = None,
                 samples_per_iteration: Optional[int] = None) -> None:
        if override_lr_scheduler and use_checkpoint_lr_scheduler:
            raise ValueError("override_lr_scheduler and use_checkpoint_lr_scheduler are both true; the first "
                             "ignores the checkpoint's schedule and the second uses it, so choose one")
        self.optimizer = optimizer
        self.start_lr = float(start_lr)
        self.min_lr = float(min_lr)
        self.warmup_iter = float(warmup_iter)
        self.end_iter = _count(total_iters)
        self.decay_style = decay_style
        self.warmup_init = None if warmup_init is None else float(warmup_init)
        self.wsd_decay_style = wsd_decay_style
        self.wsd_decay_iters = None if wsd_decay_iters is None else _count(wsd_decay_iters)
        self.decoupled_lr = None if decoupled_lr is None else float(decoupled_lr)
        self.decoupled_min_lr = None if decoupled_min_lr is None else float(decoupled_min_lr)
        self.weight_decay = weight_decay
        self._check()
        self.override_lr_scheduler = override_lr_scheduler
        self.use_checkpoint_lr_scheduler = use_checkpoint_lr_scheduler
        self.num_iters: float = int(last_iter)
        self.samples_per_iteration = samples_per_iteration
        """With rampup_batch_size: the full global batch. Progress is then counted in samples (num_samples) and
        num_iters = num_samples / samples_per_iteration; the loop sets next_batch before each step."""
        if samples_per_iteration is not None:
            self.num_samples = int(last_iter) * samples_per_iteration
            self.next_batch = samples_per_iteration
        if weight_decay is not None:  # groups that start without decay (norms, biases) never decay
            for group in optimizer.param_groups:
                group.setdefault("wd_mult", 1.0 if group.get("weight_decay", 0.0) > 0 else 0.0)
        self._apply()

    def _check(self) -> None:
        if self.decay_style not in DECAY_STYLES:
            raise ValueError(f"lr_decay_style={self.decay_style!r} is not one of {', '.join(DECAY_STYLES)}")
        if self.end_iter <= 0:
            raise ValueError(f"the learning-rate schedule needs a decay length > 0 (at least one iteration, or "
                             f"lr_decay_samples >= 1), got {self.end_iter}")
        if self.warmup_iter < 0:
            raise ValueError(f"warmup iterations must be >= 0, got {self.warmup_iter}")
        for peak, floor, names in ((self.start_lr, self.min_lr, "lr and min_lr"),
                                   (self.decoupled_lr, self.decoupled_min_lr, "decoupled_lr and decoupled_min_lr")):
            floor = self.min_lr if floor is None else floor
            if peak is not None and (floor < 0 or peak < 0 or floor > peak):
                raise ValueError(f"{names} ({peak}, {floor}) must be >= 0 with the minimum at most the peak")
        if self.warmup_init is not None and not 0 <= self.warmup_init <= min(self.start_lr, self.decoupled_lr or math.inf):
            raise ValueError(f"lr_warmup_init={self.warmup_init} must be in [0, lr] (and at most decoupled_lr)")
        if self.decay_style == "wsd":
            if self.wsd_decay_style not in WSD_DECAY_STYLES:
                raise ValueError(f"lr_wsd_decay_style={self.wsd_decay_style!r} is not one of "
                                 f"{', '.join(WSD_DECAY_STYLES)}")
            if self.wsd_decay_iters is None or not 0 < self.wsd_decay_iters <= self.end_iter - self.warmup_iter:
                raise ValueError(f"lr_decay_style 'wsd' needs lr_wsd_decay_iters (or _samples) > 0 and at most "
                                 f"the decay iterations after warmup ({self.end_iter:g} - {self.warmup_iter:g}), got "
                                 f"{self.wsd_decay_iters}")

    def get_lr(self, iteration: Optional[float] = None, peak: Optional[float] = None,
               floor: Optional[float] = None) -> float:
        """The learning rate (before lr_mult) at `iteration` (default: the current one) of a group whose peak
        and minimum are `peak` and `floor` (default: lr and min_lr)."""
        it = self.num_iters if iteration is None else iteration
        peak = self.start_lr if peak is None else peak
        floor = self.min_lr if floor is None else floor
        warmup, end = self.warmup_iter, self.end_iter
        it = min(max(it, 0), max(end, warmup))  # after the decay ends the rate stays at its value there
        if warmup > 0 and it <= warmup:
            if self.warmup_init is not None:  # Megatron-LM: from lr_warmup_init at iteration 0
                return self.warmup_init + (peak - self.warmup_init) * it / warmup
            return peak * min(max(it, 1), warmup) / warmup
        if self.decay_style == "constant":
            return peak
        if self.decay_style == "inverse_sqrt":
            return max(peak * math.sqrt(max(warmup, 1.0)) / math.sqrt(max(it, 1.0)), floor)
        if self.decay_style == "wsd":
            return floor + (peak - floor) * self._wsd_coefficient(it)
        progress = (it - warmup) / (end - warmup)  # in [0, 1]: here warmup < it <= end, or it = 0 = warmup
        if self.decay_style == "linear":
            lr = peak * (1.0 - progress)
        elif self.decay_style == "cosine":
            lr = floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
        else:  # exponential, with GPT-NeoX's constant 0.693 (about ln 2)
            lr = peak * math.exp(-0.693 * progress)
        return max(lr, floor)

    def _wsd_coefficient(self, it: float) -> float:
        anneal_start = self.end_iter - self.wsd_decay_iters
        if it <= anneal_start:
            return 1.0
        ratio = (it - anneal_start) / self.wsd_decay_iters
        if self.wsd_decay_style == "linear":
            return 1.0 - ratio
        if self.wsd_decay_style == "cosine":
            return 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return 2.0 * 0.5 ** ratio - 1.0  # exponential, Megatron-LM's: 1 at the start, 0 at the end

    def get_last_lr(self) -> List[float]:
        """The learning rate of each parameter group, as torch's schedulers report it."""
        return [group["lr"] for group in self.optimizer.param_groups]

    def step(self, step_num: Optional[int] = None) -> None:
        """Advance one iteration (or jump to `step_num`) and set the groups' learning rates."""
        if self.samples_per_iteration is None:
            self.num_iters = self.num_iters + 1 if step_num is None else int(step_num)
        else:
            self._set_samples(self.num_samples + self.next_batch if step_num is None
                              else int(step_num) * self.samples_per_iteration)
        self._apply()

    def _set_samples(self, samples: int) -> None:
        self.num_samples = int(samples)
        self.num_iters = self.num_samples / self.samples_per_iteration  # exact from the integer count, never summed

    def _apply(self) -> None:
        lr = self.get_lr()
        decoupled = (self.get_lr(peak=self.decoupled_lr, floor=self.decoupled_min_lr)
                     if self.decoupled_lr is not None else lr)
        wd = None if self.weight_decay is None else self.weight_decay.get(self.num_iters)
        for group in self.optimizer.param_groups:
            group["lr"] = (decoupled if group.get(DECOUPLED_GROUP) else lr) * group.get("lr_mult", 1.0)
            if wd is not None:
                group["weight_decay"] = wd * group.get("wd_mult", 1.0)

    def _settings(self) -> Dict[str, Any]:
        settings = {"start_lr": self.start_lr, "warmup_iter": self.warmup_iter, "end_iter": self.end_iter,
                    "decay_style": self.decay_style, "min_lr": self.min_lr, "warmup_init": self.warmup_init,
                    "wsd_decay_style": self.wsd_decay_style, "wsd_decay_iters": self.wsd_decay_iters,
                    "decoupled_lr": self.decoupled_lr, "decoupled_min_lr": self.decoupled_min_lr}
        wd = self.weight_decay.state() if self.weight_decay is not None else {}
        return {**settings, **{key: wd.get(key) for key in ("start_wd", "end_wd", "wd_incr_style", "wd_incr_iters")}}

    def state_dict(self) -> Dict[str, Any]:
        state = {**self._settings(), "num_iters": self.num_iters}
        if self.samples_per_iteration is not None:
            state["num_samples"] = self.num_samples
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        missing = [key for key in CHECKED_KEYS + ("num_iters",) if key not in state]
        if missing:
            raise ValueError(f"the checkpoint's learning-rate scheduler state lacks {missing}; it has {sorted(state)}")
        theirs = {**EXTRA_CHECKED_KEYS, **state}
        ours = self._settings()
        mismatched = [key for key in ours if not _same(ours[key], theirs[key])]
        if mismatched and not (self.override_lr_scheduler or self.use_checkpoint_lr_scheduler):
            details = ", ".join(f"{key}: config {ours[key]!r} vs checkpoint {theirs[key]!r}" for key in mismatched)
            raise ValueError(f"the learning-rate schedule in the checkpoint differs from the config ({details}); "
                             f"set override_lr_scheduler: true to use the config's values, or "
                             f"use_checkpoint_lr_scheduler: true to use the checkpoint's")
        if self.use_checkpoint_lr_scheduler:
            self.start_lr = float(state["start_lr"])
            self.warmup_iter = float(state["warmup_iter"])
            self.end_iter = _count(state["end_iter"])
            self.decay_style = str(state["decay_style"])
            self.min_lr = float(state["min_lr"])
            self.warmup_init = theirs["warmup_init"]
            self.wsd_decay_style = theirs["wsd_decay_style"]
            self.wsd_decay_iters = theirs["wsd_decay_iters"]
            self.decoupled_lr = theirs["decoupled_lr"]
            self.decoupled_min_lr = theirs["decoupled_min_lr"]
            if theirs["wd_incr_style"] is None:
                self.weight_decay = None
            else:
                self.weight_decay = WeightDecaySchedule(theirs["start_wd"], theirs["end_wd"], theirs["wd_incr_style"],
                                                        theirs["wd_incr_iters"])
                for group in self.optimizer.param_groups:
                    group.setdefault("wd_mult", 1.0 if group.get("weight_decay", 0.0) > 0 else 0.0)
            self._check()
        if self.samples_per_iteration is None:
            if state["num_iters"] != int(state["num_iters"]):
                raise ValueError(f"the checkpoint's learning-rate schedule is {state['num_iters']} iterations in, "
                                 f"counted by samples under rampup_batch_size; keep rampup_batch_size to resume it")
            self.num_iters = int(state["num_iters"])
        else:  # a checkpoint from before the ramp was configured counts whole iterations
            self._set_samples(state.get("num_samples", round(state["num_iters"] * self.samples_per_iteration)))
        self._apply()


def _count(value: float):
    """An iteration count: an int when whole (GPT-NeoX's checkpoints hold ints), else the float (lengths given in
    samples are fractional numbers of full batches)."""
    return int(value) if float(value).is_integer() else float(value)


def _same(ours: Any, theirs: Any) -> bool:
    if isinstance(ours, float) or isinstance(theirs, float):
        try:
            return math.isclose(float(ours), float(theirs), rel_tol=1e-9, abs_tol=1e-15)
        except (TypeError, ValueError):
            return False
    return ours == theirs


def weight_decay_schedule(neox_args: Any, schedule: TrainingSchedule, base: float) -> Optional[WeightDecaySchedule]:
    """The weight-decay schedule the config asks for (start_weight_decay / end_weight_decay default to `base`,
    the optimizer's weight_decay), over train_iters; None when weight decay is left constant at `base`."""
    start, end = neox_args.start_weight_decay, neox_args.end_weight_decay
    if start is None and end is None and neox_args.weight_decay_incr_style == "constant":
        return None
    start = base if start is None else start
    end = base if end is None else end
    return WeightDecaySchedule(start, end, neox_args.weight_decay_incr_style, schedule.length or schedule.train_iters)


def build_lr_scheduler(neox_args: Any, schedule: TrainingSchedule, optimizer: torch.optim.Optimizer) -> AnnealingLR:
    """The AnnealingLR that the config describes: lr, min_lr, lr_decay_style (and its wsd, warmup-init,
    decoupled and weight-decay settings) and the override rules from the config; the decay and warmup
    iterations from the run's TrainingSchedule.

    Call it after build_optimizer and before deepspeed.initialize; it starts at iteration 0 (lr / W with
    warmup, lr_warmup_init when that is set, lr without warmup)."""
    if neox_args.lr is None:
        raise ValueError("no learning rate: set optimizer.params.lr (or lr)")
    return AnnealingLR(optimizer, start_lr=neox_args.lr, warmup_iter=schedule.warmup_iters,
                       total_iters=schedule.decay_iters, decay_style=neox_args.lr_decay_style,
                       min_lr=neox_args.min_lr, override_lr_scheduler=bool(neox_args.override_lr_scheduler),
                       use_checkpoint_lr_scheduler=bool(neox_args.use_checkpoint_lr_scheduler),
                       warmup_init=neox_args.lr_warmup_init, wsd_decay_style=neox_args.lr_wsd_decay_style,
                       wsd_decay_iters=schedule.wsd_decay_iters, decoupled_lr=neox_args.decoupled_lr,
                       decoupled_min_lr=neox_args.decoupled_min_lr,
                       weight_decay=weight_decay_schedule(neox_args, schedule, base_weight_decay(neox_args)),
                       samples_per_iteration=schedule.train_batch_size if schedule.rampup is not None else None)
