"""get_batch: GPT-NeoX batch format, causal mask, eod loss masking."""

import pytest
import torch

from megatron.model import get_batch
from megatron.mpu import SingleProcessState
from tests.model.neox_args_factory import make_neox_args


def test_get_batch_format_and_eod_mask():
    text = torch.tensor([[5, 0, 7, 8, 0, 9]])
    (tokens, pos, mask), (labels, loss_mask) = get_batch(
        make_neox_args(eod_mask_loss=True), {"text": text}, SingleProcessState(), eod_token=0
    )
    assert tokens.tolist() == [[5, 0, 7, 8, 0]] and labels.tolist() == [[0, 7, 8, 0, 9]]
    assert pos.tolist() == [[0, 1, 2, 3, 4]]
    assert loss_mask.tolist() == [[1.0, 0.0, 1.0, 1.0, 0.0]]
    assert mask.shape == (1, 1, 5, 5) and mask.dtype == torch.bool
    assert mask[0, 0, 1, 2].item() and not mask[0, 0, 2, 1].item() and not mask[0, 0, 3, 3].item()
    _, (_, no_eod_mask) = get_batch(make_neox_args(), {"text": text}, SingleProcessState(), eod_token=0)
    assert no_eod_mask.sum().item() == 5
    with pytest.raises(ValueError, match="eod"):
        get_batch(make_neox_args(eod_mask_loss=True), {"text": text}, SingleProcessState())
