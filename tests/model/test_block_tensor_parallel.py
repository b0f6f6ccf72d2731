"""TP=2 equals TP=1 (init, logits, loss, gradients, KV-cache decoding) for the block-sparse attention types:
each rank takes its heads' rows of the one layout built for all heads."""

from tests.distributed_helpers import run_distributed
from tests.model.test_tensor_parallel_model import compare_tp2_with_tp1

SPARSE = dict(num_layers=4, pos_emb="rotary", attention_config=["sparse_fixed", "sparse_variable", "bigbird",
                                                                  "bslongformer"],
              sparsity_config=(("block", 4), ("different_layout_per_head", True), ("num_different_global_patterns", 2),
                               ("num_local_blocks", 2), ("num_random_blocks", 1)))


def test_block_sparse_layers_tp2_match_tp1():
    run_distributed(compare_tp2_with_tp1, world_size=2, args=((SPARSE,),))
