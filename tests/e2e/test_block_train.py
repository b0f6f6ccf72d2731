"""Block-sparse attention, gMLP / aMLP layers and parameter sharing train through deepy.py train.py on CPU: one
run over every new layer type (beside a local layer with its window from sparsity_config), each unique layer
used at two positions (num_unique_layers), the loss falls, the checkpoint holds each shared layer once under
GPT-NeoX's names, and a second launch resumed from the middle checkpoint gives the same losses exactly. The
layers themselves are tested in tests/model/test_block_sparse.py, test_gmlp.py, test_param_sharing.py and
test_block_tensor_parallel.py."""

import pytest
import torch

from tests.e2e.training_run import TrainingRun, build_tiny_corpus, falls

pytestmark = pytest.mark.slow

UNIQUE = ["sparse_fixed", "gmlp", "bigbird", "amlp", "local", "bslongformer", "sparse_variable"]


def test_sparse_gmlp_and_shared_layers_train_save_once_and_resume_exactly(tmp_path):
    data = build_tiny_corpus(tmp_path / "corpus")
    run = TrainingRun(tmp_path / "run", data, num_gpus=1, train_iters=12, checkpoint_factor=6,
                      num_layers=2 * len(UNIQUE), attention_config=UNIQUE * 2, num_unique_layers=len(UNIQUE),
                      param_sharing_style="grouped", gmlp_attn_dim=16,
                      sparsity_config={"block": 8, "num_local_blocks": 2, "num_random_blocks": 1,
                                       "different_layout_per_head": True})
    run.launch()
    run.assert_ok()
    losses = run.losses()
    assert sorted(losses) == list(range(1, 13)) and falls(losses), losses
    assert run.latest() == "global_step12"

    states = tmp_path / "run" / "ckpt" / "global_step12" / "mp_rank_00_model_states.pt"
    keys = set(torch.load(states, map_location="cpu", weights_only=False)["module"])
    slots = {int(k.split(".")[1]) for k in keys if k.startswith("sequential.")}
    assert slots & set(range(2, 2 + 2 * len(UNIQUE))) == set(range(2, 2 + len(UNIQUE))), sorted(slots)
    assert {"sequential.3.sgu.proj.weight", "sequential.5.sgu.attn.proj_qkv.weight",
            "sequential.2.attention.query_key_value.weight"} <= keys

    run.launch(iteration=6)  # resume from the middle checkpoint on purpose
    run.assert_ok()
    iterations = [r["iteration"] for r in run.records("train")]
    assert iterations == list(range(1, 13)) + list(range(7, 13)), iterations  # the second launch trained 7..12
    resumed = run.losses()
    assert {i: resumed[i] for i in range(7, 13)} == {i: losses[i] for i in range(7, 13)}
