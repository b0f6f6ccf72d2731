"""A mixture-of-experts model trains end to end through deepy.py on CPU: its loss falls, the auxiliary loss and
the expert load are logged, the checkpoint holds GPT-NeoX's expert tensors, and a stopped run resumes exactly."""

import pytest
import torch

from tests.e2e.training_run import TrainingRun, build_tiny_corpus, falls

MOE = {"num_layers": 4, "moe_num_experts": 4, "moe_top_k": 2, "moe_expert_interval": 2, "moe_jitter_eps": 0.01,
       "moe_loss_coeff": 0.01, "train_batch_size": 8, "gradient_accumulation_steps": 2, "train_iters": 16,
       "log_interval": 1, "pipe_parallel_size": 1}


@pytest.mark.slow
def test_moe_trains_logs_the_aux_loss_and_resumes_exactly(tmp_path):
    data = build_tiny_corpus(tmp_path / "corpus")
    straight = TrainingRun(tmp_path / "straight", data, **MOE, save=None, load=None)
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

    stopped = TrainingRun(tmp_path / "stopped", data, **MOE, exit_interval=8)
    stopped.launch()
    stopped.assert_ok()
    assert stopped.latest() == "global_step8" and max(stopped.losses()) == 8
    slot = torch.load(tmp_path / "stopped" / "ckpt" / "global_step8" / "layer_02-model_00-model_states.pt",
                      map_location="cpu", weights_only=True)
    assert slot["mlp.router.layer.weight"].shape == (4, 32)
    assert slot["mlp.experts.mlp.w1"].shape == slot["mlp.experts.mlp.w2"].shape == (4 * 256, 32)
    stopped.launch()
    stopped.assert_ok()
    assert stopped.losses() == losses
