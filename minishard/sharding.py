"""From "this weight's logical axes are ('embed', 'mlp')" to a sharded ``jax.jit``.

Spreading a model over devices takes four steps, one per section below:

1. **Mesh.** Arrange the devices in a named grid, e.g. ``{"data": 2, "model": 4}``
   (``make_mesh``).
2. **Rules** (``minishard.rules``). Map *logical axes*, chosen by the model
   author (``"embed"``, ``"mlp"``, ``"batch"``), to *mesh axes*, chosen by
   whoever runs the model on some hardware (``"model"``, ``"data"``).
3. **Plan.** One walk over a whole tree (a model, an optimizer state, a
   step's arguments): each array's logical axes go through the rules and come
   out as a ``PartitionSpec``, one entry per dimension naming the mesh axes it
   is split over (``None``: not split), checked to divide evenly.
   ``partition_specs``, ``shard``, ``minishard.explain`` and ``Sharded`` all read
   this one ``Plan``: a ``LeafPlan`` per array, and ``named_shardings`` puts its specs
   on a mesh. An array outside the Layers is laid out by ``OutsideLayers``
   (``replicated`` unless ``Sharded`` splits it as a batch).
4. **Jit.** ``Sharded`` plans a function's arguments and outputs and hands the
   specs to ``jax.jit`` as ``in_shardings`` / ``out_shardings``. XLA's SPMD
   partitioner then splits the program and inserts the collectives (all-reduce,
   all-gather, ...) that the shardings imply; ``minishard.collectives`` makes
   them visible. The ``ShardedFunction`` it returns says its ``Specs``.

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
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from minishard import _checks, _diagnose
from minishard.constraints import DEFAULT_BATCH_AXIS, LogicalSharding
from minishard.layers import Layer
from minishard.rules import IDENTITY_RULES, AnyMesh, AxisRules, LogicalAxes, P, ShardingError
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
    type, and an ambiguous sharding is an error at trace time (docs/explicit.md).
    minishard's models run unchanged on both.

    >>> make_mesh({"data": 2, "model": 4}).shape
    OrderedDict([('data', 2), ('model', 4)])
    """
    _checks.mesh_shape(shape, names)
    if isinstance(shape, Mapping):
        axis_names = tuple(shape)
        sizes = tuple(shape.values())
    else:
        axis_names = tuple(names or ())
        sizes = tuple(shape)
    devices = list(jax.devices() if devices is None else devices)
    _checks.mesh_devices(axis_names, sizes, devices)
    kind = AxisType.Explicit if explicit else AxisType.Auto
    return jax.make_mesh(sizes, axis_names, axis_types=(kind,) * len(sizes), devices=devices)


# --- 2. one plan for a whole tree --------------------------------------------


@dataclass(frozen=True)
class LeafPlan:
    """How one array is laid out: where it is, its logical axes, its spec, each device's shard."""

    path: str  # "layers[0].weight"
    shape: tuple[int, ...]  # the whole array
    logical_axes: LogicalAxes  # ("embed", "mlp")
    spec: PartitionSpec  # what the rules made of them: P(None, "model")
    shard_shape: tuple[int, ...]  # the shard each device holds (the whole shape without a mesh)


@dataclass(frozen=True)
class Plan:
    """``specs``: PartitionSpecs shaped like the tree; ``leaves``: one ``LeafPlan`` per array."""

    specs: Any
    leaves: tuple[LeafPlan, ...]


OutsideLayers = Callable[[Any], "tuple[LogicalAxes, PartitionSpec] | None"]
"""How to lay out an array that no Layer annotates; ``None``: leave it to XLA."""


def replicated(leaf: Any) -> tuple[LogicalAxes, PartitionSpec]:
    """The default for arrays outside Layers: a full copy on every device."""
    return (None,) * np.ndim(leaf), P()


def plan(
    tree: Any,
    mesh: AnyMesh | None,
    rules: AxisRules | None = None,
    outside: OutsideLayers = replicated,
) -> Plan:
    """The one walk: every array of ``tree`` gets its spec, checked against ``mesh``.

    Parameters of Layers (anywhere in the tree, user containers included) get
    the spec their ``param_logical_axes`` map to under ``rules``, after the
    leading axes a container names for its sub-tree (``Stacked``: ``"stage"``);
    arrays outside Layers ask ``outside`` (replicated by default; ``Sharded``
    splits a batch).
    With a mesh, the rules are checked against it once and every split
    dimension must divide evenly; without one, nothing is checked.

    >>> import jax
    >>> from minishard import Linear
    >>> layer = Linear(8, 16, key=jax.random.key(0), axes=("embed", "mlp"))
    >>> mesh = jax.sharding.AbstractMesh((4,), ("model",))
    >>> plan(layer, mesh, AxisRules(embed=None, mlp="model")).leaves[0].shard_shape
    (8, 4)
    """
    rules = rules or IDENTITY_RULES
    if mesh is not None:
        rules.check_mesh(mesh)
    walk = _Walk(rules, mesh, outside)
    return Plan(walk.tree(tree, ()), tuple(walk.leaves))


@dataclass
class _Walk:
    """One walk over a tree: what it plans with, and the ``LeafPlan`` of each array so far."""

    rules: AxisRules
    mesh: AnyMesh | None
    outside: OutsideLayers
    leaves: list[LeafPlan] = field(default_factory=list)

    def tree(self, tree: Any, path: tuple[Any, ...], leading: LogicalAxes | None = None) -> Any:
        """``tree`` with every array replaced by its spec.

        ``leading`` is None outside Layers; inside one, the logical axes its arrays lead with:
        ``("stage",)`` in a ``Stacked`` block, ``()`` elsewhere.
        """
        is_layer = lambda node: isinstance(node, Layer)  # noqa: E731
        entries, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_layer)
        specs: list[Any] = []
        for where, node in entries:
            at = (*path, *where)
            if isinstance(node, Layer):
                specs.append(self.layer(node, at, leading or ()))
            elif leading:  # an array of a stacked block that no Layer annotates: split by the stack
                unnamed = (None,) * (np.ndim(node) - len(leading))
                specs.append(self.param(at, node, (*leading, *unnamed)))
            elif (placed := (self.outside if leading is None else replicated)(node)) is None:
                specs.append(None)  # unspecified: XLA chooses
            else:  # as ``outside`` says; in a Layer's sub-tree, unannotated: a replicated parameter
                specs.append(placed[1])
                self.leaves.append(_leaf_plan(at, tuple(np.shape(node)), *placed, self.mesh))
        return jax.tree_util.tree_unflatten(treedef, specs)

    def layer(self, layer: Layer, path: tuple[Any, ...], leading: LogicalAxes) -> Layer:
        """The layer, each parameter replaced by its spec: its own axes after ``leading``."""
        annotated = layer.param_logical_axes()
        children, aux_data = layer.tree_flatten()
        specs = []
        for name, child in zip(layer.param_fields, children):
            at = (*path, jax.tree_util.GetAttrKey(name))
            axes = (*leading, *annotated.get(name, ()))
            if name in annotated and hasattr(child, "shape"):  # an array: its logical axes
                specs.append(self.param(at, child, axes))
            else:
                # a sub-tree (Sequential.layers; Stacked.block, led by "stage"), or an
                # unannotated array
                specs.append(self.tree(child, at, axes))
        return type(layer).tree_unflatten(aux_data, specs)

    def param(self, path: tuple[Any, ...], array: Any, axes: LogicalAxes) -> PartitionSpec:
        """Logical axes -> spec, through the rules: the plan's heart. An error names the path."""
        where = path_str(path)
        shape = tuple(np.shape(array))
        _checks.logical_axes(where, axes, shape)
        try:
            spec = self.rules.spec(axes, self.mesh)
        except ShardingError as e:
            raise e.retold(lambda why: f"{where}: {why}") from None
        self.leaves.append(_leaf_plan(path, shape, axes, spec, self.mesh))
        return spec


def _leaf_plan(
    path: tuple[Any, ...],
    shape: tuple[int, ...],
    axes: LogicalAxes,
    spec: PartitionSpec,
    mesh: AnyMesh | None,
) -> LeafPlan:
    """Each split dimension must divide evenly; each device then holds JAX's ``shard_shape``."""
    where = path_str(path)
    _checks.divisible(where, shape, axes, spec, mesh)
    shard = shape if mesh is None else NamedSharding(mesh, spec).shard_shape(shape)
    return LeafPlan(where, shape, axes, spec, shard)


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
    for path, spec in jax.tree_util.tree_leaves_with_path(specs):
        _checks.spec_on_mesh(path_str(path), spec, mesh)
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

    On an Explicit mesh (``make_mesh(..., explicit=True)``) a sharding is part of
    every array's type: an input not yet placed (a numpy array, a fresh model)
    would trace unsharded, so ``Sharded`` reshards it to the type its
    ``in_shardings`` give it (``_typed``, a relabel at trace time: free per call).

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
        _checks.one_kind_of_axes(mesh)
        rules.check_mesh(mesh)
        _checks.batch_axis_known(batch_axis, rules, mesh)
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

    def batch_placement(self, leaf: Any) -> tuple[LogicalAxes, PartitionSpec]:
        """Arrays outside Layers: leading dim over the batch mesh axes; scalars replicated."""
        ndim = np.ndim(leaf)
        target = self.logical_sharding.batch_target
        if ndim == 0 or target is None:
            return (None,) * ndim, P()
        return (self.batch_axis,) + (None,) * (ndim - 1), P(target)

    def plan_inputs(self, args: tuple[Any, ...]) -> Plan:
        """A call's arguments: Layers' parameters by the rules, the rest by ``batch_placement``."""
        return plan(args, self.mesh, self.rules, self.batch_placement)


class _Compiled(NamedTuple):
    jitted: Any  # jax.jit(fn, in_shardings=..., out_shardings=...), called on the arguments
    specs: Specs
    in_shardings: tuple[NamedSharding, ...]  # one per leaf of the arguments (for the diagnosis)
    structure: Structure  # the arguments' structure this jit was planned for


class ShardedFunction:
    """What ``Sharded(mesh)(fn)`` returns: call it like ``fn``; inspect with ``specs`` and
    ``lower``.

    A plan is made per argument *structure* (``_structure``: the treedef and the
    rank of every leaf; the specs follow from it alone):

    * **first call** for a structure: ``_build`` plans the arguments, finds the
      output shapes with ``jax.eval_shape``, plans them too, and makes the
      ``jax.jit``; ``specs`` and ``lower`` look the same plan up;
    * **every later call**: the last call's ``jax.jit`` is called on the
      arguments as they are. Its C++ dispatch flattens them and finds the
      compiled program in its own cache; arguments of another structure make
      it trace anew, and the traced function checks the structure first, so
      the call then looks up (or builds) the plan of its own structure.

    When jit refuses a call, ``minishard._diagnose`` says which argument was wrong.
    """

    def __init__(self, fn: Callable[..., Any], config: Sharded) -> None:
        self.fn = fn
        self.config = config
        self.name = getattr(fn, "__name__", "function")
        _checks.donate_argnums(self.name, config.donate_argnums, fn)
        donate = config.donate_argnums
        # the donated arguments' positions
        self.donated_args = (donate,) if isinstance(donate, int) else tuple(donate)
        self._plans: dict[Structure, _Compiled] = {}
        self._last: _Compiled | None = None  # the plan of the last call

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs:
            _checks.keywords(self.name, kwargs)
        if self._last is None:
            self._last = self._lookup(args)
        compiled = self._last
        # A donated array is deleted after the call it was given to; handing it to XLA
        # again would crash the process (XLA:CPU), so look first. Free without donation.
        if self.donated_args and _any_deleted(args, self.donated_args):
            _diagnose.failed_call(self, args, compiled.in_shardings)
        try:
            # No flatten or look-up in Python: jit's C++ dispatch keys its cache on the
            # structure itself. Sharded's own cost per call on 8 devices, over the same
            # hand-written jit: 64-82 µs -> -2 to 9 µs, paired (docs/benchmarks.md, issue 28).
            return compiled.jitted(*args)
        except (_OtherStructure, TypeError, ValueError, RuntimeError) as error:
            if _structure(args) == compiled.structure:  # JAX's generic errors, in minishard's terms
                _diagnose.failed_call(self, args, compiled.in_shardings)
                raise error
        # not the last call's structure: its own plan, then the call
        self._last = self._lookup(args)
        return self(*args)

    def specs(self, *args: Any) -> Specs:
        """The input and output PartitionSpecs ``Sharded`` derives for these arguments."""
        return self._lookup(args).specs

    def lower(self, *args: Any) -> jax.stages.Lowered:
        """``jax.jit(...).lower(*args)``: look at the program (``.as_text()``) or compile it."""
        compiled = self._lookup(args)
        try:
            return compiled.jitted.lower(*args)
        except (TypeError, ValueError, RuntimeError) as error:  # the same errors as a call
            _diagnose.failed_call(self, args, compiled.in_shardings)
            raise error

    def _lookup(self, args: tuple[Any, ...]) -> _Compiled:
        structure = _structure(args)
        compiled = self._plans.get(structure)
        if compiled is None:
            compiled = self._plans[structure] = self._build(args, structure)
        return compiled

    def _build(self, args: tuple[Any, ...], structure: Structure) -> _Compiled:
        """Plan the arguments, trace for the outputs' shapes, plan them, make the ``jax.jit``."""
        try:
            inputs = self.config.plan_inputs(args).specs
        except ShardingError as e:
            raise e.retold(lambda why: _diagnose.name_argument(self, why)) from None
        mesh = self.config.mesh
        in_shardings = named_shardings(inputs, mesh)
        flat_shardings = tuple(jax.tree_util.tree_leaves(in_shardings))
        traced = self._traced(structure, flat_shardings)
        outputs = self._plan_outputs(self._eval_shape(traced, args))
        jitted = jax.jit(
            traced,
            in_shardings=in_shardings,
            out_shardings=named_shardings(outputs, mesh),
            donate_argnums=self.donated_args,
        )
        return _Compiled(jitted, Specs(inputs, outputs), flat_shardings, structure)

    def _traced(
        self,
        structure: Structure,
        in_shardings: tuple[NamedSharding, ...],
    ) -> Callable[..., Any]:
        """``fn`` as jit and eval_shape trace it, once the arguments are checked to be of
        ``structure``: jit traces anew for arguments of another."""
        fn = self.fn
        explicit = self.config.logical_sharding.explicit

        def checked(*args: Any) -> Any:  # runs once per trace, never per call
            if _structure(args) != structure:
                raise _OtherStructure  # jit traces anew for new arguments: __call__ plans for them
            if explicit:
                leaves, treedef = jax.tree_util.tree_flatten(args)
                args = jax.tree_util.tree_unflatten(treedef, _typed(leaves, in_shardings))
            return fn(*args)

        checked.__name__ = checked.__qualname__ = self.name  # the program keeps fn's name
        # constrain inside fn reads the environment
        return self.config.logical_sharding.wrap(checked)

    def _plan_outputs(self, out_shapes: Any) -> Any:
        """The outputs' specs: Layers' parameters by the rules, scalars replicated, else XLA's."""
        try:
            return plan(out_shapes, self.config.mesh, self.config.rules, _scalars_replicated).specs
        except ShardingError as e:
            raise e.retold(lambda why: f"{self.name}: output {why}") from None

    def _eval_shape(self, traced: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        """``jax.eval_shape`` of what jit will trace; an Explicit mesh's ambiguity is named."""
        try:
            return jax.eval_shape(traced, *args)
        except Exception as error:
            _diagnose.arrays(self, args)  # a leaf that is no array, which jit cannot take
            _diagnose.ambiguous_sharding(self, args, Layer, error)
            raise


def _scalars_replicated(leaf: Any) -> tuple[LogicalAxes, PartitionSpec] | None:
    """Outputs outside Layers: a scalar (a loss) on every device; XLA decides the rest."""
    return replicated(leaf) if np.ndim(leaf) == 0 else None


# --- 4. the structure a plan is for, and the guards of a call ---------------------------------

Structure = tuple[Any, tuple[int, ...]]
"""A call's arguments as a plan sees them: their treedef, and the rank of every leaf."""


class _OtherStructure(Exception):
    """Raised while jit traces arguments of a structure the jit was not planned for."""


def _structure(args: tuple[Any, ...]) -> Structure:
    """The treedef holds the Layers' static fields (their logical axes); the ranks say where a
    batch is split."""
    leaves, treedef = jax.tree_util.tree_flatten(args)
    return treedef, tuple([np.ndim(leaf) for leaf in leaves])


def _typed(leaves: list[Any], shardings: tuple[NamedSharding, ...]) -> list[Any]:
    """Explicit meshes: trace with the types the shardings imply, however the inputs were placed.

    On an Explicit mesh a sharding is part of an array's type. An unplaced input
    (a numpy array, a fresh model) has an unsharded type, so it would trace
    unsharded, as if on one device; ``reshard`` gives it the type ``in_shardings``
    already placed it with: a trace-time relabel, free per call.
    """
    return [
        jax.sharding.reshard(x, s) if jax.typeof(x).sharding.mesh.empty else x
        for x, s in zip(leaves, shardings)
    ]


def _any_deleted(args: tuple[Any, ...], argnums: tuple[int, ...]) -> bool:
    """Was an array of the arguments ``argnums`` donated away by an earlier call?"""
    donated = [args[i] for i in argnums if i < len(args)]
    return any(getattr(leaf, "is_deleted", bool)() for leaf in jax.tree_util.tree_leaves(donated))


__all__ = [
    "LeafPlan",
    "OutsideLayers",
    "Plan",
    "Sharded",
    "ShardedFunction",
    "Specs",
    "make_mesh",
    "named_shardings",
    "partition_specs",
    "plan",
    "replicated",
    "shard",
]
