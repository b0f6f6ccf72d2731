"""The argument schema: one dataclass per section of GPT-NeoX's argument reference (fields, types,
defaults, docs), and NeoXArgsSchema, their union with no behaviour.

The functions that derive, validate and translate arguments (derivation, validation, deepspeed_config,
launcher) take a NeoXArgsSchema; NeoXArgs (arguments.py) adds loading, validation and encoding on top, so
nothing here imports them and the package has no import cycle."""

from dataclasses import dataclass

from megatron.neox_arguments.groups.deepspeed import NeoXArgsDeepspeedConfig
from megatron.neox_arguments.groups.deepspeed_runner import NeoXArgsDeepspeedRunner
from megatron.neox_arguments.groups.derived import NeoXArgsDerived
from megatron.neox_arguments.groups.logging import NeoXArgsLogging
from megatron.neox_arguments.groups.lr_scheduler import NeoXArgsLRScheduler
from megatron.neox_arguments.groups.model import NeoXArgsModel
from megatron.neox_arguments.groups.moe import NeoXArgsMoE
from megatron.neox_arguments.groups.optimizer import NeoXArgsOptimizer
from megatron.neox_arguments.groups.other import NeoXArgsOther
from megatron.neox_arguments.groups.parallelism import NeoXArgsParallelism
from megatron.neox_arguments.groups.text_generation import NeoXArgsTextgen
from megatron.neox_arguments.groups.tokenizer import NeoXArgsTokenizer
from megatron.neox_arguments.groups.training import NeoXArgsTraining

ARGUMENT_GROUPS = (NeoXArgsParallelism, NeoXArgsModel, NeoXArgsOptimizer, NeoXArgsLRScheduler, NeoXArgsLogging,
                   NeoXArgsOther, NeoXArgsTokenizer, NeoXArgsTraining, NeoXArgsTextgen, NeoXArgsMoE,
                   NeoXArgsDeepspeedConfig, NeoXArgsDeepspeedRunner, NeoXArgsDerived)
"""The argument groups in documentation order."""


@dataclass
class NeoXArgsSchema(*reversed(ARGUMENT_GROUPS)):  # type: ignore[misc]
    """Every argument as a field (`args.num_layers`, as GPT-NeoX code expects); no behaviour."""
