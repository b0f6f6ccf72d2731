"""NeoXArgsLRScheduler: Learning-rate warmup and decay.

Fields, types, defaults and docs follow the GPT-NeoX argument reference."""

from dataclasses import dataclass
from typing import Literal, Optional


@dataclass
class NeoXArgsLRScheduler:
    """Learning-rate warmup and decay."""

    lr_decay_style: Literal['constant', 'linear', 'cosine', 'exponential', 'inverse_sqrt', 'wsd'] = 'linear'
    """
    Learning rate decay function after warmup. Choose from 'constant', 'linear', 'cosine', 'exponential',
    'inverse_sqrt', 'wsd'.
    With p = (it - W) / (T - W) the fraction of the decay done (it: optimizer steps taken, W: warmup
    iterations, T: lr_decay_iters or train_iters): 'constant' keeps lr; 'linear' is max(lr * (1 - p),
    min_lr), i.e. it decays toward 0 and is clipped at min_lr (so with min_lr > 0 it reaches min_lr before
    the end); 'cosine' is min_lr + (lr - min_lr) * (1 + cos(pi * p)) / 2, from lr to min_lr; 'exponential'
    is max(lr * exp(-0.693 * p), min_lr), about halving lr over the decay. These equal GPT-NeoX's
    AnnealingLR up to the end of the decay. After it (it > T) the rate stays at its value at T; GPT-NeoX
    differs there for two styles: its cosine rises back toward lr and its exponential keeps falling to
    min_lr. 'inverse_sqrt' (Megatron-LM's 'inverse-square-root') is max(lr * sqrt(max(W, 1) / max(it, 1)),
    min_lr). 'wsd' (Megatron-LM's 'WSD', warmup-stable-decay) holds lr after warmup until the last
    lr_wsd_decay_iters iterations of the decay, then decays to min_lr at T in the style lr_wsd_decay_style.
    """

    lr_wsd_decay_style: Literal['exponential', 'linear', 'cosine'] = 'exponential'
    """
    Decay style of the last phase of lr_decay_style 'wsd' (Megatron-LM's --lr-wsd-decay-style), with
    r = the fraction of the lr_wsd_decay_iters done: the rate is min_lr + (lr - min_lr) * c with
    c = 2 * 0.5^r - 1 ('exponential'), 1 - r ('linear') or (1 + cos(pi * r)) / 2 ('cosine'). Only read
    with lr_decay_style 'wsd'.
    """

    lr_wsd_decay_iters: Optional[int] = None
    """
    Number of iterations of the decay phase of lr_decay_style 'wsd', at the end of the decay iterations
    (lr_decay_iters or train_iters); required with 'wsd', between 1 and the decay iterations after warmup
    (Megatron-LM's --lr-wsd-decay-iters).
    """

    lr_wsd_decay_samples: Optional[int] = None
    """
    Length in samples of the decay phase of lr_decay_style 'wsd' (Megatron-LM's --lr-wsd-decay-samples),
    instead of lr_wsd_decay_iters; needs train_samples. It is lr_wsd_decay_samples / train_batch_size full
    batches, at most the decay length after warmup.
    """

    lr_decay_iters: Optional[int] = None
    """
    Number of iterations to decay learning rate over. If None, defaults to --train-iters or the
    equivalent inferred value from train_epochs.
    """

    lr_decay_samples: Optional[int] = None
    """
    Number of samples to decay the learning rate over (Megatron-LM's --lr-decay-samples), instead of
    lr_decay_iters / lr_decay_fraction; needs train_samples. The decay length is then lr_decay_samples /
    train_batch_size full batches (possibly fractional), so the rate after c samples is Megatron-LM's at c
    (also under rampup_batch_size, where the schedule advances by samples).
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
    lr (GPT-NeoX's is not). warmup = 0 starts at lr. Not read when lr_warmup_iters is set (then leave
    warmup at its default).
    """

    lr_warmup_iters: Optional[int] = None
    """
    Warmup length in iterations (Megatron-LM's --lr-warmup-iters), instead of the fraction `warmup`
    (which must then stay at its default). The warmup rate follows `warmup`'s rule with W = lr_warmup_iters.
    """

    lr_warmup_samples: Optional[int] = None
    """
    Warmup length in samples (Megatron-LM's --lr-warmup-samples), instead of lr_warmup_iters or the fraction
    `warmup` (which must then stay at its default); needs train_samples. W = lr_warmup_samples /
    train_batch_size full batches (possibly fractional), with `warmup`'s rule (or lr_warmup_init's).
    """

    lr_warmup_init: Optional[float] = None
    """
    Rate the warmup starts from (Megatron-LM's --lr-warmup-init), in [0, lr]: with it set the rate during
    warmup is lr_warmup_init + (lr - lr_warmup_init) * it / W, so the first optimizer step uses exactly
    lr_warmup_init (Megatron-LM's rule). Unset keeps GPT-NeoX's warmup, lr * max(1, it) / W, whose first
    step uses lr / W rather than 0.
    """

    decoupled_lr: Optional[float] = None
    """
    Separate peak learning rate for the input embedding and output layer weights (Megatron-LM's
    --decoupled-lr): they get optimizer parameter groups of their own that follow the same schedule
    (warmup, decay style) with decoupled_lr in place of lr. With tied embeddings the shared matrix is one
    such weight. Not with a DeepSpeed `scheduler` dict.
    """

    decoupled_min_lr: Optional[float] = None
    """
    Minimum learning rate of the decoupled_lr groups (Megatron-LM's --decoupled-min-lr), in
    [0, decoupled_lr]; unset uses min_lr. Needs decoupled_lr.
    """

    start_weight_decay: Optional[float] = None
    """
    Weight decay at iteration 0 of a weight-decay schedule (Megatron-LM's --start-weight-decay); unset
    uses weight_decay. The schedule goes from start_weight_decay to end_weight_decay over train_iters in
    the style weight_decay_incr_style and applies to the parameters that decay (not norms and biases).
    Not with a DeepSpeed `scheduler` dict.
    """

    end_weight_decay: Optional[float] = None
    """
    Weight decay at the end of training (train_iters) of a weight-decay schedule (Megatron-LM's
    --end-weight-decay); unset uses weight_decay.
    """

    weight_decay_incr_style: Literal['constant', 'linear', 'cosine'] = 'constant'
    """
    How weight decay goes from start_weight_decay to end_weight_decay over train_iters (Megatron-LM's
    --weight-decay-incr-style), with r = it / train_iters: 'linear' start + (end - start) * r, 'cosine'
    start + (end - start) * (1 + cos(pi * (1 - r))) / 2; 'constant' keeps one value and needs
    start_weight_decay = end_weight_decay.
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
