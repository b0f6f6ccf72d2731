"""Optimization: the optimizer GPT-NeoX's `optimizer` dict asks for (optimizers), its parameter groups
(param_groups), the learning-rate and weight-decay schedule (learning_rates), and ZeRO-Offload's config rules
(zero_offload).

May import: megatron.model (the marks its layers put on parameters), megatron.mup, megatron.training_schedule,
megatron.utils.deepspeed_ops, and third-party packages. Imported by megatron.training.loop, megatron.training.mup_run,
megatron.initialize and megatron.neox_arguments. Nothing is imported here, so that importing one module (the
launcher reads zero_offload's rules before torch is needed elsewhere) does not import the others."""
