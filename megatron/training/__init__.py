"""Training a model: the run set up for DeepSpeed (setup: model, optimizer, LR schedule, engine), the batches it
reads (batches), one training step and one evaluation (step), the loop over them (loop), the run's state that its
checkpoints keep (state: a TrainState), the muP runs that stop instead of training (mup_run), and the worker's side
of a DeepSpeed autotuning experiment (autotuning_experiment).

May import: every package of megatron but checkpoint_conversion and launch.
"""
