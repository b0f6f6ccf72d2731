"""A hybrid model (Mamba, attention and RWKV layers: configs/hybrid_tiny.yml's stack) trains through deepy.py
train.py on CPU, its loss falls, and a run resumed from its checkpoint at step 6 gives the straight run's losses
exactly. One test of two launches (~15 s each) covers both recurrent block types; the layers themselves are
tested in tests/model/test_mamba.py, test_rwkv.py and test_recurrent_tensor_parallel.py."""

import os

import pytest

from megatron.utils.yaml_text import parse_yaml_text
from tests.e2e.launch import REPO
from tests.e2e.training_run import TrainingRun, build_tiny_corpus, falls

pytestmark = pytest.mark.slow

MODEL_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "norm", "pos_emb", "attention_config")


def hybrid_model():
    """The model keys of the shipped configs/hybrid_tiny.yml (the run keeps the tests' short sequences)."""
    path = os.path.join(REPO, "configs", "hybrid_tiny.yml")
    values = parse_yaml_text(open(path, encoding="utf-8").read(), path)
    return {key: values[key] for key in MODEL_KEYS}


def test_hybrid_mamba_attention_rwkv_trains_and_resumes_exactly(tmp_path):
    data = build_tiny_corpus(tmp_path / "corpus")
    model = hybrid_model()
    assert model["attention_config"] == ["mamba", "global", "rwkv"]
    straight = TrainingRun(tmp_path / "straight", data, num_gpus=1, train_iters=12, checkpoint_factor=6, **model)
    straight.launch()
    straight.assert_ok()
    losses = straight.losses()
    assert sorted(losses) == list(range(1, 13)) and falls(losses), losses

    resumed = straight.resumed_from(6, tmp_path / "resumed")
    resumed.launch()
    resumed.assert_ok()
    assert resumed.losses() == {i: losses[i] for i in range(7, 13)}
