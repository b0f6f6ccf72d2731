"""The offload benchmark's contenders are configs the project accepts and differ only in what they offload (the
figures are read by hand: 2 shared cores make wall-clock assertions unreliable)."""
from bench.offload_throughput import CONTENDERS, contender_config, parse_args
from bench.train_throughput import write_data
from megatron.neox_arguments import NeoXArgs


def test_contenders_are_valid_and_differ_only_in_offloading(tmp_path):
    args = parse_args(["--size", "tiny", "--seq", "32"])
    data = write_data(str(tmp_path), 4096)
    configs = {name: NeoXArgs.from_dict(contender_config(name, args, data, str(tmp_path))).deepspeed_config
               for name in CONTENDERS}
    offloaded = {name: sorted(k for k in config["zero_optimization"] if k.startswith("offload"))
                 for name, config in configs.items()}
    assert offloaded == {"zero2": [], "zero2_offload": ["offload_optimizer"], "zero3": [],
                         "zero3_offload": ["offload_optimizer", "offload_param"]}
    without_zero = [{k: v for k, v in config.items() if k != "zero_optimization"} for config in configs.values()]
    assert all(config == without_zero[0] for config in without_zero)
