"""The coordinate check (mup's coord_check, Tensor Programs V section D): does muP keep activations the same size
as the model widens?

Models of several widths, built once with the standard parametrization (SP) and once with muP, take a few
optimizer steps on one fixed batch; before every step a forward hook records each module's mean |output|
(the "l1" of its coordinates, the first tensor of a tuple output), and the model's own output as ``logits``.
Under SP the activations (the logits first) grow with the width after a few Adam steps; under muP they stay
flat. ``slopes`` fits log(l1) against log(width): about 0 means flat, 1 means growing like the width.

``write_coord_check`` writes the rows as CSV and JSON (with the slopes of the last step) and a PNG plot (one
panel per parametrization, l1 against width, a line per module) when matplotlib is installed; without it the
plot is refused with a message saying so (returned as ``plot_refused``), never skipped silently.
"""
from __future__ import annotations

import csv
import json
import math
import os
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch import nn

Row = Dict[str, Any]
PARAMETRIZATIONS = ("sp", "mup")
LOGITS = "logits"
PLOT_PACKAGE_HINT = "pip install -r requirements/requirements-mup.txt"


def _first_tensor(output: Any) -> Optional[torch.Tensor]:
    if isinstance(output, (tuple, list)):
        output = output[0] if output else None
    return output if isinstance(output, torch.Tensor) and output.is_floating_point() else None


def _record(model: nn.Module, sink: Dict[str, float]) -> List[Any]:
    """Forward hooks writing each module's mean |output| into ``sink`` (the root's as ``logits``)."""
    handles = []
    for name, module in model.named_modules():
        def hook(_module, _inputs, output, name=name or LOGITS):
            tensor = _first_tensor(output)
            if tensor is not None:
                sink[name] = float(tensor.detach().abs().float().mean())
        handles.append(module.register_forward_hook(hook))
    return handles


def coordinates(model: nn.Module, optimizer: torch.optim.Optimizer, batch, steps: int) -> List[Dict[str, float]]:
    """Per forward (``steps`` + 1 of them: at initialisation, then after each update) the modules' mean |output|."""
    inputs, labels = batch
    model.train()
    records: List[Dict[str, float]] = []
    for step in range(steps + 1):
        sink: Dict[str, float] = {}
        handles = _record(model, sink)
        try:
            loss = model.loss_fn(model(inputs), labels)
        finally:
            for handle in handles:
                handle.remove()
        records.append(sink)
        if step < steps:
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    return records


def coord_check(build: Callable[[int, bool], nn.Module], make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
                batch, widths: Sequence[int], steps: int = 3) -> List[Row]:
    """Rows {parametrization, width, module, step, l1} for every width under SP (``build(width, False)``) and muP
    (``build(width, True)``); ``step`` counts the updates before that forward (0: at initialisation)."""
    rows: List[Row] = []
    for parametrization in PARAMETRIZATIONS:
        for width in widths:
            model = build(int(width), parametrization == "mup")
            records = coordinates(model, make_optimizer(model), batch, steps)
            for step, record in enumerate(records):
                rows += [{"parametrization": parametrization, "width": int(width), "module": module, "step": step,
                          "l1": l1} for module, l1 in record.items()]
            del model
    return rows


def log_slope(widths: Sequence[float], values: Sequence[float]) -> float:
    """Least-squares slope of log(value) against log(width): 0 for a flat curve, 1 for one growing like the width."""
    xs, ys = [math.log(w) for w in widths], [math.log(max(v, 1e-30)) for v in values]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0


def slopes(rows: Sequence[Row], step: Optional[int] = None) -> Dict[str, Dict[str, float]]:
    """parametrization -> module -> slope of log(l1) over log(width) at ``step`` (default: the last)."""
    step = max(r["step"] for r in rows) if step is None else step
    series: Dict[str, Dict[str, Dict[int, float]]] = {}
    for r in rows:
        if r["step"] == step:
            series.setdefault(r["parametrization"], {}).setdefault(r["module"], {})[r["width"]] = r["l1"]
    return {p: {m: log_slope(sorted(v), [v[w] for w in sorted(v)]) for m, v in modules.items() if len(v) > 1}
            for p, modules in series.items()}


def write_coord_check(rows: Sequence[Row], prefix: str) -> Dict[str, str]:
    """``prefix``.csv, .json and .png; returns {kind: path}, with ``plot_refused`` (the reason) instead of ``png``
    when the plot cannot be drawn."""
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    written = {"csv": prefix + ".csv", "json": prefix + ".json"}
    with open(written["csv"], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["parametrization", "width", "module", "step", "l1"])
        writer.writeheader()
        writer.writerows(rows)
    with open(written["json"], "w") as f:
        json.dump({"slopes_last_step": slopes(rows), "rows": list(rows)}, f, indent=1)
    try:
        written["png"] = plot_coord_check(rows, prefix + ".png")
    except ImportError as exc:
        written["plot_refused"] = str(exc)
    return written


def plot_coord_check(rows: Sequence[Row], path: str) -> str:
    """One panel per parametrization: l1 against width (log-log) at the last step, a line per module."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError(f"coord_check: no plot ({path}): matplotlib is not installed ({PLOT_PACKAGE_HINT}); "
                          f"the data is in the .csv and .json beside it") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    last = max(r["step"] for r in rows)
    fig, axes = plt.subplots(1, len(PARAMETRIZATIONS), figsize=(12, 5), sharey=True)
    for ax, parametrization in zip(axes, PARAMETRIZATIONS):
        series: Dict[str, Dict[int, float]] = {}
        for r in rows:
            if r["parametrization"] == parametrization and r["step"] == last:
                series.setdefault(r["module"], {})[r["width"]] = r["l1"]
        for module, values in sorted(series.items()):
            widths = sorted(values)
            ax.plot(widths, [values[w] for w in widths], marker="o", linewidth=1,
                    label=module if module == LOGITS else None, color="black" if module == LOGITS else None)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{'muP' if parametrization == 'mup' else 'standard parametrization'}, after {last} steps")
        ax.set_xlabel("width (hidden_size)")
        ax.legend()
    axes[0].set_ylabel("mean |activation|")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
