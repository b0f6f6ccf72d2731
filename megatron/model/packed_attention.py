"""Packed documents: where each document of a packed sequence starts, and the positions that restart there.

A batch built with BatchOptions.documents (inter_document_attention_masking) carries where its documents start,
bool [b, s], in the attention_mask slot (megatron.model.batch). The attention layers
(megatron.model.attention.ParallelSelfAttention) then attend within each document as if it were run alone:
they read the documents' lengths once per call (``document_lengths``: one host read of as many integers as there
are documents),
rotate q and k at the restarted positions (``restarted_positions``), and attend either through flash-attn's
varlen kernel (all documents in one call, from the cumulative lengths ``cumulative_lengths``; CUDA fp16/bf16
where flash-attn is installed) or document by document through the layer's single-sequence core (SDPA's causal
kernel, or its masked / explicit / fused-softmax paths for windows, local and block-sparse layouts, ALiBi, rpe).
Neither builds an s x s mask: the largest attention tensor is the longest document's, and SDPA's causal kernels
(flash on CPU and GPU) do not hold even that.

Why not FlexAttention: ``create_block_mask`` evaluated eagerly (torch 2.13, CPU) builds the [s, s] mask before
reducing it to blocks, and eager ``flex_attention`` materialises the full score matrix (it says so); only its
compiled form avoids both, and compiling it took 33 s for one 1024-token shape on the 2-core development machine
(per shape; a GPU path through it is left for a machine that can test it).
"""
from __future__ import annotations

from itertools import accumulate
from typing import List

import torch


def document_lengths(starts: torch.Tensor) -> List[int]:
    """The lengths of the documents whose first tokens ``starts`` marks (bool [b, s]), row after row: they sum to
    b x s and none spans two rows (a row's first token starts a document whether it is marked or not). One host
    read."""
    b, s = starts.shape
    starts = starts.clone()
    starts[:, 0] = True
    first = torch.nonzero(starts.reshape(-1)).squeeze(1)
    return torch.diff(first, append=first.new_tensor([b * s])).tolist()


def cumulative_lengths(lengths: List[int], device: torch.device) -> torch.Tensor:
    """int32 [documents + 1]: 0 and the running sums of ``lengths`` (flash-attn's cu_seqlens)."""
    return torch.tensor([0, *accumulate(lengths)], dtype=torch.int32, device=device)


def restarted_positions(lengths: List[int], device: torch.device) -> torch.Tensor:
    """int64 [sum(lengths)]: 0 .. n - 1 for each document of length n, one after another."""
    counts = torch.tensor(lengths, dtype=torch.long, device=device)
    starts = torch.cumsum(counts, dim=0) - counts
    return torch.arange(int(sum(lengths)), device=device) - torch.repeat_interleave(starts, counts)
