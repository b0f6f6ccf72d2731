"""Optimization: the optimizer GPT-NeoX's `optimizer` dict asks for (optimizers), its parameter groups
(param_groups), the learning-rate and weight-decay schedule (learning_rates), and ZeRO-Offload's config rules
(zero_offload), and the base weight decay the config's checks read (weight_decay). Nothing is imported here,
so that importing one module (the launcher reads zero_offload's and weight_decay's rules without torch) does not
import the others.

May import: megatron.errors, utils, mpu, mup, data, training_schedule, model.
"""
