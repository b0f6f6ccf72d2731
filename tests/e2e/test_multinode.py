"""Real multi-node launches: `python deepy.py train.py` through pdsh, Open MPI and slurm on a two-host cluster
built on this machine (tests/e2e/cluster.py: an sshd on 127.0.0.2 and 127.0.0.3, a slurmctld and two
slurmd, all in a network namespace of their own). Each trains the tiny model with one rank per host,
checkpoints, stops (exit_interval), resumes, and must reproduce the losses of the same two ranks launched
on one node. The commands are those of docs/multi-node.md; the tests skip, saying why, where the
machine cannot build the cluster (not root, no network namespaces, packages missing: .ci/run installs them)."""

import re
import sys
from pathlib import Path

import pytest
import yaml

from tests.e2e import cluster as cluster_module
from tests.e2e.launch import REPO
from tests.e2e.training_run import TrainingRun, build_tiny_corpus, falls

pytestmark = pytest.mark.slow

SCHEDULE = {"train_iters": 8, "checkpoint_factor": 4, "zero_optimization": {"stage": 1}}
"""8 steps of 2 ranks x 4 sequences; the multi-node runs stop after 4 (exit_interval) and resume."""


def _needs(kind: str) -> None:
    reason = cluster_module.skip_reason(kind)
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    _needs("ip")
    built = cluster_module.Cluster(str(tmp_path_factory.mktemp("cluster")))
    yield built
    built.close()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return build_tiny_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def one_node_losses(data, tmp_path_factory):
    """The reference: the same two ranks started on one node."""
    run = TrainingRun(tmp_path_factory.mktemp("one_node"), data, num_gpus=2, save=None, load=None, **SCHEDULE)
    run.launch()
    run.assert_ok()
    losses = run.losses()
    assert sorted(losses) == list(range(1, 9)) and falls(losses, by=0.1)
    return losses


def _stop_and_resume(run: TrainingRun, runner, first: dict, second: dict, expected) -> None:
    """Train to iteration 4 and stop, then resume to 8: every loss is the one-node run's."""
    run.launch(runner=runner, exit_interval=4, **first)
    run.assert_ok()
    assert run.latest() == "global_step4" and sorted(run.losses()) == [1, 2, 3, 4]
    run.launch(runner=runner, **second)
    run.assert_ok()
    assert run.latest() == "global_step8" and run.checkpoints() == ["global_step4", "global_step8"]
    assert run.losses() == expected
    assert [r["iteration"] for r in run.records()] == list(range(1, 9))


def _verbose(cluster):
    """cluster.deepy with --verbose: DeepSpeed's runner logs the command it starts (hidden by default)."""
    return lambda argv, **kwargs: cluster.deepy([*argv, "--verbose"], **kwargs)


def _assert_quiet(output: str) -> None:
    """The runner's command line shows the encoded config as its size, not its ~5 KB."""
    assert not re.search(r"[A-Za-z0-9_=-]{1000,}", output)
    assert "<config, " in output


def test_pdsh_two_hosts(cluster, data, tmp_path, one_node_losses):
    """docs/multi-node.md: hostfile, passwordless ssh, `launcher: pdsh`; per-rank logs in log_dir on every host."""
    _needs("pdsh")
    cluster.start_sshd()
    hostfile = cluster.hostfile(slots=1)
    run = TrainingRun(tmp_path, data, hostfile=hostfile, launcher="pdsh", master_addr=cluster_module.HOSTS[0],
                      **SCHEDULE)
    _stop_and_resume(run, _verbose(cluster), {}, {}, one_node_losses)
    output = run.result.stdout + run.result.stderr
    for host in cluster_module.HOSTS:  # pdsh prefixes each line with its host
        assert f"{host}: " in output
    _assert_quiet(output)
    logs = sorted(p.name for p in (tmp_path / "logs").glob("*_rank*_std*.txt"))
    assert [name.split("_", 1)[1] for name in logs] == ["rank0_stderr.txt", "rank0_stdout.txt",
                                                        "rank1_stderr.txt", "rank1_stdout.txt"]
    rank0 = next((tmp_path / "logs").glob("*_rank0_stdout.txt")).read_text()
    assert re.search(r"iteration +8/ +8 \| lr", rank0) and re.search(r"iteration +1/ +8 \| lr", rank0), rank0[-2000:]


def test_openmpi_two_hosts(cluster, data, tmp_path, one_node_losses):
    """`launcher: openmpi`: mpirun starts the workers, which read Open MPI's OMPI_COMM_WORLD_* variables; the
    first half without deepspeed_mpi, the resumed half with it (neither needs mpi4py)."""
    _needs("openmpi")
    cluster.start_sshd()
    hostfile = cluster.hostfile(slots=1)
    run = TrainingRun(tmp_path, data, hostfile=hostfile, launcher="openmpi", master_addr=cluster_module.HOSTS[0],
                      **SCHEDULE)
    _stop_and_resume(run, _verbose(cluster), {"deepspeed_mpi": False}, {"deepspeed_mpi": True}, one_node_losses)
    assert "mpirun -n 2 -hostfile" in run.result.stdout + run.result.stderr


def test_slurm_sbatch_one_node_then_two_nodes(cluster, data, tmp_path, one_node_losses):
    """docs/multi-node.md's slurm recipe: `sbatch --nodes=N --ntasks-per-node=M tools/slurm/train.sbatch CONFIG
    configs/slurm_local.yml` (the launcher keys of slurm_local.yml; the data of this test). The first half
    runs both ranks on one node (where DeepSpeed's runner, without --force_multi, would fork them itself and
    every rank would read the batch step's SLURM_PROCID=0), the resumed half one rank on each of two nodes."""
    _needs("slurm")
    cluster.start_slurm()
    shipped = yaml.safe_load((Path(REPO) / "configs" / "slurm_local.yml").read_text())
    launcher_keys = {k: shipped[k] for k in ("launcher", "deepspeed_slurm", "no_ssh_check")}
    assert launcher_keys == {"launcher": "slurm", "deepspeed_slurm": True, "no_ssh_check": True}
    setup = tmp_path / "slurm_setup.yml"
    setup.write_text(yaml.safe_dump(launcher_keys))

    def sbatch(nodes: int, ranks_per_node: int):
        def submit(argv, extra_env=None, timeout=600):
            script, config, *rest = argv
            return cluster.sbatch("tools/slurm/train.sbatch", [config, str(setup), *rest, "--verbose"],
                                  options=[f"--nodes={nodes}", f"--ntasks-per-node={ranks_per_node}"],
                                  extra_env={"SCRIPT": script, "PYTHON": sys.executable, **(extra_env or {})},
                                  timeout=timeout)
        return submit

    run = TrainingRun(tmp_path, data, **SCHEDULE)
    run.launch(runner=sbatch(1, 2), exit_interval=4)
    run.assert_ok()
    assert "srun -n 2" in run.result.stdout
    assert run.latest() == "global_step4" and sorted(run.losses()) == [1, 2, 3, 4]
    run.launch(runner=sbatch(2, 1))
    run.assert_ok()
    assert "srun -n 2" in run.result.stdout
    assert run.latest() == "global_step8" and run.losses() == one_node_losses


def test_a_host_without_sshd_stops_the_launch_before_any_worker(cluster, data, tmp_path):
    """Real ssh: 127.0.0.4 has no sshd; deepy.py names it and the hostfile, and pdsh never runs."""
    _needs("pdsh")
    cluster.start_sshd()
    hostfile = cluster.hostfile(slots=1, hosts=(cluster_module.HOSTS[0], "127.0.0.4"))
    run = TrainingRun(tmp_path, data, hostfile=hostfile, launcher="pdsh", master_addr=cluster_module.HOSTS[0],
                      **SCHEDULE)
    result = run.launch(runner=cluster.deepy, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"hostfile '{hostfile}': host '127.0.0.4' does not answer passwordless ssh" in result.stderr
    assert f"'{cluster_module.HOSTS[0]}'" not in result.stderr
    assert "pdsh" not in result.stdout and "Traceback" not in result.stderr
    assert not (tmp_path / "logs").exists()
