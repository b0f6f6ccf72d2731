"""Saving and loading training checkpoints through the DeepSpeed engine, atomically, in GPT-NeoX's layout.

Layout of `save/` (everything GPT-NeoX writes, plus this project's crash-safety and run records):
    global_step{N}/            DeepSpeed's files, written by every rank, in GPT-NeoX's layout: without a
                               pipeline mp_rank_{t:02d}_model_states.pt whose `module` keys are
                               sequential.{slot}.{name}; with one layer_{slot:02d}-model_{t:02d}-model_states.pt
                               per slot and tensor rank (megatron.model.gpt2_model, checkpoint_layout); ZeRO /
                               optimizer files as DeepSpeed names them
    mp_rank_*_model_states.pt  also hold GPT-NeoX's client state: `iteration`, `args` (the eight values
                               GPT-NeoX's loader checks), plus ours: the data position,
                               `checkpoint_layout` and `optimizer_layout` (the rank's tensor / pipe rank and
                               its optimizer's parameter names, which resharding needs)
    global_step{N}/neox_args.json   the NeoXArgs of the run (architecture check on load), with
                               checkpoint_layout: gpt-neox
    global_step{N}/configs/*.yml    the user's YAML files, verbatim (as GPT-NeoX)
    global_step{N}/rng_state_rank{R}.pt   each rank's RNG states (unless no_save_rng), written once, here
                               (megatron.checkpoint.rng_state: why here and not in the client state)
    global_step{N}/checksums.xxh128   XXH3-128 of every file above, written after they are all flushed to disk;
                               verified before a load (megatron.checkpoint.integrity; checksums.sha256 in
                               checkpoints saved before)
    global_step{N}/COMPLETE   written last, after every rank has finished
    latest                     the tag of the newest complete checkpoint
    .run.lock                  held by the training run writing here (megatron.checkpoint.run_lock)
    non_persistent/            non-persistent checkpoints (non_persistent_ckpt_type 'global', by default here):
                               the same layout, only the newest kept (megatron.checkpoint.non_persistent)

DeepSpeed is told not to touch `latest`; we replace it (write to a temporary file, then os.replace)
only after all ranks have saved and COMPLETE exists, so a crash mid-save leaves `latest` pointing at the
previous, complete checkpoint. A save that fails (the disk full) removes its partial directory and raises
CheckpointError naming the cause; `latest` stays where it was.

Which checkpoint a directory holds (``checkpoint_kind``):
  * this project's (neox_args.json with checkpoint_layout gpt-neox): needs COMPLETE and the same architecture;
    saved with another tensor / pipeline split, ZeRO stage, or number of data-parallel ranks under ZeRO, it is
    resharded on load, weights and optimizer state (megatron.checkpoint.resharding), with a note saying so;
  * this project's older layout (neox_args.json without checkpoint_layout: flat names, or GPT-NeoX's slots
    with this project's earlier tensor names): generation, evaluation and conversion read it
    (megatron.checkpoint_conversion translates it); training refuses it and names the upgrade command;
  * GPT-NeoX's (no neox_args.json, and no checkpoint_layout in the client state): loaded as it is, its
    architecture checked against the client state's `args`, the checkpoint's configs/*.yml and the files'
    tensor/pipeline split (another split loads the weights only: finetune or no_load_optim); its padded
    vocabulary is taken from the embedding (megatron.initialize); its RNG
    states come from the client state (restore_rng). Files of this project without COMPLETE are an interrupted save and
    are refused.
"""

import dataclasses
import errno
import json
import os
import shutil
import tempfile
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch
from deepspeed.runtime.zero.utils import ZeRORuntimeException

from megatron.checkpoint.files import checkpoint_kind, load_lazily, read_client_state
from megatron.checkpoint.format import (ARCHITECTURE_KEYS, ARGS_FILE, COMPLETE_MARKER, GPT_NEOX, LATEST_FILE, LAYOUT,
                                        LAYOUT_KEY, LAYOUT_KEYS, LORA_BASE_KEY, MERGED_ON_READ, OURS, OURS_OLD, RESHARD_KEY,
                                        UPGRADE_TOOL, complete_tags, file_layout, gpt_neox_client_args,
                                        gpt_neox_gmlp_problem, gpt_neox_mamba_problem,
                                        gpt_neox_qk_norm_problem, optimizer_layout, read_latest,
                                        read_saved_args, resume_tag, saved_args, tag_for, yaml_values)
from megatron.checkpoint.integrity import (verification_problems,  # a seam tests replace
                                           write_atomically as _write_atomically, write_manifest)
from megatron.checkpoint.non_persistent import claim_directory, keep_only, newer_checkpoint, non_persistent_dir
from megatron.checkpoint.resharding import describe, layout_of, load_resharded, needs_resharding, reference_problem
from megatron.checkpoint.rng_state import process_rank, rng_file, rng_states, saved_rng_states, set_rng_states
from megatron.checkpoint.s3_location import S3Location
from megatron.checkpoint.s3_upload import download_checkpoint, s3_client
from megatron.checkpoint.weights_only import weights_only
from megatron.errors import CheckpointError  # noqa: F401 (CheckpointError: re-exported)
from megatron.model.config import expand_attention_config
from megatron.mpu.host_collectives import barrier, broadcast_object
from megatron.utils.optional_deps import MissingOptionalDependency


def _rng_states(tracker=None) -> Dict[str, Any]:
    """What a checkpoint saves (a seam tests replace to interrupt a save)."""
    return rng_states(tracker)


def directory_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, name)) for root, _dirs, names in os.walk(path) for name in names)


def estimated_checkpoint_bytes(save_dir: str, parameters: int, weight_bytes: int) -> int:
    """The size of one checkpoint: the newest complete one in ``save_dir`` if there is one, else ``parameters``
    weights of ``weight_bytes`` each plus Adam's two fp32 moments (and fp32 master weights for 16-bit weights)."""
    complete = complete_tags(save_dir)
    if complete:
        return directory_bytes(os.path.join(save_dir, complete[-1]))
    return parameters * (weight_bytes + 8 + (4 if weight_bytes < 4 else 0))


def _gib(size: float) -> str:
    return f"{size / 2 ** 30:.2f} GiB"


def space_problem(save_dir: str, needed: int) -> Optional[str]:
    """A message when the filesystem of ``save_dir`` has less free space than ``needed`` bytes (one checkpoint)."""
    free = shutil.disk_usage(save_dir).free
    if free >= needed:
        return None
    return (f"save='{save_dir}' has {_gib(free)} free, and one checkpoint of this run takes about {_gib(needed)}: "
            f"the first save would fail with the disk full. Free space there (keep_last_n_checkpoints prunes old "
            f"checkpoints) or set save to a larger filesystem")


def write_refusal(directory: str) -> Optional[OSError]:
    """The error creating (and removing) a file in ``directory`` gives, or None when it can be written. Probed,
    not judged from permission bits: root ignores those, but not an immutable attribute or a read-only mount."""
    try:
        handle, probe = tempfile.mkstemp(prefix=".neox_write_probe", dir=directory)
        os.close(handle)
        os.remove(probe)
    except OSError as exc:
        return exc
    return None


def _permission_cause(save_dir: str, path: str) -> Optional[str]:
    """Why the save failed when the cause is permission (a mode, an owner, `chattr +i`, a read-only mount): DeepSpeed
    logs and swallows the failure to create the checkpoint's directory, and torch then reports "Parent directory ...
    does not exist", which reads like a missing directory or a full disk."""
    for directory in (path, save_dir):
        if not os.path.isdir(directory):
            continue
        refused = write_refusal(directory)
        if refused is not None and refused.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return (f"'{directory}' cannot be written ({refused.strerror}): a permission problem (the directory's "
                    f"mode or owner, an immutable attribute set with chattr +i, or a read-only mount), not a "
                    f"missing directory or free space")
        if refused is None:
            return None
    return None


def _save_failure(path: str, exc: BaseException) -> CheckpointError:
    """What a failed save (disk full, a directory that cannot be written, a vanished directory, a failing disk)
    says; `latest` has not moved."""
    save_dir = os.path.dirname(path)
    try:
        previous = read_latest(save_dir)
    except CheckpointError:  # a `latest` naming another directory: nothing of it is resumed from
        previous = None
    keeps = (f"'{LATEST_FILE}' still names {previous}, which is complete and will be resumed from" if previous
             else "no checkpoint was completed before it")
    permission = _permission_cause(save_dir, path)
    if permission is not None:
        return CheckpointError(f"saving checkpoint {path} failed: {permission}; the partial checkpoint was removed "
                               f"and {keeps}. Make it writable for this user (chmod / chown, chattr -i, remount "
                               f"read-write) or set save to a directory you can write, and relaunch to resume")
    try:
        free = shutil.disk_usage(save_dir).free
    except OSError:
        free = None
    full = free is not None and (free < 1 << 20 or "No space left" in str(exc))
    cause = "the disk is full" if full else f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else exc}"
    return CheckpointError(f"saving checkpoint {path} failed: {cause}"
                           f"{f' ({_gib(free)} free)' if free is not None else ''}; the partial checkpoint was "
                           f"removed and {keeps}. Free space (or fix the disk) and relaunch to resume")


def save_checkpoint(neox_args, model_config, iteration: int, engine,
                    extra_state: Optional[Dict[str, Any]] = None,
                    write_extra: Optional[Callable[[str], None]] = None, complete: bool = True,
                    non_persistent: bool = False, rng_tracker=None) -> str:
    """Save on every rank; returns the checkpoint directory. `extra_state` holds e.g. the data position;
    `write_extra(directory)` (every rank) adds files before the checkpoint is marked complete (DPO's reference).
    ``complete=False``: the engine's files may still be being written (async_save's BackgroundWriter); the caller
    completes the checkpoint with complete_checkpoint once they are (megatron.checkpoint.async_save).
    ``non_persistent``: into the non-persistent directory, which then keeps only this checkpoint
    (megatron.checkpoint.non_persistent). ``rng_tracker``: the model's RNGStatesTracker, whose streams are saved
    with the rank's RNG states (a resume then draws the dropout masks the uninterrupted run drew)."""
    save_dir = os.path.normpath(non_persistent_dir(neox_args)) if non_persistent else neox_args.save
    tag = tag_for(iteration)
    path = os.path.join(save_dir, tag)
    rank = process_rank()
    if rank == 0:
        if non_persistent:  # never another run's save directory, whose checkpoints it would delete
            claim_directory(neox_args)
        os.makedirs(save_dir, exist_ok=True)
        if os.path.isdir(path):  # a leftover from a crashed save of the same iteration
            shutil.rmtree(path)
    barrier()
    client_state = {"iteration": iteration, "args": gpt_neox_client_args(neox_args.to_dict(), model_config),
                    LAYOUT_KEY: LAYOUT,
                    RESHARD_KEY: optimizer_layout(engine), **(extra_state or {})}
    lora = {"exclude_frozen_parameters": True} if model_config.lora else {}
    if lora:  # the adapters only, and where their base is (megatron.checkpoint.lora)
        client_state[LORA_BASE_KEY] = getattr(engine, "lora_base", None)
    try:
        with weights_only(engine, enabled=neox_args.no_save_optim):
            engine.save_checkpoint(save_dir, tag=tag, client_state=client_state, save_latest=False, **lora)
        os.makedirs(path, exist_ok=True)
        if not neox_args.no_save_rng:
            torch.save(_rng_states(rng_tracker), rng_file(path, rank))
        if rank == 0:
            with open(os.path.join(path, ARGS_FILE), "w", encoding="utf-8") as handle:
                json.dump(saved_args(neox_args, model_config), handle, indent=1, sort_keys=True, default=str)
            os.makedirs(os.path.join(path, "configs"), exist_ok=True)
            for name, text in (neox_args.config_files or {}).items():
                with open(os.path.join(path, "configs", os.path.basename(name)), "w", encoding="utf-8") as handle:
                    handle.write(text)
        if write_extra is not None:
            write_extra(path)
    except (OSError, RuntimeError) as exc:  # disk full: torch reports it as "[enforce fail at inline_container.cc]"
        raise failed_save(path, exc) from None
    if not complete:
        return path
    barrier()
    if rank == 0:
        complete_checkpoint(path, iteration, neox_args.keep_last_n_checkpoints, only=non_persistent)
    barrier()
    return path


def failed_save(path: str, exc: BaseException) -> CheckpointError:
    """The error of a save that failed on this rank; its partial directory is removed (it was never complete,
    so never loaded, and it holds the space)."""
    error = _save_failure(path, exc)
    shutil.rmtree(path, ignore_errors=True)
    return error


def complete_checkpoint(path: str, iteration: int, keep_last: Optional[int], only: bool = False,
                        digests: Optional[Mapping[str, str]] = None) -> None:
    """Rank 0, once every rank's files of ``path`` are written: checksums, COMPLETE, then `latest` moves.
    Then the oldest beyond ``keep_last`` are pruned, or with ``only`` (a non-persistent checkpoint) every other
    checkpoint of the directory is removed. ``digests``: {file relative to ``path``: XXH3-128} hashed as written
    (async_save), not read back."""
    save_dir = os.path.dirname(path)
    write_manifest(path, digests)  # every file flushed to disk and checksummed before COMPLETE
    _write_atomically(os.path.join(path, COMPLETE_MARKER), f"{iteration}\n")
    _write_atomically(os.path.join(save_dir, LATEST_FILE), os.path.basename(path))
    _remove_stray_temporaries(save_dir)
    if only:
        keep_only(save_dir, os.path.basename(path))
    else:
        _prune(save_dir, keep_last)


def _remove_stray_temporaries(save_dir: str) -> None:
    """`latest.tmp<pid>` files that a process killed inside _write_atomically left behind."""
    for name in os.listdir(save_dir):
        if name.startswith(f"{LATEST_FILE}.tmp"):
            try:
                os.remove(os.path.join(save_dir, name))
            except OSError:
                pass


def _prune(save_dir: str, keep: Optional[int]) -> None:
    if not keep:
        return
    for old in complete_tags(save_dir)[:-keep]:
        shutil.rmtree(os.path.join(save_dir, old), ignore_errors=True)


def _architecture_mismatches(saved: Dict[str, Any], current: Dict[str, Any], keys: Tuple[str, ...]) -> List[str]:
    return [f"{key}: checkpoint {saved[key]!r}, config {current[key]!r}" for key in keys
            if key in saved and saved[key] != current[key]]


def _check_resume_settings(path: str, saved: Mapping[str, Any], neox_args) -> None:
    """What a resume (not a fine-tune) needs besides the architecture. Refused: another seq_length (the data
    position counts samples of seq_length tokens), and another moe_expert_parallel_size with the optimizer state
    loaded (DeepSpeed saves the experts' optimizer state per expert-parallel rank; the dropless layer's weights
    change layout between 1 and more expert-parallel ranks). Handled, with a note: another global batch size (the
    data continues at the same sample; iterations and the LR schedule count batches of the new size). Another
    parallel layout (context_parallel_size included) is resharded by load_checkpoint."""
    problems = []
    saved_ep, ep = saved.get("moe_expert_parallel_size") or 1, neox_args.moe_expert_parallel_size
    experts = saved.get("moe_num_experts", 1) > 1 and saved_ep != ep
    if experts and neox_args.moe_type == "megablocks" and 1 in (saved_ep, ep):
        problems.append(f"moe_expert_parallel_size: checkpoint {saved_ep}, this run {ep}: the dropless layer keeps "
                        f"its experts stacked in the model file at moe_expert_parallel_size 1 and in one file per "
                        f"expert above it, and DeepSpeed's engine loads only its own layout. Resume with "
                        f"moe_expert_parallel_size: {saved_ep} (or another size above 1 with no_load_optim: true); "
                        f"generate.py, eval.py and the conversion tools read either")
    elif experts and not neox_args.no_load_optim:
        problems.append(f"moe_expert_parallel_size: checkpoint {saved_ep}, this run {ep}: DeepSpeed's optimizer "
                        f"state of the experts is saved per expert-parallel rank and cannot be split another way. "
                        f"Resume with moe_expert_parallel_size: {saved_ep}, or set no_load_optim: true to load the "
                        f"weights (saved one expert per file, they load at any expert-parallel size) and the "
                        f"iteration and start the optimizer state afresh")
    if saved.get("seq_length") is not None and saved["seq_length"] != neox_args.seq_length:
        problems.append(f"seq_length: checkpoint {saved['seq_length']}, config {neox_args.seq_length}: resuming "
                        f"continues the data where the run stopped, which is only defined for the same seq_length "
                        f"(a sample is seq_length tokens). To go on training at another length, set finetune: true "
                        f"(the weights, from iteration 0, on the data from its start)")
    if problems:
        raise CheckpointError(f"checkpoint {path} cannot be resumed by this run:\n  " + "\n  ".join(problems))
    saved_batch = saved.get("train_batch_size")
    if saved_batch is not None and saved_batch != neox_args.train_batch_size and process_rank() == 0:
        print(f"note: the global batch size changed from {saved_batch} (checkpoint) to {neox_args.train_batch_size}: "
              f"the data continues at the sample where the run stopped; iterations (train_iters, the LR schedule, "
              f"checkpoint and evaluation intervals) count batches of {neox_args.train_batch_size}", flush=True)


def _download_from_s3(neox_args) -> None:
    """s3_path's resume where ``save`` (the ``load`` directory too) lacks the checkpoint to resume from (a new machine,
    a lost disk): rank 0 downloads it from S3 (megatron.checkpoint.s3_upload.download_checkpoint: the newest
    complete one in S3, or ``iteration``'s), then every rank goes on as if it had been saved here; CheckpointError on
    every rank when the download fails."""
    load_dir, save_dir = neox_args.load, neox_args.save
    if not (neox_args.s3_path and save_dir and os.path.abspath(load_dir) == os.path.abspath(save_dir)):
        return
    wanted = tag_for(neox_args.iteration) if neox_args.iteration is not None else None
    if (os.path.isdir(os.path.join(load_dir, wanted)) if wanted else complete_tags(load_dir)):
        return
    problem = None
    if process_rank() == 0:
        location = S3Location.parse(neox_args.s3_path)
        try:
            os.makedirs(load_dir, exist_ok=True)
            path = download_checkpoint(s3_client(), location, load_dir, wanted)
            if path is not None:
                _write_atomically(os.path.join(load_dir, LATEST_FILE), os.path.basename(path))
                print(f"note: {load_dir} holds no checkpoint to resume from: downloaded {path} from "
                      f"{location.url(os.path.basename(path))}", flush=True)
        except (CheckpointError, MissingOptionalDependency) as exc:
            problem = str(exc)
    problem = broadcast_object(problem, src=0)
    if problem:
        raise CheckpointError(problem)


def _verified_by_rank0(path: str) -> List[str]:
    """verification_problems of checkpoint ``path``, read once (by rank 0) and given to every rank."""
    return broadcast_object(verification_problems(path) if process_rank() == 0 else [], src=0)


@dataclasses.dataclass(frozen=True)
class FoundCheckpoint:
    """The checkpoint a worker loads, found and verified once (find_checkpoint, called by megatron.initialize,
    which keeps it in the RunContext) and handed to every reader: the padded vocabulary, load_checkpoint, the
    resharding and inference readers use it without looking for it, or hashing its files, again."""
    load_dir: str
    tag: str
    kind: str
    """OURS, OURS_OLD or GPT_NEOX (megatron.checkpoint.files.checkpoint_kind)."""

    @property
    def path(self) -> str:
        return os.path.join(self.load_dir, self.tag)


def find_checkpoint(neox_args) -> Optional[FoundCheckpoint]:
    """The checkpoint ``load`` / ``iteration`` name (the non-persistent one when it is newer), its files checked
    against their checksums by rank 0 for every rank; None to start from scratch. Raises CheckpointError when
    ``iteration`` names no checkpoint or a file is damaged. Whether it fits this run is resolve_checkpoint's
    question, asked once the ModelConfig exists (whose padded vocabulary may come from this checkpoint)."""
    load_dir = neox_args.load
    if not load_dir:
        return None
    _download_from_s3(neox_args)
    if neox_args.iteration is not None:
        tag = tag_for(neox_args.iteration)
        if not os.path.isdir(os.path.join(load_dir, tag)):
            raise CheckpointError(f"iteration={neox_args.iteration}: no checkpoint {os.path.join(load_dir, tag)}; "
                                  f"complete ones: {complete_tags(load_dir) or 'none'}")
    else:
        tag, note = resume_tag(load_dir)
        load_dir, tag, newer = newer_checkpoint(neox_args, load_dir, tag)
        note = newer or note
        if tag is None:
            return None
        if note and process_rank() == 0:
            print(f"note: {note}", flush=True)
    path = os.path.join(load_dir, tag)
    damage = _verified_by_rank0(path)
    if damage:
        older = [t for t in complete_tags(load_dir) if t != tag]
        raise CheckpointError(f"checkpoint {path} is damaged: " + "; ".join(damage) + f". It was not loaded. Other "
                              f"complete checkpoints: {older or 'none'}" + (" — set iteration to one of them"
                                                                            if older else ""))
    return FoundCheckpoint(load_dir=load_dir, tag=tag, kind=checkpoint_kind(path))


def resolve_checkpoint(neox_args, model_config, checkpoint: Optional[FoundCheckpoint],
                       layout_must_match: bool = True) -> Optional[FoundCheckpoint]:
    """``checkpoint`` (find_checkpoint's) when this run can load it, None when there is none. Raises
    CheckpointError for a checkpoint of another model or an unfinished save. ``layout_must_match``: the tensor /
    pipeline split must be the checkpoint's (DeepSpeed's engine loads its own shards; inference reshards and
    sets it False)."""
    if checkpoint is None:
        return None
    load_dir, path, kind = checkpoint.load_dir, checkpoint.path, checkpoint.kind
    if kind == GPT_NEOX:
        # its weights load into any split (megatron.checkpoint.resharding); its optimizer state only into its own
        weights_only = neox_args.finetune or neox_args.no_load_optim
        mismatches = _gpt_neox_mismatches(path, neox_args, model_config, layout_must_match and not weights_only)
        if mismatches:
            layout = any(m.startswith(LAYOUT_KEYS) for m in mismatches)
            raise CheckpointError(f"GPT-NeoX checkpoint {path} was saved by a model of another architecture or "
                                  f"parallel layout:\n  " + "\n  ".join(mismatches) + (
                                      "\nIts weights load into another tensor / pipeline split, its optimizer state "
                                      "only into its own: set no_load_optim: true (weights and iteration) or "
                                      "finetune: true, or resume with the checkpoint's split" if layout else ""))
        return checkpoint
    if not os.path.isfile(os.path.join(path, COMPLETE_MARKER)):
        raise CheckpointError(f"checkpoint {path} is incomplete (no {COMPLETE_MARKER} marker: its save was "
                              f"interrupted); complete ones: {complete_tags(load_dir) or 'none'} — set iteration "
                              f"to one of them")
    args_file = os.path.join(path, ARGS_FILE)
    if os.path.isfile(args_file):
        saved = read_saved_args(args_file)
        # this project's checkpoints load into any tensor / pipeline layout (megatron.checkpoint.resharding)
        keys = tuple(k for k in ARCHITECTURE_KEYS if k not in LAYOUT_KEYS) if kind == OURS or not layout_must_match \
            else ARCHITECTURE_KEYS
        keys = keys if layout_must_match else tuple(k for k in keys if k not in MERGED_ON_READ)
        mismatches = _architecture_mismatches(saved, saved_args(neox_args, model_config), keys)
        if mismatches:
            raise CheckpointError(f"checkpoint {path} was saved by a model of another architecture or parallel "
                                  f"layout:\n  " + "\n  ".join(mismatches))
        if layout_must_match and not neox_args.finetune:
            _check_resume_settings(path, saved, neox_args)
    if kind == OURS_OLD and layout_must_match:
        raise CheckpointError(f"checkpoint {path} is in this project's older layout (before GPT-NeoX's tensor names "
                              f"and slots), which DeepSpeed's engine cannot load for training; rewrite it with\n  "
                              f"python {UPGRADE_TOOL} --input_dir {path} --output_dir NEW_SAVE_DIR\nand set load to "
                              f"NEW_SAVE_DIR (generation, evaluation and conversion read the old layout as it is)")
    return checkpoint


def _comparable(key: str, value: Any, values: Mapping[str, Any]) -> Any:
    """``value`` of ``key`` in a form where equal models compare equal."""
    if key == "num_kv_heads":
        return value or values.get("num_attention_heads")
    if key == "attention_config" and value is not None:
        try:
            return expand_attention_config(value, int(values.get("num_layers") or 0))
        except (ValueError, TypeError):
            return value
    return value


def _gpt_neox_mismatches(path: str, neox_args, model_config, layout_must_match: bool) -> List[str]:
    """What differs between a GPT-NeoX checkpoint (its files, client `args` and configs/*.yml) and this run."""
    problems = []
    tp, pp = file_layout(path)
    for problem in (gpt_neox_mamba_problem(tp, model_config.attention_types),
                    gpt_neox_gmlp_problem(tp, model_config.attention_types),
                    gpt_neox_qk_norm_problem(model_config.use_qk_layernorm, model_config.norm)):
        if problem:
            problems.append(problem)
    if layout_must_match:
        if tp != model_config.model_parallel_size:
            problems.append(f"model_parallel_size: checkpoint {tp} (its files), config "
                            f"{model_config.model_parallel_size}")
        if (pp >= 1) != model_config.is_pipe_parallel or (pp >= 1 and pp != model_config.pipe_parallel_size):
            problems.append(f"pipe_parallel_size: checkpoint {pp} (its files: "
                            f"{'layer_* files' if pp else 'weights in mp_rank_* files'}), config "
                            f"{model_config.pipe_parallel_size}")
    client = read_client_state(path).get("args") or {}
    current = {"num_layers": model_config.num_layers, "hidden_size": model_config.hidden_size,
               "num_attention_heads": model_config.num_attention_heads,
               "max_position_embeddings": model_config.positions, "padded_vocab_size": model_config.padded_vocab_size}
    problems += [f"{key}: checkpoint {client[key]!r} (args in its mp_rank files), config {value!r}"
                 for key, value in current.items() if client.get(key) is not None and client[key] != value]
    saved_yaml = yaml_values(path)
    ours = saved_args(neox_args, model_config)
    for key in ARCHITECTURE_KEYS:
        if key in LAYOUT_KEYS or key == "padded_vocab_size" or key not in saved_yaml:
            continue
        theirs, mine = _comparable(key, saved_yaml[key], saved_yaml), _comparable(key, ours.get(key), ours)
        if theirs != mine:
            problems.append(f"{key}: checkpoint {saved_yaml[key]!r} (its configs/*.yml), config {ours.get(key)!r}")
    return problems


def checkpoint_vocab_size(checkpoint: Optional[FoundCheckpoint]) -> Optional[int]:
    """The padded vocabulary of GPT-NeoX checkpoint ``checkpoint`` (find_checkpoint's: rows of its word
    embedding, all tensor ranks), or None when there is none to load or it is this project's (neox_args.json
    records it)."""
    if checkpoint is None or checkpoint.kind != GPT_NEOX:
        return None
    path = checkpoint.path
    tp, pp = file_layout(path)
    if pp:
        name, key = os.path.join(path, "layer_00-model_00-model_states.pt"), "word_embeddings.weight"
    else:
        name, key = os.path.join(path, "mp_rank_00_model_states.pt"), "sequential.0.word_embeddings.weight"
    state = load_lazily(name)
    weights = state if pp else (state.get("module") or {})
    if key not in weights:
        raise CheckpointError(f"{name} has no {key}: not a GPT-NeoX language model checkpoint")
    return int(weights[key].shape[0]) * tp


def _check_gpt_neox_optimizer_state(path: str, model_config) -> None:
    """GPT-NeoX's optimizer state covers the same parameters in the same order and groups as this model's
    (megatron.model.checkpoint_layout), except where GPT-NeoX's model has other parameters."""
    reasons = []
    if model_config.gpt_j_residual and model_config.gpt_j_tied:
        reasons.append("with gpt_j_tied GPT-NeoX also optimizes a post_attention_layernorm it never uses, which this "
                       "model does not have")
    if model_config.gpt_j_residual and model_config.model_parallel_size > 1:
        reasons.append("with gpt_j_residual and model_parallel_size > 1 GPT-NeoX's row-parallel biases are one share "
                       "per rank (its optimizer's master weights hold the share, not the bias)")
    if reasons:
        raise CheckpointError(f"the optimizer state of GPT-NeoX checkpoint {path} does not fit this model: "
                              f"{'; '.join(reasons)}. Load its weights only: set finetune: true (or no_load_optim: "
                              f"true to keep its iteration)")


def restore_rng(neox_args, path: Optional[str], client_state: Mapping[str, Any], rng_tracker=None) -> None:
    """Set this process's RNG to what checkpoint ``path`` saved of it (``client_state``: as load_checkpoint
    returned it), unless fine-tuning, no_load_rng or nothing to load. The one place a resume sets the RNG: call it
    where the uninterrupted run stood when it saved, i.e. after whatever setup draws (building the data streams),
    so that the first step draws the noise it drew (megatron.checkpoint.rng_state says which file holds it)."""
    if path is None or neox_args.finetune or neox_args.no_load_rng:
        return
    states = saved_rng_states(path, client_state, process_rank())
    if states is not None:
        set_rng_states(states, rng_tracker)


def load_checkpoint(neox_args, model_config, engine, checkpoint: Optional[FoundCheckpoint]
                    ) -> Tuple[int, Dict[str, Any], Optional[str]]:
    """Load ``checkpoint`` (find_checkpoint's, the RunContext's: found and verified once) into `engine`; returns
    (iteration to continue from, client state, the checkpoint directory loaded). (0, {}, None) when nothing to
    load. The directory is returned so that callers needing it again (DPO / KTO's reference model, restore_rng) do
    not resolve, and so checksum, the checkpoint a second time. The RNG is not set here: restore_rng sets it once,
    where the uninterrupted run stood."""
    if resolve_checkpoint(neox_args, model_config, checkpoint) is None:
        return 0, {}, None

    load_dir, tag = checkpoint.load_dir, checkpoint.tag
    finetune = neox_args.finetune
    # a checkpoint saved with no_save_optim resumes its weights and LR schedule, with the optimizer afresh
    schedule_only = saved_without_optimizer(checkpoint) and not (finetune or neox_args.no_load_optim)
    load_optim = not (neox_args.no_load_optim or finetune or schedule_only)
    if schedule_only and process_rank() == 0:
        print(f"note: checkpoint {checkpoint.path} was saved with no_save_optim (no optimizer state): its weights, "
              f"iteration, LR schedule and data position are loaded and the optimizer starts afresh", flush=True)
    resharded = _load_resharded(neox_args, model_config, engine, checkpoint, load_optim)
    if resharded is not None:
        if not load_optim:
            _master_weights_from_loaded(engine)
        if schedule_only and engine.lr_scheduler is not None and resharded[1].get("lr_scheduler") is not None:
            engine.lr_scheduler.load_state_dict(resharded[1]["lr_scheduler"])
        return (*resharded, os.path.join(load_dir, tag))
    if load_optim and checkpoint.kind == GPT_NEOX:
        _check_gpt_neox_optimizer_state(os.path.join(load_dir, tag), model_config)
    try:
        # a reward model fine-tuned from a language model keeps its new value head and drops the vocabulary head
        lenient = {"load_module_strict": False} if finetune and model_config.value_head else {}
        loaded_path, client_state = engine.load_checkpoint(
            load_dir, tag=tag, load_optimizer_states=load_optim,
            load_lr_scheduler_states=load_optim or schedule_only,
            load_module_only=finetune, **lenient)
    except (RuntimeError, KeyError, OSError, EOFError, ValueError, ZeRORuntimeException) as exc:
        raise CheckpointError(f"checkpoint {os.path.join(load_dir, tag)} could not be loaded: {exc}") from exc
    if loaded_path is None:
        raise CheckpointError(f"DeepSpeed found no checkpoint files in {os.path.join(load_dir, tag)}")
    if not load_optim:
        _master_weights_from_loaded(engine)
    client_state = client_state or {}
    iteration = 0 if finetune else int(client_state.get("iteration", 0))
    return iteration, client_state, os.path.join(load_dir, tag)


def saved_without_optimizer(checkpoint: FoundCheckpoint) -> bool:
    """Whether ``checkpoint`` (of this project) was saved with no_save_optim: weights without optimizer state
    (megatron.checkpoint.weights_only)."""
    args_file = os.path.join(checkpoint.path, ARGS_FILE)
    return checkpoint.kind == OURS and os.path.isfile(args_file) and bool(read_saved_args(args_file).get(
        "no_save_optim"))


def _master_weights_from_loaded(engine) -> None:
    """The fp32 master weights of a 16-bit run taken from the weights just loaded, when the optimizer state was not.
    DeepSpeed does it for ZeRO and for load_module_only, but not for its fp16 / bf16 optimizers without ZeRO, whose
    master weights would stay those of the freshly built model."""
    optimizer = getattr(engine, "optimizer", None)
    if not engine.zero_optimization() and hasattr(optimizer, "refresh_fp32_params"):
        optimizer.refresh_fp32_params()


def _load_resharded(neox_args, model_config, engine, checkpoint: FoundCheckpoint, load_optim: bool
                    ) -> Optional[Tuple[int, Dict[str, Any]]]:
    """(iteration, client state) when ``checkpoint`` of this project was saved with another parallel layout
    (tensor, pipeline, data-parallel size or ZeRO stage) and has been resharded into ``engine``; None when the
    layouts agree (DeepSpeed's engine loads its own files)."""
    path, kind = checkpoint.path, checkpoint.kind
    if kind == GPT_NEOX:  # resolve_checkpoint let another split through for the weights only
        tp, pp = file_layout(path)
        saved = {**neox_args.to_dict(), "model_parallel_size": tp, "pipe_parallel_size": pp}
    elif kind == OURS and os.path.isfile(os.path.join(path, ARGS_FILE)):
        saved = read_saved_args(os.path.join(path, ARGS_FILE))
    else:
        return None
    before, now = layout_of(saved), layout_of(neox_args.to_dict())
    if not needs_resharding(before, now, optimizer_state=load_optim):
        return None
    problem = reference_problem(path, before, now, neox_args.train_impl)
    if problem:
        raise CheckpointError(problem)
    if process_rank() == 0:
        print(f"note: checkpoint {path} was saved with {describe(before)}; resharding its weights"
              f"{' and optimizer state' if load_optim else ''} for this run's {describe(now)}", flush=True)
    iteration, client_state = load_resharded(
        path, saved, model_config, engine, load_optim=load_optim,
        strict=not (neox_args.finetune and model_config.value_head), restore_counters=not neox_args.finetune,
        verified_kind=checkpoint.kind)  # found and verified by find_checkpoint
    return (0 if neox_args.finetune else iteration), client_state
