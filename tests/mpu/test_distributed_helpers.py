"""tests.distributed_helpers.run_distributed: results per rank, failures reported with tracebacks."""
import os

import pytest
import torch
import torch.distributed as dist

from tests.distributed_helpers import run_distributed


def _ok_or_fail(rank: int, world_size: int, fail_rank: int):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    if rank == fail_rank:
        raise RuntimeError(f"boom on {rank}")
    return rank, world_size, t.item(), os.environ["OMP_NUM_THREADS"], torch.ones(2) * rank


@pytest.mark.slow
def test_results_and_failures_are_reported():
    results = run_distributed(_ok_or_fail, world_size=2, args=(-1,))
    assert [r[:4] for r in results] == [(0, 2, 1.0, "1"), (1, 2, 1.0, "1")]
    assert torch.equal(results[1][4], torch.ones(2))  # tensors come back by value
    with pytest.raises(AssertionError, match=r"(?s)rank 1 failed.*boom on 1"):
        run_distributed(_ok_or_fail, world_size=2, args=(1,))
