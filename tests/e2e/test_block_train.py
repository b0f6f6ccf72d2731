"""Block-sparse attention and gMLP / aMLP layers train through deepy.py train.py on CPU in one launch (one
layer of each kind beside a local layer with its window from sparsity_config), the loss falls, and the
checkpoint holds the gMLP tensors under GPT-NeoX's names. The layers themselves are tested in
tests/model/test_block_sparse.py, test_gmlp.py and test_block_tensor_parallel.py."""

import glob

import pytest
import torch

from tests.e2e.training_run import TrainingRun, build_tiny_corpus, falls

pytestmark = pytest.mark.slow

LAYERS = ["sparse_fixed", "gmlp", "bigbird", "amlp", "local", "bslongformer", "sparse_variable"]


def test_sparse_and_gmlp_layers_train_and_save(tmp_path):
    data = build_tiny_corpus(tmp_path / "corpus")
    run = TrainingRun(tmp_path / "run", data, num_gpus=1, train_iters=12, checkpoint_factor=12,
                      num_layers=len(LAYERS), attention_config=LAYERS, gmlp_attn_dim=16,
                      sparsity_config={"block": 8, "num_local_blocks": 2, "num_random_blocks": 1,
                                       "different_layout_per_head": True})
    run.launch()
    run.assert_ok()
    losses = run.losses()
    assert sorted(losses) == list(range(1, 13)) and falls(losses), losses
    assert run.latest() == "global_step12"
    [states] = glob.glob(str(tmp_path / "run" / "ckpt" / "global_step12" / "mp_rank_00_model_states.pt"))
    keys = set(torch.load(states, map_location="cpu", weights_only=False)["module"])
    assert {"sequential.3.sgu.proj.weight", "sequential.5.sgu.attn.proj_qkv.weight",
            "sequential.2.attention.query_key_value.weight"} <= keys, sorted(keys)
