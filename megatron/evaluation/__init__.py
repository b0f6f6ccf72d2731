"""lm-evaluation-harness integration: the NeoXLM adapter (adapter, imports lm_eval), eval_tasks resolution (tasks,
light: the launcher checks task names with it before any process starts) and running / reporting (harness). Running
tasks without lm-eval raises MissingOptionalDependency naming eval_tasks.

May import: megatron.errors, utils, mpu, model, observability, inference.
"""
