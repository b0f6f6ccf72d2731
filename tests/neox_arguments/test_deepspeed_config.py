"""The DeepSpeed config we build is accepted by DeepSpeed's own parser."""

import pytest

from tests.neox_arguments.helpers import tiny


class _DataParallelOnly:
    """The part of an mpu DeepSpeedConfig reads, so the batch check uses our data-parallel size."""

    def __init__(self, size):
        self.size = size

    def get_data_parallel_world_size(self):
        return self.size


class _Rank0:
    """Stands in for deepspeed.comm: DeepSpeedConfig asks the mpu for the data-parallel size only when
    its get_rank() works (i.e. inside a launched job)."""

    @staticmethod
    def get_rank():
        return 0


@pytest.fixture
def single_process_group(monkeypatch):
    import deepspeed.runtime.config as ds_config_module

    monkeypatch.setattr(ds_config_module, "dist", _Rank0)


@pytest.mark.parametrize("overrides", [
    {},
    {"num_gpus": 2, "zero_optimization": {"stage": 1}, "bf16": {"enabled": True}},
    {"num_gpus": 4, "zero_optimization": {"stage": 3, "overlap_comm": True}, "gradient_accumulation_steps": 2,
     "optimizer": {"type": "Adam", "params": {"lr": 6e-4, "betas": [0.9, 0.95], "eps": 1e-8}},
     "flops_profiler": {"enabled": False}, "wall_clock_breakdown": True, "gradient_clipping": 1.0},
    {"fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
     "deepspeed_extra_args": {"zero_allow_untested_optimizer": True}},
])
def test_deepspeed_parses_our_config(overrides, single_process_group):
    from deepspeed.runtime.config import DeepSpeedConfig

    args = tiny(**overrides)
    config = args.deepspeed_config
    parsed = DeepSpeedConfig(dict(config), mpu=_DataParallelOnly(args.data_parallel_size))
    assert parsed.train_batch_size == args.train_batch_size
    assert parsed.gradient_accumulation_steps == args.gradient_accumulation_steps
    assert parsed.zero_optimization_stage == args.zero_stage
    assert parsed.bfloat16_config.enabled == (args.precision == "bfloat16")
    assert parsed.float16_config.enabled == (args.precision == "fp16")


def test_only_deepspeed_keys_are_in_the_config():
    config = tiny(num_gpus=2).deepspeed_config
    assert "num_layers" not in config and "hidden_size" not in config
    assert {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
            "zero_optimization", "gradient_clipping"} <= set(config)


def test_extra_args_are_merged_at_top_level():
    config = tiny(deepspeed_extra_args={"zero_force_ds_cpu_optimizer": False}).deepspeed_config
    assert config["zero_force_ds_cpu_optimizer"] is False
