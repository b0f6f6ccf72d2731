"""DPO (megatron/post_training): the loss against closed forms computed here by hand, on a tiny model's own
log-probabilities, with the fp32 cast and dpo_reference_free; the reference model's copy, save and load."""

import math

import pytest
import torch

from megatron.model.gpt2_model import build_model
from megatron.mpu import SingleProcessState
from megatron.post_training.dpo import DPOLoss, dpo_loss, sequence_logps
from megatron.post_training.reference import ReferenceModel
from megatron.post_training.reference import start_reference
from tests.model.helpers import random_batch, tiny_config


def by_hand(pi_c: float, pi_r: float, ref_c: float, ref_r: float, beta: float) -> float:
    """-log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r))), in Python floats."""
    z = beta * ((pi_c - ref_c) - (pi_r - ref_r))
    return math.log1p(math.exp(-z))


def token_logps_by_hand(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits.double(), dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return (logp * mask.double()).sum(-1)


@pytest.mark.parametrize("reference_free", [False, True])
def test_loss_and_metrics_match_the_closed_form(reference_free: bool) -> None:
    gen = torch.Generator().manual_seed(3)
    policy, reference = -20 * torch.rand(8, generator=gen), -20 * torch.rand(8, generator=gen)
    beta = 0.3
    loss, metrics = dpo_loss(policy, reference, beta, reference_free)
    ref = torch.zeros(8) if reference_free else reference
    pairs = [(float(policy[i]), float(policy[i + 4]), float(ref[i]), float(ref[i + 4])) for i in range(4)]
    assert float(loss) == pytest.approx(sum(by_hand(*p, beta) for p in pairs) / 4, abs=1e-6)
    chosen = [beta * (pc - rc) for pc, _, rc, _ in pairs]
    rejected = [beta * (pr - rr) for _, pr, _, rr in pairs]
    assert float(metrics["chosen_rewards"]) == pytest.approx(sum(chosen) / 4, abs=1e-5)
    assert float(metrics["rejected_rewards"]) == pytest.approx(sum(rejected) / 4, abs=1e-5)
    assert float(metrics["reward_margin"]) == pytest.approx((sum(chosen) - sum(rejected)) / 4, abs=1e-5)
    assert float(metrics["reward_accuracy"]) == sum(c > r for c, r in zip(chosen, rejected)) / 4


def test_sequence_logps_and_the_fp32_cast() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = 4 * torch.randn(4, 6, 50, generator=gen)
    labels = torch.randint(0, 50, (4, 6), generator=gen)
    mask = (torch.rand(4, 6, generator=gen) > 0.3).float()
    expected = token_logps_by_hand(logits, labels, mask)
    assert torch.allclose(sequence_logps(logits, labels, mask).double(), expected, atol=1e-4)
    half = logits.bfloat16()
    in_fp32 = sequence_logps(half, labels, mask, fp32=True).double()
    assert torch.allclose(in_fp32, token_logps_by_hand(half.float(), labels, mask), atol=1e-4)
    in_bf16 = sequence_logps(half, labels, mask, fp32=False).double()
    assert not torch.allclose(in_bf16, in_fp32, atol=1e-4)  # dpo_fp32: false really stays in bf16
    assert torch.allclose(in_bf16, in_fp32, rtol=0.05, atol=0.5)


def pair_batch(seed: int = 0):
    """Two pairs: rows 0-1 chosen, rows 2-3 rejected; the first tokens of each row masked as a prompt."""
    inputs, (labels, loss_mask) = random_batch(batch=4, seed=seed)
    loss_mask = loss_mask.clone()
    loss_mask[:, :5] = 0
    return inputs, (labels, loss_mask)


def test_tiny_model_dpo_loss_equals_the_hand_computation(tmp_path) -> None:
    torch.manual_seed(0)
    config, state = tiny_config(hidden_dropout=0.0, attention_dropout=0.0), SingleProcessState()
    policy = build_model(config, state)
    reference = ReferenceModel(config, state)
    assert start_reference(reference, policy, None).startswith("the policy's weights")
    inputs, (labels, loss_mask) = pair_batch()
    loss_fn = DPOLoss(beta=0.1, reference_free=False, fp32=True)
    ref_logps = reference.logps(inputs, labels, loss_mask)
    loss = loss_fn(policy(inputs), (labels, loss_mask, ref_logps))
    assert float(loss.detach()) == pytest.approx(math.log(2), abs=1e-6)  # policy == reference
    assert loss_fn.take_metrics() == {"chosen_rewards": 0.0, "rejected_rewards": 0.0, "reward_accuracy": 0.0,
                                      "reward_margin": 0.0}
    loss.backward()
    torch.optim.SGD(policy.parameters(), lr=0.5).step()
    with torch.no_grad():
        pi = token_logps_by_hand(policy(inputs), labels, loss_mask)
        ref = token_logps_by_hand(reference.model(inputs), labels, loss_mask)
    loss = loss_fn(policy(inputs), (labels, loss_mask, ref_logps))
    expected = sum(by_hand(float(pi[i]), float(pi[i + 2]), float(ref[i]), float(ref[i + 2]), 0.1) for i in range(2)) / 2
    assert float(loss.detach()) == pytest.approx(expected, abs=1e-5) and abs(expected - math.log(2)) > 1e-3
    assert loss_fn.take_metrics()["reward_accuracy"] == 1.0  # one gradient step already prefers the chosen rows
    reference.save(str(tmp_path))
    again = ReferenceModel(config, state)
    assert start_reference(again, policy, str(tmp_path)).startswith("the reference weights saved")
    assert torch.equal(again.logps(inputs, labels, loss_mask), ref_logps)
    assert not ReferenceModel(config, state).load(str(tmp_path / "elsewhere"))


def _tensor_parallel_dpo(rank: int, world_size: int) -> None:
    from megatron.mpu import ParallelState
    from tests.model.tp_helpers import expected_local

    config = tiny_config(model_parallel_size=2, hidden_dropout=0.0, attention_dropout=0.0)
    inputs, (labels, loss_mask) = pair_batch(seed=1)
    results = []
    for state in (SingleProcessState(), ParallelState(pipe_parallel_size=0, model_parallel_size=2)):
        torch.manual_seed(0)
        policy, reference = build_model(config, state), ReferenceModel(config, state)
        start_reference(reference, policy, None)
        loss_fn = DPOLoss(0.2, False, True, state.get_model_parallel_group())
        loss = loss_fn(policy(inputs), (labels, loss_mask, reference.logps(inputs, labels, loss_mask)))
        loss.backward()
        torch.optim.SGD(policy.parameters(), lr=0.5).step()
        policy.zero_grad()
        loss = loss_fn(policy(inputs), (labels, loss_mask, reference.logps(inputs, labels, loss_mask)))
        loss.backward()
        results.append((policy, float(loss.detach()), loss_fn.take_metrics()))
    (full, full_loss, full_metrics), (split, split_loss, split_metrics) = results
    assert abs(full_loss - math.log(2)) > 1e-3 and split_loss == pytest.approx(full_loss, abs=1e-5)
    assert split_metrics == pytest.approx(full_metrics, abs=1e-5)
    for name, (want, got) in expected_local(full, split, rank, 2, grads=True).items():
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=f"grad {name}")


def test_tensor_parallel_dpo_matches_one_rank() -> None:
    from tests.distributed_helpers import run_distributed

    run_distributed(_tensor_parallel_dpo, world_size=2)


@pytest.mark.attack("a DPO reference-weights file holding a pickle that runs a command, on resume")
def test_a_planted_reference_file_is_refused_naming_it(tmp_path) -> None:
    from megatron.errors import CheckpointError
    from tests.checkpoint.test_files import plant

    config, state = tiny_config(), SingleProcessState()
    reference = ReferenceModel(config, state)
    reference.save(str(tmp_path))
    plant(reference.file(str(tmp_path)), tmp_path / "ran")
    with pytest.raises(CheckpointError, match=r"dpo_reference_mp_rank_00.pt holds a Python object .*posix.system"):
        ReferenceModel(config, state).load(str(tmp_path))
    assert not (tmp_path / "ran").exists()


def test_lora_reference_is_the_base_without_a_copy_and_gives_an_explicit_copys_loss() -> None:
    """Under LoRA the reference is the policy with its adapters off (AdapterFreeReference): the log-probabilities and
    the DPO loss of an explicit frozen copy of the base, with no second set of weights; a step moves the adapters
    only, and the reference stays the base."""
    from megatron.model.lora import is_lora_parameter
    from megatron.post_training.reference import AdapterFreeReference
    from tests.model.test_lora import randomize_lora_b

    targets = {"r": 2, "alpha": 4, "target_modules": ["query_key_value", "dense", "linear1", "linear2"]}
    config, state = tiny_config(hidden_dropout=0.1, attention_dropout=0.0, lora=targets), SingleProcessState()
    policy = build_model(config, state)
    randomize_lora_b(policy)  # adapters that change the output
    explicit = ReferenceModel(tiny_config(hidden_dropout=0.1, attention_dropout=0.0), state)
    explicit.model.load_state_dict({n: t for n, t in policy.state_dict().items() if not is_lora_parameter(n)})
    reference = AdapterFreeReference(policy, state)
    adapted = sum(getattr(m, "lora", None) is not None for m in policy.modules())
    assert {p.data_ptr() for p in reference.model.parameters()} == {p.data_ptr() for p in policy.parameters()}
    inputs, (labels, loss_mask) = pair_batch()
    loss_fn = DPOLoss(beta=0.1, reference_free=False, fp32=True)
    base_logps = explicit.logps(inputs, labels, loss_mask)
    logps = reference.logps(inputs, labels, loss_mask)
    assert policy.training and sum(getattr(m, "lora", None) is not None for m in policy.modules()) == adapted == 8
    torch.testing.assert_close(logps, base_logps, rtol=0, atol=1e-6)
    policy.eval()  # the policy's own log-probabilities (with the adapters) differ from the base's
    with torch.no_grad():
        assert (sequence_logps(policy(inputs), labels, loss_mask) - base_logps).abs().max() > 1e-2
    policy.train()
    torch.manual_seed(3)
    loss = loss_fn(policy(inputs), (labels, loss_mask, logps))
    torch.manual_seed(3)
    explicit_loss = float(loss_fn(policy(inputs), (labels, loss_mask, base_logps)).detach())
    print("DPO loss, reference = adapters off:", float(loss.detach()), "explicit frozen copy:", explicit_loss)
    assert float(loss.detach()) == pytest.approx(explicit_loss, abs=1e-6) and abs(explicit_loss - math.log(2)) > 1e-3
    loss.backward()
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=0.5).step()
    moved = {n for n, p in policy.named_parameters() if not torch.equal(p, before[n])}
    assert moved and all(is_lora_parameter(n) for n in moved), sorted(moved)
    torch.testing.assert_close(reference.logps(inputs, labels, loss_mask), base_logps, rtol=0, atol=1e-6)
