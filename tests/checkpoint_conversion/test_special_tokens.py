"""Our checkpoint -> Hugging Face: config.json's eos_token_id and bos_token_id are the run's end-of-document
token for every tokenizer type and architecture (GPT-NeoX's converter sets both to the tokenizer's eod)."""
import json

import pytest

from megatron.errors import ConversionError
from megatron.checkpoint_conversion.from_hf import convert_hf_to_neox
from megatron.checkpoint_conversion.to_hf import convert_neox_to_hf
from tests.checkpoint_conversion.helpers import tiny_gptneox, tiny_llama
from tests.tokenizer.tokenizer_files import make_hf_tokenizer_files, make_sentencepiece_model, make_tiktoken_file


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tokenizers")
    files = make_hf_tokenizer_files(directory)
    files["spm"] = make_sentencepiece_model(directory)
    files["tiktoken"] = make_tiktoken_file(directory)
    return files


@pytest.fixture(scope="module", params=["neox", "llama"])
def checkpoint(request, tmp_path_factory):
    """(architecture, our converted checkpoint, its model YAML) of a tiny Hugging Face model without tokenizer."""
    directory = tmp_path_factory.mktemp(request.param)
    (tiny_gptneox() if request.param == "neox" else tiny_llama()).save_pretrained(directory / "hf")
    convert_hf_to_neox(str(directory / "hf"), str(directory / "ckpt"), str(directory / "model.yml"))
    return request.param, directory / "ckpt", directory / "model.yml"


def _tokenizer_yaml(kind, files):
    vocab = {"HFTokenizer": files["tokenizer_json"], "HFGPT2Tokenizer": files["tokenizer_json"],
             "GPT2BPETokenizer": files["vocab"], "SPMTokenizer": files["spm"], "TiktokenTokenizer": files["tiktoken"]}
    values = {"tokenizer_type": kind, "train_micro_batch_size_per_gpu": 1}  # the rest of a run's config
    if kind in vocab:
        values["vocab_file"] = str(vocab[kind])
    if kind == "GPT2BPETokenizer":
        values["merge_file"] = str(files["merges"])
    return json.dumps(values)


# (tokenizer type, its eod id in the files of tests/tokenizer/tokenizer_files.py)
EODS = [("HFTokenizer", 0), ("HFGPT2Tokenizer", 0), ("GPT2BPETokenizer", 0), ("SPMTokenizer", 2),
        ("TiktokenTokenizer", 263), ("CharLevelTokenizer", 0)]


@pytest.mark.parametrize("kind,eod", EODS)
def test_config_json_carries_the_run_tokenizers_eos_and_bos(checkpoint, tokenizer_files, tmp_path, kind, eod):
    from megatron.tokenizer import build_tokenizer_from
    from transformers import AutoConfig

    architecture, ckpt, model_yml = checkpoint
    tokenizer_yml = tmp_path / "tokenizer.yml"
    tokenizer_yml.write_text(_tokenizer_yaml(kind, tokenizer_files))
    convert_neox_to_hf(str(ckpt), str(tmp_path / "hf"), [str(model_yml), str(tokenizer_yml)], architecture)
    settings = json.loads(tokenizer_yml.read_text())
    ours = build_tokenizer_from(settings["tokenizer_type"], settings.get("vocab_file"), settings.get("merge_file"))
    assert ours.eod == eod
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert written["eos_token_id"] == written["bos_token_id"] == eod
    config = AutoConfig.from_pretrained(tmp_path / "hf", local_files_only=True)
    assert config.eos_token_id == config.bos_token_id == eod
    assert (tmp_path / "hf" / "tokenizer.json").exists() == (kind in ("HFTokenizer", "HFGPT2Tokenizer"))


def test_without_a_tokenizer_there_is_no_eos_and_a_note(checkpoint, tmp_path, capsys):
    architecture, ckpt, _ = checkpoint
    convert_neox_to_hf(str(ckpt), str(tmp_path / "hf"), architecture=architecture)
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert written.get("eos_token_id") is None and written.get("bos_token_id") is None
    assert "config.json gets no eos_token_id" in capsys.readouterr().err


def test_a_tokenizer_file_that_is_gone_is_a_conversion_error(checkpoint, tmp_path):
    architecture, ckpt, model_yml = checkpoint
    tokenizer_yml = tmp_path / "tokenizer.yml"
    tokenizer_yml.write_text(json.dumps({"tokenizer_type": "SPMTokenizer", "vocab_file": str(tmp_path / "gone.model"),
                                         "train_micro_batch_size_per_gpu": 1}))
    with pytest.raises(ConversionError, match="gone.model.*eos_token_id"):
        convert_neox_to_hf(str(ckpt), str(tmp_path / "hf"), [str(model_yml), str(tokenizer_yml)], architecture)
