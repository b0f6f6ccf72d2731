"""Loading a trained model for generation and evaluation (generate.py, eval.py), with no training machinery.

The model is built from the run's ModelConfig (sequence parallelism off: decoding feeds sequences of any
length, which it cannot split; the weights are the same) and its weights are read straight from the
checkpoint: no optimizer, learning-rate schedule, batch size or iteration count is needed, so a config with
only the model, tokenizer and ``load`` keys is enough. The checkpoint is merged into full tensors and each
rank keeps its own slice, so any checkpoint (any tensor / pipeline split or ZeRO stage it was trained
with) loads into any inference layout.

With pipe_parallel_size > 1 the stages still need DeepSpeed's pipeline schedule to pass activations between
them: the model is wrapped in a PipelineEngine with a fixed one-sample micro-batch (a schedule setting, not
the user's batch size) and no optimizer.

Checkpoints load whatever their layout: this project's (GPT-NeoX's layout, or an older one, translated by
megatron.checkpoint_conversion) and GPT-NeoX's own; a GPT-NeoX checkpoint's padded vocabulary comes from its
embedding (megatron.initialize) and its architecture is checked by megatron.checkpoint.engine.resolve_checkpoint.
A LoRA run's checkpoint (the adapters and a pointer to their base) loads as the base with the adapters merged in.
The checkpoint is the one initialize_megatron found and verified (rank 0 hashed its files for every rank): it is
read here without being looked for, or hashed, again."""

from typing import Dict, Optional, Tuple

import deepspeed
from torch import nn

from megatron.checkpoint.engine import resolve_checkpoint
from megatron.checkpoint.lora import read_model_checkpoint
from megatron.checkpoint.tensor_parallel import split_full
from megatron.errors import CheckpointError, ConfigError, ConversionError
from megatron.initialize import RunContext, initialize_megatron
from megatron.model.checkpoint_layout import from_neox, slot_kind, to_neox
from megatron.model.embedding import Embedding
from megatron.model.gpt2_model import GPT2ModelPipe, build_model, slot_prefixes

PIPELINE_SCHEDULE_CONFIG = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1}
"""The DeepSpeed config of the inference PipelineEngine: one micro-batch per eval_batch call."""


def slot_modules(model: nn.Module) -> Dict[int, nn.Module]:
    """{GPT-NeoX slot index: the module holding that slot's parameters on this rank} (a tied head maps to the
    embedding it reuses)."""
    if isinstance(model, GPT2ModelPipe):
        num_layers = model.num_layers
        modules = {model._local_start + i: f for i, f in enumerate(model.forward_funcs) if isinstance(f, nn.Module)}
        if "embed" in model.tied_modules:
            for slot in (0, num_layers + 4):
                if model._local_start <= slot < model._local_stop:
                    modules[slot] = model.tied_modules["embed"]
        return modules
    return {slot: module for slot, module in enumerate(model.sequential) if len(module.state_dict())}


def load_model_weights(model: nn.Module, checkpoint_dir: str, parallel_state, model_config,
                       verified_kind: Optional[str] = None, checkpoint=None) -> None:
    """Copy this rank's slice of the checkpoint's weights into ``model`` (every parameter must be found). The
    checkpoint may be this project's (any layout, old ones included) or GPT-NeoX's; ``verified_kind``: as
    megatron.checkpoint.neox_checkpoint.read_checkpoint's; ``checkpoint``: read_model_checkpoint's answer for
    ``checkpoint_dir`` when the caller read it already."""
    try:
        checkpoint = checkpoint or read_model_checkpoint(checkpoint_dir, verified_kind=verified_kind)
    except ConversionError as err:
        raise CheckpointError(str(err)) from None
    tp, rank = parallel_state.get_model_parallel_world_size(), parallel_state.get_model_parallel_rank()
    num_layers = model_config.num_layers
    prefixes = slot_prefixes(num_layers)
    for slot, module in slot_modules(model).items():
        is_embedding = isinstance(module, Embedding)  # a tied head is the embedding
        prefix = prefixes[0] if is_embedding else prefixes[slot]
        kind = slot_kind(0 if is_embedding else slot, num_layers, model_config.attention_types)
        wanted = from_neox(kind, module.state_dict(), model_config, rank, tp)  # the parameters (names, shapes)
        state = {}
        for name, target in wanted.items():
            full = checkpoint.state.get(prefix + name)
            if full is None:
                raise CheckpointError(f"checkpoint {checkpoint.path} has no {prefix + name} (the model of this "
                                      f"config has it): was it saved by a model of another architecture?")
            piece = split_full(prefix + name, full, tp, model_config)[rank]
            if piece.shape != target.shape:
                raise CheckpointError(f"{prefix + name} in checkpoint {checkpoint.path} has shape "
                                      f"{tuple(full.shape)}, which does not fit this model ({tuple(target.shape)} "
                                      f"on each of {tp} tensor-parallel ranks)")
            state[name] = piece.to(target.dtype)
        # the module loads GPT-NeoX's form of its slot (checkpoint_layout), as from DeepSpeed's files
        module.load_state_dict(to_neox(kind, state, model_config, rank, tp), strict=True)


def setup_for_inference(neox_args, require_checkpoint: bool = True) -> Tuple[object, RunContext, int]:
    """(the model, or its PipelineEngine with pipe_parallel_size > 1, in eval mode; run context; the
    checkpoint's iteration)."""
    if neox_args.train_impl == "rm":
        raise ConfigError(["train_impl 'rm': a reward model scores sequences and has no vocabulary head, so "
                           "generate.py / eval.py cannot use it; score with the model converted to transformers' "
                           "*ForSequenceClassification (tools/ckpts/convert_neox_to_hf.py)"])
    if neox_args.context_parallel_size > 1:
        raise ConfigError([f"context_parallel_size={neox_args.context_parallel_size}: generate.py / eval.py with "
                           f"context parallelism is not supported yet (decoding keeps whole sequences); set "
                           f"context_parallel_size: 1, the checkpoint loads unchanged"])
    # every rank holds every expert: expert parallelism would make each forward a collective of the whole
    # expert-parallel group, which eval.py's requests (sharded over data-parallel ranks) do not keep in step
    # a LoRA run's checkpoint loads as its base with the adapters merged in (megatron.checkpoint.lora), into the model
    # without adapters
    ctx = initialize_megatron(neox_args, model_changes={"sequence_parallel": False, "moe_expert_parallel_size": 1,
                                                        "lora": None})
    checkpoint = resolve_checkpoint(neox_args, ctx.model_config, ctx.checkpoint, layout_must_match=False)
    if checkpoint is None and require_checkpoint:
        raise CheckpointError(f"no checkpoint to load: set load to a directory written by train.py "
                              f"(load={neox_args.load!r}), or iteration to one of its global_stepN")
    model = build_model(ctx.model_config, ctx.parallel_state, ctx.rng_tracker).to(ctx.device)
    iteration = 0
    if checkpoint is not None:
        load_model_weights(model, checkpoint.path, ctx.parallel_state, ctx.model_config,
                           verified_kind=checkpoint.kind)
        iteration = int(checkpoint.tag[len("global_step"):]) if checkpoint.tag[len("global_step"):].isdigit() else 0
    model.eval()
    if ctx.model_config.is_pipe_parallel and ctx.parallel_state.get_pipe_parallel_world_size() > 1:
        engine, _, _, _ = deepspeed.initialize(model=model, config=dict(PIPELINE_SCHEDULE_CONFIG),
                                               dist_init_required=False)
        engine.eval()
        return engine, ctx, iteration
    return model, ctx, iteration

