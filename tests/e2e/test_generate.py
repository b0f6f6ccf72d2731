"""generate.py end to end through deepy.py on CPU ranks: a tiny model is trained, then sampled
unconditionally, from an input file (KV cache and recompute, one and two ranks agree) and
interactively from standard input (a missing prompts file is named before launch: tests/e2e/test_prelaunch.py)."""
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest
import yaml

from tests.e2e.launch import REPO, deepy_environment, free_port, run_deepy
from tests.e2e.training_run import TrainingRun, build_tiny_corpus

pytestmark = pytest.mark.slow

PROMPTS = ["def main(", "import os\nimport sys", "class Foo:", "for i in range(", "return"]


def trained_checkpoint(base: Path, pipe_parallel_size: int = 0, model_parallel_size: int = 1) -> Dict[str, object]:
    """Train the tiny model once per test session and layout (reused through the directory); returns the
    training config (its `load` is the checkpoint). Under pytest-xdist the checkpoints live beside the workers'
    own temporary directories, behind a file lock, so that generate's and eval's tests on two workers share them
    instead of each worker training both layouts."""
    from filelock import FileLock

    if base.name.startswith("popen-gw"):
        base = base.parent
    directory = base / f"trained_pp{pipe_parallel_size}_mp{model_parallel_size}"
    config_file = directory / "config0.yml"
    with FileLock(str(directory) + ".lock"):
        if not (directory / "ckpt" / "latest").is_file():
            corpus = base / "corpus"
            with FileLock(str(corpus) + ".lock"):
                data = build_tiny_corpus(corpus) if not (corpus / "tokenizer.json").is_file() else {
                    "data_path": str(corpus / "corpus_text_document"), "vocab_file": str(corpus / "tokenizer.json"),
                    "tokenizer_type": "HFTokenizer"}
            ranks = max(pipe_parallel_size, 1) * model_parallel_size
            run = TrainingRun(directory, data, num_gpus=ranks, pipe_parallel_size=pipe_parallel_size,
                              model_parallel_size=model_parallel_size, train_iters=30, checkpoint_factor=30,
                              lr_decay_iters=30)
            run.launch()
            run.assert_ok()
    return yaml.safe_load(config_file.read_text())


@pytest.fixture(scope="session")
def trained(tmp_path_factory) -> Dict[str, object]:
    return trained_checkpoint(tmp_path_factory.getbasetemp())


def _deepy(directory: Path, config: Dict[str, object], overrides: Dict[str, object], *extra: str,
           generation_yml: bool = False, **kw):
    """generate.py on the config plus overrides (plus configs/text_generation.yml, as a user would)."""
    path = directory / f"gen{len(list(directory.glob('gen*.yml')))}.yml"
    path.write_text(yaml.safe_dump({**config, **overrides}))
    files = [str(path)] + ([os.path.join(REPO, "configs", "text_generation.yml")] if generation_yml else [])
    return run_deepy(["generate.py", *files, "--master_port", str(free_port()), *extra], **kw)


def _records(path: Path) -> List[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _ok(result) -> None:
    assert result.returncode == 0, result.stdout[-5000:] + "\n" + result.stderr[-5000:]


def test_unconditional_samples_with_the_shipped_generation_config(trained, tmp_path):
    """configs/text_generation.yml: 10 samples at temperature 1, maximum_tokens 102 capped by seq_length 32."""
    out = tmp_path / "uncond.jsonl"
    _ok(_deepy(tmp_path, trained, {"num_gpus": 1}, "-o", str(out), generation_yml=True))
    records = _records(out)
    assert len(records) == 10
    for record in records:
        assert set(record) == {"context", "text", "length", "finished", "duration_seconds"}
        assert record["context"] == "" and 0 <= record["length"] <= 31 and record["duration_seconds"] > 0
        assert record["finished"] or record["length"] == 31
    assert len({r["text"] for r in records}) > 1  # samples differ


def test_input_file_greedy_cache_equals_recompute_and_two_ranks(trained, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("<|end|>".join(PROMPTS) + "<|end|>\n")  # a prompt may span lines
    settings = {"text_gen_type": "input-file", "prompt_end": "<|end|>", "maximum_tokens": 10, "temperature": 0.0,
                "top_k": 0, "top_p": 0.0, "return_logits": True, "train_micro_batch_size_per_gpu": 2, "num_gpus": 1}
    out = tmp_path / "cache.jsonl"
    _ok(_deepy(tmp_path, trained, {**settings, "recompute": False}, "-i", str(prompts), "-o", str(out)))
    cache = _records(out)
    assert [r["context"] for r in cache] == PROMPTS
    for record in cache:
        assert len(record["logits"]) == record["length"] + (1 if record["finished"] else 0)
        assert record["length"] == 10 or record["finished"]
    # two data-parallel ranks, recomputing instead of caching, give the same samples (rank 0 writes)
    out = tmp_path / "two_ranks_recompute.jsonl"
    _ok(_deepy(tmp_path, trained, {**settings, "num_gpus": 2, "recompute": True}, "-i", str(prompts), "-o", str(out)))
    recompute = _records(out)
    assert [r["text"] for r in recompute] == [r["text"] for r in cache]
    for a, b in zip(cache, recompute):
        diffs = [abs(x - y) for row_a, row_b in zip(a["logits"], b["logits"]) for x, y in zip(row_a, row_b)]
        assert max(diffs) < 1e-4


def test_interactive_reads_stdin_until_empty_line(trained, tmp_path):
    path = tmp_path / "interactive.yml"
    out = tmp_path / "interactive.jsonl"
    path.write_text(yaml.safe_dump({**trained, "text_gen_type": "interactive", "maximum_tokens": 6,
                                    "temperature": 0.0, "num_gpus": 1, "sample_output_file": str(out)}))
    result = subprocess.run([sys.executable, "deepy.py", "generate.py", str(path), "--master_port",
                             str(free_port())], cwd=REPO, env=deepy_environment(),
                            input="def main(\nclass Foo:\n\nignored\n", capture_output=True, text=True, timeout=600)
    _ok(result)
    records = _records(out)
    assert [r["context"] for r in records] == ["def main(", "class Foo:"]
    assert "Generated text:" in result.stdout


def test_pipeline_parallel_generation(tmp_path_factory, tmp_path):
    """pipe_parallel_size=2: the stages run through DeepSpeed's eval_batch (recompute, even when asked for
    the cache). That it equals one rank token for token is tests/inference/test_text_generation.py's check."""
    config = trained_checkpoint(tmp_path_factory.getbasetemp(), pipe_parallel_size=2)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("<|end|>".join(PROMPTS))
    out = tmp_path / "pp.jsonl"
    _ok(_deepy(tmp_path, config, {"text_gen_type": "input-file", "maximum_tokens": 8, "temperature": 0.0,
                                  "prompt_end": "<|end|>", "train_micro_batch_size_per_gpu": 3, "recompute": False,
                                  "num_gpus": 2}, "-i", str(prompts), "-o", str(out)))
    records = _records(out)
    assert [r["context"] for r in records] == PROMPTS
    assert all(r["text"] and (r["length"] == 8 or r["finished"]) for r in records)
