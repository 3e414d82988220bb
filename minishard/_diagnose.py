"""``Sharded``'s diagnosis: after ``jax.jit`` refused a call, which argument was wrong, and how to fix it.

A reader may skip this module: it runs only after a failure, to say in
minishard's terms what JAX said in its own. Every function here raises
``ShardingError`` (a ``ValueError``) or ``TypeError``, or returns without a word;
the guards that run before any work are in ``minishard._checks``. It imports
only the guards and ``tree``, and comes just before ``sharding`` in the import order.
"""

from __future__ import annotations

from typing import Any

import jax

from minishard._checks import ShardingError, positional_names
from minishard.tree import path_str

__all__: list[str] = []  # private: ``sharding`` calls these by module, ``_diagnose.failed_call(...)``


def arrays(fn: Any, args: tuple[Any, ...]) -> None:
    """After jit refused: is a leaf of the arguments no array (nor a number)? jit cannot take a string."""
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


def name_argument(fn: Any, message: str) -> str:
    """``[0].layers[0].weight: ...`` -> ``step: argument model.layers[0].weight: ...``."""
    return f"{fn.name}: argument {named(fn, message)}"


def named(fn: Any, where: str) -> str:
    """``[0].layers[0]`` -> ``model.layers[0]``, using fn's parameter names."""
    index, _, rest = where.removeprefix("[").partition("]")
    names = positional_names(fn.fn) or []  # None: any number (*args, or no signature)
    if where.startswith("[") and index.isdigit() and int(index) < len(names):
        return names[int(index)] + rest
    return where


def failed_call(fn: Any, args: tuple[Any, ...], shardings: tuple[Any, ...]) -> None:
    """After jit refused a call: raise an error that names the argument, if we can."""
    arrays(fn, args)
    try:  # another batch size under a cached structure: is it still divisible?
        fn.config.plan_inputs(args)
    except ShardingError as e:
        raise e.retold(lambda why: name_argument(fn, why)) from None
    for (path, arg), want in zip(jax.tree_util.tree_leaves_with_path(args), shardings):
        where = path_str(path)
        if getattr(arg, "is_deleted", bool)():  # numpy arrays are never donated away
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


def ambiguous_sharding(fn: Any, args: tuple[Any, ...], layer_type: type, error: Exception) -> None:
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


def paths_of(fn: Any, args: tuple[Any, ...], kind: type) -> str:
    """Where in the arguments Layers of type ``kind`` sit: ``model.layers[2] (Bilinear)``."""
    is_kind = lambda node: type(node) is kind  # noqa: E731
    found = [
        named(fn, path_str(path))
        for path, node in jax.tree_util.tree_flatten_with_path(args, is_leaf=is_kind)[0]
        if is_kind(node)
    ]
    return f"{' or '.join(found) or 'a layer'} ({kind.__name__})"
