"""The dropless mixture of experts (megatron.model.moe): the layer equals a plain per-token loop over experts
(outputs and gradients), the load-balancing loss equals its hand computation and reaches the gradients with
moe_loss_coeff, expert_interval picks the MoE layers, parameters carry GPT-NeoX's names, and the expert load is
counted."""
import math

import pytest
import torch
import torch.nn.functional as F

from megatron.model.gpt2_model import build_model
from megatron.model.init_functions import Initializer
from megatron.model.moe import DroplessMoE, moe_layers, moe_metrics, set_aux_loss_scale
from megatron.model.moe import layer as moe_layer_module
from megatron.model.moe.layer import combine
from megatron.model.moe.router import load_balancing_loss, sinkhorn
from megatron.model.config import ModelConfig
from megatron.mpu import SingleProcessState
from tests.distributed_helpers import run_distributed
from tests.model.helpers import random_batch, tiny_config

ACTS = {"gelu": F.gelu, "silu": F.silu, "relu": F.relu}


def moe_config(**overrides) -> ModelConfig:
    base = dict(moe_num_experts=4, moe_top_k=2, moe_router_type="topk", expert_interval=1, intermediate_size=24)
    return tiny_config(**{**base, **overrides})


def _layer(config: ModelConfig) -> DroplessMoE:
    torch.manual_seed(0)
    layer = DroplessMoE(config, SingleProcessState(), Initializer(config), 0)
    with torch.no_grad():  # a sharper router than the init's, so that the top-k choices are well separated
        layer.router.layer.weight.mul_(20.0)
    return layer


def loop_reference(layer: DroplessMoE, x: torch.Tensor, act, gated: bool, top_k: int) -> torch.Tensor:
    """Token by token: softmax router, top-k, weights (renormalised for k >= 2), each chosen expert's MLP."""
    mlp, width = layer.experts.mlp, layer.experts.mlp.width
    out = []
    for token in x.reshape(-1, x.shape[-1]):
        probs = torch.softmax(token @ layer.router.layer.weight.t(), dim=-1)
        chosen = sorted(range(probs.numel()), key=lambda e: -float(probs[e].detach()))[:top_k]
        total = sum(probs[e] for e in chosen) if top_k > 1 else 1.0
        y = torch.zeros_like(token)
        for e in chosen:
            rows = slice(e * width, (e + 1) * width)
            h = act(mlp.w1[rows] @ token)
            if gated:
                h = h * (mlp.w3[rows] @ token)
            y = y + probs[e] / total * (h @ mlp.w2[rows])
        out.append(y)
    return torch.stack(out).view_as(x)


@pytest.mark.parametrize("top_k,activation,moe_glu", [(1, "gelu", False), (2, "gelu", False), (2, "silu", True),
                                                      (3, "relu", False), (2, "swiglu", False)])
def test_dropless_equals_per_token_loop(top_k, activation, moe_glu):
    config = moe_config(moe_top_k=top_k, activation=activation, moe_glu=moe_glu, moe_loss_coeff=0.0)
    gated = moe_glu or activation == "swiglu"
    act = ACTS.get(activation, F.silu)
    assert config.expert_activation == ("swiglu" if gated else activation)
    layer = _layer(config).train()
    assert hasattr(layer.experts.mlp, "w3") == gated
    x = torch.randn(3, 5, config.hidden_size, generator=torch.Generator().manual_seed(1), requires_grad=True)
    got = layer(x)
    params = [x] + list(layer.parameters())
    grad_out = torch.randn_like(got)
    got_grads = torch.autograd.grad((got * grad_out).sum(), params)
    want = loop_reference(layer, x, act, gated, top_k)
    want_grads = torch.autograd.grad((want * grad_out).sum(), params)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for name, g, w in zip(["x"] + [n for n, _ in layer.named_parameters()], got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=name)
    # every expert got tokens (so the test covers the grouping), and the router gets a gradient
    assert (layer.load.routed > 0).all() and got_grads[1 + [n for n, _ in layer.named_parameters()].index(
        "router.layer.weight")].abs().sum() > 0


def sliced_experts_forward(mlp, x: torch.Tensor, counts) -> torch.Tensor:
    """The experts as the layer computed them before issue 34: each expert's rows of the stacked weights sliced
    (``w1[rows]``) inside the graph, its tokens sliced from x."""
    outputs, start = [], 0
    for e, n in enumerate(counts):
        if n:
            rows, block = slice(e * mlp.width, (e + 1) * mlp.width), x[start:start + n]
            h = mlp.act(F.linear(block, mlp.w1[rows]))
            if mlp.gated:
                h = h * F.linear(block, mlp.w3[rows])
            outputs.append(h @ mlp.w2[rows])
        start += n
    return torch.cat(outputs)


def uses_in_graph(out: torch.Tensor, params) -> list:
    """How many autograd edges of the graph behind ``out`` lead to each parameter (a weight sliced per expert is
    reached once per slice)."""
    counts, seen, todo = {id(p): 0 for p in params}, set(), [out.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for child, _ in node.next_functions:
            variable = getattr(child, "variable", None)
            if variable is not None and id(variable) in counts:
                counts[id(variable)] += 1
            todo.append(child)
    return [counts[id(p)] for p in params]


def unused_expert_case(config: ModelConfig, seed: int):
    """A layer of 5 experts whose expert 4 is never chosen (its gradients must be zeros), its input, and ``run()``:
    the output and the gradients of (x, every parameter) for a fixed random output gradient."""
    layer = _layer(config).train()
    with torch.no_grad():
        layer.router.layer.weight[4] = 0.0  # x[..., 0] = 1: expert 4 is never chosen
        layer.router.layer.weight[4, 0] = -1e3
    x = torch.randn(2, 6, config.hidden_size, generator=torch.Generator().manual_seed(seed))
    x = x.index_fill(-1, torch.tensor([0]), 1.0).requires_grad_()
    names, params = zip(*[("x", x)] + list(layer.named_parameters()))
    grad_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed + 1))

    def run():
        out = layer(x)
        return out, torch.autograd.grad((out * grad_out).sum(), params, allow_unused=True)
    return layer, x, names, run


def assert_bit_identical(layer, names, got_run, want_run) -> None:
    """Both runs give the same output and gradients, bit for bit, and only expert 4 got no token."""
    (got, got_grads), (want, want_grads) = got_run, want_run
    assert layer.load.routed[4] == 0 and (layer.load.routed[:4] > 0).all()
    assert torch.equal(got, want), f"outputs differ by {(got - want).abs().max().item():.3g}"
    for name, g, w in zip(names, got_grads, want_grads):
        assert torch.equal(g, w), f"{name}: gradients differ by {(g - w).abs().max().item():.3g}"


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_split_experts_are_bit_identical_to_sliced_experts(activation, monkeypatch):
    """The experts split once per forward (unbind of the stacked weights, split of the rows) give the outputs and
    every gradient of the per-expert slicing they replace, bit for bit; one expert gets no token."""
    layer, x, names, run = unused_expert_case(moe_config(activation=activation, moe_num_experts=5, moe_top_k=2), 3)
    got = run()
    edges = uses_in_graph(layer(x), [layer.experts.mlp.w1, layer.experts.mlp.w2])
    assert edges == [1, 1], f"the stacked weights are used {edges} times in the graph: sliced per expert"
    monkeypatch.setattr(type(layer.experts.mlp), "forward", sliced_experts_forward)
    assert_bit_identical(layer, names, got, run())


def indexed_dispatch(tokens: torch.Tensor, token_of_slot: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The dispatch as the layer computed it before megatron.model.moe.dispatch: advanced indexing."""
    return tokens[token_of_slot]


def indexed_combine(routing, order, token_of_slot, positions, out_sorted) -> torch.Tensor:
    """The combine as the layer computed it before megatron.model.moe.dispatch: index_add_ into zeros."""
    return combine(out_sorted.new_zeros(positions.shape[0], out_sorted.shape[-1]), routing, order, token_of_slot,
                   out_sorted)


@pytest.mark.parametrize("top_k", [2, 3])
def test_permutation_dispatch_is_bit_identical_to_indexing(top_k, monkeypatch):
    """Routing rows by permutation gathers (megatron.model.moe.dispatch) gives the outputs and every gradient of
    indexing and index_add_ into zeros, bit for bit (a token's slots added in the same order); one expert gets no
    token."""
    layer, _, names, run = unused_expert_case(moe_config(activation="swiglu", moe_num_experts=5, moe_top_k=top_k), 5)
    got = run()
    monkeypatch.setattr(moe_layer_module, "dispatch", indexed_dispatch)
    monkeypatch.setattr(moe_layer_module, "combine_all", indexed_combine)
    assert_bit_identical(layer, names, got, run())


def test_load_balancing_loss_by_hand():
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.6, 0.3], [0.5, 0.25, 0.25], [0.2, 0.2, 0.6]])
    experts = torch.tensor([[0, 1], [1, 2], [0, 1], [2, 0]])
    # f = slots per expert / 8 = [3, 3, 2] / 8; P = mean probs = [1.5, 1.25, 1.25] / 4; loss = 3 * sum(f * P)
    want = 3 * (3 / 8 * 1.5 / 4 + 3 / 8 * 1.25 / 4 + 2 / 8 * 1.25 / 4)
    got = load_balancing_loss(probs, experts, 3, torch.float32)
    assert math.isclose(float(got), want, rel_tol=1e-6)
    uniform = torch.full((4, 3), 1 / 3)
    assert math.isclose(float(load_balancing_loss(uniform, torch.tensor([[0], [1], [2], [0]]), 3, torch.float32)),
                        1.0, rel_tol=1e-6)


def test_layer_aux_loss_is_the_routers_and_fp32_switch():
    layer = _layer(moe_config())
    x = torch.randn(2, 4, 32)
    routing, aux = layer.router(x.reshape(-1, 32))
    probs = torch.softmax(x.reshape(-1, 32) @ layer.router.layer.weight.t(), -1)
    assert torch.equal(routing.experts, probs.topk(2, -1).indices)
    want = load_balancing_loss(probs.detach(), routing.experts, 4, torch.float32)
    assert math.isclose(float(aux.detach()), float(want),
                        rel_tol=1e-5)
    half = _layer(moe_config(moe_lbl_in_fp32=False)).to(torch.bfloat16)
    fp32 = _layer(moe_config(moe_lbl_in_fp32=True)).to(torch.bfloat16)
    assert half.router(x.reshape(-1, 32).bfloat16())[1].dtype == torch.bfloat16
    assert fp32.router(x.reshape(-1, 32).bfloat16())[1].dtype == torch.float32


def _captured_aux(model):
    captured = []
    for layer in moe_layers(model):
        layer.router.register_forward_hook(lambda _m, _i, out: captured.append(out[1]))
    return captured


def _aux_grad_check(rank=0, world_size=1, checkpoint=False):
    """The model's gradients are those of lm_loss + moe_loss_coeff x sum(layer losses) x scale, computed here
    with the layer losses carried out explicitly from a model that does not attach them (coeff 0)."""
    from megatron.mpu import ParallelState

    state = ParallelState(pipe_parallel_size=0, model_parallel_size=1) if checkpoint else SingleProcessState()
    coeff, scale = 0.5, 0.25
    config = moe_config(num_layers=3, moe_loss_coeff=coeff, checkpoint_activations=checkpoint)
    model = build_model(config, state).train()
    set_aux_loss_scale(model, scale)
    plain = build_model(moe_config(num_layers=3, moe_loss_coeff=0.0), state).train()
    plain.load_state_dict(model.state_dict())
    inputs, labels = random_batch()
    (model.loss_fn(model(inputs), labels) * scale).backward()
    captured = _captured_aux(plain)
    lm = plain.loss_fn(plain(inputs), labels)
    assert len(captured) == 3  # expert_interval 1: every layer is MoE
    ((lm + coeff * sum(captured)) * scale).backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)
    router = [p for n, p in model.named_parameters() if n.endswith("router.layer.weight")][0]
    without = build_model(moe_config(num_layers=3, moe_loss_coeff=0.0), state).train()
    without.load_state_dict(model.state_dict())
    without.loss_fn(without(inputs), labels).mul(scale).backward()
    wrouter = [p for n, p in without.named_parameters() if n.endswith("router.layer.weight")][0]
    assert not torch.allclose(router.grad, wrouter.grad)  # the aux loss changed the router's gradient
    # the recomputation inside the backward (activation checkpointing) is not counted twice
    assert all(layer.load.forwards == 1 for layer in moe_layers(model))
    if checkpoint:
        state.destroy()


def test_aux_loss_gradient_is_coeff_times_layer_losses():
    _aux_grad_check()


def test_aux_loss_gradient_under_activation_checkpointing():
    run_distributed(_aux_grad_check, world_size=1, args=(True,))


@pytest.mark.parametrize("interval,layers", [(1, (0, 1, 2, 3)), (2, (0, 2)), (3, (0, 3))])
def test_expert_interval_selects_layers_and_gpt_neox_names(interval, layers):
    config = moe_config(num_layers=4, expert_interval=interval, activation="swiglu")
    assert config.moe_layers == layers
    model = build_model(config, SingleProcessState())
    names = dict(model.named_parameters())
    for i in range(4):
        prefix = f"sequential.{i + 2}.mlp."
        if i in layers:
            assert names[prefix + "router.layer.weight"].shape == (4, 32)
            for w in ("w1", "w2", "w3"):
                assert names[prefix + f"experts.mlp.{w}"].shape == (4 * 24, 32)
            assert prefix + "linear1.weight" not in names
        else:
            assert prefix + "linear1.weight" in names and prefix + "router.layer.weight" not in names
    assert tiny_config().moe_layers == ()


def test_expert_width_follows_gpt_neox():
    assert moe_config(intermediate_size=None).expert_ffn_width == 256  # 4 x 32 = 128 -> multiple of 256
    assert moe_config(intermediate_size=None, hidden_size=128, num_attention_heads=4).expert_ffn_width == 512
    assert moe_config(intermediate_size=None, hidden_size=192, num_attention_heads=4,
                      activation="swiglu").expert_ffn_width == 512  # int(8/3 x 192) = 512
    assert moe_config(intermediate_size=40).expert_ffn_width == 40


def test_sinkhorn_router_balances_in_training_and_is_topk_in_eval():
    config = moe_config(moe_router_type="sinkhorn", moe_top_k=1)
    layer = _layer(config)
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        layer.router.layer.weight[0] += 0.5 * x.mean(0)  # a router that favours expert 0
    layer.eval()
    eval_routing, _ = layer.router(x)
    logits = x @ layer.router.layer.weight.t()
    assert torch.equal(eval_routing.experts[:, 0], logits.argmax(-1))
    torch.testing.assert_close(eval_routing.weights[:, 0], torch.sigmoid(logits.max(-1).values))
    layer.train()
    train_routing, _ = layer.router(x)
    assert torch.equal(train_routing.experts[:, 0], sinkhorn(logits).argmax(-1))
    eval_counts = torch.bincount(eval_routing.experts[:, 0], minlength=4)
    train_counts = torch.bincount(train_routing.experts[:, 0], minlength=4)
    assert train_counts.max() < eval_counts.max()  # Sinkhorn spreads the tokens


def test_jitter_only_in_training():
    layer = _layer(moe_config(moe_jitter_eps=0.1))
    x = torch.randn(16, 32)
    layer.eval()
    a, b = layer.router(x)[0].probs, layer.router(x)[0].probs
    assert torch.equal(a, b)
    layer.train()
    c = layer.router(x)[0].probs
    assert not torch.equal(a, c)
    assert (c - a).abs().max() < 0.5


def test_expert_load_metrics():
    config = moe_config(num_layers=2, moe_top_k=2)
    model = build_model(config, SingleProcessState()).train()
    inputs, labels = random_batch(batch=2, seq=16)
    for _ in range(3):
        model.loss_fn(model(inputs), labels).backward()
    routed = [layer.load.routed.clone() for layer in moe_layers(model)]
    metrics = moe_metrics(model, config.num_layers, 4, config.moe_loss_coeff, iterations=3)
    for i, counts in enumerate(routed):
        assert float(counts.sum()) == 3 * 2 * 16 * 2  # 3 forwards x 32 tokens x top-2
        for e in range(4):
            assert metrics[f"moe_tokens/layer_{i:02d}/expert_{e:02d}"] == float(counts[e]) / 3
        assert metrics[f"moe_dropped/layer_{i:02d}"] == 0.0
    assert metrics["moe_aux_loss"] > 0
    model.eval()
    with torch.no_grad():
        model(inputs)  # evaluation forwards are not counted
    assert moe_metrics(model, config.num_layers, 4, 0.1, iterations=1) == {}


def test_moe_model_trains_on_cpu():
    config = moe_config(num_layers=2, moe_top_k=2, moe_router_type="sinkhorn", moe_jitter_eps=0.01)
    model = build_model(config, SingleProcessState()).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    inputs, labels = random_batch(batch=4, seq=16)
    losses = []
    for _ in range(15):
        opt.zero_grad()
        loss = model.loss_fn(model(inputs), labels)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5


@pytest.mark.parametrize("own_group", [True, False])
def test_create_moe_param_group_puts_the_experts_in_their_own_group(own_group):
    from megatron.optim.param_groups import MOE_GROUP_NAME, get_param_groups

    model = build_model(moe_config(num_layers=2, expert_interval=2), SingleProcessState())
    groups = get_param_groups(model, 0.1, moe_param_group=own_group)
    experts = {id(p) for n, p in model.named_parameters() if ".experts.mlp." in n}
    assert len(experts) == 2  # layer 0's w1 and w2; layer 1 is dense
    named = [g for g in groups if g.get("name") == MOE_GROUP_NAME]
    if own_group:
        assert len(named) == 1 and {id(p) for p in named[0]["params"]} == experts and named[0]["weight_decay"] == 0.1
        assert all(not ({id(p) for p in g["params"]} & experts) for g in groups if g is not named[0])
    else:
        assert not named and experts <= {id(p) for p in groups[0]["params"]}  # decayed with the other weights
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))


def _pipeline_vs_sequential(rank, world_size, overrides):
    import deepspeed

    from megatron.mpu import ParallelState

    steps, micro, gas = 3, 2, 2
    batches = [random_batch(batch=micro, seed=200 + i) for i in range(steps * gas)]
    config = moe_config(num_layers=4, expert_interval=2, moe_loss_coeff=0.5, **overrides)
    ref = build_model(moe_config(num_layers=4, expert_interval=2, moe_loss_coeff=0.5, **overrides),
                      SingleProcessState()).train()
    set_aux_loss_scale(ref, 1.0 / gas)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_losses = []
    for step in range(steps):
        opt.zero_grad()
        total = 0.0
        for inputs, labels in batches[step * gas:(step + 1) * gas]:
            loss = ref.loss_fn(ref(inputs), labels)
            (loss / gas).backward()
            total += loss.item() / gas
        opt.step()
        ref_losses.append(total)
    state = ParallelState(pipe_parallel_size=world_size, model_parallel_size=1)
    model = build_model(config.replace(pipe_parallel_size=world_size), state)
    set_aux_loss_scale(model, 1.0 / gas)
    ds_config = {"train_batch_size": micro * gas, "train_micro_batch_size_per_gpu": micro,
                 "gradient_accumulation_steps": gas, "steps_per_print": 10 ** 6, "gradient_clipping": 0.0}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                           config=ds_config)
    data = iter(batches)
    losses = [engine.train_batch(data).item() for _ in range(steps)]
    metrics = moe_metrics(model, 4, 4, 0.5, iterations=steps)
    state.destroy()
    return losses, ref_losses, metrics


@pytest.mark.slow
def test_pipeline_model_with_experts_matches_the_sequential_model():
    """Two pipeline stages (a MoE layer on each) train as the sequential model does, the auxiliary loss's gradient
    included (moe_loss_coeff 0.5 changes the updates); the expert load is gathered from both stages."""
    results = run_distributed(_pipeline_vs_sequential, world_size=2, args=({},))
    losses, ref, metrics = results[-1]
    assert ref[0] != ref[-1]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=1e-5)
    assert {k for k in metrics if k.startswith("moe_dropped")} == {"moe_dropped/layer_00", "moe_dropped/layer_02"}
    assert metrics == results[0][2]


TP_CONFIGS = [
    dict(moe_top_k=2, activation="swiglu", moe_loss_coeff=0.5, moe_router_type="topk"),
    dict(moe_top_k=1, moe_router_type="sinkhorn", moe_jitter_eps=0.1, gpt_j_residual=True, bias_dropout_fusion=False),
]


def _tp_vs_single(rank, world_size):
    from megatron.mpu import ParallelState
    from tests.model.kv_helpers import incremental_logits
    from tests.model.tp_helpers import expected_local, gather_vocab

    inputs, labels = random_batch()
    for overrides in TP_CONFIGS:
        config = moe_config(num_layers=2, model_parallel_size=2, **overrides)
        ref = build_model(config, SingleProcessState()).train()
        torch.manual_seed(5)  # the jitter draws from the default RNG, the same on every rank
        ref_logits = ref(inputs)
        ref_loss = ref.loss_fn(ref_logits, labels)
        ref_loss.backward()
        state = ParallelState(pipe_parallel_size=0, model_parallel_size=2)
        model = build_model(config, state).train()
        layer = moe_layers(model)[0]
        assert layer.experts.mlp.w1.shape[0] == 2 * config.expert_ffn_width  # 2 of the 4 experts
        from megatron.checkpoint.tensor_parallel import split_rule

        for name, param in model.named_parameters():  # checkpoint conversion merges the shards the model splits
            assert (split_rule(name, config) == (0, 1)) == (".experts.mlp." in name) or ".experts." not in name
            assert getattr(param, "model_parallel", False) == (".experts.mlp." in name) or ".experts." not in name
        for name, (want, got) in expected_local(ref, model, rank, 2, grads=False).items():
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"{overrides} init {name}")
        torch.manual_seed(5)
        logits = model(inputs)
        loss = model.loss_fn(logits, labels)
        loss.backward()
        torch.testing.assert_close(gather_vocab(logits, state.get_model_parallel_group()), ref_logits, rtol=1e-5,
                                   atol=1e-5, msg=str(overrides))
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        for name, (want, got) in expected_local(ref, model, rank, 2, grads=True).items():
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, msg=f"{overrides} grad {name}")
        assert torch.equal(layer.load.routed, moe_layers(ref)[0].load.routed)
        model.eval()
        ref.eval()
        with torch.no_grad():
            step = incremental_logits(model, inputs[0], prompt=5)
            torch.testing.assert_close(gather_vocab(step, state.get_model_parallel_group()), ref(inputs), rtol=1e-5,
                                       atol=1e-5, msg=f"{overrides} kv cache")
        state.destroy()


@pytest.mark.slow
def test_experts_split_over_two_tensor_parallel_ranks_match_one_rank():
    """TP=2 holds half of the experts on each rank and gives the TP=1 logits, loss (aux loss included) and
    gradients, and the same KV-cache decoding."""
    run_distributed(_tp_vs_single, world_size=2)


# ---- moe_type deepspeed: DeepSpeed's token-dropping layer ------------------------------------------------------

def ds_config(**overrides) -> ModelConfig:
    base = dict(moe_type="deepspeed", moe_use_residual=False, use_bias_in_mlp=False, moe_loss_coeff=0.0,
                moe_token_dropping=True)
    return moe_config(**{**base, **overrides})


def _ds_and_dropless(config: ModelConfig):
    """DeepSpeed's layer and the dropless layer with the same router and experts."""
    from megatron.model.moe.deepspeed_layer import DeepSpeedMoE

    ds = DeepSpeedMoE(config, SingleProcessState(), Initializer(config), 0).train()
    dropless = _layer(config.replace(moe_type="megablocks", moe_token_dropping=False,
                                     moe_train_capacity_factor=1.0, moe_eval_capacity_factor=1.0)).train()
    mlp, width = dropless.experts.mlp, dropless.experts.mlp.width
    with torch.no_grad():
        ds.deepspeed_moe.gate.wg.weight.copy_(dropless.router.layer.weight)
        for e, expert in enumerate(ds.deepspeed_moe.experts.deepspeed_experts):
            assert expert.linear1.weight.shape == (width, config.hidden_size)  # the same expert width
            expert.linear1.weight.copy_(mlp.w1[e * width:(e + 1) * width])
            expert.linear2.weight.copy_(mlp.w2[e * width:(e + 1) * width].t())
    return ds, dropless


@pytest.mark.parametrize("top_k,dropping", [(1, True), (2, True), (2, False)])
def test_deepspeed_layer_with_room_for_every_token_equals_dropless(top_k, dropping):
    config = ds_config(moe_top_k=top_k, moe_token_dropping=dropping,
                       **({"moe_train_capacity_factor": 4.0} if dropping else {}))
    ds, dropless = _ds_and_dropless(config)
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(4), requires_grad=True)
    got, want = ds(x), dropless(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert ds.load.kept == float(ds.load.routed.sum()) == 16 * top_k  # nothing dropped
    g = torch.randn_like(got)
    gx_ds, g_gate = torch.autograd.grad((got * g).sum(), [x, ds.deepspeed_moe.gate.wg.weight])
    gx_dl, g_router = torch.autograd.grad((want * g).sum(), [x, dropless.router.layer.weight])
    torch.testing.assert_close(gx_ds, gx_dl, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g_gate, g_router, rtol=1e-4, atol=1e-6)


def test_deepspeed_top2_drops_over_capacity_first_choices_first():
    """capacity = max(ceil(2 x 16 / 4 x 0.25), min_capacity 2) = 2 slots per expert: per expert, first choices in
    token order, then second choices, up to 2; a token's kept weights renormalised over its kept choices."""
    config = ds_config(moe_top_k=2, moe_train_capacity_factor=0.25, moe_min_capacity=2)
    ds, dropless = _ds_and_dropless(config)
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        got = ds(x)
        probs = torch.softmax(x @ dropless.router.layer.weight.t(), -1)
        top = probs.topk(2, -1)
        used = [0] * 4
        kept = torch.zeros(16, 2, dtype=torch.bool)
        for choice in range(2):
            for t in range(16):
                e = int(top.indices[t, choice])
                if used[e] < 2:
                    used[e] += 1
                    kept[t, choice] = True
        want = torch.zeros_like(x)
        for t in range(16):
            weights = top.values[t] * kept[t]
            total = weights.sum()
            for choice in range(2):
                if kept[t, choice]:
                    e = int(top.indices[t, choice])
                    want[t] += weights[choice] / total * dropless.experts.mlp.expert(e, x[t:t + 1])[0]
    assert 0 < int(kept.sum()) < 32 and ds.load.kept == float(kept.sum())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_deepspeed_gate_loss_and_residual():
    config = ds_config(moe_top_k=2, moe_use_residual=True, moe_loss_coeff=0.1, moe_token_dropping=False)
    from megatron.model.moe.deepspeed_layer import DeepSpeedMoE

    ds = DeepSpeedMoE(config, SingleProcessState(), Initializer(config), 0).train()
    x = torch.randn(12, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = ds(x)
        probs = torch.softmax(x @ ds.deepspeed_moe.gate.wg.weight.t(), -1)
        first = torch.nn.functional.one_hot(probs.argmax(-1), 4).float()
        # DeepSpeed's top-2 gate loss: E^2 x mean_e(mean prob_e x fraction of first choices_e)
        assert math.isclose(ds.load.aux_sum, float(16 * (probs.mean(0) * first.mean(0)).mean()), rel_tol=1e-5)
        moe_only = ds.deepspeed_moe(x, None)
        coef = torch.softmax(ds.coefficient(x), -1)
        torch.testing.assert_close(out, moe_only * coef[:, :1] + ds.mlp(x) * coef[:, 1:])
    # every expert and the residual MLP start from their own weights (DeepSpeed copies one expert)
    experts = ds.deepspeed_moe.experts.deepspeed_experts
    assert not torch.equal(experts[0].linear1.weight, experts[1].linear1.weight)
    assert not torch.equal(experts[0].linear1.weight, ds.mlp.linear1.weight)


def test_deepspeed_param_groups_mark_the_experts_for_deepspeed():
    from megatron.optim.param_groups import deepspeed_moe_param_groups

    model = build_model(ds_config(num_layers=2, expert_interval=2, use_bias_in_mlp=True), SingleProcessState())
    groups = deepspeed_moe_param_groups(model, 0.1)
    experts = {id(p) for n, p in model.named_parameters() if ".deepspeed_experts." in n}
    moe = [g for g in groups if g.get("moe")]
    assert {id(p) for g in moe for p in g["params"]} == experts
    assert sorted(g["weight_decay"] for g in moe) == [0.0, 0.1]  # biases stay undecayed
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))


@pytest.mark.parametrize("top_k", [1, 2])
def test_deepspeed_layer_decodes_with_the_kv_cache(top_k):
    """One token per step (fewer than moe_min_capacity): KV-cache decoding gives the full forward's logits."""
    from tests.model.kv_helpers import incremental_logits

    config = ds_config(num_layers=2, moe_top_k=top_k, moe_eval_capacity_factor=4.0, moe_use_residual=True)
    model = build_model(config, SingleProcessState()).eval()
    inputs, _ = random_batch(batch=1)
    with torch.no_grad():
        torch.testing.assert_close(incremental_logits(model, inputs[0], prompt=3), model(inputs), rtol=1e-5,
                                   atol=1e-5)
