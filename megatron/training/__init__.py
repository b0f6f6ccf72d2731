"""Training a model: setup (model, optimizer, schedulers, DeepSpeed engine, data) and the loop (loop), the run's
state that its checkpoints keep (state: a TrainState), the muP runs that stop instead of training (mup_run), and
the worker's side of a DeepSpeed autotuning experiment (autotuning_experiment).

May import: every package of megatron but checkpoint_conversion and launch.
"""
