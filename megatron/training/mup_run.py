"""muP in train.py: base shapes for the model being trained, and the two runs that stop instead of training.

* ``prepare_model``: with use_mup, read base_shapes_file, attach each parameter's InfShape and turn the fresh
  initialisation into muP's (megatron.mup.parametrization); the optimizer then builds muP's groups.
* ``save_base_shapes`` (save_base_shapes: true): the config's model is the base, a copy with hidden_size x
  mup_width_scale the delta; their shapes go to base_shapes_file (written by global rank 0). As in GPT-NeoX the
  run then stops (after the coordinate check when coord_check is also on): train wider models with the file.
* ``run_coord_check`` (coord_check: true): megatron.mup.coord_check over GPT-NeoX's widths (num_attention_heads
  x 2^p, p = 2..8), standard parametrization and muP, on the first training batch; writes coord_check.csv /
  .json / .png into log_dir (the working directory without one), then the run stops.
Models built here have every layer on each rank (no pipeline) and keep the run's tensor parallelism.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Dict, List

import torch
from torch import nn

from megatron.errors import ConfigError
from megatron.model.config import ModelConfig
from megatron.model.gpt2_model import build_model
from megatron.mpu.host_collectives import barrier
from megatron.mup.coord_check import coord_check, write_coord_check
from megatron.mup.parametrization import base_shapes_of, mup_initialize, set_base_shapes
from megatron.mup.rules import MODEL_KEYS
from megatron.mup.shapes import BaseShapesError, base_hidden_size, read_base_shapes, write_base_shapes
from megatron.optim.optimizers import build_optimizer

COORD_CHECK_POWERS = range(2, 9)
"""GPT-NeoX's coordinate-check widths: num_attention_heads x 2^p for these p."""
COORD_CHECK_STEPS = 3
"""Adam steps of each coordinate-check model (GPT-NeoX's, mup's default)."""


def standalone(config: ModelConfig, **changes) -> ModelConfig:
    """``config`` as one sequential model on this rank (no pipeline, no activation recomputation)."""
    return config.replace(pipe_parallel_size=0, checkpoint_activations=False, recompute_granularity=None,
                          recompute_method=None, recompute_num_layers=None, partition_activations=False,
                          contiguous_checkpointing=False, **changes)


def _shapes_model(config: ModelConfig, parallel_state) -> nn.Module:
    """A model whose parameter shapes are config's: on the meta device (no memory) where its init allows."""
    try:
        with torch.device("meta"):
            return build_model(config, parallel_state)
    except (NotImplementedError, RuntimeError):
        return build_model(config, parallel_state)


def save_base_shapes(neox_args, config: ModelConfig, parallel_state) -> str:
    """Write base_shapes_file from the config's model and its mup_width_scale-wider copy; returns the path."""
    base_config = standalone(config, mup_width_mult=1.0)
    delta_config = base_config.replace(hidden_size=config.hidden_size * int(neox_args.mup_width_scale))
    tp = parallel_state.get_model_parallel_world_size()
    shapes = base_shapes_of(_shapes_model(base_config, parallel_state), _shapes_model(delta_config, parallel_state),
                            tp)
    path = neox_args.base_shapes_file
    if _global_rank() == 0:
        write_base_shapes(path, shapes)
    barrier()
    return path


def prepare_model(neox_args, model: nn.Module, parallel_state) -> None:
    """With use_mup: base shapes on the parameters, muP's initialisation (see the module docstring)."""
    if not neox_args.use_mup:
        return
    path = neox_args.base_shapes_file
    _as_config_error(lambda: set_base_shapes(model, read_base_shapes(path), path,
                                             parallel_state.get_model_parallel_world_size()))
    mup_initialize(model, neox_args.mup_init_scale)


def coord_check_widths(config: ModelConfig) -> List[int]:
    return [config.num_attention_heads * 2 ** p for p in COORD_CHECK_POWERS]


def run_coord_check(neox_args, config: ModelConfig, parallel_state, batch, rng_tracker=None) -> Dict[str, str]:
    """The coordinate check of the run's model (module docstring) at coord_check_widths; returns the files
    written, by kind (megatron.mup.coord_check.write_coord_check)."""
    path = neox_args.base_shapes_file
    base = read_base_shapes(path)
    base_hidden = base_hidden_size(base, path)
    tp = parallel_state.get_model_parallel_world_size()

    def build(width: int, mup: bool) -> nn.Module:
        # the standard parametrization's model: none of muP's multipliers
        changes = dict(hidden_size=width, mup_width_mult=width / base_hidden) if mup else \
            dict(hidden_size=width, use_mup=False, **{key: 1.0 for key in MODEL_KEYS})
        model = build_model(standalone(config, **changes), parallel_state, rng_tracker)
        if mup:
            set_base_shapes(model, base, path, tp)
            mup_initialize(model, neox_args.mup_init_scale)
        return model

    rows = coord_check(build, lambda model: build_optimizer(neox_args, model), batch,
                       coord_check_widths(config), steps=COORD_CHECK_STEPS)
    directory = neox_args.log_dir or os.getcwd()
    if _global_rank() != 0:
        return {}
    return write_coord_check(rows, os.path.join(directory, "coord_check"))


def _global_rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0



def base_shapes_and_coord_check(neox_args, ctx, first_batch: Callable[[], object]) -> Dict[str, object]:
    """train.py's run with save_base_shapes and/or coord_check (module docstring): pretrain's summary, with what
    was written under ``mup``. ``first_batch`` gives the training batch the coordinate check repeats."""
    written: Dict[str, object] = {}
    config = ctx.model_config
    if neox_args.save_base_shapes:
        written["base_shapes_file"] = save_base_shapes(neox_args, config, ctx.parallel_state)
        _say(f"muP: base shapes of hidden_size {config.hidden_size} (delta x{neox_args.mup_width_scale}) saved to "
             f"{written['base_shapes_file']}; train other widths with base_shapes_file set to it and "
             f"save_base_shapes: false")
    if neox_args.coord_check:
        files = _as_config_error(lambda: run_coord_check(neox_args, config, ctx.parallel_state, first_batch(),
                                                         ctx.rng_tracker))
        written["coord_check"] = files
        if files:
            _say(f"muP coordinate check written: {', '.join(v for k, v in files.items() if k != 'plot_refused')}")
        if "plot_refused" in files:
            _say(f"warning: {files['plot_refused']}")
    return {"start_iteration": 0, "losses": [], "eval": [], "mup": written}


def _as_config_error(run: Callable[[], Any]) -> Any:
    """``run()``, a bad base shapes file reported as the ConfigError train.py prints (one line, no traceback)."""
    try:
        return run()
    except BaseShapesError as exc:
        raise ConfigError([str(exc)]) from None


def _say(message: str) -> None:
    if _global_rank() == 0:
        print(message, flush=True)
