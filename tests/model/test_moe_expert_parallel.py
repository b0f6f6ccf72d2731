"""Expert parallelism (moe_expert_parallel_size): the expert groups' layout, DeepSpeed's layer with its experts split
over two data-parallel ranks training as with every expert on every rank (DeepSpeed's engine, ZeRO 0 and 2), its
checkpoint files and exact resume, and the refusals."""
import os

import pytest
import torch

from megatron.model import build_model
from megatron.mpu.parallel_state import expert_parallel_ranks
from megatron.training import _record_clipping_grad_norm
from tests.distributed_helpers import run_distributed
from tests.model.helpers import random_batch
from tests.model.test_moe import ds_config

STEPS = 10
LR = 1e-2


@pytest.mark.parametrize("world,tp,pp,ep", [(8, 1, 1, 2), (8, 1, 1, 4), (16, 2, 1, 4), (16, 2, 2, 2), (8, 2, 2, 2)])
def test_expert_groups_are_laid_out_as_deepspeed_lays_them_out(world, tp, pp, ep):
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
    from deepspeed.utils.groups import _get_expert_parallel_ranks

    topology = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=world // (tp * pp))
    expert, expert_data = expert_parallel_ranks(topology.get_axis_comm_lists("data"), ep)
    want_expert, want_expert_data = _get_expert_parallel_ranks(world, tp, ep, pp)
    assert sorted(expert) == sorted(want_expert) and sorted(expert_data) == sorted(want_expert_data)
    assert all(len(g) == ep for g in expert) and sorted(r for g in expert for r in g) == list(range(world))


def _engine(ep: int, zero: int, state):
    import deepspeed

    from megatron.optimizers import deepspeed_moe_param_groups

    torch.manual_seed(1234)
    config = ds_config(num_layers=2, moe_top_k=2, moe_loss_coeff=0.1, moe_expert_parallel_size=ep,
                       moe_train_capacity_factor=1.0, use_bias_in_mlp=True)
    model = build_model(config, state).train()
    optimizer = torch.optim.AdamW(deepspeed_moe_param_groups(model, 0.01), lr=LR)
    ds = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
          "steps_per_print": 10 ** 6, "gradient_clipping": 1.0, "zero_optimization": {"stage": zero}}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds, mpu=state)
    _record_clipping_grad_norm(engine)  # the training loop's clipping without ZeRO
    return engine, model


def _steps(engine, model, rank: int, first: int, count: int):
    """[(mean loss over both ranks, gradient norm)] of steps first .. first + count - 1 (each rank its own batch)."""
    import torch.distributed as dist

    losses = []
    for step in range(first, first + count):
        inputs, labels = random_batch(batch=2, seed=10 * (step % 2) + rank)  # two batches a rank, to learn
        loss = model.loss_fn(engine(inputs), labels)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append((mean.item() / dist.get_world_size(), float(engine.get_global_grad_norm())))
    return losses


def _local_experts(model) -> dict:
    """{parameter name: tensor} of this rank's expert weights (global expert ids in the names)."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if ".deepspeed_experts." in n}


def _expert_parallel_run(rank: int, world_size: int, save_dir: str):
    import time

    from megatron.deepspeed_comm import init_deepspeed_comm
    from megatron.mpu import ParallelState

    out, start = {}, time.time()
    init_deepspeed_comm("gloo", dist_init_required=False)
    for ep, zero in ((1, 0), (2, 0), (2, 2)):
        state = ParallelState(pipe_parallel_size=0, model_parallel_size=1, expert_parallel_size=ep)
        engine, model = _engine(ep, zero, state)
        out[("experts", ep)] = _local_experts(model)
        out[("groups", ep)] = (state.get_expert_parallel_rank(), state.get_expert_parallel_world_size(),
                               state.get_expert_data_parallel_world_size())
        if zero == 2:  # exact resume: save after 4 steps; a fresh engine loads it and repeats steps 4 .. 6
            out[(ep, zero)] = _steps(engine, model, rank, 0, 4)
            engine.save_checkpoint(save_dir, tag="step4")
            saved = _local_experts(model)
            out[(ep, zero)] += _steps(engine, model, rank, 4, STEPS - 4)
            engine, model = _engine(ep, zero, state)
            engine.load_checkpoint(save_dir, tag="step4")
            out["reloaded"] = all(torch.equal(saved[n], p) for n, p in _local_experts(model).items())
            out["resumed"] = _steps(engine, model, rank, 4, 3)
            out["files"] = sorted(os.listdir(os.path.join(save_dir, "step4")))
            out["saved"] = saved
        else:
            out[(ep, zero)] = _steps(engine, model, rank, 0, STEPS)
        state.destroy()
    # the weights load at another expert-parallel size (no_load_optim: DeepSpeed's files hold one expert each)
    state = ParallelState(pipe_parallel_size=0, model_parallel_size=1, expert_parallel_size=1)
    engine, model = _engine(1, 0, state)
    engine.load_checkpoint(save_dir, tag="step4", load_optimizer_states=False, load_lr_scheduler_states=False)
    out["resharded"] = _local_experts(model)
    state.destroy()
    out["seconds"] = time.time() - start
    return out


def _global_name(name: str, ep_rank: int, local_experts: int = 2) -> str:
    """The EP=1 name of local expert parameter ``name`` of expert-parallel rank ``ep_rank``."""
    layer, rest = name.split(".deepspeed_experts.")
    e, tail = rest.split(".", 1)
    return f"{layer}.deepspeed_experts.{ep_rank * local_experts + int(e)}.{tail}"


def test_deepspeed_layer_with_experts_over_two_ranks_trains_as_with_all_experts_and_resumes(tmp_path):
    """DP=2: EP=2 (two of the four experts per rank, tokens exchanged by all-to-all, some dropped at capacity
    factor 1) gives EP=1's losses over 10 steps, with ZeRO 0 and 2; the checkpoint holds one file per expert and
    layer; a fresh engine resumes it exactly, and an EP=1 engine loads its weights (no_load_optim)."""
    ranks = run_distributed(_expert_parallel_run, world_size=2, args=(str(tmp_path),))
    for rank, out in enumerate(ranks):
        assert out[("groups", 2)] == (rank, 2, 1) and out[("groups", 1)] == (0, 1, 2)
        everything, mine = out[("experts", 1)], out[("experts", 2)]
        assert len(everything) == 2 * 4 * 4 and len(mine) == 2 * 2 * 4  # 2 layers x 4 (2 local) experts x 4 tensors
        for name, weight in mine.items():  # local expert e of rank r is global expert 2r + e, initialised alike
            torch.testing.assert_close(weight, everything[_global_name(name, rank)], rtol=0, atol=0)
        reference = torch.tensor(out[(1, 0)])  # [step, (loss, gradient norm)]
        assert reference[-1, 0] < reference[0, 0] - 1.0 and (reference[:, 1] > 1.0).any()  # learns; clipping acts
        for zero in (0, 2):
            torch.testing.assert_close(torch.tensor(out[(2, zero)]), reference, rtol=2e-3, atol=0)
        assert out["reloaded"] and out["resumed"] == out[(2, 2)][4:7]
        for name, weight in out["saved"].items():  # at EP=1 a rank holds every expert, those saved by both EP ranks
            torch.testing.assert_close(out["resharded"][_global_name(name, rank)], weight, rtol=0, atol=0)
    print("seconds in the workers:", [out["seconds"] for out in ranks])
    files = ranks[0]["files"]
    assert [f for f in files if f.startswith("layer_")] == sorted(
        f"layer_{layer}_expert_{e}_mp_rank_00_model_states.pt" for layer in range(2) for e in range(4))
    assert "mp_rank_00_model_states.pt" in files
    assert {f for f in files if "optim_states" in f} == {"zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                                         "zero_pp_rank_1_mp_rank_00_optim_states.pt"}
