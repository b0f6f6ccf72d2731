"""One training step and one evaluation: the loss (from the head's deferred logits), the engine's backward and step,
the debug values and objective metrics logged beside them, and the learning rate / batch-size ramp it runs under."""
import math
from typing import Dict, Iterator, List, Optional, Tuple, Union

import deepspeed
import torch
import torch.distributed as dist

from megatron.initialize import RunContext
from megatron.model.gpt2_model import GPT2ModelSequential
from megatron.model.moe import moe_metrics, set_aux_loss_scale
from megatron.mpu.grad_norm import global_grad_norm
from megatron.mpu.host_collectives import all_reduce, broadcast_object, world_size
from megatron.observability.gradient_noise_scale import GradientNoiseScale
from megatron.observability.training_logger import (PPL_LOSS_CAP, debug_metrics, debug_sums, debug_values,
                                                    gather_debug_sums, memory_stats, replica_gradients)
from megatron.optim.learning_rates import AnnealingLR
from megatron.training.batches import ModelBatches


def current_lr(lr_scheduler) -> float:
    """The learning rate to log: AnnealingLR's base rate, or the rate a DeepSpeed scheduler last set."""
    if isinstance(lr_scheduler, AnnealingLR):
        return lr_scheduler.get_lr()
    return float(lr_scheduler.get_last_lr()[0])


def set_batch_size(engine, lr_scheduler, batch_size: int) -> None:
    """rampup_batch_size: the next step takes `batch_size` samples, as batch_size / (micro batch x data-parallel
    size) micro-batches (DeepSpeed's set_train_batch_size, which also scales the loss by the new count), and
    moves the learning-rate schedule by that many samples."""
    if engine.train_batch_size() != batch_size:
        engine.set_train_batch_size(batch_size)
    lr_scheduler.next_batch = batch_size


def loss_of(engine, batch) -> torch.Tensor:
    """Forward one micro-batch of the sequential model and apply its loss (honours fp16_lm_cross_entropy). The GPT's
    head output is deferred: the loss computes the logits in chunks of tokens, never whole (megatron.model.head)."""
    inputs, labels = batch
    defer = {"defer_logits": True} if isinstance(engine.module, GPT2ModelSequential) else {}
    return engine.module.loss_fn(engine(inputs, **defer), labels)


def aux_loss_scale(engine, neox_args) -> float:
    """What the engine multiplies the LM loss by before its backward, for the MoE auxiliary loss's gradient
    (megatron.model.moe.stats): 1 / gradient_accumulation_steps (the engine's: rampup_batch_size changes it),
    times the current loss scale under fp16."""
    scale = 1.0 / engine.gradient_accumulation_steps()
    if engine.fp16_enabled():
        optimizer = engine.optimizer
        scale *= float(getattr(optimizer, "cur_scale", None) or getattr(optimizer, "loss_scale", 1.0))
    return scale


def train_step(neox_args, engine, batches: ModelBatches, ctx: RunContext, optimizer, debug: bool = False,
               noise_scale: Optional[GradientNoiseScale] = None
               ) -> Tuple[float, bool, Union[torch.Tensor, float, None], Dict[str, float]]:
    """One optimizer step; returns (mean loss over the global batch, whether the step was skipped, the
    global gradient norm before clipping, the log_* / memory_profiling values when `debug`, and the gradient noise
    scale once ``noise_scale`` has one). The norm is left as the engine keeps it (a device tensor: reading it
    waits for the device, so the logger reads it only when it writes a record). ``noise_scale`` takes the step's
    gradient where the debug values are taken (reduced, not yet clipped)."""
    grad_norm = None
    extras: Dict[str, float] = {}
    gradient = None
    if neox_args.moe_num_experts > 1:
        set_aux_loss_scale(engine.module, aux_loss_scale(engine, neox_args))
    if neox_args.is_pipe_parallel:
        if debug or noise_scale is not None:
            loss, extras, gradient = _pipeline_debug_step(neox_args, engine, batches, ctx, optimizer, debug,
                                                          noise_scale)
        else:
            loss = engine.train_batch(data_iter=batches)
    else:
        losses = []
        steps = engine.gradient_accumulation_steps()
        for micro in range(steps):
            if neox_args.rampup_batch_size is not None:
                # DeepSpeed finds the boundary from its running micro-step count modulo the accumulation steps,
                # which no longer lines up once the ramp changes them: say where it is
                engine.set_gradient_accumulation_boundary(micro == steps - 1)
            loss = loss_of(engine, next(batches))
            engine.backward(loss)
            if micro == steps - 1:
                if neox_args.zero_stage == 0 and not neox_args.gradient_clipping:  # else DeepSpeed computes it
                    grad_norm = _replicated_grad_norm(engine.module, ctx.parallel_state)
                if debug:
                    extras = debug_metrics(neox_args, engine.module, optimizer, ctx.parallel_state)
                if noise_scale is not None:
                    gradient = noise_scale.flatten(replica_gradients(engine.module, ctx.parallel_state))
            engine.step()
            losses.append(loss.detach().float())
        loss = torch.stack(losses).mean()
    ds_norm = engine.get_global_grad_norm()
    if ds_norm is not None:
        grad_norm = ds_norm
    skipped = not engine.was_step_applied()
    if noise_scale is not None:
        noise_scale.update(None if skipped else gradient)
        if noise_scale.noise_scale is not None:
            extras["noise_scale"] = noise_scale.noise_scale
    extras.update(objective_metrics(engine))
    return data_parallel_mean(loss, engine), skipped, grad_norm, extras


def objective_metrics(engine) -> Dict[str, float]:
    """What the loss function measured since the last call (DPO's rewards, accuracy and margin; nothing for
    language modelling), averaged over the data-parallel ranks. Under pipeline parallelism only the last stage
    runs the loss: every stage calls this and gets the last stage's values (the logging rank is on the first)."""
    take = getattr(engine.module.loss_fn, "take_metrics", None)
    if take is None:
        return {}
    pipelined = getattr(engine, "is_pipe_parallel", False)  # the pipeline engine with 2+ stages
    metrics = take() if not pipelined or engine.is_last_stage() else {}
    if metrics and dist.is_initialized():
        names = sorted(metrics)
        group = engine.grid.get_data_parallel_group() if pipelined \
            else engine.mpu.get_data_parallel_group() if getattr(engine, "mpu", None) else None
        values = all_reduce([metrics[n] for n in names], group=group) / world_size(group)
        metrics = dict(zip(names, values.tolist()))
    if pipelined:
        metrics = broadcast_object(metrics, src=engine.grid.stage_to_global(engine.num_stages - 1),
                                   group=engine.grid.get_pipe_parallel_group())
    return metrics


def _moe_metrics(neox_args, ctx: RunContext, engine, iterations: int) -> Dict[str, float]:
    """moe_aux_loss and the per-layer expert load since the last report (every rank calls it: one all-reduce)."""
    return moe_metrics(engine.module, neox_args.num_layers, neox_args.moe_num_experts, neox_args.moe_loss_coeff,
                       iterations, tensor_parallel_size=ctx.parallel_state.get_model_parallel_world_size())


def _pipeline_debug_step(neox_args, engine, batches, ctx: RunContext, optimizer, debug: bool = True,
                         noise_scale: Optional[GradientNoiseScale] = None
                         ) -> Tuple[torch.Tensor, Dict[str, float], Optional[torch.Tensor]]:
    """engine.train_batch, with the log_* values of the whole model (when ``debug``) and this rank's gradient for
    ``noise_scale`` taken where the sequential model takes them: after the last backward and the gradient
    reduction, before clipping and the optimizer step.

    The pipeline engine runs ReduceTiedGrads, ReduceGrads and OptimizerStep at the end of its schedule;
    OptimizerStep calls engine._take_model_step, which clips (fp32 without ZeRO; ZeRO and bf16 clip inside
    optimizer.step), steps the optimizer and frees the gradients. For this call only, the engine's
    _take_model_step first records this stage's values (debug_sums, under the sequential model's names); after
    train_batch the stages' values are combined on every rank (gather_debug_sums)."""
    captured: List[Dict[str, List[float]]] = []
    gradients: List[torch.Tensor] = []
    take_model_step = engine._take_model_step
    overridden = "_take_model_step" in vars(engine)  # already replaced on this engine (by a caller)

    def record_then_step(*args, **kwargs):
        captured.append(debug_sums(neox_args, engine.module, optimizer, ctx.parallel_state,
                                   names=engine.module.sequential_name) if debug else {})
        if noise_scale is not None:
            gradients.append(noise_scale.flatten(replica_gradients(engine.module, ctx.parallel_state)))
        return take_model_step(*args, **kwargs)

    engine._take_model_step = record_then_step
    try:
        loss = engine.train_batch(data_iter=batches)
    finally:
        if overridden:
            engine._take_model_step = take_model_step
        else:
            del engine._take_model_step  # the class's method again
    if len(captured) != 1:
        raise RuntimeError(f"DeepSpeed's pipeline engine took {len(captured)} optimizer steps in one train_batch "
                           f"(expected 1 call of _take_model_step); cannot log log_* values")
    if not debug:
        return loss, {}, gradients[0] if gradients else None
    extras = debug_values(neox_args, gather_debug_sums(captured[0], ctx.parallel_state))
    if neox_args.memory_profiling:
        extras.update(memory_stats())
    return loss, extras, gradients[0] if gradients else None


def _replicated_grad_norm(module: torch.nn.Module, parallel_state) -> torch.Tensor:
    """L2 norm of the full gradient without ZeRO (DeepSpeed reports none there): gradients are already
    averaged over data-parallel ranks; megatron.mpu.grad_norm counts tensor-parallel shards and experts split
    over expert-parallel ranks. A one-element tensor on the gradients' device (read when it is logged)."""
    return global_grad_norm(module.parameters(), parallel_state)


def data_parallel_mean(loss: torch.Tensor, engine) -> float:
    loss = loss.detach().float().reshape(1).clone()
    if dist.is_initialized():
        group = engine.mpu.get_data_parallel_group() if getattr(engine, "mpu", None) else None
        if getattr(engine, "is_pipe_parallel", False):
            # the pipeline engine already broadcast the loss to all stages; average over data-parallel ranks
            group = engine.grid.get_data_parallel_group()
        loss = all_reduce(loss, group=group) / world_size(group)
    return loss.item()


class CharCounter:
    """Wraps a stream of {'text': tokens} samples and counts the predicted tokens (every token after the first of
    each sample) and the characters they detokenize to, for char_level_ppl."""

    def __init__(self, samples: Iterator, tokenizer) -> None:
        self.samples, self.tokenizer = samples, tokenizer
        self.tokens = 0
        self.chars = 0

    def __iter__(self):
        return self

    def __next__(self):
        data = next(self.samples)
        for sample in data["text"]:
            predicted = [int(t) for t in sample[1:]]
            self.tokens += len(predicted)
            self.chars += len(self.tokenizer.detokenize(predicted))
        return data


def tokens_per_char(tokens: int, chars: int) -> Optional[float]:
    """Tokens per character over every rank's evaluation samples (each data-parallel replica reads its own)."""
    # ranks that read no samples add zeros; stages that read the same add a ratio
    tokens, chars = all_reduce([float(tokens), float(chars)]).tolist()
    return tokens / chars if chars > 0 else None


@torch.no_grad()
def evaluate(neox_args, engine, batches: Optional[ModelBatches], iterations: int) -> Optional[Dict[str, float]]:
    """{'lm_loss': mean loss over `iterations` global batches (the DPO loss under train_impl 'dpo', with its
    metrics beside it)} and, with char_level_ppl,
    'lm_loss_char_lvl_ppl': exp(lm_loss x tokens per character) (GPT-NeoX's character-level perplexity)."""
    if batches is None or iterations <= 0:
        return None
    counter = None
    if neox_args.char_level_ppl and batches.samples is not None:
        counter = batches.samples = CharCounter(batches.samples, batches.ctx.tokenizer)
    engine.eval()
    losses: List[float] = []
    try:
        for _ in range(iterations):
            if neox_args.is_pipe_parallel:  # the full batch's micro-batches, also while rampup_batch_size ramps
                losses.append(data_parallel_mean(engine.eval_batch(
                    data_iter=batches, num_micro_batches=neox_args.gradient_accumulation_steps), engine))
            else:
                micro = [loss_of(engine, next(batches)).float()
                         for _ in range(neox_args.gradient_accumulation_steps)]
                losses.append(data_parallel_mean(torch.stack(micro).mean(), engine))
            if neox_args.checkpoint_activations and neox_args.contiguous_checkpointing:
                deepspeed.checkpointing.reset()
    finally:
        if counter is not None:
            batches.samples = counter.samples
    engine.train()
    result = {"lm_loss": sum(losses) / len(losses), **objective_metrics(engine)}
    if neox_args.char_level_ppl:
        ratio = tokens_per_char(counter.tokens if counter else 0, counter.chars if counter else 0)
        if ratio is not None:
            result["lm_loss_char_lvl_ppl"] = math.exp(min(result["lm_loss"] * ratio, PPL_LOSS_CAP))
    return result
