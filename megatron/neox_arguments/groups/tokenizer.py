"""NeoXArgsTokenizer: Which tokenizer to build (its files are vocab_file / merge_file in the training group).

Fields, types, defaults and docs follow the GPT-NeoX argument reference."""

from dataclasses import dataclass
from typing import Literal, Optional


@dataclass
class NeoXArgsTokenizer:
    """Which tokenizer to build (its files are vocab_file / merge_file in the training group)."""

    tokenizer_type: Literal['GPT2BPETokenizer', 'HFTokenizer', 'HFGPT2Tokenizer', 'SPMTokenizer', 'CharLevelTokenizer', 'TiktokenTokenizer'] = 'GPT2BPETokenizer'
    """
    Type of tokenizer to use - should be one of ["GPT2BPETokenizer", "HFTokenizer", "HFGPT2Tokenizer",
    "SPMTokenizer", "CharLevelTokenizer", "TiktokenTokenizer"]
    """

    padded_vocab_size: Optional[int] = None
    """
    Total (padded) vocabulary size of tokenizer. Configured after launching of training, as it's
    dependent on the parallelism size.
    """
