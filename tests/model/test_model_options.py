"""Each option family builds, runs forward and backward, and satisfies a property that can fail."""

import math

import pytest
import torch

from megatron.model.gpt2_model import build_model
from megatron.model.activations import get_activation
from megatron.model.batch import causal_attention_mask
from megatron.model.init_functions import get_init_method, tensor_seed
from megatron.model.norms import build_norm
from megatron.mpu import SingleProcessState
from megatron.errors import ConfigError
from tests.model.helpers import random_batch, tiny_config


def _run(**overrides):
    """Build, forward, backward; return (model, logits, loss)."""
    model = build_model(tiny_config(**overrides), SingleProcessState())
    inputs, labels = random_batch()
    logits = model(inputs)
    loss = model.loss_fn(logits, labels)
    loss.backward()
    assert torch.isfinite(loss)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in trainable)
    return model, logits, loss


@pytest.mark.parametrize("pos_emb", ["learned", "rotary", "sinusoidal", "rpe", "alibi", "none"])
def test_pos_emb_families_train(pos_emb):
    model, logits, _ = _run(pos_emb=pos_emb)
    assert logits.shape == (2, 16, 128)
    assert hasattr(model.embedding, "position_embeddings") == (pos_emb == "learned")


def test_learned_position_embedding_offset_shifts_positions():
    a = build_model(tiny_config(opt_pos_emb_offset=2, max_position_embeddings=18), SingleProcessState())
    assert a.embedding.position_embeddings.weight.shape[0] == 18  # GPT-NeoX's: max_position_embeddings rows
    inputs, _ = random_batch()
    h, _ = a.embedding(inputs)
    want = a.embedding.word_embeddings(inputs[0]) + a.embedding.position_embeddings.weight[2:18]
    torch.testing.assert_close(h, want)


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm", "scalenorm"])
def test_norm_families(norm):
    _run(norm=norm)
    layer = build_norm(tiny_config(norm=norm, rms_norm_epsilon=1e-8, scalenorm_epsilon=1e-8), 64)
    x = torch.randn(5, 64) * 3 + 1
    y = layer(x)
    if norm == "layernorm":
        torch.testing.assert_close(y.mean(-1), torch.zeros(5), atol=1e-5, rtol=0)
        torch.testing.assert_close(y.var(-1, unbiased=False), torch.ones(5), atol=1e-3, rtol=0)
    elif norm == "rmsnorm":
        torch.testing.assert_close(y.pow(2).mean(-1).sqrt(), torch.ones(5), atol=1e-4, rtol=0)
    else:
        torch.testing.assert_close(y.norm(dim=-1), torch.ones(5), atol=1e-5, rtol=0)


def test_non_parametric_layernorm_is_torch_layer_norm_without_weight_or_bias():
    """GPT-NeoX's norm 'non_parametric_layernorm' (its PR #1338): F.layer_norm with no affine, layernorm_epsilon."""
    config = tiny_config(norm="non_parametric_layernorm", layernorm_epsilon=0.5, use_qk_layernorm=True)
    layer = build_norm(config, 64)
    x = torch.randn(5, 64, dtype=torch.float64) * 0.3 + 1
    expected = torch.nn.functional.layer_norm(x, (64,), None, None, 0.5)
    torch.testing.assert_close(layer(x), expected, rtol=0, atol=1e-12)
    assert list(layer.parameters()) == []
    model, _, _ = _run(norm="non_parametric_layernorm", use_qk_layernorm=True)
    names = [name for name, _ in model.named_parameters()]
    assert not any("norm" in name for name in names), names


def test_norm_bias_flag_and_unsupported_norms():
    assert build_norm(tiny_config(use_bias_in_norms=False), 8).bias is None
    with pytest.raises(ConfigError, match="te_layernorm"):
        build_model(tiny_config(norm="te_layernorm"), SingleProcessState())


ACTIVATIONS = ["gelu", "geglu", "relu", "softsign", "swish", "mish", "silu", "reglu", "swiglu", "bilinear", "glu"]


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_activation_families(activation):
    _run(activation=activation)
    fn, is_gated = get_activation(activation)
    x = torch.randn(3, 8)
    base = {
        "gelu": torch.nn.functional.gelu,
        "geglu": torch.nn.functional.gelu,
        "relu": torch.relu,
        "reglu": torch.relu,
        "softsign": lambda t: t / (1 + t.abs()),
        "swish": lambda t: t / (1 + (-t).exp()),
        "silu": lambda t: t / (1 + (-t).exp()),
        "swiglu": lambda t: t / (1 + (-t).exp()),
        "mish": lambda t: t * torch.tanh(torch.log1p(t.exp())),
        "bilinear": lambda t: t,
        "glu": torch.sigmoid,
    }[activation]
    if is_gated:
        torch.testing.assert_close(fn(x), base(x[:, 4:]) * x[:, :4], rtol=1e-5, atol=1e-6)
    else:
        torch.testing.assert_close(fn(x), base(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("activation", ["gelu", "geglu"])
def test_onnx_safe_writes_the_gelu_out_from_erf_with_the_same_logits(activation):
    """onnx_safe (from the config: NeoXArgs -> ModelConfig) traces to erf and elementwise ops, never aten::gelu (the
    op ONNX opsets below 20 lack), and the model computes the same logits."""
    from megatron.model.config import ModelConfig
    from tests.neox_arguments.helpers import tiny

    config = ModelConfig.from_neox_args(tiny(activation=activation, onnx_safe=True, hidden_dropout=0.0,
                                             attention_dropout=0.0), padded_vocab_size=128)
    assert config.onnx_safe
    inputs, _ = random_batch()
    logits = {}
    for safe in (False, True):
        torch.manual_seed(0)
        model = build_model(config.replace(onnx_safe=safe), SingleProcessState()).eval()
        with torch.no_grad():
            logits[safe] = model(inputs)
        activations = [m.activation for m in model.modules() if callable(getattr(m, "activation", None))]
        assert len(activations) == config.num_layers
        for act in activations:
            graph = str(torch.jit.trace(act, torch.randn(2, 16)).graph)
            assert ("aten::gelu" in graph) != safe and ("aten::erf" in graph) == safe, (safe, graph)
    torch.testing.assert_close(logits[True], logits[False], rtol=1e-5, atol=1e-5)
    x = torch.linspace(-6, 6, 101, dtype=torch.float64)
    torch.testing.assert_close(get_activation("gelu", onnx_safe=True)[0](x), torch.nn.functional.gelu(x),
                               rtol=1e-12, atol=1e-12)


def test_onnx_safe_with_bias_gelu_fusion_is_refused():
    from tests.neox_arguments.helpers import problems_of

    assert "onnx_safe=true writes the GeLU out from erf" in problems_of(onnx_safe=True, bias_gelu_fusion=True)


def test_mlp_width_rules():
    assert tiny_config(hidden_size=32).ffn_width == 128
    assert tiny_config(hidden_size=32, expansion_factor=2.0).ffn_width == 64
    assert tiny_config(hidden_size=32, intermediate_size=100, mlp_multiple_of=16).ffn_width == 112
    assert tiny_config(hidden_size=48, num_attention_heads=4, activation="swiglu").ffn_width == 64  # int(192*2/3)//2
    model = build_model(
        tiny_config(activation="swiglu", intermediate_size=96, mlp_multiple_of=8), SingleProcessState()
    )
    assert model.layers[0].mlp.linear1.weight.shape == (64, 32)
    assert model.layers[0].mlp.linear2.weight.shape == (32, 32)


def test_gpt_j_residual_and_tied():
    _run(gpt_j_residual=True)
    tied, _, _ = _run(gpt_j_residual=True, gpt_j_tied=True)
    assert not hasattr(tied.layers[0], "post_attention_layernorm")
    untied = build_model(tiny_config(gpt_j_residual=True), SingleProcessState())
    # Untied with ln2 == ln1 computes exactly what the tied layer computes.
    untied.load_state_dict(tied.state_dict(), strict=False)
    for layer in untied.layers:
        layer.post_attention_layernorm.load_state_dict(layer.input_layernorm.state_dict())
    inputs, _ = random_batch()
    torch.testing.assert_close(untied(inputs), tied(inputs))
    # Zero attention and MLP outputs: a GPT-J layer is the identity on the residual stream.
    layer = tied.layers[0]
    with torch.no_grad():
        for lin in (layer.attention.dense, layer.mlp.linear2):
            lin.weight.zero_()
            lin.bias.zero_()
    x = torch.randn(2, 16, 32)
    torch.testing.assert_close(layer((x, inputs[2]))[0], x)


def test_gqa_with_kv_heads_equal_heads_is_mha():
    inputs, _ = random_batch()
    mha = build_model(tiny_config(pos_emb="rotary"), SingleProcessState())
    same = build_model(tiny_config(pos_emb="rotary", num_kv_heads=4), SingleProcessState())
    torch.testing.assert_close(mha(inputs), same(inputs), rtol=0, atol=0)


def test_gqa_equals_mha_with_shared_kv_heads():
    """GQA (4 query heads, 2 kv heads) == MHA whose heads 2g, 2g+1 share kv head g (layout check: GQA rows
    are GPT-NeoX's [queries | keys | values], MHA rows per head [q | k | v])."""
    inputs, _ = random_batch()
    gqa = build_model(tiny_config(pos_emb="rotary", num_kv_heads=2), SingleProcessState())
    mha = build_model(tiny_config(pos_emb="rotary"), SingleProcessState())
    mha.load_state_dict({k: v for k, v in gqa.state_dict().items() if "query_key_value" not in k}, strict=False)
    d = 8
    for lg, lm in zip(gqa.layers, mha.layers):
        for attr in ("weight", "bias"):
            src = getattr(lg.attention.query_key_value, attr).detach().view(8, d, -1)  # 4 q, 2 k, 2 v heads
            rows = []
            for h in range(4):
                g = h // 2
                rows += [src[h], src[4 + g], src[6 + g]]  # per head: q | k | v (HF GPTNeoX layout)
            with torch.no_grad():
                getattr(lm.attention.query_key_value, attr).copy_(
                    torch.cat(rows).view_as(getattr(lm.attention.query_key_value, attr))
                )
    torch.testing.assert_close(gqa(inputs), mha(inputs), rtol=1e-5, atol=1e-5)
    _run(num_kv_heads=1, pos_emb="rotary")  # multi-query attention trains too


def test_bias_flags_remove_biases():
    model, _, _ = _run(use_bias_in_attn_linear=False, use_bias_in_mlp=False, use_bias_in_norms=False)
    layer = model.layers[0]
    assert layer.attention.query_key_value.bias is None and layer.attention.dense.bias is None
    assert layer.mlp.linear1.bias is None and layer.mlp.linear2.bias is None
    qwen2, _, _ = _run(use_bias_in_attn_linear=False, use_bias_in_qkv=True)  # Qwen2's: q/k/v only
    attention = qwen2.layers[0].attention
    assert attention.query_key_value.bias is not None and attention.dense.bias is None
    no_qkv, _, _ = _run(use_bias_in_attn_linear=True, use_bias_in_qkv=False)
    attention = no_qkv.layers[0].attention
    assert attention.query_key_value.bias is None and attention.dense.bias is not None
    assert layer.input_layernorm.bias is None


def test_weight_tying():
    tied = build_model(tiny_config(), SingleProcessState())
    untied = build_model(tiny_config(no_weight_tying=True), SingleProcessState())
    assert tied.head is None and untied.head is not None
    n_tied = sum(p.numel() for p in tied.parameters())
    assert sum(p.numel() for p in untied.parameters()) == n_tied + 128 * 32


@pytest.mark.parametrize(
    "method,std",
    [
        ("normal", 0.02),
        ("scaled_normal", 0.02 / math.sqrt(2 * 4)),
        ("single_residual_scaled_normal", 0.01),
        ("wang_init", 2 / 4 / math.sqrt(256)),
        ("small_init", math.sqrt(2 / (5 * 256))),
        ("xavier_normal", math.sqrt(2 / 512)),
        ("xavier_uniform", math.sqrt(2 / 512)),
    ],
)
def test_init_std(method, std):
    w = torch.empty(256, 256)
    get_init_method(method, 0.02, 4, 256)(w, torch.Generator().manual_seed(0))
    assert abs(w.std().item() / std - 1) < 0.03


@pytest.mark.parametrize("method,gain", [("orthogonal", 2.0), ("scaled_orthogonal", 1.0)])
def test_orthogonal_init(method, gain):
    w = torch.empty(64, 64)
    get_init_method(method, 0.02, 4, 64)(w, torch.Generator().manual_seed(0))
    torch.testing.assert_close(w @ w.T, gain**2 * torch.eye(64), atol=1e-4, rtol=0)


def test_model_init_methods_and_seed():
    args = dict(hidden_size=64, num_layers=4, init_method="small_init", output_layer_init_method="wang_init")
    model = build_model(tiny_config(**args), SingleProcessState())
    qkv = model.layers[0].attention.query_key_value.weight
    assert abs(qkv.std().item() / math.sqrt(2 / (5 * 64)) - 1) < 0.05
    dense = model.layers[2].mlp.linear2.weight
    assert abs(dense.std().item() / (2 / 4 / math.sqrt(64)) - 1) < 0.05
    again = build_model(tiny_config(**args), SingleProcessState())
    other = build_model(tiny_config(seed=7, **args), SingleProcessState())
    assert torch.equal(again.layers[0].attention.query_key_value.weight, qkv)
    assert not torch.equal(other.layers[0].attention.query_key_value.weight, qkv)
    assert tensor_seed(1, 0, "a") != tensor_seed(1, 1, "a") != tensor_seed(1, 0, "b")
    _run(init_method="orthogonal", output_layer_init_method="scaled_orthogonal")


def _changed_positions(model, change_at: int) -> torch.Tensor:
    inputs, _ = random_batch(batch=1)
    tokens = inputs[0].clone()
    tokens[0, change_at] = (tokens[0, change_at] + 1) % 128
    a = model(inputs)
    b = model((tokens, inputs[1], inputs[2]))
    return (a - b).abs().amax(-1)[0] > 1e-6


def test_sliding_window_limits_receptive_field():
    model = build_model(tiny_config(num_layers=1, pos_emb="rotary", sliding_window_width=3), SingleProcessState())
    changed = _changed_positions(model, 0)
    assert changed[:4].all() and not changed[4:].any()


def test_local_attention_uses_block_window():
    model = build_model(
        tiny_config(
            num_layers=1,
            pos_emb="rotary",
            attention_config=["local"],
            local_attention_block=4, local_attention_window_blocks=3,
        ),
        SingleProcessState(),
    )
    changed = _changed_positions(model, 0)
    assert changed[:8].all() and not changed[8:].any()
    _run(attention_config=["local", "flash"])


@pytest.mark.parametrize("pos_emb", ["alibi", "rpe", "rotary"])
def test_explicit_attention_equals_sdpa(pos_emb):
    model = build_model(tiny_config(pos_emb=pos_emb, apply_query_key_layer_scaling=True), SingleProcessState())
    inputs, _ = random_batch()
    sdpa = model(inputs)
    for layer in model.layers:
        layer.attention.force_explicit = True
    torch.testing.assert_close(model(inputs), sdpa, rtol=1e-5, atol=1e-5)


def test_bf16_with_fp32_softmax_close_to_fp32():
    inputs, labels = random_batch()
    ref = build_model(tiny_config(), SingleProcessState())
    low = build_model(tiny_config(precision="bfloat16", attention_softmax_in_fp32=True), SingleProcessState())
    assert next(low.parameters()).dtype == torch.bfloat16
    ref_loss = ref.loss_fn(ref(inputs), labels)
    loss = low.loss_fn(low(inputs), labels)
    loss.backward()
    assert loss.dtype == torch.float32
    assert abs(loss.item() - ref_loss.item()) < 2e-2


@pytest.mark.parametrize("window", [None, 4])
def test_bf16_attention_on_cpu_computes_in_fp32(window):
    """On a CPU, bf16 queries, keys and values attend through SDPA in fp32 (PyTorch's CPU kernel is slower in bf16,
    megatron.model.attention.sdpa): the layer's result is fp32 attention's, rounded to bf16, on the causal path and
    with a mask (a sliding window)."""
    model = build_model(tiny_config(precision="bfloat16", sliding_window_width=window), SingleProcessState())
    q, k, v = (torch.randn(2, 16, 4, 8, generator=torch.Generator().manual_seed(i)).bfloat16() for i in range(3))
    position = torch.arange(16)
    allowed = (position[None, :] <= position[:, None]) & (position[None, :] >= position[:, None] - (window or 16))
    fp32 = [t.float().transpose(1, 2) for t in (q, k, v)]
    expected = torch.nn.functional.scaled_dot_product_attention(*fp32, attn_mask=allowed)
    context = model.layers[0].attention._core(q, k, v, None)
    assert torch.equal(context, expected.bfloat16().transpose(1, 2).reshape(2, 16, 32)), \
        (context.float() - expected.transpose(1, 2).reshape(2, 16, 32)).abs().max()


def test_dropout_only_in_training():
    model = build_model(tiny_config(attention_dropout=0.5, hidden_dropout=0.5), SingleProcessState())
    inputs, _ = random_batch()
    model.eval()
    torch.testing.assert_close(model(inputs), model(inputs))
    model.train()
    assert not torch.allclose(model(inputs), model(inputs))


@pytest.mark.parametrize(
    "overrides,match",
    [
        (dict(attention_config=["sparse_fixed", "global"], sparsity_config=(("block", 5),)), "block=5"),
        (dict(attention_config=["gmlp", "global"], activation="swiglu"), "gmlp"),
        (dict(num_layers=4, num_unique_layers=2, attention_config=["gmlp", "global", "global", "global"]),
         "layers that share parameters must have one type"),
        (dict(precision="fp16"), "fp16"),
        (dict(num_kv_heads=3), "num_kv_heads"),
        (dict(activation="tanh"), "tanh"),
        (dict(use_flashattn_swiglu=True), "use_flashattn_swiglu"),
    ],
)
def test_unsupported_options_are_rejected(overrides, match):
    if overrides.get("precision") == "fp16" and torch.cuda.is_available():
        overrides = dict(attention_config=["bigbird", "global"])
        match = "bigbird"
    with pytest.raises(ValueError, match=match):
        build_model(tiny_config(**overrides), SingleProcessState())


def test_soft_prompt_tuning_trains_only_the_prompt():
    model, _, _ = _run(soft_prompt_tokens=3, soft_prompt_init_range=0.5)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable == ["sequential.0.soft_prompt.weight"]
    assert model.embedding.soft_prompt.weight.grad.abs().sum() > 0
    inputs, _ = random_batch()
    hidden, _ = model.embedding(inputs)
    torch.testing.assert_close(hidden[:, :3], model.embedding.soft_prompt.weight.expand(2, 3, 32))


@pytest.mark.parametrize("text,n_tokens", [("abcdefgh", 3), ("ab", 5)])
def test_soft_prompt_init_string_starts_from_its_tokens_embeddings(text, n_tokens):
    """soft_prompt_tuning.init_string (deepy.py's path: NeoXArgs, the worker's tokenizer, ModelConfig): the soft
    prompt starts as the word embeddings of the string's tokens, cut or repeated to n_tokens (GPT-NeoX's
    SoftEmbedding); an empty tokenization is a ConfigError naming the key."""
    from megatron.initialize import soft_prompt_init_tokens
    from megatron.model.config import ModelConfig
    from megatron.tokenizer import build_tokenizer
    from tests.neox_arguments.helpers import tiny

    args = tiny(tokenizer_type="CharLevelTokenizer", soft_prompt_tuning={"enabled": True, "n_tokens": n_tokens,
                                                                          "init_string": text})
    tokenizer = build_tokenizer(args)
    changes = soft_prompt_init_tokens(args, tokenizer)
    ids = tokenizer.tokenize(text)
    assert changes == {"soft_prompt_init_tokens": tuple(ids)}
    config = ModelConfig.from_neox_args(args, padded_vocab_size=512, **changes)
    model = build_model(config, SingleProcessState())
    embedding = model.embedding
    expected = embedding.word_embeddings.weight.detach()[(ids * n_tokens)[:n_tokens]]
    torch.testing.assert_close(embedding.soft_prompt.weight.detach(), expected, rtol=0, atol=0)
    blank = tiny(tokenizer_type="CharLevelTokenizer", soft_prompt_tuning={"enabled": True, "init_string": "x"})
    with pytest.raises(ConfigError, match="soft_prompt_tuning.init_string='x' has no tokens"):
        soft_prompt_init_tokens(blank, type("Empty", (), {"tokenize": staticmethod(lambda text: [])})())


def _soft_prompt_of_tensor_parallel_model(rank: int, world_size: int, config) -> torch.Tensor:
    from megatron.mpu import ParallelState

    state = ParallelState(pipe_parallel_size=0, model_parallel_size=world_size)
    return build_model(config, state).embedding.soft_prompt.weight.detach()


@pytest.mark.slow
def test_soft_prompt_init_string_rows_are_whole_on_every_tensor_parallel_rank():
    """Tokens of both halves of a vocabulary split over 2 ranks: each rank's soft prompt is the one-rank model's."""
    from tests.distributed_helpers import run_distributed

    config = tiny_config(soft_prompt_tokens=4, soft_prompt_init_tokens=(3, 100, 64, 127))
    single = build_model(config, SingleProcessState()).embedding.soft_prompt.weight.detach()
    for weight in run_distributed(_soft_prompt_of_tensor_parallel_model, world_size=2, args=(config,)):
        torch.testing.assert_close(weight, single, rtol=0, atol=0)


def test_custom_attention_mask_is_honoured():
    model = build_model(tiny_config(pos_emb="rotary"), SingleProcessState())
    inputs, _ = random_batch()
    tokens, pos, causal = inputs
    extra = causal_attention_mask(16)  # GPT-NeoX's whole [1, 1, s, s] mask
    torch.testing.assert_close(model((tokens, pos, extra)), model((tokens, pos, causal)), rtol=1e-5, atol=1e-5)
    extra[..., 1:, 0] = True  # queries after the first may not see token 0
    plain = model((tokens, pos, causal))
    masked = model((tokens, pos, extra))
    torch.testing.assert_close(masked[:, 0], plain[:, 0])
    assert not torch.allclose(masked[:, 1:], plain[:, 1:])
    for layer in model.layers:
        layer.attention.force_explicit = True
    torch.testing.assert_close(model((tokens, pos, extra)), masked, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model((tokens, pos, None)), plain, rtol=1e-5, atol=1e-5)


def test_building_leaves_the_global_rng_alone():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    build_model(tiny_config(pos_emb="learned", soft_prompt_tokens=2), SingleProcessState())
    torch.testing.assert_close(torch.rand(3), expected)
