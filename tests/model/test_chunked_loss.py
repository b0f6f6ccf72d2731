"""The training loss from the head's DeferredLogits (logits and cross entropy in chunks of tokens) equals the loss
from the logits, with the same gradients, for the sequential model, the pipeline's head slots, DPO / KTO and the
training step; the logits never exist whole. TP=2 (with sequence parallelism) is in the spawns of
tests/model/test_tensor_parallel_model.py and tests/model/test_deepspeed_engine.py."""

from unittest import mock

import pytest
import torch

from megatron.model.gpt2_model import build_model
from megatron.model.head import DeferredLogits, OutputHead, pipeline_tied_logits
from megatron.mpu import SingleProcessState, chunked_cross_entropy
from megatron.post_training.dpo import sequence_logps
from tests.model.helpers import random_batch, tiny_config
from tests.mpu.test_chunked_cross_entropy import LargestTensor

VOCAB = 128


def small_chunks(tokens: int, vocab: int = VOCAB):
    """Chunks of `tokens` tokens in the loss (the default would take a tiny test's tokens in one chunk)."""
    return mock.patch.object(chunked_cross_entropy, "CHUNK_LOGITS_BYTES", tokens * 4 * vocab)


def _batch(batch: int = 2, seed: int = 0):
    inputs, (labels, _) = random_batch(batch=batch, seed=seed)
    mask = (torch.rand(labels.shape, generator=torch.Generator().manual_seed(seed + 1)) > 0.25).float()
    return inputs, (labels, mask)


def _loss_and_grads(model, inputs, labels, defer: bool):
    loss = model.loss_fn(model(inputs, defer_logits=defer), labels)
    return loss, torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])


@pytest.mark.parametrize("overrides", [{}, dict(no_weight_tying=True, pos_emb="rotary", activation="swiglu")])
def test_deferred_loss_and_gradients_equal_the_logits_ones(overrides):
    model = build_model(tiny_config(**overrides), SingleProcessState())
    inputs, labels = _batch()
    assert isinstance(model(inputs, defer_logits=True), DeferredLogits)
    assert isinstance(model(inputs), torch.Tensor)  # logits unless asked: generation, evaluation harnesses, tests
    want, want_grads = _loss_and_grads(model, inputs, labels, defer=False)
    with small_chunks(5):  # 32 tokens: 6 chunks of 5 and one of 2
        got, got_grads = _loss_and_grads(model, inputs, labels, defer=True)
    print(f"loss {got.item():.7f} vs {want.item():.7f}; largest gradient difference "
          f"{max((g - w).abs().max().item() for g, w in zip(got_grads, want_grads)):.1e}")
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


def test_the_model_never_holds_the_whole_logits_when_deferred():
    vocab, tokens, hidden = 512, 8 * 16, 32  # [tokens, vocab] 65536 elements; the word embedding 16384
    model = build_model(tiny_config(padded_vocab_size=vocab), SingleProcessState())
    inputs, labels = _batch(batch=8)
    largest = {}
    for defer in (False, True):
        with small_chunks(8, vocab), LargestTensor() as mode:
            model.loss_fn(model(inputs, defer_logits=defer), labels).backward()
        largest[defer] = mode.largest
    print(largest)
    assert largest[False] >= tokens * vocab  # the check sees the logits where they exist
    assert largest[True] == vocab * hidden  # the largest: the word embedding (and its gradient), not the logits


def test_pipeline_head_slots_defer_while_training_only():
    config = tiny_config(no_weight_tying=True)
    head = OutputHead(config, SingleProcessState(), _initializer(config), defer_when_training=True)
    hidden = torch.randn(2, 3, config.hidden_size, requires_grad=True)
    assert isinstance(head(hidden), DeferredLogits)
    assert isinstance(head(hidden, defer=False), torch.Tensor)  # the sequential model says what it wants
    torch.testing.assert_close(head(hidden).logits(), head(hidden, defer=False), rtol=0, atol=0)
    head.eval()
    assert isinstance(head(hidden), torch.Tensor)
    assert isinstance(OutputHead(config, SingleProcessState(), _initializer(config))(hidden), torch.Tensor)
    model = build_model(tiny_config(), SingleProcessState())
    assert isinstance(pipeline_tied_logits(model.embedding, hidden), DeferredLogits)
    model.eval()
    assert isinstance(pipeline_tied_logits(model.embedding, hidden), torch.Tensor)


def _initializer(config):
    from megatron.model.init_functions import Initializer

    return Initializer(config)


def test_a_zero3_partitioned_head_weight_gives_logits():
    """ZeRO-3 gathers a partitioned weight only inside its module's forward: the loss, after it, would see none."""
    model = build_model(tiny_config(no_weight_tying=True), SingleProcessState())
    model.head.final_linear.weight.ds_id = 0
    inputs, _ = _batch()
    assert isinstance(model(inputs, defer_logits=True), torch.Tensor)


def test_dpo_and_kto_log_probabilities_from_deferred_logits():
    model = build_model(tiny_config(), SingleProcessState())
    inputs, (labels, mask) = _batch(seed=3)
    upstream = torch.tensor([0.7, -1.3])
    want = sequence_logps(model(inputs), labels, mask)
    want_grads = torch.autograd.grad(want, list(model.parameters()), upstream)
    with small_chunks(3):  # the backward recomputes each chunk's logits
        got = sequence_logps(model(inputs, defer_logits=True), labels, mask)
        got_grads = torch.autograd.grad(got, list(model.parameters()), upstream)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


def test_the_training_step_asks_the_gpt_for_deferred_logits():
    from megatron.training.step import loss_of

    model = build_model(tiny_config(), SingleProcessState())
    inputs, labels = _batch()

    class Engine:  # what loss_of uses of DeepSpeed's engine
        module = model
        seen = None

        def __call__(self, inputs, **kwargs):
            Engine.seen = model(inputs, **kwargs)
            return Engine.seen

    loss = loss_of(Engine(), (inputs, labels))
    assert isinstance(Engine.seen, DeferredLogits)
    torch.testing.assert_close(loss, model.loss_fn(model(inputs), labels), rtol=1e-6, atol=1e-6)


def test_deepspeeds_backward_prologue_runs_before_the_head_weight_gets_its_gradient():
    """DeepSpeed's engine starts its backward (ZeRO's accumulation boundary, its timers) from hooks on the tensors
    of the module's output; on logits they run before any parameter gets a gradient, and so they must on
    DeferredLogits (whose hidden and weight come out of one identity node for that)."""
    from deepspeed.runtime.utils import register_output_backward_hooks

    model = build_model(tiny_config(no_weight_tying=True), SingleProcessState())
    inputs, labels = _batch()
    events = []
    model.head.final_linear.weight.register_post_accumulate_grad_hook(lambda _: events.append("head weight"))
    output = model(inputs, defer_logits=True)
    manager = register_output_backward_hooks(output, lambda: events.append("prologue"))
    model.loss_fn(output, labels).backward()
    assert events == ["prologue", "head weight"] and manager.hook_handles
