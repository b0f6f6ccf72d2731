"""The argv deepy.py hands to DeepSpeed's runner (deepspeed.launcher.runner.main).

Only options the user set are passed, so the runner's own defaults (e.g. /job/hostfile) stay in force.
slurm's comment and account go through --launcher_args because upstream DeepSpeed's runner has no
options of its own for them."""

import shlex
from typing import List

from megatron.neox_arguments.groups import NeoXArgsSchema
from megatron.neox_arguments.hostfile import is_local_launch

ENCODED_CONFIG_FLAG = "--neox_config"
"""The worker argument that carries the whole validated config."""


def deepspeed_runner_argv(args: NeoXArgsSchema) -> List[str]:
    """Runner options, then the user script, then the encoded config (args.encode()) for every worker."""
    if not args.user_script:
        raise ValueError("user_script is not set; deepy.py sets it from its first argument")
    argv: List[str] = []
    if args.hostfile:
        argv += ["--hostfile", args.hostfile]
    if args.include:
        argv += ["--include", args.include]
    if args.exclude:
        argv += ["--exclude", args.exclude]
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
        argv += ["--master_addr", args.master_addr]
    argv += ["--launcher", args.launcher]
    launcher_args: List[str] = []
    if args.comment:
        launcher_args += ["--comment", args.comment]
    if args.account:
        launcher_args += ["--account", args.account]
    if launcher_args:
        argv += ["--launcher_args", shlex.join(launcher_args)]
    if args.force_multi:
        argv.append("--force_multi")
    if args.no_ssh_check:
        argv.append("--no_ssh_check")
    argv.append(args.user_script)
    argv += [ENCODED_CONFIG_FLAG, args.encode()]
    return argv
