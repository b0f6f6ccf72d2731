import warnings

import pytest

from megatron.neox_arguments.validation import DERIVED_ONLY
from megatron.neox_arguments import NeoXArgs
from megatron.errors import ConfigError
from tests.neox_arguments.helpers import TINY, tiny


@pytest.mark.parametrize("given,expected", [
    ({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}, (24, 2, 3)),
    ({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 2}, (24, 2, 3)),
    ({"train_batch_size": 24, "gradient_accumulation_steps": 3}, (24, 2, 3)),
    ({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}, (24, 2, 3)),
    ({"train_batch_size": 8}, (8, 2, 1)),
    ({"batch_size": 2}, (8, 2, 1)),
])
def test_batch_triple_is_solved_from_any_two(given, expected):
    base = {k: v for k, v in TINY.items() if k != "train_micro_batch_size_per_gpu"}
    args = NeoXArgs.from_dict({**base, "num_gpus": 4, **given})
    assert args.data_parallel_size == 4
    assert (args.train_batch_size, args.train_micro_batch_size_per_gpu, args.gradient_accumulation_steps) == expected


def test_no_batch_size_is_an_error_for_training_only():
    base = {k: v for k, v in TINY.items() if k != "train_micro_batch_size_per_gpu"}
    args = NeoXArgs.from_dict(base)  # generation and evaluation need no batch size
    assert args.train_batch_size is None
    assert any("no batch size" in p for p in args.training_problems())


def test_data_parallel_size_accounts_for_pipe_and_model_parallelism():
    args = tiny(num_gpus=8, pipe_parallel_size=2, model_parallel_size=2)
    assert args.data_parallel_size == 2 and args.is_pipe_parallel and args.train_batch_size == 4
    assert tiny(num_gpus=2, pipe_parallel_size=0).is_pipe_parallel is False
    assert tiny(num_gpus=2, pipe_parallel_size=1).data_parallel_size == 2


def test_precision_from_the_dicts():
    assert tiny().precision == "fp32"
    assert tiny(bf16={"enabled": True}).precision == "bfloat16"
    fp16 = tiny(fp16={"enabled": True, "loss_scale": 0, "loss_scale_window": 500, "hysteresis": 3,
                      "min_loss_scale": 2})
    assert fp16.precision == "fp16" and fp16.dynamic_loss_scale is True
    assert (fp16.loss_scale_window, fp16.hysteresis, fp16.min_scale) == (500, 3, 2)
    static = tiny(fp16={"enabled": True, "loss_scale": 128})
    assert static.dynamic_loss_scale is False and static.loss_scale == 128
    assert tiny(fp16={"enabled": True, "type": "bfloat16"}).precision == "bfloat16"
    explicit = tiny(precision="bfloat16")
    assert explicit.deepspeed_config["bf16"] == {"enabled": True}


def test_zero_and_optimizer_are_mirrored():
    args = tiny(zero_optimization={"stage": 2, "reduce_scatter": True, "contiguous_gradients": False,
                                   "reduce_bucket_size": 123, "allgather_bucket_size": 456},
                optimizer={"type": "Lion", "params": {"lr": 3e-4}}, gradient_clipping=0.5)
    assert (args.zero_stage, args.zero_reduce_scatter, args.zero_contiguous_gradients) == (2, True, False)
    assert (args.zero_reduce_bucket_size, args.zero_allgather_bucket_size) == (123, 456)
    assert args.optimizer_type == "lion" and args.lr == pytest.approx(3e-4) and args.clip_grad == 0.5
    assert tiny().zero_stage == 0


def test_attention_config_is_expanded_once_at_derivation():
    assert tiny(attention_config=[[["flash"], "all"]]).attention_config == ["flash", "flash"]


def test_derived_config_rederives_to_the_same_values():
    args = tiny(attention_config=[[["global", "local"], 1]], num_gpus=2, gradient_accumulation_steps=2)
    again = NeoXArgs.from_dict({k: v for k, v in args.to_dict().items()
                                if k not in DERIVED_ONLY})
    assert again.to_dict() == args.to_dict()


def test_text_gen_type_and_max_position_embeddings_defaults():
    base = {k: v for k, v in TINY.items() if k != "max_position_embeddings"}
    args = NeoXArgs.from_dict(base)
    assert args.max_position_embeddings == 32 and args.text_gen_type == "unconditional"
    assert tiny(sample_input_file="p.txt").text_gen_type == "input-file"


def test_global_num_gpus_from_hostfile_with_filters(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# cluster\nworker-0 slots=4\nworker-1 slots=4\nworker-2 slots=4\n")
    base = {k: v for k, v in TINY.items() if k != "num_gpus"}
    count = lambda **kw: NeoXArgs.from_dict({**base, "hostfile": str(hostfile), **kw}).global_num_gpus
    assert count() == 12
    assert count(num_nodes=2) == 8
    assert count(num_gpus=2) == 6
    assert count(include="worker-0@worker-1:0,2") == 6
    assert count(exclude="worker-2") == 8
    assert count(exclude="worker-1:0") == 11


def test_bad_hostfile_is_a_config_error(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("worker-0 gpus=4\n")
    base = {k: v for k, v in TINY.items() if k != "num_gpus"}
    with pytest.raises(ConfigError, match="slots=N"):
        NeoXArgs.from_dict({**base, "hostfile": str(hostfile)})


@pytest.mark.parametrize("num_gpus,expected", [(None, "local"), (2, 2)])
def test_missing_hostfile_means_the_local_node_with_one_warning(tmp_path, num_gpus, expected):
    """GPT-NeoX's 125M.yml ships hostfile: /mock_path; GPT-NeoX and DeepSpeed's runner fall back to this node."""
    from megatron.errors import NeoXConfigWarning
    from megatron.neox_arguments.hostfile import local_device_count

    placeholder = str(tmp_path / "mock_path")
    base = {k: v for k, v in TINY.items() if k != "num_gpus"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        args = NeoXArgs.from_dict({**base, "hostfile": placeholder, "num_gpus": num_gpus})
    assert args.global_num_gpus == (local_device_count() if expected == "local" else expected)
    assert args.hostfile == placeholder
    [message] = [str(w.message) for w in caught if issubclass(w.category, NeoXConfigWarning)]
    assert f"hostfile '{placeholder}' does not exist" in message and "local node" in message


def test_num_gpus_on_a_cpu_machine_counts_cpu_ranks():
    assert tiny(num_gpus=2).global_num_gpus == 2
    assert tiny(num_gpus=2, num_nodes=3).global_num_gpus == 6


def test_validated_args_are_frozen_in_deepy_and_in_the_workers():
    args = tiny(train_iters=10)
    with pytest.raises(AttributeError, match="frozen: 'train_iters' cannot be changed"):
        args.train_iters = 20
    worker = NeoXArgs.consume_neox_args(["--neox_config", args.encode()], environ={"RANK": "0", "LOCAL_RANK": "0",
                                                                                  "WORLD_SIZE": "1"})
    assert worker.rank == 0 and worker.to_dict() == {**args.to_dict(), "rank": 0, "local_rank": 0, "world_size": 1}
    with pytest.raises(AttributeError, match="frozen"):
        worker.padded_vocab_size = 128
