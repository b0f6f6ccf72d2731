"""The input embedding, the model's first slot.

Embedding: vocabulary-parallel word embedding, plus learned (``opt_pos_emb_offset`` added to the
position ids) or sinusoidal position embeddings, an optional soft prompt, then hidden dropout; under
sequence parallelism its output is this rank's chunk of the sequence. With use_mup the output is multiplied by
mup_embedding_mult and the position embeddings by mup_rp_embedding_mult (megatron.mup). (The final norm and the
output head, tied to this embedding or not, are megatron.model.head.)

Checkpoint names are GPT-NeoX's: ``word_embeddings.weight``, ``position_embeddings.weight`` (learned).
With sinusoidal positions GPT-NeoX keeps
its inverse frequencies as a buffer, ``position_embeddings.inv_freq``, which the slot writes and checks
(megatron.model.checkpoint_layout). The soft prompt (``soft_prompt.weight``) has no GPT-NeoX counterpart that loads.
"""
from __future__ import annotations

import contextlib
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from megatron.model.checkpoint_layout import EMBEDDING, install_hooks
from megatron.model.config import ModelConfig
from megatron.model.parameter_marks import EMBEDDING_OR_OUTPUT_FLAG
from megatron.model.positional import sinusoidal_embedding
from megatron.model.transformer import sequence_parallel_on
from megatron.mpu import VocabParallelEmbedding, scatter_to_sequence_parallel_region
from megatron.mpu.host_collectives import all_reduce

EMBEDDING_LAYER_INDEX = -1


class SoftPrompt(nn.Module):
    """``num_tokens`` learned vectors that replace the first positions' embeddings (prompt tuning): uniform in
    [-init_range, init_range], or ``rows`` (the word embeddings of init_string's tokens) repeated or cut to
    ``num_tokens``, as GPT-NeoX's SoftEmbedding starts them."""

    def __init__(self, num_tokens: int, init_range: float, hidden: int, seed: int,
                 rows: Optional[torch.Tensor] = None) -> None:
        super().__init__()
        self.num_tokens = num_tokens
        if rows is not None:
            repeats = -(-num_tokens // rows.shape[0])
            weight = rows.detach().to(torch.float32).repeat(repeats, 1)[:num_tokens].clone()
        else:
            weight = torch.empty(self.num_tokens, hidden)
            torch.nn.init.uniform_(weight, -init_range, init_range, generator=torch.Generator().manual_seed(seed))
        self.weight = nn.Parameter(weight)

    def forward(self, embeddings: torch.Tensor) -> torch.Tensor:
        b, s = embeddings.shape[:2]
        prompt = self.weight.to(embeddings.dtype).unsqueeze(0).expand(b, -1, -1)
        return torch.cat((prompt, embeddings), dim=1)[:, :s]


class Embedding(nn.Module):
    """(tokens, position_ids, attention_mask) -> (hidden_states, attention_mask)."""

    def __init__(self, config: ModelConfig, parallel_state, initializer, rng_tracker) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.rng_tracker = rng_tracker
        self.group = parallel_state.get_model_parallel_group()
        self.sequence_parallel = sequence_parallel_on(config, parallel_state)
        self.word_embeddings = VocabParallelEmbedding(
            config.padded_vocab_size, hidden, parallel_state,
            initializer.weight(EMBEDDING_LAYER_INDEX, "word_embeddings"))
        # decoupled_lr gives this weight its own learning rate (megatron.optim.param_groups.get_param_groups)
        setattr(self.word_embeddings.weight, EMBEDDING_OR_OUTPUT_FLAG, True)
        self.pos_emb = config.pos_emb
        self.hidden = hidden
        if self.pos_emb == "learned":
            # GPT-NeoX's table: max_position_embeddings rows, looked up at position + opt_pos_emb_offset
            self.position_offset = config.opt_pos_emb_offset
            weight = torch.empty(config.positions, hidden)
            initializer.weight(EMBEDDING_LAYER_INDEX, "position_embeddings")(weight)
            # _weight skips nn.Embedding's own init, which would draw from (and advance) the global RNG.
            self.position_embeddings = nn.Embedding(config.positions, hidden, _weight=weight)
        self.dropout = config.hidden_dropout
        # muP (megatron.mup): the embedding's and the position embeddings' multipliers, and the readout's (the tied
        # head divides its input by the width multiplier and the output temperature, mup's MuReadout)
        self.embedding_mult = config.mup_embedding_mult if config.use_mup else 1.0
        self.position_mult = config.mup_rp_embedding_mult if config.use_mup else 1.0
        self.readout_mult = readout_mult(config)
        self.soft_prompt = None
        if config.soft_prompt_tokens is not None:
            rows = None
            if config.soft_prompt_init_tokens:
                rows = word_embedding_rows(self.word_embeddings, config.soft_prompt_init_tokens, self.group)
            self.soft_prompt = SoftPrompt(config.soft_prompt_tokens, config.soft_prompt_init_range, hidden,
                                          initializer.seed, rows)
        install_hooks(self, EMBEDDING, config, parallel_state)

    @property
    def word_embeddings_weight(self) -> torch.Tensor:
        return self.word_embeddings.weight

    def forward(self, args: Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]):
        tokens, position_ids, attention_mask = args
        hidden = self.word_embeddings(tokens)
        if self.pos_emb == "learned":
            hidden = hidden + self._scaled(self.position_embeddings(position_ids + self.position_offset),
                                           self.position_mult)
        elif self.pos_emb == "sinusoidal":
            hidden = hidden + self._scaled(sinusoidal_embedding(position_ids, self.hidden).to(hidden.dtype),
                                           self.position_mult)
        if self.soft_prompt is not None:
            hidden = self.soft_prompt(hidden)
        if self.sequence_parallel:
            hidden = scatter_to_sequence_parallel_region(hidden, self.group)
        if self.training and self.dropout > 0:
            ctx = self.rng_tracker.fork() if self.sequence_parallel else contextlib.nullcontext()
            with ctx:
                hidden = F.dropout(hidden, p=self.dropout)
        return self._scaled(hidden, self.embedding_mult), attention_mask

    @staticmethod
    def _scaled(x: torch.Tensor, mult: float) -> torch.Tensor:
        return x if mult == 1.0 else x * mult


def word_embedding_rows(embedding: VocabParallelEmbedding, tokens: Tuple[int, ...], group) -> torch.Tensor:
    """[len(tokens), hidden] the rows of ``tokens`` in a vocabulary-parallel embedding, whole on every rank: each
    rank takes the rows it holds and the tensor-parallel ranks sum them (through host_collectives, since the model
    is still on the host while it is built)."""
    ids = torch.tensor(tokens, dtype=torch.long)
    outside = (ids < embedding.vocab_start) | (ids >= embedding.vocab_end)
    with torch.no_grad():
        rows = embedding.weight[(ids - embedding.vocab_start).masked_fill(outside, 0)].float()
        rows = rows.masked_fill(outside.unsqueeze(-1), 0.0)
    if embedding.world > 1:
        rows = all_reduce(rows, group=group)
    return rows


def readout_mult(config: ModelConfig) -> float:
    """What the output head multiplies its input by: 1, or with use_mup 1 / (mup_width_mult x mup_output_temp)."""
    return 1.0 / (config.mup_width_mult * config.mup_output_temp) if config.use_mup else 1.0
