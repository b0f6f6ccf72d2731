"""Rotary (rotate-half, relative-position invariance), ALiBi slopes, sinusoidal, rpe buckets."""

import math

import torch

from megatron.model.positional import (
    RotaryEmbedding,
    alibi_bias,
    alibi_slopes,
    apply_rotary,
    relative_position_bucket,
    sinusoidal_embedding,
)


def test_rotary_scores_depend_only_on_relative_position():
    torch.manual_seed(0)
    rope = RotaryEmbedding(8, 10000.0)
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)

    def score(m: int, n: int) -> float:
        cq, sq = rope(torch.tensor([m]))
        ck, sk = rope(torch.tensor([n]))
        return (apply_rotary(q, cq, sq) * apply_rotary(k, ck, sk)).sum().item()

    assert math.isclose(score(3, 1), score(10, 8), rel_tol=1e-5)
    assert math.isclose(score(7, 7), score(0, 0), rel_tol=1e-5)
    assert not math.isclose(score(3, 1), score(3, 2), rel_tol=1e-3)


def test_rotary_is_rotate_half_on_first_rotary_pct_channels():
    rope = RotaryEmbedding(4, 10000.0)  # head_dim 6, rotary_pct 2/3
    x = torch.arange(1.0, 7.0).view(1, 1, 1, 6)
    p = 3
    cos, sin = rope(torch.tensor([p]))
    out = apply_rotary(x, cos, sin).view(-1)
    f0, f1 = p * 1.0, p * 10000.0 ** (-2 / 4)
    a, b, c, d = 1.0, 2.0, 3.0, 4.0
    want = [
        a * math.cos(f0) - c * math.sin(f0),
        b * math.cos(f1) - d * math.sin(f1),
        c * math.cos(f0) + a * math.sin(f0),
        d * math.cos(f1) + b * math.sin(f1),
        5.0,
        6.0,
    ]
    torch.testing.assert_close(out, torch.tensor(want), rtol=1e-5, atol=1e-5)


def test_alibi_slopes_power_of_two_and_not():
    torch.testing.assert_close(alibi_slopes(8), torch.tensor([2.0 ** -(i + 1) for i in range(8)]))
    torch.testing.assert_close(alibi_slopes(6), torch.tensor([2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8, 2.0**-1, 2.0**-3]))
    bias = alibi_bias(torch.tensor([0.5]), torch.arange(4), torch.arange(4))
    assert bias[0, 3, 0].item() == -1.5 and bias[0, 2, 2].item() == 0.0


def test_sinusoidal_embedding_values():
    emb = sinusoidal_embedding(torch.tensor([2]), 4)
    want = [math.sin(2.0), math.sin(2.0 / 100.0), math.cos(2.0), math.cos(2.0 / 100.0)]
    torch.testing.assert_close(emb.view(-1), torch.tensor(want), rtol=1e-5, atol=1e-6)


def test_relative_position_buckets():
    rel = -torch.arange(0, 200)
    buckets = relative_position_bucket(rel, num_buckets=32, max_distance=128)
    assert buckets[:16].tolist() == list(range(16))  # exact for small distances
    assert torch.all(buckets[1:] >= buckets[:-1])  # monotone in distance
    assert buckets[-1].item() == 31 and buckets[150].item() == 31
    assert relative_position_bucket(torch.tensor([5]), 32, 128).item() == 0  # future keys: bucket 0


def test_rotary_tables_stay_fp32_in_a_bf16_model_and_equal_direct_angles():
    from megatron.model.gpt2_model import build_model
    from megatron.mpu import SingleProcessState
    from tests.model.helpers import tiny_config

    model = build_model(tiny_config(precision="bfloat16", pos_emb="rotary", seq_length=16,
                                       max_position_embeddings=4096), SingleProcessState())
    rope = model.layers[0].attention.rotary_emb
    assert rope.inv_freq.dtype == torch.bfloat16  # the module's buffer follows the model...
    cos, sin = rope.tables(2000, 3, torch.device("cpu"))
    assert cos.dtype == torch.float32  # ...the angles do not
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rope.rot_dim, 2, dtype=torch.float64) / rope.rot_dim))
    angles = torch.arange(2000, 2003, dtype=torch.float64).unsqueeze(-1) * inv_freq
    want = torch.cat((angles, angles), dim=-1)
    torch.testing.assert_close(cos.double(), want.cos(), rtol=0, atol=2e-3)  # fp32 angles near 2000 rad
    torch.testing.assert_close(sin.double(), want.sin(), rtol=0, atol=2e-3)
    beyond_cos, _ = rope.tables(4095, 3, torch.device("cpu"))  # past the table: computed directly
    torch.testing.assert_close(beyond_cos[:1], rope.tables(4095, 1, torch.device("cpu"))[0])
    torch.testing.assert_close(beyond_cos, rope(torch.arange(4095, 4098))[0])


def test_alibi_slopes_stay_fp32_in_a_bf16_model():
    from megatron.model.gpt2_model import build_model
    from megatron.mpu import SingleProcessState
    from tests.model.helpers import tiny_config

    model = build_model(tiny_config(precision="bfloat16", pos_emb="alibi", num_attention_heads=16,
                                       hidden_size=64), SingleProcessState())
    slopes = model.layers[0].attention.alibi_slopes(torch.device("cpu"))
    assert slopes.dtype == torch.float32
    torch.testing.assert_close(slopes, alibi_slopes(16), rtol=0, atol=0)  # 2^-0.5 etc. not rounded to bf16
