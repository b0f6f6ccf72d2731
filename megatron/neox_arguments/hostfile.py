"""Counting the ranks a launch will start, the way DeepSpeed's runner will count them.

deepy.py must know global_num_gpus before any process exists (to derive the data-parallel size and the
batch triple), so it reads the same hostfile with the same include / exclude / num_nodes / num_gpus
filters that the runner applies, using the runner's own parsing functions. A hostfile path that does not
exist (GPT-NeoX's 125M.yml ships `hostfile: /mock_path`) means the local node, with one warning: the runner
falls back to the local node for it, and so does GPT-NeoX."""

import os
import warnings
from typing import Dict, List, Optional

from megatron.errors import ConfigError, NeoXConfigWarning

DEFAULT_HOSTFILE = "/job/hostfile"
"""DeepSpeed's runner reads this file when no hostfile is given; so do we."""


def active_resources(hostfile: str, include: Optional[str], exclude: Optional[str],
                     num_nodes: int, num_gpus: Optional[int]) -> Dict[str, List[int]]:
    """Hosts and slots that DeepSpeed's runner will use for this hostfile and filters."""
    from deepspeed.launcher.runner import _parse_hostfile, parse_inclusion_exclusion

    try:
        with open(hostfile, encoding="utf-8") as handle:
            pool = _parse_hostfile(handle.readlines())
    except OSError as exc:
        raise ConfigError([f"hostfile '{hostfile}' cannot be read: {exc.strerror}"]) from None
    except ValueError as exc:
        raise ConfigError([f"hostfile '{hostfile}': {exc} (each line must read 'HOSTNAME slots=N')"]) from None
    try:
        resources = parse_inclusion_exclusion(pool, include or "", exclude or "")
    except ValueError as exc:
        raise ConfigError([f"include/exclude ({include or exclude!r}) do not fit hostfile '{hostfile}': {exc}"]) from None
    hosts = list(resources.items())
    if num_nodes is not None and num_nodes > 0:
        hosts = hosts[:num_nodes]
    if num_gpus is not None and num_gpus > 0:
        hosts = [(host, slots[:num_gpus]) for host, slots in hosts]
    return dict(hosts)


def local_device_count() -> int:
    """GPUs on this machine, or 1 (one CPU rank) where there are none."""
    import torch

    return max(torch.cuda.device_count(), 1) if torch.cuda.is_available() else 1


def count_global_ranks(hostfile: Optional[str], include: Optional[str], exclude: Optional[str],
                       num_nodes: int, num_gpus: Optional[int]) -> int:
    """global_num_gpus: from the hostfile and its filters, else num_gpus x nodes, else the local devices."""
    if not hostfile and os.path.isfile(DEFAULT_HOSTFILE):
        hostfile = DEFAULT_HOSTFILE
    elif hostfile and not os.path.exists(hostfile):
        warnings.warn(f"hostfile '{hostfile}' does not exist; running on the local node only (DeepSpeed's runner "
                      f"and GPT-NeoX do the same); set hostfile to a real file for several nodes, or delete the key",
                      NeoXConfigWarning, stacklevel=2)
        hostfile = None
    if hostfile:
        return sum(len(slots) for slots in active_resources(hostfile, include, exclude, num_nodes, num_gpus).values())
    per_node = num_gpus if num_gpus is not None and num_gpus > 0 else local_device_count()
    return per_node * (num_nodes if num_nodes is not None and num_nodes > 0 else 1)


def is_local_launch(hostfile: Optional[str]) -> bool:
    """Whether DeepSpeed's runner, given this hostfile (or none), starts the ranks on this node only."""
    if not hostfile:
        return not os.path.isfile(DEFAULT_HOSTFILE)
    return not os.path.exists(hostfile)
