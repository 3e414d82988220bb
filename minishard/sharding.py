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
>>> from minishard import mlp
>>> rules = AxisRules(embed=None, mlp="model")
>>> model = mlp([8, 16, 4], key=jax.random.key(0), axes=[("embed", "mlp"), ("mlp", "embed")])
>>> [spec for spec in jax.tree_util.tree_leaves(partition_specs(model, rules))]
[P(None, 'model'), P('model',), P('model', None), P(None,)]
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from minishard.constraints import DEFAULT_BATCH_AXIS, logical_sharding
from minishard.layers import Layer
from minishard.rules import (
    IDENTITY_RULES,
    AnyMesh,
    AxisRules,
    LogicalAxes,
    P,
    ShardingError,
    as_mesh_axes,
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
    if isinstance(shape, Mapping):
        if names is not None:
            raise ShardingError(f"make_mesh: {dict(shape)} already names its axes; drop names={names}")
        names, sizes = tuple(shape), tuple(shape.values())
    else:
        sizes = tuple(shape)
        if names is None or len(names) != len(sizes):
            raise ShardingError(f"make_mesh: shape {sizes} needs one name per axis, got names={names}")
        names = tuple(names)
    if bad := [
        f"{n}={s!r}" for n, s in zip(names, sizes) if isinstance(s, bool) or not isinstance(s, int) or s < 1
    ]:
        raise ShardingError(f"make_mesh: axis sizes must be positive ints, got {', '.join(bad)}")
    if twice := sorted({n for n in names if names.count(n) > 1}):
        raise ShardingError(
            f"make_mesh: mesh axis {twice} named twice in {names}; each axis needs its own name"
        )
    devices = list(jax.devices() if devices is None else devices)
    if math.prod(sizes) != len(devices):
        platform = devices[0].platform if devices else "none"
        raise ShardingError(
            f"make_mesh: mesh {dict(zip(names, sizes))} needs {math.prod(sizes)} devices, but "
            f"{len(devices)} {platform} device(s) were given. To simulate N CPU devices, set "
            "XLA_FLAGS=--xla_force_host_platform_device_count=N before JAX is first imported."
        )
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
        where, axes, shape = path_str(child_path), logical_axes[name], tuple(child.shape)
        if len(axes) != len(shape):
            raise ShardingError(f"{where}: logical axes {axes} name {len(axes)} dims; its shape is {shape}")
        try:
            spec = rules.spec(axes, mesh)
        except ShardingError as e:
            raise ShardingError(f"{where}: {e}") from None
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
    entries = tuple(spec) + (None,) * (len(shape) - len(spec))
    block = []
    for dim, (size, entry) in enumerate(zip(shape, entries)):
        ways = 1 if mesh is None else split_count(mesh, entry)
        if size % ways:
            sizes = ", ".join(f"{a!r}={mesh.shape[a]}" for a in as_mesh_axes(entry))  # type: ignore[union-attr]
            raise ShardingError(
                f"{path_str(path)}: shape {shape}, dimension {dim} (logical axis {axes[dim]!r}) has "
                f"size {size}, which mesh axis {sizes} cannot split evenly; choose sizes divisible "
                f"by {ways} or change the rules"
            )
        block.append(size // ways)
    return LeafPlan(path_str(path), shape, axes, spec, tuple(block))


def partition_specs(tree: Any, rules: AxisRules | None = None, mesh: AnyMesh | None = None) -> Any:
    """A pytree of ``PartitionSpec`` with exactly the structure of ``tree`` (``plan(...).specs``).

    Pass ``mesh`` so that logical axes with no rule can fall back to mesh axes
    of the same name, and so that every split is checked to divide evenly.
    """
    return plan(tree, mesh, rules).specs


def named_shardings(specs: Any, mesh: Mesh) -> Any:
    """PartitionSpec leaves -> ``NamedSharding(mesh, spec)``; ``None`` (unspecified) stays None."""
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
        kinds = set(mesh.axis_types)
        if len(kinds) > 1:
            raise ShardingError(
                f"Sharded: mesh axes {dict(zip(mesh.axis_names, mesh.axis_types))} mix Auto and Explicit; "
                "minishard supports meshes of one kind: make_mesh(..., explicit=True) or explicit=False"
            )
        self.mesh = mesh
        self.rules = rules or IDENTITY_RULES
        self.rules.check_mesh(mesh)
        knows = lambda name: name in self.rules or name in mesh.axis_names  # noqa: E731
        if batch_axis is not None and not knows(batch_axis):
            raise ShardingError(
                f"Sharded: batch_axis={batch_axis!r} has no rule in {self.rules} and is no mesh axis "
                f"{mesh.axis_names}; add a rule such as AxisRules({batch_axis}='data')"
            )
        self.batch_axis = batch_axis or DEFAULT_BATCH_AXIS
        self.donate_argnums = donate_argnums
        self._batch_entry = self.rules.spec((self.batch_axis,), mesh)[0] if knows(self.batch_axis) else None

    def __call__(self, fn: Callable[..., Any]) -> ShardedFunction:
        """Wrap ``fn``; nothing is traced or compiled until the first call."""
        return ShardedFunction(fn, self)

    @property
    def batch_sharding(self) -> NamedSharding:
        """Where a global batch goes: leading dimension split over the batch mesh axes."""
        return NamedSharding(self.mesh, P(self._batch_entry))

    def logical_sharding(self) -> contextlib.AbstractContextManager[None]:
        """The context ``fn`` traces in: ``minishard.constrain`` resolves with this mesh and these rules."""
        return logical_sharding(self.mesh, self.rules, self.batch_axis, self._batch_entry)

    def batch_layout(self, leaf: Any) -> tuple[LogicalAxes, PartitionSpec]:
        """Arrays outside Layers: leading dim over the batch mesh axes; scalars replicated."""
        ndim = np.ndim(leaf)
        if ndim == 0 or self._batch_entry is None:
            return (None,) * ndim, P()
        return (self.batch_axis,) + (None,) * (ndim - 1), P(self._batch_entry)


class _Compiled(NamedTuple):
    jitted: Any  # jax.jit(fn, in_shardings=..., out_shardings=...)
    specs: Specs
    donated: tuple[int, ...]  # positions, in the flattened arguments, of the donated leaves


class ShardedFunction:
    """What ``Sharded(mesh)(fn)`` returns: call it like ``fn``; inspect with ``specs`` and ``lower``.

    ``__call__``, ``specs`` and ``lower`` take one path, ``_lookup(args)``:

    * **first call** for an argument structure: ``_build`` plans the arguments,
      finds the output shapes with ``jax.eval_shape``, plans them too, and
      makes the ``jax.jit``; the result is cached under the structure;
    * **every later call**: one ``tree_flatten`` and two dict lookups find the
      cached ``jax.jit``, which is called directly.
    """

    def __init__(self, fn: Callable[..., Any], config: Sharded) -> None:
        self.fn = fn
        self.config = config
        self.name = getattr(fn, "__name__", "function")
        # treedef -> (positions of the leaves outside Layers, {which of them are scalars: jit})
        self._cache: dict[Any, tuple[tuple[int, ...], dict[tuple[bool, ...], _Compiled]]] = {}
        try:
            self._arg_names = list(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            self._arg_names = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs:
            raise TypeError(
                f"Sharded function {self.name!r}: pass arguments by position; "
                f"shardings are derived per positional argument, got keywords {sorted(kwargs)}"
            )
        compiled, leaves = self._lookup(args)
        # A donated array is deleted after the call it was given to; handing it to XLA
        # again would crash the process (XLA:CPU), so look first. Free without donation.
        if compiled.donated and any(_is_deleted(leaves[i]) for i in compiled.donated):
            self._diagnose(args, compiled.specs)
        try:
            return compiled.jitted(*leaves)
        except (ValueError, RuntimeError) as error:  # explain JAX's generic errors in minishard's terms
            self._diagnose(args, compiled.specs)
            raise error

    def specs(self, *args: Any) -> Specs:
        """The input and output PartitionSpecs ``Sharded`` derives for these arguments."""
        return self._lookup(args)[0].specs

    def lower(self, *args: Any) -> jax.stages.Lowered:
        """``jax.jit(...).lower(*args)``: look at the program (``.as_text()``) or compile it."""
        compiled, leaves = self._lookup(args)
        return compiled.jitted.lower(*leaves)

    def _lookup(self, args: tuple[Any, ...]) -> tuple[_Compiled, list[Any]]:
        # The hot path of every training step. Layer parameters' specs follow from the
        # treedef alone (their logical axes are static data); a leaf outside Layers is
        # batch-split unless it is a scalar, so its rank is part of the key. The cached jit
        # takes these leaves, so JAX does not flatten the arguments a second time.
        leaves, treedef = jax.tree_util.tree_flatten(args)
        found = self._cache.get(treedef)
        if found is None:
            found = self._cache[treedef] = (_positions_outside_layers(args), {})
        outside, by_scalars = found
        scalars = tuple([getattr(leaves[i], "ndim", 0) == 0 for i in outside])
        compiled = by_scalars.get(scalars)
        if compiled is None:
            compiled = by_scalars[scalars] = self._build(args, treedef)
        return compiled, leaves

    def _build(self, args: tuple[Any, ...], treedef: Any) -> _Compiled:
        config, mesh = self.config, self.config.mesh
        try:
            inputs = plan(args, mesh, config.rules, config.batch_layout).specs
        except ShardingError as e:
            raise ShardingError(self._name_argument(str(e))) from None
        with self.config.logical_sharding():
            out_shapes = self._eval_shape(args)
        try:
            outputs = plan(out_shapes, mesh, config.rules, _scalars_replicated).specs
        except ShardingError as e:
            raise ShardingError(f"{self.name}: output {e}") from None
        donate = (config.donate_argnums,) if isinstance(config.donate_argnums, int) else config.donate_argnums
        starts = np.cumsum([0] + [len(jax.tree_util.tree_leaves(arg)) for arg in args])
        donated = tuple(i for a in donate for i in range(starts[a], starts[a + 1]))
        fn, logical = self.fn, self.config.logical_sharding

        def on_leaves(*leaves: Any) -> Any:  # traced once per key: rebuilding the trees here is free
            with logical():  # minishard.constrain inside fn resolves logical axes with our rules
                return fn(*jax.tree_util.tree_unflatten(treedef, leaves))

        on_leaves.__name__ = on_leaves.__qualname__ = self.name  # the program keeps fn's name

        jitted = jax.jit(  # over the flat leaves: __call__ has them already, so JAX flattens nothing
            on_leaves,
            in_shardings=tuple(jax.tree_util.tree_leaves(named_shardings(inputs, mesh))),
            out_shardings=named_shardings(outputs, mesh),
            donate_argnums=donated,
        )
        return _Compiled(jitted, Specs(inputs, outputs), donated)

    def _eval_shape(self, args: tuple[Any, ...]) -> Any:
        """``jax.eval_shape(fn, *args)``; an ambiguous sharding (Explicit mesh) names its layer."""
        fn = self.fn
        try:
            # A fresh function: jax.eval_shape caches its trace under the function it is given,
            # and this trace (inside logical_sharding) must never be reused by a plain jax.jit(fn).
            return jax.eval_shape(lambda *args: fn(*args), *args)
        except Exception as error:
            if type(error).__name__ != "ShardingTypeError":  # jax._src.core's: not exported
                raise
            layer = _innermost_layer(error)
            where = f"in {_paths_of(args, type(layer), self._arg_names)}: " if layer is not None else ""
            raise ShardingError(
                f"{self.name}: {where}{str(error).splitlines()[0]} On an Explicit mesh a contraction over "
                "a split dimension must say where its output goes: pass "
                "out_sharding=minishard.constraints.output_sharding(<the output's logical axes>) to "
                "jnp.matmul/jnp.einsum, as minishard's Linear does"
            ) from None

    def _name_argument(self, message: str) -> str:
        """``[0].layers[0].weight`` -> ``model.layers[0].weight``, using fn's parameter names."""
        index, _, rest = message.removeprefix("[").partition("]")
        if message.startswith("[") and index.isdigit() and int(index) < len(self._arg_names):
            message = self._arg_names[int(index)] + rest
        return f"{self.name}: argument {message}"

    def _diagnose(self, args: tuple[Any, ...], specs: Specs) -> None:
        """After jit refused a call: raise a ShardingError that names the argument, if we can."""
        config = self.config
        try:  # another batch size under a cached structure: is it still divisible?
            plan(args, config.mesh, config.rules, config.batch_layout)
        except ShardingError as e:
            raise ShardingError(self._name_argument(str(e))) from None
        expected = jax.tree_util.tree_leaves(named_shardings(specs.inputs, config.mesh))
        for (path, arg), want in zip(jax.tree_util.tree_leaves_with_path(args), expected):
            where = path_str(path)
            if _is_deleted(arg):
                raise ShardingError(
                    self._name_argument(
                        f"{where}: was deleted, because it was donated to an earlier call "
                        f"(donate_argnums={config.donate_argnums}); pass the arrays that call returned"
                    )
                )
            if getattr(arg, "committed", False) and not arg.sharding.is_equivalent_to(want, arg.ndim):
                raise ShardingError(
                    self._name_argument(
                        f"{where}: is committed to {arg.sharding}, but Sharded derived {want}. "
                        "Place it with minishard.shard(tree, mesh, rules) (or jax.device_put with "
                        "that sharding) before the call."
                    )
                )


def _innermost_layer(error: BaseException) -> Layer | None:
    """The last Layer whose method the traceback passes through: where the error happened."""
    layer, frame = None, error.__traceback__
    while frame is not None:
        if isinstance(candidate := frame.tb_frame.f_locals.get("self"), Layer):
            layer = candidate
        frame = frame.tb_next
    return layer


def _paths_of(args: tuple[Any, ...], kind: type, names: list[str]) -> str:
    """Where in the arguments Layers of type ``kind`` sit: ``model.layers[2] (Bilinear)``."""
    found = []
    for path, node in jax.tree_util.tree_flatten_with_path(args, is_leaf=lambda n: type(n) is kind)[0]:
        if type(node) is kind:
            index, _, rest = path_str(path).removeprefix("[").partition("]")  # "[0].layers[2]"
            found.append(names[int(index)] + rest if index.isdigit() and int(index) < len(names) else rest)
    return f"{' or '.join(found) or 'a layer'} ({kind.__name__})"


def _is_deleted(leaf: Any) -> bool:
    return getattr(leaf, "is_deleted", bool)()  # numpy arrays are never donated away


def _positions_outside_layers(tree: Any) -> tuple[int, ...]:
    """Indices, in ``tree_leaves(tree)``, of the leaves that do not belong to a Layer."""
    positions, index = [], 0
    for node in jax.tree_util.tree_leaves(tree, is_leaf=lambda node: isinstance(node, Layer)):
        if isinstance(node, Layer):
            index += len(jax.tree_util.tree_leaves(node))
        else:
            positions.append(index)
            index += 1
    return tuple(positions)


def _scalars_replicated(leaf: Any) -> tuple[LogicalAxes, PartitionSpec] | None:
    """Outputs outside Layers: a scalar (a loss) comes back on every device; the rest XLA decides."""
    return replicated(leaf) if np.ndim(leaf) == 0 else None
