"""Small builders for NeoXArgs tests."""

from typing import Any, Dict

from megatron.neox_arguments import NeoXArgs
from megatron.errors import ConfigError

TINY: Dict[str, Any] = {
    "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32,
    "max_position_embeddings": 32, "train_micro_batch_size_per_gpu": 2, "num_gpus": 1,
}


def tiny(**overrides: Any) -> NeoXArgs:
    return NeoXArgs.from_dict({**TINY, **overrides})


RM_ARGS = {"train_impl": "rm", "dataset_impl": "pairwise", "pack_impl": "unpacked", "pos_train_data_paths": ["data/pos"],
           "neg_train_data_paths": ["data/neg"]}
"""What a reward-model run needs besides TINY (pairwise data paths; the files are not read)."""


def problems_of(**overrides: Any) -> str:
    """The text of the ConfigError the overrides cause (fails the test if none is raised)."""
    try:
        NeoXArgs.from_dict({**TINY, **overrides})
    except ConfigError as err:
        return str(err)
    raise AssertionError(f"no ConfigError for {overrides}")
