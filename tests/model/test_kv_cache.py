"""Decoding with the explicit KV cache (attention keys/values, Mamba and RWKV recurrent states) gives the
logits of a full forward over the same tokens."""

import pytest
import torch

from megatron.model.kv_cache import KVCache
from megatron.model.gpt2_model import build_model
from megatron.mpu import SingleProcessState
from tests.model.helpers import random_batch
from tests.model.kv_helpers import assert_decoding_matches_full_forward
from tests.model.helpers import tiny_config


@pytest.mark.parametrize(
    "overrides",
    [
        dict(pos_emb="rotary", rotary_pct=0.5, num_kv_heads=2),
        dict(pos_emb="rotary", num_kv_heads=1, sliding_window_width=4),
        dict(pos_emb="alibi"),
        dict(pos_emb="rpe", gpt_j_residual=True),
        dict(pos_emb="learned", attention_config=["local", "global"], local_attention_block=4),
        dict(attention_config=[[["mamba"], 2]]),
        dict(attention_config=[[["rwkv"], 2]]),
        dict(num_layers=3, pos_emb="rotary", attention_config=["mamba", "global", "rwkv"]),
    ],
    ids=["rotary_gqa", "sliding_window", "alibi", "rpe_gptj", "local_global", "mamba", "rwkv", "hybrid"],
)
def test_kv_cache_matches_full_forward(overrides):
    model = build_model(tiny_config(**overrides), SingleProcessState()).eval()
    assert_decoding_matches_full_forward(model)


def test_kv_cache_overflow_and_reset():
    cache = KVCache(max_length=4)
    k = torch.zeros(1, 2, 3, 8)
    cache.update(0, k, k)
    cache.advance(3)
    with pytest.raises(ValueError, match="overflow"):
        cache.update(0, k, k)
    cache.reset()
    assert cache.length == 0


def test_logits_to_keep_computes_only_the_last_positions():
    model = build_model(tiny_config(pos_emb="rotary"), SingleProcessState()).eval()
    inputs, _ = random_batch()
    with torch.no_grad():
        full = model(inputs)
        last = model(inputs, logits_to_keep=1)
        last3 = model(inputs, logits_to_keep=3)
    assert last.shape == (full.size(0), 1, full.size(-1))
    torch.testing.assert_close(last, full[:, -1:])
    torch.testing.assert_close(last3, full[:, -3:])
