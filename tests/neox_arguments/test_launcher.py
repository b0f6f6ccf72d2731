"""The argv handed to DeepSpeed's runner, and encode -> consume on the worker side."""

import shlex

import pytest

from megatron.neox_arguments import NeoXArgs
from megatron.errors import ConfigError
from megatron.neox_arguments.launcher import ENCODED_CONFIG_ENV, rendezvous_environment, worker_environment
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
    assert parsed.user_args == []  # the config travels in the environment (worker_environment)
    assert args.global_num_gpus == 3


@pytest.mark.parametrize("flag", ["deepspeed_slurm", "deepspeed_mpi"])
def test_slurm_and_mpi_rank_discovery_force_the_launcher_even_on_one_node(tmp_path, flag):
    """Without --force_multi DeepSpeed's runner, which finds no hostfile inside a slurm job, starts local
    processes that have no SLURM_* / OMPI_* variables (GPT-NeoX forces it too)."""
    base = {k: v for k, v in TINY.items() if k != "num_gpus"}
    launcher = "slurm" if flag == "deepspeed_slurm" else "openmpi"
    args = NeoXArgs.from_dict({**base, "num_gpus": 1, "launcher": launcher, flag: True, "user_script": "train.py"})
    assert runner_options(args.get_deepspeed_main_args()).force_multi
    plain = NeoXArgs.from_dict({**base, "num_gpus": 1, "launcher": launcher, "user_script": "train.py"})
    assert not runner_options(plain.get_deepspeed_main_args()).force_multi


def test_exclude_num_nodes_and_num_gpus_reach_the_runner(tmp_path):
    args, _ = launch_args(tmp_path, exclude="worker-1:1", num_nodes=2, num_gpus=2)
    parsed = runner_options(args.get_deepspeed_main_args())
    assert parsed.exclude == "worker-1:1" and parsed.num_nodes == 2 and parsed.num_gpus == 2
    assert args.global_num_gpus == 3


@pytest.mark.attack("launcher values that begin with '-' (a hostfile path, a slurm comment, a user script), "
                    "to be read as options of DeepSpeed's runner")
def test_values_beginning_with_a_dash_reach_the_runner_as_values(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "--no_python").write_text("worker-0 slots=2\nworker-1 slots=2\n")
    base = {k: v for k, v in TINY.items() if k != "num_gpus"}
    args = NeoXArgs.from_dict({**base, "hostfile": "--no_python", "user_script": "train.py", "launcher": "slurm",
                               "comment": "--exclusive", "master_addr": "10.0.0.1"})
    parsed = runner_options(args.get_deepspeed_main_args())
    assert parsed.hostfile == "--no_python" and not parsed.no_python
    assert shlex.split(parsed.launcher_args) == ["--comment", "--exclusive"]
    dashed = NeoXArgs.from_dict({**base, "num_gpus": 1, "user_script": "--no_python"})
    with pytest.raises(ValueError, match="user_script '--no_python' begins with '-'.*write ./--no_python"):
        dashed.get_deepspeed_main_args()


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


def test_encode_consume_round_trip_through_the_environment():
    args = NeoXArgs.from_dict({**TINY, "num_gpus": 2, "user_script": "train.py",
                               "attention_config": [[["global", "local"], 1]]})
    env = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", **worker_environment(args)}
    assert set(worker_environment(args)) == {ENCODED_CONFIG_ENV}
    rebuilt = NeoXArgs.consume_neox_args(["--local_rank=1"], environ=env)
    expected = args.to_dict()
    got = rebuilt.to_dict()
    assert (got.pop("rank"), got.pop("local_rank"), got.pop("world_size")) == (1, 1, 2)
    for key in ("rank", "local_rank", "world_size"):
        expected.pop(key)
    assert got == expected
    by_flag = NeoXArgs.consume_neox_args(["--neox_config", args.encode()], environ={"RANK": "1", "WORLD_SIZE": "2"})
    assert by_flag.to_dict() == {**rebuilt.to_dict(), "local_rank": None}


@pytest.mark.parametrize("flag,env", [
    ("deepspeed_slurm", {"SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS": "4"}),
    ("deepspeed_mpi", {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4"}),
    ("deepspeed_mpi", {"MV2_COMM_WORLD_RANK": "3", "MV2_COMM_WORLD_LOCAL_RANK": "1", "MV2_COMM_WORLD_SIZE": "4"}),
    ("deepspeed_mpi", {"PMI_RANK": "3", "MPI_LOCALRANKID": "1", "PMI_SIZE": "4"}),
    # mpirun without deepspeed_mpi: Open MPI's own variables are read (no RANK is set)
    (None, {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4"}),
    # the flag names the variables that win over RANK (a slurm job step also inherits a stale RANK)
    ("deepspeed_slurm", {"SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS": "4", "RANK": "0"}),
    # DeepSpeed's own launcher inside an allocation: its RANK wins over the job's SLURM_PROCID
    (None, {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "1", "RANK": "3", "LOCAL_RANK": "1",
            "WORLD_SIZE": "4"}),
])
def test_ranks_from_slurm_and_mpi_variables(flag, env):
    args = NeoXArgs.from_dict({**TINY, "num_gpus": 4, **({flag: True} if flag else {}), "user_script": "train.py"})
    rebuilt = NeoXArgs.consume_neox_args([], environ={**env, **worker_environment(args)})
    assert (rebuilt.rank, rebuilt.local_rank, rebuilt.world_size) == (3, 1, 4)


def test_rendezvous_variables_for_torch():
    env = rendezvous_environment(3, 1, 4, "10.1.2.3", 29600, {})
    assert env == {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29600"}
    launched = rendezvous_environment(3, 1, 4, None, 29600, {"MASTER_ADDR": "node0", "MASTER_PORT": "1234"})
    assert (launched["MASTER_ADDR"], launched["MASTER_PORT"]) == ("node0", "1234")
    with pytest.raises(ValueError, match=r"no RANK, LOCAL_RANK \(nor srun's .*deepy.py; .*set master_addr"):
        rendezvous_environment(None, None, 4, None, 29600, {})
    with pytest.raises(ValueError) as err:
        rendezvous_environment(None, 0, 4, None, 29600, {"MASTER_ADDR": "node0"})
    assert "no RANK (" in str(err.value) and "master_addr" not in str(err.value)


def test_world_size_mismatch_is_explained():
    args = NeoXArgs.from_dict({**TINY, "num_gpus": 2, "user_script": "train.py"})
    with pytest.raises(ConfigError, match="started 3 processes"):
        NeoXArgs.consume_neox_args(["--neox_config", args.encode()], environ={"RANK": "0", "WORLD_SIZE": "3"})


def test_garbage_encoded_config_is_a_clear_error():
    with pytest.raises(ConfigError, match="launch workers through deepy.py"):
        NeoXArgs.consume_neox_args(["--neox_config", "not-a-config"], environ={})


def test_a_worker_started_by_hand_says_to_use_deepy(monkeypatch):
    monkeypatch.setattr("sys.argv", ["train.py", "configs/125M.yml"])
    with pytest.raises(ConfigError, match=r"train.py is a worker script .* python deepy.py train.py configs/125M.yml"):
        NeoXArgs.consume_neox_args(environ={})
