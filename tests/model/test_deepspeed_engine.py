"""ParallelState serves as DeepSpeed's mpu: a TP=2 sequential model trained by the DeepSpeed engine
(ZeRO stage 1, gradient clipping on) follows the TP=1 reference over several steps. The engine's loss is the training
step's (megatron.training.step.loss_of: from the head's DeferredLogits, in chunks of tokens), the reference's from the
logits."""
import pytest
import torch

from megatron.model.gpt2_model import build_model
from megatron.mpu import ParallelState, SingleProcessState
from tests.distributed_helpers import run_distributed
from tests.model.helpers import random_batch, tiny_config

STEPS = 3
CONFIG = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
          "steps_per_print": 10 ** 6, "gradient_clipping": 0.05, "zero_optimization": {"stage": 1}}


def _train(model, engine_like: bool, parallel_state=None) -> list:
    import deepspeed

    from megatron.training.step import loss_of

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if engine_like:
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=CONFIG, mpu=parallel_state)
    losses = []
    for step in range(STEPS):
        inputs, labels = random_batch(seed=step)
        if engine_like:
            loss = loss_of(engine, (inputs, labels))
            engine.backward(loss)
            engine.step()
        else:
            opt.zero_grad()
            loss = model.loss_fn(model(inputs), labels)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CONFIG["gradient_clipping"])
            opt.step()
        losses.append(loss.item())
    return losses


def _run(rank: int, world_size: int):
    args = dict(pos_emb="rotary", num_kv_heads=2, activation="swiglu")
    state = ParallelState(pipe_parallel_size=0, model_parallel_size=2)
    assert state.get_data_parallel_world_size() == 1
    losses = _train(build_model(tiny_config(model_parallel_size=2, **args), state), True, state)
    ref = _train(build_model(tiny_config(**args), SingleProcessState()), False)
    state.destroy()
    return losses, ref


@pytest.mark.slow
def test_deepspeed_engine_with_parallel_state_as_mpu():
    for losses, ref in run_distributed(_run, world_size=2):
        assert ref[0] != ref[-1]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=1e-5)
