"""ParallelState: rank layout (model ranks adjacent), group membership, DeepSpeed mpu API, destroy."""

import pytest
import torch
import torch.distributed as dist

from megatron.mpu import ParallelState, SingleProcessState
from tests.distributed_helpers import run_distributed


def _layouts(rank: int, world_size: int) -> dict:
    seen = {}
    # TP=2: both ranks in one model group, each its own data and pipe group.
    ps = ParallelState(pipe_parallel_size=0, model_parallel_size=2)
    seen["tp2"] = (
        ps.get_model_parallel_rank(),
        ps.get_model_parallel_world_size(),
        ps.get_data_parallel_world_size(),
        ps.get_pipe_parallel_world_size(),
        ps.group_ranks("model"),
        ps.get_tensor_model_parallel_src_rank(),
        ps.get_tensor_model_parallel_rank(),
    )
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t, group=ps.get_model_parallel_group())
    seen["tp2_sum"] = t.item()
    ps.destroy()
    ps.destroy()  # idempotent
    with pytest.raises(RuntimeError):
        ps.get_model_parallel_group()
    # PP=2: stages 0 and 1.
    ps = ParallelState(pipe_parallel_size=2, model_parallel_size=1)
    seen["pp2"] = (
        ps.get_pipe_parallel_rank(),
        ps.is_first_pipe_stage(),
        ps.is_last_pipe_stage(),
        ps.group_ranks("pipe"),
        ps.get_data_parallel_world_size(),
        ps.get_topology().get_dim("pipe"),
    )
    ps.destroy()
    # DP=2.
    ps = ParallelState(pipe_parallel_size=1, model_parallel_size=1)
    seen["dp2"] = (ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(), ps.group_ranks("data"))
    ps.destroy()
    with pytest.raises(ValueError, match="not divisible"):
        ParallelState(pipe_parallel_size=0, model_parallel_size=3)
    return seen


@pytest.mark.slow
def test_layouts_on_two_ranks():
    r0, r1 = run_distributed(_layouts, world_size=2)
    assert r0["tp2"] == (0, 2, 1, 1, [0, 1], 0, 0)
    assert r1["tp2"] == (1, 2, 1, 1, [0, 1], 0, 1)
    assert r0["tp2_sum"] == r1["tp2_sum"] == 3.0
    assert r0["pp2"] == (0, True, False, [0, 1], 1, 2)
    assert r1["pp2"] == (1, False, True, [0, 1], 1, 2)
    assert r0["dp2"] == (0, 2, [0, 1]) and r1["dp2"] == (1, 2, [0, 1])


def test_model_ranks_adjacent_in_topology():
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)
    assert [0, 1] in topo.get_axis_comm_lists("model")
    assert [0, 2] in topo.get_axis_comm_lists("data")
    assert [0, 4] in topo.get_axis_comm_lists("pipe")


def test_single_process_state_is_all_ones():
    ps = SingleProcessState()
    assert ps.get_model_parallel_world_size() == 1 and ps.get_model_parallel_group() is None
    assert ps.is_first_pipe_stage() and ps.is_last_pipe_stage()


def test_requires_initialised_world():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="initialised"):
        ParallelState(0, 1)
