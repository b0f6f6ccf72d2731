"""log_grad_norm, log_grad_pct_zeros, log_optimizer_states (and log_param_norm) under DeepSpeed's pipeline engine
log what the same model logs without a pipeline: the same per-parameter values under the sequential model's
names, and totals over every stage (tied and tensor-parallel-replicated parameters counted once), on every rank.

Both sides run megatron.training.setup's own setup_model_and_optimizer and train_step on the same micro-batches: the
reference on one rank without a pipeline, the pipeline with pp=2, pp=1 x tp=2 and pp=1 x dp=2 on two gloo ranks, in fp32
and bf16 with ZeRO 0 and 1. Clipping at 1.0 acts on these gradients (their norm is above 1 at first), so values
taken after clipping would not match."""
from types import SimpleNamespace

import pytest

from tests.distributed_helpers import run_distributed
from tests.model.helpers import random_batch

STEPS, MICRO, GAS, VOCAB = 3, 2, 2, 128
FLAGS = dict(log_grad_norm=True, log_grad_pct_zeros=True, log_optimizer_states=True, log_param_norm=True)
PRECISIONS = {"fp32": {}, "bf16": {"bf16": {"enabled": True}}}
# pp1_dp2: both data-parallel ranks read the same micro-batches, so their mean gradient is the reference's; ZeRO-1
# splits the gradients and optimizer states between them.
LAYOUTS = {"pp2": dict(pipe_parallel_size=2, model_parallel_size=1),
           "pp1_tp2": dict(pipe_parallel_size=1, model_parallel_size=2),
           "pp1_dp2": dict(pipe_parallel_size=1, model_parallel_size=1)}
CASES = [(precision, zero) for precision in PRECISIONS for zero in (0, 1)]
# The run without a pipeline each pipeline case is compared with. In bf16 DeepSpeed's pipeline engine keeps fp32
# master weights and optimizer states (BF16_Optimizer) at ZeRO 0 as at ZeRO 1; without a pipeline its ZeRO-0 bf16
# optimizer is another one (FP16_UnfusedOptimizer: other update numerics, optimizer states not per parameter),
# so the bf16 reference with the pipeline's optimizer numerics is ZeRO 1.
REFERENCE = {("fp32", 0): ("fp32", 0), ("fp32", 1): ("fp32", 1), ("bf16", 0): ("bf16", 1), ("bf16", 1): ("bf16", 1)}


def _neox_args(world: int, layout: dict, precision: str, zero_stage: int):
    from megatron.neox_arguments import NeoXArgs

    return NeoXArgs.from_dict({
        "num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 16,
        "max_position_embeddings": 16, "pos_emb": "rotary", "no_weight_tying": False,
        "make_vocab_size_divisible_by": 64, "hidden_dropout": 0.0, "attention_dropout": 0.0,
        "optimizer": {"type": "Adam", "params": {"lr": 1.0e-2, "betas": [0.9, 0.95], "eps": 1.0e-8}},
        "weight_decay": 0.01, "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
        "gradient_clipping": 1.0, "zero_optimization": {"stage": zero_stage}, "num_gpus": world,
        "train_iters": STEPS, "log_interval": 1, "seed": 1234, "distributed_backend": "gloo",
        **layout, **PRECISIONS[precision], **FLAGS})


def _logged(rank: int, world_size: int, layouts: dict, cases: list):
    """{(layout, precision, zero): [(loss, DeepSpeed's grad norm, logged extras) per step]} on this rank."""
    from megatron.initialize import initialize_megatron
    from megatron.training.step import train_step
    from megatron.training.setup import setup_model_and_optimizer
    from megatron.training_schedule import TrainingSchedule

    results = {}
    for layout_name, layout in layouts.items():
        for precision, zero in cases:
            args = _neox_args(world_size, layout, precision, zero)
            ctx = initialize_megatron(args, build_tokenizer_fn=lambda _: SimpleNamespace(vocab_size=VOCAB, eod=0))
            engine, optimizer, _ = setup_model_and_optimizer(args, ctx, TrainingSchedule.from_neox_args(args))
            batches = iter([random_batch(batch=MICRO, seq=16, vocab=VOCAB, seed=100 + i) for i in range(STEPS * GAS)])
            steps = []
            for _ in range(STEPS):
                loss, _, grad_norm, extras = train_step(args, engine, batches, ctx, optimizer, debug=True)
                steps.append((loss, grad_norm, extras))
            ctx.parallel_state.destroy()
            results[(layout_name, precision, zero)] = steps
    return results


@pytest.fixture(scope="module")
def reference():
    """The sequential model on one rank."""
    cases = sorted(set(REFERENCE.values()))
    (results,) = run_distributed(_logged, world_size=1, args=({"sequential": {}}, cases), timeout_s=600)
    return results


@pytest.fixture(scope="module")
def pipeline():
    """Rank 0's and rank 1's results of every two-rank pipeline run."""
    return run_distributed(_logged, world_size=2, args=(LAYOUTS, CASES), timeout_s=600)


def _close(key: str, precision: str) -> dict:
    if precision == "fp32":  # the parallel layouts only add in another order
        return dict(rel=1e-4, abs=1e-6)
    if key.startswith("gradient_pct_zeros/"):  # which bf16 sums round to exactly 0 depends on their order:
        return dict(abs=5.0)  # allow one entry of the smallest (32-entry) tensors
    return dict(rel=3e-2, abs=3e-3)  # bf16 rounding, from the first step on


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("precision,zero", CASES, ids=[f"{p}-zero{z}" for p, z in CASES])
def test_pipeline_logs_the_sequential_models_values(reference, pipeline, layout, precision, zero):
    want_steps = reference[("sequential", *REFERENCE[(precision, zero)])]
    rank0, rank1 = (results[(layout, precision, zero)] for results in pipeline)
    kinds = {"gradient_norms", "gradient_pct_zeros", "parameter_norms", "grad_norm_total", "param_norm_total"}
    for step, ((want_loss, _, want), (loss, grad_norm, got), (_, _, other)) in enumerate(
            zip(want_steps, rank0, rank1), start=1):
        assert loss == pytest.approx(want_loss, **_close("loss", precision)), step
        assert got == other, f"step {step}: every rank logs the whole model"
        assert set(got) == set(want), f"step {step}: {sorted(set(got) ^ set(want))}"
        # optimizer states exist from the first optimizer step on (the values are taken before each step)
        assert {key.split("/")[0] for key in got} == (kinds | {"optimizer_state_norms"} if step > 1 else kinds)
        for key in sorted(want):
            assert got[key] == pytest.approx(want[key], **_close(key, precision)), f"step {step}: {key}"
        # DeepSpeed's own norm of the same gradients over every stage, the one it clips with
        assert grad_norm is not None and got["grad_norm_total"] == pytest.approx(float(grad_norm), rel=1e-5), step
    assert rank0[0][1] > 1.0, "clipping did not act; the test would not tell clipped from unclipped gradients"
    names = {key.split("/")[1] for key in rank0[-1][2] if key.startswith("gradient_norms/")}
    # the tied word embedding (on both stages of pp2) once, layers of both stages, the last stage's final norm
    assert {"sequential.0.word_embeddings.weight", "sequential.2.attention.dense.weight",
            "sequential.3.attention.dense.weight"} <= names and any(n.startswith("sequential.5.") for n in names)


def test_pipeline_parameter_names_are_the_sequential_models():
    from megatron.model.gpt2_model import GPT2ModelPipe

    assert GPT2ModelPipe.sequential_name("tied_modules.embed.word_embeddings.weight") == \
        "sequential.0.word_embeddings.weight"
    assert GPT2ModelPipe.sequential_name("0.word_embeddings.weight") == "sequential.0.word_embeddings.weight"
    assert GPT2ModelPipe.sequential_name("3.attention.dense.bias") == "sequential.3.attention.dense.bias"
    with pytest.raises(ValueError, match="not a parameter name"):
        GPT2ModelPipe.sequential_name("sequential.3.attention.dense.bias")
