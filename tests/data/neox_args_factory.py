"""Build duck-typed `neox_args` for data and tokenizer tests, filled with the reference defaults."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

REFERENCE_DEFAULTS: dict[str, Any] = {
    "tokenizer_type": "GPT2BPETokenizer",
    "vocab_file": None,
    "merge_file": None,
    "make_vocab_size_divisible_by": 128,
    "model_parallel_size": 1,
    "pipe_parallel_size": 0,
    "is_pipe_parallel": False,
    "data_path": None,
    "use_shared_fs": True,
    "train_data_paths": None,
    "valid_data_paths": None,
    "test_data_paths": None,
    "train_label_data_paths": None,
    "valid_label_data_paths": None,
    "test_label_data_paths": None,
    "train_data_weights": None,
    "valid_data_weights": None,
    "test_data_weights": None,
    "weight_by_num_documents": False,
    "weighted_sampler_alpha": 1.0,
    "data_impl": "infer",
    "pack_impl": "packed",
    "dataset_impl": "gpt2",
    "train_impl": "normal",
    "allow_chopped": True,
    "mmap_warmup": False,
    "train_iters": None,
    "train_epochs": None,
    "eval_iters": 100,
    "eval_interval": 1000,
    "split": "969, 30, 1",
    "num_workers": 2,
    "seq_length": None,
    "seed": 1234,
    "train_batch_size": None,
    "train_micro_batch_size_per_gpu": None,
    "gradient_accumulation_steps": 1,
}


def make_neox_args(**overrides: Any) -> SimpleNamespace:
    """Reference defaults with `overrides` applied; unknown keys are refused so typos fail the test."""
    unknown = set(overrides) - set(REFERENCE_DEFAULTS)
    if unknown:
        raise KeyError(f"not in the test factory's defaults: {sorted(unknown)}")
    return SimpleNamespace(**{**REFERENCE_DEFAULTS, **overrides})
