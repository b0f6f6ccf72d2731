"""StopRequested: SIGTERM / SIGINT are recorded by the training process and left alone in its forked
children; skip_single_rank_allreduce changes nothing but the time (the loop itself is exercised end to end
in tests/e2e)."""
import os
import signal
import time

import pytest
import torch

from megatron.training.loop import StopRequested
from megatron.training.setup import skip_single_rank_allreduce
from tests.distributed_helpers import run_distributed
from tests.model.helpers import random_batch, tiny_config
from tests.neox_arguments.helpers import tiny


def test_parent_records_the_signal_and_a_forked_child_dies_of_it():
    """A forked child is what multiprocessing pools start (lm-eval's stderr bootstrap during eval_tasks);
    Pool.terminate() stops them with SIGTERM and waits, forever when they ignore it."""
    stop = StopRequested()
    stop.install()
    try:
        pid = os.fork()
        if pid == 0:  # the child waits to be terminated
            time.sleep(30)
            os._exit(0)
        time.sleep(0.2)
        os.kill(pid, signal.SIGTERM)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM
        assert stop.signal_name is None
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.time() + 5
        while stop.signal_name is None and time.time() < deadline:
            time.sleep(0.01)
        assert stop.signal_name == "SIGTERM"
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGTERM) is not stop._handle


def _engine_losses(rank: int, world_size: int, zero_stage: int, skip: bool):
    import deepspeed

    from megatron.model.gpt2_model import build_model
    from megatron.mpu import ParallelState

    state = ParallelState(pipe_parallel_size=0, model_parallel_size=1)
    torch.manual_seed(0)
    model = build_model(tiny_config(), state)
    config = {"train_batch_size": 2 * world_size, "train_micro_batch_size_per_gpu": 2,
              "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 6, "gradient_clipping": 1.0,
              "zero_optimization": {"stage": zero_stage}}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                           config=config, mpu=state)
    switched = skip and skip_single_rank_allreduce(
        engine, tiny(zero_optimization={"stage": zero_stage}, num_gpus=world_size), state)
    losses = []
    for step in range(3):
        inputs, labels = random_batch(seed=10 * step + rank)
        loss = model.loss_fn(engine(inputs), labels)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    state.destroy()
    return switched, losses


def _engine_losses_per_case(rank: int, world_size: int, cases):
    """Several engines one after another in one process (each spawn costs seconds of imports)."""
    return [_engine_losses(rank, world_size, zero_stage, skip) for zero_stage, skip in cases]


@pytest.mark.slow
def test_single_rank_allreduce_is_skipped_without_changing_training():
    (results,) = run_distributed(_engine_losses_per_case, world_size=1, args=([(0, False), (0, True), (1, True)],))
    (_, reference), (switched, losses), (zero_switched, _) = results
    assert switched and losses[0] != losses[-1]
    assert losses == reference
    assert not zero_switched  # ZeRO keeps its own reduction
    assert not any(s for s, _ in run_distributed(_engine_losses, world_size=2, args=(0, True)))  # dp = 2


def test_char_counter_counts_the_predicted_tokens_and_their_characters():
    import numpy as np

    from megatron.training.step import CharCounter, tokens_per_char

    class Letters:  # token t is the character chr(97 + t), token 0 the two characters "<>"
        @staticmethod
        def detokenize(ids):
            return "".join("<>" if t == 0 else chr(97 + t) for t in ids)

    samples = iter([{"text": np.array([[5, 1, 2, 0], [1, 1, 1, 1]])}, {"text": np.array([[3, 0, 0, 4]])}])
    counter = CharCounter(samples, Letters())
    assert next(counter)["text"].shape == (2, 4) and next(counter)["text"].shape == (1, 4)
    assert (counter.tokens, counter.chars) == (9, 4 + 3 + 5)  # 'bc<>', 'bbb', '<><>e'
    assert tokens_per_char(counter.tokens, counter.chars) == pytest.approx(9 / 12)
    assert tokens_per_char(0, 0) is None


@pytest.mark.fault
def test_token_ids_beyond_the_vocabulary_are_a_data_error_naming_the_files():
    from megatron.errors import DataError
    from megatron.initialize import RunContext
    from megatron.model.config import ModelConfig
    from megatron.mpu import SingleProcessState
    from megatron.training.batches import data_source, ModelBatches

    args = tiny(data_path="/data/other_tokenizer_text_document", vocab_file="/tok/tokenizer.json")
    ctx = RunContext(parallel_state=SingleProcessState(), rng_tracker=None, tokenizer=type("T", (), {"eod": 0})(),
                     device=torch.device("cpu"), model_config=ModelConfig.from_neox_args(args, padded_vocab_size=128))
    good, bad = torch.randint(0, 128, (2, 9)), torch.randint(0, 128, (2, 9))
    bad[1, 4] = 130
    batches = ModelBatches(args, ctx, iter([{"text": good}, {"text": bad}]), source=data_source(args, "train"))
    (tokens, _, _), _ = next(batches)
    assert torch.equal(tokens, good[:, :-1])
    with pytest.raises(DataError, match=r"token id 130 in the train data \(/data/other_tokenizer_text_document\) "
                                        r"is beyond the model's vocabulary of 128 ids \(the tokenizer "
                                        r"/tok/tokenizer.json"):
        next(batches)


RAMP_BATCHES = [2, 2, 4, 6, 6]
"""Global batches of a ramp toward 6 on 2 data-parallel ranks with micro batch 1: 1, 1, 2, 3, 3 micro-batches per
rank. After 4 micro-steps DeepSpeed's own count would put the boundary of the 3-micro-batch step after 2."""


def _ramp_sample(step: int, index: int) -> tuple:
    """Sample `index` (0 .. batch - 1) of step `step`: (x, target)."""
    return float(1 + (7 * step + 3 * index) % 5), float((step + index) % 3) - 1.0


class _Line(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.full((1,), 0.5))

    def forward(self, inputs: tuple) -> torch.Tensor:  # the model's inputs come as one tuple
        return self.weight * inputs[0]

    @staticmethod
    def loss_fn(prediction: torch.Tensor, labels: tuple) -> torch.Tensor:
        return ((prediction - labels[0]) ** 2).mean()


def _ramped_weights(rank: int, world_size: int, zero_stage: int) -> list:
    """train_step under a DeepSpeed engine whose batch set_batch_size changes each step, as pretrain does."""
    import types

    import deepspeed

    from megatron.optim.learning_rates import AnnealingLR
    from megatron.mpu import SingleProcessState
    from megatron.training.step import set_batch_size, train_step

    model = _Line()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    sched = AnnealingLR(opt, start_lr=0.05, warmup_iter=0, total_iters=100, decay_style="constant",
                        samples_per_iteration=6)
    config = {"train_batch_size": 6, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 3,
              "steps_per_print": 10 ** 6, "zero_optimization": {"stage": zero_stage}, "gradient_clipping": 0.0,
              "zero_allow_untested_optimizer": True}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched, config=config,
                                           dist_init_required=False)
    args = types.SimpleNamespace(moe_num_experts=1, is_pipe_parallel=False, rampup_batch_size=[2, 2, 8],
                                 zero_stage=zero_stage, gradient_clipping=0.0)
    ctx = types.SimpleNamespace(parallel_state=SingleProcessState())
    weights = []
    for step, batch in enumerate(RAMP_BATCHES):
        set_batch_size(engine, sched, batch)
        micro = [_ramp_sample(step, m * world_size + rank) for m in range(batch // world_size)]
        batches = iter([((torch.tensor([x]),), (torch.tensor([t]),)) for x, t in micro])
        train_step(args, engine, batches, ctx, opt)
        weights.append(model.weight.item())
    return weights


PIPE_RAMP = [2, 4, 6, 6]
"""A ramp toward 6 at micro batch 2 with one data-parallel rank (PP=2 on 2 ranks): 1, 2, 3, 3 micro-batches."""


def _ramp_micro_batches() -> list:
    return [random_batch(batch=2, seed=300 + i) for i in range(sum(PIPE_RAMP) // 2)]


def _ramped_pipeline_losses(rank: int, world_size: int) -> tuple:
    """(each step's loss through DeepSpeed's pipeline engine at PP=2 under the ramp PIPE_RAMP, driven by
    set_batch_size and train_step as pretrain drives it; the same steps of the sequential model (PP=0) with the
    same initial weights, each on the mean loss of its micro-batches)."""
    import types

    import deepspeed

    from megatron.model.gpt2_model import build_model
    from megatron.mpu import ParallelState, SingleProcessState
    from megatron.training.step import evaluate, set_batch_size, train_step

    reference = build_model(tiny_config(), SingleProcessState())
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    micro, want = iter(_ramp_micro_batches()), []
    for batch in PIPE_RAMP:
        opt.zero_grad()
        losses = [reference.loss_fn(reference(inputs), labels) for inputs, labels in
                  (next(micro) for _ in range(batch // 2))]
        (sum(losses) / len(losses)).backward()
        opt.step()
        want.append(sum(loss.item() for loss in losses) / len(losses))
    state = ParallelState(pipe_parallel_size=2, model_parallel_size=1)
    model = build_model(tiny_config(pipe_parallel_size=2), state)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = {"train_batch_size": 6, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3,
              "steps_per_print": 10 ** 6, "gradient_clipping": 0.0}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    args = types.SimpleNamespace(moe_num_experts=1, is_pipe_parallel=True, gradient_accumulation_steps=3,
                                 char_level_ppl=False, checkpoint_activations=False)
    ctx, schedule = types.SimpleNamespace(parallel_state=state), types.SimpleNamespace()
    micro, got, evaluated = iter(_ramp_micro_batches()), [], None
    for step, batch in enumerate(PIPE_RAMP):
        set_batch_size(engine, schedule, batch)
        got.append(train_step(args, engine, micro, ctx, opt)[0])
        if step == 0:  # mid-ramp (1 micro-batch per step), evaluation still takes the full batch's 3
            held_out = iter(_ramp_micro_batches()[:4])
            evaluate(args, engine, held_out, 1)
            evaluated = 4 - sum(1 for _ in held_out)
    left = sum(1 for _ in micro)  # each step took exactly its batch's micro-batches
    state.destroy()
    return got, want, left, evaluated


def _ramped_weights_per_stage(rank: int, world_size: int, stages) -> tuple:
    """Several engines one after another in one process (each spawn costs seconds of imports): the ramp's
    weights at each ZeRO stage, then the pipeline's losses (_ramped_pipeline_losses)."""
    return [_ramped_weights(rank, world_size, zero_stage) for zero_stage in stages], \
        _ramped_pipeline_losses(rank, world_size)


def test_a_batch_ramp_steps_on_the_mean_gradient_of_each_steps_samples():
    """Every step equals SGD on the mean squared-error gradient over exactly that step's samples (all ranks,
    all micro-batches), for the sizes 2, 4, 6: the loss is scaled by the step's own micro-batch count and the
    optimizer steps at the step's last micro-batch. Without ZeRO and with ZeRO-1; and with pipeline parallelism
    (PP=2) the GPT model's losses equal the sequential model's under the same ramp."""
    weight, want = 0.5, []
    for step, batch in enumerate(RAMP_BATCHES):
        samples = [_ramp_sample(step, i) for i in range(batch)]
        weight -= 0.05 * sum(2 * (weight * x - t) * x for x, t in samples) / batch
        want.append(weight)
    ranks = run_distributed(_ramped_weights_per_stage, world_size=2, args=((0, 1),))
    for zero_stage, weights in zip((0, 1), zip(*(weights for weights, _ in ranks))):
        assert weights[0] == weights[1] == pytest.approx(want, rel=1e-5), zero_stage
    # PP=2: the pipeline engine runs each step's micro-batch count (1, 2, 3, 3) and equals the sequential ramp
    for got, want, left, evaluated in (pipeline for _, pipeline in ranks):
        assert (left, evaluated) == (0, 3) and len(set(want)) == len(want)
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-5)


def test_the_model_is_cast_and_placed_as_deepspeed_will_before_the_optimizer_is_built():
    """bf16: the floating-point parameters become bf16 in place (the same objects, their flags kept; what
    megatron.optim.optimizers picks depends on them), buffers keep their dtype (as DeepSpeed leaves them); a DeepSpeed
    accelerator other than the training device is refused before anything is built."""
    from types import SimpleNamespace

    from deepspeed.accelerator import get_accelerator

    from megatron.training.setup import place_as_deepspeed_will

    here = get_accelerator().device_name()  # the CPU here, CUDA on a GPU machine (tests.accelerator)
    model = torch.nn.Linear(4, 4)
    model.weight._no_weight_decay = True
    model.register_buffer("table", torch.arange(4.0))
    weight = model.weight
    args = tiny(bf16={"enabled": True})
    place_as_deepspeed_will(model, args, SimpleNamespace(device=torch.device(here)))
    assert model.weight is weight and weight._no_weight_decay and weight.dtype == torch.bfloat16
    assert weight.device.type == here and model.bias.dtype == torch.bfloat16 and model.table.dtype == torch.float32
    with pytest.raises(RuntimeError, match=f"DeepSpeed's accelerator is '{here}'.*trains on meta.*DS_ACCELERATOR"):
        place_as_deepspeed_will(model, args, SimpleNamespace(device=torch.device("meta")))
