"""The load-balanced causal layout of context parallelism (megatron.mpu.context_parallel); the ring exchange and
the context-parallel groups are tested with the model on 4 gloo ranks (tests/model/test_context_parallel.py)."""
import pytest
import torch

from megatron.mpu.context_parallel import chunk_positions, split_sequence


def test_chunk_positions_are_load_balanced():
    assert chunk_positions(16, 0, 2).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert chunk_positions(16, 1, 2).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    every = torch.cat([chunk_positions(24, r, 3) for r in range(3)]).sort().values
    assert torch.equal(every, torch.arange(24))
    x = torch.arange(16).view(1, 16)
    assert torch.equal(split_sequence(x, 1, 2), chunk_positions(16, 1, 2).view(1, 8))
    with pytest.raises(ValueError, match="divisible by 2 x context_parallel_size"):
        chunk_positions(12, 0, 4)
