"""Expert parallelism (moe_expert_parallel_size): the expert groups' layout, DeepSpeed's layer with its experts split
over two data-parallel ranks training as with every expert on every rank (DeepSpeed's engine, ZeRO 0 and 2), its
checkpoint files, exact resume, and loading at another expert-parallel size (the refusals of bad sizes:
tests/neox_arguments/test_validation.py, tests/test_checkpointing.py)."""
import os

import pytest
import torch

from megatron.mpu.parallel_state import expert_parallel_ranks
from tests.distributed_helpers import run_distributed
from tests.model.helpers import random_batch

STEPS = 10


@pytest.mark.parametrize("world,tp,pp,ep", [(8, 1, 1, 2), (8, 1, 1, 4), (16, 2, 1, 4), (16, 2, 2, 2), (8, 2, 2, 2)])
def test_expert_groups_are_laid_out_as_deepspeed_lays_them_out(world, tp, pp, ep):
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
    from deepspeed.utils.groups import _get_expert_parallel_ranks

    topology = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=world // (tp * pp))
    expert, expert_data = expert_parallel_ranks(topology.get_axis_comm_lists("data"), ep)
    want_expert, want_expert_data = _get_expert_parallel_ranks(world, tp, ep, pp)
    assert sorted(expert) == sorted(want_expert) and sorted(expert_data) == sorted(want_expert_data)
    assert all(len(g) == ep for g in expert) and sorted(r for g in expert for r in g) == list(range(world))


def _neox_args(ep: int, zero: int, save: str, **extra):
    from megatron.neox_arguments import NeoXArgs

    return NeoXArgs.from_dict({
        "num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 16, "max_position_embeddings": 16,
        "make_vocab_size_divisible_by": 64, "hidden_dropout": 0.0, "attention_dropout": 0.0, "seed": 1234,
        "moe_num_experts": 4, "moe_type": "deepspeed", "moe_top_k": 2, "expert_interval": 2, "moe_loss_coeff": 0.1,
        "moe_train_capacity_factor": 1.0, "moe_token_dropping": True, "moe_expert_parallel_size": ep,
        "optimizer": {"type": "Adam", "params": {"lr": 1.0e-2, "betas": [0.9, 0.95], "eps": 1.0e-8}},
        "weight_decay": 0.01, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0, "zero_optimization": {"stage": zero}, "num_gpus": 2, "train_iters": STEPS,
        "distributed_backend": "gloo", "save": save, "load": save, "checkpoint_factor": 4,
        "tokenizer_type": "CharLevelTokenizer",
        "config_files": {"moe.yml": "{}"}, **extra})


def _setup(args):
    """The training run's own setup: process groups, model, optimizer, engine."""
    from megatron.initialize import initialize_megatron
    from megatron.training import setup_model_and_optimizer
    from megatron.training_schedule import TrainingSchedule

    ctx = initialize_megatron(args)
    engine, optimizer, _ = setup_model_and_optimizer(args, ctx, TrainingSchedule.from_neox_args(args))
    return ctx, engine, optimizer


def _steps(args, ctx, engine, optimizer, rank: int, first: int, count: int):
    """[(loss over both ranks, gradient norm)] of train_step for steps first .. first + count - 1."""
    from megatron.training import train_step

    out = []
    for step in range(first, first + count):
        batches = iter([random_batch(batch=2, seed=10 * (step % 2) + rank)])  # two batches a rank, to learn
        loss, skipped, _, _ = train_step(args, engine, batches, ctx, optimizer)
        assert not skipped
        out.append((loss, float(engine.get_global_grad_norm())))
    return out


def _local_experts(model) -> dict:
    """{parameter name: tensor} of this rank's expert weights (local expert ids in the names)."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if ".deepspeed_experts." in n}


def _expert_parallel_run(rank: int, world_size: int, save_dir: str):
    from megatron.checkpointing import load_checkpoint, save_checkpoint
    from megatron.inference import setup_for_inference

    out = {}
    for ep, zero in ((1, 0), (2, 0), (2, 2)):
        args = _neox_args(ep, zero, save_dir)
        ctx, engine, optimizer = _setup(args)
        state = ctx.parallel_state
        out[("experts", ep)] = _local_experts(engine.module)
        out[("groups", ep)] = (state.get_expert_parallel_rank(), state.get_expert_parallel_world_size(),
                               state.get_expert_data_parallel_world_size())
        if zero == 2:  # exact resume: save after 4 steps; a fresh engine loads it and repeats steps 4 .. 6
            out[(ep, zero)] = _steps(args, ctx, engine, optimizer, rank, 0, 4)
            save_checkpoint(args, ctx.model_config, 4, engine)
            out["saved"] = _local_experts(engine.module)
            out[(ep, zero)] += _steps(args, ctx, engine, optimizer, rank, 4, STEPS - 4)
            state.destroy()
            ctx, engine, optimizer = _setup(args)
            assert load_checkpoint(args, ctx.model_config, engine)[0] == 4
            out["reloaded"] = all(torch.equal(out["saved"][n], p) for n, p in _local_experts(engine.module).items())
            out["resumed"] = _steps(args, ctx, engine, optimizer, rank, 4, 3)
            out["files"] = sorted(os.listdir(os.path.join(save_dir, "global_step4")))
        else:
            out[(ep, zero)] = _steps(args, ctx, engine, optimizer, rank, 0, STEPS)
        ctx.parallel_state.destroy()
    # the weights load at another expert-parallel size with no_load_optim (DeepSpeed's files hold one expert each)
    args = _neox_args(1, 0, save_dir, no_load_optim=True)
    ctx, engine, _ = _setup(args)
    load_checkpoint(args, ctx.model_config, engine)
    out["resharded"] = _local_experts(engine.module)
    ctx.parallel_state.destroy()
    # generate.py / eval.py: every expert on every rank, whatever the run's expert-parallel size
    model, ctx, iteration = setup_for_inference(_neox_args(2, 2, save_dir))
    out["inference"] = (iteration, _local_experts(model), model(random_batch(batch=1)[0]))
    ctx.parallel_state.destroy()
    return out


def _global_name(name: str, ep_rank: int, local_experts: int = 2) -> str:
    """The EP=1 name of local expert parameter ``name`` of expert-parallel rank ``ep_rank``."""
    layer, rest = name.split(".deepspeed_experts.")
    e, tail = rest.split(".", 1)
    return f"{layer}.deepspeed_experts.{ep_rank * local_experts + int(e)}.{tail}"


def test_deepspeed_layer_with_experts_over_two_ranks_trains_as_with_all_experts_and_resumes(tmp_path):
    """DP=2: EP=2 (two of the four experts per rank, tokens exchanged by all-to-all, some dropped at capacity
    factor 1) gives EP=1's losses over 10 steps, with ZeRO 0 and 2; the checkpoint holds one file per expert and
    layer; a fresh engine resumes it exactly, an EP=1 engine loads its weights (no_load_optim), and so does inference
    (every expert on every rank)."""
    ranks = run_distributed(_expert_parallel_run, world_size=2, args=(str(tmp_path),))
    for rank, out in enumerate(ranks):
        assert out[("groups", 2)] == (rank, 2, 1) and out[("groups", 1)] == (0, 1, 2)
        everything, mine = out[("experts", 1)], out[("experts", 2)]
        assert len(everything) == 4 * 4 and len(mine) == 2 * 4  # one MoE layer: 4 (2 local) experts x 4 tensors
        for name, weight in mine.items():  # local expert e of rank r is global expert 2r + e, initialised alike
            torch.testing.assert_close(weight, everything[_global_name(name, rank)], rtol=0, atol=0)
        reference = torch.tensor(out[(1, 0)])  # [step, (loss, gradient norm)]
        assert reference[-1, 0] < reference[0, 0] - 0.5 and (reference[:, 1] > 1.0).any()  # learns; clipping acts
        for zero in (0, 2):
            torch.testing.assert_close(torch.tensor(out[(2, zero)]), reference, rtol=2e-3, atol=0)
        assert out["reloaded"] and out["resumed"] == out[(2, 2)][4:7]
        iteration, inference_experts, logits = out["inference"]
        assert iteration == 4 and inference_experts.keys() == out["resharded"].keys()
        torch.testing.assert_close(logits, ranks[0]["inference"][2], rtol=0, atol=0)
        for name, weight in out["saved"].items():  # at EP=1 a rank holds every expert, those saved by both EP ranks
            torch.testing.assert_close(out["resharded"][_global_name(name, rank)], weight, rtol=0, atol=0)
            torch.testing.assert_close(inference_experts[_global_name(name, rank)], weight, rtol=0, atol=0)
    files = ranks[0]["files"]
    assert {"COMPLETE", "neox_args.json", "mp_rank_00_model_states.pt"} <= set(files)
    assert [f for f in files if f.startswith("layer_")] == sorted(
        f"layer_0_expert_{e}_mp_rank_00_model_states.pt" for e in range(4))
    assert {f for f in files if "optim_states" in f} == {"zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                                         "zero_pp_rank_1_mp_rank_00_optim_states.pt"}
