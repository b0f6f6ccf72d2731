"""What deepy.py hands to DeepSpeed's runner (deepspeed.launcher.runner.main), and how a worker finds its
place in the world whichever launcher started it.

The argv carries only the runner's options and the user script; options the user did not set are left
out, so the runner's own defaults (e.g. /job/hostfile) stay in force. slurm's comment and account go
through --launcher_args because upstream DeepSpeed's runner has no options of its own for them.

The validated config travels to the workers in the environment variable ENCODED_CONFIG_ENV, not on the
command line: DeepSpeed's runner and its per-node launcher log their command lines, and a ~5 KB config in
them would be echoed once per launch and once per rank. Local ranks inherit the variable; for pdsh,
Open MPI, MVAPICH and slurm the runner forwards every variable whose name starts with one of its
EXPORT_ENVS prefixes, to which deepy.py adds WORKER_ENV_PREFIXES."""

import shlex
from typing import Dict, List, Mapping, Optional, Tuple

from megatron.neox_arguments.groups import NeoXArgsSchema
from megatron.neox_arguments.hostfile import DEFAULT_HOSTFILE, active_resources, is_local_launch

ENCODED_CONFIG_ENV = "NEOX_ENCODED_CONFIG"
"""The environment variable that carries the whole validated config (NeoXArgs.encode()) to every worker."""
ENCODED_CONFIG_FLAG = "--neox_config"
"""The same as a worker argument (for workers started by hand or by a custom launcher); wins over the variable."""

WORKER_ENV_PREFIXES = ("NEOX_", "DS_ACCELERATOR", "OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME", "MASTER_ADDR",
                       "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "WANDB_MODE", "TRITON_INTERPRET")
"""Variables (by prefix) that deepy.py forwards to workers on other nodes, besides DeepSpeed's own
(PYTHON*, UCX*, MV2*, MLFLOW*, and NCCL* on GPUs). Secrets are left out on purpose: the runner logs the
command line that carries them. Put anything else in a `.deepspeed_env` file (KEY=VALUE lines) in the
working directory or your home directory; DeepSpeed's runner forwards those too."""

RANK_VARIABLES: Tuple[Tuple[str, str, str], ...] = (
    ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_SIZE"),
    ("PMI_RANK", "MPI_LOCALRANKID", "PMI_SIZE"),
)
"""(rank, local rank, world size) as srun, Open MPI, MVAPICH and MPICH / Intel MPI name them."""
TORCH_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE")
"""As torch's env:// rendezvous and DeepSpeed's own launcher name them."""


def multi_node_launch(args: NeoXArgsSchema) -> bool:
    """Whether DeepSpeed's runner will start the workers through the launcher (pdsh, mpirun, srun) rather
    than as local processes: several hosts, or a launch forced through it."""
    if forces_multi(args):
        return True
    return not is_local_launch(args.hostfile) and len(active_hosts(args)) > 1


def forces_multi(args: NeoXArgsSchema) -> bool:
    """slurm and MPI rank discovery need the workers started by srun / mpirun even on one node (as in
    GPT-NeoX): without --force_multi DeepSpeed's runner, which finds no hostfile inside a slurm job,
    would start them as local processes that have no SLURM_* / OMPI_* variables."""
    return bool(args.force_multi or args.deepspeed_slurm or args.deepspeed_mpi)


def active_hosts(args: NeoXArgsSchema) -> List[str]:
    """The hosts DeepSpeed's runner will use: the filtered hostfile, or 'localhost' for a local launch."""
    if is_local_launch(args.hostfile):
        return ["localhost"]
    hostfile = args.hostfile or DEFAULT_HOSTFILE
    return list(active_resources(hostfile, args.include, args.exclude, args.num_nodes, args.num_gpus))


def deepspeed_runner_argv(args: NeoXArgsSchema) -> List[str]:
    """Runner options, then the user script (the config goes in the environment: worker_environment())."""
    if not args.user_script:
        raise ValueError("user_script is not set; deepy.py sets it from its first argument")
    if args.user_script.startswith("-"):
        raise ValueError(f"user_script {args.user_script!r} begins with '-', which DeepSpeed's runner and launcher "
                         f"would read as an option; write ./{args.user_script}")
    argv: List[str] = []
    # values the user wrote travel as --option=value: never read as an option, whatever they begin with
    if args.hostfile:
        argv.append(f"--hostfile={args.hostfile}")
    if args.include:
        argv.append(f"--include={args.include}")
    if args.exclude:
        argv.append(f"--exclude={args.exclude}")
    if args.num_nodes is not None and args.num_nodes > 0:
        argv += ["--num_nodes", str(args.num_nodes)]
    if args.num_gpus is not None:
        argv += ["--num_gpus", str(args.num_gpus)]
    elif is_local_launch(args.hostfile) and args.global_num_gpus is not None:
        # One node (no hostfile, or one that does not exist, which the runner also reads as the local node):
        # left alone, the runner starts a rank per device, or per NUMA node on CPU; state the count the config
        # was derived for.
        argv += ["--num_gpus", str(args.global_num_gpus)]
    argv += ["--master_port", str(args.master_port)]
    if args.master_addr:
        argv.append(f"--master_addr={args.master_addr}")
    argv += ["--launcher", args.launcher]
    launcher_args: List[str] = []
    if args.comment:
        launcher_args += ["--comment", args.comment]
    if args.account:
        launcher_args += ["--account", args.account]
    if launcher_args:
        argv.append(f"--launcher_args={shlex.join(launcher_args)}")
    if forces_multi(args):
        argv.append("--force_multi")
    if args.no_ssh_check:
        argv.append("--no_ssh_check")
    argv.append(args.user_script)
    return argv


def worker_environment(args: NeoXArgsSchema) -> Dict[str, str]:
    """The variables deepy.py sets before starting the runner, for every worker to read."""
    return {ENCODED_CONFIG_ENV: args.encode()}


def forward_variables_to_workers() -> None:
    """Have DeepSpeed's runner forward WORKER_ENV_PREFIXES to the workers of pdsh / MPI / slurm launches."""
    from deepspeed.launcher import runner

    for prefix in WORKER_ENV_PREFIXES:
        if prefix not in runner.EXPORT_ENVS:
            runner.EXPORT_ENVS.append(prefix)


def ranks_from_environment(env: Mapping[str, str], deepspeed_slurm: bool = False, deepspeed_mpi: bool = False
                           ) -> Tuple[Optional[int], Optional[int], Optional[int]]:
    """(rank, local_rank, world_size) from the variables of whichever launcher started this process.

    deepspeed_slurm / deepspeed_mpi name the launcher whose variables come first (as in GPT-NeoX). Then
    RANK / LOCAL_RANK / WORLD_SIZE (DeepSpeed's own launcher, used by local and pdsh launches). A process
    with neither (started by srun or mpirun without the flag) still finds its rank in the launcher's own
    variables; MPI's are read directly, so no mpi4py and no MPI_Init are needed."""
    preferred: List[Tuple[str, str, str]] = []
    if deepspeed_slurm:
        preferred.append(RANK_VARIABLES[0])
    if deepspeed_mpi:
        preferred += list(RANK_VARIABLES[1:])
    for names in (*preferred, TORCH_RANK_VARIABLES, *RANK_VARIABLES[1:], RANK_VARIABLES[0]):
        if names[0] in env:
            values = [int(env[n]) if env.get(n, "").strip() else None for n in names]
            return values[0], values[1], values[2]
    return None, None, None


def rendezvous_environment(rank: Optional[int], local_rank: Optional[int], world_size: Optional[int],
                           master_addr: Optional[str], master_port: int, env: Mapping[str, str]) -> Dict[str, str]:
    """The variables torch's env:// rendezvous reads (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)
    for a worker, whichever launcher started it. MASTER_ADDR / MASTER_PORT already in the environment (set by
    DeepSpeed's launcher, or exported in an sbatch script) win over the config's master_addr / master_port.
    Raises ValueError naming what is missing."""
    out: Dict[str, str] = {}
    problems = []
    missing = [name for name, value in (("RANK", rank), ("LOCAL_RANK", local_rank), ("WORLD_SIZE", world_size))
               if value is None]
    if missing:
        problems.append(f"this worker finds no {', '.join(missing)} (nor srun's SLURM_PROCID / SLURM_LOCALID / "
                        f"SLURM_NTASKS or mpirun's OMPI_COMM_WORLD_* variables): start it through deepy.py")
    out.update({name: str(value) for name, value in (("RANK", rank), ("LOCAL_RANK", local_rank),
                                                      ("WORLD_SIZE", world_size)) if value is not None})
    addr = env.get("MASTER_ADDR") or master_addr
    if addr:
        out["MASTER_ADDR"] = addr
    else:
        problems.append("this worker has no address of rank 0: MASTER_ADDR is not in its environment and "
                        "master_addr is not set; set master_addr to the address of rank 0's host")
    out["MASTER_PORT"] = env.get("MASTER_PORT") or str(master_port)
    if problems:
        raise ValueError("; ".join(problems))
    return out
