"""Routers: which experts each token goes to, with which weight, and the load-balancing loss.

Both routers score a token with one bias-free linear layer (GPT-NeoX's ``router.layer``, [experts, hidden],
replicated on every rank) and pick ``moe_top_k`` different experts:

* ``topk``: probabilities p = softmax(logits) (in fp32); the k most probable experts; combine weights p for
  k = 1, and the k probabilities renormalised to sum to 1 for k >= 2. This is DeepSpeed's gate (top-1 / top-2 /
  top-k gating) and Mixtral's router, so the two layer types and the Hugging Face export compute the same function.
* ``sinkhorn`` (GPT-NeoX's current default): while training, the experts are chosen on the Sinkhorn-balanced
  logits (no gradient) and weighted by sigmoid(logit) (k = 1) or softmax(logits) (k >= 2) at the chosen experts,
  not renormalised; in eval it is top-k of those same scores (Sinkhorn needs the whole batch, decoding has one
  token). As GPT-NeoX's SinkhornRouter.

moe_jitter_eps multiplies the router's input by noise drawn uniformly from [1 - eps, 1 + eps] while training
(the default generator: identical on the tensor-parallel ranks, so they route alike).

The load-balancing loss (Switch Transformer / DeepSpeed / MegaBlocks form) is E * sum_e f_e * P_e, with f_e the
fraction of this rank's (token, choice) pairs sent to expert e (before any capacity drop) and P_e the mean router
probability of e; it is 1 for a perfectly uniform router and grows with imbalance. moe_lbl_in_fp32 computes it in
fp32, otherwise in the model's dtype.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from megatron.model.config import ModelConfig

SINKHORN_ITERATIONS = 3
SINKHORN_TOLERANCE = 1e-4


@dataclass
class Routing:
    """The routing of T tokens to k experts each."""

    weights: torch.Tensor
    """[T, k] fp32 combine weights."""
    experts: torch.Tensor
    """[T, k] int64 expert ids (k different experts per token)."""
    probs: torch.Tensor
    """[T, E] fp32 router probabilities (softmax of the logits)."""


def sinkhorn(cost: torch.Tensor, iterations: int = SINKHORN_ITERATIONS, tol: float = SINKHORN_TOLERANCE) -> torch.Tensor:
    """A few Sinkhorn-Knopp iterations on exp(cost) [T, E] (GPT-NeoX's / Megatron's balanced assignment):
    rows and columns are rescaled towards equal sums, so the top-k on the result spreads tokens over experts.

    GPT-NeoX stops after the first iteration whose change is below ``tol``. Asking that on the host would wait for
    the device in every MoE layer, so every iteration runs and the ones after that stop leave the scalings as they
    were (``torch.where`` on a flag kept on the device): the same values, bit for bit."""
    cost = torch.exp(cost)
    d0 = torch.ones(cost.size(0), device=cost.device, dtype=cost.dtype)
    d1 = 1 / (cost.size(1) * torch.sum(cost, 0))
    eps = 1e-8
    stopped = torch.zeros((), dtype=torch.bool, device=cost.device)
    for _ in range(iterations):
        d0_new = (1 / d0.size(0)) / (torch.sum(d1 * cost, 1) + eps)
        d1_new = (1 / d1.size(0)) / (torch.sum(d0_new.unsqueeze(1) * cost, 0) + eps)
        error = torch.mean(torch.abs(d1_new - d1))
        d0, d1 = torch.where(stopped, d0, d0_new), torch.where(stopped, d1, d1_new)
        stopped = stopped | (error < tol)
    return d1 * cost * d0.unsqueeze(1)


def expert_counts(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E] int64: how many entries of ``experts`` name each expert. torch.bincount gives the same, but on CUDA it
    first reads the largest entry back to the host (a sync); adding ones into E counters does not."""
    flat = experts.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def load_balancing_loss(probs: torch.Tensor, experts: torch.Tensor, num_experts: int, dtype: torch.dtype
                        ) -> torch.Tensor:
    """E * sum_e f_e * P_e (module docstring) over the tokens of ``probs`` [T, E] and ``experts`` [T, k]."""
    counts = expert_counts(experts, num_experts).to(dtype)
    fraction = counts / max(experts.numel(), 1)
    mean_prob = probs.to(dtype).mean(dim=0)
    return num_experts * torch.sum(fraction * mean_prob)


class Router(nn.Module):
    """``layer`` scores the tokens; forward returns the Routing and the load-balancing loss."""

    def __init__(self, config: ModelConfig, initializer, layer_number: int) -> None:
        super().__init__()
        self.num_experts, self.top_k = config.moe_num_experts, config.moe_top_k
        self.kind = config.moe_router_type
        self.jitter_eps = config.moe_jitter_eps
        self.lbl_in_fp32 = config.moe_lbl_in_fp32
        self.layer = nn.Linear(config.hidden_size, self.num_experts, bias=False)
        with torch.no_grad():
            full = torch.empty(self.num_experts, config.hidden_size)
            initializer.weight(layer_number, "mlp.router.layer")(full)
            self.layer.weight.copy_(full)

    def forward(self, tokens: torch.Tensor):
        """tokens [T, hidden] -> (Routing, load-balancing loss (a scalar, with gradient to the router))."""
        if self.training and self.jitter_eps is not None:
            noise = torch.empty_like(tokens).uniform_(1.0 - self.jitter_eps, 1.0 + self.jitter_eps)
            tokens = tokens * noise
        logits = F.linear(tokens, self.layer.weight)  # [T, E]
        probs = torch.softmax(logits.float(), dim=-1)
        if self.kind == "sinkhorn":
            weights, experts = self._sinkhorn_choice(logits.float(), probs)
        else:
            weights, experts = torch.topk(probs, self.top_k, dim=-1)
            if self.top_k > 1:
                weights = weights / weights.sum(dim=-1, keepdim=True).clamp(min=torch.finfo(weights.dtype).eps)
        lbl_dtype = torch.float32 if self.lbl_in_fp32 else logits.dtype
        aux = load_balancing_loss(probs, experts, self.num_experts, lbl_dtype)
        return Routing(weights=weights, experts=experts, probs=probs), aux

    def _sinkhorn_choice(self, logits: torch.Tensor, probs: torch.Tensor):
        scores = torch.sigmoid(logits) if self.top_k == 1 else probs
        if not self.training:
            return torch.topk(scores, self.top_k, dim=-1)
        with torch.no_grad():
            _, experts = torch.topk(sinkhorn(logits), self.top_k, dim=-1)
        return torch.gather(scores, 1, experts), experts
