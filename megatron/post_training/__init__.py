"""Post-training objectives: DPO (train_impl 'dpo') and KTO ('kto') on log-probabilities against a frozen
reference model, and reward models ('rm') with the Bradley-Terry loss on a value head."""

from megatron.post_training.dpo import DPOLoss, dpo_loss, sequence_logps
from megatron.post_training.kto import KTOLoss, kto_loss
from megatron.post_training.reference import ReferenceModel
from megatron.post_training.reward_model import RewardLoss, sequence_rewards

__all__ = ["DPOLoss", "KTOLoss", "ReferenceModel", "kto_loss", "RewardLoss", "dpo_loss", "sequence_logps", "sequence_rewards"]
