"""Post-training on two gloo ranks (one spawned group for both checks):

- DPO, KTO and reward models under DeepSpeed ZeRO stage 3 (data-parallel size 2): the same losses and metrics,
  step after step, as data-parallel training without ZeRO (the reference model is filled from the partitioned
  policy by gathering its weights), and a run resumed from a ZeRO-3 checkpoint (with the reference saved beside it)
  continues with the losses of the uninterrupted run;
- reference log-probabilities precomputed under a 2-stage pipeline (text_gen_type 'precompute') equal those of
  one stage."""

import math
import os
from types import SimpleNamespace

import numpy as np
import torch

from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.model.gpt2_model import build_model
from megatron.mpu import SingleProcessState
from megatron.post_training.dpo import DPOLoss
from megatron.post_training.kto import KTOLoss
from megatron.post_training.reference import ReferenceModel
from megatron.model.reward_model import RewardLoss
from megatron.post_training.precompute import precompute_reference_logps
from megatron.post_training.reference import start_reference
from tests.data.dataset_factory import write_dataset
from tests.distributed_helpers import run_distributed
from tests.model.helpers import random_batch, tiny_config
from tests.neox_arguments.helpers import tiny
from tests.parity import assert_parity

STEPS, SAVE_AT, ROWS = 4, 2, 4
REWARDS = torch.tensor([1, -1, -1, 1])  # KTO: desirable / undesirable completion of each row
IMPLS = ("dpo", "kto", "rm")
ZERO3_RTOL = 1e-5
"""ZeRO-3 against the data-parallel computation by hand, fp32: losses measured at most 2.9e-6 relative (DPO, rank 1)."""
ZERO3_METRIC_RTOL, ZERO3_METRIC_ATOL = 2e-4, 1e-5
"""The logged metrics (rewards, margins, KL), measured at most 2.8e-5 relative, then 8.5e-5 (6.8e-5 absolute) once
the reward model's loss gained its z-loss term (another order of the same sums), on the reward model's raw rewards,
~0.8, at steps 3-4; 3e-6 absolute on KTO's KL, near 0: the losses agree to 3e-6, but Adam's update m / sqrt(v) is about
lr for a parameter whose gradient is tiny, so a sum-order difference in such a gradient moves the weight by a
fraction of lr, and the value head's raw outputs with it (the loss, a function of the margin, barely moves)."""


def _loss_function(impl: str):
    return {"dpo": lambda: DPOLoss(0.5, False, True), "kto": lambda: KTOLoss(0.5, 1.0, 0.7, True),
            "rm": RewardLoss}[impl]()


def _batch(rank: int, step: int):
    """This rank's micro-batch of `step`: 2 pairs (rows 0-1 chosen, 2-3 rejected), the first tokens a prompt."""
    inputs, (labels, loss_mask) = random_batch(batch=ROWS, seed=100 * rank + step)
    loss_mask = loss_mask.clone()
    loss_mask[:, :4] = 0
    return inputs, (labels, loss_mask)


def _model(impl: str, state, seed: int = 0):
    """(tiny model with the loss of `impl`, its reference model or None); weights from `seed`."""
    from megatron.model.gpt2_model import build_model

    config = tiny_config(hidden_dropout=0.0, attention_dropout=0.0, train_impl="rm" if impl == "rm" else "normal")
    torch.manual_seed(seed)
    model = build_model(config, state)
    model.loss_fn = _loss_function(impl)
    return model, (None if impl == "rm" else ReferenceModel(config, state))


def _labels(impl: str, reference, inputs, labels):
    """The labels tuple as megatron.training.loop builds it: KTO's rewards, then the reference log-probabilities."""
    if impl == "kto":
        labels = labels + (REWARDS,)
    if reference is not None:
        labels = labels + (reference.logps(inputs, labels[0], labels[1]),)
    return labels


def data_parallel_by_hand(impl: str):
    """(losses, metrics) of each of the 2 ranks without ZeRO, in one process: the gradient of the mean of the
    ranks' losses, clipped to norm 1, then AdamW (what DeepSpeed's data parallelism does)."""
    from megatron.mpu import SingleProcessState

    model, reference = _model(impl, SingleProcessState())
    if reference is not None:
        start_reference(reference, model, None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    runs = [([], []), ([], [])]
    for step in range(STEPS):
        optimizer.zero_grad()
        total = 0
        for rank, (losses, metrics) in enumerate(runs):
            inputs, labels = _batch(rank, step)
            loss = model.loss_fn(model(inputs, defer_logits=True),  # as training does (megatron.training.step.loss_of)
                                 _labels(impl, reference, inputs, labels))
            total = total + loss / 2
            losses.append(loss.item())
            metrics.append(model.loss_fn.take_metrics())
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    return runs


def _engine(impl: str, state, seed: int = 0):
    """(ZeRO-3 engine, reference model or None) of a fresh tiny model."""
    import deepspeed

    model, reference = _model(impl, state, seed)
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), mpu=state, dist_init_required=False,
        config={"train_batch_size": 2 * ROWS, "train_micro_batch_size_per_gpu": ROWS, "gradient_clipping": 1.0,
                "steps_per_print": 10 ** 6, "zero_optimization": {"stage": 3}})
    return engine, reference


def _train(impl: str, engine, reference, rank: int, steps):
    losses, metrics = [], []
    for step in steps:
        inputs, labels = _batch(rank, step)
        loss = engine.module.loss_fn(engine(inputs), _labels(impl, reference, inputs, labels))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        metrics.append(engine.module.loss_fn.take_metrics())
    return losses, metrics


def _two_rank_checks(rank: int, world_size: int, directory: str, precompute_args):
    """({impl: {"zero3": (losses, metrics), "resumed": (losses, metrics) from SAVE_AT on}} on this rank, the files
    the 2-stage pipeline precomputed)."""
    from megatron.mpu.deepspeed_comm import init_deepspeed_comm
    from megatron.utils.lazy_compile import DEEPSPEED_MUON, import_with_lazy_compile
    from megatron.mpu import ParallelState

    import_with_lazy_compile(DEEPSPEED_MUON)  # as megatron.training.loop does: ZeRO's optimizer check imports it
    init_deepspeed_comm("gloo", dist_init_required=False)
    state = ParallelState(pipe_parallel_size=0, model_parallel_size=1)
    results = {}
    for impl in IMPLS:
        engine, reference = _engine(impl, state)
        if reference is not None:  # gathered from the partitioned policy
            assert all(p.numel() == 0 for p in engine.module.parameters())
            assert start_reference(reference, engine.module, None).startswith("the policy's weights")
        first = _train(impl, engine, reference, rank, range(SAVE_AT))
        engine.save_checkpoint(directory, tag=impl)
        if reference is not None:
            reference.save(os.path.join(directory, impl))
        later = _train(impl, engine, reference, rank, range(SAVE_AT, STEPS))
        results[impl] = {"zero3": (first[0] + later[0], first[1] + later[1])}
        engine, reference = _engine(impl, state, seed=1)  # other initial weights: the checkpoint's must win
        engine.load_checkpoint(directory, tag=impl)
        if reference is not None:
            assert start_reference(reference, engine.module, os.path.join(directory, impl)).startswith(
                "the reference weights saved")
        results[impl]["resumed"] = _train(impl, engine, reference, rank, range(SAVE_AT, STEPS))
    state.destroy()
    return results, _pipeline_precompute(precompute_args)


SEQ = 16


def _precompute_config(pipe_parallel_size: int):
    """The precompute model: a 2-layer tiny one, its weights from ModelConfig's seed (the same for any split)."""
    return tiny_config(max_position_embeddings=SEQ, seq_length=SEQ, pipe_parallel_size=pipe_parallel_size)


def _pipeline_precompute(args):
    """generate.py's precompute with pipe_parallel_size 2: the model in a PipelineEngine as setup_for_inference
    builds it."""
    import deepspeed

    from megatron.inference.loading import PIPELINE_SCHEDULE_CONFIG
    from megatron.mpu import ParallelState

    state = ParallelState(pipe_parallel_size=2, model_parallel_size=1)
    config = _precompute_config(2)
    model = build_model(config, state).eval()
    engine, _, _, _ = deepspeed.initialize(model=model, config=dict(PIPELINE_SCHEDULE_CONFIG), dist_init_required=False)
    engine.eval()
    written = precompute_reference_logps(args, engine, SimpleNamespace(parallel_state=state, device="cpu",
                                                                       model_config=config))
    state.destroy()
    return written


def test_zero3_training_and_pipeline_precompute(tmp_path) -> None:
    rng = np.random.RandomState(0)  # pairwise data: 10 pairs, some longer than seq_length + 1 (cut)
    pos, neg = (write_dataset(tmp_path / name, [rng.randint(0, 128, rng.randint(5, SEQ + 6)) for _ in range(10)])
                for name in ("pos", "neg"))
    data = dict(dataset_impl="pairwise", train_impl="dpo", pack_impl="unpacked", seq_length=SEQ, train_iters=3,
                train_batch_size=4, train_micro_batch_size_per_gpu=4, pos_train_data_paths=[pos],
                neg_train_data_paths=[neg], text_gen_type="precompute")
    one_stage = precompute_reference_logps(tiny(**data, precompute_model_name="pp1"),
                                           build_model(_precompute_config(0), SingleProcessState()),
                                           SimpleNamespace(parallel_state=SingleProcessState(), device="cpu"))
    two_stages = tiny(**data, precompute_model_name="pp2", pipe_parallel_size=2, num_gpus=2)
    expected = {impl: data_parallel_by_hand(impl) for impl in IMPLS}
    outputs = run_distributed(_two_rank_checks, world_size=2, args=(str(tmp_path), two_stages))
    results = [out[0] for out in outputs]
    assert outputs[0][1] == [f"{pos}_pp2", f"{neg}_pp2"]
    for want, got in zip(one_stage, outputs[0][1]):
        want, got = MMapIndexedDataset(want), MMapIndexedDataset(got)
        assert np.array_equal(want.sizes, got.sizes) and want.sizes.max() == SEQ + 1
        for i in range(len(want)):
            np.testing.assert_allclose(got[i], want[i], rtol=0, atol=1e-5)
        assert np.all(want[0][1:] < 0)
    for rank, result in enumerate(results):
        for impl in IMPLS:
            plain, plain_metrics = expected[impl][rank]
            zero3, zero3_metrics = result[impl]["zero3"]
            assert plain[0] != plain[-1], impl  # it trains
            assert_parity(zero3, plain, rtol=ZERO3_RTOL, what=f"{impl} ZeRO-3 losses, rank {rank}")
            for got, want in zip(zero3_metrics, plain_metrics):
                assert set(got) == set(want) and got, (impl, got)
                names = sorted(want)
                assert_parity([got[n] for n in names], [want[n] for n in names], rtol=ZERO3_METRIC_RTOL,
                              atol=ZERO3_METRIC_ATOL, what=f"{impl} ZeRO-3 metrics {names}, rank {rank}")
            if impl == "dpo":  # the gathered reference equals the policy at the first step
                assert math.isclose(zero3[0], math.log(2), abs_tol=1e-6)
                assert zero3_metrics[0]["reward_margin"] == 0.0
            resumed, _ = result[impl]["resumed"]
            assert resumed == zero3[SAVE_AT:], (impl, rank, resumed, zero3)
