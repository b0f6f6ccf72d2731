"""eval.py end to end through deepy.py on two data-parallel CPU ranks: on the trained tiny checkpoint it
gives the same scores as lm-eval's own Hugging Face model on the same weights (local multiple-choice,
loglikelihood, rolling and generation tasks from local JSONL), writes the results JSON and logs the metrics
(a missing eval_tasks file is named before launch: tests/e2e/test_prelaunch.py)."""
import json
import os
from pathlib import Path

import pytest
import yaml

from megatron.model.config import ModelConfig
from tests.e2e.launch import free_port, run_deepy
from tests.e2e.test_generate import trained_checkpoint
from tests.evaluation.hf_copy import sequential_state, write_hf_copy
from tests.evaluation.local_tasks import TASKS, scores, write_local_tasks

pytestmark = pytest.mark.slow

OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base = tmp_path_factory.getbasetemp()
    config = trained_checkpoint(base)
    work = tmp_path_factory.mktemp("eval")
    write_local_tasks(work / "tasks")
    cache = str(work / "datasets_cache")
    return config, work, {**OFFLINE, "HF_DATASETS_CACHE": cache}


def _eval(work: Path, config: dict, env: dict, *extra: str, **overrides):
    path = work / f"eval{len(list(work.glob('eval*.yml')))}.yml"
    path.write_text(yaml.safe_dump({**config, **overrides}))
    return run_deepy(["eval.py", str(path), "--master_port", str(free_port()), *extra], extra_env=env)


def _hf_scores(config: dict, work: Path, env: dict) -> dict:
    from lm_eval.evaluator import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    step = (Path(config["load"]) / "latest").read_text().strip()
    folder = Path(config["load"]) / step
    args = json.loads((folder / "neox_args.json").read_text())
    state = sequential_state(folder)
    hf_dir = write_hf_copy(state, ModelConfig.from_neox_args(args), config["vocab_file"], "<|endoftext|>", work / f"hf_{step}_{len(state)}")
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        model = HFLM(pretrained=str(hf_dir), backend="causal", device="cpu", batch_size=4,
                     max_length=int(args["seq_length"]), dtype="float32")
        results = simple_evaluate(model=model, tasks=list(TASKS), bootstrap_iters=0, log_samples=False,
                                  task_manager=TaskManager(include_path=str(work / "tasks"), include_defaults=False))
    finally:
        for key, value in saved.items():
            os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)
    return scores(results)


def test_eval_matches_lm_eval_hf_model_on_two_ranks(setup):
    config, work, env = setup
    prefix = work / "out" / "tiny"
    result = _eval(work, config, env, num_gpus=2, eval_tasks=[str(work / "tasks")], eval_results_prefix=str(prefix),
                   log_dir=str(work / "logs"), train_micro_batch_size_per_gpu=3)
    assert result.returncode == 0, result.stdout[-5000:] + "\n" + result.stderr[-5000:]
    files = sorted((work / "out").glob("tiny_eval_results_*.json"))
    assert len(files) == 1
    results = json.loads(files[0].read_text())
    assert results["iteration"] == 30 and set(results["results"]) == set(TASKS)
    got, want = scores(results), _hf_scores(config, work, env)
    assert set(got) == set(want)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    assert got["neox_mc_local/sample_len"] == 12  # both ranks' documents were gathered
    assert 0.0 < got["neox_rolling_local/bits_per_byte"] < 8.0  # better than uniform bytes: trained weights
    records = [json.loads(line) for line in (work / "logs" / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in records if r.get("type") == "eval_tasks"]
    assert len(logged) == 1 and logged[0]["neox_mc_local/acc"] == pytest.approx(got["neox_mc_local/acc"])


def test_pipeline_parallel_eval_matches_lm_eval_hf_model(setup, tmp_path_factory):
    """pipe_parallel_size=2: every forward runs both stages through DeepSpeed's eval_batch."""
    _, work, env = setup
    config = trained_checkpoint(tmp_path_factory.getbasetemp(), pipe_parallel_size=2)
    prefix = work / "pp_out" / "pp"
    result = _eval(work, config, env, num_gpus=2, eval_tasks=[str(work / "tasks")], eval_results_prefix=str(prefix),
                   train_micro_batch_size_per_gpu=4)
    assert result.returncode == 0, result.stdout[-5000:] + "\n" + result.stderr[-5000:]
    results = json.loads(next((work / "pp_out").glob("pp_eval_results_*.json")).read_text())
    got, want = scores(results), _hf_scores(config, work, env)
    assert set(got) == set(want)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
