"""The recompute benchmark's four configs are accepted and mean what their names say (its table is produced by
hand: four training launches are too slow for the suite; the memory claim itself is tested in
tests/model/test_activation_checkpointing.py)."""

from bench.recompute_memory import MODES, parse_args, train_config
from bench.train_throughput import write_data
from megatron.model.config import ModelConfig
from megatron.neox_arguments import NeoXArgs


def test_benchmark_configs_select_none_selective_full_and_block(tmp_path):
    args = parse_args(["--size", "tiny", "--seq", "32"])
    data = write_data(str(tmp_path), 4096)
    configs = {mode: ModelConfig.from_neox_args(NeoXArgs.from_dict(train_config(args, mode, data, str(tmp_path))))
               for mode in MODES}
    assert [(c.checkpoint_activations, c.recompute_granularity) for c in configs.values()] == \
        [(False, None), (False, "selective"), (True, "full"), (True, "full")]
    assert configs["full"].checkpoint_num_layers == 1
    assert (configs["full"].recompute_block_layers, configs["block"].recompute_block_layers) == (None, 1)
