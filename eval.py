#!/usr/bin/env python
"""Worker entry point for evaluation with lm-evaluation-harness (0.4.x); launch it through deepy.py with
the model's config (whose `load` names the checkpoint):

    python deepy.py eval.py CONFIG.yml --eval_tasks lambada_openai
    python deepy.py eval.py CONFIG.yml --eval_tasks path/to/my_task.yaml path/to/tasks_dir/

eval_tasks entries are lm-eval task names (their data come from the Hugging Face hub) or paths to local
task YAML files or directories of them (see megatron/evaluation/tasks.py). The documents are shared out
over the data-parallel ranks; tensor- and pipeline-parallel ranks run the model together. Rank 0 writes
the results to ``{eval_results_prefix}_eval_results_YY-MM-DD-HH-MM.json`` (lm-eval's results plus the
checkpoint's ``iteration`` and a flat ``metrics`` dict), prints lm-eval's table, and logs the metrics
(prefix ``eval_tasks``) to log_dir/metrics.jsonl, tensorboard_dir and wandb when those are configured.
HF_HUB_OFFLINE and HF_DATASETS_OFFLINE are set unless the environment sets them.
"""

import sys

from megatron.neox_arguments import NeoXArgs
from megatron.errors import ConfigError


def main() -> int:
    from megatron.errors import CheckpointError, DataError, TokenizerError
    from megatron.evaluation.tasks import EvalTaskError
    from megatron.evaluation.harness import set_offline_env
    from megatron.utils.optional_deps import MissingOptionalDependency, require

    set_offline_env()
    try:
        neox_args = NeoXArgs.consume_neox_args()
        require("lm_eval", "eval.py (eval_tasks)", "eval")
        from megatron.evaluation.harness import log_eval_results, run_eval_tasks, write_results
        from megatron.evaluation.tasks import resolve_tasks
        from megatron.inference.loading import setup_for_inference

        resolve_tasks(neox_args.eval_tasks or [])  # a bad entry fails before the model is built
        engine, ctx, iteration = setup_for_inference(neox_args)
        results = run_eval_tasks(neox_args, engine, ctx, iteration)
        if ctx.parallel_state.rank == 0:
            from lm_eval.utils import make_table

            print(make_table(results), flush=True)
            print(f"eval.py: results written to {write_results(neox_args, results)}", flush=True)
            log_eval_results(neox_args, results)
        ctx.destroy()
    except (ConfigError, CheckpointError, DataError, TokenizerError, MissingOptionalDependency,
            EvalTaskError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
