"""Training-progress logging: console, metrics.jsonl, TensorBoard, Weights & Biases and Comet.

`TrainingLogger(neox_args, model_config)` is told about every training iteration and every evaluation; every
`log_interval` iterations it writes one record (loss averaged over the interval, learning rate, grad norm,
tokens/s, samples/s, TFLOP/s per device, MFU, ETA) to

* the console and `<log_dir>/metrics.jsonl` (one JSON object per line) on the logging rank,
* TensorBoard (`tensorboard_dir`), Comet (`use_comet`) on the logging rank,
* W&B (`use_wandb`) on the logging rank, or on every rank with `wandb_init_all_ranks`,
* DeepSpeed's monitors (its `csv_monitor`, `tensorboard`, `wandb`, `comet` sections) during training, beside the
  engine's own timer events (DeepSpeedMonitorSink),
* and DeepSpeed's communication summary as `comms` records when `comms_logger` is on (megatron.observability.comms_logging).

Throughput is tokens = the interval's samples (iterations x train_batch_size, or the ramped batches of
rampup_batch_size, logged as batch_size) x seq_length over the interval's training time;
TFLOP/s and MFU use megatron.observability.flops (stated formula there). The functions at the end compute the optional
debugging values (log_grad_norm, log_param_norm, log_grad_pct_zeros, log_optimizer_states,
memory_profiling) to pass as `extras`.

The logging rank also says what the run did with its checkpoints, one console line each: a save (tag, seconds,
size on disk; with async_save, when it starts in the background and when it is complete), the resume (tag,
iteration, samples consumed), and at the end a summary (iterations, wall time, tokens/s, the last losses, where
the checkpoints and metrics are). docs/running.md shows them.

A feature whose package is missing fails with one clear error from megatron.utils.optional_deps.require."""

import datetime
import json
import math
import os
import resource
import sys
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, TextIO, Tuple

import torch
from deepspeed.utils import safe_get_full_grad, safe_get_full_optimizer_state
from torch import nn

from megatron.model.config import ModelConfig
from megatron.model.moe.naming import global_expert_names, is_expert_name
from megatron.model.parameter_marks import MOE_EXPERT_FLAG
from megatron.mpu.host_collectives import all_gather_object, all_reduce
from megatron.observability.flops import mfu, peak_tflops, tflops_per_device, training_flops_per_token
from megatron.utils.optional_deps import require

METRICS_FILE = "metrics.jsonl"
PPL_LOSS_CAP = 20.0
"""Perplexity is exp(min(loss, 20)), as Megatron reports it, so a diverged loss does not overflow."""


def _number(value: Any) -> Optional[float]:
    """value as a float if it is a plain number or a one-element tensor, else None."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.item())
    return None


def _scalars(record: Dict[str, Any], skip: Iterable[str] = ("iteration", "type")) -> Dict[str, float]:
    out = {}
    for key, value in record.items():
        number = _number(value)
        if key not in skip and number is not None:
            out[key] = number
    return out


def _default_rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


# ---------------------------------------------------------------------------------------------------
# Sinks: one per destination, each with log(prefix, metrics, step) and close()
# ---------------------------------------------------------------------------------------------------

class JsonlSink:
    """Appends one JSON record per line to <log_dir>/metrics.jsonl (kept across resumed runs)."""

    def __init__(self, log_dir: str) -> None:
        os.makedirs(log_dir, exist_ok=True)
        self.path = os.path.join(log_dir, METRICS_FILE)
        self._file = open(self.path, "a", encoding="utf-8")

    def write(self, record: Dict[str, Any]) -> None:
        plain = {k: (_number(v) if isinstance(v, torch.Tensor) else v) for k, v in record.items()}
        self._file.write(json.dumps(plain, default=str) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorboardSink:
    """Scalars under '<prefix>/<name>' in tensorboard_dir, read back by TensorBoard's EventAccumulator."""

    def __init__(self, tensorboard_dir: str) -> None:
        require("tensorboard", "tensorboard_dir", "tensorboard")
        summary = require("torch.utils.tensorboard", "tensorboard_dir", "tensorboard")
        self.writer = summary.SummaryWriter(log_dir=tensorboard_dir)

    def log(self, prefix: str, metrics: Dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(f"{prefix}/{key}", value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A W&B run; WANDB_MODE=offline (or `wandb offline`) writes it under <dir>/wandb without network."""

    def __init__(self, neox_args: Any, rank: int, config: Optional[Dict[str, Any]] = None) -> None:
        wandb = require("wandb", "use_wandb", "wandb")
        name = neox_args.wandb_run_name
        group = neox_args.wandb_group
        if neox_args.wandb_init_all_ranks:
            name = f"{name or 'neox'}-rank{rank}"
            group = group or neox_args.wandb_run_name or "neox"
        settings = wandb.Settings(base_url=neox_args.wandb_host)
        directory = neox_args.log_dir or neox_args.tensorboard_dir
        if directory:
            os.makedirs(directory, exist_ok=True)
        self.run = wandb.init(project=neox_args.wandb_project, group=group, entity=neox_args.wandb_team,
                              name=name, dir=directory, config=config, settings=settings, reinit="create_new")

    def log(self, prefix: str, metrics: Dict[str, float], step: int) -> None:
        self.run.log({f"{prefix}/{key}": value for key, value in metrics.items()}, step=step)

    def close(self) -> None:
        self.run.finish()


def _comet_offline() -> bool:
    flag = os.environ.get("COMET_OFFLINE", "").strip().lower() in ("1", "true", "yes")
    return flag or not os.environ.get("COMET_API_KEY")


class CometSink:
    """A Comet experiment: online with COMET_API_KEY, else (or with COMET_OFFLINE=1) an OfflineExperiment
    archived under COMET_OFFLINE_DIRECTORY, or <log_dir>/comet, when the run ends."""

    def __init__(self, neox_args: Any, config: Optional[Dict[str, Any]] = None) -> None:
        comet_ml = require("comet_ml", "use_comet", "comet")
        common = dict(project_name=neox_args.comet_project, workspace=neox_args.comet_workspace,
                      log_code=False, log_git_metadata=False, log_git_patch=False, parse_args=False,
                      auto_output_logging=False, log_env_gpu=False, log_env_host=False, log_env_cpu=False,
                      log_env_network=False, log_env_disk=False, display_summary_level=0)
        if _comet_offline():
            directory = (os.environ.get("COMET_OFFLINE_DIRECTORY")
                         or os.path.join(neox_args.log_dir or ".", "comet"))
            os.makedirs(directory, exist_ok=True)
            self.experiment = comet_ml.OfflineExperiment(offline_directory=directory, **common)
        else:
            self.experiment = comet_ml.Experiment(api_key=os.environ["COMET_API_KEY"], **common)
        if neox_args.comet_experiment_name:
            self.experiment.set_name(neox_args.comet_experiment_name)
        if neox_args.comet_tags:
            self.experiment.add_tags(list(neox_args.comet_tags))
        if neox_args.comet_others:
            self.experiment.log_others(dict(neox_args.comet_others))
        if config:
            self.experiment.log_parameters(config)

    def log(self, prefix: str, metrics: Dict[str, float], step: int) -> None:
        self.experiment.log_metrics(metrics, prefix=prefix, step=step)

    def close(self) -> None:
        self.experiment.end()


class DeepSpeedMonitorSink:
    """DeepSpeed's monitors (config sections csv_monitor, tensorboard, wandb, comet). The engine feeds them only its
    own timers and learning rate (and, in a pipeline, its train_loss); the training and evaluation records go to
    them too, as events '<Split>/Samples/<key>' at the engine's count of samples, DeepSpeed's own naming."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def log(self, prefix: str, metrics: Dict[str, float], step: int) -> None:
        if metrics:
            samples = int(self.engine.global_samples)
            self.engine.monitor.write_events([(f"{prefix.capitalize()}/Samples/{key}", value, samples)
                                              for key, value in metrics.items()])

    def close(self) -> None:
        pass  # the engine owns its monitors


class MetricSinks:
    """Every destination the config asks for: metrics.jsonl (log_dir), tensorboard (tensorboard_dir) and
    comet (use_comet) on the logging rank, wandb (use_wandb) there or on every rank with
    wandb_init_all_ranks. One `write` sends a record to all of them (training and eval.py alike)."""

    def __init__(self, neox_args: Any, rank: int, is_logging_rank: bool) -> None:
        self.jsonl: Optional[JsonlSink] = None
        self.sinks: List[Any] = []
        config = _jsonable(neox_args.to_dict()) if hasattr(neox_args, "to_dict") else None
        if is_logging_rank:
            if neox_args.log_dir:
                self.jsonl = JsonlSink(neox_args.log_dir)
            if neox_args.tensorboard_dir:
                self.sinks.append(TensorboardSink(neox_args.tensorboard_dir))
            if neox_args.use_comet:
                self.sinks.append(CometSink(neox_args, config))
        if neox_args.use_wandb and (is_logging_rank or neox_args.wandb_init_all_ranks):
            self.sinks.append(WandbSink(neox_args, rank, config))

    def add(self, sink: Any) -> None:
        """One more destination for the records' numbers (e.g. DeepSpeedMonitorSink once the engine exists)."""
        self.sinks.append(sink)

    def write(self, prefix: str, record: Dict[str, Any]) -> None:
        """The whole record to metrics.jsonl; its numbers as '<prefix>/<key>' scalars at record['iteration']."""
        if self.jsonl is not None:
            self.jsonl.write(record)
        scalars = _scalars(record)
        for sink in self.sinks:
            sink.log(prefix, scalars, record["iteration"])

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
            self.jsonl = None
        for sink in self.sinks:
            sink.close()
        self.sinks = []


# ---------------------------------------------------------------------------------------------------
# The logger the training loop talks to
# ---------------------------------------------------------------------------------------------------

def format_eta(seconds: float) -> str:
    return str(datetime.timedelta(seconds=int(round(max(seconds, 0.0)))))


def format_bytes(size: int) -> str:
    """1536 -> '1.5 KiB' (binary units, as `du -h`)."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def format_seconds(seconds: float) -> str:
    """Seconds under a minute as '0.42 s' / '42.1 s', longer as h:mm:ss."""
    if seconds < 10:
        return f"{seconds:.2f} s"
    return f"{seconds:.1f} s" if seconds < 60 else format_eta(seconds)


class TrainingLogger:
    """Aggregates per-iteration values and writes them every log_interval iterations.

    Call `log_train` after every optimizer step (skipped steps too), `log_eval` after each evaluation, and
    `close` at the end. Training time per interval is the wall time between reports unless the loop passes
    each step's `step_time` (which leaves evaluation and checkpointing out of the throughput)."""

    def __init__(self, neox_args: Any, model_config: Optional[ModelConfig] = None,
                 is_logging_rank: Optional[bool] = None, rank: Optional[int] = None,
                 flops_per_token: Optional[float] = None, peak: Optional[float] = None,
                 console: Optional[TextIO] = None, clock: Callable[[], float] = time.perf_counter,
                 start_iteration: int = 0, train_iters: Optional[int] = None) -> None:
        self.args = neox_args
        self.rank = rank if rank is not None else (getattr(neox_args, "rank", None) or _default_rank())
        self.is_logging_rank = self.rank == 0 if is_logging_rank is None else is_logging_rank
        self.log_interval = max(1, int(neox_args.log_interval))
        self.train_iters = train_iters if train_iters is not None else neox_args.train_iters
        self.num_devices = int(getattr(neox_args, "global_num_gpus", None) or getattr(neox_args, "world_size", None)
                               or 1)
        if flops_per_token is None:
            if model_config is None:
                raise ValueError("TrainingLogger needs the model_config (or flops_per_token) for TFLOP/s and MFU")
            flops_per_token = training_flops_per_token(model_config)
        self.flops_per_token = flops_per_token
        self.peak = peak if peak is not None else peak_tflops(neox_args.precision, neox_args.peak_theoretical_tflops)
        self.console = console if console is not None else sys.stdout
        self._clock = clock
        self.run_tokens = 0
        self.run_step_seconds = 0.0
        """Tokens and seconds of the training steps this process ran (its summary's tokens/s)."""
        self._reset_interval(start_iteration)
        self.out = MetricSinks(neox_args, self.rank, self.is_logging_rank)
        if self.is_logging_rank and self.peak is None:
            self.console.write("MFU is not applicable: no peak FLOP/s is known for this device (CPU, or a GPU not in "
                               "megatron.observability.flops.DEVICE_PEAK_TFLOPS); set NEOX_PEAK_TFLOPS to report it\n")

    # ---- state of the current interval -----------------------------------------------------------
    def _reset_interval(self, iteration: int) -> None:
        self._last_iteration = iteration
        self._last_time = self._clock()
        self._loss_sum = 0.0
        self._loss_count = 0
        self._skipped = 0
        self._timed_seconds = 0.0
        self._timed_iterations = 0
        self._samples = 0
        self._tokens = 0
        self._batch_size = self.args.train_batch_size

    def restart_clock(self, iteration: Optional[int] = None) -> None:
        """Start a fresh interval now (after resuming, or when the first step is about to run)."""
        self._reset_interval(self._last_iteration if iteration is None else iteration)

    # ---- what the loop calls ----------------------------------------------------------------------
    def log_train(self, iteration: int, lm_loss: Any, lr: float, grad_norm: Any = None, skipped: bool = False,
                  step_time: Optional[float] = None, extras: Optional[Dict[str, Any]] = None,
                  batch_size: Optional[int] = None, seq_length: Optional[int] = None) -> Optional[Dict[str, Any]]:
        """Record iteration `iteration` (1-based count of steps done; `step_time` its seconds, optional;
        `seq_length` the tokens per sample of this step when a sequence-length curriculum cuts them, else the
        config's); returns the record when one is written (every log_interval iterations and at train_iters)."""
        loss = _number(lm_loss)
        self._batch_size = batch_size if batch_size is not None else self.args.train_batch_size
        self._samples += self._batch_size
        tokens = self._batch_size * (seq_length if seq_length is not None else self.args.seq_length)
        self._tokens += tokens
        self.run_tokens += tokens
        self.run_step_seconds += step_time or 0.0
        if skipped:
            self._skipped += 1
        elif loss is not None:
            self._loss_sum += loss
            self._loss_count += 1
        if step_time is not None:
            self._timed_seconds += step_time
            self._timed_iterations += 1
        if iteration % self.log_interval and iteration != self.train_iters:
            return None
        record = self._training_record(iteration, lr, grad_norm, extras or {})
        self._write("train", record)
        if self.is_logging_rank:
            self.console.write(self._console_line(record) + "\n")
            self.console.flush()
        self._reset_interval(iteration)
        return record

    def _training_record(self, iteration: int, lr: float, grad_norm: Any, extras: Dict[str, Any]) -> Dict[str, Any]:
        iterations = max(iteration - self._last_iteration, 1)
        if self._timed_iterations:
            seconds = self._timed_seconds * iterations / self._timed_iterations
        else:
            seconds = self._clock() - self._last_time
        seconds = max(seconds, 1e-9)
        samples = self._samples or iterations * self.args.train_batch_size  # the batches of the interval
        tokens = self._tokens or samples * self.args.seq_length
        tokens_per_sec = tokens / seconds
        tflops = tflops_per_device(self.flops_per_token, tokens_per_sec, self.num_devices)
        record: Dict[str, Any] = {
            "type": "train", "iteration": iteration,
            "lm_loss": self._loss_sum / self._loss_count if self._loss_count else None,
            "lr": float(lr), "grad_norm": _number(grad_norm),
            "tokens_per_sec": tokens_per_sec,
            "samples_per_sec": samples / seconds, "batch_size": self._batch_size,
            "tflops": tflops, "mfu": mfu(tflops, self.peak),
            "iteration_time_s": seconds / iterations, "skipped_iterations": self._skipped,
        }
        if self.train_iters:
            record["eta_s"] = max(self.train_iters - iteration, 0) * seconds / iterations
        if torch.cuda.is_available():  # the peak since the start, as benchmarks and capacity planning need
            record["gpu_max_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
        record.update(extras)
        return record

    def log_eval(self, iteration: int, lm_loss: Any, split: str = "validation",
                 extras: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        """Write one evaluation record (type 'eval', lm_loss, lm_loss_ppl) now."""
        loss = _number(lm_loss)
        if loss is None:
            raise ValueError(f"evaluation loss must be a number or a one-element tensor, got {lm_loss!r}")
        record = {"type": "eval", "split": split, "iteration": iteration, "lm_loss": loss,
                  "lm_loss_ppl": math.exp(min(loss, PPL_LOSS_CAP)), **(extras or {})}
        self._write(split, record)
        if self.is_logging_rank:
            more = "".join(f" | {k} {v:.6E}" for k, v in (extras or {}).items() if isinstance(v, (int, float)))
            self.console.write(f"{split} at iteration {iteration} | lm_loss {loss:.6E} | "
                               f"lm_loss_ppl {record['lm_loss_ppl']:.6E}{more}\n")
            self.console.flush()
        return record

    def log_eval_tasks(self, iteration: int, metrics: Dict[str, Any]) -> None:
        """Write the lm-evaluation-harness scores of one evaluation (type 'eval_tasks')."""
        record = {"type": "eval_tasks", "iteration": iteration, **metrics}
        self._write("eval_tasks", record)
        if self.is_logging_rank:
            scores = " | ".join(f"{k} {v:.4f}" for k, v in metrics.items() if isinstance(v, (int, float)))
            self.console.write(f"eval_tasks at iteration {iteration} | {scores}\n")
            self.console.flush()

    def log_comms(self, iteration: int, ops: Dict[str, Any]) -> None:
        """Write DeepSpeed's communication summary (megatron.observability.comms_logging; type 'comms'); rank 0 printed it."""
        self._write("comms", {"type": "comms", "iteration": iteration, "ops": ops})

    def _write(self, prefix: str, record: Dict[str, Any]) -> None:
        self.out.write(prefix, record)

    def _console_line(self, record: Dict[str, Any]) -> str:
        total = f"/{self.train_iters:>8d}" if self.train_iters else ""
        parts = [f"iteration {record['iteration']:>8d}{total}", f"lr {record['lr']:.4E}"]
        if record["lm_loss"] is not None:
            parts.append(f"lm_loss {record['lm_loss']:.6E}")
        if record.get("moe_aux_loss") is not None:
            parts.append(f"moe_aux_loss {record['moe_aux_loss']:.6E}")
        if record["grad_norm"] is not None:
            parts.append(f"grad_norm {record['grad_norm']:.4f}")
        if getattr(self.args, "rampup_batch_size", None) is not None:
            parts.append(f"batch_size {record['batch_size']}")
        if record.get("curriculum_seqlen") is not None:
            parts.append(f"curriculum_seqlen {record['curriculum_seqlen']}")
        parts += [f"tokens/s {record['tokens_per_sec']:.1f}", f"samples/s {record['samples_per_sec']:.2f}",
                  f"TFLOP/s/device {record['tflops']:.3f}",
                  "MFU n/a" if record["mfu"] is None
                  else f"MFU {100 * record['mfu']:.2f}%"]
        if record["skipped_iterations"]:
            parts.append(f"skipped {record['skipped_iterations']}")
        if "eta_s" in record:
            parts.append(f"ETA {format_eta(record['eta_s'])}")
        return " | ".join(parts)

    def say(self, line: str) -> None:
        """One line on the console of the logging rank (checkpoints, resume, summary)."""
        if self.is_logging_rank:
            self.console.write(line + "\n")
            self.console.flush()

    def log_save(self, path: str, iteration: int, seconds: float, size: Optional[int], background: bool = False
                 ) -> None:
        """A checkpoint complete on disk (``background``: written by async_save while training went on)."""
        how = f"written in the background in {format_seconds(seconds)}" if background else \
            f"in {format_seconds(seconds)}"
        self.say(f"saved checkpoint {path} (iteration {iteration}) {how}"
                 f"{f', {format_bytes(size)}' if size is not None else ''}")

    def log_save_started(self, path: str, iteration: int) -> None:
        """async_save: the checkpoint's files are being written in the background (log_save when complete)."""
        self.say(f"saving checkpoint {path} (iteration {iteration}) in the background")

    def log_resume(self, path: str, iteration: int, consumed_train: int, consumed_valid: int,
                   finetune: bool) -> None:
        """The checkpoint the run starts from."""
        if finetune:
            self.say(f"loaded the weights of checkpoint {path} (finetune: training starts at iteration 0)")
            return
        self.say(f"resumed from checkpoint {path}: iteration {iteration}, {consumed_train} training samples "
                 f"consumed ({consumed_valid} validation)")

    def log_summary(self, summary: Dict[str, Any], wall_seconds: float, checkpoint: Optional[str]) -> None:
        """The end of the run, a few lines: what ran (or why it stopped), how fast, the last losses, where things
        are. ``summary``: pretrain's (start_iteration, iteration, losses, eval, stopped_by); ``checkpoint``: the
        latest checkpoint directory in save, None when nothing was saved."""
        first, last = summary["start_iteration"], summary["iteration"]
        ran = last - first
        stopped = summary.get("stopped_by")
        how = f"stopped by {stopped}" if stopped else (
            "stopped by exit_interval" if summary.get("exited_at_interval") else "finished")
        speed = (f", {self.run_tokens / self.run_step_seconds:,.0f} tokens/s over the training steps"
                 if self.run_step_seconds > 0 else "")
        lines = [f"run summary: {how} at iteration {last} ({ran} iteration{'s' if ran != 1 else ''} run, from "
                 f"{first}), wall time {format_seconds(wall_seconds)}{speed}"]
        losses = []
        if summary["losses"]:
            losses.append(f"train {summary['losses'][-1]:.6E} (iteration {last})")
        latest_eval: Dict[str, Tuple[int, float]] = {}
        for iteration, split, value in summary["eval"]:
            if isinstance(value, (int, float)):
                latest_eval[split] = (iteration, float(value))
        losses += [f"{split} {value:.6E} (iteration {iteration})" for split, (iteration, value) in latest_eval.items()]
        if losses:
            lines.append(f"  last lm_loss: {', '.join(losses)}")
        save = self.args.save
        places = [f"checkpoint {checkpoint}" if checkpoint else
                  f"no checkpoint in {save}" if save else "no checkpoint saved (save is not set)"]
        if self.args.log_dir:
            places.append(f"metrics {os.path.join(self.args.log_dir, METRICS_FILE)}")
        if self.args.tensorboard_dir:
            places.append(f"tensorboard {self.args.tensorboard_dir}")
        lines.append(f"  {'; '.join(places)}")
        for line in lines:
            self.say(line)

    def close(self) -> None:
        self.out.close()


def _jsonable(config: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """The config with values W&B / Comet can store (anything else as its string)."""
    if config is None:
        return None
    return json.loads(json.dumps(config, default=str))


# ---------------------------------------------------------------------------------------------------
# Debugging values (log_grad_norm, log_param_norm, log_grad_pct_zeros, log_optimizer_states)
# ---------------------------------------------------------------------------------------------------

def _full_grad(param: nn.Parameter) -> Optional[torch.Tensor]:
    """The parameter's gradient; under DeepSpeed ZeRO / bf16 the engine keeps it elsewhere."""
    if param.grad is not None and getattr(param, "_hp_grad", None) is None:
        return param.grad
    if any(hasattr(param, attr) for attr in ("_hp_grad", "_hp_mapping", "ds_id")):
        return safe_get_full_grad(param)
    return param.grad


def gradient_norms(model: nn.Module) -> Dict[str, float]:
    """{'gradient_norms/<param name>': Frobenius norm of its gradient} for parameters that have one.

    Call after backward and before the gradients are cleared. Under DeepSpeed ZeRO / bf16 the full gradient is
    assembled by DeepSpeed (safe_get_full_grad), which gathers across data-parallel ranks, so every rank must
    call it; with tensor or pipeline parallelism each rank sees its own slice / stage."""
    out = {}
    for name, param in model.named_parameters():
        grad = _full_grad(param)
        if grad is not None:
            out[f"gradient_norms/{name}"] = float(grad.detach().float().norm())
    return out


def gradient_pct_zeros(model: nn.Module) -> Dict[str, float]:
    """{'gradient_pct_zeros/<param name>': percentage (0-100) of exactly-zero gradient entries}."""
    out = {}
    for name, param in model.named_parameters():
        grad = _full_grad(param)
        if grad is not None and grad.numel():
            out[f"gradient_pct_zeros/{name}"] = 100.0 * float((grad == 0).sum()) / grad.numel()
    return out


def parameter_norms(model: nn.Module) -> Dict[str, float]:
    """{'parameter_norms/<param name>': Frobenius norm of the parameter}."""
    return {f"parameter_norms/{name}": float(param.detach().float().norm())
            for name, param in model.named_parameters()}


def total_norm(norms: Dict[str, float]) -> float:
    """The norm of all the tensors together, from their individual norms."""
    return math.sqrt(sum(value * value for value in norms.values()))


def optimizer_state_norms(model: nn.Module, optimizer: torch.optim.Optimizer) -> Dict[str, float]:
    """{'optimizer_state_norms/<param name>/<state key>': norm} for every floating-point state (exp_avg, ...).

    Under DeepSpeed ZeRO / bf16 the torch optimizer holds flat partitions; each parameter's share is found through
    DeepSpeed's links from the parameters to them, and gathered across data-parallel ranks (call it on every
    rank)."""
    return _optimizer_state_norms(list(model.named_parameters()), model, optimizer)


def _optimizer_state_norms(params: List[Tuple[str, nn.Parameter]], model: nn.Module,
                           optimizer: torch.optim.Optimizer) -> Dict[str, float]:
    """optimizer_state_norms of the (logged name, parameter) pairs `params` of `model`."""
    basic = getattr(optimizer, "optimizer", optimizer)  # DeepSpeed wrappers keep the torch optimizer here
    if not basic.state:  # no step taken yet: no states
        return {}
    if any(hasattr(p, "ds_id") for p in model.parameters()):  # ZeRO-3 assembles each parameter's state

        out = {}
        for name, param in params:
            for key in ("exp_avg", "exp_avg_sq"):
                value = safe_get_full_optimizer_state(param, key)
                if value is not None:
                    out[f"optimizer_state_norms/{name}/{key}"] = float(value.detach().float().norm())
        return out
    if any(hasattr(p, "_hp_mapping") for p in model.parameters()):
        return _partitioned_state_norms(params, basic)
    out = {}
    for name, param in params:
        for key, value in basic.state.get(param, {}).items():
            if isinstance(value, torch.Tensor) and value.is_floating_point() and key != "step":
                out[f"optimizer_state_norms/{name}/{key}"] = float(value.detach().float().norm())
    return out


def _partitioned_state_norms(params: List[Tuple[str, nn.Parameter]], basic: torch.optim.Optimizer
                             ) -> Dict[str, float]:
    """ZeRO-1/2 and DeepSpeed's BF16_Optimizer: the torch optimizer steps one flat fp32 partition per param group
    and data-parallel rank, and a parameter's `_hp_mapping` says which slice of this rank's partition of its
    group is its own (None: no slice here). A state's norm is the root of its slices' squared norms summed over
    the data-parallel group. (DeepSpeed's safe_get_full_optimizer_state reads the slices it links to the
    parameters, but DeepSpeed 0.19's ZeRO-1/2 links them right after stepping the first param group, so the other
    groups, e.g. the no-weight-decay one, would have no states.) Every data-parallel rank must call it."""
    keys = sorted({key for state in basic.state.values() for key, value in state.items()
                   if key != "step" and isinstance(value, torch.Tensor) and value.is_floating_point()})
    groups: Dict[int, Any] = {}
    rows: Dict[int, List[Tuple[str, List[float]]]] = {}  # per data-parallel group: (key, [sum of squares, present])
    for name, param in params:
        mapping = getattr(param, "_hp_mapping", None)
        state: Dict[str, Any] = {}
        if mapping is not None:
            state = basic.state.get(basic.param_groups[mapping.param_group_index]["params"][0], {})
        group = getattr(param, "_dp_group", None)
        groups.setdefault(id(group), group)
        for key in keys:
            entry = [0.0, 0.0]
            value = state.get(key)
            if value is not None:
                address = mapping.hp_fragment_address
                entry = [float(value.detach().narrow(0, address.start, address.numel).float().norm()) ** 2, 1.0]
            rows.setdefault(id(group), []).append((f"optimizer_state_norms/{name}/{key}", entry))
    out = {}
    for group_id, entries in rows.items():
        sums = all_reduce([entry for _, entry in entries], group=groups[group_id])
        for (key, _), (sum_of_squares, present) in zip(entries, sums.tolist()):
            if present:
                out[key] = math.sqrt(sum_of_squares)
    return out


def memory_stats() -> Dict[str, float]:
    """Memory in GB: CUDA allocator statistics on CUDA, the process's resident set size on CPU."""
    gb = 1024.0 ** 3
    if torch.cuda.is_available():
        return {"memory/allocated_gb": torch.cuda.memory_allocated() / gb,
                "memory/max_allocated_gb": torch.cuda.max_memory_allocated() / gb,
                "memory/reserved_gb": torch.cuda.memory_reserved() / gb,
                "memory/max_reserved_gb": torch.cuda.max_memory_reserved() / gb}
    stats = {}
    try:
        with open("/proc/self/statm", encoding="ascii") as statm:
            stats["memory/rss_gb"] = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / gb
    except (OSError, ValueError, IndexError):
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    stats["memory/max_rss_gb"] = peak / gb if sys.platform == "darwin" else peak * 1024.0 / gb
    return stats


def counted_here(param: nn.Parameter, parallel_state: Any = None) -> bool:
    """Whether this rank's copy of `param` is the one counted in whole-model values, so that every parameter
    of the model is counted exactly once: a tensor-parallel shard on every rank (the shards add up), a
    replicated parameter on tensor-parallel rank 0 only, a tied pipeline module on the first stage holding it
    only (DeepSpeed marks the other copies `ds_pipe_replicated`). `model_parallel` marks a shard, or, under the
    pipeline engine, what megatron.training.setup._mark_grad_norm_ownership counts (shards, and replicated
    parameters on tensor-parallel rank 0)."""
    if getattr(param, "ds_pipe_replicated", False):
        return False
    tp_rank = parallel_state.get_model_parallel_rank() if parallel_state is not None else 0
    return bool(getattr(param, "model_parallel", False)) or tp_rank == 0


def replica_gradients(model: nn.Module, parallel_state: Any = None) -> List[torch.Tensor]:
    """This rank's share of one model replica's gradient (the gradient noise scale's): the gradients of the
    parameters counted_here, on data-parallel rank 0 (an expert's on expert-data-parallel rank 0); the other
    replicas hold the same values and give none. Every rank must call it where debug_sums is called (ZeRO / bf16
    gradients are gathered across data-parallel ranks)."""
    first = parallel_state is None or parallel_state.get_data_parallel_rank() == 0
    first_of_experts = parallel_state is None or parallel_state.get_expert_data_parallel_rank() == 0
    out = []
    for name, param in model.named_parameters():
        if not counted_here(param, parallel_state):
            continue
        grad = _full_grad(param)
        expert = is_expert_name(name) or getattr(param, MOE_EXPERT_FLAG, False)
        if grad is not None and (first_of_experts if expert else first):
            out.append(grad)
    return out


def debug_sums(neox_args: Any, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
               parallel_state: Any = None, names: Optional[Callable[[str], str]] = None
               ) -> Dict[str, List[float]]:
    """This rank's share of the log_grad_norm / log_param_norm / log_grad_pct_zeros / log_optimizer_states
    values, as sums that add up across ranks (debug_values adds them and takes the roots):

    'gradient_norms/<name>': [sum of squares], 'gradient_pct_zeros/<name>': [zero entries, entries],
    'parameter_norms/<name>': [sum of squares], 'optimizer_state_norms/<name>/<state key>': [sum of squares].

    Only the parameters counted on this rank (counted_here) are included, under `names(name)` (default: the
    module's own names; a pipeline logs the sequential model's, GPT2ModelPipe.sequential_name); with expert
    parallelism an expert's parameters are named by its global expert (megatron.model.moe.naming). Call where the
    gradients are reduced and not yet clipped or cleared, on every rank (ZeRO / bf16 gradients and optimizer
    states are gathered across data-parallel ranks)."""
    rename = names or (lambda name: name)
    experts = global_expert_names(model, parallel_state) if parallel_state is not None else {}
    params = [(rename(experts.get(name, name)), param) for name, param in model.named_parameters()
              if counted_here(param, parallel_state)]
    out: Dict[str, List[float]] = {}
    if neox_args.log_grad_norm or neox_args.log_grad_pct_zeros:
        for name, param in params:
            grad = _full_grad(param)
            if grad is None:
                continue
            grad = grad.detach()
            if neox_args.log_grad_norm:
                out[f"gradient_norms/{name}"] = [float(grad.float().norm()) ** 2]
            if neox_args.log_grad_pct_zeros and grad.numel():
                out[f"gradient_pct_zeros/{name}"] = [float((grad == 0).sum()), float(grad.numel())]
    if neox_args.log_param_norm:
        for name, param in params:
            out[f"parameter_norms/{name}"] = [float(param.detach().float().norm()) ** 2]
    if neox_args.log_optimizer_states:
        if optimizer is None:
            raise ValueError("log_optimizer_states needs the optimizer passed to debug_metrics")
        for key, norm in _optimizer_state_norms(params, model, optimizer).items():
            out[key] = [norm ** 2]
    return out


def gather_debug_sums(sums: Dict[str, List[float]], parallel_state: Any = None) -> List[Dict[str, List[float]]]:
    """Every rank's share of one model replica (every pipeline stage and tensor-parallel rank of
    data-parallel rank 0; with expert parallelism the experts of every expert-parallel rank, from the first rank
    of each expert-data-parallel group, at every tensor-parallel rank: their global names tell them apart,
    megatron.model.moe.naming), on every rank, in rank order. Data-parallel replicas hold the same values
    and send nothing. Without a torch.distributed world, or without `parallel_state`: [sums] (this rank's
    view)."""
    if parallel_state is None or not (torch.distributed.is_available() and torch.distributed.is_initialized()) \
            or torch.distributed.get_world_size() == 1:
        return [sums]
    replica = parallel_state.get_data_parallel_rank() == 0
    experts_replica = parallel_state.get_expert_data_parallel_rank() == 0  # the data-parallel rank without EP
    mine = {key: value for key, value in sums.items()
            if (experts_replica if is_expert_name(key) else replica)}
    return all_gather_object(mine)


def debug_values(neox_args: Any, shares: Iterable[Dict[str, List[float]]]) -> Dict[str, float]:
    """The logged values from the ranks' debug_sums: per-parameter norms and zero percentages of the whole
    parameters, 'grad_norm_total' and 'param_norm_total' over the whole model."""
    added: Dict[str, List[float]] = {}
    for share in shares:
        for key, value in share.items():
            if key in added:
                added[key] = [a + b for a, b in zip(added[key], value)]
            else:
                added[key] = list(value)
    out: Dict[str, float] = {}
    for key, value in added.items():
        if key.startswith("gradient_pct_zeros/"):
            out[key] = 100.0 * value[0] / value[1]
        else:
            out[key] = math.sqrt(value[0])
    for flag, prefix, total in (("log_grad_norm", "gradient_norms/", "grad_norm_total"),
                                ("log_param_norm", "parameter_norms/", "param_norm_total")):
        if getattr(neox_args, flag):
            out[total] = math.sqrt(sum(v[0] for k, v in added.items() if k.startswith(prefix)))
    return out


def debug_metrics(neox_args: Any, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
                  parallel_state: Any = None, names: Optional[Callable[[str], str]] = None) -> Dict[str, float]:
    """The values the log_* / memory_profiling switches ask for, as `extras` for TrainingLogger.

    log_grad_norm, log_param_norm: per-parameter norms plus the total ('grad_norm_total', 'param_norm_total');
    log_grad_pct_zeros; log_optimizer_states (needs `optimizer`); memory_profiling: memory_stats() of this rank.
    With `parallel_state` in a distributed run the values are the whole model's, the same on every rank:
    tensor-parallel shards are combined into their parameter and every pipeline stage's parameters are there
    (see debug_sums, gather_debug_sums). Every rank must call it."""
    out = debug_values(neox_args, gather_debug_sums(debug_sums(neox_args, model, optimizer, parallel_state, names),
                                                    parallel_state))
    if neox_args.memory_profiling:
        out.update(memory_stats())
    return out


class MemoryProfiler:
    """memory_profiling: on CUDA records allocator history and dumps a snapshot (open it at
    pytorch.org/memory_viz); on CPU writes memory_stats() as JSON. Files go to memory_profiling_path
    (default <log_dir>/memory)."""

    def __init__(self, neox_args: Any) -> None:
        directory = neox_args.memory_profiling_path or (
            os.path.join(neox_args.log_dir, "memory") if neox_args.log_dir else None)
        if directory is None:
            raise ValueError("memory_profiling needs memory_profiling_path (or log_dir) to write snapshots to")
        self.directory = directory
        self.cuda = torch.cuda.is_available()
        os.makedirs(directory, exist_ok=True)
        if self.cuda:
            torch.cuda.memory._record_memory_history(max_entries=100000)

    def dump(self, iteration: int) -> str:
        """Write the snapshot for `iteration` and return its path."""
        if self.cuda:
            path = os.path.join(self.directory, f"memory_snapshot_iter{iteration}.pickle")
            torch.cuda.memory._dump_snapshot(path)
        else:
            path = os.path.join(self.directory, f"memory_iter{iteration}.json")
            with open(path, "w", encoding="utf-8") as out:
                json.dump({"iteration": iteration, **memory_stats()}, out)
        return path

    def stop(self) -> None:
        if self.cuda:
            torch.cuda.memory._record_memory_history(enabled=None)
