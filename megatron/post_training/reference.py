"""The frozen reference model of DPO and KTO: a second copy of the policy's architecture (the same ModelConfig,
split over the same tensor-parallel ranks), never trained.

Under pipeline parallelism (pipe_parallel_size >= 2) only the last stage holds it, whole (every layer): the
reference log-probabilities join the labels, which only the last stage reads, so the reference runs there beside
the policy's last stage. Filling it from the policy gathers the stages' weights there once, at the start. That
costs the last stage one more copy of the whole model's weights (no gradients, no optimizer state); where that
does not fit, precompute the reference log-probabilities instead (text_gen_type 'precompute').

Under ZeRO stage 3 the policy's parameters are partitioned over the data-parallel ranks; filling the reference
gathers them whole once (every rank takes part), and each rank keeps its own whole reference (ZeRO partitions
what trains; the reference has no gradients or optimizer state).

Its weights are the policy's when the run starts: those loaded from `load` (e.g. an SFT checkpoint, with
`finetune: true`) or, with nothing to load, the initial ones. Each checkpoint of the run stores them beside the
policy (`dpo_reference_mp_rank_XX.pt`, one per tensor-parallel rank, for KTO too), so a resumed run compares
with the same reference, not with the policy it resumes.

Under LoRA (the `lora` section) the reference is the policy's own model with its adapters switched off
(AdapterFreeReference): the frozen base, which is where the adapters start. No second copy of the weights is built
or saved: the base is the checkpoint each adapter checkpoint points at (`lora_base`, verified on resume).
"""

from __future__ import annotations

import contextlib
import os
from typing import Dict, Optional

import deepspeed
import torch

from megatron.checkpoint.files import load_checkpoint_file
from megatron.checkpoint.format import REFERENCE_FILE
from megatron.model.gpt2_model import GPT2ModelPipe, GPT2ModelSequential, cast_model, model_dtype
from megatron.model.lora import adapters_disabled
from megatron.mpu.host_collectives import broadcast_object, gather_object
from megatron.post_training.dpo import sequence_logps


class ReferenceModel:
    """Builds the reference (a GPT2ModelSequential whatever the policy's class) without touching the default
    RNG stream, so the policy trains on the random numbers it would draw without it. Off the last pipeline stage
    ``model`` is None (``holds`` False): those ranks only take part in ``copy_from`` and ``load``."""

    def __init__(self, config, parallel_state, fp32: bool = True) -> None:
        self.parallel_state, self.fp32 = parallel_state, fp32
        self.defer_logits = True  # start_reference sets what the policy's loss does
        self.model = None
        if parallel_state.is_last_pipe_stage():
            with torch.random.fork_rng():
                model = GPT2ModelSequential(config, parallel_state)
            self.model = cast_model(model, model_dtype(config)).eval().requires_grad_(False)

    @property
    def holds(self) -> bool:
        """Whether this rank computes reference log-probabilities (the last pipeline stage)."""
        return self.model is not None

    def to(self, device) -> "ReferenceModel":
        if self.model is not None:
            self.model.to(device)
        return self

    def copy_from(self, policy: torch.nn.Module) -> None:
        """Take the policy's current weights (GPT2ModelSequential, or GPT2ModelPipe: with several stages every
        stage of the pipeline group must call this, as it gathers their weights on the last stage)."""
        if getattr(policy, "num_stages", 1) > 1:
            state = gather_pipeline_state(policy, self.parallel_state)
        else:
            sequential = policy.to_sequential() if hasattr(policy, "to_sequential") else policy
            with gathered_zero3_parameters(sequential):
                state = {name: value.detach().clone() for name, value in sequential.state_dict().items()}
        if self.model is not None:
            self.model.load_state_dict(state)

    def file(self, checkpoint_dir: str) -> str:
        return os.path.join(checkpoint_dir, REFERENCE_FILE.format(self.parallel_state.get_model_parallel_rank()))

    def save(self, checkpoint_dir: str) -> None:
        """Called on every rank inside a checkpoint save; one data-parallel rank of the last pipeline stage writes
        each tensor-parallel shard (whole: the file does not depend on pipe_parallel_size)."""
        if self.model is not None and self.parallel_state.get_data_parallel_rank() == 0:
            torch.save(self.model.state_dict(), self.file(checkpoint_dir))

    def load(self, checkpoint_dir: str) -> bool:
        """Weights saved by `save` in `checkpoint_dir`; False when it holds none (not a DPO checkpoint). Under
        pipeline parallelism the last stage looks and tells the other stages (every stage must call this)."""
        found = False
        if self.model is not None:
            path = self.file(checkpoint_dir)
            found = os.path.isfile(path)
            if found:
                self.model.load_state_dict(load_checkpoint_file(path))  # a planted object: one error naming it
        if self.parallel_state.get_pipe_parallel_world_size() > 1:
            found = bool(broadcast_object(found, src=self.parallel_state.group_ranks("pipe")[-1],
                                          group=self.parallel_state.get_pipe_parallel_group()))
        return found

    @torch.no_grad()
    def logps(self, inputs, labels: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
        """[rows] summed log-probabilities of the labels (see megatron.post_training.dpo.sequence_logps); on the
        last pipeline stage only (``holds``)."""
        if self.model is None:
            raise RuntimeError("the reference model is held by the last pipeline stage only")
        logits = self.model(inputs, defer_logits=self.defer_logits)
        return sequence_logps(logits, labels, loss_mask, self.parallel_state.get_model_parallel_group(), self.fp32)


class AdapterFreeReference:
    """DPO / KTO's reference under LoRA: the policy (its GPT2ModelSequential, or the one-stage GPT2ModelPipe's
    layers as one) with its adapters detached, in eval mode, without gradients. What the batches and the saves use
    of ReferenceModel (``holds``, ``logps``, ``save``); ``save`` writes nothing (the base is the adapter
    checkpoints' lora_base)."""

    holds = True

    def __init__(self, policy: torch.nn.Module, parallel_state, fp32: bool = True) -> None:
        if getattr(policy, "num_stages", 1) > 1:
            raise ValueError("LoRA's reference runs the policy's whole model on one stage (pipe_parallel_size <= 1)")
        self.model = policy.to_sequential() if hasattr(policy, "to_sequential") else policy
        self.parallel_state, self.fp32 = parallel_state, fp32
        self.defer_logits = not any(hasattr(p, "ds_id") for p in policy.parameters())  # as start_reference sets

    def save(self, checkpoint_dir: str) -> None:
        """Nothing: the reference is the base checkpoint, which the adapter checkpoint names."""

    @torch.no_grad()
    def logps(self, inputs, labels: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
        """ReferenceModel.logps of the base: the policy's layers without their adapters (and without dropout)."""
        modes = {module: module.training for module in self.model.modules()}
        self.model.eval()
        try:
            with adapters_disabled(self.model):
                logits = self.model(inputs, defer_logits=self.defer_logits)
                return sequence_logps(logits, labels, loss_mask, self.parallel_state.get_model_parallel_group(),
                                      self.fp32)
        finally:
            for module, training in modes.items():
                module.training = training


def gathered_zero3_parameters(model: torch.nn.Module):
    """A context in which a model whose parameters ZeRO stage 3 partitions holds them whole (every data-parallel
    rank must enter it: it all-gathers them); a no-op context for any other model."""
    partitioned = [p for p in model.parameters() if hasattr(p, "ds_id")]
    if not partitioned:
        return contextlib.nullcontext()

    return deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None)


def gather_pipeline_state(policy: torch.nn.Module, parallel_state) -> Optional[Dict[str, torch.Tensor]]:
    """The state dict of a GPT2ModelPipe's whole model under GPT2ModelSequential's names, on the last stage of
    its pipeline group (None on the others; every stage must call it). The tied word embedding, present on the
    first and the last stage, is taken from the first stage (the one the pipeline trains)."""
    mine = {GPT2ModelPipe.sequential_name(name): value.detach().cpu() for name, value in policy.state_dict().items()}
    ranks = parallel_state.group_ranks("pipe")
    stages = gather_object(mine, dst=ranks[-1], group=parallel_state.get_pipe_parallel_group())
    if stages is None:
        return None
    merged: Dict[str, torch.Tensor] = {}
    for stage in stages:  # in stage order: the first stage's copy of a tied weight wins
        for name, value in stage.items():
            merged.setdefault(name, value)
    return merged


def start_reference(reference: ReferenceModel, policy: torch.nn.Module, resumed_dir: Optional[str]) -> str:
    """Fill the reference at the start of a run: from the checkpoint a run resumes (`resumed_dir`, None for a
    fresh start or finetune) when it is a DPO checkpoint, else from the policy as loaded. Every rank calls it (the
    stages of a pipeline exchange weights). Returns where its weights came from, for the log.

    The reference computes its log-probabilities as the policy's loss computes the policy's: from the head's
    DeferredLogits in chunks of tokens (megatron.model.head), or from whole logits where the policy's weights are
    ZeRO-3 partitioned (its head never defers then). Equal weights then give equal log-probabilities to the last
    bit (DPO's margin is exactly 0 at the start), and the reference's logits are never whole either."""
    reference.defer_logits = not any(hasattr(p, "ds_id") for p in policy.parameters())
    if resumed_dir and reference.load(resumed_dir):
        return f"the reference weights saved in {resumed_dir}"
    reference.copy_from(policy)
    return "the policy's weights at the start of the run"
