"""The frozen reference model of DPO and KTO: a second copy of the policy's architecture (the same ModelConfig,
split over the same tensor-parallel ranks), never trained.

Its weights are the policy's when the run starts: those loaded from `load` (e.g. an SFT checkpoint, with
`finetune: true`) or, with nothing to load, the initial ones. Each checkpoint of the run stores them beside the
policy (`dpo_reference_mp_rank_XX.pt`, one per tensor-parallel rank, for KTO too), so a resumed run compares
with the same reference, not with the policy it resumes.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

REFERENCE_FILE = "dpo_reference_mp_rank_{:02d}.pt"


class ReferenceModel:
    """Builds the reference (a GPT2ModelSequential whatever the policy's class) without touching the default
    RNG stream, so the policy trains on the random numbers it would draw without it."""

    def __init__(self, config, parallel_state, fp32: bool = True) -> None:
        from megatron.model.gpt2_model import GPT2ModelSequential, cast_model, model_dtype

        with torch.random.fork_rng():
            model = GPT2ModelSequential(config, parallel_state)
        self.model = cast_model(model, model_dtype(config)).eval().requires_grad_(False)
        self.parallel_state, self.fp32 = parallel_state, fp32

    def to(self, device) -> "ReferenceModel":
        self.model.to(device)
        return self

    def copy_from(self, policy: torch.nn.Module) -> None:
        """Take the policy's current weights (GPT2ModelPipe with one stage, or GPT2ModelSequential)."""
        sequential = policy.to_sequential() if hasattr(policy, "to_sequential") else policy
        self.model.load_state_dict(sequential.state_dict())

    def file(self, checkpoint_dir: str) -> str:
        return os.path.join(checkpoint_dir, REFERENCE_FILE.format(self.parallel_state.get_model_parallel_rank()))

    def save(self, checkpoint_dir: str) -> None:
        """Called on every rank inside a checkpoint save; one data-parallel rank writes each shard."""
        if self.parallel_state.get_data_parallel_rank() == 0:
            torch.save(self.model.state_dict(), self.file(checkpoint_dir))

    def load(self, checkpoint_dir: str) -> bool:
        """Weights saved by `save` in `checkpoint_dir`; False when it holds none (not a DPO checkpoint)."""
        path = self.file(checkpoint_dir)
        if not os.path.isfile(path):
            return False
        self.model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        return True

    @torch.no_grad()
    def logps(self, inputs, labels: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
        """[rows] summed log-probabilities of the labels (see megatron.post_training.dpo.sequence_logps)."""
        from megatron.post_training.dpo import sequence_logps

        logits = self.model(inputs)
        return sequence_logps(logits, labels, loss_mask, self.parallel_state.get_model_parallel_group(), self.fp32)


def start_reference(reference: ReferenceModel, policy: torch.nn.Module, resumed_dir: Optional[str]) -> str:
    """Fill the reference at the start of a run: from the checkpoint a run resumes (`resumed_dir`, None for a
    fresh start or finetune) when it is a DPO checkpoint, else from the policy as loaded. Returns where its
    weights came from, for the log."""
    if resumed_dir and reference.load(resumed_dir):
        return f"the reference weights saved in {resumed_dir}"
    reference.copy_from(policy)
    return "the policy's weights at the start of the run"
