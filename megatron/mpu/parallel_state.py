"""The pipe x data x model topology of a run and its process groups, held in one object.

Why an object: tests (and tools that reshard checkpoints) must be able to build and tear down several
layouts in one process, so nothing is kept in module globals. The object also serves as the ``mpu``
that DeepSpeed expects (``get_model_parallel_group`` and friends, plus the ``get_tensor_model_parallel_*``
names DeepSpeed 0.19 calls).

Rank order follows GPT-NeoX / DeepSpeed's ``PipeModelDataParallelTopology``: axes (pipe, data, model)
with the model axis varying fastest, so the ranks of one tensor-parallel group are adjacent.
"""
from __future__ import annotations

import datetime
from typing import Dict, List, Optional

import torch.distributed as dist


def _topology_class():
    """Imported lazily: DeepSpeed's import is slow and only the pipeline needs it."""
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    return PipeModelDataParallelTopology


class ParallelState:
    """Owns the process groups of one (pipe, data, model) layout of an initialised world.

    ``pipe_parallel_size`` 0 means "no pipeline" and is treated as one stage, as in GPT-NeoX.
    Every rank of the world must construct it (``new_group`` is collective), and every rank must call
    :meth:`destroy` when done.
    """

    def __init__(self, pipe_parallel_size: int, model_parallel_size: int,
                 timeout: Optional[datetime.timedelta] = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("ParallelState needs an initialised torch.distributed world")
        if model_parallel_size < 1:
            raise ValueError(f"model_parallel_size must be >= 1, got {model_parallel_size}")
        if pipe_parallel_size < 0:
            raise ValueError(f"pipe_parallel_size must be >= 0, got {pipe_parallel_size}")
        world = dist.get_world_size()
        pipe = max(pipe_parallel_size, 1)
        if world % (pipe * model_parallel_size) != 0:
            raise ValueError(
                f"world size {world} is not divisible by pipe_parallel_size ({pipe}) x "
                f"model_parallel_size ({model_parallel_size})"
            )
        self.world_size = world
        self.rank = dist.get_rank()
        self.pipe_parallel_size = pipe
        self.model_parallel_size = model_parallel_size
        self.data_parallel_size = world // (pipe * model_parallel_size)
        self.topology = _topology_class()(
            num_pp=pipe, num_mp=model_parallel_size, num_dp=self.data_parallel_size
        )
        self._groups: Dict[str, object] = {}
        self._group_ranks: Dict[str, List[int]] = {}
        self._all_groups: List[object] = []
        for axis in ("pipe", "data", "model"):
            for ranks in self.topology.get_axis_comm_lists(axis):
                group = dist.new_group(ranks=ranks, timeout=timeout)  # None: torch's default (30 min)
                self._all_groups.append(group)
                if self.rank in ranks:
                    self._groups[axis] = group
                    self._group_ranks[axis] = list(ranks)
        coord = self.topology.get_coord(self.rank)
        self._coord = {"pipe": coord.pipe, "data": coord.data, "model": coord.model}
        self._destroyed = False

    # --- generic accessors -------------------------------------------------------------------
    def group(self, axis: str):
        """The process group of this rank along ``axis`` ('pipe', 'data' or 'model')."""
        self._check_alive()
        return self._groups[axis]

    def group_ranks(self, axis: str) -> List[int]:
        """Global ranks in this rank's group along ``axis``, in group-rank order."""
        return list(self._group_ranks[axis])

    def coordinate(self, axis: str) -> int:
        """This rank's index along ``axis``."""
        return self._coord[axis]

    def get_topology(self):
        """The DeepSpeed topology object, for ``PipelineModule(topology=...)``."""
        return self.topology

    # --- model (tensor) parallel -------------------------------------------------------------
    def get_model_parallel_group(self):
        return self.group("model")

    def get_model_parallel_rank(self) -> int:
        return self._coord["model"]

    def get_model_parallel_world_size(self) -> int:
        return self.model_parallel_size

    def get_model_parallel_src_rank(self) -> int:
        """Global rank of the first rank of this rank's model-parallel group (batch broadcast source)."""
        return self._group_ranks["model"][0]

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_src_rank = get_model_parallel_src_rank
    get_slice_parallel_group = get_model_parallel_group
    get_slice_parallel_rank = get_model_parallel_rank
    get_slice_parallel_world_size = get_model_parallel_world_size

    # --- data parallel -----------------------------------------------------------------------
    def get_data_parallel_group(self):
        return self.group("data")

    def get_data_parallel_rank(self) -> int:
        return self._coord["data"]

    def get_data_parallel_world_size(self) -> int:
        return self.data_parallel_size

    def get_data_parallel_group_ranks(self) -> List[int]:
        return self.group_ranks("data")

    # --- pipeline parallel -------------------------------------------------------------------
    def get_pipe_parallel_group(self):
        return self.group("pipe")

    def get_pipe_parallel_rank(self) -> int:
        return self._coord["pipe"]

    def get_pipe_parallel_world_size(self) -> int:
        return self.pipe_parallel_size

    get_pipeline_model_parallel_group = get_pipe_parallel_group
    get_pipeline_model_parallel_rank = get_pipe_parallel_rank
    get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size

    def is_first_pipe_stage(self) -> bool:
        return self._coord["pipe"] == 0

    def is_last_pipe_stage(self) -> bool:
        return self._coord["pipe"] == self.pipe_parallel_size - 1

    # --- lifetime ----------------------------------------------------------------------------
    def destroy(self) -> None:
        """Free every process group this object created (idempotent)."""
        if self._destroyed:
            return
        for group in self._all_groups:
            dist.destroy_process_group(group)
        self._all_groups.clear()
        self._groups.clear()
        self._destroyed = True

    def _check_alive(self) -> None:
        if self._destroyed:
            raise RuntimeError("this ParallelState has been destroyed")

    def __repr__(self) -> str:
        return (
            f"ParallelState(rank={self.rank}, pipe={self.pipe_parallel_size}, "
            f"data={self.data_parallel_size}, model={self.model_parallel_size}, coord={self._coord})"
        )


def build_parallel_state(neox_args) -> ParallelState:
    """Build the ParallelState from ``neox_args.pipe_parallel_size`` and ``model_parallel_size``."""
    return ParallelState(pipe_parallel_size=neox_args.pipe_parallel_size,
                         model_parallel_size=neox_args.model_parallel_size,
                         timeout=datetime.timedelta(minutes=neox_args.distributed_timeout_minutes))


class SingleProcessState:
    """The layout of a lone process with no torch.distributed world: every size is 1, no groups.

    Lets the model and its unit tests run without initialising a process group; collectives skip
    communication when their group's size is 1, so ``None`` groups are never used.
    """

    world_size = 1
    rank = 0
    pipe_parallel_size = 1
    model_parallel_size = 1
    data_parallel_size = 1

    def get_model_parallel_group(self):
        return None

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_src_rank(self) -> int:
        return 0

    get_data_parallel_group = get_model_parallel_group
    get_data_parallel_rank = get_model_parallel_rank
    get_data_parallel_world_size = get_model_parallel_world_size
    get_pipe_parallel_group = get_model_parallel_group
    get_pipe_parallel_rank = get_model_parallel_rank
    get_pipe_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_src_rank = get_model_parallel_src_rank

    def is_first_pipe_stage(self) -> bool:
        return True

    def is_last_pipe_stage(self) -> bool:
        return True

    def destroy(self) -> None:
        """Nothing to free."""
