"""Arguments that are accepted and have no effect here, each with the reason.

Every other argument changes behaviour (something outside the schema reads it: the workers, the DeepSpeed
config, the launcher) or is refused when set (validation.NOT_SUPPORTED_YET / NOT_SUPPORTED_SETTINGS,
aliases.REMOVED). tests/neox_arguments/test_argument_coverage.py holds the code to that; this list is
rendered into configs/neox_arguments.md. An entry needs a real reason: GPT-NeoX itself ignores the key, or
the only value it can take here is what always happens."""

from typing import Dict

NO_OP_ARGUMENTS: Dict[str, str] = {
    "deepspeed": "GPT-NeoX's 'use DeepSpeed' flag: DeepSpeed is always the engine here (false is refused).",
    "deepspeed_activation_checkpointing": "deprecated in GPT-NeoX: activation checkpointing is always DeepSpeed's "
                                          "(false is refused; checkpoint_activations switches checkpointing).",
    "use_cpu_initialization": "weights are always initialised whole on the CPU and then sharded (GPT-NeoX's "
                              "use_cpu_initialization: true path), so they do not depend on the parallel layout; "
                              "false (draw each shard on its GPU) would only draw other random numbers.",
    "short_seq_prob": "GPT-NeoX reads it nowhere (a leftover of Megatron's BERT data pipeline): GPT samples are "
                      "always seq_length tokens.",
    "fused_kernels_build_path": "GPT-NeoX's build directory for its CUDA fused kernels: the fused kernels here are "
                                "Triton kernels compiled just in time into Triton's own cache (TRITON_CACHE_DIR).",
    "git_hash": "informational: set from `git rev-parse` of this code at launch and recorded with the run "
                "(neox_args.json in each checkpoint, the wandb / comet run config); nothing reads it back.",
}
"""Argument name -> why it has no effect."""
