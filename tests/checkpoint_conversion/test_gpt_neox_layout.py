"""GPT-NeoX's checkpoint layout, both ways, in process: checkpoints written as GPT-NeoX writes them
(tests/checkpoint_conversion/gpt_neox_files.py, checked once against GPT-NeoX's own convert_neox_to_hf.py)
from tiny random Hugging Face models give those models' logits here (read_checkpoint, the model's own
load_state_dict at TP 1 and 2, conversion to Hugging Face), and what this project writes (write_checkpoint,
and the model's state dict, which DeepSpeed's engine saves) is file for file, key for key and tensor for
tensor what GPT-NeoX writes."""
from pathlib import Path

import pytest
import torch

from megatron.checkpoint.neox_checkpoint import read_checkpoint, write_checkpoint
from megatron.checkpoint_conversion.to_hf import convert_neox_to_hf
from megatron.checkpoint.format import GPT_NEOX, LAYOUT_KEY, file_layout
from megatron.model.config import ModelConfig
from tests.checkpoint_conversion.gpt_neox_files import (
    gpt_neox_yaml,
    neox_slots_from_gptneox,
    neox_slots_from_llama,
    write_gpt_neox_checkpoint,
)
from tests.checkpoint_conversion.helpers import _randomise, our_logits, our_model, random_tokens
from tests.distributed_helpers import run_distributed

VOCAB = 128
COMMON = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 32,
          "max_position_embeddings": 32, "make_vocab_size_divisible_by": 64, "no_weight_tying": True,
          "pos_emb": "rotary", "tokenizer_type": "HFTokenizer"}
VARIANTS = {
    # GPT-NeoX / Pythia style: layernorm, gelu, parallel residual, partial rotary
    "neox": dict(COMMON, gpt_j_residual=True, rotary_pct=0.5, intermediate_size=128, norm="layernorm",
                 activation="gelu"),
    # Llama style: rmsnorm (no offset), swiglu, grouped-query attention, no biases
    "llama": dict(COMMON, num_kv_heads=2, norm="rmsnorm", activation="swiglu", intermediate_size=144,
                  rms_norm_epsilon=1.0e-6, use_bias_in_norms=False, use_bias_in_attn_linear=False,
                  use_bias_in_mlp=False, rotary_pct=1.0),
}
LAYOUTS = [(1, 0), (2, 0), (1, 1), (2, 2)]


def hf_reference(variant: str):
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if variant == "neox":
        config = GPTNeoXConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                               intermediate_size=128, hidden_act="gelu", max_position_embeddings=32,
                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                "partial_rotary_factor": 0.5},
                               use_parallel_residual=True, tie_word_embeddings=False, layer_norm_eps=1e-5)
        return _randomise(GPTNeoXForCausalLM(config).eval())
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=48, max_position_embeddings=32, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False,
                         attention_bias=False, mlp_bias=False)
    return _randomise(LlamaForCausalLM(config).eval())


def client_args(values: dict, tp: int, vocab: int = VOCAB) -> dict:
    return {"num_layers": values["num_layers"], "hidden_size": values["hidden_size"],
            "num_attention_heads": values["num_attention_heads"],
            "max_position_embeddings": values["max_position_embeddings"],
            "make_vocab_size_divisible_by": values["make_vocab_size_divisible_by"], "padded_vocab_size": vocab,
            "tokenizer_type": values["tokenizer_type"], "model_parallel_size": tp}


def gpt_neox_slots(variant: str, hf, tp: int):
    return neox_slots_from_gptneox(hf, tp) if variant == "neox" else neox_slots_from_llama(hf, tp)


def gpt_neox_checkpoint(variant: str, hf, tp: int, pp: int, save_dir: Path) -> Path:
    values = dict(VARIANTS[variant], model_parallel_size=tp, pipe_parallel_size=pp)
    return write_gpt_neox_checkpoint(save_dir, gpt_neox_slots(variant, hf, tp), gpt_neox_yaml(values),
                                     client_args(values, tp), pp)


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request):
    return request.param, hf_reference(request.param)


@pytest.mark.parametrize("tp,pp", LAYOUTS)
def test_gpt_neox_checkpoint_gives_the_reference_logits(variant, tp, pp, tmp_path):
    name, hf = variant
    path = gpt_neox_checkpoint(name, hf, tp, pp, tmp_path / "ckpt")
    ckpt = read_checkpoint(str(tmp_path / "ckpt"))  # the model from its configs/model.yml, as GPT-NeoX wrote it
    assert (ckpt.path, ckpt.kind, ckpt.layout) == (str(path), GPT_NEOX, (tp, pp))
    assert ckpt.config.padded_vocab_size == VOCAB and ckpt.config.num_kv_heads == VARIANTS[name].get("num_kv_heads")
    tokens = random_tokens(seq=16)
    with torch.no_grad():
        want = hf(tokens).logits
    torch.testing.assert_close(our_logits(our_model(ckpt.config, ckpt.state), tokens), want, rtol=0, atol=1e-4)


def test_gpt_neox_checkpoint_converts_to_hugging_face(variant, tmp_path):
    from transformers import AutoModelForCausalLM

    name, hf = variant
    gpt_neox_checkpoint(name, hf, 2, 0, tmp_path / "ckpt")
    convert_neox_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"), architecture="neox" if name == "neox" else "llama")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True).eval()
    tokens = random_tokens(seq=16)
    with torch.no_grad():
        torch.testing.assert_close(again(tokens).logits, hf(tokens).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("tp,pp", LAYOUTS)
def test_what_we_write_is_what_gpt_neox_writes(variant, tp, pp, tmp_path):
    """Same files, same keys, same tensors on every rank, and GPT-NeoX's client state."""
    name, hf = variant
    theirs = gpt_neox_checkpoint(name, hf, tp, pp, tmp_path / "theirs")
    source = read_checkpoint(str(theirs))
    values = dict(VARIANTS[name], model_parallel_size=tp, pipe_parallel_size=pp, padded_vocab_size=VOCAB)
    config = ModelConfig.from_neox_args(values)
    ours = Path(write_checkpoint(str(tmp_path / "ours"), source.state, config, values, {}, iteration=10))
    files = sorted(p.name for p in theirs.iterdir() if p.name.endswith("model_states.pt"))
    assert sorted(p.name for p in ours.iterdir() if p.name.endswith("model_states.pt")) == files
    for file in files:
        a, b = torch.load(theirs / file, weights_only=False), torch.load(ours / file, weights_only=False)
        if file.startswith("mp_rank"):
            assert b["iteration"] == 10 and b["args"] == a["args"] and b[LAYOUT_KEY] == "gpt-neox"
            assert b["mp_world_size"] == a["mp_world_size"]
            a, b = a["module"] or {}, b["module"] or {}
        assert list(b) == list(a) or sorted(b) == sorted(a), file
        for key in a:
            torch.testing.assert_close(b[key], a[key], rtol=0, atol=0, msg=f"{file} {key}")
    assert file_layout(str(ours)) == (tp, pp)


def _tp2_model_loads_gpt_neox_files(rank: int, world_size: int, variant: str, directory: str):
    """A TP=2 model takes GPT-NeoX's rank files with load_state_dict (DeepSpeed's engine does that), computes the
    reference logits, and its state_dict (what DeepSpeed saves) is the rank's file again."""
    from megatron.model.gpt2_model import build_model
    from megatron.mpu import ParallelState, gather_from_model_parallel_region

    values = dict(VARIANTS[variant], model_parallel_size=2, pipe_parallel_size=0, padded_vocab_size=VOCAB)
    config = ModelConfig.from_neox_args(values)
    state = ParallelState(pipe_parallel_size=0, model_parallel_size=2)
    model = build_model(config, state).eval()
    saved = torch.load(Path(directory) / f"mp_rank_{rank:02d}_model_states.pt", weights_only=False)["module"]
    model.load_state_dict(saved, strict=True)
    tokens = random_tokens(seq=16)
    with torch.no_grad():
        logits = gather_from_model_parallel_region(our_logits(model, tokens), state.get_model_parallel_group())
    again = model.state_dict()
    assert sorted(again) == sorted(saved)
    for key, value in saved.items():
        torch.testing.assert_close(again[key], value, rtol=0, atol=0, msg=key)
    return logits


@pytest.mark.slow
def test_tensor_parallel_model_loads_and_saves_gpt_neox_rank_files(variant, tmp_path):
    name, hf = variant
    path = gpt_neox_checkpoint(name, hf, 2, 0, tmp_path / "ckpt")
    results = run_distributed(_tp2_model_loads_gpt_neox_files, world_size=2, args=(name, str(path)))
    tokens = random_tokens(seq=16)
    with torch.no_grad():
        want = hf(tokens).logits
    for logits in results:
        torch.testing.assert_close(logits, want, rtol=0, atol=1e-4)
