"""The pipe x data x context x model topology of a run and its process groups, held in one object.

Why an object: tests (and tools that reshard checkpoints) must be able to build and tear down several
layouts in one process, so nothing is kept in module globals. The object also serves as the ``mpu``
that DeepSpeed expects (``get_model_parallel_group`` and friends, plus the ``get_tensor_model_parallel_*``
names DeepSpeed 0.19 calls).

Rank order follows GPT-NeoX / DeepSpeed's ``PipeModelDataParallelTopology``: axes (pipe, data, model)
with the model axis varying fastest, so the ranks of one tensor-parallel group are adjacent. With
``context_parallel_size`` C > 1 a context axis sits between data and model (Megatron-LM's order: tensor, then
context, then data, then pipeline): the C ranks of a context-parallel group hold the chunks of the same samples'
sequences (megatron.mpu.context_parallel). For DeepSpeed they are its sequence-parallel group (the
``get_sequence_parallel_*`` names) and data x context is its ``get_sequence_data_parallel_*`` group, over which
DeepSpeed sums gradients (and shards ZeRO states and writes checkpoints once) while dividing by the data-parallel
size only; the data-parallel group itself (which samples a rank reads) stays the data axis.

Expert parallelism (``expert_parallel_size`` > 1, a mixture of experts' moe_expert_parallel_size) is carved out
of each data-parallel group, as DeepSpeed's ``deepspeed.utils.groups`` lays it out: the data-parallel ranks
d0 .. d(D-1) form expert-parallel groups of EP consecutive ones (d0..d(EP-1), ...: the experts are split over
them, tokens are exchanged between them by all-to-all), and the ranks at the same place in each of those form an
expert-data-parallel group (d0, d(EP), d(2EP), ...: they hold the same experts, whose gradients are reduced over
it). With tensor parallelism the data-parallel groups, hence the expert groups, join ranks at the same
tensor-parallel rank (each tensor-parallel rank exchanges tokens for its own share of the experts).
``register_expert_groups_with_deepspeed`` hands these groups to DeepSpeed (its MoE layer and engine look
them up by the name ``ep_size_{EP}``) instead of letting it build copies; ``destroy`` takes them back.
``expert_groups_at_one`` builds them at EP 1 too (one-rank expert-parallel groups, the data-parallel groups as
expert-data-parallel ones): DeepSpeed's MoE layer with tensor parallelism needs them, since DeepSpeed's own groups
at EP 1 would reduce its expert gradients over the tensor-parallel ranks as well (megatron.model.moe.deepspeed_layer).
"""
from __future__ import annotations

import datetime
from typing import Dict, List, Optional, Tuple

import torch.distributed as dist
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology, ProcessTopology
from deepspeed.utils import groups


def _topology(pipe: int, data: int, context: int, model: int):
    """DeepSpeed's topology object (imported lazily: DeepSpeed's import is slow). Without context parallelism it
    is the PipeModelDataParallelTopology the pipeline engine expects."""
    if context == 1:
        return PipeModelDataParallelTopology(num_pp=pipe, num_mp=model, num_dp=data)
    return ProcessTopology(axes=["pipe", "data", "context", "model"], dims=[pipe, data, context, model])


def expert_parallel_ranks(data_parallel_lists: List[List[int]], expert_parallel_size: int
                          ) -> Tuple[List[List[int]], List[List[int]]]:
    """(expert-parallel groups, expert-data-parallel groups) carved out of the data-parallel groups (module
    docstring): each data-parallel group's ranks in runs of ``expert_parallel_size``, and the ranks at the same place
    in those runs. DeepSpeed's deepspeed.utils.groups._get_expert_parallel_ranks lays them out alike."""
    ep = expert_parallel_size
    expert, expert_data = [], []
    for ranks in data_parallel_lists:
        runs = [list(ranks[i:i + ep]) for i in range(0, len(ranks), ep)]
        expert += runs
        expert_data += [list(column) for column in zip(*runs)]
    return expert, expert_data


class ParallelState:
    """Owns the process groups of one (pipe, data, context, model) layout of an initialised world.

    ``pipe_parallel_size`` 0 means "no pipeline" and is treated as one stage, as in GPT-NeoX.
    Every rank of the world must construct it (``new_group`` is collective), and every rank must call
    :meth:`destroy` when done.
    """

    def __init__(self, pipe_parallel_size: int, model_parallel_size: int,
                 timeout: Optional[datetime.timedelta] = None, expert_parallel_size: int = 1,
                 context_parallel_size: int = 1, expert_groups_at_one: bool = False) -> None:
        if not dist.is_initialized():
            raise RuntimeError("ParallelState needs an initialised torch.distributed world")
        if model_parallel_size < 1:
            raise ValueError(f"model_parallel_size must be >= 1, got {model_parallel_size}")
        if pipe_parallel_size < 0:
            raise ValueError(f"pipe_parallel_size must be >= 0, got {pipe_parallel_size}")
        if context_parallel_size < 1:
            raise ValueError(f"context_parallel_size must be >= 1, got {context_parallel_size}")
        world = dist.get_world_size()
        pipe = max(pipe_parallel_size, 1)
        if world % (pipe * context_parallel_size * model_parallel_size) != 0:
            raise ValueError(
                f"world size {world} is not divisible by pipe_parallel_size ({pipe}) x "
                f"context_parallel_size ({context_parallel_size}) x model_parallel_size ({model_parallel_size})"
            )
        self.world_size = world
        self.rank = dist.get_rank()
        self.pipe_parallel_size = pipe
        self.model_parallel_size = model_parallel_size
        self.context_parallel_size = context_parallel_size
        self.data_parallel_size = world // (pipe * context_parallel_size * model_parallel_size)
        self.topology = _topology(pipe, self.data_parallel_size, context_parallel_size, model_parallel_size)
        self._groups: Dict[str, object] = {}
        self._group_ranks: Dict[str, List[int]] = {}
        self._all_groups: List[object] = []
        coord = self.topology.get_coord(self.rank)
        self._coord = {"pipe": coord.pipe, "data": coord.data, "model": coord.model,
                       "context": getattr(coord, "context", 0)}
        axes = {axis: self.topology.get_axis_comm_lists(axis) for axis in ("pipe", "data", "model")}
        if context_parallel_size > 1:
            axes["context"] = self.topology.get_axis_comm_lists("context")
            axes["data_context"] = self._data_context_lists()
        for axis, lists in axes.items():
            for ranks in lists:
                group = dist.new_group(ranks=ranks, timeout=timeout)  # None: torch's default (30 min)
                self._all_groups.append(group)
                if self.rank in ranks:
                    self._groups[axis] = group
                    self._group_ranks[axis] = list(ranks)
        if context_parallel_size == 1:  # the data axis is the data x context one; no group of one rank
            self._groups["data_context"], self._group_ranks["data_context"] = \
                self._groups["data"], self._group_ranks["data"]
            self._groups["context"], self._group_ranks["context"] = None, [self.rank]
        self._destroyed = False
        self._registered_with_deepspeed = False
        self.expert_parallel_size = expert_parallel_size
        self._build_expert_groups(timeout, expert_groups_at_one)

    def _build_expert_groups(self, timeout: Optional[datetime.timedelta], at_one: bool) -> None:
        """The expert-parallel and expert-data-parallel groups (module docstring); none for one expert rank unless
        ``at_one``."""
        ep, dp = self.expert_parallel_size, self.data_parallel_size
        if ep < 1 or dp % ep:
            raise ValueError(f"moe_expert_parallel_size={ep} must be >= 1 and divide the data-parallel size {dp} "
                             f"(the experts are split over groups of data-parallel ranks)")
        if ep == 1 and not at_one:
            return
        expert_lists, expert_data_lists = expert_parallel_ranks(self.topology.get_axis_comm_lists("data"), ep)
        for axis, lists in (("expert", expert_lists), ("expert_data", expert_data_lists)):
            for ranks in lists:
                group = dist.new_group(ranks=ranks, timeout=timeout)
                self._all_groups.append(group)
                if self.rank in ranks:
                    self._groups[axis] = group
                    self._group_ranks[axis] = list(ranks)
                    self._coord[axis] = ranks.index(self.rank)

    def _data_context_lists(self) -> List[List[int]]:
        """The ranks that share a (pipe, model) coordinate: data x context groups, in (data, context) order."""
        lists: Dict[tuple, List[int]] = {}
        for rank in range(self.world_size):
            c = self.topology.get_coord(rank)
            lists.setdefault((c.pipe, c.model), []).append(rank)
        return [sorted(ranks) for ranks in lists.values()]

    # --- generic accessors -------------------------------------------------------------------
    def group(self, axis: str):
        """The process group of this rank along ``axis`` ('pipe', 'data', 'context', 'model' or 'data_context';
        the context group is None without context parallelism; 'expert' and 'expert_data' with expert
        parallelism)."""
        self._check_alive()
        return self._groups[axis]

    def group_ranks(self, axis: str) -> List[int]:
        """Global ranks in this rank's group along ``axis``, in group-rank order."""
        return list(self._group_ranks[axis])

    def coordinate(self, axis: str) -> int:
        """This rank's index along ``axis``."""
        return self._coord[axis]

    def get_topology(self):
        """The DeepSpeed topology for ``PipelineModule(topology=...)``. With context parallelism it is the
        (pipe, data x context, model) one: DeepSpeed's pipeline engine has no context axis, and in this rank
        order data x context is one axis, so its p2p still joins the same (data, context, model) coordinate of
        adjacent stages and its gradient all-reduce (and ZeRO-1 partitioning) spans data x context, as the
        plain engine's does (megatron.model.gpt2_model.loss_function scales the loss's gradient for its
        division by that size)."""
        if self.context_parallel_size == 1:
            return self.topology

        return PipeModelDataParallelTopology(num_pp=self.pipe_parallel_size, num_mp=self.model_parallel_size,
                                             num_dp=self.data_parallel_size * self.context_parallel_size)

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

    # --- expert parallel (mixture of experts) -------------------------------------------------
    @property
    def expert_group_name(self) -> str:
        """DeepSpeed's name of this expert-parallel layout (its MoE layer's ``expert_group_name``)."""
        return f"ep_size_{self.expert_parallel_size}"

    def get_expert_parallel_group(self):
        """The ranks that split one set of experts between them (None for one expert-parallel rank)."""
        return self.group("expert") if self.expert_parallel_size > 1 else None

    def get_expert_parallel_rank(self) -> int:
        return self._coord.get("expert", 0)

    def get_expert_parallel_world_size(self) -> int:
        return self.expert_parallel_size

    def get_expert_data_parallel_group(self):
        """The ranks holding the same experts, over which their gradients are reduced."""
        return self.group("expert_data") if self.expert_parallel_size > 1 else self.group("data")

    def get_expert_data_parallel_rank(self) -> int:
        return self._coord.get("expert_data", self._coord["data"])

    def get_expert_data_parallel_world_size(self) -> int:
        return self.data_parallel_size // self.expert_parallel_size

    def register_expert_groups_with_deepspeed(self) -> None:
        """Put the expert groups into deepspeed.utils.groups under ``expert_group_name`` (idempotent), so that
        DeepSpeed's MoE layer and engine use them rather than building their own."""
        if "expert" not in self._groups or self._registered_with_deepspeed:
            return

        name = self.expert_group_name
        groups._EXPERT_PARALLEL_GROUP[name] = self.group("expert")
        groups._EXPERT_PARALLEL_GROUP_RANKS[name] = self.group_ranks("expert")
        groups._EXPERT_DATA_PARALLEL_GROUP[name] = self.group("expert_data")
        groups._EXPERT_DATA_PARALLEL_GROUP_RANKS[name] = self.group_ranks("expert_data")
        self._registered_with_deepspeed = True

    def _unregister_expert_groups(self) -> None:
        if not self._registered_with_deepspeed:
            return

        for table in (groups._EXPERT_PARALLEL_GROUP, groups._EXPERT_PARALLEL_GROUP_RANKS,
                      groups._EXPERT_DATA_PARALLEL_GROUP, groups._EXPERT_DATA_PARALLEL_GROUP_RANKS):
            table.pop(self.expert_group_name, None)
        self._registered_with_deepspeed = False

    # --- context parallel (DeepSpeed: sequence parallel) ---------------------------------------
    def get_context_parallel_group(self):
        return self.group("context")

    def get_context_parallel_rank(self) -> int:
        return self._coord["context"]

    def get_context_parallel_world_size(self) -> int:
        return self.context_parallel_size

    get_sequence_parallel_group = get_context_parallel_group
    get_sequence_parallel_rank = get_context_parallel_rank
    get_sequence_parallel_world_size = get_context_parallel_world_size

    def get_sequence_data_parallel_group(self):
        """Data x context ranks: DeepSpeed sums gradients over them and divides by the data-parallel size."""
        return self.group("data_context")

    def get_sequence_data_parallel_rank(self) -> int:
        return self._group_ranks["data_context"].index(self.rank)

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.data_parallel_size * self.context_parallel_size

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
        self._unregister_expert_groups()
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
            f"data={self.data_parallel_size}, context={self.context_parallel_size}, "
            f"model={self.model_parallel_size}, coord={self._coord})"
        )


def build_parallel_state(neox_args) -> ParallelState:
    """Build the ParallelState from ``neox_args.pipe_parallel_size``, ``context_parallel_size``,
    ``model_parallel_size`` and (for a mixture of experts) ``moe_expert_parallel_size`` (and expert groups at EP 1
    for DeepSpeed's layer with tensor parallelism)."""
    experts = getattr(neox_args, "moe_num_experts", 1) > 1
    deepspeed_tp = experts and neox_args.moe_type == "deepspeed" and neox_args.model_parallel_size > 1
    return ParallelState(pipe_parallel_size=neox_args.pipe_parallel_size,
                         model_parallel_size=neox_args.model_parallel_size,
                         timeout=datetime.timedelta(minutes=neox_args.distributed_timeout_minutes),
                         expert_parallel_size=neox_args.moe_expert_parallel_size if experts else 1,
                         context_parallel_size=neox_args.context_parallel_size, expert_groups_at_one=deepspeed_tp)


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
    context_parallel_size = 1

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
    get_expert_parallel_group = get_model_parallel_group
    get_expert_parallel_rank = get_model_parallel_rank
    get_expert_parallel_world_size = get_model_parallel_world_size
    get_expert_data_parallel_group = get_model_parallel_group
    get_expert_data_parallel_rank = get_model_parallel_rank
    get_expert_data_parallel_world_size = get_model_parallel_world_size
    expert_parallel_size = 1
    get_context_parallel_group = get_model_parallel_group
    get_context_parallel_rank = get_model_parallel_rank
    get_context_parallel_world_size = get_model_parallel_world_size
    get_sequence_data_parallel_world_size = get_model_parallel_world_size

    def register_expert_groups_with_deepspeed(self) -> None:
        """Nothing to register: one expert-parallel rank."""
    def is_first_pipe_stage(self) -> bool:
        return True

    def is_last_pipe_stage(self) -> bool:
        return True

    def destroy(self) -> None:
        """Nothing to free."""
