"""The DeepSpeed config we build is accepted by DeepSpeed's own parser."""

import pytest

from megatron.neox_arguments.validation import DERIVED_ONLY
from tests.neox_arguments.helpers import problems_of, tiny


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


def test_deepspeed_prints_at_steps_per_print_only_its_wall_clock_breakdown(single_process_group):
    """Issue 31: with a pipeline DeepSpeed printed `steps: N loss: X` every steps_per_print steps beside the
    logger's lm_loss line. Its only visible report at that interval besides the timings of wall_clock_breakdown:
    without those, DeepSpeed gets an interval no run reaches."""
    from megatron.neox_arguments.deepspeed_config import QUIET_STEPS_PER_PRINT

    assert _parsed(tiny(steps_per_print=10, pipe_parallel_size=2, num_gpus=2)).steps_per_print == \
        QUIET_STEPS_PER_PRINT
    assert _parsed(tiny(steps_per_print=10, wall_clock_breakdown=True)).steps_per_print == 10


def _parsed(args):
    from deepspeed.runtime.config import DeepSpeedConfig

    return DeepSpeedConfig(dict(args.deepspeed_config), mpu=_DataParallelOnly(args.data_parallel_size))


# ---- fp16: the top-level loss-scaling arguments and the fp16 dict are one setting -------------------------

FP16_VALUES = {"loss_scale": 128, "loss_scale_window": 500, "hysteresis": 3, "min_scale": 4}
FP16_DICT = {"loss_scale": 128, "loss_scale_window": 500, "hysteresis": 3, "min_loss_scale": 4}


@pytest.mark.parametrize("where", ["top level", "fp16 dict", "both"])
def test_fp16_loss_scaling_reaches_deepspeed_from_either_place(where, single_process_group):
    top = FP16_VALUES if where != "fp16 dict" else {}
    section = FP16_DICT if where != "top level" else {}
    args = tiny(fp16={"enabled": True, **section}, **top)
    assert {k: args.deepspeed_config["fp16"][k] for k in FP16_DICT} == FP16_DICT
    assert (args.loss_scale, args.loss_scale_window, args.hysteresis, args.min_scale) == (128, 500, 3, 4)
    assert args.dynamic_loss_scale is False
    fp16 = _parsed(args).float16_config
    assert (fp16.enabled, fp16.loss_scale, fp16.loss_scale_window, fp16.hysteresis, fp16.min_loss_scale) == \
        (True, 128, 500, 3, 4)


def test_precision_fp16_alone_gets_deepspeeds_dynamic_scaling(single_process_group):
    args = tiny(precision="fp16", loss_scale_window=200)
    assert args.dynamic_loss_scale is True
    fp16 = _parsed(args).float16_config
    assert (fp16.enabled, fp16.loss_scale, fp16.loss_scale_window, fp16.hysteresis) == (True, 0, 200, 2)


@pytest.mark.parametrize("overrides,needle", [
    ({"fp16": {"enabled": True, "loss_scale": 0}, "loss_scale": 128},
     "loss_scale=128.0 contradicts fp16.loss_scale=0"),
    ({"fp16": {"enabled": True, "hysteresis": 2}, "hysteresis": 4}, "hysteresis=4 contradicts fp16.hysteresis=2"),
    ({"fp16": {"enabled": True, "min_loss_scale": 1}, "min_scale": 8}, "min_scale=8.0 contradicts fp16.min_loss_scale=1"),
    ({"fp16": {"enabled": True, "loss_scale_window": 100}, "loss_scale_window": 500},
     "loss_scale_window=500.0 contradicts fp16.loss_scale_window=100"),
    ({"fp16": {"enabled": True, "loss_scale": 64}, "dynamic_loss_scale": True},
     "dynamic_loss_scale=true contradicts the static loss_scale=64"),
    ({"precision": "fp16", "dynamic_loss_scale": False}, "dynamic_loss_scale=false needs a static scale"),
    ({"precision": "fp16", "min_scale": 0.5}, "min_scale=0.5 must be a whole number"),
    ({"bf16": {"enabled": True}, "loss_scale": 1024}, "loss_scale=1024.0 is an fp16 loss-scaling setting but "
                                                      "precision is 'bfloat16'"),
    ({"hysteresis": 5}, "hysteresis=5 is an fp16 loss-scaling setting but precision is 'fp32'"),
])
def test_fp16_contradictions_name_both_places(overrides, needle):
    assert needle in problems_of(**overrides)


@pytest.mark.parametrize("fast", [True, False], ids=["bf16_fast", "bf16_slow"])
def test_precision_auto_takes_bf16_only_where_it_is_fast(monkeypatch, fast):
    """precision: auto on a CPU (issue 34): bf16 (DeepSpeed's bf16 section: fp32 master weights) where the probe's
    bf16 matmul is fast enough, fp32 where it is not; precision_choice says which and why."""
    import megatron.utils.bf16_speed as speed

    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.setattr(speed, "cpu_matmul_rates", lambda: (200.0, 870.0 if fast else 150.0))
    monkeypatch.setattr(speed, "cpu_bf16_flags", lambda: ["avx512_bf16"] if fast else [])
    args = tiny(precision="auto")
    assert args.precision == ("bfloat16" if fast else "fp32")
    assert args.deepspeed_config.get("bf16", {}).get("enabled", False) == fast
    assert args.precision_choice.startswith(f"precision: auto chose {'bf16' if fast else 'fp32'}")
    assert ("870 GFLOP/s in bf16 and 200 in fp32 (4.35x)" if fast else "(0.75x)") in args.precision_choice


def test_precision_auto_with_a_precision_dict_is_refused():
    assert "precision='auto' decides between bf16 and fp32 itself" in problems_of(precision="auto",
                                                                                  bf16={"enabled": True})


def test_bf16_speed_probe_measures_both_precisions():
    """The real probe on this machine, small: two positive rates, and the flags it reads are known ones."""
    from megatron.utils.bf16_speed import BF16_CPU_FLAGS, cpu_bf16_flags, matmul_gflops
    import torch

    assert matmul_gflops(torch.float32, size=64, repeats=1) > 0 and matmul_gflops(torch.bfloat16, 64, 1) > 0
    assert set(cpu_bf16_flags()) <= set(BF16_CPU_FLAGS)


# ---- clip_grad and gradient_clipping ---------------------------------------------------------------------

def test_clip_grad_alone_reaches_deepspeeds_gradient_clipping(single_process_group):
    args = tiny(clip_grad=0.25)
    assert args.gradient_clipping == 0.25 and args.deepspeed_config["gradient_clipping"] == 0.25
    assert _parsed(args).gradient_clipping == 0.25
    assert tiny(gradient_clipping=0.5).clip_grad == 0.5
    assert tiny(clip_grad=0.5, gradient_clipping=0.5).deepspeed_config["gradient_clipping"] == 0.5
    assert "clip_grad=0.25 contradicts gradient_clipping=1.0" in problems_of(clip_grad=0.25, gradient_clipping=1.0)


# ---- zero_* and zero_optimization ------------------------------------------------------------------------

def test_zero_arguments_reach_zero_optimization(single_process_group):
    args = tiny(zero_stage=2, zero_reduce_scatter=False, zero_contiguous_gradients=True,
                zero_reduce_bucket_size=12345, zero_allgather_bucket_size=67890,
                zero_optimization={"overlap_comm": True})
    assert args.deepspeed_config["zero_optimization"] == {
        "overlap_comm": True, "stage": 2, "reduce_scatter": False, "contiguous_gradients": True,
        "reduce_bucket_size": 12345, "allgather_bucket_size": 67890}
    zero = _parsed(args).zero_config
    assert (zero.stage, zero.reduce_scatter, zero.contiguous_gradients, zero.reduce_bucket_size,
            zero.allgather_bucket_size, zero.overlap_comm) == (2, False, True, 12345, 67890, True)


def test_unset_zero_arguments_leave_deepspeeds_defaults(single_process_group):
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    args = tiny(zero_optimization={"stage": 1})
    assert args.deepspeed_config["zero_optimization"] == {"stage": 1}
    default = DeepSpeedZeroConfig()
    zero = _parsed(args).zero_config
    assert (zero.reduce_scatter, zero.reduce_bucket_size) == (default.reduce_scatter, default.reduce_bucket_size)


@pytest.mark.parametrize("overrides,needle", [
    ({"zero_stage": 1, "zero_optimization": {"stage": 2}}, "zero_stage=1 contradicts zero_optimization.stage=2"),
    ({"zero_reduce_bucket_size": 5, "zero_optimization": {"stage": 1, "reduce_bucket_size": 6}},
     "zero_reduce_bucket_size=5 contradicts zero_optimization.reduce_bucket_size=6"),
])
def test_zero_contradictions_name_both_places(overrides, needle):
    assert needle in problems_of(**overrides)


# ---- activation checkpointing: the flags and DeepSpeed's dict ------------------------------------------

def test_activation_checkpointing_dict_sets_the_flags(single_process_group):
    args = tiny(checkpoint_activations=True, activation_checkpointing={
        "partition_activations": True, "cpu_checkpointing": True, "contiguous_memory_optimization": True,
        "synchronize_checkpoint_boundary": True, "profile": True, "number_checkpoints": 5})
    assert (args.partition_activations, args.checkpoint_in_cpu, args.contiguous_checkpointing,
            args.synchronize_each_layer, args.profile_backward) == (True,) * 5
    parsed = _parsed(args).activation_checkpointing_config
    assert (parsed.partition_activations, parsed.cpu_checkpointing, parsed.contiguous_memory_optimization,
            parsed.synchronize_checkpoint_boundary, parsed.profile, parsed.number_checkpoints) == (True,) * 5 + (5,)


def test_activation_checkpointing_flags_fill_the_dict(single_process_group):
    args = tiny(num_layers=4, checkpoint_activations=True, checkpoint_num_layers=3, partition_activations=True,
                synchronize_each_layer=True)
    section = args.deepspeed_config["activation_checkpointing"]
    assert section == {"partition_activations": True, "cpu_checkpointing": False,
                       "contiguous_memory_optimization": False, "synchronize_checkpoint_boundary": True,
                       "profile": False, "number_checkpoints": 2}  # ceil(4 / 3) chunks, as GPT-NeoX counts
    assert _parsed(args).activation_checkpointing_config.partition_activations is True


@pytest.mark.parametrize("overrides,needle", [
    ({"partition_activations": False, "activation_checkpointing": {"partition_activations": True}},
     "partition_activations=False contradicts activation_checkpointing.partition_activations=True"),
    ({"checkpoint_in_cpu": True, "activation_checkpointing": {"cpu_checkpointing": False}},
     "checkpoint_in_cpu=True contradicts activation_checkpointing.cpu_checkpointing=False"),
    ({"activation_checkpointing": {"partition": True}}, "activation_checkpointing has unknown keys ['partition']"),
    ({"activation_checkpointing": {"number_checkpoints": 1}}, "number_checkpoints=1 must be an integer >= 2"),
    ({"activation_checkpointing": {"contiguous_memory_optimization": True}},
     "contiguous_checkpointing (activation_checkpointing.contiguous_memory_optimization) needs partition_activations"),
    ({"deepspeed_activation_checkpointing": False}, "activation checkpointing is always DeepSpeed's"),
])
def test_activation_checkpointing_contradictions(overrides, needle):
    assert needle in problems_of(**overrides)


# ---- the scheduler dict -----------------------------------------------------------------------------------

ADAM = {"type": "Adam", "params": {"lr": 1e-3}}


def test_scheduler_dict_reaches_deepspeed_with_lr_as_its_peak(single_process_group):
    args = tiny(optimizer=ADAM, scheduler={"type": "WarmupDecayLR",
                                           "params": {"total_num_steps": 100, "warmup_num_steps": 10}})
    parsed = _parsed(args)
    assert parsed.scheduler_name == "WarmupDecayLR"
    assert parsed.scheduler_params == {"total_num_steps": 100, "warmup_num_steps": 10, "warmup_max_lr": 1e-3}
    cosine = tiny(optimizer=ADAM, scheduler={"type": "WarmupCosineLR", "params": {"total_num_steps": 10}})
    assert cosine.deepspeed_config["scheduler"] == {"type": "WarmupCosineLR", "params": {"total_num_steps": 10}}


@pytest.mark.parametrize("scheduler,extra,needle", [
    ({"type": "OneCycle"}, {}, "scheduler.type='OneCycle' is not supported yet"),
    ({"type": "StepLR"}, {}, "scheduler.type='StepLR' must be one of WarmupLR, WarmupDecayLR, WarmupCosineLR"),
    ({"type": "WarmupLR", "params": {"warmup_steps": 3}}, {}, "scheduler.params has keys ['warmup_steps'] that "
                                                             "WarmupLR does not take"),
    ({"type": "WarmupDecayLR", "params": {}}, {}, "scheduler.params lacks total_num_steps"),
    ({"type": "WarmupLR", "params": {"warmup_max_lr": 0.1}}, {}, "warmup_max_lr=0.1 contradicts lr=0.001"),
    ({"type": "WarmupLR"}, {"lr_decay_style": "cosine"}, "lr_decay_style='cosine' configures the built-in"),
    ({"type": "WarmupLR"}, {"warmup": 0.1}, "warmup=0.1 configures the built-in"),
    ({"type": "WarmupLR", "params": {"last_batch_iteration": 5}}, {}, "comes from the checkpoint"),
])
def test_scheduler_dict_problems(scheduler, extra, needle):
    assert needle in problems_of(optimizer=ADAM, scheduler=scheduler, **extra)


# ---- deepspeed_extra_args adds, never contradicts -----------------------------------------------------

def test_extra_args_merge_into_the_sections_they_add_to(single_process_group):
    args = tiny(zero_stage=1, bf16={"enabled": True}, deepspeed_extra_args={
        "zero_optimization": {"overlap_comm": True, "stage": 1}, "bf16": {"enabled": True},
        "zero_allow_untested_optimizer": True, "gradient_clipping": 1.0})
    config = args.deepspeed_config
    assert config["zero_optimization"] == {"overlap_comm": True, "stage": 1}
    assert config["zero_allow_untested_optimizer"] is True and config["bf16"] == {"enabled": True}
    parsed = _parsed(args)
    assert parsed.zero_config.overlap_comm is True and parsed.zero_allow_untested_optimizer is True
    assert tiny(deepspeed_extra_args={"fp16": {"enabled": True}}).precision == "fp16"


@pytest.mark.parametrize("overrides,needle", [
    ({"precision": "fp32", "deepspeed_extra_args": {"fp16": {"enabled": True}}},
     "precision='fp32' contradicts fp16.enabled=true"),
    ({"bf16": {"enabled": True}, "deepspeed_extra_args": {"bfloat16": {"enabled": False}}},
     "deepspeed_extra_args: bf16.enabled=False contradicts bf16.enabled=True"),
    ({"fp16": {"enabled": True}, "deepspeed_extra_args": {"bf16": {"enabled": True}}},
     "fp16.enabled and bf16.enabled are both true"),
    ({"zero_stage": 1, "deepspeed_extra_args": {"zero_optimization": {"stage": 3}}},
     "zero_stage=1 contradicts zero_optimization.stage=3; they are one setting, set it in one place "
     "(zero_optimization is set, at least in part, in deepspeed_extra_args)"),
    ({"gradient_clipping": 1.0, "deepspeed_extra_args": {"gradient_clipping": 0.3}},
     "deepspeed_extra_args: gradient_clipping=0.3 contradicts gradient_clipping=1.0"),
    ({"deepspeed_extra_args": {"seed": 3}}, "deepspeed_extra_args['seed']: 'seed' is a NeoX argument"),
    ({"deepspeed_extra_args": {"torch_autocast": {"enabled": True}}}, "torch_autocast is not supported yet"),
])
def test_extra_args_never_contradict_the_config(overrides, needle):
    assert needle in problems_of(**overrides)


def test_merge_reports_every_contradicting_leaf():
    from megatron.neox_arguments.deepspeed_config import merge_without_contradiction

    merged, contradictions = merge_without_contradiction({"a": {"b": 1, "c": 2}, "d": 3},
                                                         {"a": {"b": 1, "c": 5, "e": 6}, "f": 7})
    assert merged == {"a": {"b": 1, "c": 2, "e": 6}, "d": 3, "f": 7}
    assert contradictions == [("a.c", 2, 5)]


def test_mirrored_config_rederives_to_the_same_values():
    from megatron.neox_arguments import NeoXArgs

    args = tiny(fp16={"enabled": True, "hysteresis": 3}, loss_scale_window=100, clip_grad=0.5, zero_stage=1,
                zero_reduce_bucket_size=1000, checkpoint_activations=True,
                activation_checkpointing={"partition_activations": True}, optimizer=ADAM,
                scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 5}},
                deepspeed_extra_args={"zero_optimization": {"overlap_comm": True}, "wall_clock_breakdown": True})
    again = NeoXArgs.from_dict({k: v for k, v in args.to_dict().items()
                                if k not in DERIVED_ONLY})
    assert again.to_dict() == args.to_dict()


@pytest.mark.attack("a DeepSpeed section that makes DeepSpeed read checkpoint files with its own unpickling loader "
                    "(universal checkpoints, its fast / decoupled writers, DataStates)")
@pytest.mark.parametrize("overrides, key", [
    ({"checkpoint": {"load_universal": True}}, "checkpoint.load_universal=True"),
    ({"deepspeed_extra_args": {"checkpoint": {"load_universal": True}}}, "checkpoint.load_universal=True"),
    ({"checkpoint": {"writer": {"type": "fast"}}}, "checkpoint.writer={'type': 'fast'}"),
    ({"deepspeed_extra_args": {"datastates_ckpt": None}}, "datastates_ckpt=None"),
])
def test_deepspeed_settings_that_load_files_past_the_safe_reader_are_refused(overrides, key):
    assert f"{key} (a DeepSpeed setting" in problems_of(**overrides)


def test_deepspeed_checkpoint_settings_that_load_nothing_pass():
    config = tiny(checkpoint={"load_universal": False, "tag_validation": "Warn"},
                  deepspeed_extra_args={"datastates_ckpt": False}).deepspeed_config
    assert config["checkpoint"] == {"load_universal": False, "tag_validation": "Warn"}
