"""Hyperparameter transfer, the point of muP: the best Adam learning rate of a width-64 sweep stays best (within
one grid step) at width 256, on real text (the offline corpus: the Python standard library's sources, as bytes)."""

import itertools
from types import SimpleNamespace

import torch

from megatron.data.corpora import iter_stdlib_texts
from megatron.model.gpt2_model import build_model
from megatron.model.batch import masks_and_position_ids
from megatron.model.config import ModelConfig
from megatron.mpu import SingleProcessState
from megatron.mup.parametrization import base_shapes_of, mup_initialize, set_base_shapes
from megatron.optim.optimizers import build_optimizer

SEQ, BATCH, STEPS, BASE = 32, 4, 12, 64
LEARNING_RATES = [2.0 ** -p for p in (10, 8, 6, 4)]
PS = SingleProcessState()


def text_batches(count: int, seed: int):
    data = torch.tensor(list("".join(itertools.islice(iter_stdlib_texts(), 40)).encode()[:200_000]))
    generator = torch.Generator().manual_seed(seed)
    for _ in range(count):
        starts = torch.randint(0, len(data) - SEQ - 1, (BATCH,), generator=generator)
        text = torch.stack([data[s:s + SEQ + 1] for s in starts])
        tokens = text[:, :-1]
        mask, loss_mask, positions = masks_and_position_ids(tokens, None, False)
        yield (tokens, positions, mask), (text[:, 1:], loss_mask)


def held_out_loss(config: ModelConfig, base, lr: float, train, held_out) -> float:
    model = build_model(config, PS)
    set_base_shapes(model, base, "base")
    mup_initialize(model)
    args = SimpleNamespace(optimizer_type="adam", optimizer={"type": "Adam", "params": {}}, lr=lr, weight_decay=0.0,
                           start_weight_decay=None, end_weight_decay=None, weight_decay_incr_style="constant",
                           decoupled_lr=None)
    optimizer = build_optimizer(args, model)
    for inputs, labels in train:
        optimizer.zero_grad(set_to_none=True)
        model.loss_fn(model(inputs), labels).backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        return sum(float(model.loss_fn(model(inputs), labels)) for inputs, labels in held_out) / len(held_out)


def test_best_learning_rate_at_width_64_stays_best_at_width_256():
    config = ModelConfig(num_layers=2, hidden_size=BASE, num_attention_heads=4, seq_length=SEQ, padded_vocab_size=256,
                         use_mup=True)
    base = base_shapes_of(build_model(config, PS), build_model(config.replace(hidden_size=2 * BASE), PS))
    train, held_out = list(text_batches(STEPS, seed=0)), list(text_batches(2, seed=1))
    best = {}
    for width in (BASE, 4 * BASE):
        wide = config.replace(hidden_size=width, mup_width_mult=width / BASE)
        losses = [held_out_loss(wide, base, lr, train, held_out) for lr in LEARNING_RATES]
        best[width] = losses.index(min(losses))
        if width == BASE:  # the grid brackets the optimum: a best rate at its edge would prove nothing
            assert 0 < best[width] < len(LEARNING_RATES) - 1, losses
    assert abs(best[4 * BASE] - best[BASE]) <= 1, best
