"""Helpers for end-to-end training tests: a tiny corpus and tokenizer, configs, and deepy.py runs."""

import itertools
import json
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import yaml

from tests.e2e.launch import free_port, run_deepy

TINY_MODEL: Dict[str, Any] = {
    "num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 32,
    "max_position_embeddings": 32, "pos_emb": "rotary", "norm": "layernorm", "activation": "gelu",
    "no_weight_tying": False, "make_vocab_size_divisible_by": 8,
    "optimizer": {"type": "Adam", "params": {"lr": 3.0e-3, "betas": [0.9, 0.95], "eps": 1.0e-8}},
    "min_lr": 3.0e-4, "lr_decay_style": "cosine", "warmup": 0.1, "weight_decay": 0.01,
    "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0,
    "hidden_dropout": 0.0, "attention_dropout": 0.0,
    "split": "90,8,2", "num_workers": 0, "eval_iters": 2, "eval_interval": 1000,
    "log_interval": 1, "steps_per_print": 1000, "seed": 1234, "distributed_backend": "gloo",
}


def build_tiny_corpus(directory: Path, num_files: int = 60, vocab_size: int = 384) -> Dict[str, str]:
    """A few stdlib sources -> byte-level BPE -> .bin/.idx; returns data_path and vocab_file."""
    from megatron.data.corpora import iter_stdlib_texts
    from megatron.data.document_readers import iter_documents, write_jsonl
    from megatron.data.preprocessing import TextEncoderSpec, write_indexed_datasets
    from megatron.tokenizer.training import save_tokenizer, train_byte_level_bpe

    directory.mkdir(parents=True, exist_ok=True)
    texts = list(itertools.islice(iter_stdlib_texts(), num_files))
    jsonl = directory / "corpus.jsonl"
    write_jsonl(jsonl, texts)
    vocab_file = directory / "tokenizer.json"
    save_tokenizer(train_byte_level_bpe(texts, vocab_size=vocab_size), vocab_file)
    spec = TextEncoderSpec("HFTokenizer", str(vocab_file), None, ("text",), append_eod=True, vocab_size=vocab_size)
    write_indexed_datasets(iter_documents([str(jsonl)], ("text",)), spec, str(directory / "corpus"), workers=1,
                           progress=False, log=lambda _msg: None)
    return {"data_path": str(directory / "corpus_text_document"), "vocab_file": str(vocab_file),
            "tokenizer_type": "HFTokenizer"}


class TrainingRun:
    """One deepy.py train.py run in its own directory."""

    def __init__(self, directory: Path, data: Dict[str, str], **overrides: Any) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.config: Dict[str, Any] = {**TINY_MODEL, **data, "save": str(directory / "ckpt"),
                                       "load": str(directory / "ckpt"), "log_dir": str(directory / "logs"),
                                       **overrides}
        self.result = None

    def launch(self, timeout: int = 600, extra_env: Optional[Dict[str, str]] = None, script: str = "train.py",
               runner: Optional[Callable[..., Any]] = None, **overrides: Any):
        """Write the config and run `deepy.py script config --master_port N` through `runner` (default
        run_deepy: a subprocess on this machine; the multi-node tests pass their cluster's)."""
        config = {**self.config, **overrides}
        path = self.directory / f"config{len(list(self.directory.glob('config*.yml')))}.yml"
        path.write_text(yaml.safe_dump(config))
        self.result = (runner or run_deepy)([script, str(path), "--master_port", str(free_port())],
                                            extra_env=extra_env, timeout=timeout)
        return self.result

    def resumed_from(self, iteration: int, directory: Path, **overrides: Any) -> "TrainingRun":
        """A run in ``directory`` that resumes from this run's checkpoint at ``iteration`` (saving in its own
        directory): one launch instead of stopping and relaunching, where the straight run saved at ``iteration``
        on its way (saving does not change what a run computes after it)."""
        config = {key: value for key, value in self.config.items()
                  if key not in ("save", "load", "log_dir", "iteration")}
        return TrainingRun(directory, {}, **{**config, "load": str(self.directory / "ckpt"), "iteration": iteration,
                                             "save": str(directory / "ckpt"), "log_dir": str(directory / "logs"),
                                             **overrides})

    def assert_ok(self) -> None:
        assert self.result is not None and self.result.returncode == 0, \
            (self.result.stdout[-6000:] + "\n" + self.result.stderr[-6000:])

    def records(self, kind: str = "train") -> List[Dict[str, Any]]:
        path = self.directory / "logs" / "metrics.jsonl"
        with open(path, encoding="utf-8") as handle:
            rows = [json.loads(line) for line in handle if line.strip()]
        return [r for r in rows if r.get("type") == kind]

    def losses(self) -> Dict[int, float]:
        """iteration -> training loss, the last record winning (a resumed run appends to the same file)."""
        return {r["iteration"]: r["lm_loss"] for r in self.records("train")}

    def checkpoints(self) -> List[str]:
        ckpt = self.directory / "ckpt"
        return sorted(p.name for p in ckpt.iterdir() if p.is_dir()) if ckpt.is_dir() else []

    def latest(self) -> Optional[str]:
        path = self.directory / "ckpt" / "latest"
        return path.read_text().strip() if path.is_file() else None


def falls(losses: Dict[int, float], by: float = 0.2) -> bool:
    """The mean of the last three losses is below the first loss by `by` nats."""
    values = [losses[k] for k in sorted(losses)]
    return sum(values[-3:]) / 3 < values[0] - by
