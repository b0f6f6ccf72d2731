"""Post-training objectives on preference data: DPO (train_impl 'dpo') on log-probabilities against a frozen
reference model, and reward models (train_impl 'rm') with the Bradley-Terry loss on a value head."""

from megatron.post_training.dpo import DPOLoss, dpo_loss, sequence_logps
from megatron.post_training.reference import ReferenceModel
from megatron.post_training.reward_model import RewardLoss, sequence_rewards

__all__ = ["DPOLoss", "ReferenceModel", "RewardLoss", "dpo_loss", "sequence_logps", "sequence_rewards"]
