"""The lm-eval adapter on a tiny random model in one process gives the same scores as lm-eval's own
Hugging Face model ('hf', pretrained=a local folder) on the same weights, for local multiple-choice,
loglikelihood (contexts longer than the window: left truncation), rolling loglikelihood and
generate_until tasks; eval_tasks entries resolve to names and include paths."""
import datetime
import itertools
import json
import os
from types import SimpleNamespace

import pytest
import torch
import yaml

from megatron.evaluation.tasks import EvalTaskError, resolve_tasks
from megatron.evaluation.harness import flat_metrics, log_eval_results, results_path, run_eval_tasks, write_results
from megatron.initialize import RunContext
from megatron.model.gpt2_model import build_model
from megatron.mpu import RNGStatesTracker, SingleProcessState
from megatron.checkpoint.neox_checkpoint import flat_state_dict
from tests.evaluation.hf_copy import write_hf_copy
from tests.evaluation.local_tasks import TASKS, scores, write_local_tasks
from tests.model.helpers import tiny_config
from tests.neox_arguments.helpers import tiny as tiny_args


@pytest.fixture(scope="module")
def offline(tmp_path_factory):
    cache = tmp_path_factory.mktemp("hf_datasets_cache")
    saved = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_DATASETS_CACHE")}
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_DATASETS_CACHE=str(cache))
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, offline):
    from megatron.data.corpora import iter_stdlib_texts
    from megatron.tokenizer.hf_tokenizer import HFTokenizer
    from megatron.tokenizer.training import save_tokenizer, train_byte_level_bpe

    base = tmp_path_factory.mktemp("adapter")
    vocab_file = base / "tokenizer.json"
    save_tokenizer(train_byte_level_bpe(list(itertools.islice(iter_stdlib_texts(), 30)), vocab_size=300),
                   vocab_file)
    tokenizer = HFTokenizer(str(vocab_file))
    tasks = write_local_tasks(base / "tasks")
    padded = -(-tokenizer.vocab_size // 8) * 8
    config = tiny_config(pos_emb="rotary", rotary_pct=0.5, gpt_j_residual=True, no_weight_tying=True,
                         seq_length=32, max_position_embeddings=32, padded_vocab_size=padded, init_method_std=0.1)
    args = tiny_args(train_micro_batch_size_per_gpu=3, eval_tasks=[str(base / "tasks")])
    torch.manual_seed(0)
    model = build_model(config, SingleProcessState()).eval()
    ctx = RunContext(parallel_state=SingleProcessState(), rng_tracker=RNGStatesTracker(), tokenizer=tokenizer,
                     device=torch.device("cpu"), model_config=config)
    return SimpleNamespace(base=base, args=args, config=config, model=model, ctx=ctx, tasks=tasks,
                           vocab_file=vocab_file)


@pytest.fixture(scope="module")
def hf_lm(tiny):
    """lm-eval's own Hugging Face model on a copy of the same weights."""
    from lm_eval.models.huggingface import HFLM

    state = flat_state_dict(tiny.model.state_dict(), tiny.config)
    folder = write_hf_copy(state, tiny.config, str(tiny.vocab_file), "<|endoftext|>", tiny.base / "hf")
    return HFLM(pretrained=str(folder), backend="causal", device="cpu", batch_size=4, max_length=32, dtype="float32")


def _hf_scores(tiny, hf_lm, names):
    from lm_eval.evaluator import simple_evaluate
    from lm_eval.tasks import TaskManager

    results = simple_evaluate(model=hf_lm, tasks=list(names), bootstrap_iters=0, log_samples=False,
                              task_manager=TaskManager(include_path=str(tiny.base / "tasks"), include_defaults=False))
    return scores(results)


def _our_lm(tiny):
    from megatron.evaluation.adapter import NeoXLM
    from megatron.inference.text_generation import build_runner

    return NeoXLM(build_runner(tiny.model, tiny.ctx.parallel_state, tiny.config), tiny.ctx.tokenizer,
                  tiny.ctx.parallel_state, max_length=32, batch_size=3, device=torch.device("cpu"))


def test_scores_match_lm_eval_hf_model(tiny, hf_lm):
    ours = run_eval_tasks(tiny.args, tiny.model, tiny.ctx, iteration=7)
    assert ours["iteration"] == 7
    got = scores(ours)
    want = _hf_scores(tiny, hf_lm, TASKS)
    assert set(got) == set(want) and len(got) >= 7
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    assert 0.0 < got["neox_ll_local/perplexity"] < float("inf") and got["neox_rolling_local/word_perplexity"] > 1.0
    assert ours["metrics"]["neox_mc_local/acc"] == got["neox_mc_local/acc"]
    assert not tiny.model.training  # left in the mode it was in


def test_requests_match_lm_eval_hf_model_one_by_one(tiny, hf_lm):
    """Per request: log-likelihoods (one context longer than the window), greedy flags, generated text."""
    ours = _our_lm(tiny)
    texts = ["def main(argv):\n    return", "import os", "class Foo(object):", "x = [i for i in range(10)]"]
    long_context = " ".join(texts * 6)
    pairs = [(t, " None") for t in texts] + [("", "import sys"), (long_context, " pass")]
    requests = [SimpleNamespace(args=pair) for pair in pairs]
    got, want = ours.loglikelihood(requests), hf_lm.loglikelihood(requests)
    assert [g for _, g in got] == [g for _, g in want]
    torch.testing.assert_close(torch.tensor([v for v, _ in got]), torch.tensor([v for v, _ in want]),
                               rtol=1e-5, atol=1e-4)
    rolling = [SimpleNamespace(args=(long_context,)), SimpleNamespace(args=(texts[0],))]
    torch.testing.assert_close(torch.tensor(ours.loglikelihood_rolling(rolling), dtype=torch.float64),
                               torch.tensor(hf_lm.loglikelihood_rolling(rolling), dtype=torch.float64),
                               rtol=1e-5, atol=1e-3)
    kwargs = {"until": ["\n\n"], "max_gen_toks": 8, "do_sample": False}
    generate = [SimpleNamespace(args=(t, dict(kwargs))) for t in texts + [long_context]]
    got_text, want_text = ours.generate_until(generate), hf_lm.generate_until(generate)
    assert got_text == want_text and any(t.strip() for t in got_text)


def test_restores_training_mode_and_rng_and_never_forks(tiny, monkeypatch):
    """Also: the perplexity's bootstrap standard error is computed without forking the (threaded) training
    process, which could deadlock in the child (a CI hang at "bootstrapping for stddev")."""
    import multiprocessing

    def no_fork(*args, **kwargs):
        raise AssertionError("lm-eval forked a multiprocessing.Pool inside the training process")

    monkeypatch.setattr(multiprocessing, "Pool", no_fork)
    monkeypatch.delenv("DISABLE_MULTIPROC", raising=False)
    tiny.model.train()
    state = torch.get_rng_state()
    args = tiny_args(train_micro_batch_size_per_gpu=3,
                     eval_tasks=[str(tiny.tasks["neox_mc_local"]), str(tiny.tasks["neox_ll_local"])])
    result = run_eval_tasks(args, tiny.model, tiny.ctx, iteration=1, limit=3)
    assert tiny.model.training and torch.equal(torch.get_rng_state(), state)
    tiny.model.eval()
    assert sorted(result["results"]) == ["neox_ll_local", "neox_mc_local"]
    assert result["metrics"]["neox_ll_local/perplexity_stderr"] > 0
    assert "DISABLE_MULTIPROC" not in os.environ


def test_resolve_tasks(tmp_path):
    write_local_tasks(tmp_path / "tasks", docs=2)
    selection = resolve_tasks([str(tmp_path / "tasks" / "neox_ll_local.yaml")])
    assert selection.names == ["neox_ll_local"] and not selection.needs_registry
    assert selection.include_paths == [str(tmp_path / "tasks")]
    selection = resolve_tasks([str(tmp_path / "tasks"), "lambada_openai"])
    assert selection.names == sorted(TASKS) + ["lambada_openai"] and selection.needs_registry
    with pytest.raises(EvalTaskError, match="no such file"):
        resolve_tasks([str(tmp_path / "missing.yaml")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(EvalTaskError, match="no task YAML"):
        resolve_tasks([str(tmp_path / "empty")])
    with pytest.raises(EvalTaskError, match="eval_tasks is empty"):
        resolve_tasks([])


def test_unknown_local_task_name_is_named(tiny):
    from megatron.evaluation.tasks import TaskSelection, task_manager

    with pytest.raises(EvalTaskError, match="neox_mc_locl.*did you mean neox_mc_local"):
        task_manager(TaskSelection(["neox_mc_locl"], [str(tiny.base / "tasks")], needs_registry=False))


def test_flat_metrics_and_results_path():
    results = {"results": {"t": {"alias": "t", "acc,none": 0.5, "acc_stderr,none": 0.1, "em,strict": 1.0}}}
    assert flat_metrics(results) == {"t/acc": 0.5, "t/acc_stderr": 0.1, "t/em_strict": 1.0}
    when = datetime.datetime(2026, 1, 2, 3, 4)
    path = results_path(tiny_args(eval_results_prefix="out/run"), when)
    assert path == "out/run_eval_results_26-01-02-03-04.json"
    assert results_path(tiny_args(eval_results_prefix=""), when) == "eval_results_26-01-02-03-04.json"


def test_results_are_written_and_logged(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    args = tiny_args(eval_results_prefix=str(tmp_path / "out" / "run"), log_dir=str(tmp_path / "logs"),
                     tensorboard_dir=str(tmp_path / "tb"))
    results = {"results": {"t": {"acc,none": 0.25}}, "iteration": 12, "metrics": {"t/acc": 0.25}}
    path = write_results(args, results)
    assert path.startswith(str(tmp_path / "out" / "run_eval_results_"))
    assert json.loads(open(path).read()) == results
    log_eval_results(args, results)
    record = json.loads((tmp_path / "logs" / "metrics.jsonl").read_text())
    assert record == {"type": "eval_tasks", "iteration": 12, "t/acc": 0.25}
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    scalars = events.Scalars("eval_tasks/t/acc")
    assert [(e.step, e.value) for e in scalars] == [(12, 0.25)]


@pytest.mark.attack("eval_tasks naming a task YAML that is not YAML, or not UTF-8")
def test_a_malformed_local_task_yaml_is_named_with_its_line(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("task: broken\ndoc_to_text: [unclosed\n")
    with pytest.raises(EvalTaskError, match=f"eval_tasks: task file {broken} is not valid YAML at line 3, column 1: "):
        resolve_tasks([str(broken)])
    write_local_tasks(tmp_path / "tasks", docs=2)
    (tmp_path / "tasks" / "latin1.yaml").write_bytes(b"task: caf\xe9\n")
    with pytest.raises(EvalTaskError, match=f"eval_tasks: task file {tmp_path / 'tasks' / 'latin1.yaml'} is not UTF-8 "
                                            f"text: the byte \\(0xe9\\) at byte offset 9"):
        resolve_tasks([str(tmp_path / "tasks")])


def _task_copy(tiny, tmp_path, name, **changes):
    """A copy of the fixture's task ``name`` under a new name (lm-eval caches tasks by name), with ``changes``."""
    config = yaml.safe_load(tiny.tasks[name].read_text())
    config.update(task=f"{name}_{tmp_path.name[-12:]}", **changes)
    path = tmp_path / "task.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, config["task"]


@pytest.mark.attack("eval_tasks naming a task whose data file is missing")
def test_a_task_whose_data_file_is_missing_is_named(tiny, tmp_path):
    missing = tmp_path / "gone.jsonl"
    path, name = _task_copy(tiny, tmp_path, "neox_mc_local", dataset_kwargs={"data_files": {"test": str(missing)}})
    args = tiny_args(train_micro_batch_size_per_gpu=3, eval_tasks=[str(path)])
    with pytest.raises(EvalTaskError) as caught:
        run_eval_tasks(args, tiny.model, tiny.ctx, iteration=1, limit=2)
    assert str(caught.value).startswith(f"eval_tasks: task {name!r}: a data file it names is missing (") and \
        str(missing) in str(caught.value), str(caught.value)


@pytest.mark.attack("eval_tasks naming a hub task while offline, its data not in the cache")
def test_a_hub_task_offline_is_named_with_the_way_out(tiny, tmp_path):
    path, name = _task_copy(tiny, tmp_path, "neox_mc_local", dataset_path="EleutherAI/no_such_dataset_here",
                            dataset_kwargs={})
    args = tiny_args(train_micro_batch_size_per_gpu=3, eval_tasks=[str(path)])
    with pytest.raises(EvalTaskError) as caught:
        run_eval_tasks(args, tiny.model, tiny.ctx, iteration=1, limit=2)
    message = str(caught.value)
    assert message.startswith(f"eval_tasks: task {name!r} cannot load its data: ") and \
        "this run is offline" in message and "HF_DATASETS_OFFLINE=0" in message, message
