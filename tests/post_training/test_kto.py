"""KTO (megatron/post_training/kto.py): the loss against the closed form computed here by hand, desirable /
undesirable weights and the KL reference point from the other half of the micro-batch; a tiny model's KTO loss
against its own log-probabilities; rewards read per completion from a reward dataset."""

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron.data.data_utils import build_train_valid_test_datasets
from megatron.model.gpt2_model import build_model
from megatron.mpu import SingleProcessState
from megatron.post_training.kto import KTOLoss, kto_loss
from megatron.post_training.reference import ReferenceModel
from megatron.post_training.reference import start_reference
from megatron.training_schedule import TrainingSchedule
from tests.data.dataset_factory import write_dataset
from tests.model.helpers import random_batch, tiny_config
from tests.neox_arguments.helpers import tiny


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def by_hand(policy, reference, rewards, beta, wd, wu) -> float:
    ratio = [p - r for p, r in zip(policy, reference)]
    half = len(ratio) // 2
    kl = [max(0.0, sum(ratio[half:]) / half), max(0.0, sum(ratio[:half]) / half)]  # each half: the other's
    total = 0.0
    for i, (r, reward) in enumerate(zip(ratio, rewards)):
        z = kl[0] if i < half else kl[1]
        if reward > 0:
            total += wd * (1 - sigmoid(beta * (r - z)))
        elif reward < 0:
            total += wu * (1 - sigmoid(beta * (z - r)))
    return total / len(ratio)


def test_loss_matches_the_closed_form() -> None:
    gen = torch.Generator().manual_seed(2)
    policy, reference = -10 * torch.rand(6, generator=gen), -10 * torch.rand(6, generator=gen)
    rewards = torch.tensor([1, -1, 1, 1, -1, 0])
    loss, metrics = kto_loss(policy, reference, rewards, 0.3, 1.5, 0.7)
    expected = by_hand(policy.tolist(), reference.tolist(), rewards.tolist(), 0.3, 1.5, 0.7)
    assert float(loss) == pytest.approx(expected, abs=1e-6)
    ratio = (policy - reference).tolist()
    assert float(metrics["chosen_rewards"]) == pytest.approx(0.3 * (ratio[0] + ratio[2] + ratio[3]) / 3, abs=1e-5)
    assert float(metrics["rejected_rewards"]) == pytest.approx(0.3 * (ratio[1] + ratio[4]) / 2, abs=1e-5)
    with pytest.raises(ValueError, match="even number"):
        kto_loss(policy[:3], reference[:3], rewards[:3], 0.3)


def test_tiny_model_kto_loss_equals_the_hand_computation() -> None:
    torch.manual_seed(0)
    config, state = tiny_config(), SingleProcessState()
    policy, reference = build_model(config, state), ReferenceModel(config, state)
    start_reference(reference, policy, None)
    inputs, (labels, loss_mask) = random_batch(batch=4, seed=5)
    rewards = torch.tensor([1, -1, -1, 1])
    loss_fn = KTOLoss(0.1, 1.0, 1.0, True)
    ref = reference.logps(inputs, labels, loss_mask)
    loss = loss_fn(policy(inputs), (labels, loss_mask, rewards, ref))
    assert float(loss.detach()) == pytest.approx(0.5, abs=1e-6)  # policy == reference: r = z = 0
    loss.backward()
    torch.optim.SGD(policy.parameters(), lr=1.0).step()
    with torch.no_grad():
        logp = torch.log_softmax(policy(inputs).double(), -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        pi = (logp * loss_mask).sum(-1)
    loss = loss_fn(policy(inputs), (labels, loss_mask, rewards, ref))
    expected = by_hand(pi.tolist(), ref.tolist(), rewards.tolist(), 0.1, 1.0, 1.0)
    assert float(loss.detach()) == pytest.approx(expected, abs=1e-6) and expected < 0.5


def test_rewards_come_with_their_completion(tmp_path: Path) -> None:
    docs = [np.full(3 + k % 4, 100 + k) for k in range(10)]
    text = write_dataset(tmp_path / "text", docs)
    label = write_dataset(tmp_path / "label", docs)
    reward = write_dataset(tmp_path / "reward", [np.array([1 if k % 3 else -1]) for k in range(10)])
    args = tiny(train_impl="kto", pack_impl="unpacked", train_data_paths=[text], train_label_data_paths=[label],
                train_reward_data_paths=[reward], valid_data_paths=[text], valid_label_data_paths=[label],
                valid_reward_data_paths=[reward], test_data_paths=[text], test_label_data_paths=[label],
                test_reward_data_paths=[reward], seq_length=8, train_iters=5, train_batch_size=2,
                train_micro_batch_size_per_gpu=2, eval_iters=0)
    train, _, _ = build_train_valid_test_datasets(args, TrainingSchedule.from_neox_args(args).split_samples())
    for i in range(len(train)):
        k = int(train[i]["text"][0]) - 100
        assert train[i]["reward"].tolist() == [1 if k % 3 else -1]
