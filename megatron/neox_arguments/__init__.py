"""GPT-NeoX arguments: the typed schema (groups/), YAML loading, validation, derived values, the DeepSpeed
config and the launcher argv. See arguments.py for the life cycle.

May import: megatron.errors, utils, tokenizer, mpu, mup, data, training_schedule, model, optim, checkpoint, observability.
"""

from megatron.errors import ConfigError, NeoXConfigWarning
from megatron.neox_arguments.arguments import NeoXArgs, argument_types
from megatron.neox_arguments.groups import ARGUMENT_GROUPS

__all__ = ["ARGUMENT_GROUPS", "ConfigError", "NeoXArgs", "NeoXConfigWarning", "argument_types"]
