"""Hugging Face MambaForCausalLM <-> our pure-Mamba checkpoint, in process: tiny random models (tied and
untied, with and without linear biases) give the same logits (fp32, <= 1e-4) and the same greedy tokens
(transformers' generate() against our KV-cache decoding) at TP 1 and 2; converting back gives identical
tensors; and what one side cannot represent is refused."""
import pytest
import torch

from megatron.checkpoint_conversion import hf_mamba
from megatron.errors import ConversionError
from megatron.checkpoint_conversion.from_hf import convert_hf_to_neox
from megatron.checkpoint.neox_checkpoint import flat_state_dict, read_checkpoint
from megatron.checkpoint_conversion.to_hf import convert_neox_to_hf
from tests.checkpoint_conversion.helpers import VOCAB, assert_matches_hf, our_logits, our_model, random_tokens


def tiny_mamba(tied: bool = True, bias: bool = False, seed: int = 0):
    """A random 2-layer MambaForCausalLM (hidden 32, inner 64, 16 states, vocab 96); norms, biases, D and the
    step bias moved away from their initial values so a mix-up between tensors would show."""
    from transformers import MambaConfig, MambaForCausalLM

    torch.manual_seed(seed)
    config = MambaConfig(vocab_size=VOCAB, hidden_size=32, state_size=16, num_hidden_layers=2, expand=2,
                         conv_kernel=4, use_bias=bias, use_conv_bias=True, layer_norm_epsilon=1e-5,
                         tie_word_embeddings=tied, pad_token_id=None, bos_token_id=None, eos_token_id=None)
    model = MambaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias") or name.endswith(".D"):
                param.add_(torch.randn_like(param) * 0.3)
            if name.endswith("A_log"):
                param.add_(torch.randn_like(param) * 0.1)
    return model


MODELS = {"tied": dict(tied=True), "untied-bias": dict(tied=False, bias=True)}


@pytest.fixture(scope="module", params=list(MODELS))
def hf_model(request, tmp_path_factory):
    model = tiny_mamba(**MODELS[request.param])
    directory = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(directory)
    return model, directory


@pytest.mark.parametrize("tp", [1, 2])
def test_hf_mamba_to_neox_same_logits_and_greedy_tokens(hf_model, tmp_path, tp):
    hf, hf_dir = hf_model
    convert_hf_to_neox(str(hf_dir), str(tmp_path / "ckpt"), str(tmp_path / "model.yml"), tp, 0)
    ckpt = read_checkpoint(str(tmp_path / "ckpt"))
    assert ckpt.config.attention_types == ("mamba", "mamba") and ckpt.config.model_parallel_size == tp
    ours = our_model(ckpt.config, ckpt.state)
    assert_matches_hf(ours, hf)


def test_hf_mamba_to_neox_to_hf_gives_back_identical_weights(hf_model, tmp_path):
    from transformers import AutoModelForCausalLM, MambaForCausalLM

    hf, hf_dir = hf_model
    convert_hf_to_neox(str(hf_dir), str(tmp_path / "ckpt"), str(tmp_path / "model.yml"), 2, 0)
    assert convert_neox_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"), architecture="mamba") == \
        "MambaForCausalLM"
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True).eval()
    assert isinstance(again, MambaForCausalLM)
    want, got = hf.state_dict(), again.state_dict()
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    for key in ("hidden_size", "intermediate_size", "state_size", "conv_kernel", "time_step_rank", "use_bias",
                "use_conv_bias", "layer_norm_epsilon", "tie_word_embeddings", "vocab_size"):
        assert getattr(again.config, key) == getattr(hf.config, key), key


def test_our_mamba_model_to_hf(tmp_path):
    """Our randomly initialised pure-Mamba model -> MambaForCausalLM: the same logits."""
    from transformers import AutoModelForCausalLM

    from megatron.checkpoint_conversion.hf_folder import save_hf_folder
    from megatron.model.gpt2_model import GPT2ModelSequential
    from megatron.mpu import SingleProcessState
    from tests.model.helpers import tiny_config

    config = tiny_config(attention_config=[[["mamba"], 2]], norm="rmsnorm", use_bias_in_norms=False,
                         pos_emb="none", padded_vocab_size=VOCAB, no_weight_tying=True, rms_norm_epsilon=1e-5)
    torch.manual_seed(0)
    state = flat_state_dict(GPT2ModelSequential(config, SingleProcessState()).state_dict(), config)
    state = {name: t + torch.randn_like(t) * 0.1 for name, t in state.items()}
    ours = our_model(config, state)
    hf_config, hf_state = hf_mamba.to_hf(config, state)
    save_hf_folder(str(tmp_path), hf_config, hf_state)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True).eval()
    tokens = random_tokens(seq=16)
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, our_logits(ours, tokens), rtol=0, atol=1e-4)


def test_what_mamba_for_causal_lm_cannot_hold_is_refused():
    from megatron.model.gpt2_model import GPT2ModelSequential
    from megatron.mpu import SingleProcessState
    from tests.model.helpers import tiny_config

    config = tiny_config(attention_config=["mamba", "global"], norm="layernorm", pos_emb="rotary",
                         mamba_use_bias_in_linears=True, padded_vocab_size=VOCAB)
    state = flat_state_dict(GPT2ModelSequential(config, SingleProcessState()).state_dict(), config)
    state["layers.0.mixer.x_proj.bias"] = torch.ones_like(state["layers.0.mixer.x_proj.bias"])
    with pytest.raises(ConversionError) as err:
        hf_mamba.to_hf(config, state)
    message = str(err.value)
    for needle in ("MambaForCausalLM has only mamba layers", "norm='layernorm'", "use_bias_in_norms=true",
                   "pos_emb='rotary'", "x_proj.bias is not zero"):
        assert needle in message, needle


def test_hf_mamba_this_framework_cannot_build_is_refused():
    from transformers import MambaConfig

    config = MambaConfig(vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=1, conv_kernel=3,
                         time_step_rank=5)
    with pytest.raises(ConversionError) as err:
        hf_mamba.from_hf(config, {})
    for needle in ("state_size=8", "conv_kernel=3", "time_step_rank=5"):
        assert needle in str(err.value), needle
