"""Starting a worker: check the device, start torch.distributed through DeepSpeed, build the parallel
layout, seed the RNG streams, build the tokenizer, find (and verify) the checkpoint to load, and build the
model's ModelConfig (padded vocabulary included).

The result is a RunContext handed to the training / generation / evaluation code, so that nothing about
the run lives in module globals and the validated NeoXArgs are never changed. Each is made once per worker:
the ModelConfig once its vocabulary is known (the device check before it needs only the precision), the
checkpoint found and its checksums verified once, by rank 0 for every rank (megatron.checkpoint.engine
.find_checkpoint), and handed to every reader.

May import: megatron.errors, utils, tokenizer, mpu, model, optim, checkpoint, neox_arguments."""

import dataclasses
import datetime
import os
import random
from typing import Any, Dict, Mapping, Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron.checkpoint.engine import FoundCheckpoint, checkpoint_vocab_size, find_checkpoint
from megatron.errors import ConfigError
from megatron.model.config import ModelConfig, padded_vocab_size, precision_device_problems
from megatron.mpu import RNGStatesTracker, build_parallel_state, model_parallel_seed
from megatron.mpu.deepspeed_comm import init_deepspeed_comm
from megatron.mpu.host_collectives import barrier
from megatron.neox_arguments.launcher import rendezvous_environment
from megatron.optim.zero_offload import offload_device_problems
from megatron.tokenizer import build_tokenizer
from megatron.utils.rank_logs import tee_rank_output


@dataclasses.dataclass
class RunContext:
    """What every worker-side component needs besides the arguments."""

    parallel_state: object
    rng_tracker: RNGStatesTracker
    tokenizer: object
    device: torch.device
    model_config: ModelConfig
    checkpoint: Optional[FoundCheckpoint] = None
    """The checkpoint ``load`` names, found and verified (None: nothing to load): load_checkpoint and
    setup_for_inference read it."""

    def destroy(self) -> None:
        """Tear down the process groups (barrier first: a worker leaving right after a collective can abort)."""
        if dist.is_initialized():
            barrier()
            self.parallel_state.destroy()
            dist.destroy_process_group()


def distributed_backend(neox_args) -> str:
    """nccl needs CUDA: CPU workers use gloo whatever the config says (configs are shared with GPU clusters)."""
    backend = neox_args.distributed_backend
    if backend == "nccl" and not torch.cuda.is_available():
        return "gloo"
    return backend


LOST_RANK_SIGNS = ("connection reset by peer", "connection closed by peer", "broken pipe", "timed out", "timeout",
                   "connection refused")
"""How gloo / NCCL say that another rank is gone or not answering."""


def lost_rank_message(exc: BaseException, neox_args) -> Optional[str]:
    """The error to print when ``exc`` says that a collective operation lost another rank, else None."""
    text = str(exc)
    if not isinstance(exc, (RuntimeError, dist.DistError)) or not any(s in text.lower() for s in LOST_RANK_SIGNS):
        return None
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return (f"rank {neox_args.rank} lost another rank during a collective operation: that rank died (see its log) or "
            f"did not answer within distributed_timeout_minutes={neox_args.distributed_timeout_minutes:g}. The run "
            f"stopped here; relaunch it to resume from its last checkpoint. ({first[:300]})")


def start_distributed(neox_args) -> None:
    """torch.distributed through DeepSpeed, whichever launcher started this worker: the rank comes from
    DeepSpeed's launcher, srun or mpirun (their own variables, read without mpi4py or MPI_Init), the address
    of rank 0 from MASTER_ADDR or master_addr. A master port that is taken is a ConfigError naming it."""
    if not dist.is_initialized():
        try:
            os.environ.update(rendezvous_environment(neox_args.rank, neox_args.local_rank, neox_args.world_size,
                                                     neox_args.master_addr, neox_args.master_port, os.environ))
        except ValueError as err:
            raise ConfigError([str(err)]) from None
    try:
        init_deepspeed_comm(distributed_backend(neox_args), auto_mpi_discovery=False,
                            distributed_port=neox_args.master_port,
                            timeout=datetime.timedelta(minutes=neox_args.distributed_timeout_minutes))
    except dist.DistNetworkError as err:
        where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        if "EADDRINUSE" in str(err) or "address already in use" in str(err).lower():
            raise ConfigError([f"master_port: rank 0 cannot listen on {where}, another process uses that port; "
                               f"choose another master_port (deepy.py picks a free one when the default is "
                               f"taken)"]) from None
        raise ConfigError([f"rank {neox_args.rank} cannot reach rank 0 at {where} (master_addr / master_port): "
                           f"{str(err).splitlines()[0]}"]) from None


def initialize_megatron(neox_args, build_tokenizer_fn=None, model_changes: Optional[Mapping[str, Any]] = None
                        ) -> RunContext:
    """Everything before the model: distributed world, layout, seeds, tokenizer, the checkpoint to load, the
    model's config (``model_changes``: its fields that differ from the arguments', ModelConfig.from_neox_args)."""
    tee_rank_output(neox_args.log_dir, neox_args.rank)
    problems = precision_device_problems(neox_args.precision, torch.cuda.is_available())
    problems += offload_device_problems(neox_args.zero_optimization)
    if problems:
        raise ConfigError(problems)
    if torch.cuda.is_available() and neox_args.local_rank is not None:
        torch.cuda.set_device(neox_args.local_rank)
    start_distributed(neox_args)
    parallel_state = build_parallel_state(neox_args)
    tracker = RNGStatesTracker()
    set_seeds(neox_args.seed, parallel_state, tracker)
    tokenizer = (build_tokenizer_fn or build_tokenizer)(neox_args)
    try:
        vocab = padded_vocab_size(tokenizer.vocab_size, neox_args.make_vocab_size_divisible_by,
                                  neox_args.model_parallel_size, neox_args.padded_vocab_size)
    except ValueError as err:
        raise ConfigError([str(err)]) from None
    checkpoint = find_checkpoint(neox_args)
    vocab = _checkpoint_vocabulary(neox_args, checkpoint, tokenizer.vocab_size, vocab)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    changes = {**soft_prompt_init_tokens(neox_args, tokenizer), **(model_changes or {})}
    return RunContext(parallel_state=parallel_state, rng_tracker=tracker, tokenizer=tokenizer, device=device,
                      model_config=ModelConfig.from_neox_args(neox_args, padded_vocab_size=vocab, **changes),
                      checkpoint=checkpoint)


def soft_prompt_init_tokens(neox_args, tokenizer) -> Dict[str, Any]:
    """{'soft_prompt_init_tokens': the token ids of soft_prompt_tuning.init_string} when a soft prompt starts from
    a string's embeddings (megatron.model.embedding.SoftPrompt), else {}. ConfigError when the string has no
    tokens."""
    settings = neox_args.soft_prompt_tuning or {}
    text = settings.get("init_string")
    if not text or not settings.get("enabled", True):
        return {}
    tokens = tuple(int(t) for t in tokenizer.tokenize(text))
    if not tokens:
        raise ConfigError([f"soft_prompt_tuning.init_string={text!r} has no tokens for tokenizer_type="
                           f"{neox_args.tokenizer_type!r}; give a string that tokenizes, or remove init_string"])
    return {"soft_prompt_init_tokens": tokens}


def _checkpoint_vocabulary(neox_args, checkpoint: Optional[FoundCheckpoint], tokenizer_vocab: int, vocab: int) -> int:
    """A GPT-NeoX checkpoint to load fixes the padded vocabulary (its embedding's rows; GPT-NeoX pads with its
    own make_vocab_size_divisible_by), unless padded_vocab_size is set (then resolve_checkpoint compares)."""
    rows = checkpoint_vocab_size(checkpoint)
    if rows is None or rows == vocab or neox_args.padded_vocab_size is not None:
        return vocab
    if rows < tokenizer_vocab or rows % neox_args.model_parallel_size:
        raise ConfigError([f"load={neox_args.load}: the GPT-NeoX checkpoint's embedding has {rows} rows, which do not "
                           f"hold the tokenizer's {tokenizer_vocab} tokens split over model_parallel_size="
                           f"{neox_args.model_parallel_size}; check tokenizer_type / vocab_file"])
    return rows


def set_seeds(seed: int, parallel_state, tracker: Optional[RNGStatesTracker] = None) -> None:
    """Python, numpy and torch seeded per pipeline stage; the tensor-parallel dropout stream per TP rank."""
    stage_seed = seed + 100 * parallel_state.get_pipe_parallel_rank()
    random.seed(stage_seed)
    np.random.seed(stage_seed % (2 ** 32))
    model_parallel_seed(seed, parallel_state, tracker if tracker is not None else RNGStatesTracker())
    os.environ.setdefault("PYTHONHASHSEED", str(seed))
