"""GPT-NeoX's ``sparsity_config`` read per layer type, with DeepSpeed's sparsity-config semantics.

GPT-NeoX hands ``sparsity_config`` to DeepSpeed's SparsityConfig classes, one per attention type
(sparse_fixed: FixedSparsityConfig, sparse_variable: VariableSparsityConfig, bigbird: BigBirdSparsityConfig,
bslongformer: BSLongformerSparsityConfig, local: LocalSlidingWindowSparsityConfig), always unidirectional and
without horizontal global attention; each type reads its own keys with its own defaults (the ones GPT-NeoX
passes). This module turns the dict into one frozen :class:`SparsitySettings` per type and names every key
that is wrong; megatron.model.block_sparse builds the block layouts from it. It does not import torch
(ModelConfig's rules use it before any worker starts).
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, List, Mapping, Optional, Tuple

SPARSE_TYPES = ("sparse_fixed", "sparse_variable", "bigbird", "bslongformer")
"""Block-sparse attention types (megatron.model.block_sparse)."""

LAYOUT_KEYS = ("block", "different_layout_per_head", "num_local_blocks", "num_global_blocks",
               "num_different_global_patterns", "num_random_blocks", "local_window_blocks", "global_block_indices",
               "global_block_end_indices", "num_sliding_window_blocks")
"""The keys GPT-NeoX reads from sparsity_config (each type reads a subset)."""
FIXED_KEYS = {"attention": "unidirectional", "horizontal_global_attention": False}
"""DeepSpeed keys GPT-NeoX always overrides (its models are causal): accepted only at these values."""

LOCAL_DEFAULT_WINDOW_BLOCKS = 4
"""GPT-NeoX's 'local' window when sparsity_config names neither num_local_blocks nor num_sliding_window_blocks."""


def _ints(value: Any) -> Optional[Tuple[int, ...]]:
    return None if value is None else tuple(int(v) for v in value)


@dataclass(frozen=True)
class SparsitySettings:
    """The sparsity of one layer type: DeepSpeed's constructor arguments as GPT-NeoX passes them."""

    kind: str
    block: int = 16
    different_layout_per_head: bool = False
    num_local_blocks: int = 4
    num_global_blocks: int = 1
    num_different_global_patterns: int = 1
    num_random_blocks: int = 0
    local_window_blocks: Tuple[int, ...] = (4,)
    global_block_indices: Tuple[int, ...] = (0,)
    global_block_end_indices: Optional[Tuple[int, ...]] = None
    num_sliding_window_blocks: int = 3

    @classmethod
    def for_type(cls, kind: str, sparsity: Optional[Mapping[str, Any]]) -> "SparsitySettings":
        """The settings GPT-NeoX's configure_sparse_attention gives ``kind`` from ``sparsity`` (per-type
        defaults: bigbird draws one random block per row, sparse_variable none)."""
        s = dict(sparsity or {})
        common = dict(kind=kind, block=int(s.get("block", 16)),
                      different_layout_per_head=bool(s.get("different_layout_per_head", False)))
        if kind == "sparse_fixed":
            return cls(**common, num_local_blocks=int(s.get("num_local_blocks", 4)),
                       num_global_blocks=int(s.get("num_global_blocks", 1)),
                       num_different_global_patterns=int(s.get("num_different_global_patterns", 1)))
        if kind == "sparse_variable":
            return cls(**common, num_random_blocks=int(s.get("num_random_blocks", 0)),
                       local_window_blocks=_ints(s.get("local_window_blocks", [4])),
                       global_block_indices=_ints(s.get("global_block_indices", [0])),
                       global_block_end_indices=_ints(s.get("global_block_end_indices")))
        if kind == "bigbird":
            return cls(**common, num_random_blocks=int(s.get("num_random_blocks", 1)),
                       num_sliding_window_blocks=int(s.get("num_sliding_window_blocks", 3)),
                       num_global_blocks=int(s.get("num_global_blocks", 1)))
        if kind == "bslongformer":
            return cls(**common, num_sliding_window_blocks=int(s.get("num_sliding_window_blocks", 3)),
                       global_block_indices=_ints(s.get("global_block_indices", [0])),
                       global_block_end_indices=_ints(s.get("global_block_end_indices")))
        raise ValueError(f"{kind!r} is not a block-sparse attention type ({', '.join(SPARSE_TYPES)})")

    def problems(self, seq_length: int) -> List[str]:
        """DeepSpeed's own checks of these settings for a ``seq_length`` layout, naming the sparsity_config key."""
        kind, blocks = self.kind, seq_length // max(self.block, 1)
        where = f"sparsity_config (attention type {kind!r})"
        if self.block < 1:
            return [f"{where}: block={self.block} must be >= 1"]
        problems = []
        if seq_length % self.block:
            problems.append(f"{where}: seq_length={seq_length} must be divisible by block={self.block} (DeepSpeed's "
                            f"block-sparse layouts tile the whole sequence)")
        if kind == "sparse_fixed":
            if self.num_local_blocks < 1 or self.num_global_blocks < 1:
                problems.append(f"{where}: num_local_blocks={self.num_local_blocks} and num_global_blocks="
                                f"{self.num_global_blocks} must be >= 1")
            elif self.num_local_blocks % self.num_global_blocks:
                problems.append(f"{where}: num_local_blocks={self.num_local_blocks} must be divisible by "
                                f"num_global_blocks={self.num_global_blocks}")
            elif self.num_different_global_patterns > 1 and not self.different_layout_per_head:
                problems.append(f"{where}: num_different_global_patterns={self.num_different_global_patterns} needs "
                                f"different_layout_per_head: true")
            elif not 1 <= self.num_different_global_patterns <= self.num_local_blocks // self.num_global_blocks:
                problems.append(f"{where}: num_different_global_patterns={self.num_different_global_patterns} must be "
                                f"between 1 and num_local_blocks / num_global_blocks = "
                                f"{self.num_local_blocks // self.num_global_blocks}")
        if kind in ("sparse_variable", "bigbird") and not 0 <= self.num_random_blocks <= blocks:
            problems.append(f"{where}: num_random_blocks={self.num_random_blocks} must be between 0 and the "
                            f"{blocks} blocks of seq_length={seq_length}")
        if kind == "sparse_variable" and (not self.local_window_blocks or min(self.local_window_blocks) < 1):
            problems.append(f"{where}: local_window_blocks={list(self.local_window_blocks)} must be a non-empty list "
                            f"of block counts >= 1")
        if kind in ("bigbird", "bslongformer") and not 1 <= self.num_sliding_window_blocks <= blocks:
            problems.append(f"{where}: num_sliding_window_blocks={self.num_sliding_window_blocks} must be between 1 "
                            f"and the {blocks} blocks of seq_length={seq_length}")
        if kind == "bigbird" and not 1 <= self.num_global_blocks <= blocks:
            problems.append(f"{where}: num_global_blocks={self.num_global_blocks} must be between 1 and the {blocks} "
                            f"blocks of seq_length={seq_length}")
        if kind in ("sparse_variable", "bslongformer"):
            problems += self._global_index_problems(where)
        return problems

    def _global_index_problems(self, where: str) -> List[str]:
        starts, ends = self.global_block_indices, self.global_block_end_indices
        if min(starts, default=0) < 0:
            return [f"{where}: global_block_indices={list(starts)} must be >= 0"]
        if ends is None:
            return []
        if len(ends) != len(starts):
            return [f"{where}: global_block_end_indices has {len(ends)} entries but global_block_indices has "
                    f"{len(starts)}; they pair up"]
        return [f"{where}: global block start {a} must be smaller than its end {b} (global_block_end_indices)"
                for a, b in zip(starts, ends) if a >= b]


def local_window(sparsity: Optional[Mapping[str, Any]], default_blocks: int) -> Tuple[int, int]:
    """(block, window blocks) of 'local' layers: GPT-NeoX reads num_local_blocks, then
    num_sliding_window_blocks, then 4; without any sparsity_config, ``default_blocks``."""
    if sparsity is None:
        return 16, default_blocks
    blocks = sparsity.get("num_local_blocks", sparsity.get("num_sliding_window_blocks", LOCAL_DEFAULT_WINDOW_BLOCKS))
    return int(sparsity.get("block", 16)), int(blocks)


def key_problems(sparsity: Optional[Mapping[str, Any]], types: Tuple[str, ...]) -> List[str]:
    """Keys of ``sparsity_config`` that are unknown, of the wrong kind, or that no layer reads."""
    if sparsity is None:
        return []
    if not isinstance(sparsity, Mapping):
        return [f"sparsity_config={sparsity!r} must be a dict of DeepSpeed sparsity settings"]
    problems = []
    known = LAYOUT_KEYS + tuple(FIXED_KEYS) + ("mode",)
    for key, value in sparsity.items():
        if key not in known:
            guesses = difflib.get_close_matches(key, known, n=2, cutoff=0.6)
            hint = f"; did you mean {' or '.join(repr(g) for g in guesses)}?" if guesses else \
                f"; known keys: {', '.join(LAYOUT_KEYS)}"
            problems.append(f"sparsity_config: unknown key {key!r}{hint}")
        elif key == "mode":
            problems.append("sparsity_config: 'mode' is not read (GPT-NeoX chooses each layer's layout with "
                            "attention_config: sparse_fixed, sparse_variable, bigbird, bslongformer, local); "
                            "delete the key")
        elif key in FIXED_KEYS and value != FIXED_KEYS[key]:
            problems.append(f"sparsity_config: {key}={value!r} is not supported: the model is causal, so "
                            f"{key} is always {FIXED_KEYS[key]!r}; delete the key")
        elif key in ("local_window_blocks", "global_block_indices", "global_block_end_indices"):
            if value is not None and not (isinstance(value, (list, tuple)) and
                                          all(isinstance(v, int) and not isinstance(v, bool) for v in value)):
                problems.append(f"sparsity_config: {key}={value!r} must be a list of integers")
        elif key == "different_layout_per_head":
            if not isinstance(value, bool):
                problems.append(f"sparsity_config: different_layout_per_head={value!r} must be true or false")
        elif key in LAYOUT_KEYS and (isinstance(value, bool) or not isinstance(value, int)):
            problems.append(f"sparsity_config: {key}={value!r} must be an integer")
    if not problems and not any(t in SPARSE_TYPES + ("local",) for t in types):
        problems.append("sparsity_config is set but no layer reads it: add sparse_fixed, sparse_variable, bigbird, "
                        "bslongformer or local layers to attention_config, or delete sparsity_config")
    return problems


def freeze(sparsity: Optional[Mapping[str, Any]]) -> Optional[Tuple[Tuple[str, Any], ...]]:
    """The dict as sorted (key, value) pairs with lists as tuples: a value a frozen ModelConfig can hold."""
    if sparsity is None or not isinstance(sparsity, Mapping):
        return sparsity
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in sparsity.items()))
