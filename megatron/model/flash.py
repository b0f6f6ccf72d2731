"""flash-attn 2 for 'flash' attention layers, when the package is installed.

flash-attn only runs on CUDA in fp16/bf16 with head_dim <= 256, and takes no arbitrary mask or bias. A
'flash' layer therefore calls ``flash_attn_func`` when the package imports and the call is one it can do
(CUDA half-precision tensors; no batch mask other than plain causal; no rpe bias): causal attention with
the bottom-right alignment that incremental decoding needs (query i of s sees keys up to i + k_len - s),
grouped-query attention without repeating keys, ``sliding_window_width`` as ``window_size=(w, 0)`` and
ALiBi as ``alibi_slopes`` (flash-attn's bias -slope * |i + k_len - s - j| equals our -slope * (q_pos -
k_pos) on every visible key). Packed documents (inter_document_attention_masking) go through
``flash_attn_varlen_func``, all documents of the batch in one call from their cumulative lengths, where the installed
flash-attn has it. Every other call (CPU, fp32, dense masks from reset_attention_mask alone, rpe) uses PyTorch SDPA, which computes the same attention. Where flash-attn does
not import on a CUDA machine, every 'flash' layer uses SDPA: FlashAttnUnavailableWarning says so once, and
``flash_attention_backend()`` names what runs (benchmarks label their runs with it). flash-attn soft-maxes in
fp32 internally, so attention_softmax_in_fp32 and apply_query_key_layer_scaling hold on this path too.

(use_flashattn_swiglu does not need the package: it selects the project's Triton SwiGLU kernel, which
computes flash-attn's ``swiglu(x, y) = silu(x) * y``; see megatron.fused_kernels.)
"""
from __future__ import annotations

import warnings
from typing import Callable, Optional, Tuple

import torch


HALF_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256


class FlashAttnUnavailableWarning(UserWarning):
    """'flash' attention layers were built on a CUDA machine where flash-attn does not import: they run PyTorch
    SDPA. Issued by FlashAttention.load at the layer's construction line, so Python shows it once per process."""


def _import_flash_attn() -> Tuple[Optional[Callable], str]:
    """(flash_attn_func, 'flash-attn <version>'), or (None, why flash-attn cannot be used)."""
    try:
        import flash_attn
        from flash_attn import flash_attn_func
    except ModuleNotFoundError as err:
        return None, f"flash-attn is not installed ({err})"
    except ImportError as err:  # installed but broken (e.g. built for another CUDA / torch)
        return None, f"flash-attn is installed but does not import ({err})"
    return flash_attn_func, f"flash-attn {getattr(flash_attn, '__version__', '(version unknown)')}"


def flash_attention_backend() -> str:
    """What a 'flash' layer runs for the CUDA fp16/bf16 calls flash-attn can do: 'flash-attn <version>', or
    'PyTorch SDPA (flash-attn ...)' saying why not. Benchmarks label their runs with it."""
    func, about = _import_flash_attn()
    return about if func is not None else f"PyTorch SDPA ({about.split(' (')[0]})"


class FlashAttention:
    """flash_attn_func for the calls it can do; ``supports`` tells the layer which those are."""

    def __init__(self, flash_attn_func: Callable, head_dim: int, varlen_func: Optional[Callable] = None) -> None:
        self.flash_attn_func = flash_attn_func
        self.varlen_func = varlen_func
        self.head_dim = head_dim

    @classmethod
    def load(cls, head_dim: int) -> Optional["FlashAttention"]:
        """The backend, or None when flash-attn does not import (the layer then uses SDPA; on a CUDA machine
        FlashAttnUnavailableWarning says so, once: it is issued from the caller's line)."""
        func, about = _import_flash_attn()
        if func is None:
            if torch.cuda.is_available():
                warnings.warn(f"attention_config asks for 'flash' layers, but {about}: they run PyTorch SDPA "
                              "instead (the same attention without flash-attn's kernels; pip install -r "
                              "requirements/requirements-flashattention.txt for them)",
                              FlashAttnUnavailableWarning, stacklevel=2)
            return None
        try:
            from flash_attn import flash_attn_varlen_func
        except ImportError:  # an older flash-attn: packed documents then attend through SDPA, document by document
            flash_attn_varlen_func = None
        return cls(func, head_dim, flash_attn_varlen_func)

    def supports(self, q: torch.Tensor) -> bool:
        return q.is_cuda and q.dtype in HALF_DTYPES and self.head_dim <= MAX_HEAD_DIM

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, dropout_p: float,
                 window: Optional[int], alibi_slopes: Optional[torch.Tensor]) -> torch.Tensor:
        """Causal attention; q [b, s, heads, d], k/v [b, k_len, kv_heads, d] -> [b, s, heads, d]."""
        return self.flash_attn_func(
            q, k, v, dropout_p=dropout_p, causal=True,
            window_size=(-1, -1) if window is None else (int(window), 0),
            alibi_slopes=None if alibi_slopes is None else alibi_slopes.float().contiguous())

    def varlen(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
               *, dropout_p: float, window: Optional[int], alibi_slopes: Optional[torch.Tensor]) -> torch.Tensor:
        """Causal attention within each of the documents laid one after another in q [total, heads, d] and k/v
        [total, kv_heads, d], which ``cu_seqlens`` (int32 [documents + 1]) delimits -> [total, heads, d]."""
        return self.varlen_func(
            q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=max_seqlen,
            max_seqlen_k=max_seqlen, dropout_p=dropout_p, causal=True,
            window_size=(-1, -1) if window is None else (int(window), 0),
            alibi_slopes=None if alibi_slopes is None else alibi_slopes.float().contiguous())
