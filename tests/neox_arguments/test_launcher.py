"""The argv handed to DeepSpeed's runner, and encode -> consume on the worker side."""

import shlex

import pytest

from megatron.neox_arguments import ConfigError, NeoXArgs
from tests.neox_arguments.helpers import TINY


def launch_args(tmp_path, **overrides):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("worker-0 slots=2\nworker-1 slots=2\n")
    base = {k: v for k, v in TINY.items() if k != "num_gpus"}
    values = {**base, "hostfile": str(hostfile), "user_script": "train.py", **overrides}
    return NeoXArgs.from_dict(values), str(hostfile)


def runner_options(argv):
    """The runner's own options, parsed by the runner's parser."""
    from deepspeed.launcher.runner import parse_args

    return parse_args(argv)


@pytest.mark.parametrize("launcher", ["pdsh", "openmpi", "mvapich", "slurm"])
def test_argv_for_each_launcher_with_hostfile_and_include(tmp_path, launcher):
    args, hostfile = launch_args(tmp_path, launcher=launcher, include="worker-0@worker-1:0", master_port=29999,
                                 master_addr="10.0.0.1", no_ssh_check=True, force_multi=True)
    argv = args.get_deepspeed_main_args()
    parsed = runner_options(argv)
    assert parsed.hostfile == hostfile and parsed.include == "worker-0@worker-1:0"
    assert parsed.launcher == launcher and parsed.master_port == 29999 and parsed.master_addr == "10.0.0.1"
    assert parsed.no_ssh_check and parsed.force_multi
    assert parsed.user_script == "train.py"
    assert parsed.user_args[0] == "--neox_config"
    assert args.global_num_gpus == 3


def test_exclude_num_nodes_and_num_gpus_reach_the_runner(tmp_path):
    args, _ = launch_args(tmp_path, exclude="worker-1:1", num_nodes=2, num_gpus=2)
    parsed = runner_options(args.get_deepspeed_main_args())
    assert parsed.exclude == "worker-1:1" and parsed.num_nodes == 2 and parsed.num_gpus == 2
    assert args.global_num_gpus == 3


def test_slurm_comment_and_account_go_through_launcher_args(tmp_path):
    args, _ = launch_args(tmp_path, launcher="slurm", comment="my run", account="proj1")
    parsed = runner_options(args.get_deepspeed_main_args())
    assert shlex.split(parsed.launcher_args) == ["--comment", "my run", "--account", "proj1"]


def test_single_node_states_the_rank_count():
    args = NeoXArgs.from_dict({**TINY, "num_gpus": 2, "user_script": "train.py"})
    parsed = runner_options(args.get_deepspeed_main_args())
    assert parsed.num_gpus == 2 and parsed.hostfile != "" and parsed.include == ""


def test_missing_hostfile_launches_the_derived_rank_count_on_this_node(tmp_path):
    """The runner reads a hostfile that does not exist as the local node; it must start the ranks the config
    was derived for."""
    placeholder = str(tmp_path / "mock_path")
    base = {k: v for k, v in TINY.items() if k != "num_gpus"}
    with pytest.warns(UserWarning, match="does not exist"):
        args = NeoXArgs.from_dict({**base, "hostfile": placeholder, "user_script": "train.py"})
    parsed = runner_options(args.get_deepspeed_main_args())
    assert parsed.hostfile == placeholder and parsed.num_gpus == args.global_num_gpus >= 1


def test_encode_consume_round_trip():
    args = NeoXArgs.from_dict({**TINY, "num_gpus": 2, "user_script": "train.py",
                               "attention_config": [[["global", "local"], 1]]})
    argv = args.get_deepspeed_main_args()
    worker_argv = argv[argv.index("train.py") + 1:] + ["--local_rank=1"]
    env = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}
    rebuilt = NeoXArgs.consume_neox_args(worker_argv, environ=env)
    expected = args.to_dict()
    got = rebuilt.to_dict()
    assert (got.pop("rank"), got.pop("local_rank"), got.pop("world_size")) == (1, 1, 2)
    for key in ("rank", "local_rank", "world_size"):
        expected.pop(key)
    assert got == expected


@pytest.mark.parametrize("flag,env", [
    ("deepspeed_slurm", {"SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS": "4"}),
    ("deepspeed_mpi", {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4"}),
    ("deepspeed_mpi", {"MV2_COMM_WORLD_RANK": "3", "MV2_COMM_WORLD_LOCAL_RANK": "1", "MV2_COMM_WORLD_SIZE": "4"}),
])
def test_ranks_from_slurm_and_mpi_variables(flag, env):
    args = NeoXArgs.from_dict({**TINY, "num_gpus": 4, flag: True, "user_script": "train.py"})
    rebuilt = NeoXArgs.consume_neox_args(["--neox_config", args.encode()], environ=env)
    assert (rebuilt.rank, rebuilt.local_rank, rebuilt.world_size) == (3, 1, 4)


def test_world_size_mismatch_is_explained():
    args = NeoXArgs.from_dict({**TINY, "num_gpus": 2, "user_script": "train.py"})
    with pytest.raises(ConfigError, match="started 3 processes"):
        NeoXArgs.consume_neox_args(["--neox_config", args.encode()], environ={"RANK": "0", "WORLD_SIZE": "3"})


def test_garbage_encoded_config_is_a_clear_error():
    with pytest.raises(ConfigError, match="launch workers through deepy.py"):
        NeoXArgs.consume_neox_args(["--neox_config", "not-a-config"], environ={})
