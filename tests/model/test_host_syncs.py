"""No per-layer host syncs (issue 29, finding 4): on a GPU each of these made the host wait for the device.

Counted on CPU with tests.host_syncs.HostSyncCounter (the calls that sync on CUDA, by file:line):
* a plainly causal batch costs no host sync in any attention layer (it was one torch.equal of an s x s mask per layer
  and forward), whatever path the attention takes, and building the batch costs none either;
* a dropless MoE layer reads its slot counts back once (it was six or seven reads per layer: the Sinkhorn early stop,
  two bincounts, the counts, the load counters);
and the sync-free pieces compute what the old ones did: the causal-only mask gives the whole causal mask's outputs
and gradients, the Sinkhorn scalings equal the early-stopping loop's bit for bit, the expert counts equal bincount's,
rotary tables for context-parallel positions equal the directly computed angles. The expert-parallel layer's count
is checked in its spawn (tests/model/test_moe_parallel_extras.py); on a GPU, ``to_device`` below."""
import collections
import time

import pytest
import torch

from megatron.model.batch import BatchOptions, get_batch
from megatron.model.gpt2_model import build_model
from megatron.model.batch import causal_attention_mask, is_causal_only, to_device
from megatron.model.moe.router import expert_counts, sinkhorn
from megatron.model.positional import RotaryEmbedding
from megatron.mpu import SingleProcessState
from tests.host_syncs import HostSyncCounter
from tests.model.helpers import random_batch, tiny_config

ATTENTION_PATHS = {
    "sdpa": ({}, False),
    "rotary_gqa": (dict(pos_emb="rotary", num_kv_heads=2), False),
    "explicit_fp32_softmax": (dict(precision="bfloat16", attention_softmax_in_fp32=True), False),
    "fused_softmax": ({}, True),
}
"""name: (config overrides, whether the layers take the fused-softmax path, here with the kernels' PyTorch
references: the upper-triangular one when the batch is plainly causal)."""


def _model(num_layers: int, overrides: dict, fused: bool):
    torch.manual_seed(0)
    model = build_model(tiny_config(num_layers=num_layers, **overrides), SingleProcessState())
    for layer in model.layers:
        layer.attention.fused_softmax = fused
    return model.train()


def _syncs_of_a_step(model, batch) -> collections.Counter:
    """{file:line: count} of the host syncs of one forward and backward of ``model`` on ``batch``."""
    inputs, labels = batch
    with HostSyncCounter() as syncs:
        model.loss_fn(model(inputs), labels).backward()
    return syncs.by_site


@pytest.mark.parametrize("path", ATTENTION_PATHS)
def test_a_causal_batch_costs_no_host_sync_in_any_attention_layer(path):
    overrides, fused = ATTENTION_PATHS[path]
    counts = {layers: _syncs_of_a_step(_model(layers, overrides, fused), random_batch()) for layers in (1, 3)}
    print(path, counts)
    assert counts[3] == counts[1] == collections.Counter(), counts


def test_building_a_batch_costs_no_host_sync():
    text = torch.tensor([[3, 4, 0, 5, -100, -100]])  # an end of document and padding: labels to mask
    for options in (BatchOptions(), BatchOptions(eod_mask_loss=True, reset_position_ids=True,
                                                 reset_attention_mask=True)):
        with HostSyncCounter() as syncs:
            get_batch(options, {"text": text}, SingleProcessState(), eod_token=0)
        assert syncs.by_site == collections.Counter(), (options, syncs.by_site)


@pytest.mark.parametrize("path", ATTENTION_PATHS)
def test_the_causal_only_mask_gives_the_whole_causal_masks_outputs_and_gradients(path):
    overrides, fused = ATTENTION_PATHS[path]
    model = _model(2, {**overrides, "hidden_dropout": 0.0, "attention_dropout": 0.0}, fused)
    (tokens, positions, mask), labels = random_batch()
    assert is_causal_only(mask) and not is_causal_only(causal_attention_mask(16))
    results = []
    for batch_mask in (mask, causal_attention_mask(16)):  # the causal path; the masked path with GPT-NeoX's mask
        model.zero_grad()
        loss = model.loss_fn(model((tokens, positions, batch_mask)), labels)
        loss.backward()
        results.append((loss.detach(), [p.grad.float().clone() for p in model.parameters()]))
    (loss, grads), (want_loss, want_grads) = results
    worst = max(float((g - w).abs().max()) for g, w in zip(grads, want_grads))
    print(path, float(loss), float(want_loss), "largest gradient difference", worst)
    tol = 1e-2 if overrides.get("precision") == "bfloat16" else 1e-5
    torch.testing.assert_close(loss, want_loss, rtol=tol, atol=tol)
    for got, want in zip(grads, want_grads):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("router", ["sinkhorn", "topk"])
def test_a_dropless_moe_layer_reads_its_counts_back_once(router):
    overrides = dict(moe_num_experts=4, moe_top_k=1 if router == "sinkhorn" else 2, moe_router_type=router,
                     expert_interval=1, moe_loss_coeff=0.1, moe_jitter_eps=0.01)
    counts = {layers: _syncs_of_a_step(_model(layers, overrides, False), random_batch()) for layers in (1, 3)}
    print(router, counts)
    for layers, sites in counts.items():
        assert sum(sites.values()) == layers and len(sites) == 1, counts  # one site: the counts' tolist
        assert next(iter(sites)).startswith("megatron/model/moe/layer.py:"), counts


def _sinkhorn_with_early_stop(cost: torch.Tensor, iterations: int, tol: float):
    """GPT-NeoX's loop, which asks the host whether to stop: (result, iterations run)."""
    cost = torch.exp(cost)
    d0 = torch.ones(cost.size(0), dtype=cost.dtype)
    d1 = 1 / (cost.size(1) * torch.sum(cost, 0))
    ran = 0
    for _ in range(iterations):
        d0_new = (1 / d0.size(0)) / (torch.sum(d1 * cost, 1) + 1e-8)
        d1_new = (1 / d1.size(0)) / (torch.sum(d0_new.unsqueeze(1) * cost, 0) + 1e-8)
        error = torch.mean(torch.abs(d1_new - d1))
        d0, d1 = d0_new, d1_new
        ran += 1
        if error < tol:
            break
    return d1 * cost * d0.unsqueeze(1), ran


def test_sinkhorn_without_host_syncs_equals_the_early_stopping_loop_bit_for_bit():
    cost = 3 * torch.randn(64, 8, generator=torch.Generator().manual_seed(0))  # changes 1.2e-5, 6.5e-6, 3.9e-6, ..
    stops = set()
    for tol in (1.0, 1e-5, 5e-6, 0.0):  # stops after 1, 2, 3 iterations, never
        want, ran = _sinkhorn_with_early_stop(cost, 4, tol)
        stops.add(ran)
        with HostSyncCounter() as syncs:
            got = sinkhorn(cost, iterations=4, tol=tol)
        assert torch.equal(got, want), (tol, ran)
        assert syncs.total == 0
    assert stops == {1, 2, 3, 4}, stops  # the cases stop at different iterations


def test_expert_counts_equal_bincount():
    experts = torch.randint(0, 6, (50, 2), generator=torch.Generator().manual_seed(0))
    experts[experts == 5] = 4  # an expert with no slots
    with HostSyncCounter() as syncs:
        got = expert_counts(experts, 6)
    assert torch.equal(got, torch.bincount(experts.reshape(-1), minlength=6)) and got[5] == 0
    assert syncs.total == 0


def test_rotary_tables_at_context_parallel_positions_need_only_their_host_bound():
    rope = RotaryEmbedding(8, 10000.0, max_positions=32)
    positions = torch.tensor([0, 1, 2, 3, 28, 29, 30, 31])  # rank 0 of 4 chunks over 2 ranks
    with HostSyncCounter() as syncs:
        cos, sin = rope.tables_at(positions, 32)  # from the table
        far_cos, far_sin = rope.tables_at(positions + 32, 64)  # past the table: computed
    assert syncs.total == 0
    for got, want in (((cos, sin), rope(positions)), ((far_cos, far_sin), rope(positions + 32))):
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-6)


def test_to_device_leaves_a_host_tensor_on_the_host_as_it_is():
    tensor = torch.arange(6)
    assert to_device(tensor, torch.device("cpu")) is tensor


@pytest.mark.gpu
def test_to_device_does_not_wait_for_the_device():
    """A pageable host tensor's copy waits for the work queued before it; ``to_device`` pins it first, so the host
    goes on while the device is still busy (a ~0.2 s sleep kernel is queued before each copy)."""
    device = torch.device("cuda")
    host = torch.randn(16, 1024, 1024)  # 64 MiB, pageable

    def host_seconds(copy) -> float:
        torch.cuda.synchronize()
        torch.cuda._sleep(int(2e8))  # cycles: ~0.1-0.2 s on current GPUs
        start = time.perf_counter()
        out = copy()
        seconds = time.perf_counter() - start
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), host)
        return seconds

    blocking = host_seconds(lambda: host.to(device, non_blocking=True))
    pinned = host_seconds(lambda: to_device(host, device))
    print(f"host time of the copy: pageable non_blocking {blocking * 1e3:.1f} ms, to_device {pinned * 1e3:.1f} ms")
    assert pinned < blocking / 2, (pinned, blocking)


@pytest.mark.gpu
@pytest.mark.parametrize("moe", [None, "sinkhorn", "topk"])
def test_a_bf16_step_on_the_gpu_syncs_at_most_once_per_moe_layer(moe):
    """torch.cuda.set_sync_debug_mode's own count, by file:line, of one forward and backward of a 12-layer bf16 model
    on the GPU (after a warm-up step): no sync in any model file but one per dropless MoE layer (its counts)."""
    import os
    import warnings

    layers = 12
    overrides = dict(num_layers=layers, precision="bfloat16", pos_emb="rotary", seq_length=256, hidden_dropout=0.0)
    if moe is not None:
        overrides.update(moe_num_experts=4, moe_top_k=1 if moe == "sinkhorn" else 2, moe_router_type=moe,
                         expert_interval=1, moe_loss_coeff=0.1)
    torch.manual_seed(0)
    model = build_model(tiny_config(**overrides), SingleProcessState()).cuda().train()
    device = torch.device("cuda")
    (tokens, positions, mask), (labels, loss_mask) = random_batch(batch=4, seq=256)
    inputs = tuple(to_device(t, device) for t in (tokens, positions, mask))
    targets = tuple(to_device(t, device) for t in (labels, loss_mask))
    model.loss_fn(model(inputs), targets).backward()  # warm-up: tables moved to the device once
    torch.cuda.synchronize()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            model.loss_fn(model(inputs), targets).backward()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    sites = collections.Counter(f"{os.path.relpath(w.filename, root)}:{w.lineno}" for w in caught
                                if "synchroniz" in str(w.message))
    print(moe, dict(sites))
    in_model = {site: n for site, n in sites.items() if site.startswith("megatron/model/")}
    if moe is None:
        assert in_model == {}, sites
    else:
        assert len(in_model) == 1 and sum(in_model.values()) == layers, sites
        assert next(iter(in_model)).startswith("megatron/model/moe/layer.py:"), sites


@pytest.mark.parametrize("path", ["sdpa", "explicit_fp32_softmax"])
def test_training_forward_at_dropout_0_is_one_graph(path):
    """Issue 34: at dropout 0 the attention no longer saves and restores the RNG state around its core (a host
    call torch.compile cannot capture: one graph break per layer), and the mask kind is read from its shape: the
    whole training forward is one graph, and computes what the eager forward computes."""
    import torch._dynamo

    overrides, _ = ATTENTION_PATHS[path]
    model = _model(2, {**overrides, "hidden_dropout": 0.0, "attention_dropout": 0.0}, False).train()
    inputs, _ = random_batch()
    explained = torch._dynamo.explain(model)(inputs)
    assert explained.graph_break_count == 0, [str(reason.reason)[:200] for reason in explained.break_reasons]
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(inputs), model(inputs), rtol=0, atol=0)
