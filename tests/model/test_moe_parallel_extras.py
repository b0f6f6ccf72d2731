"""The smaller MoE pieces on 2 gloo ranks, in one spawned pair of processes (each spawn costs seconds of imports):

* expert parallelism (moe_expert_parallel_size 2, data-parallel 2): the per-parameter logs (log_grad_norm,
  log_param_norm, log_grad_pct_zeros, log_optimizer_states) equal expert-parallel size 1's, each expert named by its
  global index; the checkpoint (DeepSpeed's per-expert files) exports to MixtralForCausalLM, which gives the
  expert-parallel size 1 model's logits and greedy tokens in transformers;
* sequence_parallel with the dropless layer on 2 tensor-parallel ranks: the loss and the gradients of
  sequence_parallel false;
* each of these layouts reads a layer's slot counts back to the host once (tests.host_syncs).
"""
import os

import pytest
import torch

from tests.distributed_helpers import run_distributed
from tests.model.helpers import random_batch, stacked_expert_logs

pytestmark = pytest.mark.slow  # one spawned pair of processes (~8 s on an idle 2-core machine)

LOGGED = ("log_grad_norm", "log_param_norm", "log_grad_pct_zeros", "log_optimizer_states")
EXPERTS = "deepspeed_moe.experts.deepspeed_experts."


def _mixtral_args(ep: int, zero: int, save: str):
    """A tiny rmsnorm + swiglu model with a dropless top-2 MoE in both layers (Mixtral's form), on 2 ranks."""
    from megatron.neox_arguments import NeoXArgs

    return NeoXArgs.from_dict({
        "num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 16, "max_position_embeddings": 16,
        "make_vocab_size_divisible_by": 64, "hidden_dropout": 0.0, "attention_dropout": 0.0, "seed": 1234,
        "pos_emb": "rotary", "rotary_pct": 1.0, "norm": "rmsnorm", "activation": "swiglu", "no_weight_tying": True,
        "use_bias_in_norms": False, "use_bias_in_attn_linear": False, "use_bias_in_mlp": False,
        "moe_num_experts": 4, "moe_top_k": 2, "expert_interval": 1, "moe_type": "megablocks",
        "moe_router_type": "topk", "moe_loss_coeff": 0.1, "moe_expert_parallel_size": ep,
        "optimizer": {"type": "Adam", "params": {"lr": 1.0e-2, "betas": [0.9, 0.95], "eps": 1.0e-8}},
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
        "zero_optimization": {"stage": zero}, "num_gpus": 2, "train_iters": 2, "distributed_backend": "gloo",
        "save": save, "tokenizer_type": "CharLevelTokenizer", "config_files": {"moe.yml": "{}"},
        **{flag: True for flag in LOGGED}})


def _expert_parallel_logs_and_checkpoint(rank: int, save_root: str) -> dict:
    """{(ep, zero): [each step's logged values]}; EP 1 and 2 (ZeRO 0) save their initial weights."""
    from megatron.checkpoint.engine import save_checkpoint
    from megatron.initialize import initialize_megatron
    from megatron.training.step import train_step
    from megatron.training.setup import setup_model_and_optimizer
    from megatron.training_schedule import TrainingSchedule

    out = {}
    for ep, zero in ((1, 0), (2, 0), (2, 2)):
        args = _mixtral_args(ep, zero, os.path.join(save_root, f"ep{ep}"))
        ctx = initialize_megatron(args)
        engine, optimizer, _ = setup_model_and_optimizer(args, ctx, TrainingSchedule.from_neox_args(args))
        if zero == 0:
            save_checkpoint(args, ctx.model_config, 0, engine)
        out[(ep, zero)] = []
        for step in range(2):
            batches = iter([random_batch(batch=2, seed=10 * step + rank)])
            _, skipped, _, extras = train_step(args, engine, batches, ctx, optimizer, debug=True)
            assert not skipped
            out[(ep, zero)].append(extras)
        if (ep, zero) == (2, 0):
            out["syncs"] = _moe_syncs(engine.module, random_batch(batch=2, seed=rank))
        ctx.parallel_state.destroy()
    return out


def _moe_syncs(model, batch) -> dict:
    """{file:line: count} of the host syncs (tests.host_syncs) in the MoE package during one forward and backward."""
    from tests.host_syncs import HostSyncCounter

    inputs, labels = batch
    with HostSyncCounter() as syncs:
        model.loss_fn(model(inputs), labels).backward()
    return {site: n for site, n in syncs.by_site.items() if site.startswith("megatron/model/moe/")}


SEQUENCE_PARALLEL = {"topk": dict(moe_router_type="topk", moe_top_k=2, activation="swiglu", norm="rmsnorm"),
                     "sinkhorn": dict(moe_router_type="sinkhorn", moe_top_k=1)}
"""Two dropless models (4 experts, two per tensor-parallel rank, in both layers; auxiliary loss on)."""


def _sequence_parallel_loss_and_grads(rank: int) -> dict:
    """{(router, sequence_parallel): (loss, this rank's logits shard, {name: gradient}, {name: weight})} at TP=2."""
    from megatron.model.gpt2_model import build_model
    from megatron.mpu import ParallelState
    from tests.model.helpers import tiny_config

    inputs, labels = random_batch(seq=16)
    out = {}
    state = ParallelState(pipe_parallel_size=0, model_parallel_size=2)
    for router, overrides in SEQUENCE_PARALLEL.items():
        for sp in (False, True):
            config = tiny_config(model_parallel_size=2, sequence_parallel=sp, moe_num_experts=4, expert_interval=1,
                                 moe_loss_coeff=0.1, **overrides)
            model = build_model(config, state)
            logits = model(inputs)
            loss = model.loss_fn(logits, labels)
            loss.backward()
            out[(router, sp)] = (loss.detach(), logits.detach(),
                                 {n: p.grad.clone() for n, p in model.named_parameters()},
                                 {n: p.detach().clone() for n, p in model.named_parameters()},
                                 _moe_syncs(model, (inputs, labels)))
    state.destroy()
    return out


def _run(rank: int, world_size: int, save_root: str) -> dict:
    return {"sequence_parallel": _sequence_parallel_loss_and_grads(rank),
            "expert_parallel": _expert_parallel_logs_and_checkpoint(rank, save_root)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return root, run_distributed(_run, world_size=2, args=(str(root),))


def test_expert_parallel_per_parameter_logs_equal_expert_parallel_size_one(runs):
    """EP=2 (two experts per rank): every logged per-parameter value, under the expert's global index, and the
    totals equal EP=1's, on every rank, without ZeRO and with ZeRO 2 (optimizer states from the second step)."""
    _, results = runs
    reference = [results[0]["expert_parallel"][(1, 0)][step] for step in range(2)]
    names = {key.split("/", 1)[0] for key in reference[1]}
    assert names == {"gradient_norms", "gradient_pct_zeros", "parameter_norms", "optimizer_state_norms",
                     "grad_norm_total", "param_norm_total"}
    for rank in range(2):
        for zero in (0, 2):
            for step in range(2):
                values = results[rank]["expert_parallel"][(2, zero)][step]
                experts = {key for key in values if EXPERTS in key}
                # 2 layers x 4 global experts x w1 / w3 / w2, per kind of value
                for kind in ("gradient_norms/", "parameter_norms/"):
                    mine = {k for k in experts if k.startswith(kind)}
                    assert {int(k.split(EXPERTS)[1].split(".")[0]) for k in mine} == {0, 1, 2, 3} and len(mine) == 24
                stacked = stacked_expert_logs(values)
                want = {k: v for k, v in reference[step].items() if not k.startswith("memory/")}
                assert set(stacked) == set(want)
                for key, value in want.items():
                    assert stacked[key] == pytest.approx(value, rel=1e-4, abs=1e-6), (rank, zero, step, key)
            if zero == 0:  # the ranks log the same values
                assert results[rank]["expert_parallel"][(2, 0)] == results[0]["expert_parallel"][(2, 0)]


def test_expert_parallel_checkpoint_exports_to_mixtral(runs, tmp_path):
    """The EP=2 checkpoint (one file per expert, written by DeepSpeed's engine on both ranks) converts to the same
    MixtralForCausalLM as the EP=1 checkpoint of the same model, which gives our EP=1 model's logits and greedy
    tokens in transformers."""
    from transformers import MixtralForCausalLM

    from megatron.checkpoint.neox_checkpoint import read_checkpoint
    from megatron.checkpoint_conversion.to_hf import convert_neox_to_hf
    from tests.checkpoint_conversion.helpers import assert_matches_hf, our_model

    root, _ = runs
    files = os.listdir(root / "ep2" / "global_step0")
    assert {f for f in files if f.startswith("layer_")} == {f"layer_{i}_expert_{e}_mp_rank_00_model_states.pt"
                                                            for i in range(2) for e in range(4)}
    models = {}
    for ep in (1, 2):
        assert convert_neox_to_hf(str(root / f"ep{ep}" / "global_step0"), str(tmp_path / f"hf{ep}"),
                                  architecture="mixtral") == "MixtralForCausalLM"
        models[ep] = MixtralForCausalLM.from_pretrained(tmp_path / f"hf{ep}", local_files_only=True).eval()
    one, two = (dict(models[ep].state_dict()) for ep in (1, 2))
    assert set(one) == set(two) and all(torch.equal(one[k], two[k]) for k in one)
    ours = our_model(read_checkpoint(str(root / "ep1" / "global_step0")).config,
                     read_checkpoint(str(root / "ep1" / "global_step0")).state)
    assert_matches_hf(ours, models[2])


def test_a_dropless_moe_layer_reads_its_counts_back_once_on_parallel_ranks(runs):
    """One host sync per MoE layer (2 layers) in a forward and backward, whatever the layout: expert-parallel (the
    counts' all-to-all runs on the device, then both are read at once), tensor-parallel, sequence-parallel."""
    _, results = runs
    for rank in range(2):
        layouts = {"expert_parallel": results[rank]["expert_parallel"]["syncs"],
                   **{f"tp2 {router} sp={sp}": results[rank]["sequence_parallel"][(router, sp)][4]
                      for router in SEQUENCE_PARALLEL for sp in (False, True)}}
        for layout, syncs in layouts.items():
            print(rank, layout, syncs)
            assert len(syncs) == 1 and sum(syncs.values()) == 2, (rank, layout, syncs)
        site = next(iter(layouts["expert_parallel"]))
        assert site.startswith("megatron/model/moe/expert_parallel.py:"), site


@pytest.mark.parametrize("router", list(SEQUENCE_PARALLEL))
def test_dropless_moe_with_sequence_parallel_equals_without(runs, router):
    """TP=2, experts split over the tensor-parallel ranks: with sequence_parallel (the sequence gathered before
    routing, the experts' partial sums reduce-scattered after) the same weights give the same logits, loss (with
    the auxiliary loss's gradient) and gradients of every parameter, the router's included, as without."""
    _, results = runs
    for rank in range(2):
        off, on = results[rank]["sequence_parallel"][(router, False)], results[rank]["sequence_parallel"][(router, True)]
        assert set(on[3]) == set(off[3]) and all(torch.equal(on[3][n], off[3][n]) for n in off[3])
        assert any(".mlp.router." in n for n in off[2]) and any(".mlp.experts.mlp.w1" in n for n in off[2])
        torch.testing.assert_close(on[0], off[0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(on[1], off[1], rtol=1e-5, atol=1e-5)
        for name, grad in off[2].items():
            assert grad.abs().sum() > 0, name
            torch.testing.assert_close(on[2][name], grad, rtol=1e-4, atol=1e-6, msg=f"rank {rank} grad {name}")
