"""The model's last slots: the final norm and the output head, and the cross entropy over the head's output.

FinalNorm normalises the last layer's output; the output head is either OutputHead, a column-parallel
linear over the (padded) vocabulary, or, with tied weights, the word embedding matrix itself
(``tied_logits``); both give this rank's vocabulary shard of the logits. With use_mup both divide their input by
mup_width_mult x mup_output_temp (mup's MuReadout).

Asked to ``defer`` (the training loss), either head returns ``DeferredLogits`` instead: its input and weight, from
which the loss computes logits and cross entropy a chunk of tokens at a time (megatron.mpu.chunked_cross_entropy),
so that the [tokens, vocab] logits never exist whole. ``token_cross_entropy`` and ``masked_cross_entropy_sum`` take
either form. Under ZeRO stage 3 the heads never defer: the weight is whole only inside the head's own forward.

Checkpoint names are GPT-NeoX's: ``norm.*`` (its NormPipe), ``final_linear.weight`` (its ParallelLinearPipe).
A reward model (train_impl 'rm') ends in ValueHead (``value_head.weight``, one score per position) instead.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from megatron.model.checkpoint_layout import FINAL_NORM, install_hooks
from megatron.model.config import ModelConfig
from megatron.model.embedding import Embedding, readout_mult
from megatron.model.norms import build_norm
from megatron.model.parameter_marks import EMBEDDING_OR_OUTPUT_FLAG
from megatron.model.transformer import sequence_parallel_on
from megatron.mpu import (ColumnParallelLinear, copy_to_model_parallel_region, gather_from_sequence_parallel_region,
                          vocab_parallel_cross_entropy)
from megatron.mpu.chunked_cross_entropy import linear_cross_entropy, weighted_linear_cross_entropy


class DeferredLogits(NamedTuple):
    """The output head's logits, not computed yet: ``F.linear(hidden, weight)`` is this rank's vocabulary shard of
    them. ``hidden`` [..., hidden size] is the head's whole input on this rank (after the tensor-parallel region
    function and the muP readout multiplier), ``weight`` this rank's vocabulary rows.

    A tuple, because DeepSpeed's engine hooks the backward of every tensor in a module's output to start its
    backward (ZeRO's accumulation boundary, its timers): both tensors come out of one identity node
    (``_HeadOutput``), so that hook runs before any gradient reaches a parameter, as it does on logits."""

    hidden: torch.Tensor
    weight: torch.Tensor

    def logits(self) -> torch.Tensor:
        return F.linear(self.hidden, self.weight)


HeadOutput = Union[torch.Tensor, DeferredLogits]


class _HeadOutput(torch.autograd.Function):
    """Identity on (hidden, weight): one node in front of both (see DeferredLogits)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor):
        return hidden.view_as(hidden), weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad_hidden: torch.Tensor, grad_weight: torch.Tensor):
        return grad_hidden, grad_weight


def _head_output(hidden: torch.Tensor, weight: torch.Tensor, defer: bool) -> HeadOutput:
    """The logits, or with ``defer`` DeferredLogits, except for a ZeRO-3 partitioned weight (``ds_id``): that one
    is gathered only while its module's forward runs, and the loss runs after it."""
    if not defer or hasattr(weight, "ds_id"):
        return F.linear(hidden, weight)
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        hidden, weight = _HeadOutput.apply(hidden, weight)
    return DeferredLogits(hidden, weight)


def token_cross_entropy(output: HeadOutput, labels: torch.Tensor, group, keep_dtype: bool = False
                        ) -> torch.Tensor:
    """Per-token cross entropy (``labels``' shape) of the head's output, logits or DeferredLogits; in fp32, or in
    the logits' dtype with ``keep_dtype`` (fp16_lm_cross_entropy; the deferred form returns fp32 either way)."""
    if isinstance(output, DeferredLogits):
        return linear_cross_entropy(output.hidden, output.weight, labels, group, keep_dtype)
    return vocab_parallel_cross_entropy(output, labels, group, keep_dtype=keep_dtype)


def masked_cross_entropy_sum(output: HeadOutput, labels: torch.Tensor, loss_mask: torch.Tensor, group,
                             keep_dtype: bool = False) -> torch.Tensor:
    """sum over tokens of loss_mask x cross entropy (fp32 scalar) of the head's output, logits or DeferredLogits
    (whose gradients are computed chunk by chunk in the forward pass: nothing is recomputed)."""
    mask = loss_mask.reshape(-1).float()
    if isinstance(output, DeferredLogits):
        return weighted_linear_cross_entropy(output.hidden, output.weight, labels, mask, group, keep_dtype)
    losses = vocab_parallel_cross_entropy(output, labels, group, keep_dtype=keep_dtype).float()
    return torch.sum(losses.reshape(-1) * mask)


def tied_logits(embedding: Embedding, hidden: torch.Tensor, defer: bool = False) -> HeadOutput:
    """Output head that reuses the word embedding: this rank's vocabulary shard of the logits (DeferredLogits
    with ``defer``)."""
    if embedding.sequence_parallel:
        hidden = gather_from_sequence_parallel_region(hidden, embedding.group)
    else:
        hidden = copy_to_model_parallel_region(hidden, embedding.group)
    if embedding.readout_mult != 1.0:
        hidden = hidden * embedding.readout_mult
    return _head_output(hidden, embedding.word_embeddings.weight, defer)


def pipeline_tied_logits(embedding: Embedding, hidden: torch.Tensor) -> HeadOutput:
    """The tied head as a pipeline slot: deferred while training (the pipeline engine hands the last stage's
    output only to the loss then), logits otherwise (evaluation, generation)."""
    return tied_logits(embedding, hidden, defer=embedding.training)


class FinalNorm(nn.Module):
    """Final norm: (hidden_states, attention_mask) -> hidden_states."""

    def __init__(self, config: ModelConfig, parallel_state) -> None:
        super().__init__()
        group = parallel_state.get_model_parallel_group() if sequence_parallel_on(config, parallel_state) else None
        self.norm = build_norm(config, config.hidden_size, grad_reduce_group=group)
        install_hooks(self, FINAL_NORM, config, parallel_state)

    def forward(self, args) -> torch.Tensor:
        hidden = args[0] if isinstance(args, tuple) else args
        return self.norm(hidden)


class OutputHead(nn.Module):
    """Untied output head: column-parallel over the vocabulary, no bias, logits left sharded.

    ``forward(hidden, defer)`` returns DeferredLogits with ``defer``; ``defer`` None (a pipeline slot, which gets
    one argument) means ``defer_when_training and self.training`` (see pipeline_tied_logits)."""

    def __init__(self, config: ModelConfig, parallel_state, initializer, defer_when_training: bool = False) -> None:
        super().__init__()
        self.defer_when_training = defer_when_training
        self.final_linear = ColumnParallelLinear(
            config.hidden_size, config.padded_vocab_size, parallel_state,
            initializer.weight(config.num_layers, "final_linear"), bias=False,
            sequence_parallel=sequence_parallel_on(config, parallel_state))
        setattr(self.final_linear.weight, EMBEDDING_OR_OUTPUT_FLAG, True)  # decoupled_lr reads it
        self.readout_mult = readout_mult(config)

    def forward(self, hidden: torch.Tensor, defer: Optional[bool] = None) -> HeadOutput:
        if defer is None:
            defer = self.defer_when_training and self.training
        if self.readout_mult != 1.0:
            hidden = hidden * self.readout_mult
        if not defer:
            return self.final_linear(hidden)
        return _head_output(self.final_linear.local_input(hidden), self.final_linear.weight, defer)


class ValueHead(nn.Module):
    """A reward model's head (train_impl 'rm'): one score per position, [batch, seq, 1]. The final norm's output
    is whole on every tensor-parallel rank, so the head is replicated (as GPT-NeoX's rm head, a linear to one
    output without bias); transformers' *ForSequenceClassification calls it `score`."""

    def __init__(self, config: ModelConfig, parallel_state, initializer) -> None:
        super().__init__()
        if sequence_parallel_on(config, parallel_state):
            raise ValueError("a reward model's value head needs sequence_parallel=False")
        self.value_head = nn.Linear(config.hidden_size, 1, bias=False)
        initializer.weight(config.num_layers, "final_linear")(self.value_head.weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.value_head(hidden)
