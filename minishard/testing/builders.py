"""Strategies for models: from your own builder (``models``), or ``minishard.mlp`` (``mlps``).

A model is drawn in three steps: learn its arrays' logical axes from one
abstract run of the builder, draw widths the mesh and rules can split, and fill
the shapes with seeded numpy normals. ``jax.eval_shape`` builds without
computing, and numpy fills without compiling: ``jax.random`` would compile a
small program per new shape, seconds per model.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from hypothesis import strategies as st

from minishard.layers import ACTIVATIONS, Sequential, mlp
from minishard.rules import AnyMesh, AxisRules, LogicalAxes, ShardingError
from minishard.sharding import plan
from minishard.testing._cache import cached
from minishard.testing.strategies import MULTIPLES, seeds, split_counts, splittable_widths

LINEAR_AXES: Sequence[LogicalAxes] = (
    ("embed", "mlp"),
    ("mlp", "embed"),
    (None, "mlp"),
    ("mlp", None),
    (None, None),
)
"""Logical axes a Linear's weight may get in ``mlps``: both Megatron halves, one-sided, unannotated."""

Builder = Callable[[Mapping[str, int]], Any]
"""A user's model builder: widths keyed by logical axis (``widths["embed"]``) -> a model."""


@st.composite
def models(
    draw: st.DrawFn,
    build: Builder,
    mesh: AnyMesh,
    rules: AxisRules | None = None,
    *,
    fixed: Mapping[str, int] | None = None,
    multiples: Sequence[int] = MULTIPLES,
    scale: float = 0.25,
) -> Any:
    """Models from your own ``build(widths)``, with every width ``rules`` can split on ``mesh``.

    ``build`` takes a mapping from logical axis to width and returns a model;
    give each dimension the width named after its logical axis::

        def residual_mlp(widths):
            return Residual(mlp([widths["embed"], widths["mlp"], widths["embed"]],
                                key=jax.random.key(0), axes=[("embed", "mlp"), ("mlp", "embed")]))

    ``models`` runs ``build`` once under ``jax.eval_shape`` (nothing computed)
    to learn the names it asks for and its arrays' logical axes, draws the
    widths with ``splittable_widths`` (``fixed`` and ``multiples`` go there),
    builds the shapes, and fills every array with seeded numpy normals of
    standard deviation ``scale``. Define ``build`` once, at module level, and
    make it depend on its widths alone: its shapes are cached per function and
    widths, so that shrinking a failure does not trace it hundreds of times.
    """
    names, arrays = _builder_arrays(build, mesh, rules)
    widths = draw(splittable_widths(arrays, mesh, rules, fixed=fixed, multiples=multiples, names=names))
    shapes = _abstract_model(build, tuple(widths.items()))
    try:
        plan(shapes, mesh, rules)
    except ShardingError as e:
        raise ShardingError(
            f"models: {getattr(build, '__name__', build)}({widths}) built {e}. Does each dimension get "
            "the width named after its logical axis?"
        ) from None
    return _random_like(shapes, draw(seeds), scale)


class _Probe(Mapping[str, int]):
    """The widths a builder gets on its first (abstract) run: every name it asks for is recorded."""

    def __init__(self, width: int) -> None:
        self.width, self.asked = width, dict[str, None]()

    def __getitem__(self, name: str) -> int:
        self.asked[name] = None
        return self.width

    def __iter__(self) -> Iterator[str]:
        return iter(self.asked)

    def __len__(self) -> int:
        return len(self.asked)


@cached
def _builder_arrays(
    build: Builder, mesh: AnyMesh, rules: AxisRules | None
) -> tuple[tuple[str, ...], tuple[LogicalAxes, ...]]:
    """Which widths ``build`` asks for, and the logical axes of every array it builds."""
    probe = _Probe(mesh.size)  # a multiple of every split count on this mesh
    shapes = jax.eval_shape(lambda: build(probe))
    leaves = plan(shapes, mesh, rules).leaves  # a hard-coded size that cannot split fails here, named
    return tuple(probe.asked), tuple(leaf.logical_axes for leaf in leaves)


@cached
def _abstract_model(build: Builder, widths: tuple[tuple[str, int], ...]) -> Any:
    """``build(widths)`` as shapes only: ``jax.eval_shape`` traces it, computing and compiling nothing."""
    return jax.eval_shape(lambda: build(dict(widths)))


def _random_like(shapes: Any, seed: int, scale: float) -> Any:
    """numpy normals (zeros for non-float arrays): unlike jax.random, no program to compile per shape."""
    rng = np.random.default_rng(seed)

    def fill(leaf: Any) -> np.ndarray:
        if not np.issubdtype(leaf.dtype, np.floating):
            return np.zeros(leaf.shape, leaf.dtype)
        return (scale * rng.standard_normal(leaf.shape)).astype(leaf.dtype)

    return jax.tree.map(fill, shapes)


@st.composite
def mlps(
    draw: st.DrawFn,
    mesh: AnyMesh | None = None,
    rules: AxisRules | None = None,
    *,
    axes: Sequence[LogicalAxes] | None = None,
    in_features: int | None = None,
    out_features: int | None = None,
    max_linears: int = 3,
    multiples: Sequence[int] = MULTIPLES,
    max_width: int = 32,
    scale: float = 0.25,
) -> Sequential:
    """Random ``minishard.mlp`` models whose every width ``rules`` can split on ``mesh``.

    ``axes`` fixes the Linears' logical axes (and so their number); by default
    one to ``max_linears`` Linears get either the Megatron pattern
    ``("embed", "mlp"), ("mlp", "embed"), ...`` or axes drawn per layer from
    ``LINEAR_AXES``. ``in_features``/``out_features`` fix the end widths
    (drawn axes then split them only if they can). Every other width is a
    multiple (from ``multiples``) of the number of blocks ``rules`` split it
    into on ``mesh``; without ``rules``, of ``mesh.size`` (safe under any
    rules); without ``mesh``, any width up to ``max_width``. Parameters are
    seeded numpy normals of standard deviation ``scale``, which keeps
    activations of order one, so absolute tolerances stay meaningful.
    """

    def units(layer_axes: LogicalAxes) -> tuple[int, int]:  # what the Linear's in and out widths divide by
        if mesh is None:
            return 1, 1
        if rules is None:
            return mesh.size, mesh.size
        weight, bias = split_counts(layer_axes, mesh, rules), split_counts(layer_axes[1:], mesh, rules)
        return weight[0], math.lcm(weight[1], bias[0])

    def fits(layer_axes: LogicalAxes, first: bool, last: bool) -> bool:
        unit_in, unit_out = units(layer_axes)
        return not (first and in_features and in_features % unit_in) and not (
            last and out_features and out_features % unit_out
        )

    if axes is None:
        n_linear = draw(st.integers(1, max_linears))
        megatron = [(("embed", "mlp"), ("mlp", "embed"))[i % 2] for i in range(n_linear)]
        if draw(st.booleans()) and all(fits(a, i == 0, i == n_linear - 1) for i, a in enumerate(megatron)):
            axes = megatron
        else:  # per layer; the end layers only from the axes that can split the fixed end widths
            axes = []
            for i in range(n_linear):
                options = [a for a in LINEAR_AXES if fits(a, i == 0, i == n_linear - 1)]
                axes.append(draw(st.sampled_from(options)))  # (None, None) always fits
    elif bad := [i for i, a in enumerate(axes) if not fits(a, i == 0, i == len(axes) - 1)]:
        raise ValueError(
            f"mlps: Linear {bad[0]} with axes {axes[bad[0]]} cannot split in_features={in_features} / "
            f"out_features={out_features} under {rules} on mesh {dict(mesh.shape)}"  # type: ignore[union-attr]
        )
    boundary = [1] * (len(axes) + 1)  # boundary i: Linear i's input, Linear i-1's output
    for i, layer_axes in enumerate(axes):
        unit_in, unit_out = units(layer_axes)
        boundary[i], boundary[i + 1] = math.lcm(boundary[i], unit_in), math.lcm(boundary[i + 1], unit_out)
    fixed = {0: in_features, len(axes): out_features}
    sizes = [
        fixed.get(i)
        or (draw(st.integers(1, max_width)) if mesh is None else unit * draw(st.sampled_from(multiples)))
        for i, unit in enumerate(boundary)
    ]
    activation = draw(st.sampled_from(sorted(ACTIVATIONS)))
    shapes = _abstract_mlp(tuple(sizes), activation, tuple(map(tuple, axes)))
    return _random_like(shapes, draw(seeds), scale)


@cached
def _abstract_mlp(sizes: tuple[int, ...], activation: str, axes: tuple[LogicalAxes, ...]) -> Sequential:
    return jax.eval_shape(lambda: mlp(sizes, key=jax.random.key(0), activation=activation, axes=axes))


__all__ = ["LINEAR_AXES", "Builder", "mlps", "models"]
