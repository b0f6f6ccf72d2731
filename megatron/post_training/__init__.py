"""Post-training objectives: DPO (train_impl 'dpo') and KTO ('kto') on log-probabilities against a frozen
reference model, and reward models ('rm') with the Bradley-Terry loss on a value head."""

from megatron.post_training.dpo import DPOLoss, dpo_loss, sequence_logps
from megatron.post_training.kto import KTOLoss, kto_loss
from megatron.post_training.reference import ReferenceModel
from megatron.post_training.reward_model import RewardLoss, sequence_rewards


def preference_loss(neox_args, group=None):
    """The loss function train_impl 'dpo' / 'kto' put in place of the model's own, None for the others."""
    if neox_args.train_impl == "dpo":
        return DPOLoss(neox_args.dpo_beta, neox_args.dpo_reference_free, neox_args.dpo_fp32, group)
    if neox_args.train_impl == "kto":
        return KTOLoss(neox_args.kto_beta, neox_args.kto_desirable_weight, neox_args.kto_undesirable_weight,
                       neox_args.kto_fp32, group)
    return None


__all__ = ["DPOLoss", "KTOLoss", "ReferenceModel", "RewardLoss", "dpo_loss", "kto_loss", "preference_loss",
           "sequence_logps", "sequence_rewards"]
