"""What a checkpoint directory is: its file names, its layout marker, the ``latest`` file, the complete tags, and
reading its text records (neox_args.json, the configs/*.yml) — the ground floor of megatron.checkpoint,
which every other checkpoint module reads through (the layout itself is described in megatron.checkpoint.engine).

Imports no torch: the launcher resolves the checkpoint to resume before any process starts. Reading the .pt
files themselves is megatron.checkpoint.files's job."""
import glob
import json
import os
import re
from typing import Any, Dict, List, Mapping, Optional, Tuple

from megatron.errors import CheckpointError, ConfigError
from megatron.utils.text_files import read_utf8
from megatron.utils.yaml_text import COMMAND_LINE_OVERRIDES_FILE, parse_yaml_text

COMPLETE_MARKER = "COMPLETE"

LATEST_FILE = "latest"

ARGS_FILE = "neox_args.json"

LAYOUT_KEY = "checkpoint_layout"

LAYOUT = "gpt-neox"
"""neox_args.json and the client state record ``checkpoint_layout: gpt-neox``: the files are in GPT-NeoX's
layout. This project's checkpoints without it are in an older layout."""
OURS, OURS_OLD, GPT_NEOX = "this project's", "this project's older layout", "GPT-NeoX's"


UPGRADE_TOOL = "tools/ckpts/upgrade_checkpoint.py"


GPT_NEOX_ARGS = ("num_layers", "hidden_size", "num_attention_heads", "max_position_embeddings",
                 "make_vocab_size_divisible_by", "padded_vocab_size", "tokenizer_type", "model_parallel_size")
"""The `args` GPT-NeoX writes into the client state and its loader asserts equal."""


LAYER_FILE = re.compile(r"layer_(\d+)-model_(\d+)-model_states\.pt$")


MP_FILE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")


EXPERT_FILE = re.compile(r"^layer_(\d+)_expert_(\d+)_mp_rank_(\d+)_model_states\.pt$")
"""DeepSpeed's files of MoE experts (moe_type deepspeed): MoE layer, expert, tensor-parallel rank."""


ARCHITECTURE_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "num_kv_heads", "intermediate_size",
                     "expansion_factor", "mlp_multiple_of", "activation", "norm", "pos_emb", "rotary_pct",
                     "max_position_embeddings", "padded_vocab_size", "no_weight_tying", "gpt_j_residual",
                     "gpt_j_tied", "use_bias_in_norms", "use_bias_in_attn_linear", "use_bias_in_qkv", "use_bias_in_mlp",
                     "use_qk_layernorm", "attention_config", "num_unique_layers", "model_parallel_size",
                     "pipe_parallel_size", "enable_expert_tensor_parallelism")
"""Arguments that must match between a checkpoint and the model loading it."""

LAYOUT_KEYS = ("model_parallel_size", "pipe_parallel_size")


MERGED_ON_READ = ("enable_expert_tensor_parallelism",)
"""Architecture keys of a layout that inference merges on reading (megatron.inference.loading), DeepSpeed's engine not."""


REFERENCE_FILE = "dpo_reference_mp_rank_{:02d}.pt"
"""The frozen reference model of a DPO / KTO run, whole, per tensor-parallel rank (megatron.post_training.reference)."""

RESHARD_KEY = "optimizer_layout"
"""Client-state entry of each rank's model-states file: that rank's tensor / pipeline rank and the names of its
optimizer's parameters, group by group, so that its optimizer state can be resharded (megatron.checkpoint.resharding).
"""


def optimizer_layout(engine) -> Dict[str, Any]:
    """What RESHARD_KEY records for this rank: ``tensor_rank``, ``pipe_rank``, ``param_names`` (the module's
    names of the optimizer's parameters, group by group, in the order of its state dict; None under ZeRO, whose
    own files name them) and ``param_shapes`` (this rank's shape of each parameter, which DeepSpeed's bf16
    optimizer files lack)."""
    grid = getattr(engine, "grid", None)
    if grid is not None:  # DeepSpeed's pipeline engine
        tensor_rank, pipe_rank = grid.get_slice_parallel_rank(), grid.get_pipe_parallel_rank()
    else:
        mpu = getattr(engine, "mpu", None)
        tensor_rank, pipe_rank = (mpu.get_model_parallel_rank() if mpu is not None else 0), 0
    module = getattr(engine, "module", None)
    names = {id(p): n for n, p in module.named_parameters()} if module is not None else {}
    optimizer = getattr(engine, "basic_optimizer", None) or getattr(engine, "optimizer", None)
    groups = [[names.get(id(p)) for p in group["params"]] for group in getattr(optimizer, "param_groups", [])]
    if any(name is None for group in groups for name in group):  # ZeRO's flat partitions: its files name them
        groups = None
    shapes = {n: list(getattr(p, "ds_shape", p.shape)) for n, p in module.named_parameters()} if module else {}
    return {"tensor_rank": tensor_rank, "pipe_rank": pipe_rank, "param_names": groups, "param_shapes": shapes}


LORA_BASE_KEY = "lora_base"
"""The client-state entry of a LoRA run's checkpoint (the adapters only) that points at its base checkpoint
(megatron.checkpoint.lora)."""


def tag_for(iteration: int) -> str:
    return f"global_step{iteration}"


def _outside_tag(tag: str) -> bool:
    """Whether ``tag`` names anything but a directory inside its save directory (an absolute path, a path with
    several parts, `.` or `..`)."""
    separators = {"/", os.sep, os.altsep} - {None}
    return tag in (".", "..") or any(sep in tag for sep in separators)


def read_latest(save_dir: str) -> Optional[str]:
    """The tag `latest` names, or None when there is no checkpoint. A `latest` naming anything but a directory
    inside ``save_dir`` (an absolute path, ../other/global_step3) is a CheckpointError naming the file: followed,
    a run would load another run's state and then overwrite its own complete checkpoints (issue 32)."""
    path = os.path.join(save_dir, LATEST_FILE)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8", errors="replace") as handle:  # random bytes: a name that is no directory
        tag = handle.read().strip() or None
    if tag is not None and _outside_tag(tag):
        raise CheckpointError(f"{path} names {tag[:120]!r}, which is not a directory inside {save_dir}: '{LATEST_FILE}' "
                              f"holds the name of one of its checkpoint directories (such as global_step1000). It "
                              f"was not followed, so that no other directory's checkpoint is loaded and none of this "
                              f"one's is overwritten; write the name of one of {save_dir}'s checkpoints into it, or "
                              f"delete it to resume from the newest complete checkpoint")
    return tag


def _missing_latest_error(load_dir: str, named: str) -> CheckpointError:
    """`latest` names a directory that is not there and no complete checkpoint is left to resume from instead."""
    others = sorted((t for t in os.listdir(load_dir) if tag_iteration(t) >= 0), key=tag_iteration)
    left = f"it holds {', '.join(others)}, none complete" if others else "it holds no other checkpoint"
    return CheckpointError(f"{os.path.join(load_dir, LATEST_FILE)} names {named[:80]!r}, which does not exist in "
                           f"{load_dir} (deleted or moved?), and {left}: there is nothing to resume from. Restore "
                           f"{named[:80]}, set iteration to a checkpoint to load, or delete "
                           f"{os.path.join(load_dir, LATEST_FILE)} to start from scratch")


def tag_iteration(tag: str) -> int:
    suffix = tag[len("global_step"):]
    return int(suffix) if tag.startswith("global_step") and suffix.isdigit() else -1


def complete_tags(save_dir: str) -> List[str]:
    """Complete checkpoints, oldest first (by iteration: global_step10 after global_step9)."""
    if not os.path.isdir(save_dir):
        return []
    tags = [t for t in os.listdir(save_dir) if tag_iteration(t) >= 0
            and os.path.isfile(os.path.join(save_dir, t, COMPLETE_MARKER))]
    return sorted(tags, key=tag_iteration)


def resume_tag(load_dir: str) -> Tuple[Optional[str], Optional[str]]:
    """(tag to resume from, note), the note saying why it is not the one `latest` names.

    `latest` moves only after a checkpoint is COMPLETE, so it normally names the newest complete one. After
    a crash between those two writes, or with `latest` deleted, emptied or damaged, trusting it would
    resume from an older checkpoint or start over, and the run would overwrite complete checkpoints: the
    newest complete checkpoint wins instead. GPT-NeoX's checkpoints have no COMPLETE marker: for them
    `latest` decides. To resume from an older checkpoint on purpose, set `iteration`. A CheckpointError when
    `latest` names a directory outside ``load_dir`` (read_latest), or one that is missing with no complete
    checkpoint to take its place (resuming "from" it would start over, or call a finished run finished)."""
    named = read_latest(load_dir)
    complete = complete_tags(load_dir)
    if named is not None and not complete and not os.path.isdir(os.path.join(load_dir, named)):
        raise _missing_latest_error(load_dir, named)
    if not complete or named == complete[-1]:
        return named, None
    newest = complete[-1]
    if named is None:
        reason = f"'{LATEST_FILE}' is missing or empty"
    elif not os.path.isdir(os.path.join(load_dir, named)):
        reason = f"'{LATEST_FILE}' names {named[:40]!r}, which is not a checkpoint directory"
    elif named in complete:
        reason = f"'{LATEST_FILE}' names the older {named} (a save ended before '{LATEST_FILE}' moved)"
    else:  # an incomplete directory, or a checkpoint without marker: resolve_checkpoint decides
        return named, None
    return newest, (f"resuming from {os.path.join(load_dir, newest)}, the newest complete checkpoint: {reason}; "
                    f"set iteration to resume from another one")


def saved_args(neox_args, model_config) -> Dict[str, Any]:
    """What neox_args.json records: the run's arguments plus the values only known in the workers (the
    padded vocabulary, from the tokenizer) and the layout marker."""
    return {**neox_args.to_dict(), "padded_vocab_size": model_config.padded_vocab_size, LAYOUT_KEY: LAYOUT}


def gpt_neox_client_args(values: Mapping[str, Any], model_config) -> Dict[str, Any]:
    """The `args` of GPT-NeoX's client state for a run with arguments ``values`` (a NeoXArgs dict)."""
    args = {key: values.get(key) for key in GPT_NEOX_ARGS}
    args.update(num_layers=model_config.num_layers, hidden_size=model_config.hidden_size,
                num_attention_heads=model_config.num_attention_heads,
                max_position_embeddings=model_config.positions, padded_vocab_size=model_config.padded_vocab_size,
                model_parallel_size=model_config.model_parallel_size)
    return args


def model_files(path: str) -> List[str]:
    return sorted(glob.glob(os.path.join(path, "*model_states.pt")))


def read_saved_args(args_file: str) -> Dict[str, Any]:
    """A checkpoint's neox_args.json; CheckpointError when it is not a JSON object."""
    with open(args_file, "rb") as handle:
        data = handle.read()
    try:
        saved = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        problem = f"not JSON: not UTF-8 text at byte offset {exc.start}"
    except ValueError as exc:
        problem = f"not JSON: {exc}"
    except RecursionError:
        problem = "nested thousands of levels deep, which no checkpoint is"
    else:
        problem = None
    if problem is not None:
        raise CheckpointError(f"{args_file} is damaged ({problem}); this checkpoint cannot be checked against "
                              f"the config. Restore the file, or set iteration to another checkpoint")
    if not isinstance(saved, dict):
        raise CheckpointError(f"{args_file} is damaged (not a JSON object); restore it, or set iteration to "
                              f"another checkpoint")
    return saved


def file_layout(path: str) -> Tuple[int, int]:
    """(model_parallel_size, pipe_parallel_size) the files of checkpoint ``path`` were written with
    (pipe_parallel_size 0: mp_rank files hold the weights; >= 1: layer files)."""
    files = [os.path.basename(f) for f in model_files(path)]
    layer_ranks = {int(m.group(2)) for m in map(LAYER_FILE.search, files) if m}
    mp_ranks = {int(m.group(1)) for m in map(MP_FILE.search, files) if m}
    if layer_ranks:
        tp = len(layer_ranks)
        return tp, max(len(mp_ranks) // tp, 1)
    return len(mp_ranks), 0


def yaml_values(path: str) -> Dict[str, Any]:
    """The merged values of checkpoint ``path``'s configs/*.yml (GPT-NeoX writes the run's YAML files there;
    deepy.py's --set options, when the run had any, are in COMMAND_LINE_OVERRIDES_FILE, merged last)."""
    values: Dict[str, Any] = {}
    names = sorted(glob.glob(os.path.join(path, "configs", "*")),
                   key=lambda name: (os.path.basename(name) == COMMAND_LINE_OVERRIDES_FILE, name))
    for name in names:
        try:
            values.update(parse_yaml_text(read_utf8(name, lambda message: ConfigError([message])), name))
        except ConfigError as exc:
            raise CheckpointError(str(exc)) from None
    return values


def gpt_neox_mamba_problem(tp: int, attention_types) -> Optional[str]:
    """Why a GPT-NeoX checkpoint with Mamba layers saved at model_parallel_size ``tp`` > 1 cannot load, or None:
    GPT-NeoX's Mamba mixer splits each rank's in_proj rows into x and z and does not sum x_proj's output over
    the ranks (megatron.model.mamba), so its TP > 1 model is another function than the one its weights would
    make here."""
    if tp > 1 and "mamba" in tuple(attention_types):
        return (f"GPT-NeoX's Mamba layers saved at model_parallel_size={tp} compute another function than this "
                f"project's (each rank's in_proj rows split into x and z; x_proj's output not summed over ranks), "
                f"so their weights cannot be loaded; GPT-NeoX checkpoints with Mamba layers load from "
                f"model_parallel_size 1")
    return None


def gpt_neox_qk_norm_problem(use_qk_layernorm: bool, norm: str) -> Optional[str]:
    """Why a GPT-NeoX checkpoint with use_qk_layernorm and norm non_parametric_layernorm cannot load, or None:
    GPT-NeoX's QK layernorm is one norm over [heads, head_dim] shared by queries and keys, this model's q_norm /
    k_norm each normalise one head. With learned norms GPT-NeoX's attention.qk_layernorm tensors are refused when
    the weights load (megatron.model.checkpoint_layout); a norm without parameters leaves no tensor to show it."""
    if use_qk_layernorm and norm == "non_parametric_layernorm":
        return ("GPT-NeoX's use_qk_layernorm normalises queries and keys over all heads at once (one norm over "
                "[heads, head_dim]); this model's normalises each head, another function, and with norm "
                "non_parametric_layernorm no checkpoint tensor tells them apart: a GPT-NeoX checkpoint with "
                "use_qk_layernorm and non_parametric_layernorm cannot be loaded")
    return None


def gpt_neox_gmlp_problem(tp: int, attention_types) -> Optional[str]:
    """Why a GPT-NeoX checkpoint with gMLP / aMLP layers saved at model_parallel_size ``tp`` > 1 cannot load, or
    None: GPT-NeoX normalises each rank's slice of the gate and runs aMLP's attention on each rank's slice, and
    splits input_linear's rows without regard to [residual | gate], so its TP > 1 model is another function
    (megatron.model.gmlp)."""
    if tp > 1 and set(attention_types) & {"gmlp", "amlp"}:
        return (f"GPT-NeoX's gMLP / aMLP layers saved at model_parallel_size={tp} compute another function than "
                f"this project's (the gate norm and aMLP's attention work on each rank's slice of the width), so "
                f"their weights cannot be loaded; GPT-NeoX checkpoints with these layers load from "
                f"model_parallel_size 1")
    return None
