"""The model's last slots: the final norm and the output head.

FinalNorm normalises the last layer's output; the output head is either OutputHead, a column-parallel
linear over the (padded) vocabulary, or, with tied weights, the word embedding matrix itself
(``tied_logits``); both give this rank's vocabulary shard of the logits. With use_mup both divide their input by
mup_width_mult x mup_output_temp (mup's MuReadout).

Checkpoint names are GPT-NeoX's: ``norm.*`` (its NormPipe), ``final_linear.weight`` (its ParallelLinearPipe).
A reward model (train_impl 'rm') ends in ValueHead (``value_head.weight``, one score per position) instead.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron.model.checkpoint_layout import FINAL_NORM, install_hooks
from megatron.model.embedding import Embedding, readout_mult
from megatron.model.norms import build_norm
from megatron.model.transformer import sequence_parallel_on
from megatron.model_config import ModelConfig
from megatron.mpu import ColumnParallelLinear, copy_to_model_parallel_region, gather_from_sequence_parallel_region
from megatron.optimizers import EMBEDDING_OR_OUTPUT_FLAG


def tied_logits(embedding: Embedding, hidden: torch.Tensor) -> torch.Tensor:
    """Output head that reuses the word embedding: this rank's vocabulary shard of the logits."""
    if embedding.sequence_parallel:
        hidden = gather_from_sequence_parallel_region(hidden, embedding.group)
    else:
        hidden = copy_to_model_parallel_region(hidden, embedding.group)
    if embedding.readout_mult != 1.0:
        hidden = hidden * embedding.readout_mult
    return F.linear(hidden, embedding.word_embeddings.weight)


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
    """Untied output head: column-parallel over the vocabulary, no bias, logits left sharded."""

    def __init__(self, config: ModelConfig, parallel_state, initializer) -> None:
        super().__init__()
        self.final_linear = ColumnParallelLinear(
            config.hidden_size, config.padded_vocab_size, parallel_state,
            initializer.weight(config.num_layers, "final_linear"), bias=False,
            sequence_parallel=sequence_parallel_on(config, parallel_state))
        setattr(self.final_linear.weight, EMBEDDING_OR_OUTPUT_FLAG, True)  # decoupled_lr reads it
        self.readout_mult = readout_mult(config)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.final_linear(hidden if self.readout_mult == 1.0 else hidden * self.readout_mult)


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
