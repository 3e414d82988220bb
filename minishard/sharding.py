"""From "this weight's axes are ('embed', 'mlp')" to a sharded ``jax.jit``.

Spreading a model over devices takes four steps, one per section below:

1. **Mesh.** Arrange the devices in a named grid, e.g. ``{"data": 2, "model": 4}``.
2. **Rules** (``minishard.rules``). Map *logical* axis names, chosen by the
   model author (``"embed"``, ``"mlp"``, ``"batch"``), to *mesh* axis names,
   chosen by whoever runs the model on some hardware (``"model"``, ``"data"``).
3. **Specs.** Each parameter's logical axes go through the rules and come out
   as a ``PartitionSpec``: one entry per array dimension naming the mesh axis
   it is split over (``None``: not split). ``partition_specs`` does this for a
   whole model; ``shard`` places the arrays accordingly.
4. **Jit.** ``Sharded`` derives ``in_shardings`` / ``out_shardings`` from the
   arguments and hands them to ``jax.jit``. XLA's SPMD partitioner then splits
   the program and inserts the collectives (all-reduce, all-gather, ...) that
   the shardings imply; ``minishard.collectives`` makes them visible.

>>> import jax
>>> from minishard import mlp
>>> rules = AxisRules(embed=None, mlp="model")
>>> model = mlp([8, 16, 4], key=jax.random.key(0), axes=[("embed", "mlp"), ("mlp", "embed")])
>>> [spec for spec in jax.tree_util.tree_leaves(partition_specs(model, rules))]
[P(None, 'model'), P('model',), P('model', None), P(None,)]
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from minishard.layers import Axes, Layer
from minishard.rules import IDENTITY_RULES, AxisRules, P, ShardingError, as_mesh_axes, split_count
from minishard.tree import path_str

# --- 1. the mesh -------------------------------------------------------------


def make_mesh(
    shape: Mapping[str, int] | Sequence[int],
    names: Sequence[str] | None = None,
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """A named device grid: ``make_mesh({"data": 2, "model": 4})``.

    The axes are ``AxisType.Auto``: shardings are *hints* to XLA's GSPMD
    partitioner, which propagates them through the program and inserts the
    collectives itself. (``jax.make_mesh`` now defaults to ``Explicit`` axes,
    where shardings become part of every array's type; minishard teaches the
    automatic path first.)

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
    devices = list(jax.devices() if devices is None else devices)
    if math.prod(sizes) != len(devices):
        platform = devices[0].platform if devices else "none"
        raise ShardingError(
            f"make_mesh: mesh {dict(zip(names, sizes))} needs {math.prod(sizes)} devices, but "
            f"{len(devices)} {platform} device(s) were given. To simulate N CPU devices, set "
            "XLA_FLAGS=--xla_force_host_platform_device_count=N before JAX is first imported."
        )
    return jax.make_mesh(sizes, names, axis_types=(AxisType.Auto,) * len(sizes), devices=devices)


# --- 2. specs for whole trees ------------------------------------------------


@dataclass(frozen=True)
class LeafPlan:
    """How one array leaf is laid out: its path, shape, logical axes and spec."""

    path: str
    shape: tuple[int, ...]
    logical: Axes
    spec: PartitionSpec

    def check_divisible(self, mesh: Mesh) -> None:
        """Each split dimension must divide evenly by the size of its mesh axes."""
        for dim, entry in enumerate(self.spec):
            if self.shape[dim] % (ways := split_count(mesh, entry)):
                sizes = ", ".join(f"{a!r}={mesh.shape[a]}" for a in as_mesh_axes(entry))
                raise ShardingError(
                    f"{self.path}: shape {self.shape}, dimension {dim} (logical axis "
                    f"{self.logical[dim]!r}) has size {self.shape[dim]}, which mesh axis {sizes} cannot "
                    f"split evenly; choose sizes divisible by {ways} or change the rules"
                )

    def shard_shape(self, mesh: Mesh) -> tuple[int, ...]:
        """The block each device holds."""
        return tuple(
            size // split_count(mesh, entry)
            for size, entry in zip(self.shape, tuple(self.spec) + (None,) * len(self.shape))
        )


LeafSpec = Callable[[Any], "tuple[Axes, PartitionSpec] | None"]


def _is_layer(node: Any) -> bool:
    return isinstance(node, Layer)


def _plan(
    tree: Any, rules: AxisRules, mesh: Mesh | None, leaf_spec: LeafSpec, prefix: tuple[Any, ...] = ()
) -> tuple[Any, list[LeafPlan]]:
    """Walk ``tree``: Layers answer with their ``param_axes``, other leaves ask ``leaf_spec``.

    Returns the tree of specs (same structure as ``tree``) and one plan per leaf.
    """
    entries, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_layer)
    specs: list[Any] = []
    plans: list[LeafPlan] = []
    for path, node in entries:
        path = prefix + path
        if isinstance(node, Layer):
            layer_specs, layer_plans = _plan_layer(node, rules, mesh, path)
            specs.append(layer_specs)
            plans += layer_plans
        elif (axes_and_spec := leaf_spec(node)) is None:
            specs.append(None)  # unspecified: XLA chooses
        else:
            specs.append(axes_and_spec[1])
            plans.append(LeafPlan(path_str(path), tuple(np.shape(node)), *axes_and_spec))
    return jax.tree_util.tree_unflatten(treedef, specs), plans


def _plan_layer(
    layer: Layer, rules: AxisRules, mesh: Mesh | None, path: tuple[Any, ...]
) -> tuple[Layer, list[LeafPlan]]:
    """The layer itself, with every parameter replaced by its PartitionSpec."""
    param_axes = layer.param_axes()
    children, aux_data = layer.tree_flatten()
    specs, plans = [], []
    for name, child in zip(layer.param_fields, children):
        child_path = (*path, jax.tree_util.GetAttrKey(name))
        if name not in param_axes:  # a sub-tree (e.g. Sequential.layers): recurse
            # Arrays in it that no Layer annotates are parameters, never a batch: replicated.
            spec, child_plans = _plan(child, rules, mesh, _replicated, child_path)
            plans += child_plans
        else:
            where, axes, shape = path_str(child_path), param_axes[name], tuple(child.shape)
            if len(axes) != len(shape):
                raise ShardingError(
                    f"{where}: logical axes {axes} name {len(axes)} dims; its shape is {shape}"
                )
            try:
                spec = rules.spec(axes, mesh)
            except ShardingError as e:
                raise ShardingError(f"{where}: {e}") from None
            plans.append(LeafPlan(where, shape, axes, spec))
        specs.append(spec)
    return type(layer).tree_unflatten(aux_data, specs), plans


def _replicated(leaf: Any) -> tuple[Axes, PartitionSpec]:
    return (None,) * np.ndim(leaf), P()


def partition_specs(tree: Any, rules: AxisRules | None = None, mesh: Mesh | None = None) -> Any:
    """A pytree of ``PartitionSpec`` with exactly the structure of ``tree``.

    Parameters of Layers (anywhere in the tree, user containers included) get
    the spec their ``param_axes`` map to under ``rules``; any other array leaf
    is replicated (``P()``). Pass ``mesh`` so names with no rule can fall back
    to mesh axes of the same name.
    """
    return _plan(tree, rules or IDENTITY_RULES, mesh, _replicated)[0]


def _checked_plan(tree: Any, rules: AxisRules, mesh: Mesh, leaf_spec: LeafSpec) -> tuple[Any, list[LeafPlan]]:
    """``_plan`` on a known mesh, with every split dimension checked to divide evenly."""
    specs, plans = _plan(tree, rules, mesh, leaf_spec)
    for leaf in plans:
        leaf.check_divisible(mesh)
    return specs, plans


def plan(tree: Any, mesh: Mesh, rules: AxisRules | None = None) -> list[LeafPlan]:
    """One ``LeafPlan`` per array leaf of ``tree``, checked against ``mesh``."""
    rules = rules or IDENTITY_RULES
    rules.check_mesh(mesh)
    return _checked_plan(tree, rules, mesh, _replicated)[1]


def named_shardings(specs: Any, mesh: Mesh) -> Any:
    """PartitionSpec leaves -> ``NamedSharding(mesh, spec)``; ``None`` (unspecified) stays None."""
    return jax.tree_util.tree_map(lambda spec: NamedSharding(mesh, spec), specs)


def shard(tree: Any, mesh: Mesh, rules: AxisRules | None = None) -> Any:
    """Place every array of ``tree`` on ``mesh`` as its partition spec says.

    Everything is checked before anything is placed, so an indivisible
    dimension raises ``ShardingError`` naming the leaf and leaves no arrays
    half-moved.
    """
    rules = rules or IDENTITY_RULES
    rules.check_mesh(mesh)
    specs = _checked_plan(tree, rules, mesh, _replicated)[0]  # validates every leaf first
    return jax.device_put(tree, named_shardings(specs, mesh))


# --- 3. the decorator --------------------------------------------------------


class Specs(NamedTuple):
    """The specs ``Sharded`` derived for one call: per positional argument, and for the output."""

    inputs: tuple[Any, ...]
    outputs: Any


class Sharded:
    """Decorator: ``jax.jit`` with shardings derived from the arguments.

    * pytrees holding Layers (a model, an optimizer state whose momentum is
      model-shaped) get their partition specs;
    * other arrays with ``ndim >= 1`` are a batch: their leading dimension is
      split over the mesh axes of ``rules[batch_axis]`` (or of the mesh axis
      named ``batch_axis``), otherwise they are replicated; scalars are replicated;
    * outputs (found with ``jax.eval_shape``): Layer pytrees get their specs, so
      a returned model keeps its parameters' shardings; scalars (a loss) come
      back replicated; other arrays are left to XLA.

    One ``jax.jit`` is built per input structure and cached, so a training
    step pays one ``tree_flatten`` and two dict lookups on top of ``jax.jit``.

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
        batch_axis: str = "batch",
        donate_argnums: int | Sequence[int] = (),
    ) -> None:
        self.mesh = mesh
        self.rules = rules or IDENTITY_RULES
        self.rules.check_mesh(mesh)
        self.batch_axis = batch_axis
        self.donate_argnums = donate_argnums
        knows_batch = batch_axis in self.rules or batch_axis in mesh.axis_names
        self._batch_entry = self.rules.spec((batch_axis,), mesh)[0] if knows_batch else None

    def __call__(self, fn: Callable[..., Any]) -> ShardedFunction:
        """Wrap ``fn``; nothing is traced or compiled until the first call."""
        return ShardedFunction(fn, self)

    @property
    def batch_sharding(self) -> NamedSharding:
        """Where a global batch goes: leading dimension split over the batch mesh axes."""
        return NamedSharding(self.mesh, P(self._batch_entry))

    def batch_spec(self, leaf: Any) -> tuple[Axes, PartitionSpec]:
        """Arrays outside Layers: leading dim over the batch mesh axes; scalars replicated."""
        ndim = np.ndim(leaf)
        if ndim == 0 or self._batch_entry is None:
            return (None,) * ndim, P()
        return (self.batch_axis,) + (None,) * (ndim - 1), P(self._batch_entry)


def _positions_outside_layers(tree: Any) -> tuple[int, ...]:
    """Indices, in ``tree_leaves(tree)``, of the leaves that do not belong to a Layer."""
    positions, index = [], 0
    for node in jax.tree_util.tree_leaves(tree, is_leaf=_is_layer):
        if isinstance(node, Layer):
            index += len(jax.tree_util.tree_leaves(node))
        else:
            positions.append(index)
            index += 1
    return tuple(positions)


def _output_spec(leaf: Any) -> tuple[Axes, PartitionSpec] | None:
    return _replicated(leaf) if np.ndim(leaf) == 0 else None  # None: left to XLA


class ShardedFunction:
    """What ``Sharded(mesh)(fn)`` returns: call it like ``fn``; inspect with ``specs`` and ``lower``."""

    def __init__(self, fn: Callable[..., Any], config: Sharded) -> None:
        self.fn = fn
        self.config = config
        self._jitted: dict[Any, Any] = {}  # (treedef, which batch leaves are scalars) -> jax.jit(...)
        self._batch_leaves: dict[Any, tuple[int, ...]] = {}  # treedef -> positions of leaves outside Layers
        try:
            self._arg_names = list(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            self._arg_names = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs:
            raise TypeError(
                f"Sharded function {getattr(self.fn, '__name__', '')!r}: pass arguments by position; "
                f"shardings are derived per positional argument, got keywords {sorted(kwargs)}"
            )
        # The hot path of every training step: one flatten and two dict lookups on top of jax.jit.
        # Layer parameters' specs follow from the treedef alone (their axes are static data);
        # a leaf outside Layers is batch-split unless it is a scalar, so its rank is part of the key.
        leaves, treedef = jax.tree_util.tree_flatten(args)
        batch_leaves = self._batch_leaves.get(treedef)
        if batch_leaves is None:
            batch_leaves = self._batch_leaves[treedef] = _positions_outside_layers(args)
        key = (treedef, *[getattr(leaves[i], "ndim", 0) == 0 for i in batch_leaves])
        jitted = self._jitted.get(key)
        if jitted is None:
            jitted = self._jitted[key] = self._build(args)
        try:
            return jitted(*args)
        except ValueError as error:  # diagnose JAX's generic errors in minishard's terms
            self._diagnose(args)
            raise error

    def specs(self, *args: Any) -> Specs:
        """The input and output PartitionSpecs ``Sharded`` derives for these arguments."""
        config = self.config
        try:
            inputs = _checked_plan(args, config.rules, config.mesh, config.batch_spec)[0]
        except ShardingError as e:
            raise ShardingError(self._name_arguments(str(e))) from None
        out_shapes = jax.eval_shape(self.fn, *args)
        try:
            outputs = _checked_plan(out_shapes, config.rules, config.mesh, _output_spec)[0]
        except ShardingError as e:
            name = getattr(self.fn, "__name__", "function")
            raise ShardingError(f"{name}: output {e}") from None
        return Specs(inputs, outputs)

    def lower(self, *args: Any) -> jax.stages.Lowered:
        """``jax.jit(...).lower(*args)``: look at the program (``.as_text()``) or compile it."""
        return self._build(args).lower(*args)

    def _build(self, args: tuple[Any, ...]) -> Any:
        in_specs, out_specs = self.specs(*args)
        mesh = self.config.mesh
        return jax.jit(
            self.fn,
            in_shardings=named_shardings(in_specs, mesh),
            out_shardings=named_shardings(out_specs, mesh),
            donate_argnums=self.config.donate_argnums,
        )

    def _name_arguments(self, message: str) -> str:
        """``[0].layers[0].weight`` -> ``model.layers[0].weight``, using fn's parameter names."""
        index, _, rest = message.removeprefix("[").partition("]")
        if message.startswith("[") and index.isdigit() and int(index) < len(self._arg_names):
            message = self._arg_names[int(index)] + rest
        return f"{getattr(self.fn, '__name__', 'function')}: argument {message}"

    def _diagnose(self, args: tuple[Any, ...]) -> None:
        """After jit refused the call: raise a ShardingError that names the argument, if we can."""
        try:
            in_specs = _checked_plan(args, self.config.rules, self.config.mesh, self.config.batch_spec)[0]
        except ShardingError as e:
            raise ShardingError(self._name_arguments(str(e))) from None
        expected = jax.tree_util.tree_leaves(named_shardings(in_specs, self.config.mesh))
        for (path, arg), want in zip(jax.tree_util.tree_leaves_with_path(args), expected):
            if getattr(arg, "committed", False) and not arg.sharding.is_equivalent_to(want, arg.ndim):
                got = arg.sharding
                raise ShardingError(
                    self._name_arguments(
                        f"{path_str(path)}: is committed to {got}, but Sharded derived {want}. "
                        "Place it with minishard.shard(tree, mesh, rules) (or jax.device_put with "
                        "that sharding) before the call."
                    )
                )
