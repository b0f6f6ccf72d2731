"""Every file in configs/ loads and validates, alone or with the setup files it is meant to be combined with."""

import glob
import os

import pytest

from megatron.neox_arguments import NeoXArgs
from megatron.utils.yaml_text import parse_yaml_text

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs")
SETUP_FILES = ("local_setup.yml", "text_generation.yml", "slurm_local.yml")


def model_configs():
    paths = sorted(glob.glob(os.path.join(CONFIGS, "**", "*.yml"), recursive=True))
    return [os.path.relpath(p, CONFIGS) for p in paths if os.path.basename(p) not in SETUP_FILES]


def gpus_for(path):
    """Enough ranks for the file's pipeline x model parallelism (the shipped files assume a cluster)."""
    values = parse_yaml_text(open(path, encoding="utf-8").read(), path)
    return max(values.get("pipe_parallel_size", 0), 1) * values.get("model_parallel_size", 1)


@pytest.mark.parametrize("name", model_configs())
def test_model_config_loads(name):
    path = os.path.join(CONFIGS, name)
    files = [path]
    own = parse_yaml_text(open(path, encoding="utf-8").read(), path)
    setup = os.path.join(CONFIGS, "local_setup.yml")
    if not set(own) & set(parse_yaml_text(open(setup, encoding="utf-8").read(), setup)):
        files.append(setup)
    args = NeoXArgs.from_ymls(files, overwrite_values={"num_gpus": gpus_for(path)})
    assert args.num_layers >= 1 and args.deepspeed_config["train_batch_size"] >= 1
    assert len(args.attention_config) == args.num_layers


@pytest.mark.parametrize("setup", ["text_generation.yml", "slurm_local.yml"])
def test_setup_files_combine_with_a_model(setup):
    files = [os.path.join(CONFIGS, "125M.yml"), os.path.join(CONFIGS, setup)]
    args = NeoXArgs.from_ymls(files, overwrite_values={"num_gpus": 1})
    assert args.num_layers == 12


def test_quickstart_is_a_complete_cpu_training_config():
    args = NeoXArgs.from_ymls([os.path.join(CONFIGS, "quickstart.yml")])
    assert args.training_problems() == []
    assert args.precision in ("fp32", "bfloat16") and args.global_num_gpus == 1
    assert args.precision_choice.startswith("precision: auto chose")  # decided on this machine, and said
    assert args.data_path == "data/stdlib/stdlib_text_document"


def test_every_config_is_found():
    names = model_configs()
    for expected in ("125M.yml", "20B.yml", "pythia/70M.yml", "llama/7B.yml", "llama2/70B.yml", "mistral/7B.yml",
                     "quickstart.yml", "cpu_tiny.yml", "cpu_tiny_moe.yml", "125M-dmoe.yml", "1-3B-moe.yml"):
        assert expected in names


@pytest.mark.parametrize("name,kind,layers,capacity", [("125M-dmoe.yml", "megablocks", 6, 1.0),
                                                       ("1-3B-moe.yml", "deepspeed", 12, 1.25)])
def test_moe_examples_build_their_experts(name, kind, layers, capacity):
    from megatron.model.config import ModelConfig

    files = [os.path.join(CONFIGS, name), os.path.join(CONFIGS, "local_setup.yml")]
    args = NeoXArgs.from_ymls(files, overwrite_values={"num_gpus": 1})
    config = ModelConfig.from_neox_args(args, padded_vocab_size=50304)
    assert config.moe_type == kind and len(config.moe_layers) == layers and config.moe_num_experts == 8
    assert config.moe_train_capacity_factor == capacity and config.moe_token_dropping == (kind == "deepspeed")


def test_the_post_training_example_chains_pretraining_sft_dpo_and_eval():
    """configs/post_training/: SFT starts from cpu_tiny's checkpoint, DPO from SFT's, on the same model and the
    chat-example tokenizer; eval.py evaluates a stage's result with that stage's config and deepy.py --load."""
    import deepy

    load = lambda name: NeoXArgs.from_ymls([os.path.join(CONFIGS, name)])  # noqa: E731
    pretrain, sft, dpo = load("cpu_tiny.yml"), load("post_training/sft_tiny.yml"), load("post_training/dpo_tiny.yml")
    assert (sft.load, dpo.load) == (pretrain.save, sft.save) and sft.finetune and dpo.finetune
    assert sft.vocab_file == dpo.vocab_file == "data/chat_example/tokenizer/tokenizer.json"
    for key in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "norm", "pos_emb", "activation"):
        assert getattr(sft, key) == getattr(dpo, key) == getattr(pretrain, key), key
    task = "data/chat_example/tasks/docstring_mc.yaml"
    args = deepy.load_args([os.path.join(os.path.dirname(CONFIGS), "eval.py"),
                            os.path.join(CONFIGS, "post_training", "dpo_tiny.yml"), "--load", dpo.save,
                            "--eval_tasks", task])
    assert args.load == dpo.save and args.eval_tasks == [task]


def test_the_reinforce_example_starts_from_cpu_tiny_and_asks_the_documented_server():
    """configs/post_training/reinforce_tiny.yml fine-tunes cpu_tiny's checkpoint (same model and tokenizer) on the
    rollouts of the server docs/post-training.md starts (127.0.0.1:10000), one server request per step."""
    load = lambda name: NeoXArgs.from_ymls([os.path.join(CONFIGS, name)])  # noqa: E731
    pretrain, reinforce = load("cpu_tiny.yml"), load("post_training/reinforce_tiny.yml")
    assert reinforce.load == pretrain.save and reinforce.finetune and reinforce.vocab_file == pretrain.vocab_file
    for key in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "norm", "pos_emb", "activation"):
        assert getattr(reinforce, key) == getattr(pretrain, key), key
    assert (reinforce.train_impl, reinforce.dataset_impl) == ("reinforce", "online")
    assert (reinforce.online_dataserver_ips, reinforce.online_dataserver_ports) == ("127.0.0.1", 10000)
    assert reinforce.train_micro_batch_size_per_gpu == 8 * 4 and reinforce.checkpoint_factor == 1
    assert reinforce.save == "checkpoints/cpu_tiny_reinforce" and reinforce.training_problems() == []
