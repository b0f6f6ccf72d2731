"""Each validation rule, checked through the message naming the key."""

import warnings

import pytest

from megatron.model.config import ModelConfig
from megatron.neox_arguments import NeoXArgs
from megatron.errors import ConfigError, NeoXConfigWarning
from megatron.neox_arguments.validation import DERIVED_ONLY
from tests.neox_arguments.helpers import RM_ARGS, TINY, problems_of, tiny


def test_all_problems_are_reported_at_once():
    text = problems_of(hidden_size=63, min_lr=1.0, optimizer={"type": "Adam", "params": {"lr": 0.1}},
                       split="a,b")
    assert "hidden_size=63" in text and "min_lr=1.0" in text and "split=" in text
    assert "3 problems" in text


def test_type_errors_do_not_hide_the_other_problems():
    text = problems_of(num_attention_heads=5, hidden_dropout="x", num_layer=3)
    assert "hidden_dropout='x'" in text and "unknown argument 'num_layer'" in text
    assert "hidden_size=64 must be divisible by num_attention_heads=5" in text
    assert "3 problems" in text
    # what validation would say about a dropped value is noise, left out
    assert problems_of(hidden_size="big").count("hidden_size") == 1


def test_unknown_key_suggests_the_closest_name():
    text = problems_of(num_layer=3)
    assert "unknown argument 'num_layer'" in text and "did you mean 'num_layers'" in text


@pytest.mark.parametrize("key,value,expected", [
    ("num_layers", "two", "an integer"),
    ("hidden_dropout", "x", "a number"),
    ("no_weight_tying", 1, "true or false"),
    ("norm", "batchnorm", "one of 'layernorm'"),
    ("pos_emb", "rope", "one of 'learned'"),
    ("activation", "tanh", "'swiglu'"),
    ("train_data_paths", "a", "a list"),
    ("optimizer", [1], "a dict"),
    ("tokenizer_type", "BPE", "'HFTokenizer'"),
])
def test_types_and_choices_name_key_value_and_what_is_allowed(key, value, expected):
    text = problems_of(**{key: value})
    assert key in text and repr(value) in text and expected in text


@pytest.mark.parametrize("key,written,declared", [
    ("tokenizer_type", "hftokenizer", "HFTokenizer"),
    ("tokenizer_type", "GPT2BPETOKENIZER", "GPT2BPETokenizer"),
    ("norm", "RMSNorm", "rmsnorm"),
    ("launcher", "OpenMPI", "openmpi"),
])
def test_choices_in_any_case_become_the_declared_spelling(key, written, declared):
    """GPT-NeoX compares choices without regard to case (`tokenizer_type: hftokenizer`)."""
    assert getattr(tiny(**{key: written}), key) == declared


def test_int_is_accepted_for_a_float_and_converted():
    assert tiny(hidden_dropout=0).hidden_dropout == 0.0 and isinstance(tiny(hidden_dropout=0).hidden_dropout, float)


def test_required_model_fields():
    with pytest.raises(ConfigError) as err:
        NeoXArgs.from_dict({"train_micro_batch_size_per_gpu": 1})
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
        assert f"'{name}' is required" in str(err.value)


@pytest.mark.parametrize("overrides,needle", [
    ({"hidden_size": 66}, "hidden_size=66 must be divisible by num_attention_heads=4"),
    ({"num_kv_heads": 3}, "num_kv_heads=3 must divide num_attention_heads=4"),
    ({"num_kv_heads": 1, "model_parallel_size": 2, "num_gpus": 2}, "num_kv_heads=1 must be divisible by model_parallel_size=2"),
    ({"max_position_embeddings": 16}, "max_position_embeddings=16 must be >= seq_length=32"),
    ({"min_lr": 0.1, "optimizer": {"type": "Adam", "params": {"lr": 0.01}}}, "min_lr=0.1 must be <= lr=0.01"),
    ({"min_lr": -0.1, "optimizer": {"type": "Adam", "params": {"lr": -0.01}}}, "lr=-0.01 must be >= 0"),
    ({"min_lr": -0.1, "optimizer": {"type": "Adam", "params": {"lr": -0.01}}}, "min_lr=-0.1 must be >= 0"),
    ({"train_iters": 10, "train_epochs": 1}, "train_iters=10 and train_epochs=1 are both set"),
    ({"train_iters": 10, "train_samples": 40}, "train_iters=10 and train_samples=40 are both set"),
    ({"train_samples": 0}, "train_samples=0 must be >= 1"),
    ({"exit_duration_in_mins": 0}, "exit_duration_in_mins=0.0 must be > 0 (minutes)"),
    ({"adlr_autoresume_interval": 50}, "adlr_autoresume_interval=50 is a setting of adlr_autoresume; set "
                                       "adlr_autoresume: true or remove it"),
    ({"adlr_autoresume": True, "adlr_autoresume_interval": 0}, "adlr_autoresume_interval=0 must be >= 1"),
    ({"rampup_batch_size": [4, 4]}, "rampup_batch_size=[4, 4] must be three integers"),
    ({"recompute_num_layers": 2}, "recompute_num_layers=2 needs recompute_granularity: full"),
    ({"recompute_granularity": "selective", "recompute_method": "uniform"},
     "recompute_method='uniform' is a setting of recompute_granularity 'full', not 'selective'"),
    ({"recompute_granularity": "selective", "checkpoint_activations": True},
     "recompute_granularity 'selective' with checkpoint_activations: true"),
    ({"recompute_granularity": "full", "recompute_method": "block", "checkpoint_num_layers": 2},
     "recompute_method 'block' with checkpoint_num_layers=2"),
    ({"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 0},
     "recompute_num_layers=0 must be >= 1"),
    ({"recompute_granularity": "full", "checkpoint_activations": False},
     "recompute_granularity 'full' with checkpoint_activations: false"),
    ({"recompute_granularity": "full", "recompute_num_layers": 2, "checkpoint_num_layers": 1},
     "recompute_num_layers=2 and checkpoint_num_layers=1 are one setting"),
    ({"rampup_batch_size": [2, 2, 10], "train_iters": 10, "train_batch_size": 8},
     "rampup_batch_size needs the run's length as train_samples"),
    ({"rampup_batch_size": [2, 4, 10], "train_samples": 10, "train_batch_size": 8},
     "the batch must grow from start=2 to train_batch_size=8 in whole increments of 4"),
    ({"rampup_batch_size": [2, 2, 10], "train_samples": 10, "train_batch_size": 8, "num_gpus": 2},
     "must be multiples of train_micro_batch_size_per_gpu x data-parallel size = 2 x 2 = 4"),
    ({"rampup_batch_size": [2, 2, 10], "train_samples": 10, "train_batch_size": 8,
      "scheduler": {"type": "WarmupLR", "params": {}}}, "rampup_batch_size with a DeepSpeed `scheduler` dict"),
    ({"data_path": "a", "train_data_paths": ["b"], "valid_data_paths": ["c"], "test_data_paths": ["d"]},
     "data_path and train_data_paths"),
    ({"train_data_paths": ["b"]}, "without valid_data_paths, test_data_paths"),
    ({"train_data_paths": ["a", "b"], "valid_data_paths": ["c"], "test_data_paths": ["d"],
      "train_data_weights": [1.0]}, "train_data_weights has 1 entries but train_data_paths has 2"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "fp16.enabled and bf16.enabled are both true"),
    ({"pipe_parallel_size": 1, "zero_optimization": {"stage": 2}}, "zero_optimization.stage=2 cannot be combined"),
    ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage=4 must be 0, 1, 2 or 3"),
    ({"num_unique_layers": 3}, "num_unique_layers=3 must divide num_layers=2"),
    ({"num_unique_layers": 1, "pipe_parallel_size": 1}, "set pipe_parallel_size: 0"),
    ({"param_sharing_style": "spaced"}, "num_unique_layers is not set"),
    ({"num_unique_layers": 1, "param_sharing_style": "interleaved"}, "param_sharing_style='interleaved' must be one"),
    ({"attention_config": [[["global"], 3]]}, "attention_config expands to 3 layers but num_layers=2"),
    ({"attention_config": [[["globall"], 2]]}, "unknown attention type 'globall'"),
    ({"attention_config": [["global", 2]]}, "each attention_config entry must be [[types...], count]"),
    ({"attention_config": [[["sparse_fixed"], 2]], "sparsity_config": {"block": 5}},
     "seq_length=32 must be divisible by block=5"),
    ({"attention_config": [[["gmlp"], 2]], "activation": "swiglu"}, "a GLU activation does not apply"),
    ({"num_gpus": 3, "model_parallel_size": 2}, "global_num_gpus=3 is not divisible"),
    ({"train_batch_size": 5, "num_gpus": 2}, "train_batch_size=5 is not a multiple"),
    ({"train_batch_size": 8, "gradient_accumulation_steps": 3},
     "train_batch_size=8 != train_micro_batch_size_per_gpu=2 x gradient_accumulation_steps=3"),
    ({"rotary_pct": 1.5, "pos_emb": "rotary"}, "rotary_pct=1.5 must be in (0, 1]"),
    ({"gpt_j_tied": True}, "gpt_j_tied=true needs gpt_j_residual=true"),
    ({"warmup": 2.0}, "warmup=2.0"),
    ({"split": "1,2,3,4"}, "split='1,2,3,4'"),
    ({"pipe_partition_method": "balanced"}, "pipe_partition_method='balanced'"),
    ({"use_mup": True}, "use_mup needs base_shapes_file"),
    ({"train_impl": "reinforce"}, "train_impl 'reinforce' trains on rollouts from a rollout server: set dataset_impl: "
                                  "online"),
    ({"dataset_impl": "online"}, "dataset_impl 'online' (rollouts with rewards) is read by train_impl 'reinforce' "
                                 "only"),
    ({"kl_impl": "abs"}, "kl_impl='abs' is a setting of train_impl 'reinforce'"),
    ({"online_dataserver_ports": 10001}, "online_dataserver_ports=10001 is a setting of dataset_impl 'online'"),
    ({"train_impl": "reinforce", "dataset_impl": "online", "kl_div_beta": -1.0}, "kl_div_beta=-1.0 must be >= 0"),
    ({"train_impl": "reinforce", "dataset_impl": "online", "pipe_parallel_size": 2, "num_gpus": 2},
     "dataset_impl 'online' with pipe_parallel_size=2"),
    ({"train_impl": "reinforce", "dataset_impl": "online", "num_gpus": 2, "online_dataserver_ports": [1, 2, 3]},
     "online_dataserver_ports has 3 entries for 2 data-parallel ranks"),
    ({"train_impl": "kto", "train_micro_batch_size_per_gpu": 3},
     "train_micro_batch_size_per_gpu=3: train_impl 'kto' estimates its KL reference point"),
    ({"train_reward_data_paths": ["r"]}, "train_reward_data_paths is read by train_impl 'kto' only"),
    ({"train_impl": "dpo"}, "train_impl 'dpo' trains on chosen / rejected pairs: set dataset_impl: pairwise"),
    ({"dpo_beta": 0.5}, "dpo_beta=0.5 is a setting of train_impl 'dpo'"),
    ({"train_impl": "rm"}, "train_impl 'rm' trains on chosen / rejected pairs: set dataset_impl: pairwise"),
    ({"moe_num_experts": 4, "moe_type": "deepspeed", "moe_router_type": "sinkhorn"},
     "DeepSpeed's MoE layer routes with its own top-k gate"),
    ({"moe_num_experts": 4, "moe_type": "deepspeed", "moe_jitter_eps": 0.1}, "fixed eps of 0.01"),
    ({"moe_top_k": 2}, "moe_top_k=2 is a setting of mixture of experts, which is off (moe_num_experts=1)"),
    ({"moe_num_experts": 4, "moe_top_k": 5}, "moe_top_k=5 must be between 1 and moe_num_experts=4"),
    ({"moe_num_experts": 4, "moe_token_dropping": True}, "moe_token_dropping=true with moe_type='megablocks'"),
    ({"moe_num_experts": 6, "moe_expert_parallel_size": 2, "num_gpus": 4, "model_parallel_size": 2},
     "moe_num_experts=6 must be divisible by moe_expert_parallel_size x model_parallel_size = 2 x 2"),
    ({"moe_num_experts": 3, "model_parallel_size": 2, "num_gpus": 2},
     "moe_num_experts=3 must be divisible by moe_expert_parallel_size x model_parallel_size = 1 x 2"),
    ({"moe_num_experts": 4, "moe_use_residual": True}, "moe_use_residual=true with moe_type='megablocks'"),
    ({"moe_num_experts": 4, "moe_train_capacity_factor": 2.0}, "only applies with moe_token_dropping: true"),
    ({"moe_num_experts": 4, "use_tutel": True, "moe_type": "deepspeed"},
     "tutel cannot be installed as a dependency (the package is not on the Python package registry, PyPI: it "
     "installs from its GitHub repository and builds CUDA kernels, so it needs CUDA)"),
    ({"moe_num_experts": 4, "expert_interval": 2, "moe_expert_interval": 3}, "are one setting"),
    ({"moe_num_experts": 4, "moe_glu": True, "activation": "softsign"}, "moe_glu=true with activation='softsign'"),
    ({"moe_num_experts": 4, "zero_optimization": {"stage": 3}}, "zero_optimization.stage=3 with a mixture of experts"),
    ({"mup_width_scale": 4}, "mup_width_scale=4 is a muP setting and only takes effect with use_mup: true"),
    ({"kto_beta": 0.5}, "kto_beta=0.5 is a setting of train_impl 'kto'"),
    ({"deepspeed": False}, "deepspeed=False: DeepSpeed is the engine here"),
    ({"sequence_parallel": True}, "sequence_parallel=true needs model_parallel_size > 1"),
    ({"comment": "x"}, "comment / account are slurm options"),
    ({"zero_stage": "all"}, "lists and 'all' are for DeepSpeed autotuning"),
    ({"soft_prompt_tuning": {"enabled": True, "n_token": 3}}, "soft_prompt_tuning has unknown keys ['n_token']"),
    ({"deepspeed_extra_args": {"num_layers": 3}}, "deepspeed_extra_args['num_layers']: 'num_layers' is a NeoX argument"),
    ({"data_parallel_size": 2}, "'data_parallel_size' is computed"),
    ({"optimizer": {"type": "Adamw"}}, "optimizer.type='adamw' must be one of"),
    ({"layernorm_fusion": True, "norm": "rmsnorm"}, "layernorm_fusion=true fuses norm='layernorm'"),
    ({"rope_fusion": True, "pos_emb": "learned"}, "rope_fusion=true fuses rotary embeddings"),
    ({"bias_gelu_fusion": True, "activation": "swiglu"}, "bias_gelu_fusion=true fuses activation='gelu'"),
    ({"use_flashattn_swiglu": True, "activation": "geglu"}, "use_flashattn_swiglu=true replaces activation='swiglu'"),
    ({"make_vocab_size_divisible_by": 0}, "make_vocab_size_divisible_by=0 must be >= 1"),
    ({"lr_warmup_iters": 10, "warmup": 0.02}, "lr_warmup_iters=10 and warmup=0.02 are both set"),
    ({"lr_warmup_iters": -1}, "lr_warmup_iters=-1 must be >= 0"),
    ({"lr": 1e-3, "lr_warmup_init": 2e-3}, "lr_warmup_init=0.002 must be in [0, lr=0.001]"),
    ({"lr_decay_style": "wsd"}, "lr_decay_style 'wsd' needs lr_wsd_decay_iters"),
    ({"lr_wsd_decay_iters": 5}, "lr_wsd_decay_iters is only read by lr_decay_style 'wsd'"),
    ({"lr_wsd_decay_style": "linear", "lr_decay_style": "cosine"}, "lr_wsd_decay_style is only read by"),
    ({"lr_decay_style": "wsd", "lr_wsd_decay_iters": 0}, "lr_wsd_decay_iters=0 must be >= 1"),
    ({"lr_decay_style": "wsd", "lr_wsd_decay_iters": 95, "train_iters": 100, "lr_warmup_iters": 10},
     "lr_wsd_decay_iters=95 is longer than the decay iterations after warmup (100 - 10)"),
    ({"lr_decay_samples": 400, "train_iters": 100}, "lr_decay_samples=400 counts the schedule in samples, which "
     "needs the run's length as train_samples (as in Megatron-LM); with train_iters or train_epochs use lr_decay_iters"),
    ({"lr_decay_samples": 400, "lr_decay_iters": 50, "train_samples": 800},
     "lr_decay_samples=400 and lr_decay_iters=50 are both set"),
    ({"lr_warmup_samples": 40, "warmup": 0.1, "train_samples": 800}, "lr_warmup_samples=40 and warmup=0.1 are both"),
    ({"lr_warmup_samples": 40, "lr_warmup_iters": 5, "train_samples": 800},
     "lr_warmup_samples=40 and lr_warmup_iters=5 are both set"),
    ({"lr_decay_samples": 0, "train_samples": 800}, "lr_decay_samples=0 must be >= 1"),
    ({"lr_wsd_decay_samples": 40, "train_samples": 800}, "lr_wsd_decay_samples is only read by lr_decay_style 'wsd'"),
    ({"lr_decay_style": "wsd", "lr_wsd_decay_samples": 40, "lr_wsd_decay_iters": 5, "train_samples": 800},
     "lr_wsd_decay_samples=40 and lr_wsd_decay_iters=5 are both set"),
    ({"lr_decay_style": "wsd", "lr_wsd_decay_samples": 790, "lr_warmup_samples": 20, "train_samples": 800,
      "train_batch_size": 8}, "lr_wsd_decay_samples=790 is longer than the decay iterations after warmup (100 - 2.5)"),
    ({"decoupled_min_lr": 1e-4}, "decoupled_min_lr=0.0001 needs decoupled_lr"),
    ({"decoupled_lr": 1e-4, "decoupled_min_lr": 2e-4}, "decoupled_min_lr <= decoupled_lr"),
    ({"start_weight_decay": -0.1, "weight_decay_incr_style": "linear"}, "start_weight_decay=-0.1 must be >= 0"),
    ({"start_weight_decay": 0.0, "end_weight_decay": 0.1}, "differ but weight_decay_incr_style is 'constant'"),
    ({"end_weight_decay": 0.2, "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "weight_decay": 0.1}}},
     "start_weight_decay=0.1 and end_weight_decay=0.2 differ"),  # the start is the optimizer's weight_decay
    ({"scheduler": {"type": "WarmupLR", "params": {}}, "decoupled_lr": 1e-3},
     "decoupled_lr=0.001 configures the built-in learning-rate schedule"),
])
def test_rule(overrides, needle):
    assert needle in problems_of(**overrides)


@pytest.mark.parametrize("moe_type", ["deepspeed", "megablocks"])
@pytest.mark.parametrize("overrides,message", [
    ({"moe_expert_parallel_size": 2, "num_gpus": 3, "train_batch_size": 6},
     "moe_expert_parallel_size=2 must divide the data-parallel size 3 (the experts are split over groups of "
     "data-parallel ranks)"),
    ({"moe_num_experts": 6, "moe_expert_parallel_size": 4, "num_gpus": 4, "train_batch_size": 8},
     "moe_num_experts=6 must be divisible by moe_expert_parallel_size=4 (each expert-parallel rank holds "
     "moe_num_experts / moe_expert_parallel_size experts)"),
])
def test_expert_parallel_size_that_does_not_divide_gives_one_message(overrides, message, moe_type):
    assert problems_of(**{"moe_num_experts": 4, "moe_type": moe_type, **overrides}) == \
        f"Invalid NeoX configuration: {message}"


@pytest.mark.parametrize("overrides", [
    {}, {"moe_expert_parallel_size": 2}, {"moe_type": "deepspeed"},
    {"moe_type": "deepspeed", "moe_expert_parallel_size": 2},
    {"moe_type": "deepspeed", "moe_expert_parallel_size": 2, "enable_expert_tensor_parallelism": True}])
def test_moe_with_sequence_parallel_validates(overrides):
    """Both layers gather the sequence, with and without expert parallelism (tests/model/test_moe_parallel_extras.py,
    tests/model/test_moe_expert_parallel.py)."""
    args = tiny(moe_num_experts=4, model_parallel_size=2, num_gpus=4, train_batch_size=4, sequence_parallel=True,
                **overrides)
    assert args.sequence_parallel and args.moe_expert_parallel_size == overrides.get("moe_expert_parallel_size", 1)


def test_per_parameter_logging_with_expert_parallelism_validates():
    """The values are gathered from every expert-parallel rank (tests/model/test_moe_parallel_extras.py), with
    tensor parallelism too (tests/model/test_moe_expert_parallel.py)."""
    args = tiny(moe_num_experts=4, moe_type="deepspeed", moe_expert_parallel_size=2, num_gpus=2,
                train_batch_size=4, log_grad_norm=True, log_param_norm=True, log_grad_pct_zeros=True,
                log_optimizer_states=True)
    assert args.log_grad_norm and args.moe_expert_parallel_size == 2
    args = tiny(moe_num_experts=4, moe_expert_parallel_size=2, model_parallel_size=2, num_gpus=4,
                train_batch_size=4, log_grad_norm=True)
    assert args.log_grad_norm and args.model_parallel_size == 2


def test_expert_tensor_parallelism_validates_with_deepspeeds_layer_only():
    """DeepSpeed's experts split over the tensor-parallel ranks (tests/model/test_moe_expert_parallel.py); the dropless
    layer splits whole experts already."""
    args = tiny(moe_num_experts=4, moe_type="deepspeed", model_parallel_size=2, num_gpus=2,
                enable_expert_tensor_parallelism=True)
    assert args.enable_expert_tensor_parallelism
    with pytest.raises(ConfigError, match="enable_expert_tensor_parallelism=true with moe_type='megablocks'"):
        tiny(moe_num_experts=4, moe_type="megablocks", model_parallel_size=2, num_gpus=2,
             enable_expert_tensor_parallelism=True)


@pytest.mark.parametrize("moe_type", ["deepspeed", "megablocks"])
def test_expert_parallelism_validates(moe_type):
    args = tiny(moe_num_experts=4, moe_type=moe_type, moe_expert_parallel_size=2, num_gpus=4,
                train_batch_size=8, zero_optimization={"stage": 2})
    assert args.moe_expert_parallel_size == 2 and args.data_parallel_size == 4


def test_fp16_is_not_refused_at_load_time_on_a_cpu_machine():
    args = tiny(fp16={"enabled": True})  # deepy.py may run on a head node without GPUs
    assert args.precision == "fp16"


def test_fp16_is_refused_where_the_workers_start_without_cuda():
    config = ModelConfig.from_neox_args(tiny(fp16={"enabled": True}))
    assert config.device_problems(cuda_available=True) == []
    assert "fp16 needs a CUDA GPU" in " ".join(config.device_problems(cuda_available=False))


def test_training_needs_iterations_optimizer_and_data():
    problems = " ".join(tiny().training_problems())
    assert "train_iters" in problems and "optimizer" in problems and "data_path" in problems
    ready = tiny(train_iters=10, data_path="d", optimizer={"type": "Adam", "params": {"lr": 1e-3}})
    assert ready.training_problems() == []


def test_valid_tiny_config_passes():
    args = NeoXArgs.from_dict(dict(TINY))
    assert args.deepspeed_config is not None


@pytest.mark.parametrize("flag", ["log_grad_norm", "log_grad_pct_zeros", "log_optimizer_states"])
@pytest.mark.parametrize("zero_stage", [0, 1])
def test_gradient_and_optimizer_logging_is_accepted_with_a_pipeline(flag, zero_stage):
    """GPT-NeoX's Pythia 12B and 2.8B configs log gradient norms with pipe_parallel_size 1 and ZeRO 1."""
    args = tiny(pipe_parallel_size=1, zero_optimization={"stage": zero_stage}, **{flag: True})
    assert getattr(args, flag) and args.pipe_parallel_size == 1
    args = tiny(pipe_parallel_size=2, num_gpus=2, bf16={"enabled": True}, **{flag: True})
    assert getattr(args, flag) and args.is_pipe_parallel


@pytest.mark.parametrize("moe_type", ["deepspeed", "megablocks"])
def test_deepspeed_experts_are_accepted_in_a_pipeline_with_data_parallelism(moe_type):
    """DeepSpeed's layer and expert parallelism under the pipeline engine (tests/model/test_moe_expert_parallel.py)."""
    args = tiny(moe_num_experts=4, moe_type=moe_type, moe_expert_parallel_size=2, pipe_parallel_size=2, num_gpus=4)
    assert args.is_pipe_parallel and args.moe_expert_parallel_size == 2 and args.data_parallel_size == 2


@pytest.mark.parametrize("moe_type", ["deepspeed", "megablocks"])
def test_deepspeed_experts_are_accepted_in_a_pipeline_with_tensor_parallelism_and_logs(moe_type):
    """PP x TP (x DP, expert parallelism) with the per-parameter logs (tests/model/test_moe_expert_parallel.py;
    EP=2 at PP=2 x TP=2 x DP=2 was run by hand on 8 ranks)."""
    logs = {flag: True for flag in ("log_grad_norm", "log_param_norm", "log_grad_pct_zeros", "log_optimizer_states")}
    args = tiny(moe_num_experts=4, moe_type=moe_type, moe_expert_parallel_size=2, pipe_parallel_size=2,
                model_parallel_size=2, num_gpus=8, zero_optimization={"stage": 1}, **logs)
    assert args.is_pipe_parallel and args.model_parallel_size == 2 and args.data_parallel_size == 2
    assert args.log_grad_norm and args.log_optimizer_states


TE_AT_DEFAULTS = {"te_columnparallel": False, "te_rowparallel": False, "te_layernorm_mlp": False, "te_mha": False,
                  "te_fp8_format": "hybrid", "te_fp8_wgrad": True, "te_fp8_amax_history_len": 1,
                  "te_fp8_amax_compute_algo": "most_recent", "te_fp8_margin": 0, "te_fp8_mha": False}


def test_transformer_engine_keys_are_known_and_accepted_when_off():
    args = tiny(**TE_AT_DEFAULTS)
    assert args.te_mha is False and args.te_fp8_format == "hybrid"


@pytest.mark.parametrize("key,value", [("te_columnparallel", True), ("te_rowparallel", True),
                                       ("te_layernorm_mlp", True), ("te_mha", True), ("te_fp8_mha", True),
                                       ("te_fp8_format", "e4m3"), ("te_fp8_wgrad", False),
                                       ("te_fp8_amax_history_len", 16), ("te_fp8_amax_compute_algo", "max"),
                                       ("te_fp8_margin", 1)])
def test_transformer_engine_switched_on_is_not_supported_yet(key, value):
    with pytest.raises(ConfigError) as err:
        NeoXArgs.from_dict({**TINY, **TE_AT_DEFAULTS, key: value})
    [problem] = err.value.problems
    assert problem.startswith(f"{key}={value!r}: Transformer Engine") and "not supported yet" in problem


def test_transformer_engine_fp8_format_is_a_choice():
    text = problems_of(te_fp8_format="e5m2")
    assert "te_fp8_format='e5m2'" in text and "one of 'e4m3', 'hybrid'" in text


def _config_warnings(**overrides):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        args = tiny(**overrides)
    return args, [str(w.message) for w in caught if issubclass(w.category, NeoXConfigWarning)]


@pytest.mark.parametrize("flags", [{"scaled_upper_triang_masked_softmax_fusion": True},
                                   {"scaled_masked_softmax_fusion": True},
                                   {"scaled_upper_triang_masked_softmax_fusion": True,
                                    "scaled_masked_softmax_fusion": True}])
def test_softmax_fusion_with_only_flash_layers_is_accepted_with_one_warning(flags):
    args, messages = _config_warnings(attention_config=[[["flash"], 2]], **flags)
    assert args.attention_config == ["flash", "flash"] and all(getattr(args, f) for f in flags)
    [message] = messages
    assert " / ".join(flags) + "=true has no effect" in message and "'flash'" in message


@pytest.mark.parametrize("config", [None, [[["global", "flash"], 1]], [[["local"], 2]]])
def test_softmax_fusion_with_a_softmax_to_fuse_gives_no_warning(config):
    _, messages = _config_warnings(attention_config=config, scaled_upper_triang_masked_softmax_fusion=True)
    assert messages == []


@pytest.mark.parametrize("key,value", [("serve_model_weights", True), ("weight_server_port", [6000, 6001])])
def test_weight_serving_keys_are_known_and_refused(key, value):
    text = problems_of(**{key: value})
    assert "not supported yet" in text and "tools/rollout_server.py" in text and "unknown argument" not in text


def test_online_reinforce_keys_are_accepted_together():
    args = tiny(train_impl="reinforce", dataset_impl="online", kl_impl="full", kl_div_beta=0.05,
                reinforce_leave_one_out=True, fp32_reinforce=False, online_dataserver_ips="10.0.0.1",
                online_dataserver_ports=10001)
    assert (args.kl_impl, args.kl_div_beta, args.online_dataserver_ports) == ("full", 0.05, 10001)


def test_z_loss_is_a_reward_model_setting():
    assert tiny(**RM_ARGS, z_loss=0.1).z_loss == 0.1
    for settings in ({"z_loss": 0.1}, {**RM_ARGS, "z_loss": -1.0}):
        assert "z_loss is the reward model's z-loss coefficient" in problems_of(**settings)


def test_newer_gpt_neox_keys_that_act_or_do_nothing_here():
    assert tiny(fused_kernels_build_path="/tmp/build").fused_kernels_build_path == "/tmp/build"  # documented no-op
    from megatron.observability.training_logger import TrainingLogger
    from megatron.model.config import ModelConfig

    args = tiny(peak_theoretical_tflops=312.0, train_iters=2, optimizer={"type": "Adam", "params": {"lr": 1e-3}})
    logger = TrainingLogger(args, ModelConfig.from_neox_args(args, padded_vocab_size=128), rank=1)
    assert logger.peak == 312.0
    logger.close()


def test_moe_settings_reach_the_model_config():
    args = tiny(moe_num_experts=4, moe_expert_interval=3, moe_top_k=2, moe_router_type="topk", num_layers=6,
                moe_jitter_eps=0.01, moe_glu=True, activation="gelu", moe_loss_coeff=0.02)
    config = ModelConfig.from_neox_args(args, padded_vocab_size=128)
    assert args.expert_interval == 3 and config.moe_layers == (0, 3)
    assert (config.moe_top_k, config.moe_router_type, config.moe_jitter_eps, config.expert_activation,
            config.moe_loss_coeff) == (2, "topk", 0.01, "geglu", 0.02)
    assert tiny(moe_num_experts=4, num_layers=4).expert_interval == 2  # neither name written: 2
    assert tiny(moe_num_experts=4, model_parallel_size=2, num_gpus=2).model_parallel_size == 2  # experts split
    ds = tiny(moe_num_experts=4, moe_type="deepspeed", moe_token_dropping=True, moe_train_capacity_factor=1.5,
              moe_min_capacity=2, pipe_parallel_size=0)
    config = ModelConfig.from_neox_args(ds, padded_vocab_size=128)
    assert (ds.moe_router_type, config.moe_train_capacity_factor, config.moe_min_capacity) == ("topk", 1.5, 2)


def test_megatron_schedule_keys_are_accepted_where_they_are_read():
    args = tiny(lr_decay_style="wsd", lr_wsd_decay_iters=30, lr_wsd_decay_style="cosine", train_iters=100,
                lr_warmup_iters=10, lr_warmup_init=0.0, decoupled_lr=1e-3, decoupled_min_lr=1e-5,
                start_weight_decay=0.0, end_weight_decay=0.1, weight_decay_incr_style="linear",
                optimizer={"type": "Adam", "params": {"lr": 1e-4}})
    assert (args.lr_decay_style, args.lr_wsd_decay_iters, args.decoupled_lr) == ("wsd", 30, 1e-3)
    assert tiny(lr_decay_style="inverse_sqrt").lr_decay_style == "inverse_sqrt"


def test_recompute_full_is_checkpoint_activations_and_round_trips():
    args = tiny(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2)
    assert (args.checkpoint_activations, args.checkpoint_num_layers) == (True, 2)
    assert args.activation_checkpointing["number_checkpoints"] == 1  # 2 layers in chunks of 2
    again = NeoXArgs.from_dict({k: v for k, v in args.to_dict().items() if k not in DERIVED_ONLY})
    assert again.to_dict() == args.to_dict()
    block = tiny(recompute_granularity="full", recompute_method="block", recompute_num_layers=2)
    assert (block.checkpoint_activations, block.checkpoint_num_layers) == (True, 1)  # one layer per checkpoint
    assert ModelConfig.from_neox_args(block).recompute_block_layers == 2
    assert ModelConfig.from_neox_args(tiny(recompute_granularity="full", recompute_method="block")
                                      ).recompute_block_layers == 1  # Megatron-LM's default
    assert ModelConfig.from_neox_args(args).recompute_block_layers is None
    selective = tiny(recompute_granularity="selective")
    assert not selective.checkpoint_activations
    assert ModelConfig.from_neox_args(selective).recompute_granularity == "selective"


@pytest.mark.parametrize("kind", ["OneBitAdam", "ZeroOneAdam", "OneBitLamb"])
def test_communication_compressed_optimizers_are_refused_naming_the_backend(kind):
    message = problems_of(optimizer={"type": kind, "params": {"lr": 1e-3}})
    assert f"optimizer.type='{kind}'" in message and "NCCL or MPI" in message and "no gloo path" in message


def test_lamb_is_refused_until_built():
    assert "FusedLamb" in problems_of(optimizer={"type": "Lamb", "params": {"lr": 1e-3}})


def test_context_parallel_size_divides_the_world_and_refuses_what_it_does_not_compose_with():
    args = tiny(num_gpus=8, model_parallel_size=2, context_parallel_size=2)
    assert (args.data_parallel_size, args.train_batch_size) == (2, 4)
    assert tiny(**{"num_gpus": 2, "context-parallel-size": 2}).data_parallel_size == 1  # Megatron-LM's spelling
    text = problems_of(num_gpus=6, context_parallel_size=4, seq_length=36, max_position_embeddings=36,
                       pipe_parallel_size=1, reset_attention_mask=True, pos_emb="alibi",
                       zero_optimization={"stage": 3, "reduce_scatter": False})
    for expected in ("not divisible by pipe_parallel_size x context_parallel_size x model_parallel_size",
                     "seq_length=36 must be divisible by 2 x context_parallel_size = 8",
                     "reset_attention_mask with context_parallel_size=4", "pos_emb='alibi'",
                     "zero_optimization.reduce_scatter=false with stage 3 with context_parallel_size=4"):
        assert expected in text, text
    assert "pipe_parallel_size=1 with" not in text  # composed: the pipeline engine's data axis is data x context
    assert "context_parallel_size=0 must be >= 1" in problems_of(context_parallel_size=0)
    assert tiny(num_gpus=2, context_parallel_size=2, zero_optimization={"stage": 3}).zero_stage == 3
    ramp = problems_of(num_gpus=4, context_parallel_size=2, pipe_parallel_size=2, train_samples=64,
                       train_batch_size=8, train_micro_batch_size_per_gpu=2, rampup_batch_size=[4, 4, 16])
    assert "rampup_batch_size with pipe_parallel_size=2 with context_parallel_size=2 is not supported yet" in ramp
