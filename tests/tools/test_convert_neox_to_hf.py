"""tools/ckpts/convert_neox_to_hf.py on checkpoints trained by deepy.py train.py (GPTNeoX layout with
tensor parallelism 2; Llama layout with GQA, pipeline parallelism 2, ZeRO-1 and tied embeddings):
transformers loads the folder as the right class and gives the logits our DeepSpeed engine computes from
the original checkpoint (fp32, <= 1e-4); the tokenizer comes along; converting back writes DeepSpeed's
own file layout."""
import os
from pathlib import Path

import pytest
import torch

from tests.checkpoint_conversion.engine_logits import engine_logits
from tests.e2e.training_run import TrainingRun, build_tiny_corpus
from tests.tools.tool_runner import load_tool, run_tool

pytestmark = pytest.mark.slow
os.environ.setdefault("HF_HUB_OFFLINE", "1")

LLAMA_LAYOUT = dict(norm="rmsnorm", activation="swiglu", use_bias_in_norms=False, use_bias_in_attn_linear=False,
                    use_bias_in_mlp=False, rms_norm_epsilon=1.0e-6, num_kv_heads=2)
RUNS = {
    "neox-tp2": ("neox", "GPTNeoXForCausalLM",
                 dict(model_parallel_size=2, gpt_j_residual=True, rotary_pct=0.5, no_weight_tying=True)),
    "llama-gqa-pp2-tied-zero1": ("llama", "LlamaForCausalLM",
                                 dict(pipe_parallel_size=2, no_weight_tying=False, zero_optimization={"stage": 1},
                                      **LLAMA_LAYOUT)),
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """name -> the TrainingRun, after 2 iterations and a checkpoint at global_step2."""
    root = tmp_path_factory.mktemp("trained")
    data = build_tiny_corpus(root / "data")
    runs = {}
    for name, (_, _, overrides) in RUNS.items():
        run = TrainingRun(root / name, data, num_gpus=2, train_iters=2, checkpoint_factor=2, train_batch_size=8,
                          gradient_accumulation_steps=2, **overrides)
        run.launch()
        run.assert_ok()
        runs[name] = run
    return runs


def _model_files(directory: Path):
    return sorted(p.name for p in directory.iterdir() if p.name.endswith("model_states.pt"))


@pytest.mark.parametrize("name", list(RUNS))
def test_trained_checkpoint_converts_with_the_same_logits(trained, tmp_path, name):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron.checkpoint_conversion.from_hf import convert_hf_to_neox
    from megatron.tokenizer import build_tokenizer_from

    architecture, hf_class, overrides = RUNS[name]
    run = trained[name]
    ckpt = run.directory / "ckpt" / "global_step2"
    tokens = torch.randint(0, 384, (2, 20), generator=torch.Generator().manual_seed(3))
    want = engine_logits([run.directory / "config0.yml"], tokens, tmp_path / "engine")

    args = ["--input_dir", str(ckpt), "--output_dir", str(tmp_path / "hf"), "--architecture", architecture]
    if name == "neox-tp2":  # as a user runs it, with the run's YAML instead of the saved neox_args.json
        result = run_tool("tools/ckpts/convert_neox_to_hf.py", *args, "--config_file",
                          str(run.directory / "config0.yml"))
        assert result.returncode == 0, result.stderr[-3000:]
    else:
        assert load_tool("tools/ckpts/convert_neox_to_hf.py").main(args) == 0

    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True).eval()
    assert type(hf).__name__ == hf_class
    with torch.no_grad():
        got = hf(tokens).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)

    ours = build_tokenizer_from("HFTokenizer", run.config["vocab_file"])
    text = "def f(x):\n    return x + 1\n"
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf", local_files_only=True)
    assert tok(text)["input_ids"] == ours.tokenize(text)
    assert hf.config.eos_token_id == ours.eod == tok.eos_token_id

    convert_hf_to_neox(str(tmp_path / "hf"), str(tmp_path / "back"), str(tmp_path / "back.yml"),
                       overrides.get("model_parallel_size", 1), overrides.get("pipe_parallel_size", 0))
    assert _model_files(tmp_path / "back" / "global_step0") == \
        [f for f in _model_files(ckpt) if not f.startswith("zero_pp_rank")]


def test_refusal_exits_2_with_the_reason(trained, tmp_path, capsys):
    ckpt = trained["neox-tp2"].directory / "ckpt"
    tool = load_tool("tools/ckpts/convert_neox_to_hf.py")
    assert tool.main(["--input_dir", str(ckpt), "--output_dir", str(tmp_path / "hf"), "--architecture", "llama"]) == 2
    assert "needs rmsnorm" in capsys.readouterr().err


def test_missing_input_dir_exits_2(tmp_path, capsys):
    tool = load_tool("tools/ckpts/convert_neox_to_hf.py")
    assert tool.main(["--input_dir", str(tmp_path / "nope"), "--output_dir", str(tmp_path / "hf")]) == 2
    assert "--input_dir" in capsys.readouterr().err


@pytest.mark.attack("convert_neox_to_hf.py / convert_hf_to_neox.py / upgrade_checkpoint.py --output_dir naming an "
                    "existing file, or a path under a file")
def test_an_output_dir_that_is_a_file_exits_2_before_reading_the_checkpoint(tmp_path, capsys):
    existing = tmp_path / "model.safetensors"
    existing.write_bytes(b"keep me")
    for script, source in (("convert_neox_to_hf.py", "--input_dir"), ("convert_hf_to_neox.py", "--hf_dir"),
                           ("upgrade_checkpoint.py", "--input_dir")):
        tool = load_tool(f"tools/ckpts/{script}")
        extra = ["--config_out", str(tmp_path / "out.yml")] if script == "convert_hf_to_neox.py" else []
        for output, expected in ((existing, f"--output_dir {existing} is an existing file, not a directory"),
                                 (existing / "hf", f"--output_dir {existing / 'hf'} cannot be created: {existing} "
                                                   f"is a file")):
            assert tool.main([source, str(tmp_path / "nope"), "--output_dir", str(output), *extra]) == 2, script
            err = capsys.readouterr().err
            assert err == f"error: {expected}; name a new directory (or an existing one) to write into\n" \
                if output == existing else err == f"error: {expected}\n", (script, err)
    assert existing.read_bytes() == b"keep me"
