"""Training a model: setup (model, optimizer, schedulers, DeepSpeed engine, data) and the loop (loop), the run's
state that its checkpoints keep (state), and the muP runs that stop instead of training (mup_run).

May import: every package of megatron but checkpoint_conversion and launch.
"""
