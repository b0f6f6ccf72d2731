"""'flash' layers call flash-attn 2 with the right layout and arguments, where it is installed.

flash-attn needs CUDA, so on CPU a stand-in ``flash_attn`` package computes what flash-attn's
documentation specifies (causal aligned to the bottom-right corner, window_size=(left, right), ALiBi bias
-slope * |i + k_len - q_len - j|, GQA by head groups) and records its calls; the model with 'flash' layers
must then equal the model with 'global' layers (SDPA). The gpu-marked test runs the real package.
"""
import math
import sys
import types
import warnings

import pytest
import torch

from megatron.model.gpt2_model import build_model
from megatron.model.batch import masks_and_position_ids
from megatron.model.flash import FlashAttention, FlashAttnUnavailableWarning, flash_attention_backend
from megatron.mpu import SingleProcessState
from tests.model.helpers import random_batch
from tests.model.kv_helpers import incremental_logits
from tests.model.helpers import tiny_config


def documented_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                               softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash_attn_func as its documentation specifies it, for [batch, seq, heads, head_dim] inputs."""
    assert dropout_p == 0.0 and softcap == 0.0 and not return_attn_probs
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    assert k.shape == v.shape == (b, sk, hk, d) and h % hk == 0
    k = k.repeat_interleave(h // hk, dim=2)
    v = v.repeat_interleave(h // hk, dim=2)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * scale
    i = torch.arange(sq).view(-1, 1) + sk - sq  # query i's position on the key axis
    j = torch.arange(sk).view(1, -1)
    allowed = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        allowed &= j <= i
    left, right = window_size
    if left >= 0:
        allowed &= j >= i - left
    if right >= 0:
        allowed &= j <= i + right
    if alibi_slopes is not None:
        assert alibi_slopes.dtype == torch.float32 and alibi_slopes.shape == (h,)
        scores = scores - alibi_slopes.view(1, h, 1, 1) * (i - j).abs()
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v.float()).to(q.dtype)


@pytest.fixture
def fake_flash_attn(monkeypatch):
    """Install the stand-in package; returns the list of recorded calls (k's shape, window, alibi)."""
    calls = []

    def flash_attn_func(q, k, v, **kwargs):
        calls.append(dict(q=tuple(q.shape), k=tuple(k.shape), **{key: kwargs.get(key) for key in
                                                                   ("window_size", "alibi_slopes", "causal")}))
        return documented_flash_attn_func(q, k, v, **kwargs)

    package = types.ModuleType("flash_attn")
    package.flash_attn_func = flash_attn_func
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    monkeypatch.setattr(FlashAttention, "supports", lambda self, q: True)  # let it run on CPU fp32
    return calls


def _pair(**overrides):
    """(model with 'flash' layers, model with 'global' layers), same seed and weights."""
    flash_model = build_model(tiny_config(attention_config=["flash", "flash"], **overrides), SingleProcessState())
    global_model = build_model(tiny_config(attention_config=["global", "global"], **overrides),
                               SingleProcessState())
    global_model.load_state_dict(flash_model.state_dict())
    return flash_model, global_model


def _grads(model):
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


CASES = {
    "mha": dict(),
    "gqa_rotary": dict(num_kv_heads=2, pos_emb="rotary"),
    "mqa": dict(num_kv_heads=1),
    "window": dict(sliding_window_width=5, pos_emb="rotary"),
    "alibi": dict(pos_emb="alibi", num_kv_heads=2),
    "alibi_window": dict(pos_emb="alibi", sliding_window_width=3),
}


@pytest.mark.parametrize("case", list(CASES))
def test_flash_layers_equal_global_layers_forward_and_backward(fake_flash_attn, case):
    overrides = CASES[case]
    flash_model, global_model = _pair(**overrides)
    inputs, labels = random_batch()
    losses = []
    for model in (flash_model, global_model):
        logits = model(inputs)
        loss = model.loss_fn(logits, labels)
        loss.backward()
        losses.append((logits, loss))
    torch.testing.assert_close(losses[0][0], losses[1][0], rtol=1e-5, atol=1e-5)
    flash_grads, global_grads = _grads(flash_model), _grads(global_model)
    assert flash_grads.keys() == global_grads.keys()
    for name in flash_grads:
        torch.testing.assert_close(flash_grads[name], global_grads[name], rtol=1e-4, atol=1e-6, msg=name)

    attention_calls = [c for c in fake_flash_attn if "k" in c]
    assert len(attention_calls) == 2  # one per layer: the flash path was taken
    kv_heads = overrides.get("num_kv_heads") or 4
    for call in attention_calls:
        assert call["causal"] is True
        assert call["q"] == (2, 16, 4, 8) and call["k"] == (2, 16, kv_heads, 8)  # GQA: keys not repeated
        window = overrides.get("sliding_window_width")
        assert call["window_size"] == ((-1, -1) if window is None else (window, 0))
        assert (call["alibi_slopes"] is not None) == (overrides.get("pos_emb") == "alibi")


@pytest.mark.parametrize("case", ["gqa_rotary", "alibi_window"])
def test_flash_decoding_with_kv_cache_equals_full_forward(fake_flash_attn, case):
    flash_model, _ = _pair(**CASES[case])
    flash_model.eval()
    tokens = random_batch()[0][0]
    with torch.no_grad():
        full = flash_model(random_batch()[0])
        steps = incremental_logits(flash_model, tokens, prompt=6)
    torch.testing.assert_close(steps, full, rtol=1e-5, atol=1e-5)
    decode_calls = [c for c in fake_flash_attn if "k" in c and c["q"][1] == 1]
    assert decode_calls and all(c["k"][1] > 1 for c in decode_calls)  # one query against the cache


def test_packed_documents_mask_falls_back_to_sdpa(fake_flash_attn):
    flash_model, global_model = _pair()
    tokens = torch.randint(1, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    tokens[:, 5] = 0
    mask, _, pos = masks_and_position_ids(tokens, 0, False, reset_attention_mask=True)
    inputs = (tokens, pos, mask)
    torch.testing.assert_close(flash_model(inputs), global_model(inputs), rtol=1e-5, atol=1e-5)
    assert not fake_flash_attn  # flash-attn takes no per-document mask


def test_rpe_flash_layers_do_not_load_flash_attn(fake_flash_attn):
    flash_model, global_model = _pair(pos_emb="rpe")
    inputs, _ = random_batch()
    torch.testing.assert_close(flash_model(inputs), global_model(inputs), rtol=1e-5, atol=1e-5)
    assert not fake_flash_attn


def test_without_flash_attn_installed_flash_layers_use_sdpa(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import raises ModuleNotFoundError
    flash_model, global_model = _pair(num_kv_heads=2, pos_emb="alibi")
    assert all(layer.attention.flash is None for layer in flash_model.layers)
    inputs, _ = random_batch()
    torch.testing.assert_close(flash_model(inputs), global_model(inputs), rtol=1e-5, atol=1e-5)


def test_on_a_cuda_machine_without_flash_attn_the_sdpa_fallback_is_warned_once_and_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import raises ModuleNotFoundError
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # Python's own: once per call site (catch_warnings clears the registry)
        backends = [FlashAttention.load(64) for _layer in range(2)]  # as each 'flash' layer calls it
    assert backends == [None, None]
    fallback = [w for w in caught if issubclass(w.category, FlashAttnUnavailableWarning)]
    print([str(w.message) for w in fallback])
    assert len(fallback) == 1  # two 'flash' layers, one message
    assert "flash-attn is not installed" in str(fallback[0].message) and "PyTorch SDPA" in str(fallback[0].message)
    assert flash_attention_backend() == "PyTorch SDPA (flash-attn is not installed)"


def test_without_cuda_the_missing_flash_attn_is_not_warned_about(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FlashAttnUnavailableWarning)
        assert FlashAttention.load(64) is None  # CPU runs SDPA by design: nothing to warn about


def test_the_backend_name_gives_the_installed_flash_attn_version(fake_flash_attn):
    sys.modules["flash_attn"].__version__ = "2.8.3"
    assert flash_attention_backend() == "flash-attn 2.8.3"


def test_flash_backend_supports_only_cuda_half_precision():
    backend = FlashAttention(lambda *a, **k: None, head_dim=64)
    assert not backend.supports(torch.zeros(1, 2, 3, 64))
    assert not backend.supports(torch.zeros(1, 2, 3, 64, dtype=torch.bfloat16))  # CPU


@pytest.mark.gpu
@pytest.mark.parametrize("overrides", [dict(num_kv_heads=2, pos_emb="rotary"),
                                       dict(pos_emb="alibi", sliding_window_width=5)])
def test_real_flash_attn_matches_sdpa_on_cuda(overrides):
    pytest.importorskip("flash_attn")
    flash_model, global_model = _pair(precision="bfloat16", **overrides)
    flash_model, global_model = flash_model.cuda(), global_model.cuda()
    assert all(layer.attention.flash is not None for layer in flash_model.layers)
    inputs, labels = random_batch()
    inputs = tuple(t.cuda() for t in inputs)
    with torch.no_grad():
        torch.testing.assert_close(flash_model(inputs).float(), global_model(inputs).float(), rtol=2e-2, atol=2e-2)
