"""The pretraining loop: model + optimizer + LR schedule under deepspeed.initialize, the train / eval
loop, checkpoints, logging and clean shutdown on SIGTERM / SIGINT.

One train step is one optimizer step over gradient_accumulation_steps micro-batches (with
rampup_batch_size, over those of the step's batch: set_batch_size). Without a pipeline
the DeepSpeed engine is driven micro-batch by micro-batch (forward, backward, step — DeepSpeed steps the
optimizer and the LR schedule at the accumulation boundary); with a pipeline, DeepSpeed's
PipelineEngine.train_batch runs the whole schedule.

The loop is a _TrainingRun over the run's TrainState (megatron.training.state: the step and the samples consumed),
which each checkpoint saves and a resumed run restores."""

import math
import os
import signal
import time
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.utils import clip_grad_norm_

from megatron.checkpoint.async_save import AsyncCheckpoints
from megatron.checkpoint.engine import (complete_checkpoint, estimated_checkpoint_bytes, failed_save, load_checkpoint,
                                        restore_rng, save_checkpoint, space_problem)
from megatron.checkpoint.files import use_safe_loading
from megatron.checkpoint.non_persistent import in_non_persistent_dir, non_persistent_due
from megatron.checkpoint.run_lock import RunLock
from megatron.data import curriculum
from megatron.data.data_utils import build_train_valid_test_datasets, make_data_loader, repeating_iterator
from megatron.data.pairwise_dataset import as_text_and_labels
from megatron.errors import CheckpointError, ConfigError, DataError
from megatron.evaluation.harness import run_eval_tasks
from megatron.initialize import RunContext, initialize_megatron
from megatron.model.batch import BatchOptions, causal_only_mask, get_batch, to_device, truncate_batch
from megatron.model.gpt2_model import GPT2ModelSequential, build_model, loss_function
from megatron.model.moe import moe_metrics, set_aux_loss_scale
from megatron.model.moe.pipeline import adapt_pipeline_moe_engine
from megatron.mpu import broadcast_data
from megatron.mpu.grad_norm import clip_grad_norm, global_grad_norm
from megatron.mpu.host_collectives import all_gather_object, all_reduce, broadcast_object, world_size
from megatron.observability.comms_logging import CommsReporter
from megatron.observability.timers import Timers
from megatron.observability.training_logger import (PPL_LOSS_CAP, DeepSpeedMonitorSink, MemoryProfiler, TrainingLogger,
                                                    debug_metrics, debug_sums, debug_values, gather_debug_sums,
                                                    memory_stats)
from megatron.optim.learning_rates import AnnealingLR, build_lr_scheduler
from megatron.optim.optimizers import build_optimizer, describe_param_groups, pipeline_group_mismatch
from megatron.post_training.objectives import preference_loss
from megatron.post_training.reference import ReferenceModel, start_reference
from megatron.training.mup_run import base_shapes_and_coord_check, prepare_model
from megatron.training.state import TrainState, run_state
from megatron.training_schedule import OverflowGuard, TrainingSchedule
from megatron.utils.lazy_compile import DEEPSPEED_MUON, import_with_lazy_compile


class StopRequested:
    """Set by SIGTERM / SIGINT; the loop saves a checkpoint at the next step boundary and exits.

    Processes forked while it is installed (multiprocessing pools, e.g. lm-eval's bootstrap of metric
    errors during eval_tasks) inherit the handler; there it steps aside and the signal does what it did
    before, so that Pool.terminate() can still stop its workers (they used to ignore SIGTERM, and the
    training process waited for them forever)."""

    def __init__(self) -> None:
        self.signal_name: Optional[str] = None
        self._previous: Dict[int, Any] = {}
        self._pid: Optional[int] = None

    def install(self) -> None:
        self._pid = os.getpid()
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, _frame) -> None:
        if os.getpid() != self._pid:  # a forked child: behave as if never installed
            previous = self._previous.get(signum)
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.signal_name = signal.Signals(signum).name

    def restore(self) -> None:
        """Put back the handlers that were installed before (pretrain may run inside a larger program)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def any_rank(self, deadline: Optional[float] = None) -> Tuple[bool, bool]:
        """(a signal arrived, time.time() is past `deadline`) on any rank, agreed across ranks in one
        all-reduce so that every rank saves (a save is collective; on one rank nothing is sent)."""
        signalled, late = all_reduce([1.0 if self.signal_name else 0.0,
                                      1.0 if deadline is not None and time.time() >= deadline else 0.0],
                                     op="max").tolist()
        return bool(signalled), bool(late)


def _mark_grad_norm_ownership(model: torch.nn.Module, parallel_state) -> None:
    """Make DeepSpeed's gradient norm (clipping, ZeRO) count every parameter exactly once.

    DeepSpeed counts a parameter when it is marked `model_parallel` or when the rank is model-parallel
    rank 0 of its mpu. Under the pipeline engine that mpu spans all stages, so without marks the later
    stages' parameters would be left out (and the norm, hence clipping, would differ from the same model
    without a pipeline). Mark tensor-parallel shards on every rank, and replicated parameters on
    tensor-parallel rank 0 only, and neither on the tied copies DeepSpeed already counts on another stage (a
    tensor-parallel tied embedding too: counted on both stages it doubled its share of the norm)."""
    tp_rank0 = parallel_state.get_model_parallel_rank() == 0
    for param in model.parameters():
        split = getattr(param, "model_parallel", False) and parallel_state.get_model_parallel_world_size() > 1
        replicated_elsewhere = getattr(param, "ds_pipe_replicated", False)
        param.model_parallel = bool((split or tp_rank0) and not replicated_elsewhere)


def _record_clipping_grad_norm(engine) -> None:
    """Without ZeRO, DeepSpeed computes the global norm to clip but throws it away; keep it so that it can be
    logged without computing it a second time. With expert parallelism DeepSpeed's norm is not the whole
    gradient's (megatron.mpu.grad_norm): clip by that one instead."""
    experts_split = getattr(engine.mpu, "expert_parallel_size", 1) > 1

    def clip_and_record() -> None:
        if experts_split:
            engine._global_grad_norm = clip_grad_norm(engine.module.parameters(), engine.gradient_clipping(),
                                                      engine.mpu)
            return
        engine._global_grad_norm = clip_grad_norm_(parameters=engine.module.parameters(),
                                                    max_norm=engine.gradient_clipping(), mpu=engine.mpu)

    engine.clip_fp32_gradients = clip_and_record


def setup_model_and_optimizer(neox_args, ctx: RunContext, schedule: TrainingSchedule):
    """Build the model, optimizer and LR schedule and hand them to deepspeed.initialize.

    The schedule is the built-in AnnealingLR, or, when the config has a DeepSpeed `scheduler` dict, the
    scheduler DeepSpeed builds from it (the engine steps either after each optimizer step and saves and loads
    its state in checkpoints)."""
    model = build_model(ctx.model_config, ctx.parallel_state, ctx.rng_tracker)
    if neox_args.use_mup:  # base shapes on the parameters and muP's initialisation; then muP's optimizer groups

        prepare_model(neox_args, model, ctx.parallel_state)
    loss_fn = preference_loss(neox_args, ctx.parallel_state.get_model_parallel_group())
    if loss_fn is not None:  # DPO / KTO: the model's own loss (the LM loss, or a reward model's) is replaced
        model.loss_fn = loss_fn
    _place_as_deepspeed_will(model, neox_args, ctx)
    optimizer = build_optimizer(neox_args, model)
    if neox_args.is_pipe_parallel and neox_args.zero_stage in (1, 2):
        _check_stage_param_groups(optimizer, ctx.parallel_state)
    lr_scheduler = None if neox_args.scheduler else build_lr_scheduler(neox_args, schedule, optimizer)
    config = {k: v for k, v in neox_args.deepspeed_config.items() if k != "optimizer"
              and not (k == "scheduler" and lr_scheduler is not None)}
    if neox_args.is_pipe_parallel and neox_args.context_parallel_size > 1:
        # the pipeline engine's data axis is data x context (ParallelState.get_topology): it counts each
        # context-parallel rank's chunks of the same samples as a batch of their own
        config["train_batch_size"] = neox_args.train_batch_size * neox_args.context_parallel_size
    if neox_args.zero_stage > 0 and not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        # ZeRO refuses optimizers DeepSpeed has not tested unless told; ours are tested here
        config.setdefault("zero_allow_untested_optimizer", True)
    if neox_args.is_pipe_parallel:
        _mark_grad_norm_ownership(model, ctx.parallel_state)
    if neox_args.zero_stage == 3 and neox_args.context_parallel_size > 1:
        _partition_over_data_and_context(model, ctx, config)
    if neox_args.zero_stage > 0:  # ZeRO's optimizer check imports DeepSpeed's Muon: its torch.compile, deferred
        import_with_lazy_compile(DEEPSPEED_MUON)
    engine, _, _, engine_scheduler = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=lr_scheduler, config=config,
        mpu=None if neox_args.is_pipe_parallel else ctx.parallel_state, dist_init_required=False)
    if neox_args.is_pipe_parallel and neox_args.context_parallel_size > 1:
        # its batch check passed at construction: from here on (samples counted, DeepSpeed's monitors and
        # samples/sec) the batch is the real one again
        engine._config.train_batch_size = neox_args.train_batch_size
    _record_clipping_grad_norm(engine)
    if neox_args.is_pipe_parallel and neox_args.moe_num_experts > 1:
        adapt_pipeline_moe_engine(engine, ctx.parallel_state)
    use_safe_loading(engine)
    skip_single_rank_allreduce(engine, neox_args, ctx.parallel_state)
    return engine, optimizer, lr_scheduler if lr_scheduler is not None else engine_scheduler


TRAINING_DTYPES = {"fp16": torch.float16, "bfloat16": torch.bfloat16}
"""neox_args.precision -> the dtype DeepSpeed casts the parameters to (fp32: none)."""

CASTABLE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
"""The parameter dtypes DeepSpeed 0.19 casts to the training dtype (runtime/engine.py CASTABLE_DTYPES)."""


def _place_as_deepspeed_will(model: torch.nn.Module, neox_args, ctx: RunContext) -> None:
    """Cast the parameters to the 16-bit training dtype and move the model to ctx.device, as deepspeed.initialize
    does (engine._configure_distributed_model: the floating-point parameters cast, the buffers left as they are,
    then module.to(device)), but before the optimizer is built: megatron.optim.optimizers chooses and builds it for the
    parameters as they will train (DeepSpeed's FusedAdam on CUDA where that gives the flat 16-bit optimizer). The
    parameter objects stay the same (their data is replaced), as under DeepSpeed's own cast, so the attributes set on
    them (muP shapes, expert and no-decay flags) stay, and DeepSpeed's cast and move then find nothing to do.

    Under ZeRO-3 with context parallelism the model is cast but stays on the host: deepspeed.zero.Init
    (_partition_over_data_and_context) moves it to the device one parameter's partition at a time, so the whole
    model never has to fit on one device. DeepSpeed's accelerator must be the device the project trains on, or
    the engine would move the model to the other one: a RuntimeError says so before anything is built."""
    accelerator = get_accelerator().device_name()
    if accelerator != ctx.device.type:
        raise RuntimeError(
            f"DeepSpeed's accelerator is {accelerator!r} (DS_ACCELERATOR={os.environ.get('DS_ACCELERATOR')!r}) but "
            f"this worker trains on {ctx.device}: unset DS_ACCELERATOR to let DeepSpeed use the GPU, or hide the "
            f"GPUs (CUDA_VISIBLE_DEVICES=) to train on the CPU")
    dtype = TRAINING_DTYPES.get(neox_args.precision)
    if dtype is not None:
        for param in model.parameters():
            if param.dtype in CASTABLE_DTYPES and param.dtype != dtype:
                param.data = param.data.to(dtype)
    if not (neox_args.zero_stage == 3 and neox_args.context_parallel_size > 1):
        model.to(ctx.device)


def _check_stage_param_groups(optimizer: torch.optim.Optimizer, ps) -> None:
    """Every pipeline stage must have the same optimizer groups under ZeRO 1 / 2 (megatron.optim.optimizers.
    pipeline_group_mismatch): a ConfigError on every rank instead of a hang at the first step."""
    stages = all_gather_object(describe_param_groups(optimizer.param_groups), group=ps.get_pipe_parallel_group())
    problem = pipeline_group_mismatch(stages)
    if problem:
        raise ConfigError([problem])


def _partition_over_data_and_context(model: torch.nn.Module, ctx: RunContext, config: Dict[str, Any]) -> None:
    """ZeRO-3 with context parallelism. DeepSpeed's engine would partition the parameters over its mpu's
    data-parallel group alone, so the context-parallel ranks' gradients would never be summed: partition them over
    data x context here (deepspeed.zero.Init on the built module; the engine then keeps that partitioning). Stage
    3's reduce-scatter averages over that whole group, so the loss's gradient share is scaled by
    context_parallel_size, as under the pipeline engine (megatron.model.gpt2_model.cross_entropy_loss)."""
    ps = ctx.parallel_state
    deepspeed.zero.Init(module=model, data_parallel_group=ps.get_sequence_data_parallel_group(),
                        config_dict_or_path=config, mpu=ps)
    model.loss_fn = loss_function(ctx.model_config, ps, averaged_over_context=True)


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


def skip_single_rank_allreduce(engine, neox_args, parallel_state) -> bool:
    """Without ZeRO or a pipeline, DeepSpeed all-reduces the gradients after every backward through one
    flat buffer: every gradient copied in and back out, even over a single data-parallel rank, where the
    average is the gradient itself (137 ms a step for a 160M model on CPU). Switch that off there; ZeRO
    (whose optimizer keeps its own gradient state in that call) and the pipeline engine are left as they
    are. Returns whether it was switched off."""
    if neox_args.zero_stage != 0 or neox_args.is_pipe_parallel or \
            parallel_state.get_sequence_data_parallel_world_size() != 1:  # data x context-parallel ranks
        return False
    engine.enable_backward_allreduce = False
    return True


def _batch_streams(neox_args, ctx: RunContext, schedule: TrainingSchedule, consumed_train: int,
                   consumed_valid: int, reference=None):
    """(train, valid, test) streams of model batches, None for a split without data. Every rank builds the
    datasets (rank 0 builds the index maps, the others wait); only model-parallel rank 0 reads samples and
    broadcasts them to its tensor-parallel group."""
    ps = ctx.parallel_state
    reads_data = ps.get_model_parallel_rank() == 0
    datasets = build_train_valid_test_datasets(neox_args, schedule.split_samples())
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    streams = []
    for dataset, consumed, split in zip(datasets, (consumed_train, consumed_valid, 0), ("train", "valid", "test")):
        if dataset is None:
            streams.append(None)
            continue
        samples = repeating_iterator(make_data_loader(dataset, neox_args, dp_rank, dp_size, consumed)) \
            if reads_data else None
        streams.append(_ModelBatches(neox_args, ctx, samples, source=_data_source(neox_args, split),
                                     reference=reference))
    return streams


def _data_source(neox_args, split: str) -> str:
    """Names the files of one split, for messages about their contents."""
    paths = getattr(neox_args, f"{split}_data_paths") or ([neox_args.data_path] if neox_args.data_path else [])
    if neox_args.dataset_impl == "pairwise":
        paths = [*(getattr(neox_args, f"pos_{split}_data_paths") or []),
                 *(getattr(neox_args, f"neg_{split}_data_paths") or [])]
    return f"the {split} data ({', '.join(map(str, paths))})"


def batch_options(neox_args):
    """The batch-building settings of the config (megatron.model.batch.BatchOptions)."""
    return BatchOptions(labels=bool(neox_args.train_label_data_paths) or neox_args.dataset_impl == "pairwise",
                        rewards=neox_args.train_impl == "kto", eod_mask_loss=neox_args.eod_mask_loss,
                        reset_position_ids=neox_args.reset_position_ids,
                        reset_attention_mask=neox_args.reset_attention_mask)


class _ModelBatches:
    """Turns {'text': ...} samples into the model's batch format (shared inside the TP group).

    Pairwise samples ({'pos', 'neg', ...}) become one batch of the chosen rows then the rejected rows; the
    reference log-probabilities of each row (from the DPO / KTO `reference` model, or read from precomputed files)
    join the labels tuple (megatron.post_training)."""

    def __init__(self, neox_args, ctx: RunContext, samples: Optional[Iterator], source: str = "the data",
                 reference=None) -> None:
        self.options, self.ctx, self.samples, self.source = batch_options(neox_args), ctx, samples, source
        self.tokenizer_file = neox_args.vocab_file
        self.pairwise, self.reference = neox_args.dataset_impl == "pairwise", reference
        self.precomputed = neox_args.train_impl in ("dpo", "kto") and bool(neox_args.precompute_model_name)
        self.pipelined = neox_args.is_pipe_parallel
        self.seqlen: Optional[int] = None  # the sequence-length curriculum's current length (set per step)

    def __iter__(self):
        return self

    def _check_token_ids(self, tokens: torch.Tensor) -> None:
        """Data tokenized with another tokenizer holds ids past the embedding table, which would end in an
        IndexError deep inside the model (one max over CPU token ids per batch: no device sync)."""
        vocab = self.ctx.model_config.padded_vocab_size
        largest = int(tokens.max()) if tokens.numel() else 0
        if largest >= vocab:
            raise DataError(f"token id {largest} in {self.source} is beyond the model's vocabulary of {vocab} "
                            f"ids (the tokenizer {self.tokenizer_file or ''} padded to "
                            f"make_vocab_size_divisible_by): the data was tokenized with another tokenizer; "
                            f"preprocess it again with this one (tools/datasets/preprocess_data.py) or set the "
                            f"tokenizer it was made with")

    def __next__(self):

        data = next(self.samples) if self.samples is not None else None
        if data is not None and self.pairwise:
            data = as_text_and_labels(data)
        if data is not None:
            self._check_token_ids(data["text"])
            # the sample goes to the device first, asynchronously (pinned memory), and becomes the batch there
            data = {key: to_device(value, self.ctx.device) if torch.is_tensor(value) else value
                    for key, value in data.items()}
        inputs, labels = get_batch(self.options, data, self.ctx.parallel_state, eod_token=self.ctx.tokenizer.eod)
        if inputs[2] is None and self.pipelined:  # context parallelism: ring attention needs no mask, but
            inputs = (*inputs[:2], causal_only_mask())  # DeepSpeed's pipeline passes tensors only
        move = lambda t: None if t is None else to_device(t, self.ctx.device)  # no mask under CP
        inputs, labels = tuple(map(move, inputs)), tuple(map(move, labels))
        if self.reference is not None:
            if self.reference.holds:  # the last pipeline stage (the others do not read the labels)
                labels = labels + (self.reference.logps(inputs, labels[0], labels[1]),)
        elif self.precomputed:
            ref = broadcast_data(["ref"], data, torch.float32, self.ctx.parallel_state)["ref"].to(self.ctx.device)
            labels = labels + ((ref[:, 1:] * labels[1]).sum(dim=-1),)
        if self.seqlen is not None:
            inputs, labels = truncate_batch((inputs, labels), self.seqlen)
        return inputs, labels


def start_curriculum(neox_args, engine, iteration: int, client_state: Dict[str, Any]):
    """The sequence-length curriculum (megatron.data.curriculum) continued after `iteration` steps, None when off.
    DeepSpeed's pipeline engine caches the activation shapes it sends between stages after the first batch;
    with a curriculum the shapes change, so it exchanges them with every batch (its dynamic_shape mode)."""
    if not curriculum.enabled(neox_args.curriculum_learning):
        return None
    schedule = curriculum.SeqlenCurriculum(neox_args.curriculum_learning)
    schedule.resume(iteration, client_state.get(curriculum.STATE_KEY))
    if neox_args.is_pipe_parallel:
        engine.dynamic_shape = True
    return schedule


def curriculum_step(schedule, batches: _ModelBatches, iteration: int) -> int:
    """Cut the training batches of step `iteration + 1` to the curriculum's length for it; returns that length."""
    batches.seqlen = schedule.seqlen_for_step(iteration + 1)
    return batches.seqlen


def _loss_of(engine, batch) -> torch.Tensor:
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


def train_step(neox_args, engine, batches: _ModelBatches, ctx: RunContext, optimizer, debug: bool = False
               ) -> Tuple[float, bool, Union[torch.Tensor, float, None], Dict[str, float]]:
    """One optimizer step; returns (mean loss over the global batch, whether the step was skipped, the
    global gradient norm before clipping, the log_* / memory_profiling values when `debug`). The norm is left as
    the engine keeps it (a device tensor: reading it waits for the device, so the logger reads it only when it
    writes a record)."""
    grad_norm = None
    extras: Dict[str, float] = {}
    if neox_args.moe_num_experts > 1:
        set_aux_loss_scale(engine.module, aux_loss_scale(engine, neox_args))
    if neox_args.is_pipe_parallel:
        if debug:
            loss, extras = _pipeline_debug_step(neox_args, engine, batches, ctx, optimizer)
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
            loss = _loss_of(engine, next(batches))
            engine.backward(loss)
            if micro == steps - 1:
                if neox_args.zero_stage == 0 and not neox_args.gradient_clipping:  # else DeepSpeed computes it
                    grad_norm = _replicated_grad_norm(engine.module, ctx.parallel_state)
                if debug:
                    extras = debug_metrics(neox_args, engine.module, optimizer, ctx.parallel_state)
            engine.step()
            losses.append(loss.detach().float())
        loss = torch.stack(losses).mean()
    ds_norm = engine.get_global_grad_norm()
    if ds_norm is not None:
        grad_norm = ds_norm
    skipped = not engine.was_step_applied()
    extras.update(objective_metrics(engine))
    return _data_parallel_mean(loss, engine), skipped, grad_norm, extras


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


def _pipeline_debug_step(neox_args, engine, batches, ctx: RunContext, optimizer
                         ) -> Tuple[torch.Tensor, Dict[str, float]]:
    """engine.train_batch, with the log_* values of the whole model taken where the sequential model takes
    them: after the last backward and the gradient reduction, before clipping and the optimizer step.

    The pipeline engine runs ReduceTiedGrads, ReduceGrads and OptimizerStep at the end of its schedule;
    OptimizerStep calls engine._take_model_step, which clips (fp32 without ZeRO; ZeRO and bf16 clip inside
    optimizer.step), steps the optimizer and frees the gradients. For this call only, the engine's
    _take_model_step first records this stage's values (debug_sums, under the sequential model's names); after
    train_batch the stages' values are combined on every rank (gather_debug_sums)."""
    captured: List[Dict[str, List[float]]] = []
    take_model_step = engine._take_model_step
    overridden = "_take_model_step" in vars(engine)  # already replaced on this engine (by a caller)

    def record_then_step(*args, **kwargs):
        captured.append(debug_sums(neox_args, engine.module, optimizer, ctx.parallel_state,
                                   names=engine.module.sequential_name))
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
    extras = debug_values(neox_args, gather_debug_sums(captured[0], ctx.parallel_state))
    if neox_args.memory_profiling:
        extras.update(memory_stats())
    return loss, extras


def _replicated_grad_norm(module: torch.nn.Module, parallel_state) -> torch.Tensor:
    """L2 norm of the full gradient without ZeRO (DeepSpeed reports none there): gradients are already
    averaged over data-parallel ranks; megatron.mpu.grad_norm counts tensor-parallel shards and experts split
    over expert-parallel ranks. A one-element tensor on the gradients' device (read when it is logged)."""
    return global_grad_norm(module.parameters(), parallel_state)


def _data_parallel_mean(loss: torch.Tensor, engine) -> float:
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
def evaluate(neox_args, engine, batches: Optional[_ModelBatches], iterations: int) -> Optional[Dict[str, float]]:
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
                losses.append(_data_parallel_mean(engine.eval_batch(
                    data_iter=batches, num_micro_batches=neox_args.gradient_accumulation_steps), engine))
            else:
                micro = [_loss_of(engine, next(batches)).float()
                         for _ in range(neox_args.gradient_accumulation_steps)]
                losses.append(_data_parallel_mean(torch.stack(micro).mean(), engine))
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


def _agreed_problem(problem: Optional[str]) -> Optional[str]:
    """Rank 0's finding, given to every rank (all stop together instead of waiting for rank 0 in a collective)."""
    return broadcast_object(problem, src=0)


def _claim_save_directory(neox_args):
    """Rank 0 takes `save`'s run lock (megatron.checkpoint.run_lock); CheckpointError on every rank when another run holds it."""
    lock = RunLock(neox_args.save)
    problem = lock.acquire() if not dist.is_initialized() or dist.get_rank() == 0 else None
    problem = _agreed_problem(problem)
    if problem:
        raise CheckpointError(problem)
    return lock


def _check_space_for_a_checkpoint(neox_args, engine, ctx: RunContext) -> None:
    """Room for one checkpoint in `save`, checked before the first step rather than found at the first save."""
    mine = float(sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters()))
    parameters = all_reduce([mine]).item()
    if dist.is_initialized():
        parameters /= ctx.parallel_state.get_data_parallel_world_size()
    weight_bytes = next(engine.module.parameters()).element_size()
    problem = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        problem = space_problem(neox_args.save, estimated_checkpoint_bytes(neox_args.save, int(parameters),
                                                                           weight_bytes))
    problem = _agreed_problem(problem)
    if problem:
        raise CheckpointError(problem)


def _async_checkpoints(neox_args, engine, ctx: RunContext):
    """async_save's background writer (megatron.checkpoint.async_save), None for synchronous saves."""
    if not (neox_args.async_save and neox_args.save):
        return None

    return AsyncCheckpoints(engine, failure=failed_save,
                            complete=lambda path, it, digests: complete_checkpoint(
                                path, it, neox_args.keep_last_n_checkpoints,
                                only=in_non_persistent_dir(neox_args, path), digests=digests))


def steps_to_next_save(neox_args, schedule: TrainingSchedule, at: int) -> Optional[int]:
    """Steps from a save at ``at`` to the next save of any kind or the run's end or exit (async_save spreads its
    writes over them), None when there are none."""
    ahead = [i for i in schedule.save_iters if i > at] + [schedule.train_iters]
    for interval in (neox_args.non_persistent_save_interval, neox_args.exit_interval):
        if interval:
            ahead.append((at // interval + 1) * interval)
    steps = min(ahead) - at
    return steps if steps > 0 else None


def _start_reference(neox_args, ctx: RunContext, engine, resumed: Optional[str]):
    """The frozen reference model of DPO / KTO (megatron.post_training.reference), None when the run needs none.
    ``resumed``: the checkpoint this run resumed training from (None for a fresh or fine-tuning start)."""
    if neox_args.train_impl not in ("dpo", "kto") or neox_args.precompute_model_name or (
            neox_args.train_impl == "dpo" and neox_args.dpo_reference_free):
        return None  # none needed, or read from precomputed files (megatron.post_training.precompute)

    fp32 = neox_args.dpo_fp32 if neox_args.train_impl == "dpo" else neox_args.kto_fp32
    reference = ReferenceModel(ctx.model_config, ctx.parallel_state, fp32).to(ctx.device)
    source = start_reference(reference, engine.module, resumed)
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"{neox_args.train_impl.upper()} reference model: {source}", flush=True)
    return reference


def pretrain(neox_args) -> Dict[str, Any]:
    """Train (and evaluate) as the config says; returns a summary (iterations, losses, evaluations)."""
    problems = neox_args.training_problems()
    if problems:
        raise ConfigError(problems)
    started_at = time.time()
    deadline = None if neox_args.exit_duration_in_mins is None else started_at + 60.0 * neox_args.exit_duration_in_mins
    ctx = initialize_megatron(neox_args)
    do_train = neox_args.do_train if neox_args.do_train is not None else True
    lock = _claim_save_directory(neox_args) if do_train and neox_args.save else None
    try:
        return _train_and_evaluate(neox_args, ctx, do_train, check_space=lock is not None, deadline=deadline)
    finally:
        if lock is not None:
            lock.release()


def _train_and_evaluate(neox_args, ctx: RunContext, do_train: bool, check_space: bool,
                        deadline: Optional[float]) -> Dict[str, Any]:
    """pretrain's body, with `save` locked: ``deadline`` (time.time()) is exit_duration_in_mins's end."""
    schedule = TrainingSchedule.from_neox_args(neox_args)
    if neox_args.use_mup and (neox_args.save_base_shapes or neox_args.coord_check):
        return base_shapes_and_coord_check(neox_args, ctx, lambda: next(_batch_streams(neox_args, ctx, schedule, 0,
                                                                                          0)[0]))
    stop = StopRequested()
    stop.install()
    try:
        engine, optimizer, lr_scheduler = setup_model_and_optimizer(neox_args, ctx, schedule)
        if check_space:
            _check_space_for_a_checkpoint(neox_args, engine, ctx)
    except BaseException:
        stop.restore()
        raise
    iteration, client_state, loaded_from = load_checkpoint(neox_args, ctx.model_config, engine, ctx.checkpoint)
    reference = _start_reference(neox_args, ctx, engine, loaded_from if iteration else None)
    state = TrainState.from_checkpoint(client_state, iteration, neox_args.train_batch_size, neox_args.finetune)
    streams = _batch_streams(neox_args, ctx, schedule, state.consumed_train_samples, state.consumed_valid_samples,
                             reference)
    schedule_of_lengths = start_curriculum(neox_args, engine, iteration, client_state) if do_train else None
    # the first step draws from the checkpoint's RNG state, as the uninterrupted run did at that step (MoE router
    # jitter and dropout draw the same noise), whatever building the batch streams drew: set here, and only here
    restore_rng(neox_args, loaded_from, client_state)
    run = _TrainingRun(neox_args, ctx, (engine, optimizer, lr_scheduler), schedule, state, schedule_of_lengths,
                       streams, reference, stop, deadline, do_train)
    try:
        run.train()
        run.finish()
    finally:
        run.logger.close()
        stop.restore()
    run.summary["iteration"] = state.iteration
    run.summary["skipped_steps"] = run.overflow.total
    ctx.destroy()
    return run.summary


def _training_logger(neox_args, ctx: RunContext, engine, schedule: TrainingSchedule, iteration: int):
    """The run's TrainingLogger, its clock started at ``iteration`` (and feeding DeepSpeed's monitors when on)."""
    logger = TrainingLogger(neox_args, ctx.model_config, rank=dist.get_rank() if dist.is_initialized() else 0,
                            train_iters=schedule.train_iters)
    logger.restart_clock(iteration)
    if logger.is_logging_rank and engine.monitor.enabled:
        logger.out.add(DeepSpeedMonitorSink(engine))
    return logger


class _TrainingRun:
    """The loop over a TrainState and its bookkeeping, one method per job: a step, the evaluation and the saves it
    calls for, the stop checks, the end of training. Holds the run's collaborators (the engine, its optimizer and
    LR schedule, the batch streams, the logger and timers, async_save's background writer) and the summary that
    pretrain returns; the TrainState is what the checkpoints save of the run (with the curriculum's state)."""

    def __init__(self, neox_args, ctx: RunContext, engine_parts: Tuple[Any, Any, Any], schedule: TrainingSchedule,
                 state: TrainState, curriculum, streams: List[Optional[_ModelBatches]], reference,
                 stop: StopRequested, deadline: Optional[float], do_train: bool) -> None:

        self.neox_args, self.ctx, self.schedule = neox_args, ctx, schedule
        self.state, self.curriculum = state, curriculum
        self.engine, self.optimizer, self.lr_scheduler = engine_parts
        self.train_batches, self.valid_batches, self.test_batches = streams
        self.reference, self.stop, self.deadline, self.do_train = reference, stop, deadline, do_train
        self.timers = Timers(enabled=neox_args.wall_clock_breakdown)
        self.logger = _training_logger(neox_args, ctx, self.engine, schedule, state.iteration)
        self.summary: Dict[str, Any] = {"start_iteration": state.iteration, "losses": [], "eval": []}
        self.overflow = OverflowGuard()
        self.wants_debug = any((neox_args.log_grad_norm, neox_args.log_param_norm, neox_args.log_grad_pct_zeros,
                                neox_args.log_optimizer_states, neox_args.memory_profiling))
        self.memory_profiler = None
        if neox_args.memory_profiling:
            self.memory_profiler = MemoryProfiler(neox_args)
        self.last_saved = self.last_moe_report = state.iteration
        self.comms = CommsReporter(neox_args.comms_logger)
        self.background = _async_checkpoints(neox_args, self.engine, ctx)

    def train(self) -> None:
        """Steps until train_iters, a stop request or exit_interval; each step's evaluation, then its save."""
        while self.do_train and self.state.iteration < self.schedule.train_iters:
            self.step()
            self.evaluate_at_interval()
            # saved after this step's evaluation, so that the checkpoint's consumed_valid_samples (and RNG state)
            # are those the uninterrupted run continues with: a resumed run replays the same validation batches
            self.save_if_due()
            if self.stopped() or self.exit_interval_reached():
                break

    def step(self) -> None:
        """One optimizer step (at the batch size and curriculum length of the step), counted and logged."""
        started = time.perf_counter()
        iteration, neox_args = self.state.iteration, self.neox_args
        debug = self.wants_debug and (iteration + 1) % neox_args.log_interval == 0
        batch_size = self.schedule.batch_size_at(self.state.consumed_train_samples)
        if self.schedule.rampup is not None:
            set_batch_size(self.engine, self.lr_scheduler, batch_size)
        seqlen = curriculum_step(self.curriculum, self.train_batches, iteration) if self.curriculum else None
        self.timers("train_step").start()
        result = train_step(neox_args, self.engine, self.train_batches, self.ctx, self.optimizer, debug)
        self.timers("train_step").stop()
        self.count_step(result[0], result[1], batch_size, debug)
        self.log_step(result, batch_size, seqlen, started)

    def count_step(self, loss: float, skipped: bool, batch_size: int, debug: bool) -> None:
        """The TrainState moves past the step; a non-finite loss stops the run."""
        self.state.iteration += 1
        iteration = self.state.iteration
        self.overflow.record(skipped, iteration)
        if self.background is not None:
            self.background.poll()
        if not math.isfinite(loss):
            raise FloatingPointError(f"iteration {iteration}: the loss is {loss}; lower lr or check the data")
        if self.memory_profiler is not None and debug:
            self.memory_profiler.dump(iteration)
        self.state.consumed_train_samples += batch_size
        self.summary["losses"].append(loss)

    def log_step(self, result: Tuple[float, bool, Any, Dict[str, float]], batch_size: int, seqlen: Optional[int],
                 started: float) -> None:
        """The step's record (train_step's ``result``, the timers and MoE values when due) and the comms report."""
        loss, skipped, grad_norm, extras = result
        iteration, neox_args = self.state.iteration, self.neox_args
        if iteration % neox_args.log_interval == 0:
            extras.update({f"time_ms/{k}": v for k, v in
                           self.timers.elapsed_ms(normalizer=neox_args.log_interval).items()})
        if neox_args.moe_num_experts > 1 and (iteration % neox_args.log_interval == 0
                                              or iteration == self.schedule.train_iters):
            extras.update(_moe_metrics(neox_args, self.ctx, self.engine, iteration - self.last_moe_report))
            self.last_moe_report = iteration
        if seqlen is not None:
            extras["curriculum_seqlen"] = seqlen
        self.logger.log_train(iteration=iteration, lm_loss=loss, lr=current_lr(self.lr_scheduler),
                              grad_norm=grad_norm, step_time=time.perf_counter() - started, skipped=skipped,
                              extras=extras, batch_size=batch_size, seq_length=seqlen)
        if self.comms.due(iteration):
            self.logger.log_comms(iteration, self.comms.report())

    def evaluate_at_interval(self) -> None:
        """eval_interval: the validation split (its stream moves on in the TrainState) and eval_tasks."""
        neox_args, iteration = self.neox_args, self.state.iteration
        if not (neox_args.eval_interval and iteration % neox_args.eval_interval == 0):
            return
        if self.valid_batches is not None:
            self.evaluate_split(self.valid_batches, "validation")
            self.state.consumed_valid_samples += neox_args.eval_iters * neox_args.train_batch_size
        if neox_args.eval_tasks:
            self.timers("eval").start()
            results = run_eval_tasks(neox_args, self.engine, self.ctx, iteration)
            self.timers("eval").stop()
            self.logger.log_eval_tasks(iteration, results["metrics"])
            self.summary["eval"].append((iteration, "eval_tasks", results["metrics"]))

    def evaluate_split(self, batches: Optional[_ModelBatches], split: str) -> None:
        """eval_iters batches of one split, logged and added to the summary."""
        self.timers("eval").start()
        result = evaluate(self.neox_args, self.engine, batches, self.neox_args.eval_iters)
        self.timers("eval").stop()
        if result is not None:
            value = result.pop("lm_loss")
            self.logger.log_eval(iteration=self.state.iteration, lm_loss=value, split=split, extras=result)
            self.summary["eval"].append((self.state.iteration, split, value))

    def save_if_due(self) -> None:
        """A checkpoint at save_iters, else a non-persistent one at its interval."""
        iteration = self.state.iteration
        if iteration in self.schedule.save_iters:
            self.save()
        elif non_persistent_due(self.neox_args, iteration, self.schedule.save_iters):
            self.save(non_persistent=True)

    def save(self, non_persistent: bool = False) -> None:
        """A checkpoint of the TrainState's iteration, unless one was saved there already (with async_save, after the
        previous checkpoint is complete)."""
        at, neox_args, background = self.state.iteration, self.neox_args, self.background
        if neox_args.save and self.last_saved != at:
            self.timers("save").start()
            if background is not None:
                background.wait()  # the previous checkpoint is complete before the next one starts
            path = save_checkpoint(neox_args, self.ctx.model_config, at, self.engine,
                                   run_state(self.state, self.curriculum),
                                   write_extra=self.reference.save if self.reference is not None else None,
                                   complete=background is None, non_persistent=non_persistent)
            if background is not None:
                background.started(path, at, steps_to_next_save(neox_args, self.schedule, at))
            self.timers("save").stop()
            if not non_persistent:  # a persistent save at the same iteration (the run's end) still happens
                self.last_saved = at

    def stopped(self) -> bool:
        """A signal on any rank, or exit_duration_in_mins passed: saved, recorded in the summary and said."""
        signalled, out_of_time = self.stop.any_rank(self.deadline)
        if not (signalled or out_of_time):
            return False
        self.save()
        stop_name = self.stop.signal_name
        self.summary["stopped_by"] = (stop_name or "another rank's signal") if signalled else "exit_duration_in_mins"
        if signalled:  # train.py exits 128 + the signal (megatron.launch.signals); out of time: 0
            self.summary["signal"] = stop_name
        if self.logger.is_logging_rank:
            self._say_why_stopped(signalled)
        return True

    def _say_why_stopped(self, signalled: bool) -> None:
        """One line on the logging rank: why the run stops and where its checkpoint is."""
        neox_args, iteration = self.neox_args, self.state.iteration
        reason = (f"received {self.summary['stopped_by']}" if signalled else
                  f"exit_duration_in_mins={neox_args.exit_duration_in_mins} passed")
        saved = (f"saved a checkpoint at iteration {iteration} in {neox_args.save}" if neox_args.save
                 else f"no checkpoint saved (save is not set) at iteration {iteration}")
        print(f"{reason}: {saved}, exiting", flush=True)

    def exit_interval_reached(self) -> bool:
        """exit_interval: the run leaves before train_iters (the next launch continues from its checkpoint)."""
        iteration, interval = self.state.iteration, self.neox_args.exit_interval
        if interval and iteration % interval == 0 and iteration < self.schedule.train_iters:
            self.summary["exited_at_interval"] = True  # not the end of training: no final evaluation
            return True
        return False

    def finish(self) -> None:
        """The last checkpoint and comms report, the final validation and test evaluations (not after a stop or
        exit_interval), and the background writer's last checkpoint complete."""
        neox_args, iteration = self.neox_args, self.state.iteration
        if self.do_train:
            self.save()
            if self.comms.enabled and not self.comms.due(iteration):
                self.logger.log_comms(iteration, self.comms.report())
        if "stopped_by" not in self.summary and "exited_at_interval" not in self.summary:
            if neox_args.do_valid and self.valid_batches is not None:
                self.evaluate_split(self.valid_batches, "validation")
            if (neox_args.do_test if neox_args.do_test is not None else True) and self.test_batches is not None:
                self.evaluate_split(self.test_batches, "test")
        if self.background is not None:
            self.background.wait()
