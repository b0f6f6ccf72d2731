"""Checkpoints in GPT-NeoX's layout: writing, reading, verifying, resharding and resuming them.

Bottom to top: format (file names, the layout marker, ``latest`` and the complete tags, neox_args.json and the
configs/*.yml; no torch, the launcher reads it) < files (reading .pt files without running code from them, the
client state, which kind of checkpoint a directory holds) and integrity (checksums, atomic writes) < hashed_save
(hashing while writing), run_lock, rng_state (each process's RNG, written once per rank) and tensor_parallel (how
a full tensor splits) < neox_checkpoint (the one reader of a checkpoint directory, and its writer) <
training_state (optimizer state as one record) and s3_upload (s3_path: complete checkpoints to S3 and back) <
resharding, async_save, non_persistent, weights_only (no_save_optim's filter) < engine (find, verify, load and save
through the DeepSpeed engine: the training loop's door) < lora (a LoRA run's checkpoints: the adapters and a pointer
to their base).

May import: megatron.errors, utils, mpu, data, model, optim.
"""
