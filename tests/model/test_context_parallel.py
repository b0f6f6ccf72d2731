"""Context parallelism (megatron.mpu.context_parallel, megatron.model.ring_attention): on 4 gloo ranks, ring
attention at CP=2 and CP=4 gives full causal attention's output and gradients; the tiny model at CP=2 x TP=2 gives the
CP=1 loss and gradients; megatron.training.setup and .step (DeepSpeed with the ParallelState as mpu, or its
pipeline engine) train CP=2 x TP=2 (ZeRO 2), CP=2 x DP=2 (no ZeRO) and CP=2 x PP=2 (ZeRO 1) with the CP=1 losses over 10
steps, and the last two resume their step-5 checkpoints bitwise; the CP=2 x DP=2 checkpoint continues at CP=1 x DP=4
(ZeRO-1) and that one's back at CP=2 (ZeRO-2 and ZeRO-3) with the uninterrupted losses (resharded optimizer state). One spawned
world runs every check (4 ranks on a 2-core machine: starting them is the cost)."""
import os
from typing import Optional

import pytest
import torch
import torch.nn.functional as F

from megatron.model.batch import BatchOptions, get_batch
from megatron.model.gpt2_model import build_model
from megatron.model.ring_attention import ring_attention
from megatron.mpu import ParallelState, SingleProcessState
from megatron.mpu.context_parallel import chunk_positions, split_sequence
from megatron.model.config import context_parallel_problems
from tests.distributed_helpers import run_distributed
from tests.model.helpers import tiny_config
from tests.model.tp_helpers import expected_local
from tests.parity import assert_parity

SEQ = 32
STEPS = 10
CP_RTOL = 1e-5
"""fp32 losses of 10 steps against CP=1, measured at most 2.1e-7 relative (9.5e-7 absolute) in every layout; the runs
that continue from a checkpoint in another layout measured 0 (the same sums)."""
MODEL = dict(seq_length=SEQ, pos_emb="rotary", num_kv_heads=2, activation="swiglu", norm="rmsnorm")


def test_model_rules_refuse_what_ring_attention_does_not_do():
    problems = " ".join(context_parallel_problems(tiny_config(seq_length=30, pos_emb="alibi", pipe_parallel_size=1,
                                                               attention_config=[[["local"], 2]]), 2))
    for key in ("seq_length=30", "['local']", "alibi"):
        assert key in problems
    assert "pipe_parallel_size" not in problems  # composed: the pipeline engine's data axis is data x context
    assert context_parallel_problems(tiny_config(**MODEL), 2) == []


def test_generation_and_evaluation_refuse_context_parallelism():
    from megatron.inference.loading import setup_for_inference
    from megatron.errors import ConfigError
    from tests.neox_arguments.helpers import tiny

    with pytest.raises(ConfigError, match="context_parallel_size: 1, the checkpoint loads unchanged"):
        setup_for_inference(tiny(num_gpus=2, context_parallel_size=2))


def _text(seed: int, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, 128, (batch, SEQ + 1), generator=torch.Generator().manual_seed(seed))


def _full_batch(text: torch.Tensor):
    return get_batch(BatchOptions(), {"text": text}, SingleProcessState())


def _check_ring_attention(state: ParallelState, variants=((4, False), (2, False), (2, True))) -> None:
    """Output and q/k/v gradients of ring attention equal full causal SDPA at this rank's positions for each
    (kv heads of 4 query heads, explicit) variant: MHA, GQA; SDPA's CPU kernel and the explicit fp32 steps."""
    cp, rank, group = state.get_context_parallel_world_size(), state.get_context_parallel_rank(), \
        state.get_context_parallel_group()
    gen = torch.Generator().manual_seed(1)
    for kv_heads, explicit in variants:
        q = torch.randn(2, 4, SEQ, 8, generator=gen, requires_grad=True)
        k, v = (torch.randn(2, kv_heads, SEQ, 8, generator=gen, requires_grad=True) for _ in range(2))
        upstream = torch.randn(2, 4, SEQ, 8, generator=gen)
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv_heads < 4)
        ref.backward(upstream)
        mine = [split_sequence(t.detach(), rank, cp, dim=2).requires_grad_() for t in (q, k, v)]
        out = ring_attention(*mine, group, rank, cp, explicit=explicit)
        out.backward(split_sequence(upstream, rank, cp, dim=2))
        msg = f"kv_heads={kv_heads} explicit={explicit}"
        torch.testing.assert_close(out, split_sequence(ref.detach(), rank, cp, dim=2), rtol=1e-5, atol=1e-5, msg=msg)
        for name, full, local in zip("qkv", (q, k, v), mine):
            torch.testing.assert_close(local.grad, split_sequence(full.grad, rank, cp, dim=2), rtol=1e-5,
                                       atol=1e-5, msg=f"d{name} {msg}")


def _check_model_grads(state: ParallelState, rank: int) -> None:
    """CP=2 x TP=2: the loss value is CP=1's on every rank; the gradients summed over the context-parallel ranks
    (what DeepSpeed does) are CP=1's (this rank's tensor-parallel shard). Full recomputation and sequence
    parallelism compose; so does YaRN RoPE scaling (its frequencies and attention factor at each chunk's
    positions)."""
    yarn = dict(MODEL, rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=8))
    for overrides in (MODEL, dict(MODEL, pos_emb="learned", checkpoint_activations=True, sequence_parallel=True),
                      yarn):
        ref = build_model(tiny_config(model_parallel_size=2, **overrides), SingleProcessState())  # split: the state's
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


def _neox_args(tp: int, zero_stage: int, pp: int = 0, save_dir: Optional[str] = None, cp: int = 2, micro: int = 2):
    from megatron.neox_arguments import NeoXArgs

    return NeoXArgs.from_dict({
        "num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "num_kv_heads": 2, "seq_length": SEQ,
        "pos_emb": "rotary", "activation": "swiglu", "norm": "rmsnorm", "make_vocab_size_divisible_by": 64,
        "hidden_dropout": 0.0, "attention_dropout": 0.0, "seed": 1234, "distributed_backend": "gloo",
        "optimizer": {"type": "Adam", "params": {"lr": 1.0e-2, "betas": [0.9, 0.95], "eps": 1.0e-8}},
        "lr_decay_style": "constant", "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0, "zero_optimization": {"stage": zero_stage}, "num_gpus": 4, "train_iters": STEPS,
        "pipe_parallel_size": pp, "model_parallel_size": tp, "context_parallel_size": cp,
        **({"save": save_dir, "load": save_dir} if save_dir else {})})


def _initialize(args):
    from types import SimpleNamespace

    from megatron.initialize import initialize_megatron

    return initialize_megatron(args, build_tokenizer_fn=lambda _: SimpleNamespace(vocab_size=128, eod=0))


def _train(args, ctx, engine, optimizer, first: int, save_at: Optional[int] = None) -> list:
    """Steps first + 1 .. STEPS of megatron.training.loop's train_step on the global batches ``_text(100 + step % 3)``
    (this data-parallel rank's micro-batch of them); saves a checkpoint after step ``save_at``."""
    from megatron.checkpoint.engine import save_checkpoint
    from megatron.training.step import train_step
    from megatron.training.batches import ModelBatches

    state, micro = ctx.parallel_state, args.train_micro_batch_size_per_gpu
    rows = slice(micro * state.get_data_parallel_rank(), micro * (state.get_data_parallel_rank() + 1))
    samples = ({"text": _text(100 + step % 3, batch=args.train_batch_size)[rows]} for step in range(first, STEPS))
    batches = ModelBatches(args, ctx, samples if state.get_model_parallel_rank() == 0 else None)
    losses = []
    for step in range(first, STEPS):
        losses.append(train_step(args, engine, batches, ctx, optimizer)[0])
        if step + 1 == save_at:
            save_checkpoint(args, ctx.model_config, step + 1, engine)
    return losses


def _check_resharded(load_dir: str, first: int, save_at: Optional[int] = None, **layout) -> list:
    """Steps first + 1 .. STEPS of the CP=2 x DP=2 run of 4 samples a step, resumed from its checkpoint in
    ``load_dir`` in another layout (``layout``: _neox_args' keywords): megatron.checkpoint.engine.load_checkpoint
    reshards weights and optimizer state (megatron.checkpoint.resharding)."""
    from megatron.checkpoint.engine import load_checkpoint
    from megatron.training.setup import setup_model_and_optimizer
    from megatron.training_schedule import TrainingSchedule

    args = _neox_args(save_dir=load_dir, **layout)
    assert args.train_batch_size == 4
    ctx = _initialize(args)
    engine, optimizer, _ = setup_model_and_optimizer(args, ctx, TrainingSchedule.from_neox_args(args))
    assert load_checkpoint(args, ctx.model_config, engine, ctx.checkpoint)[0] == first
    losses = _train(args, ctx, engine, optimizer, first, save_at)
    ctx.parallel_state.destroy()
    return losses


def _check_training(tp: int, zero_stage: int, reference_rank: int, pp: int = 0,
                    save_dir: Optional[str] = None) -> dict:
    """10 steps of megatron.training.loop (initialize_megatron, setup_model_and_optimizer with the ParallelState as
    DeepSpeed's mpu, or the pipeline engine over its topology, ModelBatches splitting each sample per
    context-parallel rank, train_step) at CP=2 x PP=pp x TP=tp (x DP=2 / (pp x tp)); the CP=1 reference (on
    ``reference_rank`` only) takes the same optimizer and clipping in a plain loop over the data-parallel ranks'
    samples joined. Three batches in turn, so that the loss falls in 10 steps. With ``save_dir`` the run saves
    after step 5 and a fresh engine loading that checkpoint repeats steps 6-10 ("resumed")."""
    from megatron.checkpoint.engine import find_checkpoint, load_checkpoint
    from megatron.optim.optimizers import build_optimizer
    from megatron.training.setup import setup_model_and_optimizer
    from megatron.training_schedule import TrainingSchedule

    args = _neox_args(tp, zero_stage, pp, save_dir)
    ctx = _initialize(args)
    state = ctx.parallel_state
    dp = state.get_data_parallel_world_size()
    want = 2 // (tp * max(pp, 1))
    assert (dp, args.data_parallel_size, args.train_batch_size) == (want, want, 2 * want)
    texts = [_text(100 + step % 3, batch=2 * dp) for step in range(STEPS)]
    engine, optimizer, _ = setup_model_and_optimizer(args, ctx, TrainingSchedule.from_neox_args(args))
    half = STEPS // 2
    out = {"losses": _train(args, ctx, engine, optimizer, 0, save_at=half if save_dir else None), "ref": None}
    assert engine.global_samples == STEPS * args.train_batch_size  # samples, not samples x context ranks
    if save_dir:  # this worker's checkpoint was saved after initialize_megatron: found here
        engine, optimizer, _ = setup_model_and_optimizer(args, ctx, TrainingSchedule.from_neox_args(args))
        assert load_checkpoint(args, ctx.model_config, engine, find_checkpoint(args))[0] == half
        out["resumed"] = _train(args, ctx, engine, optimizer, half)
    state.destroy()
    if torch.distributed.get_rank() == reference_rank:
        ref = build_model(ctx.model_config.replace(model_parallel_size=1, context_parallel_size=1,
                                                   pipe_parallel_size=0), SingleProcessState())
        opt = build_optimizer(args, ref)
        out["ref"] = []
        for text in texts:
            opt.zero_grad()
            loss = ref.loss_fn(*(lambda b: (ref(b[0]), b[1]))(_full_batch(text)))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            opt.step()
            out["ref"].append(loss.item())
    return out


def _run(rank: int, world_size: int, save_root: str) -> dict:
    results = {}
    state = ParallelState(pipe_parallel_size=0, model_parallel_size=2, context_parallel_size=2)
    assert (state.get_data_parallel_world_size(), state.get_sequence_data_parallel_world_size()) == (1, 2)
    results["cp_tp_groups"] = (state.group_ranks("model"), state.group_ranks("context"))
    _check_ring_attention(state)
    _check_model_grads(state, rank)
    state.destroy()
    state = ParallelState(pipe_parallel_size=0, model_parallel_size=1, context_parallel_size=2)
    results["cp_dp_groups"] = (state.group_ranks("data"), state.group_ranks("context"),
                               state.group_ranks("data_context"), state.get_sequence_data_parallel_rank())
    state.destroy()
    state = ParallelState(pipe_parallel_size=0, model_parallel_size=1, context_parallel_size=4)
    _check_ring_attention(state, variants=((2, False),))  # a ring of 4: sources before and after each rank
    state.destroy()
    results["cp2_tp2"] = _check_training(tp=2, zero_stage=2, reference_rank=0)
    dp2 = os.path.join(save_root, "dp2")
    results["cp2_dp2"] = _check_training(tp=1, zero_stage=0, reference_rank=1, save_dir=dp2)
    # out of context parallelism: its step-5 checkpoint continues at CP=1 x DP=4 (ZeRO-1), which saves after step 7;
    # into it: that continues at CP=2 x DP=2 (ZeRO-2, and ZeRO-3: partitioned over data x context)
    results["cp1_dp4"] = _check_resharded(dp2, 5, save_at=7, tp=1, zero_stage=1, cp=1, micro=1)
    results["cp2_dp2_zero2"] = _check_resharded(dp2, 7, tp=1, zero_stage=2)
    results["cp2_dp2_zero3"] = _check_resharded(dp2, 7, save_at=8, tp=1, zero_stage=3)
    results["cp2_dp2_zero3_resumed"] = _check_resharded(dp2, 8, tp=1, zero_stage=3)  # its own layout: DeepSpeed loads
    results["cp2_pp2"] = _check_training(tp=1, zero_stage=1, reference_rank=2, pp=2,
                                         save_dir=os.path.join(save_root, "pp2"))
    return results


def test_context_parallel_matches_cp1_on_four_ranks(tmp_path):
    results = run_distributed(_run, world_size=4, args=(str(tmp_path),))
    assert [r["cp_tp_groups"] for r in results] == [([0, 1], [0, 2]), ([0, 1], [1, 3]), ([2, 3], [0, 2]),
                                                     ([2, 3], [1, 3])]
    assert [r["cp_dp_groups"] for r in results] == [([0, 2], [0, 1], [0, 1, 2, 3], 0), ([1, 3], [0, 1], [0, 1, 2, 3], 1),
                                                     ([0, 2], [2, 3], [0, 1, 2, 3], 2), ([1, 3], [2, 3], [0, 1, 2, 3], 3)]
    for layout, reference_rank in (("cp2_tp2", 0), ("cp2_dp2", 1), ("cp2_pp2", 2)):
        ref = torch.tensor(results[reference_rank][layout]["ref"])
        assert ref[-1] < ref[0] - 0.1, f"{layout}: the reference did not train"
        for rank, r in enumerate(results):
            assert_parity(r[layout]["losses"], ref, rtol=CP_RTOL, what=f"{layout}, rank {rank}")
            if "resumed" in r[layout]:
                assert r[layout]["resumed"] == r[layout]["losses"][STEPS // 2:], f"{layout}: resume"
    uninterrupted = torch.tensor(results[0]["cp2_dp2"]["losses"])
    for layout, first in (("cp1_dp4", 5), ("cp2_dp2_zero2", 7), ("cp2_dp2_zero3", 7)):
        for rank, r in enumerate(results):
            assert_parity(r[layout], uninterrupted[first:], rtol=CP_RTOL, what=f"{layout} resharded, rank {rank}")
    assert all(r["cp2_dp2_zero3_resumed"] == r["cp2_dp2_zero3"][1:] for r in results), "ZeRO-3 x CP=2: resume"
