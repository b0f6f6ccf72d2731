"""NeoXArgsMoE: Mixture-of-experts settings.

Fields, types, defaults and docs follow the GPT-NeoX argument reference."""

from dataclasses import dataclass
from typing import Literal, Optional


@dataclass
class NeoXArgsMoE:
    """Mixture-of-experts settings."""

    expert_interval: int = 2
    """
    Have one MoE layer every expert_interval layers
    """

    moe_top_k: int = 1
    """
    Activate top K experts in MoE
    """

    use_tutel: bool = False
    """
    Use Tutel optimizations in MoE
    """

    moe_num_experts: int = 1
    """
    Number of MoE experts
    """

    moe_loss_coeff: float = 0.1
    """
    Coefficient for MoE loss
    """

    moe_train_capacity_factor: float = 1.0
    """
    The capacity of the expert at train time
    """

    moe_eval_capacity_factor: float = 1.0
    """
    The capacity of the expert at eval time
    """

    moe_min_capacity: int = 4
    """
    The minimum capacity per expert regardless of the capacity_factor
    """

    moe_token_dropping: bool = False
    """
    Whether to drop tokens when exceeding capacity
    """

    create_moe_param_group: bool = True
    """
    Whether to create a separate parameter group for MoE parameters
    """

    moe_use_residual: bool = True
    """
    Whether to use residual in MoE
    """

    moe_expert_parallel_size: int = 1
    """
    Number of parallel experts in MoE
    """

    moe_type: str = 'megablocks'
    """
    Either `deepspeed` or `megablocks`
    """

    moe_expert_interval: int = 1
    """
    GPT-NeoX's newer name for the spacing of MoE layers: one MoE layer every moe_expert_interval layers.
    """

    moe_router_type: Literal['sinkhorn', 'topk'] = 'sinkhorn'
    """
    Token routing: "sinkhorn" (GPT-NeoX trains with it) or "topk".
    """

    moe_glu: bool = False
    """
    Use gated linear units in MoE
    """

    moe_lbl_in_fp32: bool = False
    """
    Whether to compute the load balancing loss in fp32.
    """

    moe_jitter_eps: Optional[float] = None
    """
    Coefficient for MoE routing jitter. Jitter is not used if set to None
    """

    enable_expert_tensor_parallelism: bool = False
    """
    Enable expert tensor parallelism
    """
