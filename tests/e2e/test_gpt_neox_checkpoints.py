"""GPT-NeoX checkpoints through deepy.py: generation's load path gives the Hugging Face reference logits,
train.py fine-tunes from them exactly as from the same weights converted by this project, and resumes from
a GPT-NeoX checkpoint with its optimizer state exactly as from its own; and the checkpoints train.py saves
have GPT-NeoX's files, slots, keys and client state."""
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from megatron.checkpoint.format import GPT_NEOX, LAYOUT_KEY
from megatron.checkpoint.files import checkpoint_kind
from megatron.checkpoint.rng_state import GPT_NEOX_KEYS
from tests.checkpoint.weights_only import assert_loads_weights_only
from tests.checkpoint_conversion.engine_logits import engine_logits, runtime_config
from tests.checkpoint_conversion.gpt_neox_files import (
    gpt_neox_yaml,
    neox_slots_from_gptneox,
    neox_slots_from_llama,
    write_gpt_neox_checkpoint,
)
from tests.checkpoint_conversion.helpers import random_tokens, save_tiny_tokenizer
from tests.checkpoint_conversion.test_gpt_neox_layout import VARIANTS, client_args, hf_reference
from tests.e2e.training_run import TrainingRun, build_tiny_corpus, falls
from tests.tools.tool_runner import load_tool

pytestmark = pytest.mark.slow


def _write(variant: str, hf, tp: int, pp: int, save_dir: Path, **extra) -> Path:
    values = dict(VARIANTS[variant], model_parallel_size=tp, pipe_parallel_size=pp, **extra)
    slots = neox_slots_from_gptneox(hf, tp) if variant == "neox" else neox_slots_from_llama(hf, tp)
    vocab = slots[0][0]["word_embeddings.weight"].shape[0] * tp
    return write_gpt_neox_checkpoint(save_dir, slots, gpt_neox_yaml(values), client_args(values, tp, vocab), pp)


@pytest.mark.parametrize("variant,tp,pp", [("llama", 1, 2), ("neox", 2, 0)])
def test_generation_loads_gpt_neox_checkpoints_with_the_reference_logits(tmp_path, variant, tp, pp):
    """The config here pads the vocabulary to 96 (make_vocab_size_divisible_by 8): the checkpoint's 128 rows win."""
    hf = hf_reference(variant)
    _write(variant, hf, tp, pp, tmp_path / "ckpt")
    save_tiny_tokenizer(tmp_path / "tok")
    model = dict(VARIANTS[variant], model_parallel_size=tp, pipe_parallel_size=pp, make_vocab_size_divisible_by=8,
                 vocab_file=str(tmp_path / "tok" / "tokenizer.json"), load=str(tmp_path / "ckpt"))
    (tmp_path / "model.yml").write_text(yaml.safe_dump(model))
    tokens = random_tokens(seq=16)
    got = engine_logits([tmp_path / "model.yml", runtime_config(tmp_path / "run")], tokens, tmp_path / "run")
    with torch.no_grad():
        want = hf(tokens).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return build_tiny_corpus(tmp_path_factory.mktemp("corpus"))


def test_finetuning_from_a_gpt_neox_checkpoint_equals_finetuning_from_ours(data, tmp_path):
    """A Llama-style (rmsnorm, swiglu, GQA) model with the corpus' 384-token vocabulary, as GPT-NeoX writes it at
    tensor parallelism 2, and the same weights converted by convert_hf_to_neox.py: train.py with finetune gives
    the same losses from both (the first is the loaded model's)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=384, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=48, max_position_embeddings=32,
                                      rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
                                      mlp_bias=False)).eval()
    with torch.no_grad():
        hf.lm_head.weight.mul_(300.0)  # far from a fresh model's loss (about ln 384 = 5.95)
    _write("llama", hf, 2, 0, tmp_path / "gpt-neox", make_vocab_size_divisible_by=8)
    hf.save_pretrained(tmp_path / "hf")
    assert load_tool("tools/ckpts/convert_hf_to_neox.py").main(
        ["--hf_dir", str(tmp_path / "hf"), "--output_dir", str(tmp_path / "ours"), "--config_out",
         str(tmp_path / "ours.yml"), "--model_parallel_size", "2"]) == 0
    model = {k: v for k, v in VARIANTS["llama"].items() if k != "tokenizer_type"}
    losses = {}
    for name in ("gpt-neox", "ours"):
        run = TrainingRun(tmp_path / f"run-{name}", data, num_gpus=2, model_parallel_size=2, train_iters=3,
                          finetune=True, load=str(tmp_path / name), save=None, **model)
        run.launch()
        run.assert_ok()
        losses[name] = run.losses()
    assert sorted(losses["gpt-neox"]) == [1, 2, 3] and losses["gpt-neox"][1] > 8.0, losses
    for it, loss in losses["ours"].items():
        assert losses["gpt-neox"][it] == pytest.approx(loss, rel=1e-5, abs=1e-5), it


def _as_gpt_neox_writes_it(ckpt: Path, out: Path) -> Path:
    """Our checkpoint as GPT-NeoX would have written it: no COMPLETE, checksums, neox_args.json or rank RNG
    files, only GPT-NeoX's client state, with rank 0's RNG states in it (the optimizer files untouched)."""
    shutil.copytree(ckpt, out / ckpt.name)
    rng = torch.load(ckpt / "rng_state_rank0.pt", weights_only=True)
    for extra in ("COMPLETE", "checksums.xxh128", "neox_args.json", *[p.name for p in ckpt.glob("rng_state_rank*.pt")]):
        (out / ckpt.name / extra).unlink()
    for path in (out / ckpt.name).glob("mp_rank_*_model_states.pt"):
        state = torch.load(path, weights_only=False)
        for key in (LAYOUT_KEY, "consumed_train_samples", "consumed_valid_samples"):
            state.pop(key)
        # GPT-NeoX's four generators (its CUDA tracker's states, rng_tracker_states, have no CPU form to give)
        state.update({GPT_NEOX_KEYS[name]: value for name, value in rng.items() if name in GPT_NEOX_KEYS})
        torch.save(state, path)
    (out / "latest").write_text(ckpt.name)
    return out / ckpt.name


def test_resume_with_optimizer_state_from_a_gpt_neox_checkpoint_and_our_files(data, tmp_path):
    """Two data-parallel ranks with ZeRO stage 1 (how GPT-NeoX trained Pythia) learn and save every 3 steps; the
    run saved at step 3 and rewritten as GPT-NeoX writes checkpoints resumes with its optimizer and LR state to the
    losses of the run that never stopped; and the files train.py wrote are GPT-NeoX's."""
    straight = TrainingRun(tmp_path / "straight", data, num_gpus=2, zero_optimization={"stage": 1}, train_iters=6,
                           checkpoint_factor=3)
    straight.launch()
    straight.assert_ok()
    assert sorted(straight.losses()) == list(range(1, 7)) and falls(straight.losses())  # it learns
    assert straight.checkpoints() == ["global_step3", "global_step6"] and straight.latest() == "global_step6"
    saved = straight.directory / "ckpt" / "global_step3"

    names = sorted(p.name for p in saved.iterdir())
    assert names == ["COMPLETE", "checksums.xxh128", "configs", "mp_rank_00_model_states.pt", "neox_args.json", "rng_state_rank0.pt",
                     "rng_state_rank1.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                     "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    state = torch.load(saved / "mp_rank_00_model_states.pt", weights_only=False)
    layer = ["input_layernorm.weight", "input_layernorm.bias", "attention.query_key_value.weight",
             "attention.query_key_value.bias", "attention.dense.weight", "attention.dense.bias",
             "post_attention_layernorm.weight", "post_attention_layernorm.bias", "mlp.linear1.weight",
             "mlp.linear1.bias", "mlp.linear2.weight", "mlp.linear2.bias"]
    assert list(state["module"]) == ["sequential.0.word_embeddings.weight",
                                     *[f"sequential.{slot}.{name}" for slot in (2, 3) for name in layer],
                                     "sequential.5.norm.weight", "sequential.5.norm.bias"]
    assert state["iteration"] == 3 and state["args"] == {
        "num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "max_position_embeddings": 32,
        "make_vocab_size_divisible_by": 8, "padded_vocab_size": 384, "tokenizer_type": "HFTokenizer",
        "model_parallel_size": 1}
    assert {"lr_scheduler", "param_shapes"} <= set(state) and "np_rng_state" not in state  # RNG: in rng_state_rank*
    assert_loads_weights_only(str(saved))  # and GPT-NeoX's converter's plain torch.load reads the weights

    gpt_neox = _as_gpt_neox_writes_it(saved, tmp_path / "gpt-neox")
    assert checkpoint_kind(str(gpt_neox)) == GPT_NEOX
    resumed = TrainingRun(tmp_path / "resumed", data, num_gpus=2, zero_optimization={"stage": 1}, train_iters=6,
                          load=str(tmp_path / "gpt-neox"), save=None)
    resumed.launch()
    resumed.assert_ok()
    losses, want = resumed.losses(), straight.losses()
    assert sorted(losses) == [4, 5, 6]
    for it in (4, 5, 6):
        assert losses[it] == pytest.approx(want[it], rel=1e-6, abs=1e-6), it
