"""muP under tensor parallelism: base shapes are whole-tensor shapes, so a TP=2 muP model (its multipliers, its
muP initialisation) gives TP=1's initial weights, logits, loss, gradients and KV-cache decoding."""

from megatron.model.gpt2_model import build_model
from megatron.mpu import SingleProcessState
from megatron.mup.parametrization import base_shapes_of, mup_initialize, set_base_shapes
from tests.distributed_helpers import run_distributed
from tests.model.helpers import tiny_config
from tests.model.test_tensor_parallel_model import compare_tp2_with_tp1

MUP = dict(use_mup=True, mup_width_mult=2.0, mup_attn_temp=0.5, mup_output_temp=2.0, mup_embedding_mult=1.5,
           mup_rp_embedding_mult=0.5, pos_emb="learned")
GLU_UNTIED = dict(MUP, activation="swiglu", no_weight_tying=True, num_kv_heads=2)


def mup_weights(model) -> None:
    """Base shapes of width 16 (the models are 32 wide), then muP's initialisation."""
    base = tiny_config(hidden_size=16, activation="swiglu", no_weight_tying=True, num_kv_heads=2)
    ps = SingleProcessState()
    shapes = base_shapes_of(build_model(base, ps), build_model(base.replace(hidden_size=32), ps))
    tp = 2 if any(getattr(p, "model_parallel", False) for p in model.parameters()) else 1
    infshapes = set_base_shapes(model, shapes, "base", tensor_parallel=tp)
    assert infshapes["sequential.2.attention.query_key_value.weight"].width_mult == 2.0
    mup_initialize(model, init_scale=0.7)


def test_mup_tp2_matches_tp1():
    run_distributed(compare_tp2_with_tp1, world_size=2, args=((GLU_UNTIED,), mup_weights))
