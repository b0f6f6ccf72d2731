"""Local lm-eval tasks built from local JSONL (no hub): multiple choice, loglikelihood, rolling
loglikelihood and generate_until, from lines of the Python standard library's sources."""
import itertools
import json
import random
from pathlib import Path
from typing import Dict, List

import yaml

TASKS = ("neox_mc_local", "neox_ll_local", "neox_rolling_local", "neox_gen_local")


def _lines(count: int) -> List[str]:
    from megatron.data.corpora import iter_stdlib_texts

    lines = []
    for text in itertools.islice(iter_stdlib_texts(), 40):
        lines += [line.strip() for line in text.splitlines() if 12 <= len(line.strip()) <= 60]
    random.Random(0).shuffle(lines)
    return lines[:count]


def _write_jsonl(path: Path, rows: List[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path.resolve())


def write_local_tasks(directory: Path, docs: int = 12) -> Dict[str, Path]:
    """Four task YAML files (and their JSONL) in ``directory``; returns task name -> YAML path."""
    directory.mkdir(parents=True, exist_ok=True)
    lines = _lines(docs * 6)
    mc_rows, ll_rows, rolling_rows, gen_rows = [], [], [], []
    for i in range(docs):
        line, others = lines[i], lines[docs + 3 * i: docs + 3 * i + 3]
        cut = len(line) // 2
        choices = [line[cut:]] + [o[len(o) // 2:] for o in others]
        random.Random(i).shuffle(choices)
        mc_rows.append({"question": line[:cut], "choices": choices, "label": choices.index(line[cut:])})
        # a long context (over the 32-token window) checks the left truncation on some rows
        context = " ".join(lines[4 * docs + i: 4 * docs + i + (4 if i % 3 == 0 else 1)])
        ll_rows.append({"context": context, "continuation": " " + lines[5 * docs + i][:24]})
        rolling_rows.append({"text": " ".join(lines[i: i + (5 if i % 4 == 0 else 1)])})
        gen_rows.append({"context": line[:cut], "answer": line[cut:]})
    data = {name: _write_jsonl(directory / f"{name}.jsonl", rows) for name, rows in
            zip(TASKS, (mc_rows, ll_rows, rolling_rows, gen_rows))}
    base = lambda name: {"task": name, "dataset_path": "json", "test_split": "test",
                         "dataset_kwargs": {"data_files": {"test": data[name]}}}
    configs = {
        "neox_mc_local": {"output_type": "multiple_choice", "doc_to_text": "{{question}}",
                          "doc_to_choice": "{{choices}}", "doc_to_target": "label",
                          "metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}]},
        "neox_ll_local": {"output_type": "loglikelihood", "doc_to_text": "{{context}}",
                          "doc_to_target": "{{continuation}}",
                          "metric_list": [{"metric": "perplexity"}, {"metric": "acc"}]},
        "neox_rolling_local": {"output_type": "loglikelihood_rolling", "doc_to_text": "",
                               "doc_to_target": "{{text}}",
                               "metric_list": [{"metric": "word_perplexity"}, {"metric": "bits_per_byte"}]},
        "neox_gen_local": {"output_type": "generate_until", "doc_to_text": "{{context}}",
                           "doc_to_target": "{{answer}}",
                           "generation_kwargs": {"until": ["\n"], "max_gen_toks": 6, "do_sample": False},
                           "metric_list": [{"metric": "exact_match"}]},
    }
    paths = {}
    for name, config in configs.items():
        paths[name] = directory / f"{name}.yaml"
        paths[name].write_text(yaml.safe_dump({**base(name), **config}))
    return paths


def scores(results: dict) -> Dict[str, float]:
    """{"task/metric": value} of an lm-eval results dict (stderr left out)."""
    out = {}
    for task, values in results["results"].items():
        for key, value in values.items():
            if isinstance(value, (int, float)) and "stderr" not in key:
                out[f"{task}/{key.split(',')[0]}"] = float(value)
    return out
