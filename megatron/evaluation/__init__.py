"""lm-evaluation-harness integration: the NeoXLM adapter (megatron.evaluation.adapter, imports lm_eval),
eval_tasks resolution (tasks) and running / reporting (harness). Importing this package does not need
lm-eval; running tasks without it raises MissingOptionalDependency naming eval_tasks."""
from megatron.evaluation.harness import (
    flat_metrics,
    log_eval_results,
    results_path,
    run_eval_tasks,
    set_offline_env,
    write_results,
)
from megatron.evaluation.tasks import EvalTaskError, TaskSelection, resolve_tasks

__all__ = ["EvalTaskError", "TaskSelection", "flat_metrics", "log_eval_results", "resolve_tasks", "results_path",
           "run_eval_tasks", "set_offline_env", "write_results"]
