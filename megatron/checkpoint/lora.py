"""Checkpoints of a LoRA run (the `lora` section, megatron.model.lora): the adapters only, and where the base is.

A LoRA run saves what trains: its checkpoints hold the adapters' tensors (DeepSpeed's ``exclude_frozen_parameters``)
and the optimizer state of the adapters (the optimizer holds nothing else), with the usual client state, RNG files,
neox_args.json and checksums. Their client state adds ``lora_base``: the base checkpoint the frozen weights come
from — its directory, tag and iteration, and the XXH3-128 digest of its checksum manifest (None for a GPT-NeoX
checkpoint without one), so that a base rewritten since is refused instead of silently giving other weights.

Loading, at the start of a LoRA run (``load_lora_checkpoint``, in place of megatron.checkpoint.engine's
load_checkpoint):
  * ``load`` names a full checkpoint (the base: no ``lora_base``): with ``finetune: true`` its weights load (every
    tensor but the adapters', which start as peft starts them), iteration 0; without it, refused (its optimizer
    state is the full model's).
  * ``load`` names an adapter checkpoint: the base its pointer names is found, verified against its checksums and
    the recorded manifest digest, and its weights loaded; then the adapters, and (unless finetune / no_load_optim)
    their optimizer state, LR schedule and iteration: the run continues as if it had not stopped.
Every load checks its names: a base must give every tensor but the adapters, an adapter checkpoint every adapter.
A base saved with another tensor / pipeline split than the run's is resharded as it loads (``load_base_resharded``:
its full tensors read and each rank's shard cut with megatron.checkpoint.tensor_parallel's rules, into the frozen
parameters, whatever the ZeRO stage; under ZeRO-3, which partitions the frozen base too, the base always loads so,
into its partitions, DeepSpeed reading only its own ZeRO-3 files). The adapters load with the split they
were saved with (their optimizer state is DeepSpeed's files of that split): resume with it."""

import contextlib
import os
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.runtime.zero.utils import ZeRORuntimeException

from megatron.checkpoint.engine import (FoundCheckpoint, _master_weights_from_loaded, _verified_by_rank0,
                                        resolve_checkpoint, saved_without_optimizer)
from megatron.checkpoint.files import checkpoint_kind, read_client_state
from megatron.checkpoint.format import GPT_NEOX, LORA_BASE_KEY, file_layout, model_files, optimizer_layout
from megatron.checkpoint.integrity import file_digest, manifest_of
from megatron.checkpoint.neox_checkpoint import (NeoxCheckpoint, is_zero3, model_config_of, read_args_file,
                                                 read_checkpoint, read_slots, resolve_checkpoint_dir)
from megatron.checkpoint.rng_state import process_rank
from megatron.checkpoint.tensor_parallel import split_full
from megatron.checkpoint.training_state import client_state as saved_client_state
from megatron.checkpoint.training_state import flat_name
from megatron.errors import CheckpointError, ConversionError
from megatron.model.gpt2_model import slot_prefixes
from megatron.model.lora import is_lora_parameter

A_SUFFIX, B_SUFFIX = ".lora.lora_A", ".lora.lora_B"

def base_pointer(checkpoint: FoundCheckpoint) -> Dict[str, Any]:
    """What an adapter checkpoint records of base checkpoint ``checkpoint``."""
    path = checkpoint.path
    manifest = manifest_of(path)
    iteration = read_client_state(path).get("iteration")
    return {"load": os.path.abspath(checkpoint.load_dir), "tag": checkpoint.tag, "iteration": iteration,
            "manifest": manifest, "manifest_digest": file_digest(os.path.join(path, manifest)) if manifest else None}


def adapter_base(path: str) -> Optional[Dict[str, Any]]:
    """The base pointer of checkpoint ``path``; None for a full checkpoint (or one without model-states files)."""
    try:
        return read_client_state(path).get(LORA_BASE_KEY)
    except CheckpointError:
        return None


def base_checkpoint(pointer: Mapping[str, Any], adapters: str, base_dir: Optional[str] = None) -> FoundCheckpoint:
    """The base checkpoint ``pointer`` (of adapter checkpoint ``adapters``) names (``base_dir``: a copy of it moved
    elsewhere, a global_stepN directory), its files verified and its manifest the one recorded; CheckpointError naming
    what is wrong otherwise."""
    path = os.path.normpath(base_dir) if base_dir else os.path.join(pointer["load"], pointer["tag"])
    if not os.path.isdir(path):
        raise CheckpointError(f"adapter checkpoint {adapters} was trained on base checkpoint {path}, which is not "
                              f"there; put the base back at that path (or merge the adapters into a copy of it with "
                              f"tools/ckpts/merge_lora.py --base_dir)")
    damage = _verified_by_rank0(path)
    if damage:
        raise CheckpointError(f"base checkpoint {path} (of adapter checkpoint {adapters}) is damaged: "
                              + "; ".join(damage))
    manifest = manifest_of(path)
    digest = file_digest(os.path.join(path, manifest)) if manifest else None
    if digest != pointer.get("manifest_digest"):
        raise CheckpointError(f"base checkpoint {path} is not the one adapter checkpoint {adapters} was trained on: "
                              f"its {manifest or 'checksum manifest'} digest is {digest}, the adapters recorded "
                              f"{pointer.get('manifest_digest')} (iteration {pointer.get('iteration')}); the base "
                              f"was rewritten or replaced")
    return FoundCheckpoint(load_dir=os.path.dirname(path), tag=os.path.basename(path), kind=checkpoint_kind(path))


@contextlib.contextmanager
def checked_names(engine, wanted: str, path: str) -> Iterator[None]:
    """While DeepSpeed loads ``path`` into ``engine``, load every module state non-strictly and then require:
    ``wanted`` 'base': nothing missing but the adapters; 'adapters': no adapter missing; nothing unexpected."""
    missing: List[str] = []
    unexpected: List[str] = []
    patched = []
    for module in engine.module.modules():
        original = module.load_state_dict

        def lenient(state_dict, strict=True, assign=False, _original=original):
            result = _original(state_dict, strict=False, assign=assign)
            missing.extend(result.missing_keys)
            unexpected.extend(result.unexpected_keys)
            return result

        module.__dict__["load_state_dict"] = lenient
        patched.append(module)
    try:
        yield
    finally:
        for module in patched:
            module.__dict__.pop("load_state_dict", None)
    wrong = [name for name in missing if is_lora_parameter(name) == (wanted == "adapters")]
    if wrong or unexpected:
        what = "adapter tensors" if wanted == "adapters" else "base tensors"
        raise CheckpointError(f"checkpoint {path} does not fit this LoRA model: missing {what} "
                              f"{sorted(wrong)[:6]}{' ...' if len(wrong) > 6 else ''}"
                              + (f"; tensors this model does not have: {sorted(unexpected)[:6]}" if unexpected else ""))


def _same_split(path: str, model_config) -> bool:
    """Whether checkpoint ``path`` was saved with this run's tensor-parallel size and pipeline (or no pipeline)."""
    tp, pp = file_layout(path)
    if tp == 0 and is_zero3(model_files(path)):  # ZeRO-3: no pipeline; its files name the tensor-parallel ranks
        tp = len({name.split("mp_rank_")[1] for name in map(os.path.basename, model_files(path))})
    return tp == model_config.model_parallel_size and (pp >= 1) == model_config.is_pipe_parallel


def _check_adapter_split(path: str, model_config) -> None:
    if not _same_split(path, model_config):
        tp, pp = file_layout(path)
        raise CheckpointError(f"adapter checkpoint {path} was saved with model_parallel_size {tp} and "
                              f"pipe_parallel_size {pp}; a LoRA run resumes its adapters (and their optimizer state) "
                              f"with the split they were saved with (this run: {model_config.model_parallel_size} and "
                              f"{model_config.pipe_parallel_size}). Set those, or merge the adapters into the base "
                              f"(tools/ckpts/merge_lora.py), which any split loads")


def load_base_resharded(engine, model_config, checkpoint: FoundCheckpoint) -> Dict[str, Any]:
    """Base checkpoint ``checkpoint``, saved with another tensor / pipeline split, into ``engine``'s frozen
    parameters: its full tensors (read_checkpoint, already verified), this rank's shard of each; returns its client
    state. The names are checked as ``checked_names`` checks a base: every parameter but the adapters, and no other
    (on one pipeline stage of several: every parameter of this stage's layers)."""
    try:
        state = read_checkpoint(checkpoint.path, verified_kind=checkpoint.kind).state
    except ConversionError as exc:
        raise CheckpointError(str(exc)) from None
    params = {flat_name(name, model_config.num_layers): param for name, param in engine.module.named_parameters()
              if not is_lora_parameter(name)}
    missing, unexpected = sorted(set(params) - set(state)), sorted(set(state) - set(params))
    if getattr(engine.module, "num_stages", 1) > 1:  # the other stages' layers are theirs to take
        unexpected = []
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {checkpoint.path} does not fit this LoRA model: missing base tensors "
                              f"{missing[:6]}{' ...' if len(missing) > 6 else ''}"
                              + (f"; tensors this model does not have: {unexpected[:6]}" if unexpected else ""))
    tp_rank, world = optimizer_layout(engine)["tensor_rank"], model_config.model_parallel_size
    with torch.no_grad():
        for name, param in params.items():
            try:
                shard = split_full(name, state[name], world, model_config)[tp_rank]
            except ConversionError as exc:
                raise CheckpointError(f"base checkpoint {checkpoint.path}: {exc}") from None
            shape = tuple(getattr(param, "ds_shape", param.shape))
            if tuple(shard.shape) != shape:
                raise CheckpointError(f"base checkpoint {checkpoint.path}: {name} has shape {tuple(state[name].shape)}"
                                      f", whose shard {tuple(shard.shape)} does not fit this model's {shape} at "
                                      f"model_parallel_size {world}")
            _assign(param, shard)
    return saved_client_state(checkpoint.path)


def _assign(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """``param`` = ``value``; under ZeRO-3 (a partitioned parameter) gathered whole, set, and partitioned again."""
    if not hasattr(param, "ds_id"):
        param.copy_(value.to(param.dtype))
        return
    source = dist.get_global_rank(param.ds_process_group, 0)  # every rank sets the same value; one broadcasts it
    with deepspeed.zero.GatheredParameters([param], modifier_rank=source):
        param.data.copy_(value.to(param.dtype))


def _zero3(engine) -> bool:
    return any(hasattr(param, "ds_id") for param in engine.module.parameters())


def _load_base(model_config, engine, base: FoundCheckpoint) -> Dict[str, Any]:
    """The base's weights into the engine (resharded when saved with another split); its client state."""
    same = _same_split(base.path, model_config)
    if same and not _zero3(engine):
        return _engine_load(engine, base, "base", True, False, False)
    if process_rank() == 0 and not same:
        tp, pp = file_layout(base.path)
        print(f"note: base checkpoint {base.path} was saved with model_parallel_size {tp} and pipe_parallel_size "
              f"{pp}; resharding its weights for this run's {model_config.model_parallel_size} and "
              f"{model_config.pipe_parallel_size}", flush=True)
    return load_base_resharded(engine, model_config, base)  # ZeRO-3: into its partitions (DeepSpeed reads its own)


def _engine_load(engine, checkpoint: FoundCheckpoint, wanted: str, module_only: bool, load_optim: bool,
                 load_schedule: bool) -> Dict[str, Any]:
    try:
        with checked_names(engine, wanted, checkpoint.path):
            loaded, client_state = engine.load_checkpoint(
                checkpoint.load_dir, tag=checkpoint.tag, load_optimizer_states=load_optim,
                load_lr_scheduler_states=load_schedule, load_module_only=module_only)
    except (RuntimeError, KeyError, OSError, EOFError, ValueError, ZeRORuntimeException) as exc:
        raise CheckpointError(f"checkpoint {checkpoint.path} could not be loaded: {exc}") from exc
    if loaded is None:
        raise CheckpointError(f"DeepSpeed found no checkpoint files in {checkpoint.path}")
    return client_state or {}


def load_lora_checkpoint(neox_args, model_config, engine, checkpoint: Optional[FoundCheckpoint]
                         ) -> Tuple[int, Dict[str, Any], Optional[str]]:
    """megatron.checkpoint.engine.load_checkpoint for a LoRA run (see the module docstring): (iteration to continue
    from, client state, the checkpoint directory loaded). Sets ``engine.lora_base``, the pointer its saves record."""
    if resolve_checkpoint(neox_args, model_config, checkpoint) is None:
        raise CheckpointError(f"lora trains adapters on a base model, but there is no checkpoint to load "
                              f"(load={neox_args.load!r}): set load to the base checkpoint's directory, with "
                              f"finetune: true (tools/ckpts/convert_hf_to_neox.py writes both for a Hugging Face model)")
    path = checkpoint.path
    pointer = adapter_base(path) if checkpoint.kind != GPT_NEOX else None
    if pointer is None:
        if not neox_args.finetune:
            raise CheckpointError(f"lora: load={checkpoint.load_dir} names {path}, a full checkpoint (no adapters): "
                                  f"its optimizer state is the whole model's. To start adapters on it as the base, "
                                  f"set finetune: true")
        client_state = _load_base(model_config, engine, checkpoint)
        _master_weights_from_loaded(engine)
        engine.lora_base = base_pointer(checkpoint)
        return 0, client_state, path
    _check_adapter_split(path, model_config)
    finetune = neox_args.finetune
    schedule_only = saved_without_optimizer(checkpoint) and not (finetune or neox_args.no_load_optim)
    load_optim = not (neox_args.no_load_optim or finetune or schedule_only)
    if not load_optim and _zero3(engine):
        raise CheckpointError(f"lora under ZeRO-3: adapter checkpoint {path} would load without its optimizer state "
                              f"(finetune / no_load_optim), but ZeRO-3 keeps the adapters' weights in that state (its "
                              f"model files hold placeholders), so they would stay at their initial values. Resume "
                              f"with finetune: false and no_load_optim: false, or start from these adapters under "
                              f"ZeRO stage 1 or 2")
    base = base_checkpoint(pointer, path)
    _load_base(model_config, engine, base)
    client_state = _engine_load(engine, checkpoint, "adapters", finetune, load_optim, load_optim or schedule_only)
    if not load_optim:
        _master_weights_from_loaded(engine)
    engine.lora_base = dict(pointer)
    return (0 if finetune else int(client_state.get("iteration", 0))), client_state, path


def read_adapter_checkpoint(path: str) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any], Dict[str, Any], str]:
    """(the adapters' full tensors under flat names, the lora section, the base pointer, the checkpoint directory) of
    adapter checkpoint ``path`` (a global_stepN directory or a save directory with ``latest``)."""
    path = resolve_checkpoint_dir(path)
    args = read_args_file(path)
    pointer = adapter_base(path)
    if not args.get("lora") or pointer is None:
        raise ConversionError(f"{path} is not a LoRA run's adapter checkpoint (its neox_args.json has no lora "
                              f"section, or its client state no {LORA_BASE_KEY}); it is a full checkpoint already")
    tp, pp = file_layout(path)
    config = model_config_of(args, path, model_parallel_size=max(tp, 1), pipe_parallel_size=pp, padded_vocab_size=1)
    prefixes = slot_prefixes(config.num_layers)
    adapters = {}
    for slot, state in read_slots(path, model_files(path), config, tp, pp, None).items():
        adapters.update({prefixes[slot] + name: value for name, value in state.items()})
    others = [name for name in adapters if not name.endswith((A_SUFFIX, B_SUFFIX))]
    if others or not adapters:
        raise ConversionError(f"{path}: an adapter checkpoint holds the adapters only; it holds "
                              f"{others[:4] or 'no tensors'}")
    return adapters, config.lora_dict, pointer, path


def adapted_weights(adapters: Mapping[str, torch.Tensor]) -> List[str]:
    """The base weights' flat names the adapters change."""
    return sorted(name[:-len(A_SUFFIX)] + ".weight" for name in adapters if name.endswith(A_SUFFIX))


def merged_state(state: Mapping[str, torch.Tensor], adapters: Mapping[str, torch.Tensor], lora: Mapping[str, Any]
                 ) -> Dict[str, torch.Tensor]:
    """``state`` (full tensors, flat names) with each adapted weight W replaced by W + (alpha / r) B A."""
    scale = float(lora["alpha"]) / int(lora["r"])
    out = dict(state)
    for weight in adapted_weights(adapters):
        if weight not in out:
            raise ConversionError(f"the base checkpoint has no {weight}, which the adapters change")
        stem = weight[:-len(".weight")]
        a, b = adapters[stem + A_SUFFIX].float(), adapters[stem + B_SUFFIX].float()
        base = out[weight]
        out[weight] = (base.float() + scale * (b @ a)).to(base.dtype)
    return out


def read_base_checkpoint(pointer: Mapping[str, Any], adapters: str, base_dir: Optional[str] = None) -> NeoxCheckpoint:
    """read_checkpoint of the base of adapter checkpoint ``adapters`` (base_checkpoint's, verified)."""
    try:
        found = base_checkpoint(pointer, adapters, base_dir)
    except CheckpointError as exc:
        raise ConversionError(str(exc)) from None
    return read_checkpoint(found.path, verified_kind=found.kind)


def read_model_checkpoint(path: str, verified_kind: Optional[str] = None) -> NeoxCheckpoint:
    """read_checkpoint's merged checkpoint, or for an adapter checkpoint its base with the adapters merged in: what
    generation and evaluation load from a LoRA run's checkpoint."""
    path = resolve_checkpoint_dir(path, verified=verified_kind is not None)  # verified here, once
    kind = verified_kind or checkpoint_kind(path)
    if kind == GPT_NEOX or adapter_base(path) is None:
        return read_checkpoint(path, verified_kind=kind)
    adapters, lora, pointer, path = read_adapter_checkpoint(path)
    base = read_base_checkpoint(pointer, path)
    base.state = merged_state(base.state, adapters, lora)
    return base
