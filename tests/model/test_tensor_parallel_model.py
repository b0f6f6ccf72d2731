"""TP=2 (with and without sequence parallelism; RoPE scaling, non-parametric norms and q/k/v-only biases too) gives
the TP=1 logits, loss and gradients (fp32), and KV-cache decoding at TP=2 gives the full-forward logits. Every other config takes its TP=2 loss from the head's
DeferredLogits (as training does: logits and cross entropy in chunks of 5 tokens, all-reduced within each chunk)."""
from unittest import mock

import pytest
import torch

from megatron.model.batch import BatchOptions, get_batch
from megatron.model.gpt2_model import build_model
from megatron.mpu import ParallelState, SingleProcessState, chunked_cross_entropy
from tests.distributed_helpers import run_distributed
from tests.model.helpers import random_batch
from tests.model.kv_helpers import incremental_logits
from tests.model.helpers import tiny_config
from tests.model.tp_helpers import expected_local, gather_vocab

CONFIGS = [
    dict(no_weight_tying=True),
    dict(pos_emb="rotary", rotary_pct=0.5, num_kv_heads=2, activation="swiglu", norm="rmsnorm", use_qk_layernorm=True),
    dict(pos_emb="rotary", num_kv_heads=2, activation="geglu", sequence_parallel=True),
    dict(pos_emb="alibi", gpt_j_residual=True, sequence_parallel=True, use_qk_layernorm=True),
    dict(pos_emb="rpe", norm="scalenorm", no_weight_tying=True, sequence_parallel=True),
    dict(pos_emb="rotary", num_kv_heads=2, norm="non_parametric_layernorm", use_qk_layernorm=True,
         use_bias_in_attn_linear=False, use_bias_in_qkv=True,  # Qwen2's q/k/v-only biases, split with GQA
         rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=4)),
]


def compare_tp2_with_tp1(rank: int, world_size: int, configs=tuple(CONFIGS), adjust=None) -> None:
    """For each tiny_config override dict: init, logits, loss, grads and KV-cache decoding at TP=2 equal TP=1.
    ``adjust(model)``, when given, changes both models' weights the same way after they are built. The first,
    third, ... config's TP=2 loss comes from DeferredLogits in chunks of 5 tokens (the others' from the logits)."""
    inputs, labels = random_batch()
    text = torch.cat([inputs[0], labels[0][:, -1:]], dim=1)
    for index, overrides in enumerate(configs):
        args = tiny_config(model_parallel_size=2, **overrides)
        ref = build_model(args, SingleProcessState())
        if adjust is not None:
            adjust(ref)
        ref_logits = ref(inputs)
        ref_loss = ref.loss_fn(ref_logits, labels)
        ref_loss.backward()

        state = ParallelState(pipe_parallel_size=0, model_parallel_size=2)
        model = build_model(args, state)
        if adjust is not None:
            adjust(model)
        # Only TP rank 0 reads data; get_batch broadcasts it inside the model-parallel group.
        got_inputs, got_labels = get_batch(BatchOptions(), {"text": text} if rank == 0 else None, state)
        for got, want in zip(got_inputs + got_labels, inputs + labels):
            assert torch.equal(got, want)
        for name, (want, got) in expected_local(ref, model, rank, 2, grads=False).items():
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"{overrides} init {name}")
        deferred = index % 2 == 0
        if deferred:
            with torch.no_grad():
                logits = model(inputs)
            with mock.patch.object(chunked_cross_entropy, "CHUNK_LOGITS_BYTES", 5 * 4 * args.padded_vocab_size // 2):
                loss = model.loss_fn(model(inputs, defer_logits=True), labels)
        else:
            logits = model(inputs)
            loss = model.loss_fn(logits, labels)
        loss.backward()
        msg = f"{overrides}{' deferred' if deferred else ''}"
        torch.testing.assert_close(
            gather_vocab(logits, state.get_model_parallel_group()), ref_logits, rtol=1e-5, atol=1e-5, msg=msg
        )
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6, msg=msg)
        for name, (want, got) in expected_local(ref, model, rank, 2, grads=True).items():
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=f"{msg} grad {name}")
        if not overrides.get("sequence_parallel"):
            model.eval()
            with torch.no_grad():
                step = incremental_logits(model, inputs[0], prompt=5)
            torch.testing.assert_close(
                gather_vocab(step, state.get_model_parallel_group()),
                ref_logits,
                rtol=1e-5,
                atol=1e-5,
                msg=f"{msg} kv cache",
            )
        else:
            with pytest.raises(ValueError, match="sequence_parallel"):
                incremental_logits(model, inputs[0], prompt=4)
        state.destroy()


@pytest.mark.slow
def test_tp2_matches_tp1_logits_loss_and_grads():
    run_distributed(compare_tp2_with_tp1, world_size=2)
