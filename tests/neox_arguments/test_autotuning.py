"""autotuning_run / the autotuning dict: validation, the config DeepSpeed's autotuner reads, and an experiment's
DeepSpeed config read back into NeoXArgs in the worker (megatron/neox_arguments/autotuning.py)."""

import base64
import json
import os

import pytest

from megatron.neox_arguments import NeoXArgs
from megatron.errors import ConfigError
from megatron.neox_arguments.autotuned import read_deepspeed_config, tuned_args
from megatron.neox_arguments.autotuning import autotuner_config, runner_autotuning_argv
from tests.neox_arguments.helpers import problems_of, tiny

AUTOTUNING = {"enabled": True, "fast": True, "start_profile_step": 1, "end_profile_step": 2,
              "max_train_micro_batch_size_per_gpu": 4, "results_dir": "res", "exps_dir": "exps"}
TUNE = {"autotuning_run": "tune", "autotuning": AUTOTUNING, "zero_optimization": {"stage": [0, 1]},
        "pipe_parallel_size": 0, "num_gpus": 2, "train_iters": 10, "user_script": "train.py",
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}


def encoded(config):
    return base64.urlsafe_b64encode(json.dumps(config).encode("utf-8")).decode("ascii")


def test_the_autotuner_reads_our_config_with_the_search_space_and_no_global_batch():
    args = tiny(**TUNE)
    config = autotuner_config(args)
    assert config["zero_optimization"]["stage"] == [0, 1]
    assert "train_batch_size" not in config  # each experiment's micro batch x accumulation decides it
    assert config["train_micro_batch_size_per_gpu"] == 2 and config["gradient_accumulation_steps"] == 1
    assert config["autotuning"] == {**AUTOTUNING, "mp_size": 1}
    assert config["optimizer"]["type"] == "Adam"
    assert args.deepspeed_config["train_batch_size"] == 4  # the validated args are left as they were
    assert tiny(**{**TUNE, "zero_optimization": None, "zero_stage": "all"}).zero_stage == "all"


def test_runner_argv_asks_for_tuning_and_passes_the_config_file_after_the_script():
    args = tiny(**TUNE)
    argv = runner_autotuning_argv(args, args.get_deepspeed_main_args(), "/tmp/x/ds_config.json")
    script = argv.index("train.py")
    assert argv[script - 2:script] == ["--autotuning", "tune"]
    assert argv[script + 1:] == ["--deepspeed_config", "/tmp/x/ds_config.json"]
    assert argv[argv.index("--num_gpus") + 1] == "2"


@pytest.mark.parametrize("overrides,needle", [
    ({"autotuning": {"enabled": True}, "autotuning_run": None}, "set autotuning_run: tune"),
    ({"autotuning": {"fast": True}}, "needs the autotuning dict with enabled: true"),
    ({"zero_optimization": {"stage": [0, 1]}, "autotuning_run": None}, "lists and 'all' are for DeepSpeed autotuning"),
    ({"zero_optimization": {"stage": [0, 4]}}, "must be 'all' or a non-empty list of 0, 1, 2 and 3"),
    ({"pipe_parallel_size": 1}, "autotuning_run needs pipe_parallel_size: 0"),
    ({"autotuning": {**AUTOTUNING, "metric": "speed"}}, "autotuning.metric='speed' must be one of"),
    ({"autotuning": {**AUTOTUNING, "tuner": "grid"}}, "autotuning.tuner is not a key of DeepSpeed's"),
    ({"autotuning": {**AUTOTUNING, "fast": "yes"}}, "autotuning.fast='yes' must be bool"),
    ({"autotuning": {**AUTOTUNING, "end_profile_step": 1}}, "need 0 <= start < end"),
    ({"train_iters": 2}, "end_profile_step=2 must be < train_iters=2"),
    ({"autotuning": {**AUTOTUNING, "mp_size": 2}}, "autotuning.mp_size=2 must equal model_parallel_size=1"),
    ({"deepspeed_slurm": True}, "through pdsh / MPI / slurm (force_multi, deepspeed_slurm, deepspeed_mpi), is not "
                                "supported yet"),
    ({"moe_num_experts": 2}, "autotuning_run with a mixture of experts"),
    ({"rampup_batch_size": [2, 2, 8]}, "autotuning_run with rampup_batch_size"),
])
def test_what_a_tuning_launch_needs_is_checked_before_launch(overrides, needle):
    assert needle in problems_of(**{**TUNE, **overrides})


def test_gpt_neox_autotuning_section_loads_with_its_arg_mappings():
    """configs/autotuning_configs/small_tune.json of GPT-NeoX (with pipe_parallel_size 0; see the refusal above)."""
    section = {"enabled": True, "arg_mappings": {"train_micro_batch_size_per_gpu": "--train_micro_batch_size_per_gpu",
                                                 "gradient_accumulation_steps ": "--gradient_accumulation_steps"}}
    args = tiny(**{**TUNE, "autotuning": section, "zero_optimization": {"stage": [0, 1, 2, 3]}})
    assert autotuner_config(args)["autotuning"]["arg_mappings"] == section["arg_mappings"]


def experiment_config(args, **changes):
    """An experiment's DeepSpeed config as the autotuner writes it: ours, first values, its batch and ZeRO."""
    config = {**autotuner_config(args), "zero_optimization": {"stage": 1}, "train_micro_batch_size_per_gpu": 3,
              "gradient_accumulation_steps": 2, "train_batch_size": 12, **changes}
    config["autotuning"] = {**config["autotuning"], "metric_path": "/r/z1_gas2_tmbspg3/metrics.json"}
    return config


def test_an_experiment_trains_with_its_batch_and_stage_without_checkpoints_and_logs_beside_its_metrics():
    args = tiny(**TUNE, save="ckpt", load="ckpt", log_dir="logs")
    ds_config = experiment_config(args)
    worker = NeoXArgs.consume_neox_args(["--local_rank=0", "--deepspeed_config", encoded(ds_config)],
                                        environ={"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2",
                                                 "NEOX_ENCODED_CONFIG": args.encode()})
    assert (worker.train_micro_batch_size_per_gpu, worker.gradient_accumulation_steps, worker.train_batch_size,
            worker.zero_stage) == (3, 2, 12, 1)
    assert worker.deepspeed_config == ds_config  # the engine runs with the experiment's config as it is
    assert worker.save is None and worker.load is None and worker.log_dir == "/r/z1_gas2_tmbspg3/logs"
    assert worker.rank == 0 and worker.world_size == 2


def test_the_optimal_config_makes_a_normal_run_that_saves_as_configured(tmp_path):
    args = tiny(**TUNE, save="ckpt", log_dir="logs")
    optimal = experiment_config(args, train_batch_size=None, zero_optimization={"stage": 0, "reduce_scatter": False})
    del optimal["train_batch_size"], optimal["autotuning"]  # as ds_config_optimal.json: the autotuning section popped
    path = tmp_path / "ds_config_optimal.json"
    path.write_text(json.dumps(optimal))
    tuned = tuned_args(args, read_deepspeed_config(str(path)), experiment=False)
    assert tuned.autotuning_run is None and tuned.autotuning is None and "autotuning" not in tuned.deepspeed_config
    assert (tuned.train_batch_size, tuned.zero_stage, tuned.zero_reduce_scatter) == (12, 0, False)
    assert tuned.deepspeed_config["train_batch_size"] == 12
    assert tuned.save == "ckpt" and tuned.log_dir == "logs"


@pytest.mark.parametrize("changes,needle", [
    ({"train_batch_size": 7}, "train_batch_size=7 != 3 x 2 x data-parallel size 2"),
    ({"train_micro_batch_size_per_gpu": 0}, "both must be integers >= 1"),
    ({"zero_optimization": {"stage": 5}}, "zero_optimization.stage=5 must be 0, 1, 2 or 3"),
])
def test_a_config_the_worker_cannot_train_with_is_refused(changes, needle):
    args = tiny(**TUNE)
    with pytest.raises(ConfigError, match="autotuner") as err:
        tuned_args(args, experiment_config(args, **changes), experiment=True)
    assert needle in str(err.value)


def test_a_worker_of_a_tuning_config_needs_the_experiment_config():
    args = tiny(**TUNE)
    with pytest.raises(ConfigError, match="autotuning experiments, which the autotuner starts"):
        NeoXArgs.consume_neox_args(["--neox_config", args.encode()], environ={})
    with pytest.raises(ConfigError, match="neither a DeepSpeed config JSON file nor"):
        read_deepspeed_config("not-base64!")


def test_deepy_autotuning_flag_sets_autotuning_run(tmp_path):
    """GPT-NeoX's `deepy.py --autotuning tune|run` overrides the config's autotuning_run."""
    import yaml

    import deepy

    config = {**TUNE, **{k: v for k, v in tiny().to_dict().items() if k in ("num_layers", "hidden_size",
              "num_attention_heads", "seq_length", "max_position_embeddings")}, "autotuning_run": None,
              "train_micro_batch_size_per_gpu": 1, "data_path": str(tmp_path / "data")}
    del config["user_script"]
    path = tmp_path / "tune.yml"
    path.write_text(yaml.safe_dump(config))
    script = os.path.join(os.path.dirname(deepy.__file__), "train.py")
    assert deepy.load_args([script, str(path), "--autotuning", "run"]).autotuning_run == "run"
    with pytest.raises(ConfigError, match="set autotuning_run: tune"):
        deepy.load_args([script, str(path)])


def test_a_non_fast_experiment_passes_deepspeeds_zero_template_to_the_engine_as_it_is():
    """Without fast, the autotuner fills its own templates (bucket sizes as floats, stage-3 settings)."""
    import hjson
    from deepspeed.autotuning.constants import DEFAULT_TEMPLATE_PATH_ZERO_3

    with open(DEFAULT_TEMPLATE_PATH_ZERO_3, encoding="utf-8") as handle:
        zero = hjson.load(handle)["zero_optimization"]
    args = tiny(**{**TUNE, "zero_optimization": {"stage": "all"}})
    tuned = tuned_args(args, experiment_config(args, zero_optimization=dict(zero)), experiment=True)
    assert tuned.deepspeed_config["zero_optimization"] == zero
    assert (tuned.zero_stage, tuned.zero_reduce_bucket_size, tuned.zero_reduce_scatter) == (3, 5e8, True)


def test_the_optimal_config_counts_only_when_its_experiment_measured_something(tmp_path):
    """DeepSpeed writes a failed experiment (metric 0) as optimal when none ran; deepy.py must not train with it."""
    from megatron.neox_arguments.autotuning import measured_optimal_config

    optimal = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1}}
    assert measured_optimal_config(str(tmp_path)) is None
    (tmp_path / "ds_config_optimal.json").write_text(json.dumps(optimal))
    for name, config in (("z1_gas1_tmbspg2", optimal), ("z0_gas1_tmbspg2", {**optimal, "zero_optimization": {}})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "ds_config.json").write_text(json.dumps({**config, "autotuning": {"enabled": True}}))
    (tmp_path / "z0_gas1_tmbspg2" / "metrics.json").write_text('{"throughput": 5}')
    assert measured_optimal_config(str(tmp_path)) is None  # the optimal one failed: only another measured
    (tmp_path / "z1_gas1_tmbspg2" / "metrics.json").write_text('{"throughput": 3}')
    assert measured_optimal_config(str(tmp_path)) == optimal
