"""What cannot be converted is refused with one clear ConversionError naming the option or file."""
import pytest
import torch

from megatron.checkpoint_conversion import hf_gptneox, hf_llama
from megatron.errors import ConversionError
from megatron.checkpoint_conversion.from_hf import convert_hf_to_neox
from megatron.checkpoint.neox_checkpoint import read_checkpoint
from megatron.checkpoint_conversion.to_hf import convert_neox_to_hf
from megatron.model.config import ModelConfig
from tests.checkpoint_conversion.helpers import tiny_gptneox, tiny_llama

NEOX = dict(num_layers=1, hidden_size=8, num_attention_heads=2, seq_length=8, pos_emb="rotary", norm="layernorm",
            activation="gelu", rotary_pct=1.0, attention_config=["global"])
LLAMA = dict(NEOX, norm="rmsnorm", activation="swiglu", use_bias_in_norms=False, use_bias_in_attn_linear=False,
             use_bias_in_mlp=False)
MIXTRAL = dict(moe_num_experts=4, moe_top_k=2, moe_router_type="topk", expert_interval=1)


@pytest.mark.parametrize("overrides,message", [
    (dict(pos_emb="learned"), "pos_emb='learned'"),
    (dict(norm="rmsnorm"), "--architecture llama"),
    (dict(norm="non_parametric_layernorm"), "norm='non_parametric_layernorm'"),
    (dict(use_bias_in_qkv=False), "use_bias_in_qkv=false with use_bias_in_attn_linear=true: GPTNeoX's"),
    (dict(activation="swiglu"), "activation='swiglu'"),
    (dict(num_kv_heads=1), "grouped-query"),
    (dict(use_bias_in_mlp=False), "use_bias_in_mlp=false"),
    (dict(use_qk_layernorm=True), "use_qk_layernorm"),
    (dict(attention_config=["local"]), "attention_config"),
    (dict(moe_num_experts=2), r"mixture of experts \(moe_num_experts=2\): only --architecture mixtral"),
])
def test_gptneox_refuses(overrides, message):
    with pytest.raises(ConversionError, match=message):
        hf_gptneox.to_hf(ModelConfig(**{**NEOX, **overrides}), {})


@pytest.mark.parametrize("architecture,overrides,message", [
    ("llama", dict(rotary_pct=0.5), "rotary_pct=0.5"),
    ("llama", dict(norm="layernorm"), "needs rmsnorm"),
    ("llama", dict(norm="non_parametric_layernorm"), "norm='non_parametric_layernorm'"),
    ("llama", dict(gpt_j_residual=True), "parallel residual"),
    ("llama", dict(sliding_window_width=4), "--architecture mistral"),
    ("mistral", dict(use_bias_in_mlp=True), "Mistral has no linear biases"),
    ("llama", dict(moe_num_experts=4, moe_top_k=2), "only --architecture mixtral"),
    ("mixtral", dict(), "moe_num_experts=1: Mixtral is a mixture of experts"),
    ("mixtral", dict(MIXTRAL, moe_top_k=1), "moe_top_k=1: Mixtral renormalises"),
    ("mixtral", dict(MIXTRAL, expert_interval=2, num_layers=2), "every Mixtral layer is a mixture of experts"),
    ("mixtral", dict(MIXTRAL, moe_router_type="sinkhorn"), "moe_router_type='sinkhorn'"),
    ("mixtral", dict(MIXTRAL, moe_type="deepspeed"), "Mixtral's experts are dropless"),
    ("mixtral", dict(MIXTRAL, use_bias_in_mlp=True), "Mixtral has no linear biases"),
    ("llama", dict(use_bias_in_qkv=True), "use_bias_in_qkv=true with use_bias_in_attn_linear=false: Llama's "
                                          "attention_bias sets q, k, v and o together"),
    ("mistral", dict(use_bias_in_qkv=True), "use_bias_in_qkv=true: Mistral has no linear biases"),
    ("qwen2", dict(), "use_bias_in_qkv=false: Qwen2 has biases on q, k and v"),
    ("olmo", dict(), "norm='rmsnorm': OLMo's LayerNorms have no weight or bias"),
    ("olmo", dict(norm="non_parametric_layernorm", layernorm_epsilon=1e-6), "epsilon is fixed at 1e-05"),
    ("olmo", dict(norm="non_parametric_layernorm", use_bias_in_mlp=True), "OLMo's MLP has no biases"),
    ("qwen2", dict(use_bias_in_qkv=True, use_bias_in_mlp=True), "use_bias_in_mlp=true: Qwen2's output projection"),
    ("qwen2", dict(use_bias_in_qkv=True, sliding_window_width=4), "Qwen2's sliding window"),
])
def test_llama_refuses(architecture, overrides, message):
    with pytest.raises(ConversionError, match=message):
        hf_llama.to_hf(ModelConfig(**{**LLAMA, **overrides}), {}, architecture)


def test_missing_checkpoint_names_the_flag(tmp_path):
    with pytest.raises(ConversionError, match="--input_dir"):
        convert_neox_to_hf(str(tmp_path / "nowhere"), str(tmp_path / "out"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConversionError, match="no DeepSpeed model files"):
        read_checkpoint(str(tmp_path / "empty"))


def test_unknown_architecture(tmp_path):
    with pytest.raises(ConversionError, match="--architecture 'gpt2'"):
        convert_neox_to_hf(str(tmp_path), str(tmp_path / "out"), architecture="gpt2")


def test_missing_hf_folder_and_weights(tmp_path):
    with pytest.raises(ConversionError, match="no config.json"):
        convert_hf_to_neox(str(tmp_path / "none"), str(tmp_path / "o"), str(tmp_path / "c.yml"))
    tiny_llama().config.save_pretrained(tmp_path / "cfg_only")
    with pytest.raises(ConversionError, match="has no weights"):
        convert_hf_to_neox(str(tmp_path / "cfg_only"), str(tmp_path / "o"), str(tmp_path / "c.yml"))


def test_unsupported_hf_models(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=8, n_head=2).save_pretrained(tmp_path / "gpt2")
    torch.save({}, tmp_path / "gpt2" / "pytorch_model.bin")
    with pytest.raises(ConversionError, match="model_type 'gpt2' is not supported"):
        convert_hf_to_neox(str(tmp_path / "gpt2"), str(tmp_path / "o"), str(tmp_path / "c.yml"))
    model = tiny_gptneox()
    model.config.hidden_act = "gelu_new"
    model.save_pretrained(tmp_path / "tanh")
    with pytest.raises(ConversionError, match="hidden_act='gelu_new'"):
        convert_hf_to_neox(str(tmp_path / "tanh"), str(tmp_path / "o"), str(tmp_path / "c.yml"))


def test_qwen2_sliding_window_olmo_clip_qkv_and_unconverted_rope_types_name_config_json_keys(tmp_path):
    from tests.checkpoint_conversion.helpers import tiny_qwen2

    model = tiny_qwen2()
    model.config.use_sliding_window, model.config.sliding_window = True, 4
    model.save_pretrained(tmp_path / "window")
    with pytest.raises(ConversionError, match="config.json use_sliding_window=true"):
        convert_hf_to_neox(str(tmp_path / "window"), str(tmp_path / "o"), str(tmp_path / "c.yml"))
    from tests.checkpoint_conversion.helpers import tiny_olmo

    model = tiny_olmo()
    model.config.clip_qkv = 8.0
    model.save_pretrained(tmp_path / "clip")
    with pytest.raises(ConversionError, match="config.json clip_qkv=8.0"):
        convert_hf_to_neox(str(tmp_path / "clip"), str(tmp_path / "o"), str(tmp_path / "c.yml"))
    model = tiny_llama()
    model.config.rope_parameters = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 4,
                                    "long_factor": [2.0] * 4, "original_max_position_embeddings": 16}
    model.save_pretrained(tmp_path / "longrope")
    with pytest.raises(ConversionError, match=r"rope_scaling.rope_type='longrope' \(per-frequency"):
        convert_hf_to_neox(str(tmp_path / "longrope"), str(tmp_path / "o"), str(tmp_path / "c.yml"))


def test_multi_query_attention_cannot_be_split_over_two_ranks(tmp_path):
    tiny_llama(kv_heads=1).save_pretrained(tmp_path / "mqa")
    with pytest.raises(ConversionError, match="num_kv_heads=1 must be divisible by model_parallel_size=2"):
        convert_hf_to_neox(str(tmp_path / "mqa"), str(tmp_path / "o"), str(tmp_path / "c.yml"), 2, 0)


def test_vocabulary_that_does_not_split_is_refused(tmp_path):
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=95, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=16)).save_pretrained(tmp_path / "odd")
    with pytest.raises(ConversionError, match="vocab_size 95 is not divisible by --model_parallel_size 2"):
        convert_hf_to_neox(str(tmp_path / "odd"), str(tmp_path / "o"), str(tmp_path / "c.yml"), 2, 0)


def test_gpt_neox_mamba_checkpoint_saved_with_tensor_parallelism_is_refused(tmp_path):
    """GPT-NeoX's TP > 1 Mamba mixer is another function than ours (megatron.model.mamba): its checkpoints are
    refused, naming why, before any tensor is read."""
    from megatron.checkpoint.format import gpt_neox_mamba_problem
    from tests.checkpoint_conversion.gpt_neox_files import gpt_neox_yaml, write_gpt_neox_checkpoint

    values = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, max_position_embeddings=16,
                  norm="rmsnorm", pos_emb="none", attention_config=[[["mamba"], 2]], model_parallel_size=2,
                  pipe_parallel_size=0)
    embedding = torch.zeros(48, 32)
    path = write_gpt_neox_checkpoint(tmp_path, {0: [{"word_embeddings.weight": embedding}] * 2},
                                     gpt_neox_yaml(values), {"num_layers": 2}, pp=0)
    with pytest.raises(ConversionError, match="GPT-NeoX's Mamba layers saved at model_parallel_size=2"):
        read_checkpoint(str(path))
    assert gpt_neox_mamba_problem(1, ("mamba", "mamba")) is None
    assert gpt_neox_mamba_problem(2, ("global", "rwkv")) is None


def test_gpt_neox_checkpoint_with_a_non_parametric_qk_layernorm_is_refused(tmp_path):
    """GPT-NeoX's use_qk_layernorm is one norm over all heads, ours one per head; with non_parametric_layernorm no
    tensor shows the difference, so the checkpoint is refused by its config before any tensor is read."""
    from megatron.checkpoint.format import gpt_neox_qk_norm_problem
    from tests.checkpoint_conversion.gpt_neox_files import gpt_neox_yaml, write_gpt_neox_checkpoint

    values = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, max_position_embeddings=16,
                  norm="non_parametric_layernorm", pos_emb="rotary", use_qk_layernorm=True, model_parallel_size=1,
                  pipe_parallel_size=0)
    path = write_gpt_neox_checkpoint(tmp_path, {0: [{"word_embeddings.weight": torch.zeros(48, 32)}]},
                                     gpt_neox_yaml(values), {"num_layers": 2}, pp=0)
    with pytest.raises(ConversionError, match="GPT-NeoX's use_qk_layernorm normalises queries and keys over all"):
        read_checkpoint(str(path))
    assert gpt_neox_qk_norm_problem(True, "layernorm") is None  # its qk_layernorm tensors are refused instead
    assert gpt_neox_qk_norm_problem(False, "non_parametric_layernorm") is None
