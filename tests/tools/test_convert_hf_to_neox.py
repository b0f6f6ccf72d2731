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
from tests.checkpoint_conversion.helpers import random_tokens, save_tiny_tokenizer, tiny_gptneox, tiny_llama
from tests.e2e.launch import free_port, run_deepy
from tests.e2e.training_run import build_tiny_corpus
from tests.tools.tool_runner import load_tool, run_tool

os.environ.setdefault("HF_HUB_OFFLINE", "1")
TOOL = "tools/ckpts/convert_hf_to_neox.py"


@pytest.mark.slow
@pytest.mark.parametrize("kind,tp,pp", [("llama-gqa", 2, 0), ("neox-parallel-partial-untied", 1, 2)])
def test_converted_checkpoint_loads_through_the_engine_with_the_same_logits(tmp_path, kind, tp, pp):
    hf = tiny_llama(kv_heads=2) if kind == "llama-gqa" else tiny_gptneox(parallel_residual=True, rotary_pct=0.5)
    hf.save_pretrained(tmp_path / "hf")
    save_tiny_tokenizer(tmp_path / "hf")
    result = run_tool(TOOL, "--hf_dir", str(tmp_path / "hf"), "--output_dir", str(tmp_path / "ckpt"),
                      "--config_out", str(tmp_path / "model.yml"), "--model_parallel_size", str(tp),
                      "--pipe_parallel_size", str(pp))
    assert result.returncode == 0, result.stderr[-3000:]
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


def test_missing_hf_dir_exits_2(tmp_path):
    result = run_tool(TOOL, "--hf_dir", str(tmp_path / "nope"), "--output_dir", str(tmp_path / "o"),
                      "--config_out", str(tmp_path / "c.yml"))
    assert result.returncode == 2
    assert "--hf_dir" in result.stderr and "no config.json" in result.stderr and "Traceback" not in result.stderr
