"""The guards of ``constraints`` and ``sharding``, and ``Sharded``'s diagnosis of a failed call.

A reader may skip this module: each guard is one line in the textbook, and the
diagnosis runs only after ``jax.jit`` refused a call, to say in minishard's terms
which argument was wrong and how to fix it. Every function here raises
``ShardingError`` (a ``ValueError``) or ``TypeError``, or returns without a word.
It imports only ``rules`` and ``tree``, so ``constraints`` (before ``layers``) can use it.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
from jax.sharding import Mesh, PartitionSpec

from minishard.rules import AnyMesh, AxisRules, LogicalAxes, ShardingError, as_mesh_axes, split_count
from minishard.tree import path_str

if TYPE_CHECKING:
    from minishard.sharding import ShardedFunction

__all__: list[str] = []  # private: the textbook calls these by module, ``_diagnose.divisible(...)``


# --- guards: before any work -------------------------------------------------------------


def mesh_shape(shape: Any, names: Any) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """``make_mesh``'s shape and names, checked: a dict, or sizes with one name each."""
    if isinstance(shape, Mapping):
        if names is not None:
            raise ShardingError(f"make_mesh: {dict(shape)} already names its axes; drop names={names}")
        names, sizes = tuple(shape), tuple(shape.values())
    else:
        sizes = tuple(shape)
        if names is None or len(names) != len(sizes):
            raise ShardingError(f"make_mesh: shape {sizes} needs one name per axis, got names={names}")
        names = tuple(names)
    if not sizes:
        raise ShardingError("make_mesh: the mesh has no axes; name at least one, e.g. make_mesh({'data': 8})")
    if bad := [
        f"{n}={s!r}" for n, s in zip(names, sizes) if isinstance(s, bool) or not isinstance(s, int) or s < 1
    ]:
        raise ShardingError(f"make_mesh: axis sizes must be positive ints, got {', '.join(bad)}")
    if twice := sorted({n for n in names if names.count(n) > 1}):
        raise ShardingError(
            f"make_mesh: mesh axis {twice} named twice in {names}; each axis needs its own name"
        )
    return names, sizes


def mesh_devices(names: tuple[str, ...], sizes: tuple[int, ...], devices: Sequence[Any]) -> None:
    """As many devices as the mesh has places."""
    if not devices:
        raise ShardingError(
            f"make_mesh: no devices were given for mesh {dict(zip(names, sizes))}; pass some "
            "(jax.devices()), or leave devices=None for all of them"
        )
    if math.prod(sizes) != len(devices):
        raise ShardingError(
            f"make_mesh: mesh {dict(zip(names, sizes))} needs {math.prod(sizes)} devices, but "
            f"{len(devices)} {devices[0].platform} device(s) were given. To simulate N CPU devices, set "
            "XLA_FLAGS=--xla_force_host_platform_device_count=N before JAX is first imported."
        )


def divisible(
    where: str, shape: tuple[int, ...], axes: LogicalAxes, spec: PartitionSpec, mesh: AnyMesh | None
) -> None:
    """Each split dimension of an array (a parameter, an input, an activation) divides evenly."""
    if mesh is None:
        return
    for dim, (size, entry) in enumerate(zip(shape, spec)):
        if size % (ways := split_count(mesh, entry)):
            sizes = ", ".join(f"{a!r}={mesh.shape[a]}" for a in as_mesh_axes(entry))
            raise ShardingError(
                f"{where}: shape {shape}, dimension {dim} (logical axis {axes[dim]!r}) has "
                f"size {size}, which mesh axis {sizes} cannot split evenly; choose sizes divisible "
                f"by {ways} or change the rules"
            )


def param_spec(where: str, axes: Any, shape: tuple[int, ...], rules: AxisRules, mesh: Any) -> Any:
    """A parameter's spec, with its path in any error: its logical axes name each of its dimensions."""
    if len(axes) != len(shape):
        raise ShardingError(f"{where}: logical axes {axes} name {len(axes)} dims; its shape is {shape}")
    try:
        return rules.spec(axes, mesh)
    except ShardingError as e:
        raise ShardingError(f"{where}: {e}") from None


def rank(where: str, x: Any, logical_axes: Any) -> None:
    """One logical axis per dimension of ``x``."""
    if isinstance(logical_axes, str):
        raise ShardingError(
            f"{where}: logical axes {logical_axes!r} is one string; did you mean a tuple ({logical_axes!r},)?"
        )
    if len(logical_axes) != jax.numpy.ndim(x):
        shape = jax.numpy.shape(x)
        raise ShardingError(f"{where}: {logical_axes} name {len(logical_axes)} dims; x has shape {shape}")


def spec_on_mesh(path: Any, spec: Any, mesh: Mesh) -> None:
    """A leaf of ``named_shardings``' specs: a PartitionSpec naming only axes of ``mesh``."""
    where = path_str(path)
    if not isinstance(spec, PartitionSpec):
        raise ShardingError(
            f"named_shardings: {where} is {spec!r} ({type(spec).__name__}), not a PartitionSpec; "
            "use P(...) (None for an unspecified leaf)"
        )
    for entry in spec:
        for axis in as_mesh_axes(entry):
            if axis not in mesh.axis_names:
                raise ShardingError(
                    f"named_shardings: {where}: {spec} names mesh axis {axis!r}, which the mesh "
                    f"{dict(mesh.shape)} lacks"
                )


def one_kind_of_axes(mesh: Mesh) -> None:
    if len(set(mesh.axis_types)) > 1:
        raise ShardingError(
            f"Sharded: mesh axes {dict(zip(mesh.axis_names, mesh.axis_types))} mix Auto and Explicit; "
            "minishard supports meshes of one kind: make_mesh(..., explicit=True) or explicit=False"
        )


def batch_axis_known(batch_axis: str | None, rules: AxisRules, mesh: Mesh) -> None:
    if batch_axis is not None and batch_axis not in rules and batch_axis not in mesh.axis_names:
        raise ShardingError(
            f"Sharded: batch_axis={batch_axis!r} has no rule in {rules} and is no mesh axis "
            f"{mesh.axis_names}; add a rule such as AxisRules({batch_axis}='data')"
        )


def donate_argnums(name: str, donate: Any, arg_names: list[str] | None) -> tuple[int, ...]:
    """Each donated position is an argument of the function (``arg_names`` None: any count)."""
    one = isinstance(donate, str) or not isinstance(donate, Sequence)
    positions = (donate,) if one else tuple(donate)
    count = "" if arg_names is None else f"; {name} takes {len(arg_names)} positional arguments"
    for a in positions:
        if isinstance(a, bool) or not isinstance(a, int) or a < 0:
            raise ShardingError(
                f"{name}: donate_argnums={donate!r} must be non-negative ints (argument positions){count}"
            )
        if arg_names is not None and a >= len(arg_names):
            raise ShardingError(
                f"{name}: donate_argnums={donate!r} names argument {a}, but {name} takes "
                f"{len(arg_names)} positional arguments ({', '.join(arg_names) or 'none'})"
            )
    return positions


def keywords(name: str, kwargs: dict[str, Any]) -> None:
    raise TypeError(
        f"Sharded function {name!r}: pass arguments by position; "
        f"shardings are derived per positional argument, got keywords {sorted(kwargs)}"
    )


def arrays(fn: ShardedFunction, args: tuple[Any, ...]) -> None:
    """Every leaf of the arguments is an array (or a number): jit cannot take a string."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(args):
        if not hasattr(leaf, "dtype") and not isinstance(leaf, int | float | complex):
            raise TypeError(
                name_argument(
                    fn,
                    f"{path_str(path)}: is {type(leaf).__name__} {leaf!r}, not an array; a Sharded "
                    "function takes arrays (or pytrees of them): pass other values through "
                    "functools.partial or a closure",
                )
            )


# --- diagnosis: after jax.jit refused ---------------------------------------------------


def name_argument(fn: ShardedFunction, message: str) -> str:
    """``[0].layers[0].weight: ...`` -> ``step: argument model.layers[0].weight: ...``."""
    return f"{fn.name}: argument {named(fn, message)}"


def named(fn: ShardedFunction, where: str) -> str:
    """``[0].layers[0]`` -> ``model.layers[0]``, using fn's parameter names."""
    index, _, rest = where.removeprefix("[").partition("]")
    names = fn.arg_names or []
    if where.startswith("[") and index.isdigit() and int(index) < len(names):
        return names[int(index)] + rest
    return where


def failed_call(fn: ShardedFunction, args: tuple[Any, ...], shardings: tuple[Any, ...]) -> None:
    """After jit refused a call: raise an error that names the argument, if we can."""
    arrays(fn, args)
    try:  # another batch size under a cached structure: is it still divisible?
        fn.config.plan_inputs(args)
    except ShardingError as e:
        raise ShardingError(name_argument(fn, str(e))) from None
    for (path, arg), want in zip(jax.tree_util.tree_leaves_with_path(args), shardings):
        where = path_str(path)
        if is_deleted(arg):
            raise ShardingError(
                name_argument(
                    fn,
                    f"{where}: was deleted, because it was donated to an earlier call "
                    f"(donate_argnums={fn.config.donate_argnums}); pass the arrays that call returned",
                )
            )
        if getattr(arg, "committed", False) and not arg.sharding.is_equivalent_to(want, arg.ndim):
            raise ShardingError(
                name_argument(
                    fn,
                    f"{where}: is committed to {arg.sharding}, but Sharded derived {want}. "
                    "Place it with minishard.shard(tree, mesh, rules) (or jax.device_put with "
                    "that sharding) before the call.",
                )
            )


def ambiguous_layout(fn: ShardedFunction, args: tuple[Any, ...], layer_type: type, error: Exception) -> None:
    """An Explicit mesh's ``ShardingTypeError`` while tracing: name the layer it happened in."""
    if type(error).__name__ != "ShardingTypeError":  # jax._src.core's: not exported
        return
    layer = innermost(error, layer_type)
    where = f"in {paths_of(fn, args, type(layer))}: " if layer is not None else ""
    raise ShardingError(
        f"{fn.name}: {where}{str(error).splitlines()[0]} On an Explicit mesh a contraction over "
        "a split dimension must say where its output goes: pass "
        "out_sharding=minishard.constraints.output_sharding(<the output's logical axes>) to "
        "jnp.matmul/jnp.einsum, as minishard's Linear does"
    ) from None


def innermost(error: BaseException, kind: type) -> Any:
    """The last ``kind`` (a Layer) whose method the traceback passes through: where the error happened."""
    found, frame = None, error.__traceback__
    while frame is not None:
        if isinstance(candidate := frame.tb_frame.f_locals.get("self"), kind):
            found = candidate
        frame = frame.tb_next
    return found


def paths_of(fn: ShardedFunction, args: tuple[Any, ...], kind: type) -> str:
    """Where in the arguments Layers of type ``kind`` sit: ``model.layers[2] (Bilinear)``."""
    is_kind = lambda node: type(node) is kind  # noqa: E731
    found = [
        named(fn, path_str(path))
        for path, node in jax.tree_util.tree_flatten_with_path(args, is_leaf=is_kind)[0]
        if is_kind(node)
    ]
    return f"{' or '.join(found) or 'a layer'} ({kind.__name__})"


def positional_names(fn: Callable[..., Any]) -> list[str] | None:
    """The names of ``fn``'s positional parameters; None when it takes ``*args`` or has no signature."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_POSITIONAL for p in parameters):
        return None
    return [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def is_deleted(leaf: Any) -> bool:
    return getattr(leaf, "is_deleted", bool)()  # numpy arrays are never donated away
