"""The gradient noise scale (log_gradient_noise_scale): McCandlish et al., "An Empirical Model of Large-Batch
Training" (arXiv 1812.06162), the simple noise scale B_simple = tr(Sigma) / |G|^2, estimated as GPT-NeoX does
(its megatron/gradient_noise_scale) and logged as ``noise_scale``.

Sigma is the covariance of one sample's gradient and G the true gradient. A gradient averaged over B samples has
E|G_B|^2 = |G|^2 + tr(Sigma) / B, so two batch sizes give both unknowns (the paper's appendix A.1):

    |G|^2     ~ (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
    tr(Sigma) ~ (|G_small|^2 - |G_big|^2) / (1 / B_small - 1 / B_big)

As in GPT-NeoX, G_small is one training step's gradient (B_small = train_batch_size samples, averaged over the
data-parallel ranks as the engine averages it) and G_big the mean of gradient_noise_scale_n_batches consecutive
steps' gradients (B_big = n x B_small), buffered step by step (on the host with gradient_noise_scale_cpu_offload).
At the end of each window both estimates enter exponential moving averages (beta 0.99), and the logged noise scale
is the ratio of the averages. (GPT-NeoX corrects the averages' bias with the count of steps where the count of
windows is meant; the ratio, the value it logs, is the same either way, and the averages kept here are corrected by
the windows.) A skipped step (fp16 overflow) is left out, as
GPT-NeoX leaves out gradients that are not finite.

Under model parallelism each rank holds a part of the gradient (tensor-parallel shards, its pipeline stage's
parameters, ZeRO's gathered through DeepSpeed): each rank buffers the part it counts
(megatron.observability.training_logger.replica_gradients) and the squared norms are summed over the ranks in
one all-reduce per window, so every rank logs the same value. The optimizer steps are not changed.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import torch

SumOverModel = Callable[[Sequence[float]], List[float]]
"""Adds a few numbers over the ranks that hold one model replica's gradient (the identity on one rank)."""


def simple_noise_terms(small_sq: float, big_sq: float, batch_small: float, batch_big: float) -> Tuple[float, float]:
    """(|G|^2 estimate, tr(Sigma) estimate) from the squared norms of gradients averaged over ``batch_small`` and
    ``batch_big`` samples (McCandlish et al., appendix A.1)."""
    grad_sq = (batch_big * big_sq - batch_small * small_sq) / (batch_big - batch_small)
    trace = (small_sq - big_sq) / (1.0 / batch_small - 1.0 / batch_big)
    return grad_sq, trace


def ema(average: Optional[float], beta: float, value: float, count: int) -> Tuple[float, float]:
    """(the new moving average, its bias-corrected value) after the ``count``-th value (from 0), as GPT-NeoX's."""
    average = (0.0 if average is None else average) * beta + (1.0 - beta) * value
    return average, average / (1.0 - beta ** (count + 1))


class GradientNoiseScale:
    """The running estimate; ``update`` after every optimizer step with that step's gradient (every rank)."""

    def __init__(self, batch_size: int, n_batches: int, sum_over_model: SumOverModel, cpu_offload: bool = False,
                 beta: float = 0.99) -> None:
        if n_batches < 2:
            raise ValueError(f"gradient_noise_scale_n_batches={n_batches} must be >= 2 (the large batch is that "
                             f"many steps' gradients)")
        self.batch_small, self.batch_big = float(batch_size), float(batch_size * n_batches)
        self.n_batches, self.beta, self.cpu_offload = n_batches, beta, cpu_offload
        self.sum_over_model = sum_over_model
        self.buffer: Optional[torch.Tensor] = None
        self.ema_grad_sq: Optional[float] = None
        self.ema_trace: Optional[float] = None
        self.grad_sq: Optional[float] = None
        """The bias-corrected moving average of the |G|^2 estimates."""
        self.trace: Optional[float] = None
        """The bias-corrected moving average of the tr(Sigma) estimates."""
        self.noise_scale: Optional[float] = None
        self.n_updates = 0
        """Steps counted (skipped ones are not)."""
        self.windows = 0

    def flatten(self, gradients: Sequence[torch.Tensor]) -> torch.Tensor:
        """This rank's gradient pieces as one fp32 vector (a copy: the engine frees its gradients after the step)."""
        if not gradients:
            return torch.zeros(0, dtype=torch.float32)
        flat = torch.cat([g.detach().float().reshape(-1) for g in gradients])
        return flat.cpu() if self.cpu_offload else flat

    def update(self, gradient: Optional[torch.Tensor]) -> Optional[float]:
        """Count one step's gradient (``flatten``'s; None for a skipped step, which is left out); returns the noise
        scale once a window of n_batches steps completes, else None."""
        if gradient is None:
            return None
        self.buffer = gradient.clone() if self.buffer is None else self.buffer.add_(gradient)
        completed = None
        if self.n_updates % self.n_batches == self.n_batches - 1:
            big = self.buffer / self.n_batches
            self.buffer = None
            small_sq, big_sq = self.sum_over_model([float(gradient.double().pow(2).sum()),
                                                    float(big.double().pow(2).sum())])
            grad_sq, trace = simple_noise_terms(small_sq, big_sq, self.batch_small, self.batch_big)
            self.ema_grad_sq, self.grad_sq = ema(self.ema_grad_sq, self.beta, grad_sq, self.windows)
            self.ema_trace, self.trace = ema(self.ema_trace, self.beta, trace, self.windows)
            self.windows += 1
            self.noise_scale = completed = self.trace / self.grad_sq
        self.n_updates += 1
        return completed
