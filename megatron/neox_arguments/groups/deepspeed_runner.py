"""NeoXArgsDeepspeedRunner: Arguments for the DeepSpeed launcher (hosts, GPUs, multi-node launcher).

Fields, types, defaults and docs follow the GPT-NeoX argument reference."""

from dataclasses import dataclass
from typing import Literal, Optional


@dataclass
class NeoXArgsDeepspeedRunner:
    """Arguments for the DeepSpeed launcher (hosts, GPUs, multi-node launcher)."""

    hostfile: Optional[str] = None
    """
    list of hostnames / ssh aliases and the number of GPUs per host example file contents: worker-1
    slots=4 worker-2 slots=4 127.0.0 slots=4 127.0.1 slots=4
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
    will use all.
    """

    num_gpus: Optional[int] = None
    """
    Max number of GPUs to use on each node, will use [0:N) GPU ids on each node. None / not specifying a
    value will use all.
    """

    master_port: int = 29500
    """
    Port used by PyTorch distributed for communication during training.
    """

    master_addr: Optional[str] = None
    """
    IP address of node 0, will be inferred via 'hostname -I' if not specified.
    """

    launcher: Literal['pdsh', 'openmpi', 'mvapich', 'slurm'] = 'pdsh'
    """
    Launcher backend for multi-node training. Options currently include PDSH, OpenMPI, MVAPICH.
    """

    force_multi: bool = False
    """
    Force multi-node training even if only one node is specified.
    """

    autotuning_run: Optional[str] = None
    """
    Either "tune", "run", or `None`.
    """

    no_ssh_check: bool = False
    """
    If true, overrides the default check where DeepSpeed confirms that the headnode is accessible via
    ssh.
    """

    comment: Optional[str] = None
    """
    Adds a `--comment` to the DeepSpeed launch command. In DeeperSpeed this is passed on to the
    SlurmLauncher as well. Sometimes necessary for cluster rules, or so I've heard.
    """

    account: Optional[str] = None
    """
    Adds a `--account` to the DeepSpeed launch command. In DeeperSpeed this is passed on to the
    SlurmLauncher as well. Sometimes necessary for cluster rules, or so I've heard.
    """
