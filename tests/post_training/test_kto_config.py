"""KTO's settings travel from the config to the loss (issue 32's missed bug: every other test builds KTOLoss by hand,
so kto_beta / kto_desirable_weight / kto_undesirable_weight dropped between the YAML and the loss went unseen).
The config is read from a YAML file as deepy.py reads it, encoded and decoded as the workers receive it, and the
model is built by the training setup (megatron.training.setup); its loss is compared with the closed form at the
YAML's numbers."""

from types import SimpleNamespace

import pytest
import torch

from tests.distributed_helpers import run_distributed
from tests.model.helpers import random_batch
from tests.post_training.test_kto import by_hand

VOCAB = 128
SETTINGS = {"kto_beta": 0.37, "kto_desirable_weight": 1.9, "kto_undesirable_weight": 0.45}  # none is a default

CONFIG = """
num_layers: 2
hidden_size: 32
num_attention_heads: 4
seq_length: 16
max_position_embeddings: 16
make_vocab_size_divisible_by: 64
hidden_dropout: 0.0
attention_dropout: 0.0
train_micro_batch_size_per_gpu: 4
num_gpus: 1
train_iters: 2
distributed_backend: gloo
optimizer: {type: Adam, params: {lr: 1.0e-3}}
train_impl: kto
pack_impl: unpacked
# the datasets are not built here: named, as validation asks
train_data_paths: [unused_text]
train_label_data_paths: [unused_label]
train_reward_data_paths: [unused_reward]
valid_data_paths: [unused_text]
valid_label_data_paths: [unused_label]
valid_reward_data_paths: [unused_reward]
test_data_paths: [unused_text]
test_label_data_paths: [unused_label]
test_reward_data_paths: [unused_reward]
"""


def _loss_from_the_config(rank: int, world_size: int, config_file: str) -> dict:
    from megatron.initialize import initialize_megatron
    from megatron.neox_arguments import NeoXArgs
    from megatron.post_training.dpo import sequence_logps
    from megatron.training.setup import setup_model_and_optimizer
    from megatron.training_schedule import TrainingSchedule

    args = NeoXArgs.decode(NeoXArgs.from_ymls([config_file]).encode())  # deepy.py's reading, the workers' copy
    ctx = initialize_megatron(args, build_tokenizer_fn=lambda _: SimpleNamespace(vocab_size=VOCAB, eod=0))
    engine, _, _ = setup_model_and_optimizer(args, ctx, TrainingSchedule.from_neox_args(args))
    inputs, (labels, loss_mask) = random_batch(batch=4, seq=16, vocab=VOCAB, seed=3)
    rewards = torch.tensor([1, -1, 1, -1])
    reference = torch.tensor([-70.0, -66.0, -72.0, -69.0])
    with torch.no_grad():
        logits = engine.module(inputs)
        loss = engine.module.loss_fn(logits, (labels, loss_mask, rewards, reference))
        policy = sequence_logps(engine.module(inputs), labels, loss_mask)
    ctx.parallel_state.destroy()
    return {"loss": float(loss), "policy": policy.tolist(), "reference": reference.tolist(),
            "rewards": rewards.tolist()}


@pytest.mark.slow
def test_kto_settings_from_the_yaml_reach_the_loss(tmp_path):
    config = tmp_path / "kto.yml"
    config.write_text(CONFIG + "".join(f"{key}: {value}\n" for key, value in SETTINGS.items()))
    (got,) = run_distributed(_loss_from_the_config, world_size=1, args=(str(config),), timeout_s=300)
    expected = by_hand(got["policy"], got["reference"], got["rewards"], SETTINGS["kto_beta"],
                       SETTINGS["kto_desirable_weight"], SETTINGS["kto_undesirable_weight"])
    defaults = by_hand(got["policy"], got["reference"], got["rewards"], 0.1, 1.0, 1.0)
    assert abs(expected - defaults) > 1e-2, "the case cannot tell the settings from the defaults"
    assert abs(got["loss"] - expected) < 1e-6, (f"loss {got['loss']!r}: the closed form at the YAML's settings is "
                                                f"{expected!r}, at the defaults {defaults!r}")
