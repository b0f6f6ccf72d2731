"""NeoXArgs: every GPT-NeoX argument in one typed dataclass, loaded from YAML, validated, derived.

Life cycle:
  deepy.py:  NeoXArgs.from_ymls(paths)  -> read + merge YAML, map older names, check keys and types,
             derive (world size, batch triple, precision, ...), validate, build the DeepSpeed config;
             args.get_deepspeed_main_args() -> argv for deepspeed.launcher.runner; the whole config
             travels to the workers encoded in one environment variable (launcher.worker_environment).
  workers:   NeoXArgs.consume_neox_args() -> the identical NeoXArgs, plus this process's rank.

NeoXArgs is NeoXArgsSchema (groups/: the union of the group dataclasses, one per section of the argument
reference, so `args.num_layers` works as GPT-NeoX code expects and `dataclasses.fields(NeoXArgs)` lists
every argument) plus this behaviour."""

import argparse
import base64
import dataclasses
import json
import os
import re
import sys
import typing
import warnings
import zlib
from functools import lru_cache
from typing import Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple

from megatron.errors import ConfigError, NeoXConfigWarning
from megatron.utils.yaml_text import COMMAND_LINE_OVERRIDES_FILE
from megatron.model.config import ModelConfig
from megatron.neox_arguments.aliases import apply_aliases
from megatron.neox_arguments.autotuned import is_experiment, read_deepspeed_config, tuned_args
from megatron.neox_arguments.deepspeed_config import (build_deepspeed_config, fold_deepspeed_extra_args,
                                                      note_extra_args_origin)
from megatron.neox_arguments.derivation import (derive_activation_checkpointing, derive_batch, derive_model, derive_moe,
                                                derive_optimizer_and_zero, derive_precision, derive_recompute,
                                                derive_scheduler, derive_world)
from megatron.neox_arguments.groups import NeoXArgsDeepspeedConfig, NeoXArgsSchema
from megatron.neox_arguments.launcher import (ENCODED_CONFIG_ENV, ENCODED_CONFIG_FLAG, deepspeed_runner_argv,
                                              ranks_from_environment)
from megatron.neox_arguments.loading import merge_overrides, normalize_key, read_config_files
from megatron.neox_arguments.overrides import apply_set_options, name_set_options, overrides_file_text
from megatron.neox_arguments.typecheck import coerce, describe
from megatron.neox_arguments.validation import (derived_only_problems, fusion_flag_warnings, lr_schedule_problems,
                                                model_problems, not_supported_problems, not_supported_setting_problems,
                                                online_data_warnings, parallelism_problems, post_training_problems,
                                                rampup_problems, training_problems, unknown_key_problems,
                                                validated_model)
from megatron.utils.process_tree import end_with_parent


class NeoXArgs(NeoXArgsSchema):
    """All arguments; construct with from_ymls / from_dict (which validate), not directly. Once validated
    (and, in a worker, given its rank) they are frozen: run state lives elsewhere (ModelConfig in the run
    context, megatron.training_schedule.TrainingSchedule)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_frozen", False):
            raise AttributeError(f"NeoXArgs are validated and frozen: '{name}' cannot be changed; derive run state "
                                 f"elsewhere (ModelConfig, TrainingSchedule) or build new arguments with from_dict")
        object.__setattr__(self, name, value)

    def freeze(self) -> "NeoXArgs":
        object.__setattr__(self, "_frozen", True)
        return self

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def from_ymls(cls, paths: Sequence[str], overwrite_values: Optional[Mapping[str, Any]] = None,
                  set_options: Sequence[str] = ()) -> "NeoXArgs":
        """Load, merge, validate and derive from YAML files, then `overwrite_values` (deepy.py's own flags) and
        `set_options` (its `--set KEY=VALUE`s, megatron.neox_arguments.overrides) on top; raises ConfigError
        listing every problem."""
        values, origin, texts = read_config_files(paths)
        touched = apply_set_options(values, origin, _defaults(), set_options)
        flagged = {normalize_key(key) for key in overwrite_values or {}}
        if touched & flagged:
            raise ConfigError([f"{origin[key]} and deepy.py's own flag for {key} both set it; give it once"
                               for key in sorted(touched & flagged)])
        values = merge_overrides(values, overwrite_values)
        for key in flagged:
            origin[key] = "the command-line overrides"
        if "config_files" not in values:
            values["config_files"] = dict(texts)
            if touched:
                values["config_files"][COMMAND_LINE_OVERRIDES_FILE] = overrides_file_text(values, touched,
                                                                                          set_options)
        try:
            return cls.from_dict(values, origin=origin)
        except ConfigError as err:
            if not touched:
                raise
            raise ConfigError(name_set_options(err.problems, set_options)) from None

    @classmethod
    def as_given(cls, paths: Sequence[str], overwrite_values: Optional[Mapping[str, Any]] = None,
                 set_options: Sequence[str] = ()) -> "NeoXArgs":
        """The YAML files' values as given, neither validated nor derived: those of known keys with a valid type
        (the rest left at their defaults). For checks that need only what the user wrote (deepy.py's file checks,
        reported beside the problems of a config that from_ymls refuses), `--set` options applied; raises
        ConfigError only for files (or --set options) that cannot be read."""
        values, origin, _texts = read_config_files(paths)
        apply_set_options(values, origin, _defaults(), set_options)
        _problems, clean, _provided, _folded = _typed_values(merge_overrides(values, overwrite_values), origin)
        return cls(**clean).freeze()

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], origin: Optional[Dict[str, str]] = None) -> "NeoXArgs":
        """Validate and derive from a flat dict of arguments (keys with - or _)."""
        problems, clean, provided, folded = _typed_values(values, origin)
        if problems:
            raise ConfigError(problems + _problems_besides(problems, clean, provided, folded))
        args = cls(**clean)
        problems, model = args._derive_and_validate(provided)
        if problems:
            raise ConfigError(note_extra_args_origin(problems, folded))
        for message in fusion_flag_warnings(model) + online_data_warnings(args):
            warnings.warn(message, NeoXConfigWarning, stacklevel=2)
        return args.freeze()

    def _derive_and_validate(self, provided: Set[str]) -> Tuple[List[str], Optional[ModelConfig]]:
        """(every problem, the ModelConfig validation built: one per validation, for the warnings too)."""
        problems = not_supported_problems(self) + not_supported_setting_problems(self)
        problems += derive_precision(self, provided)
        problems += derive_optimizer_and_zero(self, provided)
        problems += derive_scheduler(self, provided)
        problems += derive_world(self)
        problems += derive_batch(self, provided)
        problems += derive_model(self)
        problems += derive_moe(self, provided)
        problems += derive_recompute(self, provided)
        problems += derive_activation_checkpointing(self, provided)
        model = validated_model(self)
        problems += model_problems(self, model)
        problems += training_problems(self)
        problems += lr_schedule_problems(self, provided)
        problems += rampup_problems(self)
        problems += post_training_problems(self)
        problems += parallelism_problems(self)
        if not problems:
            self.deepspeed_config, ds_problems = build_deepspeed_config(self)
            problems += ds_problems
        return problems, model

    # ---- checks that depend on the script or the machine -------------------------------------------
    def training_problems(self) -> List[str]:
        """What train.py needs beyond a valid config (generate.py and eval.py do not need these)."""
        problems = []
        if self.train_iters is None and self.train_epochs is None and self.train_samples is None:
            problems.append("train_iters (or train_samples, or train_epochs) is required for training")
        if self.train_batch_size is None:
            problems.append("no batch size: set train_micro_batch_size_per_gpu (and optionally "
                            "gradient_accumulation_steps or train_batch_size)")
        if self.optimizer is None:
            problems.append("an optimizer dict is required for training, e.g. "
                            "optimizer: {type: Adam, params: {lr: 0.0006, betas: [0.9, 0.95], eps: 1.0e-8}}")
        has_data = self.data_path or self.train_data_paths or (self.dataset_impl == "pairwise"
                                                               and self.pos_train_data_paths) \
            or self.dataset_impl == "online"  # rollouts from the online data server
        if not has_data:
            problems.append("no training data: set data_path (or train_data_paths, valid_data_paths and "
                            "test_data_paths)")
        return problems

    # ---- launching ----------------------------------------------------------------------------
    def get_deepspeed_main_args(self) -> List[str]:
        """argv for deepspeed.launcher.runner: launcher options, the user script, the encoded config."""
        return deepspeed_runner_argv(self)

    def encode(self) -> str:
        """The whole config as one command-line-safe string."""
        payload = json.dumps(self.to_dict(), sort_keys=True).encode("utf-8")
        return base64.urlsafe_b64encode(zlib.compress(payload, 9)).decode("ascii")

    @classmethod
    def decode(cls, encoded: str) -> "NeoXArgs":
        """Inverse of encode(): the identical, already validated and derived arguments."""
        try:
            values = json.loads(zlib.decompress(base64.urlsafe_b64decode(encoded.encode("ascii"))))
        except (ValueError, zlib.error) as exc:
            raise ConfigError([f"{ENCODED_CONFIG_FLAG} / {ENCODED_CONFIG_ENV} is not a config encoded by deepy.py "
                               f"({exc}); launch workers through deepy.py"]) from None
        unknown = set(values) - set(argument_types())
        if unknown:
            raise ConfigError([f"the encoded config has arguments this version does not know: {sorted(unknown)}; "
                               f"deepy.py and the workers must run the same code"])
        return cls(**values)

    @classmethod
    def consume_neox_args(cls, argv: Optional[Sequence[str]] = None,
                          environ: Optional[Mapping[str, str]] = None) -> "NeoXArgs":
        """In a worker: rebuild the launcher's NeoXArgs (from ENCODED_CONFIG_FLAG, else the ENCODED_CONFIG_ENV
        variable deepy.py sets) and fill this process's rank from the environment. In a DeepSpeed autotuning
        experiment, `--deepspeed_config` (the experiment's config) sets the batch and ZeRO settings. A worker
        started by a launcher (``environ`` not given) ends with it (megatron.utils.process_tree)."""
        if environ is None:
            end_with_parent()
        parser = argparse.ArgumentParser(add_help=False)
        parser.add_argument(ENCODED_CONFIG_FLAG, default=None)
        parser.add_argument("--local_rank", type=int, default=None)
        parser.add_argument("--deepspeed_config", default=None)  # an autotuning experiment's (autotuning.py)
        known, rest = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
        env = os.environ if environ is None else environ
        encoded = known.neox_config or env.get(ENCODED_CONFIG_ENV)
        if not encoded:
            script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "train.py"
            configs = " ".join(a for a in rest if not a.startswith("-")) or "CONFIG.yml"
            raise ConfigError([f"{script} is a worker script and received no config: start it through deepy.py, "
                               f"which validates the config and launches the workers: "
                               f"python deepy.py {script} {configs}"])
        args = cls.decode(encoded)
        if known.deepspeed_config is not None:
            ds_config = read_deepspeed_config(known.deepspeed_config)
            args = tuned_args(args, ds_config, experiment=is_experiment(ds_config))
        elif args.autotuning_run is not None:
            raise ConfigError([f"this config has autotuning_run={args.autotuning_run!r}: its workers are DeepSpeed "
                               f"autotuning experiments, which the autotuner starts with --deepspeed_config; launch "
                               f"through deepy.py"])
        rank, local_rank, world_size = ranks_from_environment(env, args.deepspeed_slurm, args.deepspeed_mpi)
        args.rank = rank
        args.local_rank = local_rank if local_rank is not None else known.local_rank
        if world_size is not None:
            args.world_size = world_size
            if args.global_num_gpus is not None and world_size != args.global_num_gpus:
                raise ConfigError([f"the launcher started {world_size} processes but the config was derived for "
                                   f"global_num_gpus={args.global_num_gpus}; pass the same hostfile / num_gpus to "
                                   f"deepy.py that the cluster provides"])
        return args.freeze()

    # ---- conversions --------------------------------------------------------------------------
    def to_dict(self) -> Dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def _typed_values(values: Mapping[str, Any], origin: Optional[Dict[str, str]] = None
                  ) -> Tuple[List[str], Dict[str, Any], Set[str], Dict[str, Any]]:
    """(problems with the keys and types, the values of known keys that have a valid type, the known keys given,
    the keys folded in from deepspeed_extra_args): the first step of from_dict."""
    values = {normalize_key(k): v for k, v in values.items()}
    origin = dict(origin or {})
    problems = apply_aliases(values, origin)
    known = set(argument_types())
    deepspeed_group = [f.name for f in dataclasses.fields(NeoXArgsDeepspeedConfig)]
    folded_problems, folded = fold_deepspeed_extra_args(values, origin, deepspeed_group, known)
    problems += folded_problems
    problems += unknown_key_problems(values, known, origin)
    provided = set(values) & known
    problems += derived_only_problems(provided)
    clean: Dict[str, Any] = {}
    for key in sorted(provided):
        ok, value = coerce(values[key], argument_types()[key])
        if ok:
            clean[key] = value
        else:
            where = f" (in {origin[key]})" if key in origin else ""
            problems.append(f"{key}={values[key]!r}{where} must be {describe(argument_types()[key])}")
    return problems, clean, provided, folded


def _problems_besides(first: List[str], clean: Dict[str, Any], provided: Set[str],
                      folded: Mapping[str, Any]) -> List[str]:
    """The derivation and validation problems of the values that are fine, reported with the type errors and
    unknown keys `first` so that one round shows them all: those that mention a key named in `first` (its
    value was dropped, so what validation says about it is noise) are left out."""
    mentioned = {name for name in argument_types() for p in first if re.search(rf"\b{name}\b", p)}
    try:
        args = NeoXArgs(**clean)
        later, _ = args._derive_and_validate(provided & set(clean))
    except Exception:  # a dropped value that derivation cannot do without: the first problems are the story
        return []
    later = note_extra_args_origin(later, folded)
    return [p for p in later if not any(re.search(rf"\b{name}\b", p) for name in mentioned)]


def _defaults() -> Dict[str, Any]:
    """Each argument's default value (a fresh one where the field has a default factory)."""
    return {f.name: f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            for f in dataclasses.fields(NeoXArgsSchema)}


@lru_cache(maxsize=None)
def _resolved_types() -> Dict[str, Any]:
    return typing.get_type_hints(NeoXArgs)


def argument_types() -> Dict[str, Any]:
    """Every argument name with its annotation."""
    return _resolved_types()
