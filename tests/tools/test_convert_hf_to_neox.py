"""tools/ckpts/convert_hf_to_neox.py writes checkpoints that our DeepSpeed engine loads (the path of
generate.py / eval.py, and of train.py with finetune): random tiny Hugging Face models (Llama with GQA
over tensor parallelism 2; GPTNeoX with parallel residual, partial rotary and untied embeddings over
pipeline parallelism 2) give transformers' logits (fp32, <= 1e-4) when loaded through deepy.py, and
train.py fine-tunes from a converted checkpoint."""
import json
import os

import pytest
import torch
import yaml

from tests.checkpoint_conversion.engine_logits import engine_logits, runtime_config
from tests.checkpoint_conversion.helpers import (hf_greedy, random_tokens, save_tiny_tokenizer, tiny_gptneox,
                                                tiny_llama, tiny_qwen2)
from tests.e2e.launch import free_port, run_deepy
from tests.e2e.training_run import build_tiny_corpus
from tests.tools.tool_runner import load_tool

os.environ.setdefault("HF_HUB_OFFLINE", "1")
TOOL = "tools/ckpts/convert_hf_to_neox.py"


@pytest.mark.slow
@pytest.mark.parametrize("kind,tp,pp", [("llama-gqa", 2, 0), ("neox-parallel-partial-untied", 1, 2)])
def test_converted_checkpoint_loads_through_the_engine_with_the_same_logits(tmp_path, kind, tp, pp):
    hf = tiny_llama(kv_heads=2) if kind == "llama-gqa" else tiny_gptneox(parallel_residual=True, rotary_pct=0.5)
    hf.save_pretrained(tmp_path / "hf")
    save_tiny_tokenizer(tmp_path / "hf")
    assert load_tool(TOOL).main(["--hf_dir", str(tmp_path / "hf"), "--output_dir", str(tmp_path / "ckpt"),
                                 "--config_out", str(tmp_path / "model.yml"), "--model_parallel_size", str(tp),
                                 "--pipe_parallel_size", str(pp)]) == 0  # in-process: the tool's CLI is tested below
    tokens = random_tokens(seq=16)
    got = engine_logits([tmp_path / "model.yml", runtime_config(tmp_path / "run")], tokens, tmp_path / "run")
    with torch.no_grad():
        want = hf(tokens).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


@pytest.mark.slow
def test_train_py_finetunes_from_a_converted_checkpoint(tmp_path):
    """A GPTNeoX with the tiny corpus' tokenizer and vocabulary, converted to pipeline parallelism 2 with tied
    embeddings, fine-tunes with train.py; its first loss is the converted model's, not a fresh one's: the
    embeddings are scaled up so that its logits are far from uniform and its loss far above ln(384) = 5.95,
    which a freshly initialised model gives."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    data = build_tiny_corpus(tmp_path / "data")
    torch.manual_seed(0)
    hf = GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=384, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                          intermediate_size=64, max_position_embeddings=32, tie_word_embeddings=True))
    with torch.no_grad():
        hf.gpt_neox.embed_in.weight.mul_(50.0)
    hf.save_pretrained(tmp_path / "hf")
    os.link(data["vocab_file"], tmp_path / "hf" / "tokenizer.json")
    tool = load_tool(TOOL)
    assert tool.main(["--hf_dir", str(tmp_path / "hf"), "--output_dir", str(tmp_path / "ckpt"), "--config_out",
                      str(tmp_path / "model.yml"), "--pipe_parallel_size", "2"]) == 0
    train = {"data_path": data["data_path"], "num_gpus": 2, "train_micro_batch_size_per_gpu": 4, "train_iters": 2}
    train.update(optimizer={"type": "Adam", "params": {"lr": 1.0e-9}}, lr_decay_style="constant",
                 distributed_backend="gloo", split="90,8,2", num_workers=0, eval_interval=1000, eval_iters=1,
                 log_interval=1, log_dir=str(tmp_path / "logs"), save=str(tmp_path / "finetuned"),
                 checkpoint_factor=2)
    (tmp_path / "train.yml").write_text(yaml.safe_dump(train))
    result = run_deepy(["train.py", str(tmp_path / "model.yml"), str(tmp_path / "train.yml"), "--master_port",
                        str(free_port())])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines() if line]
    losses = {r["iteration"]: r["lm_loss"] for r in rows if r.get("type") == "train"}
    assert min(losses) == 1  # finetune: counting starts again at iteration 1
    assert losses[1] > 8.0, losses
    assert (tmp_path / "finetuned" / "global_step2" / "COMPLETE").is_file()


FAMILIES = {  # the Llama 3.2-style model's TP-2 generation: docs/fine-tuning.md's worked example
    "qwen2": lambda: tiny_qwen2(kv_heads=2, tied=True, rope=dict(rope_type="yarn", factor=2.0)),
    "mistral": lambda: tiny_llama(kv_heads=2, mistral_window=5),
}


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_generate_py_at_tensor_parallel_2_gives_transformers_greedy_tokens(tmp_path, family):
    """Qwen2 (q/k/v biases, tied, YaRN RoPE scaling) and Mistral (a sliding window shorter than prompt +
    continuation) converted at TP 2: `deepy.py generate.py` on two ranks continues each prompt with transformers'
    greedy tokens (the Llama 3.2-style model: tests/tools/test_fine_tuning_doc.py)."""
    hf = FAMILIES[family]()
    hf.save_pretrained(tmp_path / "hf")
    save_tiny_tokenizer(tmp_path / "hf")
    model_yml = tmp_path / "model.yml"
    assert load_tool(TOOL).main(["--hf_dir", str(tmp_path / "hf"), "--output_dir", str(tmp_path / "ckpt"),
                                 "--config_out", str(model_yml), "--model_parallel_size", "2"]) == 0
    _assert_generate_gives_hf_greedy(hf, [model_yml, runtime_config(tmp_path / "run")], tmp_path)


def _assert_generate_gives_hf_greedy(hf, configs, tmp_path) -> None:
    """`deepy.py generate.py CONFIGS -i prompts` continues two prompts with ``hf``'s greedy tokens."""
    from tokenizers import Tokenizer

    prompts = ["w5 w17 w9 w30", "w2 w3"]
    (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n")
    out = tmp_path / "samples.jsonl"
    result = run_deepy(["generate.py", *map(str, configs), "-i", str(tmp_path / "prompts.txt"), "-o", str(out),
                        "--master_port", str(free_port())])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-4000:]
    tokenizer = Tokenizer.from_file(str(tmp_path / "hf" / "tokenizer.json"))
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["context"] for r in records] == prompts
    for prompt, record in zip(prompts, records):
        ids = torch.tensor([tokenizer.encode(prompt).ids])
        want = hf_greedy(hf, ids, record["length"])[0, ids.size(1):].tolist()
        assert record["length"] > 0 and tokenizer.encode(record["text"]).ids == want, (record, want)


def test_missing_hf_dir_exits_2(tmp_path, capsys):
    assert load_tool(TOOL).main(["--hf_dir", str(tmp_path / "nope"), "--output_dir", str(tmp_path / "o"),
                                 "--config_out", str(tmp_path / "c.yml")]) == 2
    err = capsys.readouterr().err
    assert "--hf_dir" in err and "no config.json" in err


@pytest.mark.slow
def test_config_out_alone_serves_generate_and_the_reverse_conversion(tmp_path):
    """The YAML convert_hf_to_neox.py writes (model, tokenizer and load: no batch size, optimizer or
    iterations) is all that `deepy.py generate.py` and `convert_neox_to_hf.py --config_file` need: greedy
    generation gives transformers' greedy tokens, and converting back gives the original tensors."""
    from safetensors.torch import load_file

    hf = tiny_gptneox(parallel_residual=True, rotary_pct=0.5, tied=False)
    hf.save_pretrained(tmp_path / "hf")
    save_tiny_tokenizer(tmp_path / "hf")
    model_yml = tmp_path / "model.yml"
    assert load_tool(TOOL).main(["--hf_dir", str(tmp_path / "hf"), "--output_dir", str(tmp_path / "ckpt"),
                                 "--config_out", str(model_yml)]) == 0
    written = set(yaml.safe_load(model_yml.read_text()))
    assert not {"train_micro_batch_size_per_gpu", "optimizer", "train_iters"} & written

    _assert_generate_gives_hf_greedy(hf, [model_yml], tmp_path)

    assert load_tool("tools/ckpts/convert_neox_to_hf.py").main([
        "--input_dir", str(tmp_path / "ckpt"), "--config_file", str(model_yml),
        "--output_dir", str(tmp_path / "back")]) == 0
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    original = {k: v for k, v in hf.state_dict().items() if not k.endswith("inv_freq")}
    names = {"lm_head.weight": "embed_out.weight"} if "embed_out.weight" in back else {}
    for name, tensor in original.items():
        assert torch.equal(back[names.get(name, name)], tensor), name


CUSTOM_CONFIG = '''import pathlib
pathlib.Path({marker!r}).touch()
from transformers import PretrainedConfig
class CustomConfig(PretrainedConfig):
    model_type = "custom"
'''


def _run_converter(tmp_path, hf_dir, capsys):
    code = load_tool(TOOL).main(["--hf_dir", str(hf_dir), "--output_dir", str(tmp_path / "o"),
                                 "--config_out", str(tmp_path / "c.yml")])
    return code, capsys.readouterr().err


@pytest.mark.attack("a Hugging Face folder whose config.json has auto_map (custom code), converted with the "
                    "answer 'y' to transformers' prompt")
def test_a_folder_asking_for_its_own_code_is_refused_and_its_code_never_runs(tmp_path, capsys, monkeypatch):
    hf_dir, marker = tmp_path / "hf", tmp_path / "ran"
    hf_dir.mkdir()
    (hf_dir / "configuration_custom.py").write_text(CUSTOM_CONFIG.format(marker=str(marker)))
    (hf_dir / "config.json").write_text(json.dumps(
        {"model_type": "custom", "auto_map": {"AutoConfig": "configuration_custom.CustomConfig"}}))
    monkeypatch.setattr("builtins.input", lambda *_: "y")  # a user answering transformers' question
    code, err = _run_converter(tmp_path, hf_dir, capsys)
    assert not marker.exists(), "the folder's code ran"
    assert code == 2 and f"{hf_dir / 'config.json'} has auto_map (AutoConfig)" in err, err
    assert "trust_remote_code is off" in err
    assert not (tmp_path / "o").exists()


@pytest.mark.attack("a pytorch_model.bin holding a pickle that runs a command, given to convert_hf_to_neox.py")
def test_a_hostile_pytorch_model_bin_is_refused_naming_the_file(tmp_path, capsys):
    from transformers import GPTNeoXConfig

    from tests.checkpoint.test_files import plant

    hf_dir, marker = tmp_path / "hf", tmp_path / "ran"
    GPTNeoXConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                  vocab_size=64).save_pretrained(hf_dir)
    plant(str(hf_dir / "pytorch_model.bin"), marker)
    code, err = _run_converter(tmp_path, hf_dir, capsys)
    assert code == 2 and f"{hf_dir / 'pytorch_model.bin'} holds a Python object" in err, err
    assert "weights_only=False" not in err and not marker.exists()


@pytest.mark.attack("convert_hf_to_neox.py writing over a complete checkpoint, a running run's save directory or "
                    "a user's config file")
def test_the_converter_replaces_no_checkpoint_and_no_config_it_did_not_write(tmp_path, capsys):
    from megatron.checkpoint.run_lock import RunLock

    from transformers import GPTNeoXConfig

    hf_dir = tmp_path / "hf"  # refused before its weights are read: a config is enough
    GPTNeoXConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                  vocab_size=64).save_pretrained(hf_dir)
    out, config_out = tmp_path / "out", tmp_path / "c.yml"
    (out / "global_step0").mkdir(parents=True)  # a complete checkpoint (of an earlier conversion)
    (out / "global_step0" / "COMPLETE").write_text("0\n")
    argv = ["--hf_dir", str(hf_dir), "--output_dir", str(out), "--config_out", str(config_out)]
    assert load_tool(TOOL).main(argv) == 2
    assert f"{out / 'global_step0'} exists already (a complete checkpoint); it is not replaced" in \
        capsys.readouterr().err
    assert os.listdir(out / "global_step0") == ["COMPLETE"] and not config_out.exists()
    mine = tmp_path / "mine.yml"
    mine.write_text("num_layers: 2\n")
    assert load_tool(TOOL).main(["--hf_dir", str(hf_dir), "--output_dir", str(tmp_path / "new"),
                                 "--config_out", str(mine)]) == 2
    assert f"--config_out {str(mine)!r} exists and is not a config this tool wrote" in capsys.readouterr().err
    assert mine.read_text() == "num_layers: 2\n" and not (tmp_path / "new").exists()
    lock = RunLock(str(tmp_path / "running"))
    assert lock.acquire() is None
    try:
        assert load_tool(TOOL).main(["--hf_dir", str(hf_dir), "--output_dir", str(tmp_path / "running"),
                                     "--config_out", str(tmp_path / "r.yml")]) == 2
        assert "is in use by another training run" in capsys.readouterr().err
    finally:
        lock.release()
    assert not (tmp_path / "running" / "global_step0").exists()
