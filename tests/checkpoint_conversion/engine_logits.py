"""Logits of a checkpoint as generate.py / eval.py compute them, through deepy.py and
workers/logits_worker.py (megatron.inference.loading's load path)."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch
import yaml

from tests.e2e.launch import free_port, run_deepy

WORKER = "tests/checkpoint_conversion/workers/logits_worker.py"
RUNTIME = {"distributed_backend": "gloo"}
"""What the worker needs besides the model config: no batch size, optimizer or iterations (inference
loads weights only), just the launch."""


def runtime_config(workdir: Path, num_gpus: int = 2) -> Path:
    """A YAML file with RUNTIME, for configs that describe only the model (convert_hf_to_neox's)."""
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "runtime.yml"
    path.write_text(yaml.safe_dump({**RUNTIME, "num_gpus": num_gpus, "log_dir": str(workdir / "logs")}))
    return path


def engine_logits(configs: Sequence[Path], tokens: torch.Tensor, workdir: Path) -> torch.Tensor:
    """Launch the worker on ``configs``; returns the full [batch, seq, vocab] logits."""
    workdir.mkdir(parents=True, exist_ok=True)
    torch.save(tokens, workdir / "tokens.pt")
    out = workdir / "logits.pt"
    result = run_deepy([WORKER, *map(str, configs), "--master_port", str(free_port())],
                       extra_env={"CONVERT_TOKENS": str(workdir / "tokens.pt"), "CONVERT_LOGITS_OUT": str(out)})
    assert result.returncode == 0 and out.is_file(), result.stdout[-4000:] + "\n" + result.stderr[-6000:]
    return torch.load(out)
