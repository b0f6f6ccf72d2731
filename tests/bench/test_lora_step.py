"""The LoRA benchmark's two configs are accepted and mean what their names say: the full run saves the base, the
LoRA run loads it with adapters and trains far fewer parameters (its table is produced by hand: two training launches
are too slow for the suite)."""

from bench.lora_step import MODES, parse_args, train_config, trainable_parameters
from bench.train_throughput import write_data
from megatron.model.config import ModelConfig
from megatron.neox_arguments import NeoXArgs


def test_full_run_saves_the_base_the_lora_run_loads(tmp_path):
    args = parse_args(["--size", "tiny", "--seq", "32", "--rank", "2"])
    data = write_data(str(tmp_path), 4096)
    full, lora = (train_config(args, mode, data, str(tmp_path)) for mode in MODES)
    assert full["save"] == lora["load"] and lora["finetune"] and "lora" not in full
    config = ModelConfig.from_neox_args(NeoXArgs.from_dict(lora))
    assert config.lora_dict["r"] == 2 and len(config.lora_dict["target_modules"]) == 4
    assert 0 < trainable_parameters(lora) < trainable_parameters(full) / 10
