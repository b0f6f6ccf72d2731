"""DeepSpeed's `data_efficiency` config section (its Data Efficiency library): what is on, the rules of its
`data_sampling` part and the section as DeepSpeed's engine gets it. No torch: deepy.py checks a config with it.

    data_efficiency:
      enabled: true
      seed: 1234
      data_sampling:            # curriculum learning by offline-analysed difficulty (megatron.data.difficulty)
        enabled: true
        num_epochs: 1
        curriculum_learning:
          enabled: true
          data_cluster_path: data/clusters
          curriculum_metrics:
            vocab_rarity: {index_to_sample_path: ..., index_to_metric_path: ..., difficulty_type: value,
                           clustering_type: schedule_based, min_difficulty: ..., max_difficulty: ...,
                           schedule_type: fixed_linear, schedule_config: {total_curriculum_step: 100,
                                                                         difficulty_step: 1}}
      data_routing:             # random layerwise token dropping (megatron.model.random_ltd_settings)
        enabled: true
        random_ltd: {...}

A part is on when it and every section above it say `enabled: true` (DeepSpeed's engine reads the innermost
flag alone, so the section it gets has the inner flags of a switched-off part cleared: deepspeed_section).

This project's own `curriculum_learning` (curriculum_type seqlen, megatron.data.curriculum) is a different
thing: it cuts every sample to a scheduled length. The two run together unless both schedule the sequence length
(a `seqlen` metric here), which is refused.
"""
from __future__ import annotations

import copy
import os
from typing import Any, Dict, List, Mapping, Optional

from megatron.data.curriculum import SCHEDULE_KEYS

METRICS = {
    "seqlen": "tokens of the sample before padding (samples packed to seq_length all have seq_length + 1)",
    "vocab_rarity": "mean over the sample's tokens of -log p(token), p the token's frequency in the analysed "
                    "data, in thousandths of a nat (Megatron-DeepSpeed's vocabulary rarity, as a per-token mean)",
}
"""The difficulty metrics tools/datasets/analyze_difficulty.py computes (megatron.data.difficulty)."""

TOP_KEYS = ("enabled", "seed", "data_sampling", "data_routing")
SAMPLING_KEYS = ("enabled", "num_epochs", "num_workers", "pin_memory", "curriculum_learning")
CURRICULUM_KEYS = ("enabled", "data_cluster_path", "curriculum_metrics")
METRIC_KEYS = ("index_to_sample_path", "index_to_metric_path", "difficulty_type", "clustering_type",
               "min_difficulty", "max_difficulty", "schedule_type", "schedule_config")
DIFFICULTY_TYPES = ("value", "percentile")
CLUSTERING_TYPES = ("schedule_based", "single_cluster")
WHERE = "data_efficiency"
CURRICULUM_WHERE = f"{WHERE}.data_sampling.curriculum_learning"


def _on(section: Any) -> bool:
    return isinstance(section, Mapping) and section.get("enabled", False) is True


def enabled(section: Optional[Mapping[str, Any]]) -> bool:
    """The whole section is on (DeepSpeed's default for `enabled` is false)."""
    return _on(section)


def sampling_enabled(section: Optional[Mapping[str, Any]]) -> bool:
    """Curriculum sampling by analysed difficulty is on."""
    return enabled(section) and _on(section.get("data_sampling")) and \
        _on(section["data_sampling"].get("curriculum_learning"))


def routing_section(section: Optional[Mapping[str, Any]]) -> Optional[Mapping[str, Any]]:
    """The random_ltd section when random layerwise token dropping is on, else None."""
    if not enabled(section) or not _on(section.get("data_routing")):
        return None
    random_ltd = section["data_routing"].get("random_ltd")
    return random_ltd if _on(random_ltd) else None


def metrics(section: Mapping[str, Any]) -> Dict[str, Mapping[str, Any]]:
    """{metric name: its settings} of an enabled curriculum (sampling_enabled)."""
    return dict(section["data_sampling"]["curriculum_learning"].get("curriculum_metrics") or {})


def _unknown(keys: Any, known: tuple, where: str) -> List[str]:
    return [f"{where}.{key}: unknown key; the keys are {', '.join(known)}" for key in keys if key not in known]


def structure_problems(section: Any) -> List[str]:
    """Unknown keys and non-dict parts anywhere above the metrics and the random_ltd keys."""
    if section is None:
        return []
    if not isinstance(section, Mapping):
        return [f"{WHERE} must be a dict (DeepSpeed's data_efficiency section), got {section!r}"]
    problems = _unknown(section, TOP_KEYS, WHERE)
    for part, keys, inner in (("data_sampling", SAMPLING_KEYS, "curriculum_learning"),
                              ("data_routing", ("enabled", "random_ltd"), "random_ltd")):
        value = section.get(part)
        if value is None:
            continue
        if not isinstance(value, Mapping):
            problems.append(f"{WHERE}.{part} must be a dict, got {value!r}")
            continue
        problems += _unknown(value, keys, f"{WHERE}.{part}")
        child = value.get(inner)
        if child is not None and not isinstance(child, Mapping):
            problems.append(f"{WHERE}.{part}.{inner} must be a dict, got {child!r}")
    return problems


def sampling_problems(section: Any, seqlen_curriculum_on: bool, train_impl: str, dataset_impl: str,
                      pipe_parallel_size: int, batch_rampup: bool) -> List[str]:
    """What is wrong with an enabled data_sampling curriculum (DeepSpeed's asserts, as messages naming the key).
    The analysis files themselves are checked before launch (analysis_file_problems)."""
    if not sampling_enabled(section):
        return []
    sampling = section["data_sampling"]
    curriculum = sampling["curriculum_learning"]
    problems = _unknown(curriculum, CURRICULUM_KEYS, CURRICULUM_WHERE)
    for key in ("num_epochs",):
        value = sampling.get(key, 1)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            problems.append(f"{WHERE}.data_sampling.{key}={value!r} must be a positive integer")
    if sampling.get("num_workers", 0) not in (0, None):
        problems.append(f"{WHERE}.data_sampling.num_workers={sampling['num_workers']!r}: the loader's workers are "
                        f"num_workers (the top-level key) here; delete it")
    if not isinstance(curriculum.get("data_cluster_path"), str) or not curriculum["data_cluster_path"]:
        problems.append(f"{CURRICULUM_WHERE}.data_cluster_path must be a directory path (DeepSpeed's sampler writes "
                        f"the clusters of samples of each difficulty there)")
    found = curriculum.get("curriculum_metrics")
    if not isinstance(found, Mapping) or not found:
        problems.append(f"{CURRICULUM_WHERE}.curriculum_metrics must be a dict of one or more metrics "
                        f"({', '.join(METRICS)}) with their settings")
        found = {}
    for name, settings in found.items():
        problems += metric_problems(name, settings)
    if seqlen_curriculum_on and "seqlen" in found:
        problems.append(f"curriculum_learning (sequence-length warmup, curriculum_type seqlen) and "
                        f"{CURRICULUM_WHERE}.curriculum_metrics.seqlen both schedule the sequence length: use one "
                        f"(curriculum_learning cuts every sample to the scheduled length; the seqlen metric picks "
                        f"samples that are short already)")
    if train_impl != "normal" or dataset_impl != "gpt2":
        problems.append(f"{CURRICULUM_WHERE} with train_impl={train_impl!r} / dataset_impl={dataset_impl!r}: the "
                        f"analysed samples are language-modelling samples (train_impl 'normal', dataset_impl 'gpt2')")
    if pipe_parallel_size > 1:
        problems.append(f"{CURRICULUM_WHERE} with pipe_parallel_size={pipe_parallel_size}: DeepSpeed's sampler "
                        f"broadcasts each batch from global rank 0 over the data-parallel group, which the last "
                        f"pipeline stage's ranks (they read the labels) are not in; use pipe_parallel_size <= 1")
    if batch_rampup:
        problems.append(f"{CURRICULUM_WHERE} with rampup_batch_size: DeepSpeed's sampler draws fixed global "
                        f"batches (train_batch_size); remove one of them")
    return problems


def metric_problems(name: str, settings: Any) -> List[str]:
    """One curriculum metric's settings (DeepSpeed's CurriculumScheduler and DeepSpeedDataSampler)."""
    where = f"{CURRICULUM_WHERE}.curriculum_metrics.{name}"
    if name not in METRICS:
        return [f"{where}: unknown metric {name!r}; tools/datasets/analyze_difficulty.py computes "
                f"{', '.join(METRICS)}"]
    if not isinstance(settings, Mapping):
        return [f"{where} must be a dict of {', '.join(METRIC_KEYS)}"]
    problems = _unknown(settings, METRIC_KEYS, where)
    difficulty, clustering = settings.get("difficulty_type"), settings.get("clustering_type", "schedule_based")
    if difficulty not in DIFFICULTY_TYPES:
        problems.append(f"{where}.difficulty_type={difficulty!r} must be one of {', '.join(DIFFICULTY_TYPES)}")
    if clustering != "schedule_based":
        problems.append(f"{where}.clustering_type={clustering!r}: only schedule_based is built (single_cluster "
                        f"leaves the curriculum to a data post-processing step this project does not have)")
    needed = ["index_to_sample_path"] + (["index_to_metric_path"] if difficulty == "value" else [])
    merged = "_percentile_merged" if difficulty == "percentile" else ""
    problems += [f"{where}.{key} is missing: the analysis files tools/datasets/analyze_difficulty.py wrote "
                 f"(<save-path>/{name}/{name}_{key[:-5]}{merged if key == 'index_to_sample_path' else ''})"
                 for key in needed if not isinstance(settings.get(key), str)]
    low, high = settings.get("min_difficulty"), settings.get("max_difficulty")
    for key, value in (("min_difficulty", low), ("max_difficulty", high)):
        if not isinstance(value, int) or isinstance(value, bool):
            problems.append(f"{where}.{key}={value!r} must be an integer (a metric value, or a percentile with "
                            f"difficulty_type percentile)")
    if isinstance(low, int) and isinstance(high, int):
        if low > high:
            problems.append(f"{where}.min_difficulty={low} must be <= max_difficulty={high}")
        if difficulty == "percentile" and not 1 <= low <= high <= 100:
            problems.append(f"{where}: percentiles min_difficulty={low}, max_difficulty={high} must be in 1..100")
    schedule = settings.get("schedule_type")
    if schedule not in SCHEDULE_KEYS:
        extra = " ('custom' needs a Python schedule function, which a config cannot give)" \
            if schedule == "custom" else ""
        return problems + [f"{where}.schedule_type={schedule!r} must be one of {', '.join(SCHEDULE_KEYS)}{extra}"]
    config = settings.get("schedule_config")
    missing = [key for key in SCHEDULE_KEYS[schedule] if not isinstance(config, Mapping) or key not in config]
    if missing:
        problems.append(f"{where}.schedule_config lacks {', '.join(missing)} (needed by schedule_type {schedule!r})")
    return problems


def analysis_files(section: Optional[Mapping[str, Any]]) -> List[tuple]:
    """[(key, path prefix)] of the analysis files an enabled curriculum reads."""
    if not sampling_enabled(section):
        return []
    out = []
    for name, settings in metrics(section).items():
        if not isinstance(settings, Mapping):
            continue
        keys = ["index_to_sample_path"] + (["index_to_metric_path"] if settings.get("difficulty_type") == "value"
                                           else [])
        out += [(f"{CURRICULUM_WHERE}.curriculum_metrics.{name}.{key}", settings[key]) for key in keys
                if isinstance(settings.get(key), str)]
    return out


def analysis_file_problems(section: Optional[Mapping[str, Any]]) -> List[str]:
    """Analysis files (.bin/.idx) that are not there, each named with its key and the command that writes them."""
    return [f"{key}: '{path}' (.bin/.idx) not found; write it with tools/datasets/analyze_difficulty.py over the "
            f"same config (it analyses the training split this config builds)"
            for key, path in analysis_files(section)
            if not (os.path.isfile(f"{path}.bin") and os.path.isfile(f"{path}.idx"))]


def deepspeed_section(section: Optional[Mapping[str, Any]], random_ltd: Optional[Dict[str, Any]]) -> \
        Optional[Dict[str, Any]]:
    """The section as DeepSpeed's engine gets it, None when off: the inner `enabled` flags of switched-off parts
    cleared (the engine reads those alone), and random_ltd as megatron.model.random_ltd_settings completed it."""
    if not enabled(section):
        return None
    out = copy.deepcopy(dict(section))
    sampling = out.get("data_sampling")
    if isinstance(sampling, dict) and isinstance(sampling.get("curriculum_learning"), dict) and \
            not sampling_enabled(section):
        sampling["curriculum_learning"]["enabled"] = False
    routing = out.get("data_routing")
    if isinstance(routing, dict) and isinstance(routing.get("random_ltd"), dict):
        routing["random_ltd"] = random_ltd if random_ltd is not None else {**routing["random_ltd"], "enabled": False}
    return out
