"""Checkpoints in GPT-NeoX's layout: writing, reading, verifying, resharding and resuming them.

Bottom to top: files (names, the ``latest`` file, atomic writes) and integrity (checksums) < hashed_save
(hashing while writing) and run_lock < tensor_parallel (how a full tensor splits), neox_checkpoint (the one
reader of a checkpoint directory) and training_state (optimizer and RNG state) < resharding, async_save,
non_persistent and engine (save / load through the DeepSpeed engine).

May import: megatron.errors, utils, mpu, data, model, optim.
"""
