"""Composed meshes for your model: ``compositions`` draws which dimensions, and how many devices each.

A composed style (``minishard.styles.compose``: ``dp+tp+pp``) gives each dimension of
parallelism a mesh axis of its own and composes their rules in one order. Whether it computes
what the dense model computes is a property of every composition and every mesh shape, so it
is tested best on drawn cases: ``compositions(widths)`` draws a ``Composition`` (its
dimensions, a mesh, the composed rules) that ``assert_sharded_equivalent`` and
``assert_placement`` take as they are (``mesh=c.mesh, rules=c.rules``).

What composes is ``minishard.styles.dimensions``' answer, asked of every candidate: the
strategy never draws a composition the library refuses, and keeps no table of its own.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Mapping, Sequence

import jax
from hypothesis import strategies as st
from jax.sharding import AbstractMesh, Mesh

from minishard.sharding import make_mesh
from minishard.styles import DIMENSIONS, LOGICAL_AXES, MESH_AXES, ORDER, dimensions, style_rules
from minishard.testing.strategies import _factorizations, _multi_device_count, split_counts

ANNOTATED = ("dp", "fsdp", "tp", "sp")
"""The dimensions that are annotations alone: any model whose arrays name their logical axes takes
them. pp, cp and ep need a chapter's machinery too (a ``Pipeline``, a ring core, MoE layers)."""


class Composition:
    """A composed style on a mesh: ``Composition("dp+tp+pp", {"data": 2, "model": 2, "stage": 2})``.

    Its ``dimensions``, each over its mesh axis of ``mesh`` (the first devices), and the composed
    ``rules`` (``minishard.styles.style_rules``). Its repr is this call: a failing example, as
    hypothesis prints it, pastes into a test as it is.

    >>> composition = Composition("tp+dp", {"data": 2, "model": 4})
    >>> composition, composition.dimensions, composition.rules.spec(("batch", "mlp"))
    (Composition('dp+tp', {'data': 2, 'model': 4}), ('dp', 'tp'), P('data', 'model'))
    """

    def __init__(self, style: str, shape: Mapping[str, int]) -> None:
        self.dimensions = dimensions(style)  # a composition the library refuses is refused here
        if tuple(shape) != (axes := _mesh_axes(self.dimensions)):
            raise ValueError(f"Composition: {style} has the mesh axes {axes} in this order, not {(*shape,)}")
        self.mesh, self.rules = _mesh(axes, tuple(shape.values())), style_rules(style)

    @property
    def name(self) -> str:
        """The style, as ``--parallel`` spells it: ``"dp+tp+pp"``."""
        return "+".join(self.dimensions)

    def __repr__(self) -> str:
        return f"Composition({self.name!r}, {dict(self.mesh.shape)})"


def compositions(
    widths: Mapping[str, int],
    dims: Sequence[str] | None = None,
    *,
    min_dimensions: int = 1,
    max_dimensions: int = 3,
    devices: int | None = None,
) -> st.SearchStrategy[Composition]:
    """``Composition``\\ s of ``dims`` that your model, of these ``widths``, can take on ``devices`` devices.

    ``widths`` gives your model's width per logical axis, the batch's included:
    ``{"batch": 8, "embed": 32, "mlp": 128, "heads": 8, ...}``. ``dims`` are the dimensions it
    can take; by default those of ``ANNOTATED`` that split a logical axis it names (sp needs a
    "seq", fsdp an "embed" or "mlp" ...). Each draw is a set of ``min_dimensions`` to
    ``max_dimensions`` of them that ``minishard.styles.dimensions`` accepts, and a mesh of one
    axis per dimension (sp rides on tp's), every axis at least 2 wide (a 1-wide axis splits
    nothing), their sizes multiplying to ``devices`` (default: all) and dividing every width the
    composed rules split. Fewer dimensions and the first shapes come first: hypothesis shrinks
    towards them.

    A ``dims`` entry that is no dimension, or splits no logical axis of ``widths``, and a choice
    that leaves nothing to draw, are refused at once (``ValueError``), before any example runs.

    >>> from hypothesis import find
    >>> widths = {"batch": 8, "embed": 16, "mlp": 64}   # an MLP's: no "seq", so no sp
    >>> find(compositions(widths, min_dimensions=2, devices=8), lambda c: "fsdp" in c.dimensions)
    Composition('fsdp+tp', {'data': 2, 'model': 4})
    >>> compositions(widths, ["dp", "cp"])
    Traceback (most recent call last):
    ValueError: compositions: cp splits seq, and widths names none of them
    """
    available = _multi_device_count("compositions")
    n = available if devices is None else devices
    if n > available:
        raise ValueError(f"compositions: devices={n}, but this process has only {available}")
    if unknown := sorted(set(widths) - set(LOGICAL_AXES)):
        raise ValueError(
            f"compositions: widths names {unknown}, which the styles' rules do not; the logical axes are "
            f"{', '.join(LOGICAL_AXES)}"
        )
    dims = _takeable(widths, dims)
    fits = [
        composition
        for count in range(min_dimensions, max_dimensions + 1)
        for chosen in itertools.combinations(dims, count)
        if (name := _composes(chosen))
        for composition in _on_meshes(name, widths, n)
    ]
    if not fits:
        raise ValueError(
            f"compositions: no composition of {min_dimensions} to {max_dimensions} of {', '.join(dims)} "
            f"splits the widths {dict(widths)} over {n} devices, every mesh axis at least 2 wide"
        )
    return st.sampled_from(fits)


def _takeable(widths: Mapping[str, int], dims: Sequence[str] | None) -> tuple[str, ...]:
    """``dims`` (checked), or the ``ANNOTATED`` ones that split an axis of ``widths``; ``DIMENSIONS``' order.

    A dimension's axes are its rows of ``ORDER`` but the batch, which only dp's is: fsdp or ep that
    split a model's batch and nothing else would be dp over another mesh axis."""
    rows = {dim: {logical for d, logical in ORDER if d == dim} for dim in DIMENSIONS}
    splits = {dim: (axes - {"batch"}) or axes for dim, axes in rows.items()}
    if dims is None:
        return tuple(dim for dim in ANNOTATED if splits[dim] & set(widths))
    for dim in dims:
        if dim not in DIMENSIONS:
            known = ", ".join(DIMENSIONS)
            raise ValueError(f"compositions: unknown dimension {dim!r}; the dimensions are {known}")
        if not splits[dim] & set(widths):
            raise ValueError(
                f"compositions: {dim} splits {', '.join(sorted(splits[dim]))}, and widths names none of them"
            )
    return tuple(dim for dim in DIMENSIONS if dim in dims)


def _composes(chosen: tuple[str, ...]) -> str | None:
    """The style of ``chosen`` if ``minishard.styles.dimensions`` takes it, else None."""
    try:
        return "+".join(dimensions("+".join(chosen)))
    except ValueError:
        return None


def _on_meshes(name: str, widths: Mapping[str, int], devices: int) -> list[Composition]:
    """``name`` on every mesh of ``devices`` devices, each axis at least 2, that splits ``widths`` evenly."""
    rules, axes = style_rules(name), _mesh_axes(dimensions(name))
    shapes = [shape for shape in _factorizations(devices, len(axes)) if min(shape) >= 2]
    return [
        Composition(name, dict(zip(axes, shape)))
        for shape in shapes
        if all(
            width % split_counts((logical,), AbstractMesh(shape, axes), rules)[0] == 0
            for logical, width in widths.items()
        )
    ]


def _mesh_axes(dims: tuple[str, ...]) -> tuple[str, ...]:
    """A mesh axis per dimension (sp rides on tp's), in ``MESH_AXES``' order."""
    return tuple(axis for axis in MESH_AXES if axis in {DIMENSIONS[dim].axis for dim in dims})


@functools.cache
def _mesh(axes: tuple[str, ...], shape: tuple[int, ...]) -> Mesh:
    """One mesh per shape, made once: every example that draws it reuses its compiled programs."""
    return make_mesh(dict(zip(axes, shape)), devices=jax.devices()[: math.prod(shape)])


__all__ = ["ANNOTATED", "Composition", "compositions"]
