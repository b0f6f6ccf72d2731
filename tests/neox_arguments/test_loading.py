import warnings

import pytest

from megatron.neox_arguments import NeoXArgs
from megatron.errors import ConfigError

FLOW = """# GPT-NeoX style: flow mapping, comments, trailing commas, True/False
{
  # the model
  "num-layers": 2,
  "hidden_size": 64, "num_attention_heads": 4,
  "seq-length": 32, "max_position_embeddings": 32,
  "train_micro_batch_size_per_gpu": 2,
  "optimizer": {"type": "Adam", "params": {"lr": 6e-4, "betas": [0.9, 0.95], "eps": 1.0e-8,},},
  "bf16": {"enabled": True,},
  "num_gpus": 1,
}
"""


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_flow_style_yaml_with_comments_trailing_commas_and_dashes(tmp_path):
    args = NeoXArgs.from_ymls([write(tmp_path, "a.yml", FLOW)])
    assert args.num_layers == 2 and args.seq_length == 32
    assert args.lr == pytest.approx(6e-4)  # 6e-4 is a float, not YAML 1.1's string
    assert args.optimizer["params"]["eps"] == pytest.approx(1e-8)
    assert args.precision == "bfloat16"


def test_several_files_merge_and_raw_text_is_kept(tmp_path):
    a = write(tmp_path, "model.yml", "{num_layers: 2, hidden_size: 64, num_attention_heads: 4, seq_length: 32}")
    b = write(tmp_path, "setup.yml", "train_micro_batch_size_per_gpu: 2\nnum_gpus: 1\n")
    args = NeoXArgs.from_ymls([a, b])
    assert args.hidden_size == 64 and args.train_micro_batch_size_per_gpu == 2
    assert set(args.config_files) == {"model.yml", "setup.yml"}
    assert args.config_files["setup.yml"].startswith("train_micro_batch_size_per_gpu")


def test_same_key_in_two_files_names_both_files_and_the_key(tmp_path):
    a = write(tmp_path, "one.yml", FLOW)
    b = write(tmp_path, "two.yml", "{train-micro-batch-size-per-gpu: 4}")
    with pytest.raises(ConfigError) as err:
        NeoXArgs.from_ymls([a, b])
    text = str(err.value)
    assert "train_micro_batch_size_per_gpu" in text and "one.yml" in text and "two.yml" in text


def test_dash_and_underscore_spelling_in_one_file_is_a_duplicate(tmp_path):
    path = write(tmp_path, "dup.yml", "{train-iters: 1, train_iters: 2}")
    with pytest.raises(ConfigError, match="train_iters"):
        NeoXArgs.from_ymls([path])


def test_yaml_syntax_error_names_the_file_and_line(tmp_path):
    path = write(tmp_path, "broken.yml", "{\n  num_layers: 2,\n  hidden_size: [64,\n}\n")
    with pytest.raises(ConfigError) as err:
        NeoXArgs.from_ymls([path])
    assert "broken.yml" in str(err.value) and "line" in str(err.value)


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="nope.yml"):
        NeoXArgs.from_ymls([str(tmp_path / "nope.yml")])


def test_config_names_without_suffix_are_read_as_yml(tmp_path):
    """GPT-NeoX's deepy.py: `-d configs 125M local_setup` is configs/125M.yml configs/local_setup.yml."""
    from megatron.neox_arguments.loading import resolve_config_paths

    write(tmp_path, "plain", "{}")  # a file that exists under the name as given is taken as it is
    d = str(tmp_path)
    assert resolve_config_paths(["125M", "local_setup.yml", "slurm.json", "x.yaml", "plain"], d) == \
        [f"{d}/125M.yml", f"{d}/local_setup.yml", f"{d}/slurm.json", f"{d}/x.yaml", f"{d}/plain"]
    assert resolve_config_paths(["configs/pythia/70M"]) == ["configs/pythia/70M.yml"]


def test_overrides_win_over_files_without_a_duplicate_error(tmp_path):
    args = NeoXArgs.from_ymls([write(tmp_path, "a.yml", FLOW)], overwrite_values={"num-layers": 4})
    assert args.num_layers == 4


def test_older_names_are_mapped_with_a_deprecation_warning(tmp_path):
    text = FLOW.replace('"num_gpus": 1,', '"num_gpus": 1, "gas": 3, "save_interval": 50,')
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        args = NeoXArgs.from_ymls([write(tmp_path, "old.yml", text)])
    assert args.gradient_accumulation_steps == 3 and args.train_batch_size == 6
    assert args.checkpoint_factor == 50
    messages = " ".join(str(w.message) for w in caught)
    assert "'gas' is deprecated" in messages and "'save_interval' is deprecated" in messages


def test_zero_allow_untested_optimizer_moves_to_deepspeed_extra_args(tmp_path):
    text = FLOW.replace('"num_gpus": 1,', '"num_gpus": 1, "zero_allow_untested_optimizer": True,')
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = NeoXArgs.from_ymls([write(tmp_path, "old.yml", text)])
    assert args.deepspeed_config["zero_allow_untested_optimizer"] is True


def test_older_and_newer_name_together_is_an_error():
    with pytest.raises(ConfigError, match="'gas'.*gradient_accumulation_steps"):
        NeoXArgs.from_dict({"num_layers": 1, "hidden_size": 8, "num_attention_heads": 1, "seq_length": 8,
                            "gas": 2, "gradient_accumulation_steps": 2, "train_micro_batch_size_per_gpu": 1})


def test_removed_older_names_are_refused_with_the_fix():
    with pytest.raises(ConfigError, match="detect_nvlink_pairs.*delete the key"):
        NeoXArgs.from_dict({"num_layers": 1, "hidden_size": 8, "num_attention_heads": 1, "seq_length": 8,
                            "train_micro_batch_size_per_gpu": 1, "detect_nvlink_pairs": True})


@pytest.mark.attack("a YAML config (or a checkpoint's configs/*.yml) with a python/object tag that runs a command "
                    "when the file is read")
def test_yaml_python_tags_are_refused_and_never_run(tmp_path):
    from megatron.checkpoint.format import yaml_values
    from megatron.errors import CheckpointError, ConfigError
    from megatron.neox_arguments import NeoXArgs

    marker = tmp_path / "ran"
    payload = f"num_layers: !!python/object/apply:os.system ['touch {marker}']\n"
    (tmp_path / "evil.yml").write_text(payload)
    with pytest.raises(ConfigError, match=rf"{tmp_path / 'evil.yml'}: .*python/object/apply:os.system"):
        NeoXArgs.from_ymls([str(tmp_path / "evil.yml")])
    (tmp_path / "global_step1" / "configs").mkdir(parents=True)
    (tmp_path / "global_step1" / "configs" / "model.yml").write_text(payload)
    with pytest.raises(CheckpointError, match="python/object/apply:os.system"):
        yaml_values(str(tmp_path / "global_step1"))
    assert not marker.exists()
