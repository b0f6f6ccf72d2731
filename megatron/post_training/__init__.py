"""Post-training objectives: DPO (train_impl 'dpo', dpo) and KTO ('kto', kto) on log-probabilities against a frozen
reference model (reference), the reference log-probabilities computed ahead of training (precompute, data_paths),
REINFORCE on online rollouts ('reinforce', reinforce) with the rollout server that samples and scores them
(rollout_server, example_rewards), and the choice between them (objectives). A reward model ('rm': value head and
Bradley-Terry loss) is a model variant: megatron.model.reward_model.

May import: megatron.errors, utils, tokenizer, mpu, data, model, checkpoint, inference.
"""
