"""The GPT model as a list of layer specs, run as a DeepSpeed PipelineModule or as a plain module.

Layers, in order: EmbeddingPipe, num_layers x ParallelTransformerLayerPipe, NormPipe, output head
(``ParallelLinearPipe``, or the embedding again through TiedLayerSpec unless no_weight_tying).
Inputs are GPT-NeoX's batch format ((tokens, position_ids, attention_mask), (labels, loss_mask));
the model returns this rank's vocabulary shard of the logits and ``cross_entropy_loss`` reduces them.

* ``GPT2ModelPipe`` (pipe_parallel_size >= 1): a PipelineModule over ``parallel_state``'s topology,
  partitioned by ``pipe_partition_method``; activation checkpointing every ``checkpoint_num_layers``
  transformer layers with DeepSpeed's checkpoint, restricted to the transformer layers
  (``checkpointable_layers``: the first stage takes integer tokens, which reentrant checkpointing rejects).
* ``GPT2ModelSequential`` (pipe_parallel_size 0): the same layers in an nn.Module with the same forward
  and loss; it also takes an explicit ``KVCache`` for incremental decoding.
"""
from __future__ import annotations

from functools import partial
from typing import List, Optional, Tuple

import deepspeed
import torch
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from torch import nn

from megatron.model.attention import check_attention_type
from megatron.model.embedding import EmbeddingPipe, NormPipe, ParallelLinearPipe, tied_logits
from megatron.model.init_functions import Initializer
from megatron.model.fused import model_fused_ops
from megatron.model.kv_cache import KVCache
from megatron.model.transformer import ParallelTransformerLayerPipe, check_layer_options
from megatron.model.activation_checkpointing import (
    checkpoint_function,
    checkpointing_enabled,
    checkpointing_rng_tracker,
    configure_activation_checkpointing,
)
from megatron.deepspeed_comm import init_deepspeed_comm
from megatron.mpu import RNGStatesTracker, model_parallel_seed, vocab_parallel_cross_entropy

Batch = Tuple[Tuple[torch.Tensor, torch.Tensor, torch.Tensor], Tuple[torch.Tensor, torch.Tensor]]


def cross_entropy_loss(logits: torch.Tensor, labels_and_mask: Tuple[torch.Tensor, torch.Tensor],
                       group=None, half_precision_loss: bool = False) -> torch.Tensor:
    """Mean vocabulary-parallel cross entropy over the tokens where loss_mask is 1.

    Per-token losses are computed in fp32, or in the logits' dtype with ``half_precision_loss``
    (fp16_lm_cross_entropy); the masked mean is always taken in fp32.
    """
    labels, loss_mask = labels_and_mask
    losses = vocab_parallel_cross_entropy(logits, labels, group, keep_dtype=half_precision_loss).float()
    loss_mask = loss_mask.reshape(-1).float()
    return torch.sum(losses.reshape(-1) * loss_mask) / loss_mask.sum().clamp(min=1.0)


def loss_function(neox_args, parallel_state):
    """The model's loss: ``loss_fn(logits, (labels, loss_mask))``."""
    return partial(cross_entropy_loss, group=parallel_state.get_model_parallel_group(),
                   half_precision_loss=bool(getattr(neox_args, "fp16_lm_cross_entropy", False)))


def _check_model_options(neox_args) -> None:
    check_layer_options(neox_args)
    model_fused_ops(neox_args)  # fusion flags that cannot be used here fail now, naming the flag
    config = neox_args.attention_config
    if len(config) != int(neox_args.num_layers):
        raise ValueError(f"attention_config has {len(config)} entries for num_layers={neox_args.num_layers} "
                         "(it must be expanded to one type per layer)")
    for kind in config:
        check_attention_type(kind)
    if getattr(neox_args, "precision", "fp32") == "fp16" and not torch.cuda.is_available():
        raise ValueError("precision='fp16' needs a GPU; use fp32 or bfloat16 on CPU")


def model_dtype(neox_args) -> torch.dtype:
    return {"fp16": torch.float16, "bfloat16": torch.bfloat16}.get(getattr(neox_args, "precision", "fp32"),
                                                                    torch.float32)


def _tied(neox_args) -> bool:
    return not bool(getattr(neox_args, "no_weight_tying", False))


class GPT2ModelSequential(nn.Module):
    """All layers on one pipeline stage, called in order; optional explicit KV cache."""

    def __init__(self, neox_args, parallel_state, rng_tracker=None) -> None:
        super().__init__()
        _check_model_options(neox_args)
        rng_tracker = _model_tracker(neox_args, parallel_state, rng_tracker)
        init = Initializer(neox_args)
        self.embedding = EmbeddingPipe(neox_args, parallel_state, init, rng_tracker)
        self.layers = nn.ModuleList(
            ParallelTransformerLayerPipe(neox_args, parallel_state, init, i, rng_tracker)
            for i in range(int(neox_args.num_layers)))
        self.final_norm = NormPipe(neox_args, parallel_state)
        self.head = None if _tied(neox_args) else ParallelLinearPipe(neox_args, parallel_state, init)
        self.checkpoint_every = int(getattr(neox_args, "checkpoint_num_layers", 1) or 1) \
            if getattr(neox_args, "checkpoint_activations", False) else 0
        self.loss_fn = loss_function(neox_args, parallel_state)

    @classmethod
    def from_parts(cls, embedding: EmbeddingPipe, layers: List[nn.Module], final_norm: NormPipe,
                   head: Optional[nn.Module], loss_fn, checkpoint_every: int = 0) -> "GPT2ModelSequential":
        """A sequential model over existing (already initialised) layers; parameters are shared."""
        model = cls.__new__(cls)
        nn.Module.__init__(model)
        model.embedding, model.layers, model.final_norm, model.head = embedding, nn.ModuleList(layers), \
            final_norm, head
        model.checkpoint_every, model.loss_fn = checkpoint_every, loss_fn
        return model

    def forward(self, inputs, kv_cache: Optional[KVCache] = None, logits_to_keep: Optional[int] = None
                ) -> torch.Tensor:
        """Logits [batch, seq, vocab shard]; `logits_to_keep` = n computes them for the last n positions only
        (decoding needs one: the output head over a 50k vocabulary dominates a prompt's forward otherwise)."""
        if kv_cache is not None and self.embedding.sequence_parallel:
            raise ValueError("KV-cache decoding with sequence_parallel is not supported; build the "
                             "inference model with sequence_parallel=False (weights are identical)")
        hidden, mask = self.embedding(tuple(inputs))
        if self.checkpoint_every and self.training and kv_cache is None:
            hidden = self._checkpointed_layers(hidden, mask)
        else:
            for layer in self.layers:
                hidden, mask = layer((hidden, mask), kv_cache)
        if logits_to_keep is not None:
            if self.embedding.sequence_parallel:
                raise ValueError("logits_to_keep needs sequence_parallel=False (the sequence is split over ranks)")
            hidden = hidden[:, -logits_to_keep:]
        hidden = self.final_norm((hidden, mask))
        logits = tied_logits(self.embedding, hidden) if self.head is None else self.head(hidden)
        if kv_cache is not None:
            kv_cache.advance(inputs[0].size(1))
        return logits

    def _checkpointed_layers(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        def run(start: int, end: int):
            def body(h, m):
                for layer in self.layers[start:end]:
                    h, m = layer((h, m))
                return h
            return body

        for start in range(0, len(self.layers), self.checkpoint_every):
            end = min(start + self.checkpoint_every, len(self.layers))
            hidden = checkpoint_function()(run(start, end), hidden, mask)
        return hidden


def _model_tracker(neox_args, parallel_state, rng_tracker):
    """The RNG tracker the model's dropout uses.

    With checkpoint_activations it is always DeepSpeed's tracker (configured here, seeded from
    neox_args.seed like ``model_parallel_seed``): DeepSpeed's recomputation replays only its own tracker's
    streams, so any other tracker would give different dropout masks in the backward pass. Otherwise the
    given tracker, or a new one seeded from neox_args.seed.
    """
    if checkpointing_enabled(neox_args):
        configure_activation_checkpointing(neox_args, parallel_state)
        return checkpointing_rng_tracker(neox_args, parallel_state)
    if rng_tracker is not None:
        return rng_tracker
    tracker = RNGStatesTracker()
    with torch.random.fork_rng():  # seed the tracker only; leave the default stream alone
        model_parallel_seed(int(getattr(neox_args, "seed", 1234)), parallel_state, tracker)
    return tracker


def gpt2_layer_specs(neox_args, parallel_state, rng_tracker) -> List[object]:
    """DeepSpeed layer specs of the model (built lazily, per pipeline stage)."""
    init = Initializer(neox_args)
    if _tied(neox_args):
        specs = [TiedLayerSpec("embed", EmbeddingPipe, neox_args, parallel_state, init, rng_tracker,
                               tied_weight_attr="word_embeddings.weight")]
    else:
        specs = [LayerSpec(EmbeddingPipe, neox_args, parallel_state, init, rng_tracker)]
    specs += [LayerSpec(ParallelTransformerLayerPipe, neox_args, parallel_state, init, i, rng_tracker)
              for i in range(int(neox_args.num_layers))]
    specs.append(LayerSpec(NormPipe, neox_args, parallel_state))
    if _tied(neox_args):
        specs.append(TiedLayerSpec("embed", EmbeddingPipe, neox_args, parallel_state, init, rng_tracker,
                                   forward_fn=tied_logits, tied_weight_attr="word_embeddings.weight"))
    else:
        specs.append(LayerSpec(ParallelLinearPipe, neox_args, parallel_state, init))
    return specs


class GPT2ModelPipe(PipelineModule):
    """The GPT as a DeepSpeed PipelineModule (see module docstring)."""

    def __init__(self, neox_args, parallel_state, rng_tracker=None) -> None:
        _check_model_options(neox_args)
        if not deepspeed.comm.is_initialized():
            # PipelineModule talks through deepspeed.comm; wrap the existing torch.distributed world.
            init_deepspeed_comm(torch.distributed.get_backend(), dist_init_required=False)
        rng_tracker = _model_tracker(neox_args, parallel_state, rng_tracker)
        checkpointing = bool(getattr(neox_args, "checkpoint_activations", False))
        super().__init__(
            layers=gpt2_layer_specs(neox_args, parallel_state, rng_tracker),
            loss_fn=loss_function(neox_args, parallel_state),
            topology=parallel_state.get_topology(),
            partition_method=getattr(neox_args, "pipe_partition_method", None) or "type:transformer|mlp",
            activation_checkpoint_interval=int(getattr(neox_args, "checkpoint_num_layers", 1) or 1)
            if checkpointing else 0,
            activation_checkpoint_func=checkpoint_function(),
            checkpointable_layers=["ParallelTransformerLayerPipe"],
        )
        self._tied_head = _tied(neox_args)
        self._checkpoint_every = self.activation_checkpoint_interval

    def to_sequential(self) -> GPT2ModelSequential:
        """The same layers (shared parameters) as a GPT2ModelSequential, e.g. for KV-cache decoding.

        Needs every layer on this rank, i.e. pipe_parallel_size == 1.
        """
        if self.num_stages != 1:
            raise ValueError(f"to_sequential needs pipe_parallel_size == 1, this model has {self.num_stages} "
                             "stages")
        funcs = list(self.forward_funcs)
        embedding = self.tied_modules["embed"] if self._tied_head else funcs[0]
        head = None if self._tied_head else funcs[-1]
        return GPT2ModelSequential.from_parts(embedding, funcs[1:-2], funcs[-2], head, self.loss_fn,
                                              self._checkpoint_every)


def build_model(neox_args, parallel_state, rng_tracker=None) -> nn.Module:
    """The model for this rank: GPT2ModelPipe if pipe_parallel_size >= 1, else GPT2ModelSequential.

    Parameters are cast to the dtype of ``neox_args.precision``. With soft_prompt_tuning enabled only the
    soft prompt stays trainable. ``rng_tracker`` (default: a new one seeded from neox_args.seed) draws the
    model-parallel dropout; with checkpoint_activations DeepSpeed's tracker is used instead (see
    ``_model_tracker``). For the pipeline model pass ``mpu=None`` to deepspeed.initialize (the
    PipelineModule brings its own grid); for the sequential model pass ``mpu=parallel_state``.
    """
    if int(getattr(neox_args, "pipe_parallel_size", 0) or 0) >= 1:
        model = GPT2ModelPipe(neox_args, parallel_state, rng_tracker)
    else:
        model = GPT2ModelSequential(neox_args, parallel_state, rng_tracker)
    soft = getattr(neox_args, "soft_prompt_tuning", None)
    if soft and soft.get("enabled", True):
        for name, param in model.named_parameters():
            param.requires_grad = "soft_prompt" in name
    return model.to(model_dtype(neox_args))
