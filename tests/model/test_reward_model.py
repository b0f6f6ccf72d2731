"""Reward models (train_impl 'rm'): the value head's reward at the last scored position, the Bradley-Terry loss
against its closed form, a tiny reward model learning a separable preference, and its export to transformers'
*ForSequenceClassification scoring the same (transformers as the oracle)."""

import math

import pytest
import torch

from megatron.checkpoint_conversion import hf_gptneox, hf_llama
from megatron.checkpoint.neox_checkpoint import flat_state_dict
from megatron.model.gpt2_model import build_model
from megatron.mpu import SingleProcessState
from megatron.model.reward_model import RewardLoss, sequence_rewards
from tests.checkpoint_conversion.helpers import batch_inputs
from tests.model.helpers import tiny_config


def test_rewards_are_read_at_the_last_scored_position_and_the_loss_is_bradley_terry() -> None:
    values = torch.arange(24, dtype=torch.float32).view(4, 6, 1)
    mask = torch.zeros(4, 6)
    for row, last in enumerate((5, 2, 3, 0)):
        mask[row, : last + 1] = 1
    assert sequence_rewards(values, mask).tolist() == [5.0, 8.0, 15.0, 18.0]
    loss_fn = RewardLoss()
    loss = loss_fn(values, (None, mask))
    by_hand = (math.log1p(math.exp(-(5.0 - 15.0))) + math.log1p(math.exp(-(8.0 - 18.0)))) / 2
    assert float(loss) == pytest.approx(by_hand, rel=1e-6)
    assert loss_fn.take_metrics() == {"chosen_rewards": 6.5, "rejected_rewards": 16.5, "reward_accuracy": 0.0,
                                      "reward_margin": -10.0}
    with pytest.raises(ValueError, match="no position with loss mask 1"):
        sequence_rewards(values, torch.zeros(4, 6))


def test_z_loss_adds_its_coefficient_times_the_mean_squared_rewards_as_gpt_neox() -> None:
    """z_loss from the config (deepy.py's path: NeoXArgs -> ModelConfig -> the model's loss) adds GPT-NeoX's
    z_loss x mean(r_chosen^2 + r_rejected^2) to the Bradley-Terry loss."""
    from megatron.model.config import ModelConfig
    from megatron.model.gpt2_model import loss_function
    from tests.neox_arguments.helpers import RM_ARGS, tiny

    values = torch.tensor([[1.5], [-0.5], [0.25], [2.0]]).view(4, 1, 1)
    mask = torch.ones(4, 1)
    config = ModelConfig.from_neox_args(tiny(**RM_ARGS, z_loss=0.1), padded_vocab_size=128)
    loss = loss_function(config, SingleProcessState())(values, (None, mask))
    chosen, rejected = (1.5, -0.5), (0.25, 2.0)
    bradley_terry = sum(math.log1p(math.exp(-(c - r))) for c, r in zip(chosen, rejected)) / 2
    z = 0.1 * sum(c * c + r * r for c, r in zip(chosen, rejected)) / 2
    assert float(loss) == pytest.approx(bradley_terry + z, rel=1e-6), (float(loss), bradley_terry, z)


def pairs(seed: int = 0, rows: int = 8, seq: int = 12):
    """Separable pairs: chosen rows end in token 7, rejected rows in token 9; random lengths (padded)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(10, 90, (2 * rows, seq), generator=gen)
    mask = torch.zeros(2 * rows, seq)
    for r in range(rows):
        last = int(torch.randint(4, seq, (1,), generator=gen))
        for row, token in ((r, 7), (r + rows, 9)):
            tokens[row, last] = token
            mask[row, : last + 1] = 1
    return tokens, mask


@pytest.mark.parametrize("architecture", ["neox", "llama"])
def test_tiny_reward_model_learns_and_scores_the_same_in_transformers(architecture: str) -> None:
    from transformers import GPTNeoXForSequenceClassification, LlamaForSequenceClassification

    shape = dict(pos_emb="rotary", train_impl="rm", hidden_dropout=0.0, attention_dropout=0.0)
    if architecture == "llama":
        shape.update(norm="rmsnorm", activation="swiglu", use_bias_in_norms=False, use_bias_in_mlp=False,
                     use_bias_in_attn_linear=False, no_weight_tying=True)
    config = tiny_config(**shape)
    torch.manual_seed(0)
    model = build_model(config, SingleProcessState())
    assert isinstance(model.loss_fn, RewardLoss) and not config.tied_embeddings
    test_tokens, test_mask = pairs(seed=1)
    if architecture == "neox":  # learning is the same for both; the export differs
        tokens, mask = pairs(rows=16)
        optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
        for _ in range(25):
            loss = model.loss_fn(model(batch_inputs(tokens)), (None, mask))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        assert float(loss.detach()) < math.log(2) - 0.2
        assert model.loss_fn.take_metrics()["reward_accuracy"] > 0.5  # the mean over the 25 steps
    model.eval()
    with torch.no_grad():
        ours = sequence_rewards(model(batch_inputs(test_tokens)), test_mask)
    chosen, rejected = ours.chunk(2)
    if architecture == "neox":
        assert float((chosen > rejected).float().mean()) > 0.9  # held-out pairs

    state = flat_state_dict(model.state_dict(), config)
    if architecture == "neox":
        hf_config, hf_state = hf_gptneox.to_hf(config, state)
        hf = GPTNeoXForSequenceClassification(hf_config)
    else:
        hf_config, hf_state = hf_llama.to_hf(config, state, "llama")
        hf = LlamaForSequenceClassification(hf_config)
    assert hf_config.num_labels == 1 and "score.weight" in hf_state
    hf.load_state_dict(hf_state, strict=True)
    hf.eval()
    with torch.no_grad():
        for row in range(len(test_tokens)):
            length = int(test_mask[row].sum())
            score = hf(test_tokens[row: row + 1, :length]).logits  # the last token is the scored one
            assert float(score) == pytest.approx(float(ours[row]), abs=1e-4)
