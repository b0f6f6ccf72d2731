"""Precomputed reference log-probabilities (megatron/post_training/precompute.py, generate.py under text_gen_type
'precompute'): read back through PairwiseDataset they give the DPO losses of the reference model run on the fly."""

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatron.data.data_utils import build_train_valid_test_datasets
from megatron.data.pairwise_dataset import as_text_and_labels
from megatron.model.batch import BatchOptions, get_batch
from megatron.model.gpt2_model import build_model
from megatron.mpu import SingleProcessState
from megatron.errors import ConfigError
from megatron.launch.prelaunch import data_problems
from megatron.post_training.dpo import DPOLoss
from megatron.post_training.reference import ReferenceModel
from megatron.post_training.precompute import precompute_reference_logps
from megatron.post_training.reference import start_reference
from megatron.training_schedule import TrainingSchedule
from tests.data.dataset_factory import write_dataset
from tests.model.helpers import tiny_config
from tests.neox_arguments.helpers import tiny

SEQ = 16


def test_precomputed_logps_give_the_on_the_fly_losses(tmp_path: Path) -> None:
    rng = np.random.RandomState(0)
    pos = write_dataset(tmp_path / "pos", [rng.randint(0, 128, rng.randint(5, SEQ + 6)) for _ in range(10)])
    neg = write_dataset(tmp_path / "neg", [rng.randint(0, 128, rng.randint(5, SEQ + 6)) for _ in range(10)])
    config = dict(dataset_impl="pairwise", train_impl="dpo", pack_impl="unpacked", seq_length=SEQ, train_iters=3,
                  train_batch_size=4, train_micro_batch_size_per_gpu=4, pos_train_data_paths=[pos],
                  neg_train_data_paths=[neg], precompute_model_name="sft")
    (missing, *_) = data_problems(tiny(**config))
    assert "pos_sft' (.bin/.idx) not found" in missing and "text_gen_type: precompute" in missing
    with pytest.raises(ConfigError, match="needs precompute_model_name"):
        tiny(**{**config, "precompute_model_name": None, "text_gen_type": "precompute"})

    model_config, state = tiny_config(max_position_embeddings=SEQ, seq_length=SEQ), SingleProcessState()
    torch.manual_seed(0)
    sft = build_model(model_config, state)
    args = tiny(**config, text_gen_type="precompute")
    written = precompute_reference_logps(args, sft, SimpleNamespace(parallel_state=state, device="cpu"))
    assert written == [f"{pos}_sft", f"{neg}_sft"] and data_problems(tiny(**config)) == []

    reference = ReferenceModel(model_config, state)
    start_reference(reference, sft, None)
    args = tiny(**config)
    train, _, _ = build_train_valid_test_datasets(args, TrainingSchedule.from_neox_args(args).split_samples())
    samples = [train[i] for i in range(4)]
    data = as_text_and_labels({k: torch.as_tensor(np.stack([s[k] for s in samples])) for k in samples[0]})
    inputs, (labels, loss_mask) = get_batch(BatchOptions(labels=True), data, state)
    precomputed = (data["ref"][:, 1:] * loss_mask).sum(dim=-1)
    on_the_fly = reference.logps(inputs, labels, loss_mask)
    torch.testing.assert_close(precomputed, on_the_fly, rtol=0, atol=1e-4)
    policy = build_model(model_config.replace(seed=7), state)  # other weights, so the losses are not ln 2
    logits = policy(inputs)
    losses = [float(DPOLoss(0.1, False, True)(logits, (labels, loss_mask, ref)).detach())
              for ref in (precomputed, on_the_fly)]
    assert losses[0] == pytest.approx(losses[1], abs=1e-6) and abs(losses[0] - np.log(2)) > 1e-3


def test_kto_reads_precomputed_logps_that_give_the_on_the_fly_losses(tmp_path: Path) -> None:
    """KTO data (completions, labels, rewards): generate.py's precompute writes `{data path}_sft` for every split;
    training's batches (megatron.training.batches.ModelBatches) then carry their sums, which give the KTO losses of the
    reference model run on the fly."""
    from megatron.initialize import RunContext
    from megatron.model.config import ModelConfig
    from megatron.post_training.kto import KTOLoss
    from megatron.post_training.reference import ReferenceModel
    from megatron.training.batches import ModelBatches

    rng = np.random.RandomState(1)
    docs = [rng.randint(0, 128, rng.randint(5, SEQ + 6)) for _ in range(12)]
    text = write_dataset(tmp_path / "text", docs)
    label = write_dataset(tmp_path / "label", [np.where(np.arange(len(d)) < 3, -100, d) for d in docs])
    reward = write_dataset(tmp_path / "reward", [np.array([1 if k % 3 else -1]) for k in range(12)])
    valid = write_dataset(tmp_path / "valid", docs[:6])
    valid_label = write_dataset(tmp_path / "valid_label", docs[:6])
    valid_reward = write_dataset(tmp_path / "valid_reward", [np.array([1])] * 6)
    config = dict(train_impl="kto", pack_impl="unpacked", seq_length=SEQ, train_iters=3, train_batch_size=4,
                  train_micro_batch_size_per_gpu=4, train_data_paths=[text], train_label_data_paths=[label],
                  train_reward_data_paths=[reward], valid_data_paths=[valid], valid_label_data_paths=[valid_label],
                  valid_reward_data_paths=[valid_reward], test_data_paths=[valid], test_label_data_paths=[valid_label],
                  test_reward_data_paths=[valid_reward], precompute_model_name="sft")
    (missing, *_) = data_problems(tiny(**config))
    assert "text_sft' (.bin/.idx) not found" in missing and "text_gen_type: precompute" in missing

    model_config, state = tiny_config(max_position_embeddings=SEQ, seq_length=SEQ), SingleProcessState()
    torch.manual_seed(0)
    sft = build_model(model_config, state)
    written = precompute_reference_logps(tiny(**config, text_gen_type="precompute"), sft,
                                         SimpleNamespace(parallel_state=state, device="cpu"))
    assert written == [f"{text}_sft", f"{valid}_sft"] and data_problems  # the test split's file is valid's(tiny(**config)) == []

    args = tiny(**config)
    train, _, _ = build_train_valid_test_datasets(args, TrainingSchedule.from_neox_args(args).split_samples())
    samples = [train[i] for i in range(4)]
    assert samples[0]["ref"].dtype == np.float32 and samples[0]["ref"].shape == (SEQ + 1,)
    batch = {k: torch.as_tensor(np.stack([s[k] for s in samples])) for k in samples[0]}
    ctx = RunContext(parallel_state=state, rng_tracker=None, tokenizer=type("T", (), {"eod": 0})(),
                     device=torch.device("cpu"), model_config=ModelConfig.from_neox_args(args, padded_vocab_size=128))
    inputs, (labels, loss_mask, rewards, precomputed) = next(ModelBatches(args, ctx, iter([batch])))
    reference = ReferenceModel(model_config, state)
    start_reference(reference, sft, None)
    on_the_fly = reference.logps(inputs, labels, loss_mask)
    torch.testing.assert_close(precomputed, on_the_fly, rtol=0, atol=1e-4)
    assert set(rewards.tolist()) == {1, -1}
    policy = build_model(model_config.replace(seed=7), state)  # other weights, so the losses are not 0.5
    logits = policy(inputs)
    losses = [float(KTOLoss(0.1, 1.0, 0.7, True)(logits, (labels, loss_mask, rewards, ref)).detach())
              for ref in (precomputed, on_the_fly)]
    assert losses[0] == pytest.approx(losses[1], abs=1e-6) and abs(losses[0] - 0.5) > 1e-3
