"""gMLP / aMLP layers: the block computes GPT-NeoX's GMLPBlock (written out below from its definition: a masked
[s, s] linear over positions, a masked-softmax tiny attention), outputs and gradients; KV-cache decoding equals
the full forward; left-padded decoding is refused. TP=2 is in tests/model/test_block_tensor_parallel.py."""

import pytest
import torch
import torch.nn.functional as F

from megatron.model.kv_cache import KVCache
from megatron.model.gpt2_model import build_model
from megatron.model.batch import causal_attention_mask
from megatron.mpu import SingleProcessState
from tests.model.helpers import random_batch, tiny_config
from tests.model.kv_helpers import incremental_logits


def gpt_neox_gmlp(block, x, mask):
    """GPT-NeoX's GMLPBlock forward (its [s, b, h] transposes dropped), with ``block``'s weights."""
    z = F.gelu(F.linear(block.norm(x), block.input_linear.weight))
    sgu = block.sgu
    res, gate = z.chunk(2, dim=-1)
    gate = sgu.norm(gate)
    n = x.size(1)
    weight, bias = sgu.proj.weight[:n, :n], sgu.proj.bias[:n]
    weight = weight.masked_fill(torch.ones(n, n).triu_(1).bool(), 0.0)
    gate = F.linear(gate.transpose(2, 1), weight, bias).transpose(2, 1)
    if sgu.attn is not None:
        attn = sgu.attn
        q, k, v = torch.chunk(F.linear(z, attn.proj_qkv.weight, attn.proj_qkv.bias), 3, dim=-1)
        w = torch.einsum("bnd,bmd->bnm", q, k) * q.size(-1) ** -0.5
        a = torch.softmax(w.masked_fill(mask[:, 0], -10000.0), dim=-1)
        gate = gate + F.linear(torch.einsum("bnm,bmd->bnd", a, v), attn.proj_ffn.weight, attn.proj_ffn.bias)
    return F.linear(gate * res, block.output_linear.weight)


@pytest.mark.parametrize("kind", ["gmlp", "amlp"])
def test_block_equals_gpt_neox_formula_outputs_and_grads(kind):
    config = tiny_config(attention_config=[kind, "global"], norm="rmsnorm", **({"gmlp_attn_dim": 8} if kind == "amlp"
                                                                              else {}))
    block = build_model(config, SingleProcessState()).layers[0]
    with torch.no_grad():  # move the spatial projection off its identity-like init so it mixes positions
        block.sgu.proj.weight.normal_(0, 0.1, generator=torch.Generator().manual_seed(1))
    inputs, _ = random_batch()
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(0), requires_grad=True)
    params = [x] + list(block.parameters())
    got, _ = block((x, inputs[2]))  # the batch's causal-only mask
    want = gpt_neox_gmlp(block, x, causal_attention_mask(16))  # GPT-NeoX's whole causal mask
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for g, w in zip(torch.autograd.grad(got.square().sum(), params),
                    torch.autograd.grad(want.square().sum(), params)):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)
    # later positions do not reach earlier ones
    moved = x.detach().clone()
    moved[:, 10:] += 1.0
    changed = (block((moved, inputs[2]))[0] - got).abs().amax(dim=(0, 2)) > 0
    assert not changed[:10].any() and changed[10:].all()


def test_kv_cache_decoding_equals_full_forward_and_padding_is_refused():
    model = build_model(tiny_config(num_layers=3, pos_emb="rotary", attention_config=["gmlp", "global", "amlp"],
                                    gmlp_attn_dim=8), SingleProcessState()).eval()
    with torch.no_grad():
        for layer in model.layers[:1]:
            layer.sgu.proj.weight.normal_(0, 0.1, generator=torch.Generator().manual_seed(1))
    inputs, _ = random_batch()
    with torch.no_grad():
        full = model(inputs)
        step = incremental_logits(model, inputs[0], prompt=5)
    torch.testing.assert_close(step, full, rtol=1e-5, atol=1e-5)
    cache = KVCache(max_length=16)
    cache.set_padding(torch.tensor([[True, False], [False, False]]))
    with pytest.raises(ValueError, match="left-padded"):
        model((inputs[0][:, :2], inputs[1][:, :2], None), kv_cache=cache)
