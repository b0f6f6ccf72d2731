"""The coordinate check: after a few Adam steps the activations grow with the width under the standard
parametrization and stay flat under muP (fitted slopes of log mean|x| over log width), through the step train.py
runs with coord_check; its data files, and its plot or the clear refusal of it without matplotlib."""

import csv
import json
import sys
from types import SimpleNamespace

import pytest

from megatron.mpu import SingleProcessState
from megatron.training import mup_run as run
from megatron.mup.coord_check import write_coord_check
from tests.model.helpers import random_batch, tiny_config
from tests.neox_arguments.helpers import tiny

WIDTHS = [32, 64, 128, 256]
WATCHED = ["logits", "sequential.2.attention", "sequential.3.attention", "sequential.3.mlp"]


def test_activations_flat_under_mup_and_growing_under_standard_parametrization(tmp_path, monkeypatch, capsys):
    """train.py's run with save_base_shapes and coord_check (here widths 4 heads x 2^3..2^6 instead of 2^2..2^8)."""
    monkeypatch.setattr(run, "COORD_CHECK_POWERS", range(3, 7))
    path = str(tmp_path / "base.yml")
    config = tiny_config(seq_length=32, hidden_size=32, use_mup=True, mup_attn_temp=0.5)  # SP models drop it
    args = tiny(use_mup=True, save_base_shapes=True, coord_check=True, base_shapes_file=path, hidden_size=32,
                log_dir=str(tmp_path / "logs"), optimizer={"type": "Adam", "params": {"lr": 0.01}})
    ctx = SimpleNamespace(model_config=config, parallel_state=SingleProcessState(), rng_tracker=None)
    summary = run.base_shapes_and_coord_check(args, ctx, lambda: random_batch(4, 32, 128))
    files = summary["mup"]["coord_check"]
    assert summary["mup"]["base_shapes_file"] == path and summary["losses"] == []
    out = capsys.readouterr().out
    assert f"base shapes of hidden_size 32 (delta x2) saved to {path}" in out

    slopes = json.load(open(files["json"]))["slopes_last_step"]
    for module in WATCHED:
        assert abs(slopes["mup"][module]) < 0.35, (module, slopes["mup"][module])
        assert slopes["sp"][module] > 0.6, (module, slopes["sp"][module])
    rows = list(csv.DictReader(open(files["csv"])))
    assert {int(r["width"]) for r in rows} == set(WIDTHS) and {int(r["step"]) for r in rows} == {0, 1, 2, 3}
    assert {r["parametrization"] for r in rows} == {"sp", "mup"}
    # the plot is drawn where matplotlib is installed, else refused with the reason (never silently missing)
    assert ("png" in files and open(files["png"], "rb").read(4) == b"\x89PNG") or \
        ("matplotlib is not installed" in files["plot_refused"] and f"warning: {files['plot_refused']}" in out)


ROWS = [{"parametrization": p, "width": w, "module": "logits", "step": 1, "l1": float(w)}
        for p in ("sp", "mup") for w in (8, 16)]


def test_plot_is_refused_with_the_reason_without_matplotlib(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    files = write_coord_check(ROWS, str(tmp_path / "cc"))
    assert "png" not in files and (tmp_path / "cc.csv").exists() and (tmp_path / "cc.json").exists()
    assert "matplotlib is not installed (pip install -r requirements/requirements-mup.txt)" in files["plot_refused"]
    assert json.load(open(files["json"]))["slopes_last_step"]["sp"]["logits"] == pytest.approx(1.0)


def test_plot_is_written_with_matplotlib(tmp_path):
    pytest.importorskip("matplotlib")
    files = write_coord_check(ROWS, str(tmp_path / "cc"))
    assert open(files["png"], "rb").read(4) == b"\x89PNG"
