"""NeoXArgsLRScheduler: Learning-rate warmup and decay.

Fields, types, defaults and docs follow the GPT-NeoX argument reference."""

from dataclasses import dataclass
from typing import Literal, Optional


@dataclass
class NeoXArgsLRScheduler:
    """Learning-rate warmup and decay."""

    lr_decay_style: Literal['constant', 'linear', 'cosine', 'exponential'] = 'linear'
    """
    Learning rate decay function after warmup. Choose from 'constant', 'linear', 'cosine', 'exponential'.
    With p = (it - W) / (T - W) the fraction of the decay done (it: optimizer steps taken, W: warmup
    iterations, T: lr_decay_iters or train_iters): 'constant' keeps lr; 'linear' is max(lr * (1 - p),
    min_lr), i.e. it decays toward 0 and is clipped at min_lr (so with min_lr > 0 it reaches min_lr before
    the end); 'cosine' is min_lr + (lr - min_lr) * (1 + cos(pi * p)) / 2, from lr to min_lr; 'exponential'
    is max(lr * exp(-0.693 * p), min_lr), about halving lr over the decay. These equal GPT-NeoX's
    AnnealingLR up to the end of the decay. After it (it > T) the rate stays at its value at T; GPT-NeoX
    differs there for two styles: its cosine rises back toward lr and its exponential keeps falling to
    min_lr.
    """

    lr_decay_iters: Optional[int] = None
    """
    Number of iterations to decay learning rate over. If None, defaults to --train-iters or the
    equivalent inferred value from train_epochs.
    """

    lr_decay_fraction: Optional[float] = None
    """
    Effective fraction of training over which to decay lr. Overrides lr_decay_iters. Useful when
    specifying train_epochs.
    """

    min_lr: float = 0.0
    """
    Minimum value for learning rate after warmup (warmup is not clipped). 'linear' and 'exponential' are
    clipped at it, 'cosine' ends at it, 'constant' ignores it. Must be between 0 and lr.
    """

    warmup: float = 0.01
    """
    Fraction of the decay iterations (lr_decay_iters, else train_iters) to warm up over, in [0, 1]
    (.01 = 1 percent): W = warmup * T iterations, possibly fractional. During warmup (it <= W, with it the
    optimizer steps taken) the rate is lr * max(1, it) / W, as GPT-NeoX since its fix #1379: the first
    optimizer step (it = 0) uses lr / W like the second rather than 0. When W < 1 that rate is capped at
    lr (GPT-NeoX's is not). warmup = 0 starts at lr.
    """

    override_lr_scheduler: bool = False
    """
    Reset the values of the scheduler (learning rate,warmup iterations, minimum learning rate, maximum
    number of iterations, and decay style from input arguments and ignore values from checkpoints. Note
    that all the above values will be reset.
    """

    use_checkpoint_lr_scheduler: bool = False
    """
    Use checkpoint to set the values of the scheduler (learning rate, warmup iterations, minimum
    learning rate, maximum number of iterations, and decay style from checkpoint and ignore input
    arguments.
    """
