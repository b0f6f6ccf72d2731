"""NeoXArgsOptimizer: Optimizer choice and ZeRO knobs (the optimizer and zero_optimization dicts fill these in).

Fields, types, defaults and docs follow the GPT-NeoX argument reference."""

from dataclasses import dataclass
from typing import List, Literal, Optional, Union


@dataclass
class NeoXArgsOptimizer:
    """Optimizer choice and ZeRO knobs (the optimizer and zero_optimization dicts fill these in)."""

    optimizer_type: Literal['adam', 'onebitadam', 'cpu_adam', 'cpu_torch_adam', 'sm3', 'madgrad_wd', 'sgd', 'lion'] = 'adam'
    """
    Type of optimizer to use. Choose from ['adam', 'onebitadam', 'cpu_adam', 'cpu_torch_adam', 'sm3',
    'madgrad_wd', 'sgd', 'lion'] NOTE: sgd will use MuSGD from Mup. Mup must be enabled for this
    optimizer.
    """

    use_bnb_optimizer: bool = False
    """
    Whether to enable the bitsandbytes optimizers
    """

    zero_stage: Union[int, List[int], Literal['all']] = None
    """
    Zero Optimizer stage
    """

    zero_reduce_scatter: Optional[bool] = None
    """
    Zero: Uses reduce or reduce scatter instead of allreduce to average gradients
    """

    zero_contiguous_gradients: Optional[bool] = None
    """
    Zero: Copies the gradients to a contiguous buffer as they are produced. Avoids memory fragmentation
    during backward pass. Only useful when running very large models.
    """

    zero_reduce_bucket_size: Optional[int] = None
    """
    Zero: Number of elements reduced/allreduced at a time. Limits the memory required for the allgather
    for large model sizes
    """

    zero_allgather_bucket_size: Optional[int] = None
    """
    Zero: Number of elements allgathered at a time. Limits the memory required for the allgather for
    large model sizes
    """

    lr: Optional[float] = None
    """
    Max Learning rate during training
    """
