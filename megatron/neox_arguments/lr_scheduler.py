"""NeoXArgsLRScheduler: Learning-rate warmup and decay.

Fields, types, defaults and docs follow the GPT-NeoX argument reference."""

from dataclasses import dataclass
from typing import Literal, Optional


@dataclass
class NeoXArgsLRScheduler:
    """Learning-rate warmup and decay."""

    lr_decay_style: Literal['constant', 'linear', 'cosine', 'exponential'] = 'linear'
    """
    Learning rate decay function. Choose from 'constant', 'linear', 'cosine', 'exponential'.
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
    Minimum value for learning rate. The scheduler clips values below this threshold.
    """

    warmup: float = 0.01
    """
    Percentage of total iterations to warmup on (.01 = 1 percent of all training iters).
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
