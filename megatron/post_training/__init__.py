"""Post-training objectives on preference data (train_impl 'dpo'): losses written against log-probabilities,
and the frozen reference model they compare the policy with."""

from megatron.post_training.dpo import DPOLoss, dpo_loss, sequence_logps
from megatron.post_training.reference import ReferenceModel

__all__ = ["DPOLoss", "ReferenceModel", "dpo_loss", "sequence_logps"]
