"""On a GPU: the model runs in bf16 and fp16 on CUDA and agrees with the fp32 CPU model."""
import pytest
import torch

from megatron.model.gpt2_model import build_model
from megatron.mpu import SingleProcessState
from tests.model.helpers import random_batch
from tests.model.kv_helpers import incremental_logits
from tests.model.helpers import tiny_config


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bfloat16", "fp16"])
@pytest.mark.parametrize("pos_emb", ["rotary", "alibi", "sinusoidal"])
def test_cuda_half_precision_matches_cpu_fp32(precision, pos_emb):
    overrides = dict(pos_emb=pos_emb, num_kv_heads=2, attention_softmax_in_fp32=True)
    ref = build_model(tiny_config(**overrides), SingleProcessState())
    model = build_model(tiny_config(precision=precision, **overrides), SingleProcessState()).cuda()
    inputs, labels = random_batch()
    ref_loss = ref.loss_fn(ref(inputs), labels)
    cuda_inputs = tuple(t.cuda() for t in inputs)
    logits = model(cuda_inputs)
    loss = model.loss_fn(logits, tuple(t.cuda() for t in labels))
    loss.backward()
    assert abs(loss.item() - ref_loss.item()) < 3e-2
    model.eval()
    with torch.no_grad():
        full = model(cuda_inputs).float()
        step = incremental_logits(model, cuda_inputs[0], prompt=5).float()
    torch.testing.assert_close(step, full, rtol=5e-2, atol=5e-2)
