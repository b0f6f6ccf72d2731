"""Which post-training loss takes the place of the model's own for train_impl 'dpo' / 'kto' / 'reinforce'."""

from megatron.post_training.dpo import DPOLoss
from megatron.post_training.kto import KTOLoss
from megatron.post_training.reinforce import ReinforceLoss


def preference_loss(neox_args, group=None):
    """The loss function train_impl 'dpo' / 'kto' / 'reinforce' put in place of the model's own, None for the
    others."""
    if neox_args.train_impl == "dpo":
        return DPOLoss(neox_args.dpo_beta, neox_args.dpo_reference_free, neox_args.dpo_fp32, group)
    if neox_args.train_impl == "kto":
        return KTOLoss(neox_args.kto_beta, neox_args.kto_desirable_weight, neox_args.kto_undesirable_weight,
                       neox_args.kto_fp32, group)
    if neox_args.train_impl == "reinforce":
        return ReinforceLoss(neox_args.kl_impl, neox_args.kl_div_beta, neox_args.fp32_reinforce, group)
    return None
