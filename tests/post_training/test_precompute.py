"""Precomputed reference log-probabilities (megatron/post_training/precompute.py, generate.py under text_gen_type
'precompute'): read back through PairwiseDataset they give the DPO losses of the reference model run on the fly."""

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatron.data.data_utils import build_train_valid_test_datasets
from megatron.data.pairwise_dataset import as_text_and_labels
from megatron.model import BatchOptions, build_model, get_batch
from megatron.mpu import SingleProcessState
from megatron.neox_arguments import ConfigError
from megatron.neox_arguments.prelaunch import data_problems
from megatron.post_training import DPOLoss, ReferenceModel
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
