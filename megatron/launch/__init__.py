"""Starting and stopping runs: DeepSpeed's autotuner run (autotuner) and signal forwarding from deepy.py to the
ranks, with the exit codes workers stop with (signals).

May import: megatron.errors, utils, neox_arguments.
"""
