"""GPT-NeoX arguments: the typed schema, YAML loading, validation, derived values, DeepSpeed config and
launcher argv. See arguments.py for the life cycle."""

from megatron.neox_arguments.arguments import ARGUMENT_GROUPS, NeoXArgs, argument_types
from megatron.neox_arguments.errors import ConfigError, NeoXConfigWarning

__all__ = ["ARGUMENT_GROUPS", "ConfigError", "NeoXArgs", "NeoXConfigWarning", "argument_types"]
