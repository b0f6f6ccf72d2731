"""NeoXArgsDerived: values computed from the user's arguments, never set in YAML.

They are fields (not properties) so that they travel to the workers inside the encoded config and show up
in `dataclasses.fields(NeoXArgs)` like every other argument."""

from dataclasses import dataclass
from typing import Optional


@dataclass
class NeoXArgsDerived:
    """Values computed by NeoXArgs after validation."""

    data_parallel_size: Optional[int] = None
    """
    Number of data-parallel replicas: global_num_gpus / (pipeline stages x model_parallel_size).
    """

    deepspeed_config: Optional[dict] = None
    """
    The DeepSpeed config dict handed to deepspeed.initialize (exactly DeepSpeed's keys).
    """
