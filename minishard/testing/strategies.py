"""Strategies for where a test runs: meshes, rules, the widths they can split, batches, seeds.

Compiling is what a sharding test spends its time on, and hypothesis reruns a
failing test hundreds of times while it shrinks it. So every size is drawn from
a *small fixed set* per mesh (``MULTIPLES``): the candidates reuse compiled
programs, since ``jax.jit`` caches them per shapes and shardings.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from hypothesis import strategies as st
from jax.sharding import Mesh

from minishard.rules import (
    IDENTITY_RULES,
    AnyMesh,
    AxisRules,
    LogicalAxes,
    MeshAxes,
    as_mesh_axes,
    split_count,
)
from minishard.sharding import Sharded, make_mesh

DEFAULT_MESH_AXES = ("data", "model")
"""The mesh axes a drawn mesh names unless told (``styles.MESH_AXES`` are every dimension's)."""

DEFAULT_CHOICES: Mapping[str, Sequence[MeshAxes]] = {
    "batch": ("data", None),
    "embed": (None,),
    "mlp": ("model", None, ("data", "model")),
}
"""What ``axis_rules()`` may map each logical name to: data, tensor and 2-D parallelism."""

MULTIPLES = (1, 2)
"""Widths and batch sizes are ``unit * m``, ``m`` drawn from this small set (see ``splittable_widths``)."""

seeds = st.integers(0, 2**32 - 1)
"""Seeds for numpy's generator: parameter values change, compiled programs do not."""


# --- meshes -----------------------------------------------------------------------


def meshes(
    mesh_axes: Sequence[str] = DEFAULT_MESH_AXES,
    *,
    shapes: Sequence[Sequence[int]] | None = None,
    min_sizes: Mapping[str, int] | None = None,
    devices: int | None = None,
) -> st.SearchStrategy[Mesh]:
    """Meshes with these mesh axis names over ``devices`` devices (default: all of them).

    ``mesh_axes`` sets the rank: ``("data",)``, ``("data", "model")``,
    ``("data", "fsdp", "model")``; mix ranks with ``st.one_of(meshes(...), ...)``.
    By default every shape whose sizes multiply to the device count is drawn
    (on 8 devices and 2 axes: 1x8, 2x4, 4x2, 8x1); ``shapes`` lists them
    instead. ``min_sizes={"model": 2}`` drops the shapes where an axis is
    narrower: a 1-wide "model" axis splits nothing, so a tensor-parallel test
    would pass without testing anything.

    A process with a single device would draw only 1-device meshes, where
    every test passes; ``meshes`` refuses it (``RuntimeError``, saying how to
    simulate devices) when it is called, before any example runs.
    """
    available = _multi_device_count("meshes")
    n = available if devices is None else devices
    if n > available:
        raise ValueError(f"meshes: devices={n}, but this process has only {available}")
    names = tuple(mesh_axes)
    if isinstance(mesh_axes, str) or not names or not all(isinstance(a, str) for a in names):
        raise TypeError(
            f"meshes: mesh_axes must be a tuple of mesh axis names, e.g. ('data', 'model'); got {mesh_axes!r}"
        )
    if shapes is None:
        shapes = _factorizations(n, len(names))
    elif bad := [s for s in shapes if len(s) != len(names) or math.prod(s) != n]:
        raise ValueError(
            f"meshes: shapes {bad} do not give one size per axis {names} multiplying to {n}; "
            "for meshes over fewer devices, pass devices="
        )
    minimum = dict(min_sizes or {})
    if unknown := sorted(set(minimum) - set(names)):
        raise ValueError(f"meshes: min_sizes names {unknown}, which are not among the axes {names}")
    kept = [tuple(s) for s in shapes if all(size >= minimum.get(a, 1) for a, size in zip(names, s))]
    if not kept:
        raise ValueError(f"meshes: no shape of {n} devices over {names} has min_sizes {minimum}")
    # A few meshes, made once here: every example that draws one reuses its compiled programs.
    return st.sampled_from([make_mesh(dict(zip(names, s)), devices=jax.devices()[:n]) for s in kept])


def _multi_device_count(where: str) -> int:
    n = jax.device_count()
    if n < 2:
        raise RuntimeError(
            f"minishard.testing.{where}: this process has {n} {jax.devices()[0].platform} device, so every "
            "mesh would be 1x1, nothing would be split, and every sharding test would pass. Simulate "
            "CPU devices before JAX starts: set XLA_FLAGS=--xla_force_host_platform_device_count=8 in "
            "the environment (or in conftest.py, before `import jax`), or call "
            "jax.config.update('jax_num_cpu_devices', 8) before the first use of a device."
        )
    return n


def _factorizations(n: int, rank: int) -> list[tuple[int, ...]]:
    """Every way to write ``n`` as an ordered product of ``rank`` sizes: 8, 2 -> 1x8, 2x4, 4x2, 8x1."""
    if rank == 1:
        return [(n,)]
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    return [(d, *rest) for d in divisors for rest in _factorizations(n // d, rank - 1)]


# --- rules ------------------------------------------------------------------------


@st.composite
def axis_rules(
    draw: st.DrawFn,
    choices: Mapping[str, Sequence[MeshAxes]] | None = None,
    *,
    ordered: bool | None = None,
    mesh: AnyMesh | None = None,
    split: Iterable[str] = (),
) -> AxisRules:
    """Random ``AxisRules``, each logical name mapped to one of its ``choices``.

    The keyword form (``ordered=False``) maps each name to one target. The
    ordered form (``ordered=True``) gives each name one to three distinct
    targets and shuffles all the pairs, so later rules become fallbacks and
    names compete for mesh axes in a random order. ``None`` draws the form too.
    The keyword form raises ``ShardingError`` when two dimensions of one array
    get the same mesh axis, so the default ``choices`` never allow that.

    ``split=["mlp"]`` (with ``mesh``) keeps only the targets that really split
    on ``mesh`` (more than one block), and puts these names' rules first in the
    ordered form, so no other name takes their mesh axes first. Without it,
    ``mlp`` may be drawn replicated and a tensor-parallel test tests nothing.
    """
    choices = dict(DEFAULT_CHOICES if choices is None else choices)
    split = tuple(split)
    if split:
        if mesh is None:
            raise TypeError("axis_rules(split=...) needs the mesh the names must be split on: mesh=mesh")
        choices.update({name: _splitting(name, choices.get(name, ()), mesh) for name in split})
    if not (draw(st.booleans()) if ordered is None else ordered):
        return AxisRules(**{name: draw(st.sampled_from(targets)) for name, targets in choices.items()})
    pairs = [
        (name, target)
        for name, targets in choices.items()
        for target in draw(st.lists(st.sampled_from(targets), min_size=1, max_size=3, unique=True))
    ]
    shuffled = draw(st.permutations(pairs))
    return AxisRules.from_pairs(sorted(shuffled, key=lambda pair: pair[0] not in split))  # stable


def _splitting(name: str, targets: Sequence[MeshAxes], mesh: AnyMesh) -> list[MeshAxes]:
    """The ``targets`` that split a dimension on ``mesh`` into more than one block."""
    on_mesh = [t for t in targets if set(as_mesh_axes(t)) <= set(mesh.axis_names)]
    if not (splitting := [t for t in on_mesh if split_count(mesh, t) > 1]):
        raise ValueError(
            f"axis_rules: no choice for {name!r} in {list(targets)} splits mesh {dict(mesh.shape)}; "
            "add choices, or draw meshes(min_sizes=...) whose axes are wider than 1"
        )
    return splitting


# --- widths -----------------------------------------------------------------------


def split_counts(logical_axes: LogicalAxes, mesh: AnyMesh, rules: AxisRules | None = None) -> tuple[int, ...]:
    """Into how many blocks ``rules`` split each dimension of an array with these logical axes.

    >>> mesh = jax.sharding.AbstractMesh((2, 4), ("data", "model"))
    >>> split_counts(("embed", "mlp"), mesh, AxisRules(embed=None, mlp=("data", "model")))
    (1, 8)
    """
    spec = (rules or IDENTITY_RULES).spec(logical_axes, mesh)
    return tuple(split_count(mesh, entry) for entry in spec)


def width_units(
    arrays: Iterable[LogicalAxes], mesh: AnyMesh, rules: AxisRules | None = None
) -> dict[str, int]:
    """Per logical axis: what its width must be a multiple of, so that every array splits evenly.

    ``arrays`` lists the logical axes of each array of a model (a weight
    ``("embed", "mlp")``, its bias ``("mlp",)``, ...); a name's unit is the
    least common multiple of the ways it is split in any of them.

    >>> mesh = jax.sharding.AbstractMesh((2, 4), ("data", "model"))
    >>> width_units([("embed", "mlp"), ("mlp",), ("mlp", "embed")], mesh, AxisRules(embed=None, mlp="model"))
    {'embed': 1, 'mlp': 4}
    """
    units: dict[str, int] = {}
    for axes in arrays:
        for name, ways in zip(axes, split_counts(axes, mesh, rules)):
            if name is not None:
                units[name] = math.lcm(units.get(name, 1), ways)
    return units


@st.composite
def splittable_widths(
    draw: st.DrawFn,
    arrays: Iterable[LogicalAxes],
    mesh: AnyMesh,
    rules: AxisRules | None = None,
    *,
    fixed: Mapping[str, int] | None = None,
    multiples: Sequence[int] = MULTIPLES,
    names: Sequence[str] | None = None,
) -> dict[str, int]:
    """A width per logical axis of ``arrays`` that ``rules`` can split on ``mesh``: ``{"mlp": 8, ...}``.

    Each width is its ``width_units`` unit times one of ``multiples``, a small
    fixed set: one mesh and rules then give only a few distinct shapes, so the
    hundreds of examples a shrinking failure runs reuse a few compiled programs.
    ``fixed`` pins widths (an input width, the number of classes); one that
    cannot split evenly is refused with the unit it needs. ``names`` (default:
    every name in ``arrays``) says which widths to draw; a name no array
    carries has unit 1.
    """
    arrays = list(arrays)
    units = width_units(arrays, mesh, rules)
    fixed = dict(fixed or {})
    widths: dict[str, int] = {}
    for name in [*(units if names is None else names), *fixed]:
        unit = units.get(name, 1)
        if name in fixed:
            if fixed[name] % unit:
                raise ValueError(
                    f"splittable_widths: fixed width {name}={fixed[name]} cannot split into the {unit} "
                    f"blocks {rules} give it on mesh {dict(mesh.shape)}; fix a multiple of {unit}, or draw "
                    "only meshes and rules that split it fewer ways"
                )
            widths[name] = fixed[name]
        elif name not in widths:
            widths[name] = unit * draw(st.sampled_from(multiples))
    return widths


# --- batches ----------------------------------------------------------------------


def batch_sizes(
    mesh: Mesh,
    rules: AxisRules | None = None,
    batch_axis: str | None = None,
    multiples: Sequence[int] = MULTIPLES,
) -> st.SearchStrategy[int]:
    """Batch sizes ``Sharded(mesh, rules, batch_axis)`` can split: ``unit * m``, ``m`` in ``multiples``."""
    unit = split_count(mesh, Sharded(mesh, rules, batch_axis).batch_sharding.spec[0])
    return st.sampled_from(multiples).map(lambda m: m * unit)


@st.composite
def batches(
    draw: st.DrawFn,
    mesh: Mesh,
    rules: AxisRules | None = None,
    features: int | Sequence[int] = (),
    *,
    batch_axis: str | None = None,
    multiples: Sequence[int] = MULTIPLES,
    dtype: Any = np.float32,
) -> np.ndarray:
    """A batch of standard normals, ``(batch, *features)``, whose batch ``Sharded`` can split evenly."""
    shape = (features,) if isinstance(features, int) else tuple(features)
    size = draw(batch_sizes(mesh, rules, batch_axis, multiples))
    return np.random.default_rng(draw(seeds)).standard_normal((size, *shape)).astype(dtype)


__all__ = [
    "DEFAULT_CHOICES",
    "DEFAULT_MESH_AXES",
    "MULTIPLES",
    "axis_rules",
    "batch_sizes",
    "batches",
    "meshes",
    "seeds",
    "split_counts",
    "splittable_widths",
    "width_units",
]
