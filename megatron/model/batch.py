"""Turn a {'text': int64 [b, s + 1]} sample into GPT-NeoX's model batch, shared inside the TP group.

((tokens, position_ids, attention_mask), (labels, loss_mask)):
  tokens = text[:, :-1], labels = text[:, 1:], position_ids = 0..s-1 per row,
  attention_mask = bool, True where a query may NOT attend: ``causal_only_mask()``, [1, 1, 1, 1] False, when
  attention is plainly causal (the layers hide the future themselves, by position), else [b, 1, s, s],
  loss_mask = 1.0 except, with eod_mask_loss, 0.0 where the input token is the end-of-document token,
  and 0.0 where the label is negative (-100: padding of unpacked samples, or masked by a label dataset).
With a label dataset ('label' [b, s + 1], BatchOptions.labels) labels come from it.
reset_position_ids restarts positions after each end-of-document token; reset_attention_mask keeps tokens
from attending across documents (a per-sample [b, 1, s, s] mask: the strict upper triangle and the other
documents). Packed documents (BatchOptions.documents: inter_document_attention_masking, or reset_attention_mask
with reset_position_ids, megatron.training.batches.packs_documents) keep them apart without an s x s mask: the
attention_mask slot carries where documents start, bool [b, s], True on each row's first token and on each token
after an end-of-document token (an EOD belongs to the document it ends; ``is_document_starts`` tells it from a mask
by its two dimensions; bool, because DeepSpeed's pipeline engine sends the last activation of a GPT2ModelPipe
stage as half and turns it back into bool), positions restart per document, and the attention layers attend within
each document (megatron.model.packed_attention).

Why plain causality has a mask of its own shape: the attention layers decide from the mask's shape alone
(``is_causal_only``, host metadata) that they may take the causal kernels (SDPA's is_causal, flash-attn's causal,
the upper-triangular fused softmax) — deciding it from an s x s mask's values would cost a host sync in every
layer of every forward on a GPU, and the s x s mask itself. It is a tensor and not None because DeepSpeed's
pipeline engine passes only tensors between stages (it sends the shape along, so the next stage sees the same);
it broadcasts like a full mask wherever one is combined with it, and truncate_batch leaves it as it is.
Every value here is computed on the device the sample is on: a sample copied to the GPU (from the DataLoader's
pinned memory, ``to_device``) becomes a batch without a host sync.
truncate_batch cuts a batch to the current length of a sequence-length curriculum.
With context_parallel_size C > 1 each context-parallel rank keeps its load-balanced chunks of tokens, position_ids,
labels and loss_mask (megatron.mpu.context_parallel) and the attention mask is None: ring attention masks by
global positions (megatron.model.ring_attention).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from megatron.mpu import broadcast_data
from megatron.mpu.context_parallel import split_sequence


def causal_attention_mask(seq_length: int, device=None) -> torch.Tensor:
    """[1, 1, s, s] bool, True above the diagonal (future positions are masked)."""
    return torch.ones(seq_length, seq_length, dtype=torch.bool, device=device).triu(1).view(1, 1, seq_length,
                                                                                           seq_length)


def causal_only_mask(device=None) -> torch.Tensor:
    """[1, 1, 1, 1] False: the attention mask of a plainly causal batch (module docstring). It hides nothing beyond
    the future, which every layer hides by position."""
    return torch.zeros(1, 1, 1, 1, dtype=torch.bool, device=device)


def is_causal_only(attention_mask: Optional[torch.Tensor]) -> bool:
    """True when ``attention_mask`` hides nothing beyond the future: None, or a mask whose query and key
    dimensions are 1 x 1 (``causal_only_mask``; a real 1 x 1 mask cannot hide a query's only key either). Read
    from the shape only, so deciding it never waits for the device."""
    return attention_mask is None or (attention_mask.dim() == 4 and attention_mask.shape[-2:] == (1, 1))


def is_document_starts(attention_mask: Optional[torch.Tensor]) -> bool:
    """True when the attention_mask slot carries where packed documents start ([b, s] bool) rather than a
    [.., s, s] mask (see the module docstring). Read from the shape only (host metadata)."""
    return attention_mask is not None and attention_mask.dim() == 2


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device`` without the host waiting for the copy: a host tensor bound for a GPU is copied
    from page-locked memory (the DataLoader's pinned batches as they are, others pinned first), which is what
    makes ``non_blocking`` asynchronous — from pageable memory CUDA copies synchronously. Elsewhere a plain
    ``.to``. A tensor whose elements share memory (an ``expand``ed view: position ids, a broadcast mask) cannot be
    pinned as it is, and is small where it is that: it is copied as it is."""
    if tensor.device.type == "cpu" and torch.device(device).type == "cuda" and not tensor.is_pinned() \
            and tensor.is_contiguous():
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def masks_and_position_ids(tokens: torch.Tensor, eod_token: Optional[int], eod_mask_loss: bool,
                           reset_position_ids: bool = False, reset_attention_mask: bool = False,
                           documents: bool = False) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(attention_mask, loss_mask, position_ids) for left-to-right language modelling; with ``documents`` the
    attention_mask is where the documents start (bool [b, s]) and the positions restart per document."""
    b, s = tokens.shape
    attention_mask = causal_only_mask(tokens.device)
    loss_mask = torch.ones(b, s, dtype=torch.float32, device=tokens.device)
    if (eod_mask_loss or reset_position_ids or reset_attention_mask or documents) and eod_token is None:
        raise ValueError("eod_mask_loss / reset_position_ids / reset_attention_mask / inter_document_attention_masking "
                         "need the tokenizer's eod token id")
    reset_position_ids = reset_position_ids or documents
    reset_attention_mask = reset_attention_mask and not documents
    if eod_mask_loss:
        loss_mask[tokens == eod_token] = 0.0
    index = torch.arange(s, dtype=torch.long, device=tokens.device).unsqueeze(0).expand(b, s)
    position_ids = index
    if reset_position_ids or reset_attention_mask:
        is_eod = (tokens == eod_token).long()
        document = torch.cumsum(is_eod, dim=1) - is_eod  # an EOD belongs to the document it ends
        if reset_position_ids:
            last_eod = torch.cummax(torch.where(is_eod.bool(), index, torch.full_like(index, -1)), dim=1).values
            start = torch.cat([torch.zeros_like(last_eod[:, :1]), last_eod[:, :-1] + 1], dim=1)
            position_ids = index - start
        if documents:
            attention_mask = torch.cat([torch.ones_like(is_eod[:, :1]), is_eod[:, :-1]], dim=1).bool()
        if reset_attention_mask:
            attention_mask = causal_attention_mask(s, tokens.device) | \
                (document[:, None, :, None] != document[:, None, None, :])
    return attention_mask, loss_mask, position_ids


@dataclass(frozen=True)
class BatchOptions:
    """How samples become model batches (GPT-NeoX's eod_mask_loss, reset_position_ids, reset_attention_mask;
    ``labels``: the data carries a label dataset, i.e. train_label_data_paths is set; ``rewards``: a reward per
    sample, [b, 1], which joins the labels tuple: (labels, loss_mask, rewards), for KTO)."""

    labels: bool = False
    rewards: bool = False
    eod_mask_loss: bool = False
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    documents: bool = False  # packed documents attend only to themselves, without an s x s mask


def get_batch(options: BatchOptions, data: Optional[Dict[str, torch.Tensor]], parallel_state,
              eod_token: Optional[int] = None):
    """Model batch from a data sample; ``data`` is read only on model-parallel rank 0."""
    keys = (["text", "label"] if options.labels else ["text"]) + (["reward"] if options.rewards else [])
    sample = broadcast_data(keys, data, torch.int64, parallel_state)
    text = sample["text"]
    tokens = text[:, :-1].clamp(min=0)  # -100 padding is never attended to as a label; any id embeds
    labels = (sample["label"] if "label" in sample else text)[:, 1:].contiguous()
    attention_mask, loss_mask, position_ids = masks_and_position_ids(
        tokens, eod_token, options.eod_mask_loss, options.reset_position_ids, options.reset_attention_mask,
        options.documents)
    negative = labels < 0  # masked and clamped whether or not there are any: asking would sync with the device
    loss_mask = loss_mask.masked_fill(negative, 0.0)
    labels = labels.clamp(min=0)
    if options.rewards:
        return (tokens, position_ids, attention_mask), (labels, loss_mask, sample["reward"].reshape(-1))
    cp_size = parallel_state.get_context_parallel_world_size()
    if cp_size > 1:
        cp_rank = parallel_state.get_context_parallel_rank()
        tokens, position_ids, labels, loss_mask = (split_sequence(t, cp_rank, cp_size)
                                                   for t in (tokens, position_ids, labels, loss_mask))
        attention_mask = None
    return (tokens, position_ids, attention_mask), (labels, loss_mask)


def truncate_batch(batch, seqlen: int):
    """The model batch cut to its first `seqlen` positions (the sequence-length curriculum, megatron.data.curriculum):
    tokens, position_ids, the attention mask's last two dimensions (a causal-only mask stays as it is), labels and
    loss_mask; a batch no longer than `seqlen` is returned as is."""
    (tokens, position_ids, attention_mask), (labels, loss_mask, *rest) = batch
    if seqlen >= tokens.size(1):
        return batch
    cut = lambda t: t[:, :seqlen].contiguous()
    if is_document_starts(attention_mask):
        attention_mask = cut(attention_mask)
    elif not is_causal_only(attention_mask):
        attention_mask = attention_mask[..., :seqlen, :seqlen].contiguous()
    return ((cut(tokens), cut(position_ids), attention_mask), (cut(labels), cut(loss_mask), *rest))
