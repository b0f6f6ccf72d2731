"""A checkpoint saved by a TP=2 x PP=2 run continues under other parallel layouts (TP=1 x PP=1 and TP=1 x PP=2 x
DP=2, ZeRO 0-3, other numbers of data-parallel ranks; in fp32 and bf16) with the losses of the uninterrupted
TP=2 x PP=2 run: weights, Adam's moments and step, the LR schedule and the iteration are resharded
(megatron.checkpoint.resharding); GPT-NeoX's form of the checkpoint loads its weights into another split.

One group of four gloo ranks runs megatron.training.setup's own setup_model_and_optimizer, train_step, save_checkpoint
and load_checkpoint on a tiny model: the reference run trains 5 steps and saves after step 2, then each target
layout loads that checkpoint and trains steps 3 to 5 on the same global batches. Step 3's loss is taken before
its update, so it checks the weights; steps 4 and 5 check the optimizer state too (without it, step 4 differs).
The same group does it for mixtures of experts (GPT-NeoX's dMoE and DeepSpeed's layer, at micro-batches of one
sample in every layout: the load-balancing loss is per micro-batch)."""
import fnmatch
import glob
from types import SimpleNamespace

import pytest

from tests.checkpoint.weights_only import assert_loads_weights_only
from tests.checkpoint.counts import Counts, manifest_files
from tests.distributed_helpers import run_distributed
from tests.model.helpers import random_batch

STEPS, SAVED_AT, GLOBAL_BATCH, VOCAB = 5, 2, 4, 128
SOURCE = dict(model_parallel_size=2, pipe_parallel_size=2, zero_stage=0)
TARGETS = {
    "tp1_pp1_dp4_zero0": dict(model_parallel_size=1, pipe_parallel_size=1, zero_stage=0),
    "tp1_pp2_dp2_zero1": dict(model_parallel_size=1, pipe_parallel_size=2, zero_stage=1),
    "tp1_pp0_dp4_zero2": dict(model_parallel_size=1, pipe_parallel_size=0, zero_stage=2),
    "tp1_pp0_dp4_zero3": dict(model_parallel_size=1, pipe_parallel_size=0, zero_stage=3),
}
CHAINED = {
    "tp1_pp0_dp4_zero2": (dict(model_parallel_size=2, pipe_parallel_size=1, zero_stage=0), "TP2 x PP1 x DP2"),
    "tp1_pp0_dp4_zero3": (dict(model_parallel_size=1, pipe_parallel_size=2, zero_stage=1), "TP1 x PP2 x DP2 ZeRO-1"),
}
"""These targets save after step 3 (their ZeRO files: partitions of four data-parallel ranks), and steps 4 and 5
go on from there in another layout: reading ZeRO 2's and ZeRO 3's files (step 5 checks their optimizer state)."""
BF16 = {"bf16": {"enabled": True}}
SOURCE_BF16 = {**SOURCE, **BF16}
"""In bf16 the pipeline engine keeps fp32 master weights and Adam's state in DeepSpeed's bf16 optimizer."""
TARGETS_BF16 = {
    "bf16_tp1_pp2_dp2_zero0": dict(model_parallel_size=1, pipe_parallel_size=2, zero_stage=0, **BF16),
    "bf16_tp1_pp0_dp4_zero1": dict(model_parallel_size=1, pipe_parallel_size=0, zero_stage=1, **BF16),
}
CLOSE_BF16 = 5e-4
"""bf16 sums in other orders round otherwise: measured within 1.5e-4 over steps 3-5."""
WEIGHTS_ONLY = dict(model_parallel_size=2, pipe_parallel_size=1, zero_stage=1, no_load_optim=True)
"""The checkpoint as GPT-NeoX writes it, resharded without its optimizer state: step 3's loss (before its update)
is the reference's, step 4's is not."""
DS = dict(moe_num_experts=4, moe_top_k=1, moe_expert_interval=1, moe_type="deepspeed", create_moe_param_group=True)
"""DeepSpeed's layer (top-1, residual MoE on, nothing dropped) at EP 1: experts and residual MLP whole on every
tensor-parallel rank, the experts in DeepSpeed's per-expert files, ZeRO partitioning DeepSpeed's expert groups."""
DS_SOURCE = dict(model_parallel_size=2, pipe_parallel_size=0, zero_stage=1, **DS)
DS_TARGETS = {
    "ds_tp1_pp0_dp4_zero0": dict(model_parallel_size=1, pipe_parallel_size=0, zero_stage=0, **DS),
}
DS_SPLIT = dict(DS, enable_expert_tensor_parallelism=True)
"""Each expert split column / row over the tensor ranks (its shards in each rank's expert files); an architecture
key, so it reshards to another data-parallel / ZeRO layout at TP=2 (at TP=4 the tiny experts do not split)."""
DS_SPLIT_SOURCE = dict(model_parallel_size=2, pipe_parallel_size=0, zero_stage=1, **DS_SPLIT)
DS_SPLIT_TARGET = dict(model_parallel_size=2, pipe_parallel_size=0, zero_stage=2, **DS_SPLIT)
CLOSE = 1e-5
MOE = dict(moe_num_experts=4, moe_top_k=2, moe_expert_interval=1, create_moe_param_group=True)
"""GPT-NeoX's dMoE (the dropless layer, moe_type megablocks, at moe_expert_parallel_size 1) in both layers: four
gated experts stacked in the model files, two per tensor-parallel rank at TP=2, in an optimizer group of their own;
the load-balancing loss is part of the loss."""
MOE_SOURCE = {**SOURCE, **MOE}
MOE_TARGETS = {
    "moe_tp1_pp0_dp4_zero2": dict(model_parallel_size=1, pipe_parallel_size=0, zero_stage=2, **MOE),
    "moe_tp1_pp2_dp2_zero1": dict(model_parallel_size=1, pipe_parallel_size=2, zero_stage=1, **MOE),
}
MOE_CHAINED = dict(model_parallel_size=2, pipe_parallel_size=1, zero_stage=0, **MOE)
"""From moe_tp1_pp0_dp4_zero2's checkpoint after step 3 (ZeRO 2's partitions of four data-parallel ranks): the
experts split again over two tensor-parallel ranks."""
MOE_WEIGHTS_ONLY = dict(model_parallel_size=1, pipe_parallel_size=1, zero_stage=0, no_load_optim=True, **MOE)
"""The MoE checkpoint's weights alone: step 3 is the reference's, steps 4-5 are not (the optimizer state matters)."""
"""The layouts add the same numbers in other orders (fp32): measured within 5e-7 of each other over these steps."""


def _args(world: int, layout: dict, save: str, load=None):
    from megatron.neox_arguments import NeoXArgs

    layout = dict(layout)
    zero = layout.pop("zero_stage")
    dp = world // (layout["model_parallel_size"] * max(layout["pipe_parallel_size"], 1))
    # the load-balancing loss is a product of per-micro-batch averages: an MoE layout keeps micro-batches of one
    micro = 1 if layout.get("moe_num_experts") else min(2, GLOBAL_BATCH // dp)
    return NeoXArgs.from_dict({
        "num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "num_kv_heads": 2, "activation": "swiglu",
        "seq_length": 16,
        "max_position_embeddings": 16, "pos_emb": "rotary", "no_weight_tying": False,
        "make_vocab_size_divisible_by": 64, "hidden_dropout": 0.0, "attention_dropout": 0.0,
        "optimizer": {"type": "Adam", "params": {"lr": 1.0e-2, "betas": [0.9, 0.95], "eps": 1.0e-8}},
        "weight_decay": 0.01, "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": GLOBAL_BATCH // (micro * dp), "gradient_clipping": 1.0,
        "zero_optimization": {"stage": zero}, "num_gpus": world, "train_iters": STEPS, "lr_decay_style": "cosine",
        "warmup": 0.25, "seed": 1234, "distributed_backend": "gloo", "save": save, "load": load, **layout})


def _micro_batches(args, dp_rank: int, dp: int, first_step: int):
    """This data-parallel rank's micro-batches of the global batches of steps first_step.. (each step's four
    samples are the same whatever the layout; the ranks share them out in micro-batches of equal size)."""
    micro = args.train_micro_batch_size_per_gpu
    for step in range(first_step, STEPS + 1):
        (tokens, pos, mask), (labels, loss_mask) = random_batch(batch=GLOBAL_BATCH, seq=16, vocab=VOCAB, seed=step)
        for k in range(args.gradient_accumulation_steps):
            rows = slice((k * dp + dp_rank) * micro, (k * dp + dp_rank + 1) * micro)
            yield (tokens[rows], pos[rows], mask), (labels[rows], loss_mask[rows])


def _run(world: int, layout: dict, save: str, load, first_step: int, save_at=None, counts=None):
    """Losses of steps first_step..STEPS (and the iteration the run starts from). With ``counts`` (tests.checkpoint.counts) also
    the ModelConfigs built by validation and by initialize_megatron, and the checkpoint files this rank hashed to
    start and load, with the number of files the checkpoint's manifest lists."""
    from megatron.checkpoint.engine import load_checkpoint, restore_rng, save_checkpoint
    from megatron.checkpoint.format import resume_tag
    from megatron.initialize import initialize_megatron
    from megatron.training.step import train_step
    from megatron.training.setup import setup_model_and_optimizer
    from megatron.training_schedule import TrainingSchedule

    counted = {}
    before = (counts.configs, counts.hashed, counts.kinds) if counts else None
    args = _args(world, layout, save, load)
    validated = counts.configs if counts else None
    ctx = initialize_megatron(args, build_tokenizer_fn=lambda _: SimpleNamespace(vocab_size=VOCAB, eod=0))
    if counts:
        counted["model_configs"] = (validated - before[0], counts.configs - validated)
    engine, optimizer, _ = setup_model_and_optimizer(args, ctx, TrainingSchedule.from_neox_args(args))
    iteration, client, loaded = load_checkpoint(args, ctx.model_config, engine, ctx.checkpoint)
    restore_rng(args, loaded, client)
    if counts:
        counted["hashed"] = counts.hashed - before[1]
        counted["kinds"] = counts.kinds - before[2]
        counted["manifest_files"] = manifest_files(f"{load}/{resume_tag(load)[0]}")
    engine_steps = engine.global_steps
    ps = ctx.parallel_state
    batches = _micro_batches(args, ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(), first_step)
    losses = []
    for step in range(first_step, STEPS + 1):
        losses.append(train_step(args, engine, batches, ctx, optimizer)[0])
        if step == save_at:
            save_checkpoint(args, ctx.model_config, step, engine, {"consumed_train_samples": step * GLOBAL_BATCH})
    ps.destroy()
    return {"losses": losses, "iteration": iteration, "consumed": client.get("consumed_train_samples"),
            "engine_steps": engine_steps, **counted}


def _as_gpt_neox(save: str) -> str:
    """The saved checkpoint as GPT-NeoX writes it: no neox_args.json, COMPLETE or manifest, no layout entries."""
    import os
    import shutil

    import torch

    neox = save + "-gpt-neox"
    tag = f"global_step{SAVED_AT}"
    shutil.copytree(os.path.join(save, tag), os.path.join(neox, tag))
    for name in os.listdir(os.path.join(neox, tag)):
        path = os.path.join(neox, tag, name)
        if name in ("neox_args.json", "COMPLETE", "checksums.xxh128") or name.startswith("rng_state_rank"):
            os.remove(path)
        elif name.startswith("mp_rank_"):
            state = torch.load(path, weights_only=False)
            torch.save({k: v for k, v in state.items() if k not in ("checkpoint_layout", "optimizer_layout")}, path)
    with open(os.path.join(neox, "latest"), "w") as handle:
        handle.write(tag)
    return neox


def _deepspeed_layouts(world_size: int, save: str) -> dict:
    results = {"ds_reference": _run(world_size, DS_SOURCE, save, None, 1, save_at=SAVED_AT)}
    for name, layout in DS_TARGETS.items():
        results[name] = _run(world_size, layout, save + "-" + name, save, SAVED_AT + 1)
    results["ds_split_reference"] = _run(world_size, DS_SPLIT_SOURCE, save + "-split", None, 1, save_at=SAVED_AT)
    results["ds_split_zero2"] = _run(world_size, DS_SPLIT_TARGET, save + "-split-zero2", save + "-split", SAVED_AT + 1)
    return results


def _all_layouts(rank: int, world_size: int, save: str) -> dict:
    import torch.distributed as dist

    counts = Counts()
    results = {"reference": _run(world_size, SOURCE, save, None, 1, save_at=SAVED_AT)}
    for name, layout in TARGETS.items():
        results[name] = _run(world_size, layout, save + "-" + name, save, SAVED_AT + 1,
                             save_at=SAVED_AT + 1 if name in CHAINED else None, counts=counts)
    for name, (layout, _) in CHAINED.items():  # the ZeRO 2 / 3 checkpoints of four data-parallel ranks, resharded
        results[f"from_{name}"] = _run(world_size, layout, save + "-from-" + name, save + "-" + name, SAVED_AT + 2)
    if rank == 0:
        _as_gpt_neox(save)
    dist.barrier()
    results["gpt_neox_weights"] = _run(world_size, WEIGHTS_ONLY, save + "-from-neox", save + "-gpt-neox", SAVED_AT + 1)
    results.update(_moe_layouts(world_size, save + "-moe", counts))
    results.update(_deepspeed_layouts(world_size, save + "-ds"))
    results["reference_bf16"] = _run(world_size, SOURCE_BF16, save + "-bf16", None, 1, save_at=SAVED_AT)
    for name, layout in TARGETS_BF16.items():
        results[name] = _run(world_size, layout, save + "-" + name, save + "-bf16", SAVED_AT + 1)
    return results


def _moe_layouts(world_size: int, save: str, counts) -> dict:
    results = {"moe_reference": _run(world_size, MOE_SOURCE, save, None, 1, save_at=SAVED_AT)}
    for name, layout in MOE_TARGETS.items():
        results[name] = _run(world_size, layout, save + "-" + name, save, SAVED_AT + 1,
                             save_at=SAVED_AT + 1 if name == "moe_tp1_pp0_dp4_zero2" else None)
    results["moe_from_zero2"] = _run(world_size, MOE_CHAINED, save + "-chained", save + "-moe_tp1_pp0_dp4_zero2",
                                     SAVED_AT + 2)
    results["moe_weights_only"] = _run(world_size, MOE_WEIGHTS_ONLY, save + "-weights", save, SAVED_AT + 1,
                                       counts=counts)
    return results


@pytest.fixture(scope="module")
def save_root(tmp_path_factory) -> str:
    """The prefix of every save directory of ``runs`` (save, save-tp1_pp1_dp4_zero0, save-moe, ...)."""
    return str(tmp_path_factory.mktemp("reshard") / "save")


@pytest.fixture(scope="module")
def runs(save_root):
    return run_distributed(_all_layouts, world_size=4, args=(save_root,), timeout_s=600)


def test_every_file_of_every_layout_saved_loads_with_weights_only(runs, save_root):
    """The model-state, pipeline layer, expert and RNG files of every checkpoint the runs saved (TP=2 x PP=2, ZeRO
    0-3, bf16, GPT-NeoX's dMoE and DeepSpeed's MoE layer) load with torch.load(weights_only=True) and no allowed
    globals, the non-pipeline mp_rank files also with a plain torch.load as GPT-NeoX's converter reads them."""
    checked = [name for path in sorted(glob.glob(save_root + "*/global_step*"))
               for name in assert_loads_weights_only(path)]
    kinds = {"pipeline layer": "layer_*-model_*-model_states.pt", "ZeRO-3 model": "zero_pp_rank_*_model_states.pt",
             "expert": "layer_*_expert_*_model_states.pt", "mp_rank": "mp_rank_*_model_states.pt",
             "rng": "rng_state_rank*.pt"}
    missing = [kind for kind, pattern in kinds.items() if not fnmatch.filter(checked, pattern)]
    assert not missing, f"no {missing} file among the checkpoints saved: {sorted(set(checked))}"


@pytest.mark.parametrize("target", TARGETS)
def test_a_tp2_pp2_checkpoint_continues_in_another_layout_with_the_same_losses(runs, target):
    for rank, results in enumerate(runs):
        reference, resumed = results["reference"], results[target]
        assert resumed["iteration"] == resumed["engine_steps"] == SAVED_AT, rank
        assert resumed["consumed"] == SAVED_AT * GLOBAL_BATCH, rank
        assert resumed["losses"] == pytest.approx(reference["losses"][SAVED_AT:], abs=CLOSE), rank


@pytest.mark.parametrize("source", CHAINED)
def test_a_zero_2_or_3_checkpoint_of_four_data_parallel_ranks_continues_in_another_layout(runs, source):
    for rank, results in enumerate(runs):
        resumed = results[f"from_{source}"]
        assert resumed["iteration"] == resumed["engine_steps"] == SAVED_AT + 1, rank
        assert resumed["consumed"] == (SAVED_AT + 1) * GLOBAL_BATCH, rank
        assert resumed["losses"] == pytest.approx(results["reference"]["losses"][SAVED_AT + 1:], abs=CLOSE), rank


@pytest.mark.parametrize("target", TARGETS_BF16)
def test_a_bf16_checkpoint_continues_in_another_layout_with_the_same_losses(runs, target):
    for rank, results in enumerate(runs):
        reference, resumed = results["reference_bf16"], results[target]
        assert resumed["iteration"] == SAVED_AT, rank
        assert resumed["losses"] == pytest.approx(reference["losses"][SAVED_AT:], abs=CLOSE_BF16), rank


def test_a_gpt_neox_checkpoint_loads_its_weights_into_another_split_and_the_optimizer_state_matters(runs):
    """The checkpoint as GPT-NeoX writes it (no neox_args.json, no layout records), TP2 x PP2 into TP2 x PP1 x DP2
    with no_load_optim: step 3 (before its update) has the reference's loss, steps 4-5 others (measured 8.6e-4 and
    4.3e-3 off), by more than the bounds above, which is what makes those tests able to fail."""
    for results in runs:
        reference, resumed = results["reference"]["losses"], results["gpt_neox_weights"]["losses"]
        assert results["gpt_neox_weights"]["iteration"] == results["gpt_neox_weights"]["engine_steps"] == SAVED_AT
        assert resumed[0] == pytest.approx(reference[SAVED_AT], abs=CLOSE)
        assert max(abs(a - b) for a, b in zip(resumed[1:], reference[SAVED_AT + 1:])) > 5 * CLOSE_BF16


@pytest.mark.parametrize("target", MOE_TARGETS)
def test_a_dropless_moe_checkpoint_continues_in_another_layout_with_the_same_losses(runs, target):
    """GPT-NeoX's dMoE at TP=2 x PP=2 (two experts per tensor rank, ZeRO 0) continues without tensor parallelism,
    without a pipeline under ZeRO 2 and in a pipeline under ZeRO 1 (measured within 5e-7 of the reference)."""
    for rank, results in enumerate(runs):
        reference, resumed = results["moe_reference"], results[target]
        assert resumed["iteration"] == resumed["engine_steps"] == SAVED_AT, rank
        assert resumed["consumed"] == SAVED_AT * GLOBAL_BATCH, rank
        assert resumed["losses"] == pytest.approx(reference["losses"][SAVED_AT:], abs=CLOSE), rank


def test_a_dropless_moe_zero_2_checkpoint_splits_its_experts_over_tensor_ranks_again(runs):
    """moe_tp1_pp0_dp4_zero2's step-3 checkpoint (the experts whole, ZeRO 2's partitions of four ranks) continues at
    TP=2 x PP=1 x DP=2 without ZeRO; and the MoE checkpoint's weights without its optimizer state give the
    reference's step 3 (before its update) but not steps 4-5 (measured 1.0e-3 and 1.6e-2 off): the optimizer state
    of the router and the experts is what the tests above check."""
    for rank, results in enumerate(runs):
        reference, chained = results["moe_reference"]["losses"], results["moe_from_zero2"]
        assert chained["iteration"] == chained["engine_steps"] == SAVED_AT + 1, rank
        assert chained["losses"] == pytest.approx(reference[SAVED_AT + 1:], abs=CLOSE), rank
        weights_only = results["moe_weights_only"]["losses"]
        assert weights_only[0] == pytest.approx(reference[SAVED_AT], abs=CLOSE), rank
        assert max(abs(a - b) for a, b in zip(weights_only[1:], reference[SAVED_AT + 1:])) > 5 * CLOSE_BF16, rank


@pytest.mark.parametrize("reference,target", [("ds_reference", name) for name in DS_TARGETS]
                         + [("ds_split_reference", "ds_split_zero2")])
def test_a_checkpoint_of_deepspeeds_moe_layer_continues_in_another_layout_with_the_same_losses(runs, reference,
                                                                                               target):
    """DeepSpeed's layer at TP=2 x DP=2 under ZeRO 1 continues at TP=1 x DP=4 without ZeRO, and with
    enable_expert_tensor_parallelism under ZeRO 2 (measured equal to the last bit); its residual MLP is whole on
    each tensor rank (before, merging it as a split MLP doubled it)."""
    for rank, results in enumerate(runs):
        expected, resumed = results[reference]["losses"][SAVED_AT:], results[target]
        assert resumed["iteration"] == resumed["engine_steps"] == SAVED_AT, rank
        assert resumed["losses"] == pytest.approx(expected, abs=CLOSE), rank


def test_a_resume_builds_one_model_config_per_step_and_finds_and_hashes_the_checkpoint_once(runs):
    """Each worker builds the ModelConfig once to validate its arguments and once in initialize_megatron (with the
    tokenizer's padded vocabulary); a resume finds and verifies its checkpoint once: rank 0 hashes each file of the
    manifest once and every rank trusts its verdict, also where resharding reads the whole checkpoint (with the
    optimizer state, and the weights alone), and which kind of checkpoint it is is worked out once. Before,
    validation and initialize_megatron built two each, every rank hashed the checkpoint again in read_checkpoint,
    and a reshard worked out its kind twice."""
    for rank, results in enumerate(runs):
        for name in (*TARGETS, "moe_weights_only"):
            run = results[name]
            assert run["model_configs"] == (1, 1), (rank, name)
            assert run["manifest_files"] > 0, name
            assert run["hashed"] == (run["manifest_files"] if rank == 0 else 0), (rank, name)
            assert run["kinds"] == 1, (rank, name, run["kinds"])


def test_which_layout_changes_need_resharding():
    from megatron.checkpoint.resharding import needs_resharding

    base = dict(model_parallel_size=2, pipe_parallel_size=2, data_parallel_size=1, zero_stage=0)
    assert not needs_resharding(base, dict(base))
    assert not needs_resharding(base, {**base, "data_parallel_size": 2})  # the engine loads whole optimizer states
    for change in ({"model_parallel_size": 1}, {"pipe_parallel_size": 0}, {"zero_stage": 1}):
        assert needs_resharding(base, {**base, **change}), change
    zero = {**base, "zero_stage": 2}
    assert needs_resharding(zero, {**zero, "data_parallel_size": 2})
    # context parallelism splits no weights, but ZeRO partitions over data x context ranks
    assert not needs_resharding(base, {**base, "context_parallel_size": 2})
    assert needs_resharding(zero, {**zero, "context_parallel_size": 2})
    assert needs_resharding({**zero, "context_parallel_size": 2}, {**zero, "data_parallel_size": 2})
    # the weights alone (no_load_optim): the engine reads them from the model files unless the split or ZeRO-3's
    # partitioned weights differ
    assert not needs_resharding(zero, {**base, "data_parallel_size": 2}, optimizer_state=False)
    assert needs_resharding(zero, {**zero, "model_parallel_size": 1}, optimizer_state=False)
    assert needs_resharding(zero, {**zero, "zero_stage": 3}, optimizer_state=False)


def test_expert_parallelism_and_deepspeeds_layer_in_a_pipeline_are_refused_naming_what_reshards(tmp_path):
    """Expert parallelism and DeepSpeed's layer in a pipeline are refused, in the checkpoint or in the run; the
    dropless layer, and DeepSpeed's without a pipeline, at EP 1 pass."""
    from megatron.checkpoint.resharding import load_resharded, moe_problem
    from megatron.errors import CheckpointError
    from megatron.model.config import ModelConfig
    from tests.neox_arguments.helpers import tiny

    run = ModelConfig.from_neox_args(tiny(moe_num_experts=2, pipe_parallel_size=0), padded_vocab_size=128)
    saved = dict(model_parallel_size=2, pipe_parallel_size=2, data_parallel_size=1, zero_stage=0, moe_num_experts=2,
                 moe_type="megablocks", moe_expert_parallel_size=1)
    assert moe_problem(str(tmp_path), saved, run) == ""
    assert moe_problem(str(tmp_path), {**saved, "pipe_parallel_size": 0, "moe_type": "deepspeed"},
                       run.replace(moe_type="deepspeed")) == ""
    for change, what in (({"moe_type": "deepspeed"}, "moe_type deepspeed, pipe_parallel_size 2"),
                         ({"moe_expert_parallel_size": 2}, "moe_type megablocks, moe_expert_parallel_size 2")):
        with pytest.raises(CheckpointError, match=rf"TP=2 PP=2 DP=1 ZeRO-0\), and resharding the mixture of experts "
                                                  rf"of the checkpoint's \({what}\) is not supported yet.*"
                                                  rf"dropless layer \(moe_type megablocks\) at "
                                                  rf"moe_expert_parallel_size 1 in any layout"):
            load_resharded(str(tmp_path), {**saved, **change}, run, engine=None, load_optim=True)
    in_pipeline = run.replace(moe_type="deepspeed", pipe_parallel_size=1)
    assert "this run's (moe_type deepspeed, pipe_parallel_size 1)" in moe_problem(str(tmp_path), saved, in_pipeline)


def test_dpo_refuses_another_tensor_parallel_size_for_its_reference_model(tmp_path):
    import torch

    from megatron.checkpoint.resharding import reference_problem

    saved = dict(model_parallel_size=2, pipe_parallel_size=2, data_parallel_size=1, zero_stage=0)
    other_tp, other_pp = {**saved, "model_parallel_size": 1}, {**saved, "pipe_parallel_size": 1}
    assert reference_problem(str(tmp_path), saved, other_tp, "dpo") == ""  # no reference files: not a DPO checkpoint
    torch.save({}, tmp_path / "dpo_reference_mp_rank_00.pt")
    assert "resume with model_parallel_size=2" in reference_problem(str(tmp_path), saved, other_tp, "kto")
    assert reference_problem(str(tmp_path), saved, other_pp, "dpo") == ""
    assert reference_problem(str(tmp_path), saved, other_tp, "normal") == ""
