"""Starting and stopping runs: DeepSpeed's autotuner run (autotuner) and signal forwarding from deepy.py to the
ranks, with the exit codes workers stop with (signals).

May import: megatron.errors, utils, tokenizer, data, training_schedule, checkpoint, neox_arguments, post_training, evaluation.
"""
