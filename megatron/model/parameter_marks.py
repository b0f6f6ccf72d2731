"""The marks the model's layers put on their parameters so that the optimizer's groups can find them: set as
attributes by the model (megatron.model), read by megatron.optim.param_groups. They live with the model, which sets
them, so that the model never imports the optimizer."""

NO_DECAY_FLAG = "_no_weight_decay"
"""Set this attribute to True on a parameter to exclude it from weight decay."""

MOE_EXPERT_FLAG = "_moe_expert"
"""Set on the expert weights of the MoE layers (megatron.model.moe): ``create_moe_param_group`` gives them their
own optimizer group."""

EMBEDDING_OR_OUTPUT_FLAG = "_embedding_or_output"
"""Set on the input-embedding and output-layer weights (megatron.model.embedding / head): with decoupled_lr
``get_param_groups`` puts them in groups of their own (Megatron-LM's is_embedding_or_output_parameter)."""
