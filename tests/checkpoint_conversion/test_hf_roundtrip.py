"""Hugging Face -> our checkpoint, in process: tiny random GPTNeoX / Llama / Mistral / Mixtral / Qwen2 / OLMo models
give the same logits (fp32, <= 1e-4) and the same greedy generation in our model, for every tensor / pipeline
split written (RoPE scaling included); and our checkpoint -> Hugging Face -> our checkpoint gives back the same
tensors."""
import json

import pytest
import torch

from megatron.checkpoint_conversion.from_hf import convert_hf_to_neox
from megatron.checkpoint.neox_checkpoint import flat_state_dict, read_checkpoint
from megatron.checkpoint_conversion.to_hf import convert_neox_to_hf
from tests.checkpoint_conversion.helpers import (
    assert_matches_hf,
    our_logits,
    our_model,
    random_tokens,
    save_tiny_tokenizer,
    sharpened_attention,
    tiny_gptneox,
    tiny_llama,
    tiny_mixtral,
    tiny_olmo,
    tiny_qwen2,
)

MODELS = {
    "neox-parallel-partial-untied": lambda: tiny_gptneox(parallel_residual=True, rotary_pct=0.5, tied=False),
    "neox-sequential-residual": lambda: tiny_gptneox(parallel_residual=False, rotary_pct=0.25, tied=False),
    "neox-tied-no-attn-bias": lambda: tiny_gptneox(rotary_pct=1.0, tied=True, attention_bias=False),
    "llama-gqa": lambda: tiny_llama(kv_heads=2),
    "llama-tied-bias": lambda: tiny_llama(kv_heads=2, tied=True, bias=True),
    "mistral-window": lambda: tiny_llama(kv_heads=2, mistral_window=5),
    "mixtral-top2": lambda: tiny_mixtral(kv_heads=2),
    "llama3.2-rope-llama3-tied": lambda: tiny_llama(kv_heads=2, tied=True, rope=LLAMA3_ROPE),
    "llama-rope-yarn": lambda: tiny_llama(kv_heads=2, rope=dict(rope_type="yarn", factor=4.0,
                                                                  original_max_position_embeddings=8)),
    "qwen2-qkv-bias-tied-yarn": lambda: tiny_qwen2(kv_heads=2, tied=True, rope=dict(rope_type="yarn", factor=2.0)),
    "olmo-non-parametric-norm": lambda: tiny_olmo(kv_heads=2),
    "neox-rope-dynamic-past-max-positions": lambda: sharpened_attention(
        tiny_gptneox(rope=dict(rope_type="dynamic", factor=4.0), positions=8)),
}
LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8)
"""Llama 3.1 / 3.2's RoPE scaling at this tiny size: the original context (8192 there) 8 tokens, so the
frequencies of all three bands occur among head_dim 8's four."""
ARCHITECTURE = {"gpt_neox": "neox", "llama": "llama", "mistral": "mistral", "mixtral": "mixtral", "qwen2": "qwen2",
                "olmo": "olmo"}


@pytest.fixture(scope="module", params=list(MODELS))
def hf_model(request, tmp_path_factory):
    model = MODELS[request.param]()
    directory = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(directory)
    return model, directory


@pytest.mark.parametrize("tp,pp", [(1, 0), (2, 0), (2, 2)])
def test_hf_to_neox_same_logits_and_greedy_generation(hf_model, tmp_path, tp, pp):
    hf, hf_dir = hf_model
    path = convert_hf_to_neox(str(hf_dir), str(tmp_path / "ckpt"), str(tmp_path / "model.yml"), tp, pp)
    ckpt = read_checkpoint(str(tmp_path / "ckpt"))
    assert ckpt.path == path
    ours = our_model(ckpt.config, ckpt.state)
    assert_matches_hf(ours, hf)


def test_neox_to_hf_to_neox_gives_back_the_tensors(hf_model, tmp_path):
    """HF -> ours (TP 2) -> HF: transformers' logits are unchanged; -> ours again (PP 1): same tensors."""
    from transformers import AutoModelForCausalLM

    hf, hf_dir = hf_model
    convert_hf_to_neox(str(hf_dir), str(tmp_path / "a"), str(tmp_path / "a.yml"), 2, 0)
    first = read_checkpoint(str(tmp_path / "a"))
    architecture = ARCHITECTURE[hf.config.model_type]
    convert_neox_to_hf(str(tmp_path / "a"), str(tmp_path / "hf"), architecture=architecture)
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True).eval()
    assert type(again) is type(hf)
    tokens = random_tokens(seq=16)
    with torch.no_grad():
        torch.testing.assert_close(again(tokens).logits, hf(tokens).logits, rtol=0, atol=1e-5)
    convert_hf_to_neox(str(tmp_path / "hf"), str(tmp_path / "b"), str(tmp_path / "b.yml"), 1, 1)
    second = read_checkpoint(str(tmp_path / "b"))
    assert set(first.state) == set(second.state)
    for name, tensor in first.state.items():
        assert torch.equal(tensor, second.state[name]), name
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == hf.config.model_type
    assert again.config.rope_parameters == hf.config.rope_parameters  # RoPE scaling both ways


def test_tokenizer_is_copied_and_named_in_the_config(tmp_path):
    import yaml

    from megatron.tokenizer import build_tokenizer_from

    hf_dir = tmp_path / "hf"
    tiny_gptneox().save_pretrained(hf_dir)
    save_tiny_tokenizer(hf_dir)
    convert_hf_to_neox(str(hf_dir), str(tmp_path / "ckpt"), str(tmp_path / "model.yml"))
    config = yaml.safe_load((tmp_path / "model.yml").read_text())
    assert config["tokenizer_type"] == "HFTokenizer" and config["load"] == str(tmp_path / "ckpt")
    assert config["finetune"] is True and config["padded_vocab_size"] == 96
    ours = build_tokenizer_from("HFTokenizer", config["vocab_file"])
    assert ours.tokenize("w5 w7 w2") == [5, 7, 2] and ours.eod == 0
    saved = json.loads((tmp_path / "ckpt" / "global_step0" / "neox_args.json").read_text())
    assert saved["model_parallel_size"] == 1 and saved["num_layers"] == 2
    assert saved["vocab_file"] == config["vocab_file"]
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step0"
    assert (tmp_path / "ckpt" / "global_step0" / "configs" / "model.yml").read_text() == \
        (tmp_path / "model.yml").read_text()


def test_neox_to_hf_precision_and_tokenizer(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_dir = tmp_path / "hf"
    tiny_gptneox().save_pretrained(hf_dir)
    save_tiny_tokenizer(hf_dir)
    convert_hf_to_neox(str(hf_dir), str(tmp_path / "ckpt"), str(tmp_path / "model.yml"))
    convert_neox_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "out"), precision="bf16")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True)
    assert type(model).__name__ == "GPTNeoXForCausalLM" and model.dtype == torch.bfloat16
    assert model.config.eos_token_id == 0
    tok = AutoTokenizer.from_pretrained(tmp_path / "out", local_files_only=True)
    assert tok("w5 w7")["input_ids"] == [5, 7] and tok.eos_token == "<|endoftext|>"
    config = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"


@pytest.mark.parametrize("overrides", [
    dict(gpt_j_residual=True, gpt_j_tied=True, rotary_pct=0.5, no_weight_tying=True),
    dict(gpt_j_residual=False, rotary_pct=1.0, no_weight_tying=False, activation="relu",
         use_bias_in_attn_linear=False),
])
def test_our_gptneox_layouts_to_hf(overrides, tmp_path):
    """Our randomly initialised model -> GPTNeoX, including gpt_j_tied (one norm written as both of HF's)."""
    from transformers import GPTNeoXForCausalLM

    from megatron.checkpoint_conversion import hf_gptneox
    from tests.model.helpers import tiny_config

    model = tiny_config(pos_emb="rotary", padded_vocab_size=96, **overrides)
    ours = our_model(model, _randomised_state(model))
    config, state = hf_gptneox.to_hf(model, flat_state_dict(ours.state_dict(), model))
    hf = _saved_and_loaded(config, state, tmp_path)
    assert isinstance(hf, GPTNeoXForCausalLM)
    tokens = random_tokens(seq=16)
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, our_logits(ours, tokens), rtol=0, atol=1e-4)


@pytest.mark.parametrize("architecture,overrides", [
    ("llama", dict(num_kv_heads=2, no_weight_tying=True)),
    ("llama", dict(num_kv_heads=4, no_weight_tying=False, use_bias_in_attn_linear=True, use_bias_in_mlp=True)),
    ("mistral", dict(num_kv_heads=1, no_weight_tying=True, sliding_window_width=4, use_bias_in_attn_linear=False,
                     use_bias_in_mlp=False)),
    ("olmo", dict(num_kv_heads=2, no_weight_tying=True, norm="non_parametric_layernorm")),
    ("qwen2", dict(num_kv_heads=2, no_weight_tying=False, use_bias_in_qkv=True,
                   rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                     original_max_position_embeddings=8))),
])
def test_our_llama_layouts_to_hf(architecture, overrides, tmp_path):
    """Our randomly initialised rmsnorm + swiglu model (GQA, MHA, MQA; sliding window; q/k/v biases with RoPE
    scaling; non-parametric norms) -> Llama / Mistral / Qwen2 / OLMo."""
    from transformers import LlamaForCausalLM, MistralForCausalLM, OlmoForCausalLM, Qwen2ForCausalLM

    from megatron.checkpoint_conversion import hf_llama
    from tests.model.helpers import tiny_config

    values = dict(pos_emb="rotary", padded_vocab_size=96, norm="rmsnorm", activation="swiglu", use_bias_in_norms=False,
                  use_bias_in_attn_linear=False, use_bias_in_mlp=False, rms_norm_epsilon=1e-6)
    model = tiny_config(**{**values, **overrides})
    ours = our_model(model, _randomised_state(model))
    config, state = hf_llama.to_hf(model, flat_state_dict(ours.state_dict(), model), architecture)
    hf = _saved_and_loaded(config, state, tmp_path)
    expected = {"mistral": MistralForCausalLM, "qwen2": Qwen2ForCausalLM, "olmo": OlmoForCausalLM}
    assert isinstance(hf, expected.get(architecture, LlamaForCausalLM))
    tokens = random_tokens(seq=16)
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, our_logits(ours, tokens), rtol=0, atol=1e-4)


def _saved_and_loaded(config, state, directory):
    """Through the folder a user gets: save_hf_folder, then transformers' from_pretrained."""
    from transformers import AutoModelForCausalLM

    from megatron.checkpoint_conversion.hf_folder import save_hf_folder

    save_hf_folder(str(directory), config, state)
    return AutoModelForCausalLM.from_pretrained(directory, local_files_only=True).eval()


def _randomised_state(config):
    """Our model's weights (flat names) with every tensor random (norm weights and biases included)."""
    from megatron.model.gpt2_model import GPT2ModelSequential
    from megatron.mpu import SingleProcessState

    torch.manual_seed(0)
    state = flat_state_dict(GPT2ModelSequential(config, SingleProcessState()).state_dict(), config)
    return {name: torch.randn_like(t) * (0.3 if t.dim() > 1 else 1.0) for name, t in state.items()}


def test_llama31_config_json_as_published_with_rope_scaling_and_rope_theta(tmp_path):
    """Llama 3.1 / 3.2's config.json as published (written by transformers 4: `rope_scaling` with `rope_type` llama3
    beside a top-level `rope_theta`, no rope_parameters) converts with the scaling: transformers' logits."""
    from transformers import AutoModelForCausalLM

    tiny_llama(kv_heads=2, tied=True, rope=LLAMA3_ROPE).save_pretrained(tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    config = json.loads(path.read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope
    path.write_text(json.dumps(config))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True).eval()
    convert_hf_to_neox(str(tmp_path / "hf"), str(tmp_path / "ckpt"), str(tmp_path / "model.yml"))
    ckpt = read_checkpoint(str(tmp_path / "ckpt"))
    assert ckpt.config.rope_scaling_dict == LLAMA3_ROPE
    assert_matches_hf(our_model(ckpt.config, ckpt.state), hf)
