"""NeoXArgsDeepspeedRunner: Arguments for the DeepSpeed launcher (hosts, GPUs, multi-node launcher).

Fields, types, defaults and docs follow the GPT-NeoX argument reference."""

from dataclasses import dataclass
from typing import Literal, Optional


@dataclass
class NeoXArgsDeepspeedRunner:
    """Arguments for the DeepSpeed launcher (hosts, GPUs, multi-node launcher)."""

    hostfile: Optional[str] = None
    """
    MPI-style hostfile: one line per node, `HOSTNAME slots=N` (N GPUs, or CPU ranks on machines without
    GPUs), e.g. `worker-0 slots=8` and `worker-1 slots=8`. Hostnames are ssh names (pdsh, Open MPI) or
    slurm node names. `-H/--hostfile` on deepy.py's command line, else the DLTS_HOSTFILE environment
    variable (as in GPT-NeoX), overrides it. When none is given, DeepSpeed's runner reads /job/hostfile if
    it exists, and otherwise runs on the local node only; a hostfile that does not exist also means the
    local node, with a warning.
    """

    include: Optional[str] = None
    """
    Specify hardware resources to use during execution. String format is `NODE_SPEC[@NODE_SPEC ...]`
    where `NODE_SPEC=NAME[:SLOT[,SLOT ...]]`. If `:SLOT` is omitted, include all slots on that host.
    Example: `"worker-0@worker-1:0,2"` will use all slots. on `worker-0` and slots `[0, 2]` on
    `worker-1`.
    """

    exclude: Optional[str] = None
    """
    Specify hardware resources to NOT use during execution. Same format as include
    """

    num_nodes: int = -1
    """
    Total number of worker nodes to run on, this will use the top N hosts from the given hostfile. -1
    will use all. Cannot be combined with include / exclude.
    """

    num_gpus: Optional[int] = None
    """
    Max number of GPUs to use on each node, will use [0:N) GPU ids on each node. None / not specifying a
    value will use all. On a machine without GPUs and without a hostfile, the number of CPU ranks to
    start. Cannot be combined with include / exclude.
    """

    master_port: int = 29500
    """
    Port used by PyTorch distributed for communication during training.
    """

    master_addr: Optional[str] = None
    """
    Address of the node running rank 0, as the other nodes reach it. Several nodes: when not set,
    MASTER_ADDR from deepy.py's environment, else the first address `hostname -I` prints on the first host
    (asked over ssh before launch); workers started by srun or mpirun receive it in their config.
    """

    launcher: Literal['pdsh', 'openmpi', 'mvapich', 'slurm'] = 'pdsh'
    """
    Launcher backend for multi-node training: 'pdsh' (ssh to every host, DeepSpeed's launcher starts the
    host's ranks), 'openmpi' or 'mvapich' (mpirun over ssh starts every rank; workers read the MPI
    launcher's rank variables), 'slurm' (srun inside an allocation starts every rank; use with
    deepspeed_slurm, see configs/slurm_local.yml). Only used with several hosts, or with force_multi /
    deepspeed_slurm / deepspeed_mpi; a single node is launched directly.
    """

    force_multi: bool = False
    """
    Force multi-node training even if only one node is specified: start the workers through the launcher.
    Implied by deepspeed_slurm and deepspeed_mpi.
    """

    autotuning_run: Optional[Literal['tune', 'run']] = None
    """
    Either "tune", "run", or `None`. Run DeepSpeed's autotuner over the autotuning dict's search space (ZeRO
    stages from zero_optimization.stage as a list or 'all', times micro batch sizes): it profiles the model, runs
    each experiment as a short training launch that exits after autotuning.end_profile_step (no checkpoints; its
    logs and metrics.json in results_dir/EXPERIMENT), and writes results_dir/summary.txt,
    ds_config_optimal.json and cmd_optimal.txt. "run" then trains with the optimal config (its micro batch,
    gradient accumulation and zero_optimization, which in fast mode is the stage alone, as DeepSpeed's autotuner
    writes it; saving as configured). Example: zero_optimization: {stage: [0, 1]}, autotuning: {enabled: true,
    fast: true, max_train_micro_batch_size_per_gpu: 4}. Also deepy.py --autotuning tune|run. One
    node only, pipe_parallel_size 0.
    """

    no_ssh_check: bool = False
    """
    If true, skip the checks that every host answers passwordless ssh before launch (deepy.py checks
    every host of a pdsh / openmpi / mvapich launch, DeepSpeed's runner the first). For slurm clusters
    without ssh to the compute nodes (srun needs none).
    """

    comment: Optional[str] = None
    """
    slurm only: passed to srun as `--comment` (some clusters require one).
    """

    account: Optional[str] = None
    """
    slurm only: passed to srun as `--account` (the account the job step is charged to).
    """
