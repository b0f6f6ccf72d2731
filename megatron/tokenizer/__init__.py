"""Tokenizers chosen by `tokenizer_type`, one interface (`AbstractTokenizer`). (The padded vocabulary is the
model's: megatron.model.config.padded_vocab_size.)

May import: megatron.errors.
"""

from megatron.errors import TokenizerError
from megatron.tokenizer.abstract_tokenizer import AbstractTokenizer
from megatron.tokenizer.build_tokenizer import TOKENIZER_TYPES, build_tokenizer, build_tokenizer_from

__all__ = [
    "AbstractTokenizer",
    "TOKENIZER_TYPES",
    "TokenizerError",
    "build_tokenizer",
    "build_tokenizer_from",
]
