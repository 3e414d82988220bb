"""From "this weight's logical axes are ('embed', 'mlp')" to a sharded ``jax.jit``.

Spreading a model over devices takes four steps, one per section below:

1. **Mesh.** Arrange the devices in a named grid, e.g. ``{"data": 2, "model": 4}``.
2. **Rules** (``minishard.rules``). Map *logical axes*, chosen by the model
   author (``"embed"``, ``"mlp"``, ``"batch"``), to *mesh axes*, chosen by
   whoever runs the model on some hardware (``"model"``, ``"data"``).
3. **Plan.** One walk over a whole tree (a model, an optimizer state, a
   step's arguments): each array's logical axes go through the rules and come
   out as a ``PartitionSpec``, one entry per dimension naming the mesh axes it
   is split over (``None``: not split), checked to divide evenly.
   ``partition_specs``, ``shard``, ``minishard.explain`` and ``Sharded`` all read
   this one ``Plan``.
4. **Jit.** ``Sharded`` plans a function's arguments and outputs and hands the
   specs to ``jax.jit`` as ``in_shardings`` / ``out_shardings``. XLA's SPMD
   partitioner then splits the program and inserts the collectives (all-reduce,
   all-gather, ...) that the shardings imply; ``minishard.collectives`` makes
   them visible.

The path of one parameter: ``Linear(axes=("embed", "mlp"))`` stores its
``logical_axes``; ``plan`` asks the layer for ``param_logical_axes()`` and the
rules for ``spec(...)``; ``Sharded`` wraps the specs in ``NamedSharding``\\ s for
``jax.jit``, whose compiled program holds the collectives.

>>> import jax
>>> from minishard import megatron_axes, mlp
>>> rules = AxisRules(embed=None, mlp="model", classes=None)
>>> model = mlp([8, 16, 4], key=jax.random.key(0), axes=megatron_axes(2))
>>> [spec for spec in jax.tree_util.tree_leaves(partition_specs(model, rules))]
[P(None, 'model'), P('model',), P('model', None), P(None,)]
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from minishard import _diagnose, _sharding
from minishard._diagnose import is_deleted
from minishard.constraints import DEFAULT_BATCH_AXIS, LogicalSharding
from minishard.layers import Layer
from minishard.rules import (
    IDENTITY_RULES,
    AnyMesh,
    AxisRules,
    LogicalAxes,
    P,
    ShardingError,
    split_count,
)
from minishard.tree import path_str

# --- 1. the mesh -------------------------------------------------------------


def make_mesh(
    shape: Mapping[str, int] | Sequence[int],
    names: Sequence[str] | None = None,
    devices: Sequence[jax.Device] | None = None,
    *,
    explicit: bool = False,
) -> Mesh:
    """A named device grid: ``make_mesh({"data": 2, "model": 4})``.

    The axes are ``AxisType.Auto``: shardings are *hints* to XLA's GSPMD
    partitioner, which propagates them through the program and inserts the
    collectives itself. ``explicit=True`` makes them ``Explicit`` (what
    ``jax.make_mesh`` gives by default): shardings become part of every array's
    type, and an ambiguous layout is an error at trace time (docs/explicit.md).
    minishard's models run unchanged on both.

    >>> make_mesh({"data": 2, "model": 4}).shape
    OrderedDict([('data', 2), ('model', 4)])
    """
    names, sizes = _diagnose.mesh_shape(shape, names)
    devices = list(jax.devices() if devices is None else devices)
    _diagnose.mesh_devices(names, sizes, devices)
    kind = AxisType.Explicit if explicit else AxisType.Auto
    return jax.make_mesh(sizes, names, axis_types=(kind,) * len(sizes), devices=devices)


# --- 2. one plan for a whole tree --------------------------------------------


@dataclass(frozen=True)
class LeafPlan:
    """How one array is laid out: where it is, its logical axes, its spec, each device's block."""

    path: str  # "layers[0].weight"
    shape: tuple[int, ...]  # the whole array
    logical_axes: LogicalAxes  # ("embed", "mlp")
    spec: PartitionSpec  # what the rules made of them: P(None, "model")
    block_shape: tuple[int, ...]  # the block each device holds (the whole shape without a mesh)


@dataclass(frozen=True)
class Plan:
    """``specs``: a pytree of PartitionSpecs shaped like the tree; ``leaves``: one ``LeafPlan`` per array."""

    specs: Any
    leaves: tuple[LeafPlan, ...]


OutsideLayers = Callable[[Any], "tuple[LogicalAxes, PartitionSpec] | None"]
"""How to lay out an array that no Layer annotates; ``None``: leave it to XLA."""


def replicated(leaf: Any) -> tuple[LogicalAxes, PartitionSpec]:
    """The default for arrays outside Layers: a full copy on every device."""
    return (None,) * np.ndim(leaf), P()


def plan(
    tree: Any, mesh: AnyMesh | None, rules: AxisRules | None = None, outside: OutsideLayers = replicated
) -> Plan:
    """The one walk: every array of ``tree`` gets its spec, checked against ``mesh``.

    Parameters of Layers (anywhere in the tree, user containers included) get
    the spec their ``param_logical_axes`` map to under ``rules``; arrays outside
    Layers ask ``outside`` (replicated by default; ``Sharded`` splits a batch).
    With a mesh, the rules are checked against it once and every split
    dimension must divide evenly; without one, nothing is checked.

    >>> import jax
    >>> from minishard import Linear
    >>> layer = Linear(8, 16, key=jax.random.key(0), axes=("embed", "mlp"))
    >>> mesh = jax.sharding.AbstractMesh((4,), ("model",))
    >>> plan(layer, mesh, AxisRules(embed=None, mlp="model")).leaves[0].block_shape
    (8, 4)
    """
    rules = rules or IDENTITY_RULES
    if mesh is not None:
        rules.check_mesh(mesh)
    leaves: list[LeafPlan] = []
    specs = _walk(tree, (), rules, mesh, outside, leaves)
    return Plan(specs, tuple(leaves))


def _walk(
    tree: Any,
    prefix: tuple[Any, ...],
    rules: AxisRules,
    mesh: AnyMesh | None,
    outside: OutsideLayers,
    out: list,
) -> Any:
    """``tree`` with every array replaced by its spec; appends a LeafPlan per array to ``out``."""
    entries, treedef = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda node: isinstance(node, Layer)
    )
    specs: list[Any] = []
    for path, node in entries:
        path = prefix + path
        if isinstance(node, Layer):
            specs.append(_walk_layer(node, path, rules, mesh, out))
        elif (layout := outside(node)) is None:
            specs.append(None)  # unspecified: XLA chooses
        else:
            specs.append(layout[1])
            out.append(_leaf_plan(path, tuple(np.shape(node)), *layout, mesh))
    return jax.tree_util.tree_unflatten(treedef, specs)


def _walk_layer(
    layer: Layer, path: tuple[Any, ...], rules: AxisRules, mesh: AnyMesh | None, out: list
) -> Layer:
    """The layer itself, with every parameter replaced by its PartitionSpec."""
    logical_axes = layer.param_logical_axes()
    children, aux_data = layer.tree_flatten()
    specs = []
    for name, child in zip(layer.param_fields, children):
        child_path = (*path, jax.tree_util.GetAttrKey(name))
        if name not in logical_axes:  # a sub-tree (e.g. Sequential.layers): recurse
            # Arrays in it that no Layer annotates are parameters, never a batch: replicated.
            specs.append(_walk(child, child_path, rules, mesh, replicated, out))
            continue
        axes, shape = logical_axes[name], tuple(child.shape)
        spec = _diagnose.param_spec(path_str(child_path), axes, shape, rules, mesh)
        out.append(_leaf_plan(child_path, shape, axes, spec, mesh))
        specs.append(spec)
    return type(layer).tree_unflatten(aux_data, specs)


def _leaf_plan(
    path: tuple[Any, ...],
    shape: tuple[int, ...],
    axes: LogicalAxes,
    spec: PartitionSpec,
    mesh: AnyMesh | None,
) -> LeafPlan:
    """Each split dimension must divide evenly by the size of its mesh axes."""
    _diagnose.divisible(path_str(path), shape, axes, spec, mesh)
    entries = tuple(spec) + (None,) * (len(shape) - len(spec))
    ways = [1 if mesh is None else split_count(mesh, entry) for entry in entries]
    return LeafPlan(path_str(path), shape, axes, spec, tuple(s // w for s, w in zip(shape, ways)))


def partition_specs(tree: Any, rules: AxisRules | None = None, mesh: AnyMesh | None = None) -> Any:
    """A pytree of ``PartitionSpec`` with exactly the structure of ``tree`` (``plan(...).specs``).

    Pass ``mesh`` so that logical axes with no rule can fall back to mesh axes
    of the same name, and so that every split is checked to divide evenly.
    """
    return plan(tree, mesh, rules).specs


def named_shardings(specs: Any, mesh: Mesh) -> Any:
    """PartitionSpec leaves -> ``NamedSharding(mesh, spec)``; ``None`` (unspecified) stays None.

    Each spec is checked first: a PartitionSpec that names only axes of ``mesh``.
    """
    jax.tree_util.tree_map_with_path(lambda path, spec: _diagnose.spec_on_mesh(path, spec, mesh), specs)
    return jax.tree_util.tree_map(lambda spec: NamedSharding(mesh, spec), specs)


def shard(tree: Any, mesh: Mesh, rules: AxisRules | None = None) -> Any:
    """Place every array of ``tree`` on ``mesh`` as its plan says.

    The whole plan is made (and checked) before anything is placed, so an
    indivisible dimension raises ``ShardingError`` naming the leaf and leaves
    no arrays half-moved.
    """
    return jax.device_put(tree, named_shardings(plan(tree, mesh, rules).specs, mesh))


# --- 3. the decorator --------------------------------------------------------


class Specs(NamedTuple):
    """The specs ``Sharded`` derived for one call: per positional argument, and for the output."""

    inputs: tuple[Any, ...]
    outputs: Any


class Sharded:
    """Decorator: ``jax.jit`` with shardings derived from the arguments.

    * pytrees holding Layers (a model, an optimizer state whose velocities are
      model-shaped) get their partition specs;
    * other arrays with ``ndim >= 1`` are a batch: their leading dimension is
      split over the mesh axes of ``rules[batch_axis]`` (or of the mesh axis
      named ``batch_axis``), otherwise they are replicated; scalars are replicated;
    * outputs (found with ``jax.eval_shape``): Layer pytrees get their specs, so
      a returned model keeps its parameters' shardings; scalars (a loss) come
      back replicated; other arrays are left to XLA.

    The mesh, the rules and where the batch goes are one ``LogicalSharding``,
    built here once: the same object ``minishard.constrain`` reads while ``fn`` traces.

    >>> import jax, jax.numpy as jnp
    >>> from minishard import mlp
    >>> mesh = make_mesh({"data": 8})
    >>> model = mlp([4, 8, 2], key=jax.random.key(0))
    >>> forward = Sharded(mesh, AxisRules(batch="data"))(lambda m, x: m(x))
    >>> forward(model, jnp.ones((16, 4))).sharding.spec
    P('data',)
    """

    def __init__(
        self,
        mesh: Mesh,
        rules: AxisRules | None = None,
        batch_axis: str | None = None,
        donate_argnums: int | Sequence[int] = (),
    ) -> None:
        rules = rules or IDENTITY_RULES
        _diagnose.one_kind_of_axes(mesh)
        rules.check_mesh(mesh)
        _diagnose.batch_axis_known(batch_axis, rules, mesh)
        self.logical_sharding = LogicalSharding(mesh, rules, batch_axis or DEFAULT_BATCH_AXIS)
        self.donate_argnums = donate_argnums

    # Read from the one environment, never copied: ``constrain`` sees the same values.
    mesh = property(lambda self: self.logical_sharding.mesh)
    rules = property(lambda self: self.logical_sharding.rules)
    batch_axis = property(lambda self: self.logical_sharding.batch_axis)

    def __call__(self, fn: Callable[..., Any]) -> ShardedFunction:
        """Wrap ``fn``; nothing is traced or compiled until the first call."""
        return ShardedFunction(fn, self)

    @property
    def batch_sharding(self) -> NamedSharding:
        """Where a global batch goes: leading dimension split over the batch mesh axes."""
        return NamedSharding(self.mesh, P(self.logical_sharding.batch_target))

    def batch_layout(self, leaf: Any) -> tuple[LogicalAxes, PartitionSpec]:
        """Arrays outside Layers: leading dim over the batch mesh axes; scalars replicated."""
        ndim, target = np.ndim(leaf), self.logical_sharding.batch_target
        if ndim == 0 or target is None:
            return (None,) * ndim, P()
        return (self.batch_axis,) + (None,) * (ndim - 1), P(target)

    def plan_inputs(self, args: tuple[Any, ...]) -> Plan:
        """The plan of a call's arguments: Layers' parameters by the rules, the rest by ``batch_layout``."""
        return plan(args, self.mesh, self.rules, self.batch_layout)


class _Compiled(NamedTuple):
    jitted: Any  # jax.jit(fn, in_shardings=..., out_shardings=...)
    specs: Specs
    in_shardings: tuple[NamedSharding, ...]  # one per leaf of the arguments
    donated: tuple[int, ...]  # positions, in the flattened arguments, of the donated leaves


class ShardedFunction:
    """What ``Sharded(mesh)(fn)`` returns: call it like ``fn``; inspect with ``specs`` and ``lower``.

    ``__call__``, ``specs`` and ``lower`` take one path, ``_lookup(args)``:

    * **first call** for an argument structure: ``_build`` plans the arguments,
      finds the output shapes with ``jax.eval_shape``, plans them too, and
      makes the ``jax.jit``; the result is cached under the structure;
    * **every later call**: one ``tree_flatten`` and two dict lookups find the
      cached ``jax.jit``, which is called directly.

    When jit refuses a call, ``minishard._diagnose`` says which argument was wrong.
    """

    def __init__(self, fn: Callable[..., Any], config: Sharded) -> None:
        self.fn, self.config = fn, config
        self.name = getattr(fn, "__name__", "function")
        self.arg_names = _diagnose.positional_names(fn)  # None: any number (*args, or no signature)
        self.donated_args = _diagnose.donate_argnums(self.name, config.donate_argnums, self.arg_names)
        # treedef -> (positions of the leaves outside Layers, {which of them are scalars: jit})
        self._cache: dict[Any, tuple[tuple[int, ...], dict[tuple[bool, ...], _Compiled]]] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs:
            _diagnose.keywords(self.name, kwargs)
        compiled, leaves = self._lookup(args)
        # A donated array is deleted after the call it was given to; handing it to XLA
        # again would crash the process (XLA:CPU), so look first. Free without donation.
        if compiled.donated and any(is_deleted(leaves[i]) for i in compiled.donated):
            _diagnose.failed_call(self, args, compiled.in_shardings)
        try:
            return compiled.jitted(*leaves)
        except (TypeError, ValueError, RuntimeError) as error:  # JAX's generic errors, in minishard's terms
            _diagnose.failed_call(self, args, compiled.in_shardings)
            raise error

    def specs(self, *args: Any) -> Specs:
        """The input and output PartitionSpecs ``Sharded`` derives for these arguments."""
        return self._lookup(args)[0].specs

    def lower(self, *args: Any) -> jax.stages.Lowered:
        """``jax.jit(...).lower(*args)``: look at the program (``.as_text()``) or compile it."""
        compiled, leaves = self._lookup(args)
        try:
            return compiled.jitted.lower(*leaves)
        except (TypeError, ValueError, RuntimeError) as error:  # the same errors as a call
            _diagnose.failed_call(self, args, compiled.in_shardings)
            raise error

    def _lookup(self, args: tuple[Any, ...]) -> tuple[_Compiled, list[Any]]:
        # The hot path of every training step. Layer parameters' specs follow from the
        # treedef alone (their logical axes are static data); a leaf outside Layers is
        # batch-split unless it is a scalar, so its rank is part of the key. The cached jit
        # takes these leaves, so JAX does not flatten the arguments a second time.
        leaves, treedef = jax.tree_util.tree_flatten(args)
        found = self._cache.get(treedef)
        if found is None:
            found = self._cache[treedef] = (_sharding.positions_outside_layers(args), {})
        outside, by_scalars = found
        scalars = tuple([getattr(leaves[i], "ndim", 0) == 0 for i in outside])
        compiled = by_scalars.get(scalars)
        if compiled is None:
            compiled = by_scalars[scalars] = self._build(args, leaves, treedef)
        return compiled, leaves

    def _build(self, args: tuple[Any, ...], leaves: list[Any], treedef: Any) -> _Compiled:
        """Plan the arguments, trace for the outputs' shapes, plan them, make the ``jax.jit``."""
        _diagnose.arrays(self, args)
        try:
            inputs = self.config.plan_inputs(args).specs
        except ShardingError as e:
            raise ShardingError(_diagnose.name_argument(self, str(e))) from None
        mesh, env = self.config.mesh, self.config.logical_sharding
        in_shardings = tuple(jax.tree_util.tree_leaves(named_shardings(inputs, mesh)))
        traced = env.wrap(self._on_leaves(treedef, in_shardings))  # constrain inside fn reads env
        outputs = self._plan_outputs(self._eval_shape(traced, args, leaves))
        donated = _sharding.leaf_positions(args, self.donated_args)
        jitted = jax.jit(  # over the flat leaves: __call__ has them already, so JAX flattens nothing
            traced,
            in_shardings=in_shardings,
            out_shardings=named_shardings(outputs, mesh),
            donate_argnums=donated,
        )
        return _Compiled(jitted, Specs(inputs, outputs), in_shardings, donated)

    def _on_leaves(self, treedef: Any, in_shardings: tuple[NamedSharding, ...]) -> Callable[..., Any]:
        """``fn`` over the flat leaves, as jit and eval_shape trace it."""
        fn, typed = self.fn, _sharding.typed if self.config.logical_sharding.explicit else _sharding.as_given

        def on_leaves(*leaves: Any) -> Any:  # traced once per key: rebuilding the trees here is free
            return fn(*jax.tree_util.tree_unflatten(treedef, typed(leaves, in_shardings)))

        on_leaves.__name__ = on_leaves.__qualname__ = self.name  # the program keeps fn's name
        return on_leaves

    def _plan_outputs(self, out_shapes: Any) -> Any:
        """The outputs' specs: Layers' parameters by the rules, scalars replicated, the rest XLA's."""
        try:
            return plan(out_shapes, self.config.mesh, self.config.rules, _scalars_replicated).specs
        except ShardingError as e:
            raise ShardingError(f"{self.name}: output {e}") from None

    def _eval_shape(self, traced: Callable[..., Any], args: tuple[Any, ...], leaves: list[Any]) -> Any:
        """``jax.eval_shape`` of the function jit will trace; an Explicit mesh's ambiguity is named."""
        try:
            return jax.eval_shape(traced, *leaves)
        except Exception as error:
            _diagnose.ambiguous_layout(self, args, Layer, error)
            raise


def _scalars_replicated(leaf: Any) -> tuple[LogicalAxes, PartitionSpec] | None:
    """Outputs outside Layers: a scalar (a loss) comes back on every device; the rest XLA decides."""
    return replicated(leaf) if np.ndim(leaf) == 0 else None


__all__ = [
    "LeafPlan", "OutsideLayers", "Plan", "Sharded", "ShardedFunction", "Specs", "make_mesh",
    "named_shardings", "partition_specs", "plan", "replicated", "shard"
]  # fmt: skip
