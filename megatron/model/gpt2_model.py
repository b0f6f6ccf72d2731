"""The GPT model as GPT-NeoX's list of layer slots, run as a DeepSpeed PipelineModule or as a plain module.

Slots, with L = num_layers (GPT-NeoX's indices: they name the checkpoint files and the module keys, so
checkpoints move between GPT-NeoX and this project unchanged):
    0             Embedding
    1             a parameter-free slot (GPT-NeoX's pre-transformer function)
    2 .. L + 1    ParallelTransformerLayer (layer i in slot i + 2)
    L + 2         a parameter-free slot (GPT-NeoX's post-transformer function)
    L + 3         FinalNorm, the final norm
    L + 4         the output head: OutputHead, or the embedding again (TiedLayerSpec) unless
                  no_weight_tying; a reward model's ValueHead (train_impl rm)
Inside each slot the parameter names and layouts are GPT-NeoX's too (see megatron/model/attention.py,
norms.py, embedding.py, transformer.py), so a model's state dict is the state dict GPT-NeoX's model of the
same config has, entry for entry. With pos_emb rpe one relative-position table is shared by all layers (as
GPT-NeoX's), which is why rpe needs pipe_parallel_size <= 1.
Inputs are GPT-NeoX's batch format ((tokens, position_ids, attention_mask), (labels, loss_mask));
the model returns this rank's vocabulary shard of the logits and ``cross_entropy_loss`` reduces them. For the
training loss the head's output is deferred instead (megatron.model.head.DeferredLogits): the loss computes logits
and cross entropy a chunk of tokens at a time, so that the [tokens, vocab] logits never exist whole. The sequential
model defers when asked (``forward(..., defer_logits=True)``, as training does), the pipeline's head while
training (DeepSpeed's pipeline engine hands the last stage's output only to the loss then).

* ``GPT2ModelPipe`` (pipe_parallel_size >= 1): a PipelineModule over ``parallel_state``'s topology,
  partitioned by ``pipe_partition_method``; DeepSpeed saves slot i of tensor rank t as
  ``layer_{i:02d}-model_{t:02d}-model_states.pt`` (parameter-free slots and the tied head write nothing).
  Activation checkpointing every ``checkpoint_num_layers`` transformer layers with DeepSpeed's checkpoint,
  restricted to the layer blocks (``checkpointable_layers``: the first stage takes integer tokens,
  which reentrant checkpointing rejects); with recompute_method 'block' only the first
  ``recompute_block_layers`` layers of each stage, one per checkpoint.
* ``GPT2ModelSequential`` (pipe_parallel_size 0): the same slots in an nn.ModuleList named ``sequential``
  (module keys ``sequential.{i}.*``, as GPT-NeoX's SequentialWrapper), with the same forward and loss; it
  also takes an explicit ``KVCache`` for incremental decoding. ``embedding``, ``layers``, ``final_norm`` and
  ``head`` name the slots' modules. With num_unique_layers (parameter sharing, this model only) a layer slot
  whose parameters another slot owns holds a ``SharedLayer``: it runs the owner's module, has no parameters
  of its own and writes nothing to the state dict, so each shared tensor is stored once (under its owner's
  slot).

Every layer is built from a frozen ``ModelConfig`` (megatron.model.config) and the ParallelState; the
builder checks the config's rules once (``ModelConfig.problems``) and raises one ConfigError.
"""
from __future__ import annotations

from functools import partial
from typing import Dict, List, Optional, Tuple

import deepspeed
import torch
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from torch import nn

from megatron.errors import ConfigError
from megatron.model.activation_checkpointing import (checkpoint_function, checkpointing_rng_tracker,
                                                     configure_activation_checkpointing)
from megatron.model.attention import build_relative_position_bias
from megatron.model.config import RECURRENT_TYPES, ModelConfig, context_parallel_problems
from megatron.model.embedding import Embedding
from megatron.model.fused import model_fused_ops
from megatron.model.gmlp import GMLPBlock
from megatron.model.head import (FinalNorm, HeadOutput, OutputHead, ValueHead, masked_cross_entropy_sum,
                                 pipeline_tied_logits, tied_logits)
from megatron.model.init_functions import Initializer
from megatron.model.kv_cache import KVCache, LayerKeyedCache
from megatron.model.lora import apply_lora
from megatron.model.mamba import ParallelMambaResidualLayer, mamba_kernel_problems
from megatron.model.reward_model import RewardLoss
from megatron.model.rwkv import RWKVResidualLayer
from megatron.model.transformer import ParallelTransformerLayer
from megatron.mpu import RNGStatesTracker, model_parallel_seed
from megatron.mpu.context_parallel import all_reduce_sum
from megatron.mpu.deepspeed_comm import init_deepspeed_comm

Batch = Tuple[Tuple[torch.Tensor, torch.Tensor, torch.Tensor], Tuple[torch.Tensor, torch.Tensor]]


def cross_entropy_loss(logits: HeadOutput, labels_and_mask: Tuple[torch.Tensor, torch.Tensor],
                       group=None, half_precision_loss: bool = False, context_group=None,
                       context_grad_scale: int = 1) -> torch.Tensor:
    """Mean vocabulary-parallel cross entropy over the tokens where loss_mask is 1, from the logits or from the
    head's DeferredLogits (then in chunks of tokens, megatron.mpu.chunked_cross_entropy).

    Per-token losses are computed in fp32, or in the logits' dtype with ``half_precision_loss``
    (fp16_lm_cross_entropy); the masked mean is always taken in fp32.

    With a ``context_group`` (context parallelism: this rank holds part of each sequence) the mean is over the
    tokens of the whole group: the value is the full sequences' loss on every rank, and its gradient is this
    rank's share (its tokens' losses over the group's token count), which DeepSpeed sums over the
    context-parallel ranks, so the gradient equals that of context_parallel_size 1. DeepSpeed's pipeline engine
    instead averages over data x context ranks (its data axis, ParallelState.get_topology): there the share is
    multiplied by ``context_grad_scale`` = context_parallel_size, which that average divides out again.
    """
    labels, loss_mask = labels_and_mask
    total = masked_cross_entropy_sum(logits, labels, loss_mask, group, keep_dtype=half_precision_loss)
    loss_mask = loss_mask.reshape(-1).float()
    if context_group is None:
        return total / loss_mask.sum().clamp(min=1.0)
    count = all_reduce_sum(loss_mask.sum(), context_group).clamp(min=1.0)
    share = total / count
    scaled = share * context_grad_scale if context_grad_scale != 1 else share
    return scaled + (all_reduce_sum(share, context_group) - scaled).detach()


def loss_function(config: ModelConfig, parallel_state, averaged_over_context: bool = False):
    """The model's loss: ``loss_fn(logits, (labels, loss_mask))``; a reward model's is the Bradley-Terry loss
    on pairs (megatron.model.reward_model). ``averaged_over_context``: the engine averages gradients over
    data x context ranks (as DeepSpeed's pipeline engine always does: cross_entropy_loss's context_grad_scale)."""
    if config.value_head:
        return RewardLoss(config.z_loss)
    cp = parallel_state.get_context_parallel_world_size()
    context_group = parallel_state.get_context_parallel_group() if cp > 1 else None
    return partial(cross_entropy_loss, group=parallel_state.get_model_parallel_group(),
                   half_precision_loss=config.fp16_lm_cross_entropy, context_group=context_group,
                   context_grad_scale=cp if config.is_pipe_parallel or averaged_over_context else 1)


def check_model_config(config: ModelConfig, parallel_state) -> None:
    """One ConfigError listing everything that keeps ``config`` from being built on this rank's layout."""
    problems = config.problems() + config.device_problems(torch.cuda.is_available())
    if "mamba" in config.attention_types:
        problems += mamba_kernel_problems(config, torch.cuda.is_available())
    if config.padded_vocab_size is None:
        problems.append("padded_vocab_size is not set: build the tokenizer first (ModelConfig.from_neox_args(args, "
                        "padded_vocab_size=...)) or set padded_vocab_size")
    cp = parallel_state.get_context_parallel_world_size()
    if cp != config.context_parallel_size:
        problems += context_parallel_problems(config, cp)
    tp = parallel_state.get_model_parallel_world_size()  # the split is the parallel state's
    for name, value in (("num_kv_heads", config.kv_heads), ("padded_vocab_size", config.padded_vocab_size)):
        if value is not None and value % tp:
            problems.append(f"{name}={value} cannot be split over {tp} tensor-parallel ranks")
    if problems:
        raise ConfigError(problems)
    model_fused_ops(config)  # fusion flags that cannot run here fail now, naming the flag


def model_dtype(config: ModelConfig) -> torch.dtype:
    return {"fp16": torch.float16, "bfloat16": torch.bfloat16}.get(config.precision, torch.float32)


def slot_prefixes(num_layers: int) -> Dict[int, str]:
    """{slot index: the name prefix of its parameters in a flat model state dict} for the slots that hold
    parameters: 0 "embedding.", i + 2 "layers.{i}.", L + 3 "final_norm.", L + 4 "head." (the untied head)."""
    prefixes = {0: "embedding.", num_layers + 3: "final_norm.", num_layers + 4: "head."}
    prefixes.update({i + 2: f"layers.{i}." for i in range(num_layers)})
    return prefixes


BLOCK_CLASSES: Dict[str, type] = {"global": ParallelTransformerLayer, "local": ParallelTransformerLayer,
                                  "flash": ParallelTransformerLayer, "sparse_fixed": ParallelTransformerLayer,
                                  "sparse_variable": ParallelTransformerLayer, "bigbird": ParallelTransformerLayer,
                                  "bslongformer": ParallelTransformerLayer, "gmlp": GMLPBlock, "amlp": GMLPBlock,
                                  "mamba": ParallelMambaResidualLayer,
                                  "rwkv": RWKVResidualLayer}
"""The module of each layer type of attention_config (GPT-NeoX's per-layer types): the layer specs as data.
Every block class takes (config, parallel_state, initializer, layer_number, rng_tracker, rpe) and maps
(hidden, attention_mask) [+ kv_cache] to (hidden, attention_mask), so it can sit in any slot 2..L+1."""


def block_class(config: ModelConfig, layer_number: int) -> type:
    return BLOCK_CLASSES[config.attention_types[layer_number]]


def pass_through(args):
    """A parameter-free slot of the layer list (GPT-NeoX's pre/post-transformer functions)."""
    return args


class LayerSlot(nn.Module):
    """``pass_through`` as a module, so that GPT2ModelSequential's slots keep GPT-NeoX's indices."""

    def forward(self, args):
        return args


class SharedLayer(nn.Module):
    """Layer position ``position`` of a parameter-shared stack (num_unique_layers): it runs the layer built at
    its owner position, whose parameters are registered (and saved, and counted) there only. Its decoding
    state is keyed by this position (LayerKeyedCache)."""

    def __init__(self, owner: nn.Module, position: int) -> None:
        super().__init__()
        self._owner = (owner,)  # a tuple, so that the owner is not registered here a second time
        self.layer_number = position

    @property
    def owner(self) -> nn.Module:
        return self._owner[0]

    def forward(self, args, kv_cache: Optional[KVCache] = None):
        view = LayerKeyedCache(kv_cache, self.layer_number) if kv_cache is not None else None
        return self.owner(args, view)


class GPT2ModelSequential(nn.Module):
    """All layers on one pipeline stage, called in order; optional explicit KV cache."""

    def __init__(self, config: ModelConfig, parallel_state, rng_tracker=None) -> None:
        super().__init__()
        check_model_config(config, parallel_state)
        rng_tracker = _model_tracker(config, parallel_state, rng_tracker)
        init = Initializer(config)
        rpe = _shared_rpe(config, parallel_state, init)
        layers: List[nn.Module] = []
        for i in range(config.num_layers):
            owner = config.layer_owners[i]
            layers.append(block_class(config, i)(config, parallel_state, init, i, rng_tracker, rpe) if owner == i
                          else SharedLayer(layers[owner], i))
        head = None if config.tied_embeddings else _head_class(config)(config, parallel_state, init)
        self._assemble(Embedding(config, parallel_state, init, rng_tracker), layers,
                       FinalNorm(config, parallel_state), head, loss_function(config, parallel_state),
                       config.checkpoint_num_layers if config.checkpoint_activations else 0,
                       config.recompute_block_layers)

    @classmethod
    def from_parts(cls, embedding: Embedding, layers: List[nn.Module], final_norm: FinalNorm,
                   head: Optional[nn.Module], loss_fn, checkpoint_every: int = 0,
                   checkpoint_first: Optional[int] = None) -> "GPT2ModelSequential":
        """A sequential model over existing (already initialised) layers; parameters are shared."""
        model = cls.__new__(cls)
        nn.Module.__init__(model)
        model._assemble(embedding, layers, final_norm, head, loss_fn, checkpoint_every, checkpoint_first)
        return model

    def _assemble(self, embedding: Embedding, layers: List[nn.Module], final_norm: FinalNorm,
                  head: Optional[nn.Module], loss_fn, checkpoint_every: int,
                  checkpoint_first: Optional[int] = None) -> None:
        self.sequential = nn.ModuleList([embedding, LayerSlot(), *layers, LayerSlot(), final_norm,
                                         head if head is not None else LayerSlot()])
        self.layers: Tuple[nn.Module, ...] = tuple(layers)  # a tuple: registered once, under sequential
        self.tied_head = head is None
        self.checkpoint_every, self.loss_fn = checkpoint_every, loss_fn
        self.checkpoint_first = checkpoint_first  # recompute_method 'block': only these first layers

    @property
    def embedding(self) -> Embedding:
        return self.sequential[0]

    @property
    def final_norm(self) -> FinalNorm:
        return self.sequential[len(self.layers) + 3]

    @property
    def head(self) -> Optional[nn.Module]:
        """The untied output head, or None when the word embedding is the head."""
        return None if self.tied_head else self.sequential[len(self.layers) + 4]

    def forward(self, inputs, kv_cache: Optional[KVCache] = None, logits_to_keep: Optional[int] = None,
                defer_logits: bool = False) -> HeadOutput:
        """Logits [batch, seq, vocab shard]; `logits_to_keep` = n computes them for the last n positions only
        (decoding needs one: the output head over a 50k vocabulary dominates a prompt's forward otherwise).
        `defer_logits`: the head's DeferredLogits instead, for ``loss_fn`` to compute in chunks (ignored with a
        KV cache or `logits_to_keep`, and by a reward model's value head)."""
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
        defer = defer_logits and kv_cache is None and logits_to_keep is None
        if self.head is None:
            logits = tied_logits(self.embedding, hidden, defer)
        elif isinstance(self.head, OutputHead):
            logits = self.head(hidden, defer)
        else:
            logits = self.head(hidden)
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
            if self.checkpoint_first is not None and start >= self.checkpoint_first:
                hidden = run(start, end)(hidden, mask)  # recompute_method 'block': past the first layers
            else:
                hidden = checkpoint_function()(run(start, end), hidden, mask)
        return hidden


def _shared_rpe(config: ModelConfig, parallel_state, init: Initializer):
    """The relative-position table all layers share (pos_emb rpe), or None."""
    return build_relative_position_bias(config, parallel_state, init) if config.pos_emb == "rpe" else None


def _model_tracker(config: ModelConfig, parallel_state, rng_tracker):
    """The RNG tracker the model's dropout uses.

    With checkpoint_activations or recompute_granularity 'selective' it is always DeepSpeed's tracker
    (configured here, seeded from config.seed like ``model_parallel_seed``): DeepSpeed's recomputation replays
    only its own tracker's streams, so any other tracker would give different dropout masks in the backward
    pass. Otherwise the given tracker, or a new one seeded from config.seed.
    """
    if config.checkpoint_activations or config.recompute_granularity == "selective":
        configure_activation_checkpointing(config, parallel_state)
        return checkpointing_rng_tracker(config, parallel_state)
    if rng_tracker is not None:
        return rng_tracker
    tracker = RNGStatesTracker()
    with torch.random.fork_rng():  # seed the tracker only; leave the default stream alone
        model_parallel_seed(config.seed, parallel_state, tracker)
    return tracker


def gpt2_layer_specs(config: ModelConfig, parallel_state, rng_tracker) -> List[object]:
    """DeepSpeed layer specs of the model, one per slot (built lazily, per pipeline stage)."""
    init = Initializer(config)
    if config.tied_embeddings:
        specs = [TiedLayerSpec("embed", Embedding, config, parallel_state, init, rng_tracker,
                               tied_weight_attr="word_embeddings.weight")]
    else:
        specs = [LayerSpec(Embedding, config, parallel_state, init, rng_tracker)]
    specs.append(pass_through)
    rpe = _shared_rpe(config, parallel_state, init)
    specs += [LayerSpec(block_class(config, i), config, parallel_state, init, i, rng_tracker, rpe)
              for i in range(config.num_layers)]
    specs += [pass_through, LayerSpec(FinalNorm, config, parallel_state)]
    if config.tied_embeddings:
        specs.append(TiedLayerSpec("embed", Embedding, config, parallel_state, init, rng_tracker,
                                   forward_fn=pipeline_tied_logits, tied_weight_attr="word_embeddings.weight"))
    elif config.value_head:
        specs.append(LayerSpec(ValueHead, config, parallel_state, init))
    else:  # deferred while training: the pipeline engine hands the last stage's output only to the loss then
        specs.append(LayerSpec(OutputHead, config, parallel_state, init, defer_when_training=True))
    return specs


def _head_class(config: ModelConfig) -> type:
    """The untied head: the vocabulary head, or a reward model's value head (train_impl 'rm')."""
    return ValueHead if config.value_head else OutputHead


DEFAULT_PARTITION_METHOD = "type:transformer|mlp"


def partition_method(config: ModelConfig) -> str:
    """DeepSpeed's partition method for ``config``: pipe_partition_method, except that the default
    (``type:transformer|mlp``, which balances the ParallelTransformerLayer slots) also counts Mamba and RWKV
    layers, whose class names it would not match (DeepSpeed would find no layer to balance)."""
    method = config.pipe_partition_method
    recurrent = [kind for kind in RECURRENT_TYPES if kind in config.attention_types]
    if method == DEFAULT_PARTITION_METHOD and recurrent:
        return "|".join([method] + recurrent)
    return method


class GPT2ModelPipe(PipelineModule):
    """The GPT as a DeepSpeed PipelineModule (see module docstring)."""

    def __init__(self, config: ModelConfig, parallel_state, rng_tracker=None) -> None:
        check_model_config(config, parallel_state)
        if not deepspeed.comm.is_initialized():
            # PipelineModule talks through deepspeed.comm; wrap the existing torch.distributed world.
            init_deepspeed_comm(torch.distributed.get_backend(), dist_init_required=False)
        rng_tracker = _model_tracker(config, parallel_state, rng_tracker)
        super().__init__(
            layers=gpt2_layer_specs(config, parallel_state, rng_tracker),
            loss_fn=loss_function(config, parallel_state),
            topology=parallel_state.get_topology(),
            partition_method=partition_method(config),
            activation_checkpoint_interval=config.checkpoint_num_layers if config.checkpoint_activations else 0,
            activation_checkpoint_func=checkpoint_function(),
            checkpointable_layers=sorted({cls.__name__ for cls in BLOCK_CLASSES.values()}),
        )
        self._tied_head = config.tied_embeddings
        self.num_layers = config.num_layers
        self._checkpoint_every = self.activation_checkpoint_interval
        self._checkpoint_first = config.recompute_block_layers
        self._precompute_checkpointable_values()

    def _precompute_checkpointable_values(self) -> None:
        """DeepSpeed's per-chunk "checkpoint this" flags; with recompute_method 'block' (one layer per chunk) only
        the first ``recompute_block_layers`` layer chunks of this stage keep theirs. DeepSpeed's engine calls this
        again when it sets the interval."""
        super()._precompute_checkpointable_values()
        first = getattr(self, "_checkpoint_first", None)
        if first is None:
            return
        if self.activation_checkpoint_interval != 1:
            raise ValueError(f"recompute_method 'block' checkpoints one layer per chunk; the pipeline's "
                             f"activation_checkpoint_interval is {self.activation_checkpoint_interval}")
        flags, seen = [], 0
        for checkpointable in self.is_checkpointable_results:
            flags.append(checkpointable and seen < first)
            seen += bool(checkpointable)
        self.is_checkpointable_results = flags

    @staticmethod
    def sequential_name(name: str) -> str:
        """The GPT2ModelSequential name of this module's parameter ``name``. Both use GPT-NeoX's layer slots:
        ``'<slot>.<rest>'`` here is ``'sequential.<slot>.<rest>'`` there, and the tied word embedding
        (``'tied_modules.embed.<rest>'``, on the first and the last stage) is slot 0's."""
        tied = "tied_modules.embed."
        if name.startswith(tied):
            return "sequential.0." + name[len(tied):]
        if not name.partition(".")[0].isdigit():
            raise ValueError(f"{name!r} is not a parameter name of GPT2ModelPipe ('<slot>.<rest>' or '{tied}<rest>')")
        return f"sequential.{name}"

    def to_sequential(self) -> GPT2ModelSequential:
        """The same layers (shared parameters) as a GPT2ModelSequential, e.g. for KV-cache decoding.

        Needs every layer on this rank, i.e. pipe_parallel_size == 1.
        """
        if self.num_stages != 1:
            raise ValueError(f"to_sequential needs pipe_parallel_size == 1, this model has {self.num_stages} "
                             "stages")
        funcs = list(self.forward_funcs)  # the slots: embedding, pass, layers..., pass, norm, head
        embedding = self.tied_modules["embed"] if self._tied_head else funcs[0]
        head = None if self._tied_head else funcs[-1]
        return GPT2ModelSequential.from_parts(embedding, funcs[2:-3], funcs[-2], head, self.loss_fn,
                                              self._checkpoint_every, self._checkpoint_first)


def build_model(config: ModelConfig, parallel_state, rng_tracker=None) -> nn.Module:
    """The model for this rank: GPT2ModelPipe if pipe_parallel_size >= 1, else GPT2ModelSequential.

    Parameters are cast to the dtype of ``config.precision``. With a soft prompt only the soft prompt
    stays trainable; with lora only the adapters (megatron.model.lora). ``rng_tracker`` (default: a new one seeded from config.seed) draws the
    model-parallel dropout; with checkpoint_activations DeepSpeed's tracker is used instead (see
    ``_model_tracker``). For the pipeline model pass ``mpu=None`` to deepspeed.initialize (the
    PipelineModule brings its own grid); for the sequential model pass ``mpu=parallel_state``.
    """
    if config.is_pipe_parallel:
        model = GPT2ModelPipe(config, parallel_state, rng_tracker)
    else:
        model = GPT2ModelSequential(config, parallel_state, rng_tracker)
    if config.soft_prompt_tokens is not None:
        for name, param in model.named_parameters():
            param.requires_grad = "soft_prompt" in name
    apply_lora(model, config, parallel_state)
    return cast_model(model, model_dtype(config))


def cast_model(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``model.to(dtype)``, except Mamba's A_log and D under mamba_selective_fp32_params, which stay fp32
    (cast one parameter at a time, so they are never rounded through the half dtype)."""
    kept = {id(p) for p in model.parameters() if getattr(p, "mamba_fp32", False)}
    if not kept or dtype == torch.float32:
        return model.to(dtype)
    for param in model.parameters():
        if id(param) not in kept and param.is_floating_point():
            param.data = param.data.to(dtype)
    for module in model.modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and buf.is_floating_point():
                setattr(module, name, buf.to(dtype))
    return model
