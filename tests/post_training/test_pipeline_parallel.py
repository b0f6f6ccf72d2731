"""DPO, KTO and reward models under DeepSpeed's pipeline engine (pipe_parallel_size 2): the same losses and
metrics, step after step, as the sequential model; the reference model, held whole by the last stage, is
gathered from the stages' weights, saved once and read back by any layout; the metrics reach the first stage
(the logging rank)."""

import math

import torch

from megatron.model.gpt2_model import build_model
from megatron.mpu import ParallelState, SingleProcessState
from megatron.post_training.dpo import DPOLoss
from megatron.post_training.kto import KTOLoss
from megatron.post_training.reference import ReferenceModel
from megatron.model.reward_model import RewardLoss
from megatron.post_training.reference import start_reference
from tests.distributed_helpers import run_distributed
from tests.model.helpers import random_batch, tiny_config

STEPS, GAS, ROWS = 3, 2, 4
REWARDS = torch.tensor([1, -1, -1, 1])  # KTO: desirable / undesirable completion of each row


def micro_batches():
    """STEPS x GAS micro-batches of 2 pairs (rows 0-1 chosen, 2-3 rejected), the first tokens masked as a
    prompt."""
    out = []
    for i in range(STEPS * GAS):
        inputs, (labels, loss_mask) = random_batch(batch=ROWS, seed=40 + i)
        loss_mask = loss_mask.clone()
        loss_mask[:, :4] = 0
        out.append((inputs, (labels, loss_mask)))
    return out


def loss_function(impl: str):
    return {"dpo": lambda: DPOLoss(0.5, False, True), "kto": lambda: KTOLoss(0.5, 1.0, 0.7, True),
            "rm": RewardLoss}[impl]()


def with_reference(impl: str, inputs, labels, reference):
    """The batch the loss of `impl` reads (as megatron.training.batches.ModelBatches): KTO's rewards, and the reference
    log-probabilities on the ranks that hold the reference (the last pipeline stage)."""
    if impl == "kto":
        labels = labels + (REWARDS,)
    if impl != "rm" and reference.holds:
        labels = labels + (reference.logps(inputs, labels[0], labels[1]),)
    return inputs, labels


def sequential_run(impl: str, config):
    """(per-step mean loss, per-step metrics, initial reference log-probabilities of the first micro-batch)."""
    state = SingleProcessState()
    policy, loss_fn = build_model(config, state), loss_function(impl)
    reference, initial = None, None
    if impl != "rm":
        reference = ReferenceModel(config, state)
        start_reference(reference, policy, None)
        first_inputs, (first_labels, first_mask) = micro_batches()[0]
        initial = reference.logps(first_inputs, first_labels, first_mask)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    batches, losses, metrics = micro_batches(), [], []
    for step in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for inputs, labels in batches[step * GAS:(step + 1) * GAS]:
            inputs, labels = with_reference(impl, inputs, labels, reference)
            loss = loss_fn(policy(inputs, defer_logits=True), labels)  # as training (megatron.training.step.loss_of)
            (loss / GAS).backward()
            total += loss.item() / GAS
        opt.step()
        losses.append(total)
        metrics.append(loss_fn.take_metrics())
    return losses, metrics, initial


def _pipeline_runs(rank: int, world_size: int, directory: str):
    return {impl: _pipeline_run(impl, f"{directory}/{impl}") for impl in ("dpo", "kto", "rm")}


def _pipeline_run(impl: str, directory: str):
    import os

    import deepspeed

    from megatron.training.step import objective_metrics

    os.makedirs(directory, exist_ok=True)
    shape = dict(hidden_dropout=0.0, attention_dropout=0.0, train_impl="rm" if impl == "rm" else "normal")
    expected_losses, expected_metrics, initial = sequential_run(impl, tiny_config(**shape))
    state = ParallelState(pipe_parallel_size=2, model_parallel_size=1)
    config = tiny_config(pipe_parallel_size=2, **shape)
    policy = build_model(config, state)
    policy.loss_fn = loss_function(impl)
    engine, _, _, _ = deepspeed.initialize(
        model=policy, optimizer=torch.optim.AdamW(policy.parameters(), lr=1e-2),
        config={"train_batch_size": ROWS * GAS, "train_micro_batch_size_per_gpu": ROWS,
                "gradient_accumulation_steps": GAS, "steps_per_print": 10 ** 6, "gradient_clipping": 0.0})
    reference = None
    if impl != "rm":  # as megatron.training.loop._start_reference: after the engine (and any checkpoint) is loaded
        reference = ReferenceModel(config, state)
        assert reference.holds == state.is_last_pipe_stage()
        assert start_reference(reference, engine.module, None).startswith("the policy's weights")
    data = iter([with_reference(impl, inputs, labels, reference) for inputs, labels in micro_batches()])
    losses, metrics = [], []
    for _ in range(STEPS):
        losses.append(engine.train_batch(data).item())
        metrics.append(objective_metrics(engine))  # every stage: the last stage's values
    saved = None
    if impl != "rm":
        reference.save(directory)
        again = ReferenceModel(config, state)
        assert start_reference(again, engine.module, directory).startswith("the reference weights saved")
        if again.holds:  # the file holds the whole model: a one-stage run reads it too
            whole = ReferenceModel(tiny_config(**shape), SingleProcessState())
            assert whole.load(directory)
            first_inputs, (first_labels, first_mask) = micro_batches()[0]
            saved = whole.logps(first_inputs, first_labels, first_mask)
    state.destroy()
    return losses, metrics, expected_losses, expected_metrics, saved, initial


def test_pipeline_parallel_preference_training_matches_the_sequential_model(tmp_path) -> None:
    results = run_distributed(_pipeline_runs, world_size=2, args=(str(tmp_path),))
    for impl in ("dpo", "kto", "rm"):
        for rank, (losses, metrics, want_losses, want_metrics, saved, initial) in enumerate(r[impl] for r in results):
            assert len(metrics) == STEPS and set(metrics[0]) == set(want_metrics[0]) and metrics[0], impl
            assert want_losses[0] != want_losses[-1]
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=0, atol=1e-5)
            # the rewards and KL come from sequence log-prob sums (tens of nats here) that the pipeline stages add
            # in another order: KTO's batch KL estimate moves its metrics by ~1e-5 in fp32 (1.2e-5 measured with
            # torch 2.13, 0 for DPO and RM), so 5e-5 allows a few ulps and still catches a wrong reward
            worst = max(abs(got[name] - want[name]) for got, want in zip(metrics, want_metrics) for name in want)
            print(f"{impl} rank {rank}: largest metric difference from the sequential model {worst:.2e}")
            for got, want in zip(metrics, want_metrics):
                for name in want:
                    assert math.isclose(got[name], want[name], abs_tol=5e-5), (impl, rank, name, got, want)
            if impl == "dpo":  # policy == reference at the first step
                assert math.isclose(want_losses[0], math.log(2), abs_tol=1e-6)
            if impl != "rm" and rank == 1:
                torch.testing.assert_close(saved, initial, rtol=0, atol=0)
