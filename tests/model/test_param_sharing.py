"""Parameter sharing (num_unique_layers, param_sharing_style): which positions share, the parameter count,
gradients equal to an unshared model's summed over the positions that share, a state dict holding each shared
tensor once that loads back exactly, and KV-cache decoding. Resuming a run exactly is in
tests/e2e/test_block_train.py."""

import io

import pytest
import torch

from megatron.model.gpt2_model import build_model
from megatron.model.config import shared_layer_owners
from megatron.mpu import SingleProcessState
from tests.model.helpers import random_batch, tiny_config
from tests.model.kv_helpers import assert_decoding_matches_full_forward


def test_grouped_and_spaced_orders_as_gpt_neox_documents_them():
    # GPT-NeoX: num-layers=4, num-unique-layers=2 -> grouped [1, 2, 1, 2], spaced [1, 1, 2, 2]
    assert shared_layer_owners(4, 2, "grouped") == (0, 1, 0, 1)
    assert shared_layer_owners(4, 2, "spaced") == (0, 0, 2, 2)
    assert shared_layer_owners(6, 3, "spaced") == (0, 0, 2, 2, 4, 4)
    assert shared_layer_owners(4, None, "grouped") == (0, 1, 2, 3)


def _sum(params) -> int:
    return sum(p.numel() for p in params)


@pytest.mark.parametrize("style", ["grouped", "spaced"])
def test_parameter_count_gradients_and_state_dict(style):
    shared_config = tiny_config(num_layers=4, num_unique_layers=2, param_sharing_style=style, pos_emb="rotary")
    shared = build_model(shared_config, SingleProcessState())
    full = build_model(tiny_config(num_layers=4, pos_emb="rotary"), SingleProcessState())
    owners = shared_config.layer_owners
    assert _sum(shared.parameters()) == _sum(full.parameters()) - 2 * _sum(full.layers[0].parameters())
    assert {i for i, layer in enumerate(shared.layers) if list(layer.parameters())} == set(owners)

    # the unshared model with every position holding its owner's weights computes the same function, and the
    # shared weights' gradients are the sums of the positions' gradients
    with torch.no_grad():
        for name, param in full.named_parameters():
            parts = name.split(".")
            if parts[0] == "sequential" and 2 <= int(parts[1]) < 6:
                position = int(parts[1]) - 2
                parts[1] = str(owners[position] + 2)
            param.copy_(dict(shared.named_parameters())[".".join(parts)])
    inputs, labels = random_batch()
    shared.loss_fn(shared(inputs), labels).backward()
    full.loss_fn(full(inputs), labels).backward()
    full_grads = dict(full.named_parameters())
    for name, param in shared.named_parameters():
        parts = name.split(".")
        if parts[0] == "sequential" and 2 <= int(parts[1]) < 6:
            sharers = [i for i in range(4) if owners[i] == int(parts[1]) - 2]
            want = sum(full_grads[".".join([parts[0], str(i + 2)] + parts[2:])].grad for i in sharers)
        else:
            want = full_grads[name].grad
        torch.testing.assert_close(param.grad, want, rtol=1e-5, atol=1e-6, msg=name)

    # each shared tensor once, under its owner's slot; it loads back into a fresh model exactly
    state = shared.state_dict()
    assert {int(k.split(".")[1]) - 2 for k in state if k.startswith("sequential.")} & set(range(4)) == set(owners)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    fresh = build_model(shared_config.replace(seed=99), SingleProcessState())
    fresh.load_state_dict(torch.load(io.BytesIO(buffer.getvalue())))
    torch.testing.assert_close(fresh(inputs), shared(inputs), rtol=0, atol=0)


def test_kv_cache_decoding_of_a_shared_stack_equals_full_forward():
    model = build_model(tiny_config(num_layers=4, num_unique_layers=2, pos_emb="rotary",
                                    attention_config=["global", "gmlp", "global", "gmlp"]),
                        SingleProcessState()).eval()
    assert_decoding_matches_full_forward(model)
