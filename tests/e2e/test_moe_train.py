"""Mixture-of-experts models train end to end through deepy.py on CPU: the dropless layer (pipeline engine) and
DeepSpeed's token-dropping layer (two data-parallel ranks, ZeRO 1). Losses fall, the auxiliary loss and the
expert load are logged, the checkpoints hold GPT-NeoX's expert tensors (DeepSpeed's expert files for its layer).
Both layers' exact resume, in and out of a pipeline, is tests/model/test_moe_expert_parallel.py's (four ranks, one
process group)."""

import pytest
import torch

from tests.e2e.training_run import TrainingRun, build_tiny_corpus, falls

MOE = {"num_layers": 4, "moe_num_experts": 4, "moe_top_k": 2, "moe_expert_interval": 2, "moe_jitter_eps": 0.01,
       "moe_loss_coeff": 0.01, "train_batch_size": 8, "gradient_accumulation_steps": 2, "train_iters": 16,
       "log_interval": 1, "pipe_parallel_size": 1}
DEEPSPEED = {"num_layers": 2, "moe_num_experts": 4, "moe_top_k": 2, "moe_type": "deepspeed", "moe_token_dropping": True,
             "moe_expert_interval": 2, "moe_jitter_eps": 0.01, "moe_loss_coeff": 0.01, "num_gpus": 2,
             "pipe_parallel_size": 0, "train_batch_size": 16, "gradient_accumulation_steps": 2, "train_iters": 6,
             "log_interval": 1, "zero_optimization": {"stage": 1}}


@pytest.mark.slow
def test_moe_layers_train_log_the_aux_loss_and_save_gpt_neox_expert_tensors(tmp_path):
    data = build_tiny_corpus(tmp_path / "corpus")
    straight = TrainingRun(tmp_path / "straight", data, **MOE, checkpoint_factor=8)
    straight.launch()
    straight.assert_ok()
    losses = straight.losses()
    assert len(losses) == 16 and falls(losses, by=0.3), losses
    records = straight.records("train")
    assert all(r["moe_aux_loss"] > 0 for r in records)
    assert "moe_aux_loss" in straight.result.stdout
    for record in records:  # layers 0 and 2 are MoE: 8 sequences x 32 tokens x top-2 slots per iteration
        for layer in (0, 2):
            tokens = [record[f"moe_tokens/layer_{layer:02d}/expert_{e:02d}"] for e in range(4)]
            assert sum(tokens) == 8 * 32 * 2 and record[f"moe_dropped/layer_{layer:02d}"] == 0.0
        assert "moe_tokens/layer_01/expert_00" not in record
    slot = torch.load(tmp_path / "straight" / "ckpt" / "global_step8" / "layer_02-model_00-model_states.pt",
                      map_location="cpu", weights_only=True)
    assert slot["mlp.router.layer.weight"].shape == (4, 32)
    assert slot["mlp.experts.mlp.w1"].shape == slot["mlp.experts.mlp.w2"].shape == (4 * 256, 32)

    # DeepSpeed's layer: tokens over capacity (factor 1) are dropped, the experts are in DeepSpeed's files
    # (its exact resume, also at another expert-parallel size: tests/model/test_moe_expert_parallel.py, in-process)
    straight = TrainingRun(tmp_path / "ds_straight", data, **DEEPSPEED, checkpoint_factor=3)
    straight.launch()
    straight.assert_ok()
    records = straight.records("train")
    assert all(0 < r["moe_dropped/layer_00"] < 0.5 for r in records)
    assert all(sum(r[f"moe_tokens/layer_00/expert_{e:02d}"] for e in range(4)) == 16 * 32 * 2 for r in records)
    files = sorted(p.name for p in (tmp_path / "ds_straight" / "ckpt" / "global_step3").iterdir())
    assert [f"layer_0_expert_{e}_mp_rank_00_model_states.pt" for e in range(4)] == [f for f in files if "expert" in f]
    losses = straight.losses()
    assert losses[6] < losses[1]
