"""Tensor-parallel causal self-attention.

Fused QKV layout (rows of the query_key_value weight, and its bias) — GPT-NeoX's, so checkpoints hold the
same tensors:
  * multi-head attention (num_kv_heads unset or equal to num_attention_heads): per head, [q | k | v] of
    head_dim each, i.e. the weight viewed as [heads, 3, head_dim, hidden] (also Hugging Face GPTNeoX's);
    each tensor-parallel rank holds consecutive heads.
  * grouped-query / multi-query attention (num_kv_heads = K < heads = H, G = H / K): on each
    tensor-parallel rank, that rank's query heads, then its key heads, then its value heads:
    [H/T * head_dim | K/T * head_dim | K/T * head_dim] rows. The full (TP=1) tensor is [Q | K | V]; ranks hold
    their share of each of the three blocks (``shard_of`` with blocks). Query head ``g * G + j`` uses
    key/value head ``g`` (each rank holds consecutive groups, hence K must be divisible by
    model_parallel_size).

GPT-NeoX's checkpoints also hold ``alibi_embed.slopes`` (this rank's ALiBi slopes) and, with
rotary_save_freqs_buffer, ``rotary_emb.inv_freq``: the layer's slot writes and checks them
(megatron.model.checkpoint_layout); here the slopes and frequencies stay fp32 and out of the module's state. The
rpe table is one
``RelativePositionBias`` shared by every layer (GPT-NeoX's ``rpe``), so each layer's state dict holds it as
``rpe.weight``. Registration order (query_key_value, QK norms, rpe, dense) is GPT-NeoX's, which gives the
optimizer the same parameter order.

Attention is computed with F.scaled_dot_product_attention. A boolean mask is built from absolute
positions (causal; ``sliding_window_width`` w: a query at i sees keys i - w .. i; ``local`` layers: with
sparsity_config ``block`` B (16) and ``num_sliding_window_blocks`` W (3), a query in block i sees the
keys of blocks i - W // 2 .. i, the dense equivalent of DeepSpeed's unidirectional
LocalSlidingWindowSparsityConfig; block-sparse layers sparse_fixed, sparse_variable, bigbird, bslongformer:
their DeepSpeed layout expanded to positions, per head, megatron.model.block_sparse) and
combined with the batch's attention_mask (True = masked, as GPT-NeoX). ALiBi / rpe add a float bias.
A batch mask that hides nothing beyond the future (megatron.model.batch.is_causal_only, known from its shape, so
no layer waits for the device to find out) counts as no mask: plainly causal attention then runs SDPA's is_causal
path, flash-attn's causal one or the upper-triangular fused softmax, and builds no s x s mask.
The scores are q.k / sqrt(head_dim), or with use_mup q.k / (head_dim x mup_attn_temp) (muP's 1/d, which keeps
them of the same size as the heads widen; flash-attn is then not called, SDPA takes the scale).
With attention_softmax_in_fp32 or apply_query_key_layer_scaling in half precision, the scores are
computed explicitly and soft-maxed in fp32 (layer scaling divides by the layer number before the
product and multiplies it back in fp32, which is exact in real arithmetic).

With recompute_granularity 'selective' (Megatron-LM's selective recompute) the attention core (``_core``: the
scores, softmax, dropout and the product with v, whose [batch, heads, seq, seq] activations dominate at long
sequences) runs under DeepSpeed's checkpoint in training: only q, k, v are kept and the core is recomputed
in the backward pass, with the same dropout masks (the model then draws dropout from DeepSpeed's RNG tracker).

Fused kernels (megatron.model.fused): rope_fusion rotates q and k with the Triton rotary kernel (in the
[batch, seq, heads, head_dim] layout it expects, before the heads move to dim 1). With
scaled_upper_triang_masked_softmax_fusion or scaled_masked_softmax_fusion, every layer but "flash" takes
the explicit-scores path and soft-max through the fused kernel (in fp32, returned in the scores' dtype):
the upper-triangular one where the mask is exactly causal with no bias, the masked one otherwise
(window, local blocks, block-sparse layouts, batch masks, ALiBi / rpe biases, KV-cache decoding); a kernel
whose flag is off is its PyTorch reference. The masked kernel fills hidden scores with -10000 (Megatron's
convention), which gives the same probabilities as -inf wherever a query sees at least one key. "flash" layers never use
the fused softmax: they call flash-attn 2 where it is installed and can do the call (CUDA, fp16/bf16;
see megatron.model.flash), and otherwise attend like "global" layers without the fusion flags.
Without either flag attention uses SDPA, the fastest choice on CPU and GPU (on a CPU in bf16 or fp16, SDPA in fp32:
``sdpa``).

A batch of packed documents (the attention_mask slot holding where documents start, [b, s], megatron.model.batch)
attends within each document as if it were run alone, without an s x s mask: ``_documents_context``, after the QK
norm and before the rotation (rotary positions restart per document), megatron.model.packed_attention.

With context_parallel_size > 1 this rank holds two load-balanced chunks of each sequence: rotary rotates q and k
at the chunks' global positions and the core is ring attention (megatron.model.ring_attention), causal by
position (the batch carries no mask then); the layer types, positions and options it does not serve are
refused by megatron.model.config.context_parallel_problems.
"""
from __future__ import annotations

import contextlib
import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from megatron.model.activation_checkpointing import checkpoint_function
from megatron.model.batch import is_causal_only, is_document_starts
from megatron.model.block_sparse import BlockSparseMask, layer_seed
from megatron.model.config import ModelConfig, sparsity_settings
from megatron.model.flash import FlashAttention
from megatron.model.fused import model_fused_ops
from megatron.model.kv_cache import KVCache
from megatron.model.norms import build_norm
from megatron.model.packed_attention import cumulative_lengths, document_lengths, restarted_positions
from megatron.model.positional import RelativePositionBias, RotaryEmbedding, alibi_bias, alibi_slopes
from megatron.model.ring_attention import ring_attention
from megatron.model.sparsity_config import SPARSE_TYPES
from megatron.mpu import ColumnParallelLinear, RowParallelLinear
from megatron.mpu.context_parallel import chunk_positions


HALF_PRECISIONS = (torch.bfloat16, torch.float16)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
    """F.scaled_dot_product_attention, except that on a CPU half-precision q, k, v attend in fp32 (the result in
    their dtype). PyTorch's CPU flash kernel gains nothing from bf16 and its backward is slower than fp32's: forward
    and backward at [8, 4, 128, 32] (the quickstart's) took 2.4x fp32's time in bf16 and 1.2x through fp32, and
    at [1, 8, 2048, 128] no more in fp32 than in bf16 (measured on a 2-core AMD EPYC with avx512_bf16, 2026-11-28).
    The softmax in fp32 is also the more precise one. A float mask (a bias) goes to fp32 with them."""
    if q.device.type != "cpu" or q.dtype not in HALF_PRECISIONS:
        return F.scaled_dot_product_attention(q, k, v, **kwargs)
    mask = kwargs.get("attn_mask")
    if mask is not None and mask.is_floating_point():
        kwargs["attn_mask"] = mask.float()
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), **kwargs).to(q.dtype)


def qkv_blocks(config: ModelConfig):
    """How the fused QKV rows are split over tensor-parallel ranks (``shard_of``'s ``chunks``): consecutive
    heads (1) for multi-head attention, each of the query / key / value blocks for grouped-query attention."""
    if config.kv_heads == config.num_attention_heads:
        return 1
    d = config.head_dim
    return (config.num_attention_heads * d, config.kv_heads * d, config.kv_heads * d)


def build_relative_position_bias(config: ModelConfig, parallel_state, initializer) -> RelativePositionBias:
    """The model's one rpe table (pos_emb rpe), shared by all its layers."""
    return RelativePositionBias(config.rpe_num_buckets, config.rpe_max_distance, config.num_attention_heads,
                                config.head_dim, parallel_state.get_model_parallel_rank(),
                                parallel_state.get_model_parallel_world_size(),
                                initializer.weight(0, "attention.rpe"))


class ParallelSelfAttention(nn.Module):
    """Causal self-attention over this rank's heads: fused QKV (column-parallel), optional QK norm,
    positional encoding, SDPA, output projection (row-parallel). ``forward(x, attention_mask,
    kv_cache)``; ``x`` is [batch, seq, hidden] (sequence-sharded under sequence_parallel)."""

    def __init__(self, config: ModelConfig, parallel_state, initializer, layer_number: int, rng_tracker,
                 rpe: Optional[RelativePositionBias] = None) -> None:
        super().__init__()
        self.layer_number = layer_number
        self.attention_type = config.attention_types[layer_number]
        hidden, heads, kv_heads = config.hidden_size, config.num_attention_heads, config.kv_heads
        tp = parallel_state.get_model_parallel_world_size()
        self.head_dim = config.head_dim
        self.group_size = heads // kv_heads
        self.local_kv_heads = kv_heads // tp
        self.local_heads = self.local_kv_heads * self.group_size
        self.tp_rank = parallel_state.get_model_parallel_rank()
        self.dropout_p = config.attention_dropout
        self.rng_tracker = rng_tracker
        self.ops = model_fused_ops(config)
        self.fused_softmax = config.softmax_fusion and self.attention_type != "flash"
        sp, bias = config.sequence_parallel, config.use_bias_in_attn_linear
        qkv_rows = (heads + 2 * kv_heads) * self.head_dim
        self.query_key_value = ColumnParallelLinear(
            hidden, qkv_rows, parallel_state, initializer.weight(layer_number, "attention.query_key_value"),
            bias=config.qkv_bias, chunks=qkv_blocks(config), sequence_parallel=sp)

        group = parallel_state.get_model_parallel_group() if tp > 1 else None
        self.qk_norm = config.use_qk_layernorm
        if self.qk_norm:
            self.q_norm = build_norm(config, self.head_dim, grad_reduce_group=group)
            self.k_norm = build_norm(config, self.head_dim, grad_reduce_group=group)

        self.pos_emb = config.pos_emb
        if self.pos_emb == "rotary":
            self.rotary_emb = RotaryEmbedding(config.rotary_dim, float(config.rotary_emb_base),
                                              max_positions=config.positions, scaling=config.rope_scaling_dict)
        elif self.pos_emb == "alibi":
            # fp32 outside the module's buffers, like the rotary tables: model.to(bfloat16) would round the
            # slopes (2^-0.5 and its powers with 16 heads), shifting the bias by whole units at long distances
            self._alibi_slopes = alibi_slopes(heads)[self.tp_rank * self.local_heads:
                                                     (self.tp_rank + 1) * self.local_heads]
        elif self.pos_emb == "rpe":
            self.rpe = rpe if rpe is not None else build_relative_position_bias(config, parallel_state, initializer)
        self.dense = RowParallelLinear(
            heads * self.head_dim, hidden, parallel_state,
            initializer.output_weight(layer_number, "attention.dense"), bias=bias, sequence_parallel=sp)

        self.window = config.sliding_window_width
        if self.attention_type == "local":
            self.local_block, self.local_blocks = config.local_attention_block, config.local_attention_window_blocks
        self.block_sparse = BlockSparseMask(
            sparsity_settings(config, self.attention_type), heads, config.seq_length,
            layer_seed(config.seed, layer_number), self.tp_rank * self.local_heads, self.local_heads) \
            if self.attention_type in SPARSE_TYPES else None
        self.blockwise = self.attention_type == "local" or self.block_sparse is not None
        self.layer_scaling = config.apply_query_key_layer_scaling
        self.softmax_fp32 = config.attention_softmax_in_fp32 or self.layer_scaling
        self.force_explicit = False  # tests flip this to compare the explicit path with SDPA
        self.selective_recompute = config.recompute_granularity == "selective"
        # muP scores q.k / (head_dim x mup_attn_temp); None: SDPA's (and flash-attn's) 1 / sqrt(head_dim)
        self.softmax_scale = 1.0 / (self.head_dim * config.mup_attn_temp) if config.use_mup else None
        self.flash = FlashAttention.load(self.head_dim) if self.attention_type == "flash" and \
            self.pos_emb != "rpe" and self.softmax_scale is None else None
        # context parallelism: this rank holds load-balanced chunks of the sequence; attention is a ring
        self.cp_size = parallel_state.get_context_parallel_world_size()
        self.cp_rank = parallel_state.get_context_parallel_rank()
        self.cp_group = parallel_state.get_context_parallel_group() if self.cp_size > 1 else None

    def _mask(self, q_pos: torch.Tensor, k_pos: torch.Tensor, attention_mask: Optional[torch.Tensor]):
        """Boolean [.., q, k] mask, True where attention is *allowed*."""
        allowed = k_pos.unsqueeze(0) <= q_pos.unsqueeze(-1)
        if self.window is not None:
            allowed &= (q_pos.unsqueeze(-1) - k_pos.unsqueeze(0)) <= int(self.window)
        if self.attention_type == "local":
            qb = torch.div(q_pos, self.local_block, rounding_mode="floor").unsqueeze(-1)
            kb = torch.div(k_pos, self.local_block, rounding_mode="floor").unsqueeze(0)
            allowed &= (qb - kb) <= self.local_blocks // 2
        if self.block_sparse is not None:
            allowed = allowed & self.block_sparse.allowed(q_pos, k_pos)
        if attention_mask is not None:
            allowed = allowed & ~attention_mask.to(torch.bool)
        return allowed

    def _only_the_future_hidden(self, attention_mask: Optional[torch.Tensor]) -> bool:
        """No mask, window, block layout or additive bias: nothing but causality restricts a query (host values
        only: the mask was reduced to None when it hides nothing beyond the future, see ``_context``)."""
        return attention_mask is None and self.window is None and not self.blockwise and \
            self.pos_emb not in ("alibi", "rpe")

    def _plain_causal(self, q_len: int, k_len: int, attention_mask: Optional[torch.Tensor]) -> bool:
        """True when the attention is exactly causal over the whole sequence with no additive bias."""
        return q_len == k_len and self._only_the_future_hidden(attention_mask)

    def _single_query_sees_all(self, q_len: int, attention_mask: Optional[torch.Tensor]) -> bool:
        """Decoding one token with no mask, window or bias: it attends to every cached key unmasked."""
        return q_len == 1 and self._only_the_future_hidden(attention_mask)

    def alibi_slopes(self, device: torch.device) -> torch.Tensor:
        """This rank's ALiBi slopes, fp32, on ``device``."""
        if self._alibi_slopes.device != device:
            self._alibi_slopes = self._alibi_slopes.to(device)
        return self._alibi_slopes

    def _bias(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> Optional[torch.Tensor]:
        if self.pos_emb == "alibi":
            return alibi_bias(self.alibi_slopes(q_pos.device), q_pos, k_pos)
        if self.pos_emb == "rpe":
            return self.rpe(q_pos, k_pos)
        return None

    def forward(self, x: torch.Tensor, attention_mask: Optional[torch.Tensor],
                kv_cache: Optional[KVCache] = None, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.dense(self._context(x, attention_mask, kv_cache, positions))

    def forward_with_bias(self, x: torch.Tensor, attention_mask: Optional[torch.Tensor],
                          kv_cache: Optional[KVCache] = None, positions: Optional[torch.Tensor] = None
                          ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(output without the dense bias, that bias), for bias_dropout_fusion to add it in its kernel."""
        return self.dense.forward_without_bias(self._context(x, attention_mask, kv_cache, positions))

    def _context(self, x: torch.Tensor, attention_mask: Optional[torch.Tensor],
                 kv_cache: Optional[KVCache], positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Attention over this rank's heads: [batch, seq, local heads * head_dim], before the dense.
        ``positions`` [batch, seq] (random-LTD's kept tokens, in order): each token's place in the whole sequence,
        where rotary embeddings rotate it; the mask (or causality by index) already says who sees whom."""
        if is_causal_only(attention_mask):  # from its shape: the batch hides only the future (model.batch)
            attention_mask = None
        qkv = self.query_key_value(x)
        b, s = qkv.shape[:2]
        d, g = self.head_dim, self.group_size
        # [batch, seq, heads, head_dim] until after the rotation (the rotary kernel's layout).
        # split (not indexing): its backward is one concatenation instead of a zero-filled copy per slice
        if g == 1:  # per head [q | k | v]
            q, k, v = (t.squeeze(3) for t in qkv.view(b, s, self.local_heads, 3, d).split(1, dim=3))
        else:  # [queries | keys | values] of this rank
            q, k, v = qkv.split([self.local_heads * d, self.local_kv_heads * d, self.local_kv_heads * d], dim=-1)
            q = q.view(b, s, self.local_heads, d)
            k, v = k.view(b, s, self.local_kv_heads, d), v.view(b, s, self.local_kv_heads, d)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if is_document_starts(attention_mask):
            return self._documents_context(q, k, v, attention_mask, kv_cache)
        offset = kv_cache.length if kv_cache is not None else 0
        if self.cp_size > 1 and kv_cache is not None:
            raise ValueError("KV-cache decoding with context_parallel_size > 1 is not supported; build the inference "
                             "model with context_parallel_size 1 (the weights are the same)")
        if self.pos_emb == "rotary" and positions is not None:
            # [b, s] places -> a table row per token, the batch rotated as one long sequence
            cos, sin = self.rotary_emb.tables_at(positions.reshape(-1), self.rotary_emb.max_positions)
            q, k = (self.ops.rotary(t.reshape(1, b * s, *t.shape[2:]), cos, sin).reshape(t.shape) for t in (q, k))
        elif self.pos_emb == "rotary":
            if self.cp_size > 1:  # this rank's chunks sit at their global positions, all below s x cp_size
                cos, sin = self.rotary_emb.tables_at(chunk_positions(s * self.cp_size, self.cp_rank, self.cp_size,
                                                                     x.device), s * self.cp_size)
            else:
                cos, sin = self.rotary_emb.tables(offset, s, x.device)
            q, k = self.ops.rotary(q, cos, sin), self.ops.rotary(k, cos, sin)
        if self.cp_size > 1:
            context = ring_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), self.cp_group,
                                     self.cp_rank, self.cp_size)
            return context.transpose(1, 2).reshape(b, s, self.local_heads * d)
        return self._attend(q, k, v, attention_mask, kv_cache)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_mask: Optional[torch.Tensor],
                kv_cache: Optional[KVCache] = None) -> torch.Tensor:
        """``_core``, under selective recomputation where it applies."""
        if self.selective_recompute and self.training and kv_cache is None and torch.is_grad_enabled():
            # recompute_granularity 'selective': keep only q, k, v for the backward pass; DeepSpeed's checkpoint
            # replays the dropout streams of its RNG tracker, which the model uses in this mode
            return checkpoint_function()(self._core, q, k, v, attention_mask)
        return self._core(q, k, v, attention_mask, kv_cache)

    def _documents_context(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: torch.Tensor,
                           kv_cache: Optional[KVCache]) -> torch.Tensor:
        """Packed documents (megatron.model.packed_attention): each document attends to itself alone, at
        positions restarting from 0, as if it were run alone; no s x s mask. q, k, v [batch, seq, heads,
        head_dim] before the rotation; ``starts`` bool [batch, seq], True where a document starts."""
        if kv_cache is not None or self.cp_size > 1:
            raise ValueError("packed documents (inter_document_attention_masking) are for training and scoring: "
                             "KV-cache decoding and context_parallel_size > 1 take one document per sequence")
        b, s, d = q.size(0), q.size(1), self.head_dim
        lengths = document_lengths(starts)
        q, k, v = (t.reshape(b * s, *t.shape[2:]) for t in (q, k, v))  # documents one after another
        if self.pos_emb == "rotary":
            cos, sin = self.rotary_emb.tables_at(restarted_positions(lengths, q.device), max(lengths))
            q, k = (self.ops.rotary(t.unsqueeze(0), cos, sin).squeeze(0) for t in (q, k))
        if self._flash_applies(q, None) and self.flash.varlen_func is not None:
            slopes = self.alibi_slopes(q.device) if self.pos_emb == "alibi" else None
            with self.rng_tracker.fork():
                context = self.flash.varlen(q, k, v, cumulative_lengths(lengths, q.device), max(lengths),
                                            dropout_p=self.dropout_p if self.training else 0.0, window=self.window,
                                            alibi_slopes=slopes)
            return context.reshape(b, s, self.local_heads * d)
        pieces = [self._attend(qd.unsqueeze(0), kd.unsqueeze(0), vd.unsqueeze(0), None)
                  for qd, kd, vd in zip(q.split(lengths), k.split(lengths), v.split(lengths))]
        return torch.cat(pieces, dim=1).reshape(b, s, self.local_heads * d)

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_mask: Optional[torch.Tensor],
              kv_cache: Optional[KVCache] = None) -> torch.Tensor:
        """The attention core, softmax(q k^T) v with its mask, bias and dropout: [batch, seq, local heads *
        head_dim] from q, k, v in [batch, seq, heads, head_dim] (after the rotation)."""
        b, s, d = q.size(0), q.size(1), self.head_dim
        g = self.group_size
        offset = kv_cache.length if kv_cache is not None else 0
        if self._flash_applies(q, attention_mask):
            return self._flash_context(q, k, v, kv_cache).reshape(b, s, self.local_heads * d)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_number, k, v)
        gqa = g > 1  # SDPA shares each key/value head with its group itself (enable_gqa): no repeated copies
        dropout = self.dropout_p if self.training else 0.0
        explicit = self.fused_softmax or self.force_explicit or (self.softmax_fp32 and q.dtype != torch.float32)
        if not explicit and (self._plain_causal(s, k.size(2), attention_mask) or
                             self._single_query_sees_all(s, attention_mask)):
            # Fast path (flash / memory-efficient kernels where available): causal mask or none, no bias.
            with self._dropout_stream(dropout):
                context = sdpa(q, k, v, dropout_p=dropout, is_causal=s > 1, enable_gqa=gqa,
                               scale=self.softmax_scale)
            return context.transpose(1, 2).reshape(b, s, self.local_heads * d)
        q_pos = torch.arange(offset, offset + s, device=q.device)
        k_pos = torch.arange(k.size(2), device=q.device)
        bias = self._bias(q_pos, k_pos)
        # the fused upper-triangular softmax masks the future by itself: no s x s mask then
        causal = self.fused_softmax and self._plain_causal(s, k.size(2), attention_mask)
        allowed = None if causal else self._mask(q_pos, k_pos, attention_mask)
        with self._dropout_stream(dropout):
            if explicit:
                if gqa:
                    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
                context = self._explicit(q, k, v, allowed, bias, dropout, causal)
            else:
                mask = allowed
                if bias is not None:
                    mask = bias.to(q.dtype).masked_fill(~allowed, float("-inf"))
                context = sdpa(q, k, v, attn_mask=mask, dropout_p=dropout, enable_gqa=gqa, scale=self.softmax_scale)
        return context.transpose(1, 2).reshape(b, s, self.local_heads * d)

    def _flash_applies(self, q: torch.Tensor, attention_mask: Optional[torch.Tensor]) -> bool:
        """flash-attn can do this call: no mask beyond causal (``_context`` made a causal-only mask None)."""
        return self.flash is not None and not self.force_explicit and attention_mask is None and \
            self.flash.supports(q)

    def _flash_context(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       kv_cache: Optional[KVCache]) -> torch.Tensor:
        """[batch, seq, local heads, head_dim] through flash-attn; q/k/v in [batch, seq, heads, head_dim]."""
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_number, k.transpose(1, 2), v.transpose(1, 2))
            k, v = k.transpose(1, 2), v.transpose(1, 2)
        slopes = self.alibi_slopes(q.device) if self.pos_emb == "alibi" else None
        dropout = self.dropout_p if self.training else 0.0
        with self._dropout_stream(dropout):
            return self.flash(q, k, v, dropout_p=dropout, window=self.window, alibi_slopes=slopes)

    def _dropout_stream(self, dropout: float):
        """The RNG stream attention dropout draws from (the tracker's model-parallel stream), entered only when
        there is dropout: at 0 nothing is drawn, and saving and restoring the generator state (a host call that
        torch.compile cannot capture: a graph break in every layer) would be all the fork did."""
        return self.rng_tracker.fork() if dropout > 0 else contextlib.nullcontext()

    def _explicit(self, q, k, v, allowed, bias, dropout, causal: bool):
        coeff = float(self.layer_number + 1) if self.layer_scaling else 1.0
        q = q / (math.sqrt(self.head_dim) * coeff) if self.softmax_scale is None else q * (self.softmax_scale / coeff)
        scores = torch.matmul(q, k.transpose(-1, -2))
        if self.fused_softmax:
            probs = self._fused_softmax(scores, allowed, bias, coeff, causal).to(v.dtype)
        else:
            scores = scores.float() * coeff
            if bias is not None:
                scores = scores + bias
            scores = scores.masked_fill(~allowed, float("-inf"))
            probs = torch.softmax(scores, dim=-1).to(v.dtype)
        if dropout > 0:
            probs = F.dropout(probs, p=dropout)
        return torch.matmul(probs, v)

    def _fused_softmax(self, scores: torch.Tensor, allowed: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                       coeff: float, causal: bool) -> torch.Tensor:
        """softmax(coeff * scores + bias) under ``allowed`` through the fused kernels (fp32 inside).

        Without a bias the kernels scale the raw scores themselves (the fp32 scores never exist in
        memory); an additive bias must be added in fp32 first, so those scores arrive already scaled.
        """
        scale = coeff
        if bias is not None:
            scores, scale = scores.float() * coeff + bias, 1.0
        if causal:
            return self.ops.upper_triang_masked_softmax(scores, scale)
        return self.ops.masked_softmax(scores, ~allowed, scale)
