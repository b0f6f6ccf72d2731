"""Base shapes: which dimensions of each parameter grow with the width, and how wide the base model was.

muP scales each parameter's initialisation and learning rate by how much wider it is than in a small *base*
model. A base shapes file (written by ``save_base_shapes``, named by ``base_shapes_file``) records it in
microsoft/mup's YAML format: parameter name -> one entry per dimension, ``null`` for a finite dimension (one
that does not grow with hidden_size: the vocabulary, the positions) and the base model's size for an
infinite one. A dimension is infinite when the base model (the config as written) and the delta model
(hidden_size x mup_width_scale) differ in it.

Names are the sequential model's (``sequential.<slot>.<rest>``, GPT-NeoX's checkpoint names) and shapes are
whole tensors (tensor-parallel shards put back together), so one file serves every pipeline and tensor-parallel
layout. This module does not import torch (ModelConfig's adapter reads the base width from the file).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import yaml

BaseShapes = Dict[str, List[Optional[int]]]
"""name -> per dimension: None (finite) or the base model's size (infinite)."""

HEADER = ("# muP base shapes (microsoft/mup's format), written by save_base_shapes:\n"
          "# - null: a finite dimension (it does not grow with hidden_size)\n"
          "# - a number: the base model's size of an infinite (width) dimension\n")

WORD_EMBEDDINGS = "word_embeddings.weight"


class BaseShapesError(ValueError):
    """The base shapes file is missing, unreadable or does not describe this model."""


@dataclass(frozen=True)
class InfShape:
    """One parameter's shape against the base model's (mup's InfShape)."""

    base: Tuple[Optional[int], ...]
    shape: Tuple[int, ...]

    def dim_mult(self, dim: int) -> float:
        """How many times wider dimension ``dim`` is than in the base model (1 for a finite dimension)."""
        return self.shape[dim] / self.base[dim] if self.base[dim] else 1.0

    @property
    def ninf(self) -> int:
        """Infinite dimensions: 0 scalar-like, 1 vector-like (biases, norms, embeddings), 2 matrix-like."""
        return sum(b is not None for b in self.base)

    @property
    def width_mult(self) -> float:
        """The multiplier of the last infinite dimension (a linear weight's fan-in), as mup's; 1 without one."""
        infinite = [i for i, b in enumerate(self.base) if b is not None]
        return self.dim_mult(infinite[-1]) if infinite else 1.0

    @property
    def fanin_fanout_ratio(self) -> float:
        """fan-in multiplier / fan-out multiplier of a [out, in] weight (MuSGD's matrix-like rule)."""
        return self.dim_mult(1) / self.dim_mult(0)


def make_base_shapes(base: Mapping[str, Sequence[int]], delta: Mapping[str, Sequence[int]]) -> BaseShapes:
    """The base shapes of a base model and a wider delta model of the same architecture (name -> shape)."""
    if set(base) != set(delta):
        raise BaseShapesError(f"the base and delta models have different parameters: "
                              f"{sorted(set(base) ^ set(delta))[:5]}")
    shapes: BaseShapes = {}
    for name, dims in base.items():
        other = delta[name]
        if len(other) != len(dims):
            raise BaseShapesError(f"{name}: {len(dims)} dimensions in the base model, {len(other)} in the delta")
        shapes[name] = [None if a == b else int(a) for a, b in zip(dims, other)]
    return shapes


def write_base_shapes(path: str, shapes: BaseShapes) -> None:
    """Write ``shapes`` to ``path`` atomically (a reader never sees half a file)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(HEADER)
        yaml.safe_dump({name: list(dims) for name, dims in shapes.items()}, f, default_flow_style=None,
                       sort_keys=False)
    os.replace(tmp, path)


def read_base_shapes(path: str) -> BaseShapes:
    """The base shapes in ``path``; BaseShapesError naming the file and the fix when it is missing or malformed."""
    if not os.path.isfile(path):
        raise BaseShapesError(f"base_shapes_file={path!r} does not exist: write it first by running the base-width "
                              f"config once with use_mup: true and save_base_shapes: true")
    with open(path) as f:
        try:
            data = yaml.safe_load(f)
        except yaml.YAMLError as exc:
            raise BaseShapesError(f"base_shapes_file={path!r} is not YAML: {exc}") from None
    if not isinstance(data, dict) or not all(
            isinstance(dims, list) and all(d is None or (isinstance(d, int) and d > 0) for d in dims)
            for dims in data.values()):
        raise BaseShapesError(f"base_shapes_file={path!r} is not a base shapes file (parameter name -> list of "
                              f"null or positive sizes); write it again with save_base_shapes: true")
    return data


def infshapes(shapes: Mapping[str, Sequence[int]], base: BaseShapes, path: str,
              whole: bool = True) -> Dict[str, InfShape]:
    """Each parameter's InfShape; BaseShapesError naming what differs when ``base`` describes another model.
    ``whole=False``: ``shapes`` are one pipeline stage's, a part of the model (the file's other parameters live on
    other stages)."""
    missing = sorted(set(shapes) - set(base))
    unknown = sorted(set(base) - set(shapes)) if whole else []
    problems = []
    if missing:
        problems.append(f"{len(missing)} of this model's parameters are not in it ({', '.join(missing[:3])}"
                        f"{', ...' if len(missing) > 3 else ''})")
    if unknown:
        problems.append(f"{len(unknown)} of its parameters are not in this model ({', '.join(unknown[:3])}"
                        f"{', ...' if len(unknown) > 3 else ''})")
    for name in sorted(set(shapes) & set(base)):
        dims, ref = tuple(shapes[name]), base[name]
        if len(dims) != len(ref):
            problems.append(f"{name} has {len(dims)} dimensions here and {len(ref)} in the file")
    if problems:
        raise BaseShapesError(f"base_shapes_file={path!r} does not describe this model: {'; '.join(problems)}. "
                              f"It was written for another architecture (layers, layer types, vocabulary, biases); "
                              f"write it again from this model's base-width config with save_base_shapes: true")
    return {name: InfShape(tuple(base[name]), tuple(int(d) for d in dims)) for name, dims in shapes.items()}


def base_hidden_size(base: BaseShapes, path: str = "the base shapes") -> int:
    """The base model's hidden_size: the width of its word embedding ([vocab, hidden])."""
    for name, dims in base.items():
        if name.endswith(WORD_EMBEDDINGS) and len(dims) == 2 and dims[1]:
            return int(dims[1])
    raise BaseShapesError(f"{path} has no word embedding with an infinite width dimension ({WORD_EMBEDDINGS}: "
                          f"[null, hidden]); write it again with save_base_shapes: true")


def mup_width_mult(args: Any) -> float:
    """ModelConfig's mup_width_mult of a NeoXArgs (or its dict's namespace): hidden_size over the base model's,
    1.0 without muP, without a base_shapes_file, or while save_base_shapes writes it (this run is the base).
    A file that cannot be read also gives 1.0 here: validation reports it (megatron.mup.rules)."""
    path = getattr(args, "base_shapes_file", None)
    if not getattr(args, "use_mup", False) or not path or getattr(args, "save_base_shapes", False):
        return 1.0
    try:
        return int(args.hidden_size) / base_hidden_size(read_base_shapes(path), path)
    except (BaseShapesError, OSError, TypeError):
        return 1.0
