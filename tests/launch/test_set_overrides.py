"""deepy.py's `--set KEY=VALUE` (megatron/neox_arguments/overrides.py): a value for one run, checked exactly as
the YAML files' values are, each problem naming its `--set KEY`, and recorded with the checkpoint's configs."""

import os

import yaml

import deepy
from megatron.checkpoint.format import yaml_values
from megatron.neox_arguments import NeoXArgs
from megatron.neox_arguments.launcher import ENCODED_CONFIG_ENV
from megatron.utils.yaml_text import COMMAND_LINE_OVERRIDES_FILE
from tests.e2e.test_prelaunch import BASE, deepy_main, files  # noqa: F401 (fixtures)


def _load(tmp_path, config, *options):
    path = tmp_path / "run.yml"
    path.write_text(yaml.safe_dump(config))
    return deepy.load_args(["train.py", str(path), *[part for option in options for part in ("--set", option)]])


def _problems(tmp_path, config, *options):
    try:
        _load(tmp_path, config, *options)
    except deepy.ConfigError as err:
        return err.problems
    raise AssertionError("the config was accepted")


def test_values_read_as_yaml_reach_the_arguments_and_dots_reach_into_dicts(tmp_path, files):
    args = _load(tmp_path, {**BASE, **files}, "train_iters=100", "optimizer.params.lr=3e-4", "seq-length=16",
                 "optimizer.params.betas=[0.9, 0.99]", "attention_config=[[[global], 2]]", "iteration=null")
    assert args.train_iters == 100 and args.seq_length == 16 and args.iteration is None
    assert args.optimizer == {"type": "Adam", "params": {"lr": 3e-4, "betas": [0.9, 0.99]}}
    assert args.attention_config == ["global", "global"]
    assert isinstance(args.optimizer["params"]["lr"], float)


def test_a_dotted_key_starts_from_the_default_when_no_file_sets_it(tmp_path, files):
    default = NeoXArgs.from_dict({**BASE, **files}).zero_optimization
    args = _load(tmp_path, {**BASE, **files}, "zero_optimization.stage=1")
    assert args.zero_optimization == {**default, "stage": 1} and default["stage"] != 1


def test_bad_values_and_unknown_keys_name_the_flag_and_the_closest_names(tmp_path, files):
    problems = _problems(tmp_path, {**BASE, **files}, "train_iters=ten", "train_itres=5", "norm=batchnorm")
    text = "\n".join(problems)
    assert "train_iters='ten' (in --set train_iters) must be an integer" in text, text
    assert "unknown argument 'train_itres' in --set train_itres; did you mean 'train_iters'" in text, text
    assert "(in --set norm)" in text and "'layernorm'" in text, text


def test_problems_about_a_set_value_name_the_option_beyond_type_errors(deepy_main, tmp_path, files):
    problems = _problems(tmp_path, {**BASE, **files}, "optimizer.params.lr=abc", "seq_length=64")
    assert "optimizer.params.lr must be a number, got 'abc' (from --set optimizer.params.lr)" in problems, problems
    assert "max_position_embeddings=32 must be >= seq_length=64 (from --set seq_length)" in problems, problems
    code, err, launched = deepy_main({**BASE, **files}, "--set", f"data_path={tmp_path / 'nowhere'}")
    assert code == 2 and launched == [] and err.startswith("Invalid NeoX configuration: data_path: ") \
        and err.rstrip().endswith("(from --set data_path)"), err


def test_malformed_repeated_or_conflicting_options_are_refused(tmp_path, files):
    (malformed, repeated, inside) = _problems(tmp_path, {**BASE, **files}, "train_iters", "seq_length=8",
                                              "seq_length=16", "optimizer=null", "optimizer.type=Adam")
    assert malformed.startswith("--set 'train_iters': write --set KEY=VALUE"), malformed
    assert repeated == "--set seq_length and --set seq_length set the same value; give it once", repeated
    assert inside == "--set optimizer.type and --set optimizer set the same value; give it once", inside
    (through,) = _problems(tmp_path, {**BASE, **files}, "train_iters.warmup=3")
    assert through.startswith("--set train_iters.warmup: train_iters is 8, not a dict"), through
    path = tmp_path / "run.yml"
    try:
        deepy.load_args(["train.py", str(path), "--num_gpus", "1", "--set", "num_gpus=2"])
    except deepy.ConfigError as err:
        assert err.problems == ["--set num_gpus and deepy.py's own flag for num_gpus both set it; give it once"]
    else:
        raise AssertionError("accepted")


def test_the_launched_config_and_the_saved_configs_record_the_overrides(deepy_main, files, tmp_path):
    code, err, launched = deepy_main({**BASE, **files}, "--set", "train_iters=3", "--set", "optimizer.params.lr=2e-4")
    assert code == 0 and len(launched) == 1, err
    args = NeoXArgs.decode(os.environ[ENCODED_CONFIG_ENV])
    assert args.train_iters == 3 and args.optimizer["params"]["lr"] == 2e-4
    text = args.config_files[COMMAND_LINE_OVERRIDES_FILE]
    assert "#   --set optimizer.params.lr=2e-4" in text, text
    folder = tmp_path / "global_step3" / "configs"  # written as checkpoint.engine writes config_files
    folder.mkdir(parents=True)
    for name, content in args.config_files.items():
        (folder / os.path.basename(name)).write_text(content)
    saved = yaml_values(str(folder.parent))
    assert saved["train_iters"] == 3 and saved["optimizer"] == args.optimizer and saved["num_layers"] == 2


def test_help_lists_the_option():
    text = deepy.build_parser().format_help()
    assert "--set KEY=VALUE" in text and "optimizer.params.lr=3e-4" in text
