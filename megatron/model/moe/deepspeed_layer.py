"""The token-dropping mixture of experts (``moe_type: deepspeed``): DeepSpeed's MoE layer itself
(deepspeed.moe.layer.MoE, upstream DeepSpeed), as GPT-NeoX builds it.

* experts: E copies of the dense MLP (megatron.model.mlp.ParallelMLP, biases included; with moe_glu its
  activation's GLU form), each initialised on its own from the layout-independent initialiser (DeepSpeed
  deep-copies one expert, so its experts would start identical);
* gate: DeepSpeed's TopKGate (``deepspeed_moe.gate.wg``, fp32): softmax, top-1 / top-2 (its top-k beyond 2),
  the k weights renormalised for k = 2; capacity per expert ceil(k x tokens / E x capacity factor), at least
  moe_min_capacity, with moe_train_capacity_factor in training and moe_eval_capacity_factor in evaluation; routes
  over capacity are dropped (their weight is lost; a dropped token passes through the residual connection only)
  when moe_token_dropping is true, else the capacity grows to the busiest expert (no drop). Top-1 drops by
  DeepSpeed's random token selection; top-2 keeps first choices before second ones, then token order; its second
  expert is the second most probable one (DeepSpeed's sampling of the second expert is off, as Mixtral's router);
  moe_jitter_eps 0.01 is DeepSpeed's 'Jitter' noisy gate policy;
* auxiliary loss: DeepSpeed's gate loss (fp32), times moe_loss_coeff, reaches the gradients as the dropless
  layer's does (megatron.model.moe.stats);
* moe_use_residual: DeepSpeed's residual MoE, a dense MLP (``mlp``) beside the experts mixed by a learned
  2-way softmax (``coefficient``).

Parameter names are DeepSpeed's (``mlp.deepspeed_moe.gate.wg.weight``,
``mlp.deepspeed_moe.experts.deepspeed_experts.{e}.linear1.weight``, ...), and DeepSpeed's engine saves the
experts in its own files (``layer_{i}_expert_{e}_mp_rank_XX_model_states.pt``), as GPT-NeoX's checkpoints of
this layer.

Expert parallelism (moe_expert_parallel_size EP > 1): each rank of an expert-parallel group holds E / EP of the
experts (rank r: global experts r x E/EP .. (r+1) x E/EP - 1, DeepSpeed's order), and DeepSpeed's layer sends each
expert its capacity-sized slots by all-to-all over that group and back (on gloo too). The groups are the
ParallelState's (megatron.mpu.parallel_state), registered with DeepSpeed under its name ``ep_size_{EP}``; DeepSpeed
marks the expert parameters (``allreduce=False``, ``group_name``) so that its engine reduces their gradients over
the expert-data-parallel group only (averaged over all data-parallel ranks), with and without ZeRO 1 / 2, and saves
each expert in its own file, as above. An expert starts from the same initialiser entry at every EP size.
generate.py and eval.py build the model with every expert on every rank (megatron.inference.loading), from those files.
Tensor parallelism (model_parallel_size T > 1): every tensor-parallel rank holds the same tokens, the whole gate and
the same experts (replicated, as DeepSpeed's layer without expert tensor parallelism), and runs the layer exactly as
with one tensor-parallel rank: DeepSpeed is shown a single tensor-parallel rank during the layer's forward
(``_one_tensor_parallel_rank``). Why not DeepSpeed's own split (each tensor-parallel rank takes 1/T of every
expert's capacity slots, then an all-gather): it asserts a capacity divisible by T for every batch (decoding one
token per sequence breaks it) and leaves each rank a partial expert gradient, which DeepSpeed sums with
expert-data-parallel groups that span the tensor-parallel ranks; with those only one tensor-parallel rank writes the
expert files, while each reads its own ``mp_rank`` file back. Replicated, an expert's gradient is whole and equal on
the tensor-parallel ranks (counted once by the gradient norm, like any replicated parameter), reduced over the
data-parallel ranks at the same tensor-parallel rank (the ParallelState's expert groups, registered with DeepSpeed at
EP 1 too, so that DeepSpeed's own EP 1 groups, which span the tensor-parallel ranks, are not built), and each
tensor-parallel rank writes its copy in its own files. The price: the experts' work is repeated on the T ranks.
enable_expert_tensor_parallelism avoids it: each local expert is then megatron.model.mlp.ParallelMLP on the
tensor-parallel group (linear1 column-, linear2 row-parallel, built here rather than deep-copied by DeepSpeed, since
process groups do not copy), initialised as the whole expert's shard; DeepSpeed still sees one tensor-parallel rank,
so every rank keeps all its tokens (no drop / gather of capacity slots: DeepSpeed's own path gathers them with
all_gather_into_tensor into a flat buffer, which gloo refuses, and asserts a capacity divisible by T), runs its
share of every expert on them, and the row-parallel layer all-reduces the outputs. An expert shard's gradient is
whole (all tokens), reduced over the same expert-data-parallel groups; each tensor-parallel rank writes its shards
in its own ``mp_rank`` expert files (megatron.checkpoint.tensor_parallel merges them).
With sequence_parallel each tensor-parallel rank holds a chunk of the sequence; the layer all-gathers the chunks and
runs on the whole sequence as without sequence_parallel (the gate's capacity counts the same tokens, so the same ones
are dropped; the gate, replicated experts and residual MLP see every token, so their gradients are whole on each
rank and need no reduction over the tensor-parallel ranks, unlike the norms'), then keeps this rank's chunk of its
output, which is the same on every tensor-parallel rank. In a pipeline (PP x DP x TP): megatron.model.moe.pipeline.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from deepspeed.moe.layer import MoE
from deepspeed.utils import groups
from torch import nn

from megatron.model.config import ModelConfig
from megatron.model.mlp import ParallelMLP
from megatron.model.moe.stats import MoELayerBase
from megatron.model.parameter_marks import MOE_EXPERT_FLAG
from megatron.mpu import SingleProcessState, gather_from_sequence_parallel_region, scatter_to_sequence_parallel_region

JITTER_POLICY = "Jitter"


class _OneTensorParallelRank:
    """An mpu that reports one tensor-parallel rank and answers everything else as ``mpu`` does."""

    def __init__(self, mpu) -> None:
        self._mpu = mpu

    def __getattr__(self, name: str):
        return getattr(self._mpu, name)

    def get_tensor_model_parallel_world_size(self) -> int:
        return 1

    def get_tensor_model_parallel_rank(self) -> int:
        return 0

    get_model_parallel_world_size = get_tensor_model_parallel_world_size
    get_model_parallel_rank = get_tensor_model_parallel_rank


@contextlib.contextmanager
def _one_tensor_parallel_rank() -> Iterator[None]:
    """DeepSpeed's MoE layer reads the tensor-parallel size from the engine's mpu (deepspeed.utils.groups.mpu) to split
    its capacity over the tensor-parallel ranks; for the replicated layer (module docstring) it sees one rank."""
    mpu = groups.mpu
    if mpu is None or mpu.get_model_parallel_world_size() == 1:
        yield
        return
    groups.mpu = _OneTensorParallelRank(mpu)
    try:
        yield
    finally:
        groups.mpu = mpu


class _ExpertInitializer:
    """The model's initializer with the dense MLP's entries (``mlp.linear1``) named as global expert ``e``'s
    (``mlp.deepspeed_moe.experts.deepspeed_experts.{e}.linear1``): a split expert starts as the whole one."""

    def __init__(self, initializer, expert: int) -> None:
        self._initializer, self._prefix = initializer, f"mlp.deepspeed_moe.experts.deepspeed_experts.{expert}."

    def weight(self, layer_number: int, name: str):
        return self._initializer.weight(layer_number, name.replace("mlp.", self._prefix, 1))

    def output_weight(self, layer_number: int, name: str):
        return self._initializer.output_weight(layer_number, name.replace("mlp.", self._prefix, 1))


class DeepSpeedMoE(MoE, MoELayerBase):
    """deepspeed.moe.layer.MoE with the load counters and the auxiliary-loss attachment; called with the
    hidden states, returns the output (module docstring)."""

    def __init__(self, config: ModelConfig, parallel_state, initializer, layer_number: int) -> None:
        # the layer sees the whole sequence (sequence_parallel: module docstring), so its experts never split it
        expert_config = config.replace(activation=config.expert_activation, model_parallel_size=1,
                                       sequence_parallel=False)
        tp = parallel_state.get_model_parallel_world_size()
        # the expert is whole on every tensor-parallel rank: it needs no process group (DeepSpeed deep-copies it,
        # groups do not copy)
        expert = ParallelMLP(expert_config, SingleProcessState(), initializer, layer_number)
        super().__init__(
            hidden_size=config.hidden_size, expert=expert, num_experts=config.moe_num_experts,
            ep_size=config.moe_expert_parallel_size, k=config.moe_top_k,
            capacity_factor=config.moe_train_capacity_factor, eval_capacity_factor=config.moe_eval_capacity_factor,
            min_capacity=config.moe_min_capacity, use_residual=config.moe_use_residual,
            noisy_gate_policy=JITTER_POLICY if config.moe_jitter_eps is not None else None,
            drop_tokens=config.moe_token_dropping, use_rts=True, use_tutel=False,
            enable_expert_tensor_parallelism=False, top2_2nd_expert_sampling=False)
        self.setup_stats(config.moe_num_experts, layer_number, config.moe_loss_coeff)
        # with tensor parallelism the state's groups at EP 1 too (module docstring; generate.py builds the layer at
        # EP 1 in a state of the run's EP, and has no engine to reduce gradients: DeepSpeed's lookup is enough)
        tp_groups = tp > 1 and parallel_state.get_expert_parallel_world_size() == 1
        if config.moe_expert_parallel_size > 1 or tp_groups:
            if parallel_state.get_expert_parallel_world_size() != config.moe_expert_parallel_size:
                raise ValueError(f"moe_expert_parallel_size={config.moe_expert_parallel_size} but the parallel state "
                                 f"has {parallel_state.get_expert_parallel_world_size()} expert-parallel ranks")
            parallel_state.register_expert_groups_with_deepspeed()
            self.set_deepspeed_parallelism()  # finds the registered groups: the all-to-all's group is set
        self.first_expert = 0  # the global id of local expert 0 (every expert is local at EP 1, e.g. inference)
        if self.ep_size > 1:
            self.first_expert = parallel_state.get_expert_parallel_rank() * self.num_local_experts
        self.split_experts = config.enable_expert_tensor_parallelism and tp > 1
        if self.split_experts:  # each expert column / row split over the tensor-parallel ranks (module docstring)
            split_config = config.replace(activation=config.expert_activation, sequence_parallel=False)
            self.deepspeed_moe.experts.deepspeed_experts = nn.ModuleList([
                ParallelMLP(split_config, parallel_state, _ExpertInitializer(initializer, e), layer_number)
                for e in range(self.first_expert, self.first_expert + self.num_local_experts)])
            for param in self.deepspeed_moe.experts.parameters():  # DeepSpeed's expert mark (deepspeed.moe.experts)
                param.allreduce, param.group_name = False, self.expert_group_name
        self._reinitialise(initializer, layer_number)
        for param in self.deepspeed_moe.experts.parameters():
            setattr(param, MOE_EXPERT_FLAG, True)
        self._kept = 0.0
        self.deepspeed_moe.gate.register_forward_hook(self._count_kept)
        self.sequence_group = parallel_state.get_model_parallel_group() if config.sequence_parallel and tp > 1 \
            else None

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """DeepSpeed's group lookup, once: the engine calls it again at initialisation, and DeepSpeed's gate refuses
        to be given its group twice."""
        if self.deepspeed_moe.ep_group is None:
            super().set_deepspeed_parallelism(use_data_before_expert_parallel_)

    def _reinitialise(self, initializer, layer_number: int) -> None:
        """Every expert, the gate and the residual MLP from their own seeds (names as in the state dict)."""
        with torch.no_grad():
            # split experts were initialised by their tensor-parallel layers (the full tensor's shard)
            experts = [] if self.split_experts else self.deepspeed_moe.experts.deepspeed_experts
            for e, expert in enumerate(experts, start=self.first_expert):
                prefix = f"mlp.deepspeed_moe.experts.deepspeed_experts.{e}."  # the global expert's entry
                initializer.weight(layer_number, prefix + "linear1")(expert.linear1.weight)
                initializer.output_weight(layer_number, prefix + "linear2")(expert.linear2.weight)
            initializer.weight(layer_number, "mlp.deepspeed_moe.gate.wg")(self.deepspeed_moe.gate.wg.weight)
            if self.use_residual:
                initializer.weight(layer_number, "mlp.mlp.linear1")(self.mlp.linear1.weight)
                initializer.output_weight(layer_number, "mlp.mlp.linear2")(self.mlp.linear2.weight)
                initializer.weight(layer_number, "mlp.coefficient")(self.coefficient.weight)
                self.coefficient.bias.zero_()

    def _count_kept(self, _module, _inputs, output) -> None:
        """The gate's routes that fit in the capacity (DeepSpeed flags dropped ones with a negative expert)."""
        if len(output) == 7:  # a tensor: counted on the device (megatron.model.moe.stats.ExpertLoad.record)
            self._kept = (output[3] >= 0).sum()
        else:  # the dense dispatch mask [tokens, experts, capacity]
            self._kept = output[2].sum()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.sequence_group is None:
            return self._forward(hidden_states)
        # sequence_parallel (module docstring): the whole sequence in, this rank's chunk of the (equal) outputs out;
        # the input's gradient is whole on every rank, so the gather's backward only keeps this rank's chunk
        whole = gather_from_sequence_parallel_region(hidden_states, self.sequence_group, seq_dim=1,
                                                     tensor_parallel_output_grad=False)
        return scatter_to_sequence_parallel_region(self._forward(whole), self.sequence_group, seq_dim=1)

    def _forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        gate = self.deepspeed_moe.gate
        tokens = hidden_states.numel() // hidden_states.shape[-1]
        floor = gate.min_capacity
        if gate.k == 1 and tokens < floor:
            # DeepSpeed's top-1 gate asserts tokens >= min_capacity (KV-cache decoding has one token per sequence);
            # a capacity of all the tokens drops nothing either, so lowering the floor to them is the same function
            gate.min_capacity = tokens
        try:
            with _one_tensor_parallel_rank():
                output, aux, counts = MoE.forward(self, hidden_states)
        finally:
            gate.min_capacity = floor
        return self._finish(output, aux, counts, self._kept)
