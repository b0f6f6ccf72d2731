"""Context parallelism (megatron.mpu.context_parallel, megatron.model.ring_attention): on 4 gloo ranks, ring
attention at CP=2 gives full causal attention's output and gradients; the tiny model at CP=2 x TP=2 gives the
CP=1 loss and gradients; the DeepSpeed engine with the ParallelState as mpu trains CP=2 x TP=2 (ZeRO 1) and
CP=2 x DP=2 (no ZeRO) with the CP=1 losses over 10 steps. One spawned world runs every check (4 ranks on a
2-core machine: starting them is the cost)."""
import pytest
import torch
import torch.nn.functional as F

from megatron.model import BatchOptions, build_model, get_batch
from megatron.model.ring_attention import ring_attention
from megatron.mpu import ParallelState, SingleProcessState
from megatron.mpu.context_parallel import chunk_positions, split_sequence
from megatron.model_config import context_parallel_problems
from tests.distributed_helpers import run_distributed
from tests.model.helpers import tiny_config
from tests.model.tp_helpers import expected_local

SEQ = 32
STEPS = 10
MODEL = dict(seq_length=SEQ, pos_emb="rotary", num_kv_heads=2, activation="swiglu", norm="rmsnorm")
DS_CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 6,
             "gradient_clipping": 1.0}


def test_chunk_positions_are_load_balanced():
    assert chunk_positions(16, 0, 2).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert chunk_positions(16, 1, 2).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    every = torch.cat([chunk_positions(24, r, 3) for r in range(3)]).sort().values
    assert torch.equal(every, torch.arange(24))
    x = torch.arange(16).view(1, 16)
    assert torch.equal(split_sequence(x, 1, 2), chunk_positions(16, 1, 2).view(1, 8))
    with pytest.raises(ValueError, match="divisible by 2 x context_parallel_size"):
        chunk_positions(12, 0, 4)


def test_model_rules_refuse_what_ring_attention_does_not_do():
    problems = " ".join(context_parallel_problems(tiny_config(seq_length=30, pos_emb="alibi", pipe_parallel_size=1,
                                                               attention_config=[[["local"], 2]]), 2))
    for key in ("seq_length=30", "pipe_parallel_size=1", "['local']", "alibi"):
        assert key in problems
    assert context_parallel_problems(tiny_config(**MODEL), 2) == []


def _text(seed: int, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, 128, (batch, SEQ + 1), generator=torch.Generator().manual_seed(seed))


def _full_batch(text: torch.Tensor):
    return get_batch(BatchOptions(), {"text": text}, SingleProcessState())


def _check_ring_attention(state: ParallelState) -> None:
    """Output and q/k/v gradients of ring attention equal full causal SDPA at this rank's positions (MHA, GQA)."""
    cp, rank, group = state.get_context_parallel_world_size(), state.get_context_parallel_rank(), \
        state.get_context_parallel_group()
    gen = torch.Generator().manual_seed(1)
    for kv_heads in (4, 2):
        q = torch.randn(2, 4, SEQ, 8, generator=gen, requires_grad=True)
        k, v = (torch.randn(2, kv_heads, SEQ, 8, generator=gen, requires_grad=True) for _ in range(2))
        upstream = torch.randn(2, 4, SEQ, 8, generator=gen)
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv_heads < 4)
        ref.backward(upstream)
        mine = [split_sequence(t.detach(), rank, cp, dim=2).requires_grad_() for t in (q, k, v)]
        out = ring_attention(*mine, group, rank, cp)
        out.backward(split_sequence(upstream, rank, cp, dim=2))
        torch.testing.assert_close(out, split_sequence(ref.detach(), rank, cp, dim=2), rtol=1e-5, atol=1e-5)
        for name, full, local in zip("qkv", (q, k, v), mine):
            torch.testing.assert_close(local.grad, split_sequence(full.grad, rank, cp, dim=2), rtol=1e-5,
                                       atol=1e-5, msg=f"d{name} kv_heads={kv_heads}")


def _check_model_grads(state: ParallelState, rank: int) -> None:
    """CP=2 x TP=2: the loss value is CP=1's on every rank; the gradients summed over the context-parallel ranks
    (what DeepSpeed does) are CP=1's (this rank's tensor-parallel shard). Full recomputation composes."""
    for overrides in (MODEL, dict(MODEL, pos_emb="learned", checkpoint_activations=True)):
        ref = build_model(tiny_config(**overrides), SingleProcessState())
        text = _text(0)
        inputs, labels = _full_batch(text)
        ref_loss = ref.loss_fn(ref(inputs), labels)
        ref_loss.backward()
        model = build_model(tiny_config(model_parallel_size=2, context_parallel_size=2, **overrides), state)
        inputs, labels = get_batch(BatchOptions(), {"text": text}, state)
        assert inputs[0].size(1) == SEQ // 2 and inputs[2] is None
        assert torch.equal(inputs[1][0], chunk_positions(SEQ, state.get_context_parallel_rank(), 2))
        model.train()
        loss = model.loss_fn(model(inputs), labels)
        loss.backward()
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        for param in model.parameters():
            torch.distributed.all_reduce(param.grad, group=state.get_context_parallel_group())
        for name, (want, got) in expected_local(ref, model, state.get_model_parallel_rank(), 2, grads=True).items():
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=f"{overrides} grad {name}")


def _train(model, state, steps_data, zero_stage: int):
    """Losses of ``steps_data`` (one text per step): through the DeepSpeed engine when ``state`` is a
    ParallelState, else by a plain loop (CP=1 reference) with the same optimizer and clipping."""
    import deepspeed

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = None
    if isinstance(state, ParallelState):
        config = dict(DS_CONFIG, zero_optimization={"stage": zero_stage},
                      train_batch_size=2 * state.get_data_parallel_world_size())
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config, mpu=state)
    losses = []
    for text in steps_data:
        inputs, labels = get_batch(BatchOptions(), {"text": text}, state)
        if engine is not None:
            loss = model.loss_fn(engine(inputs), labels)
            engine.backward(loss)
            engine.step()
            torch.distributed.all_reduce(loss.detach(), group=state.get_data_parallel_group())
            losses.append(loss.item() / state.get_data_parallel_world_size())
        else:
            opt.zero_grad()
            loss = model.loss_fn(model(inputs), labels)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), DS_CONFIG["gradient_clipping"])
            opt.step()
            losses.append(loss.item())
    return losses


def _check_training(state: ParallelState, tp: int, zero_stage: int) -> dict:
    """10 DeepSpeed steps at this layout; the CP=1 reference (on global rank 0 only) trains on the data-parallel
    ranks' samples joined. Three batches in turn, so that the loss falls visibly in 10 steps."""
    dp, dp_rank = state.get_data_parallel_world_size(), state.get_data_parallel_rank()
    texts = [_text(100 + step % 3, batch=2 * dp) for step in range(STEPS)]
    model = build_model(tiny_config(model_parallel_size=tp, context_parallel_size=2, **MODEL), state)
    losses = _train(model, state, [t[2 * dp_rank:2 * dp_rank + 2] for t in texts], zero_stage)
    ref = _train(build_model(tiny_config(**MODEL), SingleProcessState()), SingleProcessState(), texts, 0) \
        if state.rank == 0 else None
    return {"losses": losses, "ref": ref}


def _run(rank: int, world_size: int) -> dict:
    results = {}
    state = ParallelState(pipe_parallel_size=0, model_parallel_size=2, context_parallel_size=2)
    assert (state.get_data_parallel_world_size(), state.get_sequence_data_parallel_world_size()) == (1, 2)
    results["cp_tp_groups"] = (state.group_ranks("model"), state.group_ranks("context"))
    _check_ring_attention(state)
    _check_model_grads(state, rank)
    results["cp2_tp2"] = _check_training(state, tp=2, zero_stage=1)
    state.destroy()
    state = ParallelState(pipe_parallel_size=0, model_parallel_size=1, context_parallel_size=2)
    results["cp_dp_groups"] = (state.group_ranks("data"), state.group_ranks("context"),
                               state.group_ranks("data_context"), state.get_sequence_data_parallel_rank())
    results["cp2_dp2"] = _check_training(state, tp=1, zero_stage=0)
    state.destroy()
    return results


def test_context_parallel_matches_cp1_on_four_ranks():
    results = run_distributed(_run, world_size=4)
    assert [r["cp_tp_groups"] for r in results] == [([0, 1], [0, 2]), ([0, 1], [1, 3]), ([2, 3], [0, 2]),
                                                     ([2, 3], [1, 3])]
    assert [r["cp_dp_groups"] for r in results] == [([0, 2], [0, 1], [0, 1, 2, 3], 0), ([1, 3], [0, 1], [0, 1, 2, 3], 1),
                                                     ([0, 2], [2, 3], [0, 1, 2, 3], 2), ([1, 3], [2, 3], [0, 1, 2, 3], 3)]
    for layout in ("cp2_tp2", "cp2_dp2"):
        ref = torch.tensor(results[0][layout]["ref"])
        assert ref[-1] < ref[0] - 0.1, f"{layout}: the reference did not train"
        for r in results:
            torch.testing.assert_close(torch.tensor(r[layout]["losses"]), ref, rtol=0, atol=2e-3, msg=layout)
