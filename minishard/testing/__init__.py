"""Property-test the sharding of your own models: strategies, three assertions, a profile.

Sharding a program promises three things, and each has its assertion:

* **numbers**, ``assert_sharded_equivalent``: the sharded run computes what the
  plain ``jax.jit`` run computes;
* **layout**, ``assert_layout``: every array is split the way *you* say it must
  be, read from the placed arrays themselves;
* **communication**, ``assert_collectives``: the compiled program sends no more
  than a budget of ``Limit``\\ s (no all-gather, bytes over "model", ...).

The first cannot see a wrong annotation: sharding never changes the numbers, so
a model with its two Megatron halves swapped computes exactly the same thing,
only slower. The second and third can, because they compare with what you
intended rather than with what the library derived from the same annotations.

These are properties, so they are tested best on many random cases: the
strategies (hypothesis ``@composite``\\ s) draw ``meshes`` over any axis names,
``axis_rules``, widths that a mesh and rules can split (``splittable_widths``,
for any arrays' logical axes), models from your own builder (``models``), MLPs
(``mlps``) and ``batches``. Compiling is what such tests spend their time on,
and hypothesis runs a failing test hundreds of times while it shrinks it, so
every size is drawn from a *small fixed set* per mesh: the candidates reuse
compiled programs (``jax.jit`` caches per shapes and shardings). Load the
``"minishard"`` hypothesis profile (``register_profiles``) for settings that
suit compiling tests.

hypothesis is a development dependency (``pip install hypothesis``), so
``import minishard`` never imports this module; import it yourself.
docs/testing.md is the guide, built on a worked example.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

try:
    from hypothesis import HealthCheck, Phase, settings
    from hypothesis import strategies as st
except ImportError as error:  # only the tests need hypothesis, so minishard does not depend on it
    raise ImportError(
        "minishard.testing needs hypothesis, a development dependency: pip install hypothesis "
        "(or pip install 'minishard[dev]')"
    ) from error

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from minishard.census import KINDS, Collective, collectives, human_bytes, instructions, summary
from minishard.layers import ACTIVATIONS, Sequential, mlp
from minishard.rules import (
    IDENTITY_RULES,
    AnyMesh,
    AxisRules,
    LogicalAxes,
    MeshAxes,
    ShardingError,
    as_mesh_axes,
    split_count,
)
from minishard.sharding import Sharded, ShardedFunction, make_mesh, plan
from minishard.tree import path_str, tree_bytes

MESH_AXES = ("data", "model")

DEFAULT_CHOICES: Mapping[str, Sequence[MeshAxes]] = {
    "batch": ("data", None),
    "embed": (None,),
    "mlp": ("model", None, ("data", "model")),
}
"""What ``axis_rules()`` may map each logical name to: data, tensor and 2-D parallelism."""

LINEAR_AXES: Sequence[LogicalAxes] = (
    ("embed", "mlp"),
    ("mlp", "embed"),
    (None, "mlp"),
    ("mlp", None),
    (None, None),
)
"""Logical axes a Linear's weight may get in ``mlps``: both Megatron halves, one-sided, unannotated."""

MULTIPLES = (1, 2)
"""Widths and batch sizes are ``unit * m``, ``m`` drawn from this small set (see ``splittable_widths``)."""

seeds = st.integers(0, 2**32 - 1)
"""Seeds for numpy's generator: parameter values change, compiled programs do not."""


# --- 1. meshes ------------------------------------------------------------------


def meshes(
    axes: Sequence[str] = MESH_AXES,
    *,
    shapes: Sequence[Sequence[int]] | None = None,
    min_sizes: Mapping[str, int] | None = None,
    devices: int | None = None,
) -> st.SearchStrategy[Mesh]:
    """Meshes with these axis names over ``devices`` devices (default: all of them).

    ``axes`` sets the rank: ``("data",)``, ``("data", "model")``,
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
    names = tuple(axes)
    if isinstance(axes, str) or not names or not all(isinstance(a, str) for a in names):
        raise TypeError(
            f"meshes: axes must be a tuple of mesh axis names, e.g. ('data', 'model'); got {axes!r}"
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
    return st.sampled_from(kept).map(functools.partial(_mesh, names))


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


@functools.lru_cache(maxsize=64)
def _mesh(names: tuple[str, ...], sizes: tuple[int, ...]) -> Mesh:
    return make_mesh(dict(zip(names, sizes)), devices=jax.devices()[: math.prod(sizes)])


# --- 2. rules -------------------------------------------------------------------


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


# --- 3. widths ------------------------------------------------------------------


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


# --- 4. models and batches ------------------------------------------------------


Builder = Callable[[Mapping[str, int]], Any]
"""A user's model builder: widths keyed by logical axis (``widths["embed"]``) -> a model."""


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


@functools.lru_cache(maxsize=256)
def _abstract_model(build: Builder, widths: tuple[tuple[str, int], ...]) -> Any:
    """``build(widths)`` as shapes only: ``jax.eval_shape`` traces it, computing and compiling nothing."""
    return jax.eval_shape(lambda: build(dict(widths)))


_BUILDERS: dict[Any, tuple[tuple[str, ...], tuple[LogicalAxes, ...]]] = {}


def _rules_key(rules: AxisRules | None) -> Any:
    """A cache key for ``rules``: equal rules drawn in two examples share one entry."""
    return None if rules is None else (rules.pairs, rules.ordered)


def _builder_arrays(
    build: Builder, mesh: AnyMesh, rules: AxisRules | None
) -> tuple[tuple[str, ...], tuple[LogicalAxes, ...]]:
    """Which widths ``build`` asks for, and the logical axes of every array it builds; cached."""
    key = (build, mesh, _rules_key(rules))
    if key not in _BUILDERS:
        if len(_BUILDERS) > 256:
            _BUILDERS.clear()
        probe = _Probe(mesh.size)  # a multiple of every split count on this mesh
        shapes = jax.eval_shape(lambda: build(probe))
        leaves = plan(shapes, mesh, rules).leaves  # a hard-coded size that cannot split fails here, named
        _BUILDERS[key] = tuple(probe.asked), tuple(leaf.logical_axes for leaf in leaves)
    return _BUILDERS[key]


def _random_like(shapes: Any, seed: int, scale: float) -> Any:
    """numpy normals (zeros for non-float arrays): unlike jax.random, no program to compile per shape."""
    rng = np.random.default_rng(seed)

    def fill(leaf: Any) -> np.ndarray:
        if not np.issubdtype(leaf.dtype, np.floating):
            return np.zeros(leaf.shape, leaf.dtype)
        return (scale * rng.standard_normal(leaf.shape)).astype(leaf.dtype)

    return jax.tree.map(fill, shapes)


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


@functools.lru_cache(maxsize=256)
def _abstract_mlp(sizes: tuple[int, ...], activation: str, axes: tuple[LogicalAxes, ...]) -> Sequential:
    # jax.eval_shape builds the model without computing (or compiling) anything; numpy then draws
    # the parameters. jax.random would compile small programs for every new shape: seconds per model.
    return jax.eval_shape(lambda: mlp(sizes, key=jax.random.key(0), activation=activation, axes=axes))


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


# --- 5. numbers -----------------------------------------------------------------


def assert_sharded_equivalent(
    fn: Callable[..., Any],
    *args: Any,
    mesh: Mesh,
    rules: AxisRules | None = None,
    batch_axis: str | None = None,
    reference: Callable[..., Any] | None = None,
    rtol: float = 1e-5,
    atol: float = 1e-6,
) -> Any:
    """Run ``fn`` unsharded and sharded; outputs must agree and be laid out as declared.

    The reference is ``jax.jit(fn)`` on one device (``reference`` instead of
    ``fn`` there, e.g. the plain model for a hand-written ``shard_map``, which
    cannot run on one device); the other run is
    ``Sharded(mesh, rules, batch_axis)(fn)``. Every output leaf must match
    (``numpy.testing.assert_allclose``, the message names the leaf's path) and
    every leaf whose spec ``ShardedFunction.specs`` declares (Layer parameters,
    scalars) must carry that sharding; leaves it leaves to XLA are not checked.
    Returns the sharded outputs. Define ``fn`` once, at module level: jit
    caches compiled code per function, so a new lambda per call recompiles.

    This catches a program that computes something else when sharded (a
    ``shard_map`` that forgets its ``psum``, a host callback). It cannot catch a
    wrong annotation, which changes where arrays live but not the numbers:
    that is ``assert_layout``'s job.

    >>> import jax, jax.numpy as jnp
    >>> from minishard import AxisRules, make_mesh, mlp
    >>> n = jax.device_count()
    >>> model = mlp([8, 2 * n, 4], key=jax.random.key(0), axes=[("embed", "mlp"), ("mlp", "embed")])
    >>> mesh, rules = make_mesh({"model": n}), AxisRules(embed=None, mlp="model")
    >>> def forward(model, x):
    ...     return model(x)
    >>> assert_sharded_equivalent(forward, model, jnp.ones((4, 8)), mesh=mesh, rules=rules).shape
    (4, 4)
    """
    sharded = _sharded(fn, mesh, rules, batch_axis)
    declared = sharded.specs(*args).outputs
    # jax.block_until_ready after each run: dispatching sharded programs back to
    # back can deadlock the collectives of simulated CPU devices.
    # Through the host: an array typed for an Explicit mesh keeps that type on one device.
    on_one_device = jax.device_put(jax.device_get(args), mesh.devices.flat[0])
    expected = jax.block_until_ready(_jitted(reference or fn)(*on_one_device))
    actual = jax.block_until_ready(sharded(*args))
    treedef: Any = jax.tree_util.tree_structure(actual)  # Any: PyTreeDef comes without type stubs
    specs = treedef.flatten_up_to(declared)  # None where Sharded left the layout to XLA
    leaves = zip(jax.tree_util.tree_leaves_with_path(actual), jax.tree_util.tree_leaves(expected), specs)
    for (path, got), want, spec in leaves:
        where = f"output {path_str(path)}"
        np.testing.assert_allclose(got, want, rtol, atol, err_msg=f"{where}: sharded != unsharded")
        if spec is not None and not NamedSharding(mesh, spec).is_equivalent_to(got.sharding, got.ndim):
            raise AssertionError(f"{where}: has sharding {got.sharding}, but Sharded declared {spec}")
    return actual


_SHARDED: dict[Any, ShardedFunction] = {}


def _sharded(fn: Callable[..., Any], mesh: Mesh, rules: AxisRules | None, batch_axis: str | None) -> Any:
    """``Sharded(mesh, rules, batch_axis)(fn)``, kept across examples: its plans and jit are reused.

    (``jax.jit`` would find the compiled program anyway; this also skips
    re-planning and re-tracing, which a shrinking failure would repeat hundreds of times.)
    """
    key = (fn, mesh, _rules_key(rules), batch_axis)
    if key not in _SHARDED:
        if len(_SHARDED) > 256:
            _SHARDED.clear()
        _SHARDED[key] = Sharded(mesh, rules, batch_axis)(fn)
    return _SHARDED[key]


@functools.lru_cache(maxsize=64)
def _jitted(fn: Callable[..., Any]) -> Any:
    return jax.jit(fn)


# --- 6. layout ------------------------------------------------------------------

Layout = PartitionSpec | tuple[int, ...] | LogicalAxes
"""What an array's layout must be: a spec, each device's block shape, or logical axes (through the rules)."""


def assert_layout(tree: Any, mesh: Mesh, expected: Any, *, rules: AxisRules | None = None) -> None:
    """Every array of ``tree`` must be laid out on ``mesh`` as ``expected`` says.

    The layout is read from the arrays themselves (``.sharding`` and the
    ``addressable_shards`` each device holds), not from minishard's plan: put
    in ``tree`` what ``shard`` placed or a ``Sharded`` function returned.
    ``expected`` maps a leaf's path, as ``minishard.tree.path_str`` writes it
    (``"inner.layers[0].weight"``), to one of

    * a ``PartitionSpec``: the array's sharding must be equivalent to it;
    * a block shape, a tuple of ints: the block every device of the mesh holds;
    * logical axes, a tuple of names or None: the spec ``rules`` give them.
      This checks the model's annotations against your intention under these
      rules; state a spec or a block to check the rules too.

    ``expected`` may instead be a pytree shaped like ``tree`` holding those (a
    ``None`` there is not checked). Arrays not listed are not checked; a path
    that names no array fails, since a typo would otherwise check nothing. All
    mismatches are reported together: the path, the expected and actual
    layouts, and, with ``rules``, the logical axes the model gave the array and
    what each rule did with them (``AxisRules.explain``).

    >>> import jax
    >>> from minishard import AxisRules, make_mesh, mlp, shard
    >>> n = jax.device_count()
    >>> mesh, rules = make_mesh({"model": n}), AxisRules(embed=None, mlp="model")
    >>> model = shard(mlp([4, 8 * n, 4], key=jax.random.key(0), axes=[("embed", "mlp"), ("mlp", "embed")]),
    ...               mesh, rules)
    >>> assert_layout(model, mesh, {"layers[0].weight": (4, 8), "layers[2].weight": ("mlp", "embed"),
    ...                             "layers[2].bias": PartitionSpec()}, rules=rules)
    """
    arrays = {path_str(path): array for path, array in jax.tree_util.tree_leaves_with_path(tree)}
    wanted = {path: want for path, want in _expected_by_path(tree, expected).items() if want is not None}
    if unknown := sorted(set(wanted) - set(arrays)):
        raise AssertionError(
            f"assert_layout: {unknown} name no array of the tree; its arrays are {list(arrays)}"
        )
    given_rules, rules = rules, rules or IDENTITY_RULES
    problems = {
        path: p for path, want in wanted.items() if (p := _layout_problem(arrays[path], mesh, want, rules))
    }
    if problems:
        why = _why(tree, mesh, given_rules) if given_rules else lambda path: ""
        raise AssertionError(
            f"assert_layout: {len(problems)} of {len(wanted)} arrays are not laid out as expected on mesh "
            f"{dict(mesh.shape)}:\n" + "\n".join(f"{path}: {p}{why(path)}" for path, p in problems.items())
        )


def _expected_by_path(tree: Any, expected: Any) -> dict[str, Any]:
    """``{path: layout}`` from either form of ``expected``."""
    if isinstance(expected, Mapping) and all(
        isinstance(key, str) and (value is None or isinstance(value, PartitionSpec | tuple))
        for key, value in expected.items()
    ):
        return dict(expected)
    treedef: Any = jax.tree_util.tree_structure(tree)
    try:  # the layouts sit where tree has arrays: tuples there are taken whole, not as subtrees
        flat = treedef.flatten_up_to(expected)
    except (ValueError, TypeError) as e:
        raise TypeError(
            f"assert_layout: expected is neither {{path: layout}} nor shaped like the tree: {e}"
        ) from None
    return {path_str(path): want for (path, _), want in zip(jax.tree_util.tree_leaves_with_path(tree), flat)}


def _layout_problem(array: Any, mesh: Mesh, want: Layout, rules: AxisRules) -> str | None:
    """What is wrong with ``array``'s layout, or None if it is the one wanted."""
    if not isinstance(array, jax.Array):
        kind = f"{type(array).__module__}.{type(array).__name__}"
        return f"is not on the mesh: a {kind}, not a jax.Array (place it with minishard.shard)"
    # addressable_shards: one per device of this process, each holding that device's block
    blocks = sorted({shard.data.shape for shard in array.addressable_shards})
    got = array.sharding.spec if isinstance(array.sharding, NamedSharding) else array.sharding
    actual = f"got {got}, blocks {', '.join(map(str, blocks))}"
    if array.sharding.device_set != set(mesh.devices.flat):
        return f"is on {len(array.sharding.device_set)} device(s), not on the mesh's {mesh.size}; {actual}"
    if not isinstance(want, PartitionSpec | tuple):
        raise TypeError(
            f"assert_layout: expected a PartitionSpec, a block shape or logical axes, got {want!r}"
        )
    if isinstance(want, tuple) and all(isinstance(d, int) and not isinstance(d, bool) for d in want):
        return None if blocks == [want] else f"expected blocks {want}, {actual}"
    if isinstance(want, PartitionSpec):
        spec, stated = want, f"{want}"
    elif all(a is None or isinstance(a, str) for a in want):
        spec = rules.spec(want, mesh)  # type: ignore[arg-type]  # tuple[str | None, ...] by the test above
        stated = f"{want} -> {spec}"
    else:
        raise TypeError(f"assert_layout: {want!r} is neither a block shape (ints) nor logical axes (names)")
    if NamedSharding(mesh, spec).is_equivalent_to(array.sharding, array.ndim):
        return None
    block = tuple(
        size // split_count(mesh, entry) for size, entry in zip(array.shape, _padded(spec, array.ndim))
    )
    return f"expected {stated}, blocks {block}; {actual}"


def _padded(spec: PartitionSpec, ndim: int) -> tuple[MeshAxes, ...]:
    return tuple(spec) + (None,) * (ndim - len(spec))


def _why(tree: Any, mesh: Mesh, rules: AxisRules) -> Callable[[str], str]:
    """For a Layer parameter's path: the logical axes the model gave it, and ``AxisRules.explain``."""
    try:
        leaves = {leaf.path: leaf.logical_axes for leaf in plan(tree, mesh, rules).leaves}
    except ShardingError:
        leaves = {}

    def why(path: str) -> str:
        axes = leaves.get(path)
        if axes is None:
            return ""
        if all(axis is None for axis in axes):
            return f"\n  the model does not annotate it: logical axes {axes}"
        trace = str(rules.explain(axes, mesh)).replace("\n", "\n    ")
        return f"\n  the model names its axes {axes}; under {rules}:\n    {trace}"

    return why


# --- 7. communication -----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Limit:
    """At most ``count`` collective instructions, and ``bytes`` bytes per device, of those selected.

    ``kind`` selects one kind (``"all-gather"``, see ``minishard.census.KINDS``),
    ``None`` every kind; ``over`` the ones whose device groups span this mesh
    axis (or all of these axes, perhaps more), ``None`` any.

    >>> print(Limit("all-gather", count=0), Limit("all-reduce", over="data", count=1), sep="; ")
    no all-gather; all-reduce over 'data': at most 1
    >>> print(Limit(over="model", bytes=4096))
    any collective over 'model': at most 4.1 kB per device
    """

    kind: str | None = None
    over: str | tuple[str, ...] | None = None
    count: int | None = None
    bytes: int | None = None

    def __post_init__(self) -> None:
        if self.kind is not None and self.kind not in KINDS:
            raise ValueError(f"Limit: kind {self.kind!r} is none of {KINDS}")
        if self.count is None and self.bytes is None:
            raise ValueError(f"Limit({self.kind!r}): give a count, bytes or both")

    def selects(self, kind: str, groups: tuple[tuple[str, ...], ...]) -> bool:
        """Does this limit count an instruction of ``kind`` over these device groups?"""
        spans = [{axis.partition("(")[0] for axis in group} for group in groups]  # "y(2 of 4)" spans y
        wanted = set(as_mesh_axes(self.over))
        return (self.kind is None or kind == self.kind) and any(wanted <= axes for axes in spans)

    def __str__(self) -> str:
        what = (self.kind or "any collective") + (f" over {self.over!r}" if self.over is not None else "")
        if self.count == 0:
            return f"no {what}"
        bounds = [str(self.count)] if self.count is not None else []
        bounds += [f"{human_bytes(self.bytes)} per device"] if self.bytes is not None else []
        return f"{what}: at most {', '.join(bounds)}"


Program = jax.stages.Lowered | jax.stages.Compiled | str


def assert_collectives(
    program: Program | Callable[..., Any],
    *limits: Limit,
    args: Sequence[Any] = (),
    mesh: Mesh | None = None,
    rules: AxisRules | None = None,
    exhaustive: bool = False,
) -> dict[str, Collective]:
    """The compiled ``program`` must stay within every ``Limit``; returns its collectives.

    ``program`` is a ``jit(f).lower(...)``, its ``.compile()``, HLO text (pass
    ``mesh``), or a function to compile with ``args``: a ``Sharded`` (or
    ``jax.jit``) function, or a plain one, then wrapped in ``Sharded(mesh, rules)``.
    With ``exhaustive=True`` the limits list *all* the program may send: a
    collective that no limit selects fails too. The failure names every broken
    limit with what was found, then prints the program's collectives.

    Budgets to start from: ``data_parallel_limits`` and ``megatron_limits``.
    """
    name = getattr(getattr(program, "fn", program), "__name__", "the program")
    compiled: jax.stages.Compiled | str
    if isinstance(program, jax.stages.Compiled | str):
        compiled = program
    elif isinstance(program, jax.stages.Lowered):
        compiled = program.compile()  # once, for both readings below
    else:
        step: Any = program
        if not hasattr(step, "lower"):
            if mesh is None:
                raise TypeError("assert_collectives: a plain function needs mesh= (and rules=) to compile it")
            step = _sharded(step, mesh, rules, None)
        compiled = step.lower(*args).compile()
    # Collectives exist only in the compiled HLO: XLA's SPMD partitioner inserts them there.
    found = list(instructions(compiled, mesh))
    broken = []
    for limit in limits:
        selected = [nbytes for kind, nbytes, groups in found if limit.selects(kind, groups)]
        if (limit.count is not None and len(selected) > limit.count) or (
            limit.bytes is not None and sum(selected) > limit.bytes
        ):
            broken.append(f"  {limit}; found {len(selected)}, {human_bytes(sum(selected))}")
    if exhaustive:
        for kind, nbytes, groups in found:
            if not any(limit.selects(kind, groups) for limit in limits):
                over = ", ".join(map(str, groups))
                broken.append(f"  {kind} over {over} ({human_bytes(nbytes)}): no limit allows it")
    table = collectives(compiled, mesh)
    if broken:
        raise AssertionError(
            f"assert_collectives: {name} breaks its communication budget:\n"
            + "\n".join(broken)
            + "\nits collectives:\n  "
            + summary(table).replace("\n", "\n  ")
        )
    return table


def data_parallel_limits(params: Any, *, over: str = "data", scalars: int = 1) -> list[Limit]:
    """The least a data-parallel training step sends: the gradients once, and its scalar outputs.

    Every device holds all of ``params`` and computes gradients on its slice of
    the batch, so one all-reduce over ``over`` must sum ``tree_bytes(params)``
    (XLA may split or fuse it into several instructions, so only bytes are
    bounded), plus 4 bytes for each of ``scalars`` float32 means (a loss).
    Use with ``exhaustive=True``: nothing else is needed.

    >>> import jax
    >>> from minishard import mlp
    >>> print(*data_parallel_limits(mlp([4, 8, 2], key=jax.random.key(0))))
    all-reduce over 'data': at most 236 B per device
    """
    return [Limit("all-reduce", over=over, bytes=tree_bytes(params) + 4 * scalars)]


def megatron_limits(
    activations: Sequence[int], *, pairs: int = 1, over: str = "model", dtype: Any = np.float32
) -> list[Limit]:
    """The least a Megatron MLP's forward pass sends: one all-reduce of its output per pair of Linears.

    In a ``("embed", "mlp")`` then ``("mlp", "embed")`` pair with ``mlp``
    split over ``over``, each device computes a partial sum of the pair's
    output from its slice of the hidden units; one all-reduce over ``over``
    adds them up. ``activations`` is that output's block on one device,
    e.g. ``(batch // mesh.shape["data"], embed)``. Use with ``exhaustive=True``.

    >>> print(*megatron_limits((4, 16)))
    all-reduce over 'model': at most 1, 256 B per device
    """
    nbytes = math.prod(activations) * np.dtype(dtype).itemsize
    return [Limit("all-reduce", over=over, count=pairs, bytes=pairs * nbytes)]


# --- 8. hypothesis profiles -----------------------------------------------------


def register_profiles() -> tuple[str, ...]:
    """Register hypothesis profiles for compiling tests; ``settings.load_profile("minishard")``.

    * ``"minishard"``: 10 examples (each may compile), no deadline (the first
      example of a shape compiles, the next ones do not: timings vary 100x),
      no health check for slow data generation, and a failure reported as soon
      as it is shrunk: no hunt for further distinct bugs, no explain phase
      (each re-runs the test many times);
    * ``"minishard-ci"``: the same, derandomized, so CI runs the same examples
      every time, and printing the reproduction blob;
    * ``"minishard-dev"``: 50 examples, to search harder locally.

    Registered when ``minishard.testing`` is imported; calling again is harmless.
    Load one in ``conftest.py``, or build on one for a single test:
    ``@settings(settings.get_profile("minishard"), max_examples=3)``.
    """
    base = settings(
        max_examples=10,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        report_multiple_bugs=False,
        phases=[phase for phase in Phase if phase != Phase.explain],
    )
    settings.register_profile("minishard", base)
    settings.register_profile("minishard-ci", base, derandomize=True, print_blob=True)
    settings.register_profile("minishard-dev", base, max_examples=50)
    return ("minishard", "minishard-ci", "minishard-dev")


register_profiles()


__all__ = [
    "DEFAULT_CHOICES",
    "LINEAR_AXES",
    "MULTIPLES",
    "Layout",
    "Limit",
    "assert_collectives",
    "assert_layout",
    "assert_sharded_equivalent",
    "axis_rules",
    "batch_sizes",
    "batches",
    "data_parallel_limits",
    "megatron_limits",
    "meshes",
    "mlps",
    "models",
    "register_profiles",
    "seeds",
    "split_counts",
    "splittable_widths",
    "width_units",
]
