"""Running eval_tasks through lm-evaluation-harness on a loaded model, from eval.py or from the training
loop, and reporting the scores (results JSON, metrics.jsonl, tensorboard, comet, wandb).

``run_eval_tasks(neox_args, engine, ctx, iteration)`` is collective: every rank calls it; it returns the
same JSON-safe results dict on every rank (lm-eval's ``results``, ``versions``, ``n-shot``, ... plus
``iteration`` and a flat ``metrics`` dict {"task/metric": value}). The model is put in eval mode for the
run and back in its previous mode after; the global RNG streams are left as they were, so calling it
from the training loop does not change the training run.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import random
from importlib.metadata import version
from typing import Any, Dict, Iterator, Optional

import numpy as np
import torch

from megatron.evaluation.tasks import EvalTaskError, first_task_problem, resolve_tasks, task_manager
from megatron.inference.text_generation import build_runner, max_sequence_length
from megatron.mpu.host_collectives import broadcast_object
from megatron.observability.training_logger import MetricSinks
from megatron.utils.optional_deps import MissingOptionalDependency, require

BOOTSTRAP_ITERS = 1000
"""Bootstrap resamples for the standard errors of non-mean metrics (lm-eval's default, 100000, takes
minutes for perplexities)."""


def set_offline_env() -> None:
    """No hub lookups: local tasks and cached datasets only (and 4-10x faster start-up)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


@contextlib.contextmanager
def no_forked_pool() -> Iterator[None]:
    """lm-eval's bootstrap standard errors (perplexity) run in a ``multiprocessing.Pool`` unless DISABLE_MULTIPROC
    is set. Forking a training process whose other threads (gloo, the tensorboard writer, the async checkpoint
    writer, tqdm's monitor) may hold a lock at that moment can leave the child deadlocked, and the run hangs at
    "bootstrapping for stddev" (seen in CI). The single-process path draws the same resamples."""
    before = os.environ.get("DISABLE_MULTIPROC")
    os.environ["DISABLE_MULTIPROC"] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["DISABLE_MULTIPROC"]
        else:
            os.environ["DISABLE_MULTIPROC"] = before


@contextlib.contextmanager
def _untouched_rng() -> Iterator[None]:
    """Restore the Python, numpy and torch RNG states after lm-eval (which reseeds them)."""
    py_state, np_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_available() else []):
        try:
            yield
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)


def flat_metrics(results: Dict[str, Any]) -> Dict[str, float]:
    """{"task/metric": value} for the numeric scores (filter suffix ",none" dropped, stderr kept)."""
    flat: Dict[str, float] = {}
    for task, scores in (results.get("results") or {}).items():
        for key, value in scores.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            metric, _, filt = key.partition(",")
            flat[f"{task}/{metric}" + (f"_{filt}" if filt and filt != "none" else "")] = float(value)
    return flat


def _json_safe(obj: Any) -> Any:
    from lm_eval.utils import handle_non_serializable

    return json.loads(json.dumps(obj, default=handle_non_serializable))


MIN_LM_EVAL_FOR_DATA_PARALLEL = (0, 4, 12)
"""lm-eval gathers data-parallel results through the LM's all_gather / gather_object / barrier from 0.4.12
(before, through an accelerate Accelerator the adapter does not have)."""


def _check_lm_eval_version(parallel_state) -> None:


    installed = version("lm-eval")
    numbers = tuple(int(p) for p in installed.split(".")[:3] if p.isdigit())
    if parallel_state.get_data_parallel_world_size() > 1 and numbers < MIN_LM_EVAL_FOR_DATA_PARALLEL:
        raise MissingOptionalDependency(
            f"eval_tasks on {parallel_state.get_data_parallel_world_size()} data-parallel ranks needs lm-eval >= "
            f"0.4.12 (installed: {installed}); pip install -r requirements/requirements-eval.txt, or run with "
            "one data-parallel rank")


def run_eval_tasks(neox_args, engine, ctx, iteration: int, limit: Optional[int] = None) -> Dict[str, Any]:
    """Evaluate neox_args.eval_tasks with the model (see module docstring); ``limit`` caps the documents
    per task (lm-eval's --limit)."""
    set_offline_env()
    require("lm_eval", "eval_tasks", "eval")
    _check_lm_eval_version(ctx.parallel_state)
    from lm_eval.evaluator import simple_evaluate

    from megatron.evaluation.adapter import NeoXLM  # an lm_eval.api.model.LM: imports lm_eval, an optional package

    selection = resolve_tasks(neox_args.eval_tasks or [])
    manager = task_manager(selection)
    module = getattr(engine, "module", engine)
    was_training = module.training
    module.eval()
    try:
        lm = NeoXLM(build_runner(engine, ctx.parallel_state, ctx.model_config), ctx.tokenizer, ctx.parallel_state,
                    max_length=max_sequence_length(ctx.model_config),
                    batch_size=int(neox_args.train_micro_batch_size_per_gpu or 1), device=ctx.device,
                    seed=int(neox_args.seed))
        try:
            with _untouched_rng(), no_forked_pool():
                raw = simple_evaluate(model=lm, tasks=selection.names, task_manager=manager, limit=limit,
                                      bootstrap_iters=BOOTSTRAP_ITERS, log_samples=False, random_seed=None,
                                      numpy_random_seed=None, torch_random_seed=None,
                                      fewshot_random_seed=int(neox_args.seed))
        except Exception:  # a task lm-eval cannot build (missing data file, hub data offline): named, else re-raised
            problem = first_task_problem(manager, selection.names)
            if problem is None:
                raise
            raise EvalTaskError(problem) from None
    finally:
        module.train(was_training)
    if raw is not None:
        raw.pop("samples", None)
    results = broadcast_object(_json_safe(raw) if raw is not None else None, src=0) or {}
    results["iteration"] = int(iteration)
    results["metrics"] = flat_metrics(results)
    return results


def results_path(neox_args, now: Optional[datetime.datetime] = None) -> str:
    """``{eval_results_prefix}_eval_results_YY-MM-DD-HH-MM.json`` (``eval_results_...`` without a prefix)."""
    stamp = (now or datetime.datetime.now()).strftime("%y-%m-%d-%H-%M")
    prefix = neox_args.eval_results_prefix or ""
    return f"{prefix}_eval_results_{stamp}.json" if prefix else f"eval_results_{stamp}.json"


def write_results(neox_args, results: Dict[str, Any]) -> str:
    path = results_path(neox_args)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(results, handle, indent=2, sort_keys=True)
    return path


def log_eval_results(neox_args, results: Dict[str, Any]) -> None:
    """The flat metrics as an 'eval_tasks' record at the checkpoint's iteration, to every sink the config
    asks for (metrics.jsonl, tensorboard, comet, wandb; see megatron.observability.training_logger.MetricSinks). Call on rank 0."""
    sinks = MetricSinks(neox_args, rank=0, is_logging_rank=True)
    try:
        sinks.write("eval_tasks", {"type": "eval_tasks", "iteration": int(results.get("iteration", 0)),
                                   **results.get("metrics", {})})
    finally:
        sinks.close()
