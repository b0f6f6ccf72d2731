"""TP=2 equals TP=1 (init, logits, loss, gradients, KV-cache decoding) for the block-sparse attention types
(each rank takes its heads' rows of the one layout built for all heads), for gMLP / aMLP layers (whose gate
norm, spatial projection and tiny attention see the whole width at every TP size) and for a parameter-shared
stack of them. One spawn for all three."""

import torch

from megatron.model.gmlp import SpatialGatingUnit
from tests.distributed_helpers import run_distributed
from tests.model.test_tensor_parallel_model import compare_tp2_with_tp1

SPARSE = dict(num_layers=4, pos_emb="rotary", attention_config=["sparse_fixed", "sparse_variable", "bigbird",
                                                                  "bslongformer"],
              sparsity_config=(("block", 4), ("different_layout_per_head", True), ("num_different_global_patterns", 2),
                               ("num_local_blocks", 2), ("num_random_blocks", 1)))
GMLP = dict(num_layers=3, attention_config=["amlp", "global", "gmlp"], gmlp_attn_dim=8, norm="layernorm")
SHARED = dict(num_layers=4, num_unique_layers=2, param_sharing_style="spaced", attention_config=["bslongformer",
              "bslongformer", "gmlp", "gmlp"], sparsity_config=(("block", 4),), pos_emb="rotary")



def mix_positions(model) -> None:
    """Give every spatial projection seeded weights (they start at zero, which would hide the gate norm)."""
    for module in model.modules():
        if isinstance(module, SpatialGatingUnit):
            with torch.no_grad():
                module.proj.weight.normal_(0, 0.1, generator=torch.Generator().manual_seed(1))


def test_block_sparse_gmlp_and_shared_layers_tp2_match_tp1():
    run_distributed(compare_tp2_with_tp1, world_size=2, args=((SPARSE, GMLP, SHARED), mix_positions))
