"""get_batch: GPT-NeoX batch format, causal mask, eod loss masking; truncate_batch (the sequence-length curriculum)."""

import pytest
import torch

from megatron.model.batch import BatchOptions, get_batch
from megatron.model.batch import is_causal_only
from megatron.mpu import SingleProcessState
from tests.model.helpers import random_batch, tiny_config


def test_get_batch_format_and_eod_mask():
    text = torch.tensor([[5, 0, 7, 8, 0, 9]])
    (tokens, pos, mask), (labels, loss_mask) = get_batch(
        BatchOptions(eod_mask_loss=True), {"text": text}, SingleProcessState(), eod_token=0
    )
    assert tokens.tolist() == [[5, 0, 7, 8, 0]] and labels.tolist() == [[0, 7, 8, 0, 9]]
    assert pos.tolist() == [[0, 1, 2, 3, 4]]
    assert loss_mask.tolist() == [[1.0, 0.0, 1.0, 1.0, 0.0]]
    # plainly causal: the causal-only mask, whose shape says so (no s x s mask; the layers hide the future)
    assert mask.shape == (1, 1, 1, 1) and mask.dtype == torch.bool and not mask.any() and is_causal_only(mask)
    _, (_, no_eod_mask) = get_batch(BatchOptions(), {"text": text}, SingleProcessState(), eod_token=0)
    assert no_eod_mask.sum().item() == 5
    with pytest.raises(ValueError, match="eod"):
        get_batch(BatchOptions(eod_mask_loss=True), {"text": text}, SingleProcessState())


def test_reset_position_ids_and_attention_mask_restart_at_each_document():
    args = BatchOptions(reset_position_ids=True, reset_attention_mask=True)
    text = torch.tensor([[5, 0, 6, 7, 0, 8, 9]])
    (tokens, positions, mask), _ = get_batch(args, {"text": text}, SingleProcessState(), eod_token=0)
    assert positions.tolist() == [[0, 1, 0, 1, 2, 0]]
    allowed = (~mask[0, 0]).int().tolist()
    assert allowed[3] == [0, 0, 1, 1, 0, 0] and allowed[5] == [0, 0, 0, 0, 0, 1]
    assert not is_causal_only(mask)


def test_documents_packed_with_resets_match_each_document_alone():
    from megatron.model.gpt2_model import build_model

    torch.manual_seed(0)
    args = BatchOptions(reset_position_ids=True, reset_attention_mask=True)
    model = build_model(tiny_config(pos_emb="learned"), SingleProcessState()).eval()
    first, second = [11, 12, 13, 0], [21, 22, 23, 24, 25]
    packed, _ = get_batch(args, {"text": torch.tensor([first + second + [0]])}, SingleProcessState(), eod_token=0)
    alone, _ = get_batch(BatchOptions(), {"text": torch.tensor([second + [0]])},
                         SingleProcessState(), eod_token=0)
    with torch.no_grad():
        torch.testing.assert_close(model(packed)[:, len(first):], model(alone), rtol=1e-5, atol=1e-5)


def test_negative_labels_are_masked_and_label_datasets_are_used():
    args = BatchOptions(labels=True)
    text = torch.tensor([[3, 4, 5, -100, -100]])
    label = torch.tensor([[3, -100, 5, 6, -100]])
    (tokens, _, _), (labels, loss_mask) = get_batch(args, {"text": text, "label": label}, SingleProcessState(),
                                                    eod_token=0)
    assert tokens.min() >= 0
    assert labels.tolist() == [[0, 5, 6, 0]] and loss_mask.tolist() == [[0.0, 1.0, 1.0, 0.0]]


def test_a_truncated_batch_is_the_prefix_and_the_model_sees_only_it():
    from megatron.model.gpt2_model import build_model
    from megatron.model.batch import truncate_batch

    (tokens, position_ids, mask), (labels, loss_mask) = batch = random_batch(seq=16, seed=3)
    (t, p, m), (lab, lm) = truncate_batch(batch, 8)
    assert torch.equal(t, tokens[:, :8]) and torch.equal(p, position_ids[:, :8]) and torch.equal(lab, labels[:, :8])
    assert torch.equal(lm, loss_mask[:, :8]) and m is mask and is_causal_only(m)  # the causal-only mask stays
    args = BatchOptions(reset_attention_mask=True)
    text = torch.tensor([[5, 0, 6, 7, 0, 8, 9, 3, 4]])
    (_, _, documents), _ = got = get_batch(args, {"text": text}, SingleProcessState(), eod_token=0)
    (_, _, cut), _ = truncate_batch(got, 5)
    assert torch.equal(cut, documents[:, :, :5, :5]) and cut.shape == (1, 1, 5, 5)
    assert truncate_batch(batch, 16) is batch and truncate_batch(batch, 32) is batch
    torch.manual_seed(0)
    model = build_model(tiny_config(hidden_dropout=0.0, attention_dropout=0.0), SingleProcessState()).eval()
    with torch.no_grad():
        full, short = model((tokens, position_ids, mask)), model((t, p, m))
    assert short.shape[1] == 8 and torch.allclose(short, full[:, :8], atol=1e-5)  # causal: the prefix's logits
    assert not torch.allclose(model.loss_fn(short, (lab, lm)), model.loss_fn(full, (labels, loss_mask)))
