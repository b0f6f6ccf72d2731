"""The pre-launch memory bound (megatron.neox_arguments.memory): what each rank must hold, split as the layout and
ZeRO split it, and the refusal when it exceeds the device."""

import pytest

from megatron.launch.prelaunch import memory_problems
from megatron.neox_arguments.memory import estimate, parameters_lower_bound
from megatron.model.config import ModelConfig
from tests.neox_arguments.helpers import tiny

ADAM = {"type": "Adam", "params": {"lr": 1.0e-3}}
GIB = 2 ** 30


def args(**overrides):
    return tiny(optimizer=ADAM, train_iters=10, user_script="train.py", **overrides)


def test_the_parameters_counted_are_the_projections_and_the_embedding():
    config = ModelConfig.from_neox_args(args(), padded_vocab_size=128)
    h, ffn = 64, config.ffn_width
    assert ffn == 4 * h and parameters_lower_bound(config) == 2 * (2 * h * h + 2 * h * ffn) + 128 * h


@pytest.mark.parametrize("stage,weights,gradients,optimizer", [(0, 1, 1, 1), (1, 1, 1, 4), (2, 1, 4, 4),
                                                               (3, 4, 4, 4)])
def test_zero_divides_what_its_stage_partitions_over_the_data_parallel_ranks(stage, weights, gradients, optimizer):
    whole = estimate(args(num_gpus=1), training=True, on_gpu=True)
    split = estimate(args(num_gpus=4, zero_optimization={"stage": stage}), training=True, on_gpu=True)
    assert (whole.weights // split.weights, whole.gradients // split.gradients, whole.optimizer // split.optimizer) \
        == (weights, gradients, optimizer)
    assert whole.optimizer == 2 * whole.weights  # Adam's two fp32 moments of fp32 weights


def test_an_autotuning_runs_stage_choices_count_the_stage_that_needs_least():
    """autotuning_run tunes zero_optimization.stage over a list (or 'all'): the bound is the least the tuner could
    need, the stage that partitions the most (a list once crashed the pre-launch check)."""
    least = estimate(args(num_gpus=4, zero_optimization={"stage": 3}), training=True, on_gpu=True)
    for stages in ([0, 1, 3], "all"):
        tuned = args(num_gpus=4, zero_optimization={"stage": stages}, autotuning_run="run",
                     autotuning={"enabled": True})
        assert estimate(tuned, training=True, on_gpu=True) == least


def test_tensor_parallelism_offload_and_inference():
    whole = estimate(args(num_gpus=2), training=True, on_gpu=True)
    tp = estimate(args(num_gpus=2, model_parallel_size=2), training=True, on_gpu=True)
    assert tp.weights == whole.weights // 2 and tp.optimizer == whole.optimizer // 2
    offloaded = tiny(optimizer={**ADAM, "type": "CPU_Adam"}, train_iters=10, user_script="train.py",
                     zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu"}})
    assert estimate(offloaded, training=True, on_gpu=True).optimizer == 0
    assert estimate(offloaded, training=True, on_gpu=False).optimizer > 0  # CPU ranks: the same RAM
    inference = estimate(args(), training=False, on_gpu=True)
    assert inference.total == inference.weights == whole.weights


def test_a_model_that_fits_passes_and_one_that_does_not_names_its_numbers():
    assert memory_problems(args(), gpu_bytes=GIB) == []
    (problem,) = memory_problems(args(hidden_size=65536, num_attention_heads=8), gpu_bytes=80 * GIB)
    assert problem.startswith("the model cannot fit: each rank needs at least ") and \
        "and each rank has 80.0 GiB (the memory of the smallest GPU here)" in problem, problem
    (problem,) = memory_problems(args(hidden_size=65536, num_attention_heads=8, num_gpus=2), ram_bytes=64 * GIB)
    assert "each rank has 32.0 GiB (its share of this machine's 64.0 GiB of RAM over 2 CPU rank(s))" in problem
