"""comms_logger: the section's keys (prof_interval is ours and never reaches DeepSpeed), and the project's own
tensor-parallel collectives counted by DeepSpeed's comms logger once deepspeed.comm is started, summarised by
CommsReporter. (The summary printed and written during training through deepy.py is checked in
tests/e2e/test_deepspeed_features.py.)"""

import pytest
import torch

from megatron.observability.comms_logging import CommsReporter
from tests.distributed_helpers import run_distributed
from tests.neox_arguments.helpers import problems_of, tiny


def test_prof_interval_is_ours_and_the_rest_is_deepspeeds():
    args = tiny(comms_logger={"enabled": True, "prof_all": True, "prof_interval": 5})
    assert args.deepspeed_config["comms_logger"] == {"enabled": True, "prof_all": True}
    from deepspeed.comm.config import DeepSpeedCommsConfig

    assert DeepSpeedCommsConfig(args.deepspeed_config).comms_logger.prof_all  # DeepSpeed's schema takes it
    reporter = CommsReporter(args.comms_logger)
    assert reporter.enabled and [i for i in range(1, 12) if reporter.due(i)] == [5, 10]
    assert not CommsReporter({"enabled": False, "prof_interval": 5}).due(5)


@pytest.mark.parametrize("section,expected", [
    ({"enabled": True, "prof_every": 3}, "unknown keys ['prof_every']"),
    ({"enabled": True, "prof_interval": 0}, "prof_interval=0 must be an integer >= 1"),
])
def test_bad_sections_are_refused(section, expected):
    assert expected in problems_of(comms_logger=section)


def _tensor_parallel_ops(rank: int, world_size: int):
    import deepspeed.comm as ds_comm

    from megatron.mpu.deepspeed_comm import init_deepspeed_comm
    from megatron.mpu import ParallelState, reduce_from_model_parallel_region, vocab_parallel_cross_entropy

    init_deepspeed_comm("gloo", dist_init_required=False)
    ds_comm.configure(enabled=True, prof_all=True)
    state = ParallelState(pipe_parallel_size=0, model_parallel_size=2)
    group = state.get_model_parallel_group()
    for _ in range(3):
        reduce_from_model_parallel_region(torch.ones(8, 16), group)  # 512 bytes
    vocab_parallel_cross_entropy(torch.randn(2, 5, 7), torch.zeros(2, 5, dtype=torch.long), group)
    ops = CommsReporter({"enabled": True}).report()
    state.destroy()
    return ops


@pytest.mark.slow
def test_tensor_parallel_collectives_are_counted_by_deepspeeds_comms_logger():
    ops = run_distributed(_tensor_parallel_ops, world_size=2)[0]
    assert ops["all_reduce"]["512"]["count"] == 3
    assert ops["all_reduce"]["40"]["count"] == 3  # the loss's max, target logit and sum of exponentials
    figures = ops["all_reduce"]["512"]
    assert figures["avg_latency_ms"] > 0 and figures["msg_size_str"] == "512.0 B" and "busbw_avg_gbps" in figures
