"""The pretraining loop (pretrain): the run set up (megatron.training.setup), its checkpoint loaded, its batches
built (megatron.training.batches), then steps (megatron.training.step), evaluations, checkpoints, logging and a
clean shutdown on SIGTERM / SIGINT or at exit_duration_in_mins.

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
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch.distributed as dist

from megatron.checkpoint.async_save import AsyncCheckpoints
from megatron.checkpoint.engine import (complete_checkpoint, directory_bytes, estimated_checkpoint_bytes, failed_save,
                                        load_checkpoint, restore_rng, save_checkpoint, space_problem)
from megatron.checkpoint.format import read_latest
from megatron.checkpoint.lora import load_lora_checkpoint
from megatron.checkpoint.non_persistent import in_non_persistent_dir, non_persistent_due, non_persistent_problem
from megatron.checkpoint.run_lock import RunLock
from megatron.checkpoint.s3_upload import S3Uploads, bucket_problem, s3_client
from megatron.errors import CheckpointError, ConfigError, TrainingDiverged
from megatron.evaluation.harness import run_eval_tasks
from megatron.initialize import RunContext, initialize_megatron
from megatron.model.random_ltd import random_ltd_metrics
from megatron.mpu.host_collectives import all_reduce, broadcast_object
from megatron.observability.comms_logging import CommsReporter
from megatron.observability.gradient_noise_scale import GradientNoiseScale
from megatron.observability.profiler import step_profiler
from megatron.observability.timers import Timers
from megatron.observability.training_logger import DeepSpeedMonitorSink, MemoryProfiler, TrainingLogger
from megatron.post_training.reference import AdapterFreeReference, ReferenceModel, start_reference
from megatron.post_training.reinforce import ReinforceReference
from megatron.training.autoresume import AutoResumeCheck, load_autoresume
from megatron.training.batches import (ModelBatches, batch_streams, curriculum_step, difficulty_sampling,
                                       sampler_logs, sampler_state, start_curriculum)
from megatron.training.checkpoint_validation import check_loaded_checkpoint, validation_state
from megatron.training.mup_run import base_shapes_and_coord_check
from megatron.training.setup import setup_model_and_optimizer
from megatron.training.state import TrainState, run_state
from megatron.training.step import _moe_metrics, current_lr, evaluate, set_batch_size, train_step
from megatron.training_schedule import OverflowGuard, TrainingSchedule
from megatron.utils.optional_deps import MissingOptionalDependency, missing_feature_packages


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


def _agreed_problem(problem: Optional[str]) -> Optional[str]:
    """Rank 0's finding, given to every rank (all stop together instead of waiting for rank 0 in a collective)."""
    return broadcast_object(problem, src=0)


def _claim_save_directory(neox_args):
    """Rank 0 takes `save`'s run lock (megatron.checkpoint.run_lock); CheckpointError on every rank when another run
    holds it, or when the non-persistent directory is another run's (megatron.checkpoint.non_persistent)."""
    lock = RunLock(neox_args.save)
    problem = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        # the non-persistent directory deletes its older checkpoints: never another run's save directory
        problem = lock.acquire() or non_persistent_problem(neox_args)
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


def _async_checkpoints(neox_args, engine, completed: Callable[[str, int], None]):
    """async_save's background writer (megatron.checkpoint.async_save), None for synchronous saves.
    ``completed(path, iteration)``: called on rank 0 once a checkpoint is complete."""
    if not (neox_args.async_save and neox_args.save):
        return None

    def complete(path: str, iteration: int, digests: Dict[str, str]) -> None:
        complete_checkpoint(path, iteration, neox_args.keep_last_n_checkpoints,
                            only=in_non_persistent_dir(neox_args, path), digests=digests)
        completed(path, iteration)

    return AsyncCheckpoints(engine, failure=failed_save, complete=complete)


def _s3_uploads(neox_args, do_train: bool) -> Optional[S3Uploads]:
    """Rank 0's uploader of the complete checkpoints to s3_path (megatron.checkpoint.s3_upload), None elsewhere or
    when off; started at once (an upload a killed run left unfinished is finished now). The bucket is checked on
    rank 0 before the first step, and every rank stops with its error (CheckpointError)."""
    if not (neox_args.s3_path and neox_args.save and do_train):
        return None
    uploads, problem = None, None
    if not dist.is_initialized() or dist.get_rank() == 0:
        uploads = S3Uploads(s3_client(), neox_args.s3_path, neox_args.s3_chunk_size, neox_args.save)
        problem = bucket_problem(uploads.client, uploads.location)
    problem = _agreed_problem(problem)
    if problem:
        raise CheckpointError(problem)
    if uploads is not None:
        uploads.start()
    return uploads


def _gradient_noise_scale(neox_args) -> Optional[GradientNoiseScale]:
    """log_gradient_noise_scale's estimator (megatron.observability.gradient_noise_scale), None when off: the squared
    norms of each rank's share of the gradient are summed over all ranks (the replicas give zeros)."""
    if not neox_args.log_gradient_noise_scale:
        return None
    return GradientNoiseScale(neox_args.train_batch_size, neox_args.gradient_noise_scale_n_batches,
                              sum_over_model=lambda values: all_reduce(list(values)).tolist(),
                              cpu_offload=neox_args.gradient_noise_scale_cpu_offload)


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
    """The frozen reference model of DPO / KTO / REINFORCE's KL term (megatron.post_training.reference), None when the
    run needs none. ``resumed``: the checkpoint this run resumed training from (None for a fresh or fine-tuning
    start)."""
    if neox_args.train_impl == "reinforce":
        if neox_args.kl_div_beta <= 0:
            return None  # no KL term
        reference = ReinforceReference(ctx.model_config, ctx.parallel_state, neox_args.kl_impl,
                                       neox_args.fp32_reinforce).to(ctx.device)
        source = start_reference(reference, engine.module, resumed)
    elif neox_args.train_impl not in ("dpo", "kto") or neox_args.precompute_model_name or (
            neox_args.train_impl == "dpo" and neox_args.dpo_reference_free):
        return None  # none needed, or read from precomputed files (megatron.post_training.precompute)
    elif ctx.model_config.lora:  # the base: the policy with its adapters off, no second copy
        reference = AdapterFreeReference(engine.module, ctx.parallel_state, _reference_fp32(neox_args))
        source = "the base model (the policy with its LoRA adapters off)"
    else:
        reference = ReferenceModel(ctx.model_config, ctx.parallel_state, _reference_fp32(neox_args)).to(ctx.device)
        source = start_reference(reference, engine.module, resumed)
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"{neox_args.train_impl.upper()} reference model: {source}", flush=True)
    return reference


def _reference_fp32(neox_args) -> bool:
    """DPO's / KTO's reference log-probabilities in fp32 (dpo_fp32 / kto_fp32)."""
    return neox_args.dpo_fp32 if neox_args.train_impl == "dpo" else neox_args.kto_fp32


def pretrain(neox_args) -> Dict[str, Any]:
    """Train (and evaluate) as the config says; returns a summary (iterations, losses, evaluations)."""
    problems = neox_args.training_problems()
    if problems:
        raise ConfigError(problems)
    missing = missing_feature_packages(neox_args, "train.py")
    if missing:  # deepy.py checked its own environment; this worker's (another node's) may differ. Said by every
        # rank before any of them waits in a collective, not after the model is built, when the others are left
        # waiting for the one that failed and report it as lost
        raise MissingOptionalDependency("; ".join(missing))
    if neox_args.adlr_autoresume:  # the cluster's library found before anything is built (the loop initialises it)
        load_autoresume()
    started_at = time.time()
    deadline = None if neox_args.exit_duration_in_mins is None else started_at + 60.0 * neox_args.exit_duration_in_mins
    ctx = initialize_megatron(neox_args)
    do_train = neox_args.do_train if neox_args.do_train is not None else True
    lock = _claim_save_directory(neox_args) if do_train and neox_args.save else None
    try:
        return _train_and_evaluate(neox_args, ctx, do_train, check_space=lock is not None, deadline=deadline,
                                   started_at=started_at)
    finally:
        if lock is not None:
            lock.release()


def _train_and_evaluate(neox_args, ctx: RunContext, do_train: bool, check_space: bool,
                        deadline: Optional[float], started_at: float) -> Dict[str, Any]:
    """pretrain's body, with `save` locked: ``deadline`` (time.time()) is exit_duration_in_mins's end,
    ``started_at`` (time.time()) the run's start (its summary's wall time)."""
    schedule = TrainingSchedule.from_neox_args(neox_args)
    if neox_args.use_mup and (neox_args.save_base_shapes or neox_args.coord_check):
        return base_shapes_and_coord_check(neox_args, ctx, lambda: next(batch_streams(neox_args, ctx, schedule, 0,
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
    load = load_lora_checkpoint if ctx.model_config.lora else load_checkpoint
    iteration, client_state, loaded_from = load(neox_args, ctx.model_config, engine, ctx.checkpoint)
    check_loaded_checkpoint(neox_args, engine, ctx, loaded_from, client_state,
                            is_logging_rank=not dist.is_initialized() or dist.get_rank() == 0)
    reference = _start_reference(neox_args, ctx, engine, loaded_from if iteration else None)
    state = TrainState.from_checkpoint(client_state, iteration, neox_args.train_batch_size, neox_args.finetune)
    streams = batch_streams(neox_args, ctx, schedule, state.consumed_train_samples, state.consumed_valid_samples,
                             reference, difficulty_sampling(neox_args, engine, ctx, client_state) if do_train else None)
    schedule_of_lengths = start_curriculum(neox_args, engine, iteration, client_state) if do_train else None
    # the first step draws from the checkpoint's RNG state, as the uninterrupted run did at that step (MoE router
    # jitter and dropout draw the same noise), whatever building the batch streams drew: set here, and only here
    restore_rng(neox_args, loaded_from, client_state, ctx.rng_tracker)
    run = _TrainingRun(neox_args, ctx, (engine, optimizer, lr_scheduler), schedule, state, schedule_of_lengths,
                       streams, reference, stop, deadline, do_train)
    if loaded_from is not None:
        run.logger.log_resume(loaded_from, iteration, state.consumed_train_samples, state.consumed_valid_samples,
                              bool(neox_args.finetune))
    try:
        run.train()
        run.finish()
        run.summary["iteration"] = state.iteration
        run.summary["skipped_steps"] = run.overflow.total
        run.logger.log_summary(run.summary, time.time() - started_at, _latest_checkpoint(neox_args.save))
    finally:
        if run.profiler is not None:  # a run that ended inside the profiled steps writes what it recorded
            run.profiler.close()
        run.logger.close()
        stop.restore()
    ctx.destroy()
    return run.summary


def _latest_checkpoint(save: Optional[str]) -> Optional[str]:
    """The directory of the checkpoint `latest` names in ``save`` (None: none there)."""
    tag = read_latest(save) if save and os.path.isdir(save) else None
    return os.path.join(save, tag) if tag else None


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
                 state: TrainState, curriculum, streams: List[Optional[ModelBatches]], reference,
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
        self.save_started: Dict[str, float] = {}
        """checkpoint directory -> time.perf_counter() when its save started (its line says how long it took)."""
        self.background = _async_checkpoints(neox_args, self.engine, self.say_saved_in_background)
        self.uploads = _s3_uploads(neox_args, do_train)
        self.noise_scale = _gradient_noise_scale(neox_args)
        self.profiler = step_profiler(neox_args, dist.get_rank() if dist.is_initialized() else 0)
        self.autoresume = AutoResumeCheck.start(neox_args) if do_train else None

    def train(self) -> None:
        """Steps until train_iters, a stop request or exit_interval; each step's evaluation, then its save."""
        if self.do_train and self.neox_args.dataset_impl == "online" and self.neox_args.save and \
                _latest_checkpoint(self.neox_args.save) is None:
            # the rollout server samples from the newest checkpoint in save: it gets the starting weights first
            self.last_saved = None
            self.save()
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
        if self.profiler is not None:
            self.profiler.begin(iteration)
        self.timers("train_step").start()
        result = train_step(neox_args, self.engine, self.train_batches, self.ctx, self.optimizer, debug,
                            self.noise_scale)
        self.timers("train_step").stop()
        if self.profiler is not None:
            self.profiler.end(iteration)
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
            raise TrainingDiverged(f"iteration {iteration}: the loss is {loss}; lower lr or check the data (the last "
                                   f"checkpoint in save, if any, is from before this step; relaunching resumes there)")
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
        if self.engine.random_ltd_enabled():
            extras.update(random_ltd_metrics(self.engine.module, self.engine.random_ltd_scheduler))
        extras.update(sampler_logs(self.train_batches))
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

    def evaluate_split(self, batches: Optional[ModelBatches], split: str) -> None:
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
            if self.uploads is not None and not non_persistent:
                self.uploads.wait()  # its upload is done before this save's completion prunes it (keep_last_n)
            started = time.perf_counter()
            path = save_checkpoint(neox_args, self.ctx.model_config, at, self.engine,
                                   {**run_state(self.state, self.curriculum), **sampler_state(self.train_batches),
                                    **validation_state(neox_args, self.engine, self.ctx)},
                                   write_extra=self.reference.save if self.reference is not None else None,
                                   complete=background is None, non_persistent=non_persistent,
                                   rng_tracker=self.ctx.rng_tracker)
            if background is not None:
                self.save_started[path] = started
                self.logger.log_save_started(path, at)
                background.started(path, at, steps_to_next_save(neox_args, self.schedule, at))
            elif self.logger.is_logging_rank:
                self.logger.log_save(path, at, time.perf_counter() - started, directory_bytes(path))
            if background is None and self.uploads is not None and not non_persistent:
                self.uploads.start()
            self.timers("save").stop()
            if not non_persistent:  # a persistent save at the same iteration (the run's end) still happens
                self.last_saved = at

    def say_saved_in_background(self, path: str, iteration: int) -> None:
        """async_save's completion (rank 0, on the writer's thread): the save's line, from its start."""
        started = self.save_started.pop(path, None)
        seconds = time.perf_counter() - started if started is not None else 0.0
        self.logger.log_save(path, iteration, seconds, directory_bytes(path), background=True)
        if self.uploads is not None and not in_non_persistent_dir(self.neox_args, path):
            self.uploads.start()

    def stopped(self) -> bool:
        """A signal on any rank, adlr_autoresume's termination request or exit_duration_in_mins passed: saved,
        recorded in the summary and said (after adlr_autoresume's, rank 0 asks the scheduler to resubmit the job)."""
        signalled, out_of_time = self.stop.any_rank(self.deadline)
        resume = self.autoresume_requested()
        if not (signalled or out_of_time or resume):
            return False
        self.save()
        stop_name = self.stop.signal_name
        if signalled:  # train.py exits 128 + the signal (megatron.launch.signals); otherwise 0
            self.summary["stopped_by"], self.summary["signal"] = stop_name or "another rank's signal", stop_name
        else:
            self.summary["stopped_by"] = "adlr_autoresume" if resume else "exit_duration_in_mins"
            if resume and (not dist.is_initialized() or dist.get_rank() == 0):
                self.autoresume.request_resume()
        if self.logger.is_logging_rank:
            self._say_why_stopped(signalled)
        return True

    def autoresume_requested(self) -> bool:
        """adlr_autoresume: whether the scheduler asks the job to end, asked every adlr_autoresume_interval
        iterations on every rank (as GPT-NeoX does) and agreed across ranks, so that all of them save and leave."""
        if self.autoresume is None or not self.autoresume.due(self.state.iteration):
            return False
        asked = self.autoresume.termination_requested()
        return bool(all_reduce([1.0 if asked else 0.0], op="max").tolist()[0])

    def _say_why_stopped(self, signalled: bool) -> None:
        """One line on the logging rank: why the run stops and where its checkpoint is."""
        neox_args, iteration = self.neox_args, self.state.iteration
        reasons = {"adlr_autoresume": f"adlr_autoresume: the cluster's scheduler asked the job to end "
                                      f"(AutoResume.termination_requested at iteration {iteration})",
                   "exit_duration_in_mins": f"exit_duration_in_mins={neox_args.exit_duration_in_mins} passed"}
        reason = f"received {self.summary['stopped_by']}" if signalled else reasons[self.summary["stopped_by"]]
        saved = (f"saved a checkpoint at iteration {iteration} in {neox_args.save}" if neox_args.save
                 else f"no checkpoint saved (save is not set) at iteration {iteration}")
        then = "; resume requested" if self.summary["stopped_by"] == "adlr_autoresume" else ""
        print(f"{reason}: {saved}{then}, exiting", flush=True)

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
        if self.uploads is not None:  # the last checkpoint's upload done (CheckpointError if it failed)
            self.uploads.finish()
