"""Saving and loading training checkpoints through the DeepSpeed engine, atomically.

Layout of `save/`:
    global_step{N}/            DeepSpeed's files (model / optimizer shards), written by every rank
    global_step{N}/neox_args.json   the NeoXArgs of the run (architecture check on load)
    global_step{N}/configs/*.yml    the user's YAML files, verbatim
    global_step{N}/rng_state_rank{R}.pt   each rank's RNG states (unless no_save_rng)
    global_step{N}/COMPLETE   written last, after every rank has finished
    latest                     the tag of the newest complete checkpoint

DeepSpeed is told not to touch `latest`; we replace it (write to a temporary file, then os.replace)
only after all ranks have saved and COMPLETE exists, so a crash mid-save leaves `latest` pointing at the
previous, complete checkpoint."""

import json
import os
import random
import shutil
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

COMPLETE_MARKER = "COMPLETE"
LATEST_FILE = "latest"

ARCHITECTURE_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "num_kv_heads", "intermediate_size",
                     "expansion_factor", "mlp_multiple_of", "activation", "norm", "pos_emb", "rotary_pct",
                     "max_position_embeddings", "padded_vocab_size", "no_weight_tying", "gpt_j_residual",
                     "gpt_j_tied", "use_bias_in_norms", "use_bias_in_attn_linear", "use_bias_in_mlp",
                     "use_qk_layernorm", "attention_config", "num_unique_layers", "model_parallel_size",
                     "pipe_parallel_size")
"""Arguments that must match between a checkpoint and the model loading it."""
LAYOUT_KEYS = ("model_parallel_size", "pipe_parallel_size")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded into this run; the message says which and why."""


def tag_for(iteration: int) -> str:
    return f"global_step{iteration}"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rng_states() -> Dict[str, Any]:
    states = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def _set_rng_states(states: Dict[str, Any]) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])


def _write_atomically(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def read_latest(save_dir: str) -> Optional[str]:
    """The tag `latest` names, or None when there is no checkpoint."""
    path = os.path.join(save_dir, LATEST_FILE)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as handle:
        return handle.read().strip() or None


def complete_tags(save_dir: str) -> List[str]:
    """Complete checkpoints, oldest first."""
    if not os.path.isdir(save_dir):
        return []
    tags = [t for t in os.listdir(save_dir) if t.startswith("global_step")
            and os.path.isfile(os.path.join(save_dir, t, COMPLETE_MARKER))]
    return sorted(tags, key=lambda t: int(t[len("global_step"):]) if t[len("global_step"):].isdigit() else -1)


def saved_args(neox_args, model_config) -> Dict[str, Any]:
    """What neox_args.json records: the run's arguments plus the values only known in the workers (the
    padded vocabulary, from the tokenizer)."""
    return {**neox_args.to_dict(), "padded_vocab_size": model_config.padded_vocab_size}


def save_checkpoint(neox_args, model_config, iteration: int, engine,
                    extra_state: Optional[Dict[str, Any]] = None) -> str:
    """Save on every rank; returns the checkpoint directory. `extra_state` holds e.g. the data position."""
    save_dir = neox_args.save
    tag = tag_for(iteration)
    path = os.path.join(save_dir, tag)
    rank = _rank()
    if rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        if os.path.isdir(path):  # a leftover from a crashed save of the same iteration
            shutil.rmtree(path)
    _barrier()
    client_state = {"iteration": iteration, **(extra_state or {})}
    engine.save_checkpoint(save_dir, tag=tag, client_state=client_state, save_latest=False)
    os.makedirs(path, exist_ok=True)
    if not neox_args.no_save_rng:
        torch.save(_rng_states(), os.path.join(path, f"rng_state_rank{rank}.pt"))
    if rank == 0:
        with open(os.path.join(path, "neox_args.json"), "w", encoding="utf-8") as handle:
            json.dump(saved_args(neox_args, model_config), handle, indent=1, sort_keys=True, default=str)
        os.makedirs(os.path.join(path, "configs"), exist_ok=True)
        for name, text in (neox_args.config_files or {}).items():
            with open(os.path.join(path, "configs", os.path.basename(name)), "w", encoding="utf-8") as handle:
                handle.write(text)
    _barrier()
    if rank == 0:
        _write_atomically(os.path.join(path, COMPLETE_MARKER), f"{iteration}\n")
        _write_atomically(os.path.join(save_dir, LATEST_FILE), tag)
        _prune(save_dir, neox_args.keep_last_n_checkpoints)
    _barrier()
    return path


def _prune(save_dir: str, keep: Optional[int]) -> None:
    if not keep:
        return
    for old in complete_tags(save_dir)[:-keep]:
        shutil.rmtree(os.path.join(save_dir, old), ignore_errors=True)


def _architecture_mismatches(saved: Dict[str, Any], current: Dict[str, Any], keys: Tuple[str, ...]) -> List[str]:
    return [f"{key}: checkpoint {saved[key]!r}, config {current[key]!r}" for key in keys
            if key in saved and saved[key] != current[key]]


def resolve_checkpoint(neox_args, model_config, layout_must_match: bool = True) -> Optional[Tuple[str, str]]:
    """(load_dir, tag) to load, or None to start from scratch. Raises CheckpointError for a bad checkpoint.
    ``layout_must_match``: the tensor / pipeline split must be the checkpoint's (DeepSpeed's engine loads
    its own shards; inference reshards and sets it False)."""
    load_dir = neox_args.load
    if not load_dir:
        return None
    if neox_args.iteration is not None:
        tag = tag_for(neox_args.iteration)
        if not os.path.isdir(os.path.join(load_dir, tag)):
            raise CheckpointError(f"iteration={neox_args.iteration}: no checkpoint {os.path.join(load_dir, tag)}; "
                                  f"complete ones: {complete_tags(load_dir) or 'none'}")
    else:
        tag = read_latest(load_dir)
        if tag is None:
            return None
    path = os.path.join(load_dir, tag)
    if not os.path.isfile(os.path.join(path, COMPLETE_MARKER)):
        raise CheckpointError(f"checkpoint {path} is incomplete (no {COMPLETE_MARKER} marker: its save was "
                              f"interrupted); complete ones: {complete_tags(load_dir) or 'none'} — set iteration "
                              f"to one of them")
    args_file = os.path.join(path, "neox_args.json")
    if os.path.isfile(args_file):
        with open(args_file, encoding="utf-8") as handle:
            saved = json.load(handle)
        keys = ARCHITECTURE_KEYS if layout_must_match else tuple(k for k in ARCHITECTURE_KEYS if k not in LAYOUT_KEYS)
        mismatches = _architecture_mismatches(saved, saved_args(neox_args, model_config), keys)
        if mismatches:
            raise CheckpointError(f"checkpoint {path} was saved by a model of another architecture or parallel "
                                  f"layout:\n  " + "\n  ".join(mismatches))
    return load_dir, tag


def load_checkpoint(neox_args, model_config, engine) -> Tuple[int, Dict[str, Any]]:
    """Load into `engine`; returns (iteration to continue from, client state). (0, {}) when nothing to load."""
    resolved = resolve_checkpoint(neox_args, model_config)
    if resolved is None:
        return 0, {}
    load_dir, tag = resolved
    finetune = neox_args.finetune
    load_optim = not (neox_args.no_load_optim or finetune)
    try:
        loaded_path, client_state = engine.load_checkpoint(
            load_dir, tag=tag, load_optimizer_states=load_optim, load_lr_scheduler_states=load_optim,
            load_module_only=finetune)
    except (RuntimeError, KeyError, OSError, EOFError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {os.path.join(load_dir, tag)} could not be loaded: {exc}") from exc
    if loaded_path is None:
        raise CheckpointError(f"DeepSpeed found no checkpoint files in {os.path.join(load_dir, tag)}")
    client_state = client_state or {}
    rng_file = os.path.join(load_dir, tag, f"rng_state_rank{_rank()}.pt")
    if not (finetune or neox_args.no_load_rng) and os.path.isfile(rng_file):
        _set_rng_states(torch.load(rng_file, weights_only=False))
    iteration = 0 if finetune else int(client_state.get("iteration", 0))
    return iteration, client_state
