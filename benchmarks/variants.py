"""Section 7: what would make minishard cheaper per call? Throw-away variants, measured in the same harness.

minishard's per-call cost over raw JAX has two sources, and each gets
variants here, built *outside* ``minishard/`` (subclasses and re-registered
copies of its classes) so the lead can apply the winner as a small diff:

* **Layer pytrees** (``minishard_jit`` pays them): ``jax.jit`` calls a
  Layer's ``tree_flatten`` for every Layer of every argument and its
  ``tree_unflatten`` for every Layer of every result, on every call. A list
  of tuples costs nothing comparable: C++ flattens it with no Python at all.

  - ``layers_current``: the code as it is (two list comprehensions; two
    ``dict.update(zip(...))``; registered with ``register_pytree_with_keys_class``);
  - ``layers_itemgetter``: flatten with per-class ``operator.itemgetter``s
    (C code, no Python loop), unflatten with one ``dict.update``;
  - ``layers_dataclass_bound``: ``jax.tree_util.register_dataclass`` (C++
    flatten). Its unflatten *calls* ``cls(**fields)``, i.e. ``__init__``,
    which minishard forbids; shown only as a bound on what C++ flattening buys.

* **Sharded's prelude** (``minishard_sharded`` pays it on top): it flattens the
  arguments to build its cache key, then calls a ``jax.jit`` that flattens
  them again.

  - ``sharded_current``: the code as it is;
  - ``sharded_flat``: flatten once; the cached ``jax.jit`` takes the *leaves*
    (its function unflattens them inside the trace), so JAX's own flatten sees
    only arrays; the key and the shardings are the same;
  - ``sharded_floor``: call the cached jit with no key at all. Unsound (a
    scalar arriving where an array was would be mis-sharded): the floor.

All run the dispatch-bound training step, interleaved and paired with
``raw`` exactly like section 1.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from contenders import MS_OPTIMIZER, Problem, make_raw, minishard_model, minishard_train_step, one_device_mesh
from harness import Comparison, batched, compare_blocked, compare_calls
from jax.sharding import NamedSharding

import minishard as ms

# --- Layer variants ------------------------------------------------------------------


def fields_getter(names: tuple[str, ...]) -> Callable[[dict[str, Any]], tuple[Any, ...]]:
    """``fields -> tuple(fields[name] for name in names)``, in C where possible."""
    if len(names) == 1:  # itemgetter of one name returns the bare value, not a 1-tuple
        name = names[0]
        return lambda fields: (fields[name],)
    return operator.itemgetter(*names) if names else lambda fields: ()


def register_itemgetter(cls: type) -> None:
    """The proposal for ``Layer``: same methods and protocol, cheaper bodies."""
    params, static = fields_getter(cls.param_fields), fields_getter(cls.static_fields)  # type: ignore[attr-defined]
    names = cls.param_fields + cls.static_fields  # type: ignore[attr-defined]

    def tree_flatten(self: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        fields = self.__dict__
        return params(fields), static(fields)

    def tree_unflatten(cls: type, aux_data: tuple[Any, ...], children: Any) -> Any:
        layer = object.__new__(cls)
        layer.__dict__.update(zip(names, (*children, *aux_data)))
        return layer

    cls.tree_flatten = tree_flatten  # type: ignore[attr-defined]
    cls.tree_unflatten = classmethod(tree_unflatten)  # type: ignore[attr-defined]
    jax.tree_util.register_pytree_with_keys_class(cls)


def register_dataclass_bound(cls: type) -> None:
    """C++ flattening; its unflatten calls ``__init__(**fields)`` (forbidden in minishard: a bound only)."""

    def init(self: Any, **fields: Any) -> None:
        self.__dict__.update(fields)

    cls.__init__ = init  # type: ignore[misc]
    jax.tree_util.register_dataclass(
        cls,
        data_fields=list(cls.param_fields),  # type: ignore[attr-defined]
        meta_fields=list(cls.static_fields),  # type: ignore[attr-defined]
    )


def variant_classes(tag: str, register: Callable[[type], None]) -> dict[type, type]:
    """Copies of minishard's layer classes, registered by ``register`` instead of by ``Layer``.

    A mixin's ``__init_subclass__`` runs *instead of* ``Layer.__init_subclass__``
    (it comes first in the MRO and does not call ``super()``), so the copy is
    registered once, our way; ``__call__``, fields and ``param_logical_axes``
    are inherited unchanged, and ``isinstance(copy, ms.Layer)`` still holds.
    """

    class Registered:
        def __init_subclass__(cls, **kwargs: Any) -> None:
            register(cls)

    originals = (ms.Linear, ms.ReLU, ms.Swish, ms.Sequential)
    return {cls: type(f"{tag}{cls.__name__}", (Registered, cls), {}) for cls in originals}


def convert(node: Any, classes: dict[type, type]) -> Any:
    """The same model, every Layer replaced by its copy (fields copied as they are)."""
    if isinstance(node, ms.Layer):
        copy = object.__new__(classes[type(node)])
        copy.__dict__.update({name: convert(value, classes) for name, value in node.__dict__.items()})
        return copy
    if isinstance(node, tuple):
        return tuple(convert(item, classes) for item in node)
    return node


# --- Sharded variants ------------------------------------------------------------------


def outside_layers(args: Any) -> tuple[int, ...]:
    """Positions (in the flat leaves) of the leaves outside Layers: the batch leaves."""
    positions, index = [], 0
    for node in jax.tree_util.tree_leaves(args, is_leaf=lambda n: isinstance(n, ms.Layer)):
        if isinstance(node, ms.Layer):
            index += len(jax.tree_util.tree_leaves(node))
        else:
            positions.append(index)
            index += 1
    return tuple(positions)


class FlatSharded:
    """``Sharded`` that flattens once: the cache key needs the leaves anyway, so jit gets the leaves.

    The proposal for ``ShardedFunction``: same key, same shardings, same
    program; only the cached ``jax.jit`` now takes the flat leaves and its
    function unflattens them inside the trace (free: tracing happens once).
    """

    def __init__(self, sharded: Any) -> None:
        self.sharded = sharded  # the ShardedFunction: its specs() derive the shardings
        self._outside: dict[Any, tuple[int, ...]] = {}
        self._cache: dict[Any, Any] = {}

    def __call__(self, *args: Any) -> Any:
        leaves, treedef = jax.tree_util.tree_flatten(args)
        outside = self._outside.get(treedef)
        if outside is None:
            outside = self._outside[treedef] = outside_layers(args)
        key = (treedef, *[getattr(leaves[i], "ndim", 0) == 0 for i in outside])
        jitted = self._cache.get(key)
        if jitted is None:
            jitted = self._cache[key] = self._build(args, treedef)
        return jitted(*leaves)

    def _build(self, args: tuple[Any, ...], treedef: Any) -> Any:
        specs, mesh = self.sharded.specs(*args), self.sharded.config.mesh
        fn = self.sharded.fn

        def on_leaves(*leaves: Any) -> Any:  # traced once per key: rebuilding the trees here is free
            return fn(*jax.tree_util.tree_unflatten(treedef, leaves))

        on_leaves.__name__ = on_leaves.__qualname__ = getattr(fn, "__name__", "on_leaves")

        return jax.jit(
            on_leaves,
            in_shardings=[NamedSharding(mesh, spec) for spec in jax.tree_util.tree_leaves(specs.inputs)],
            out_shardings=jax.tree_util.tree_map(lambda spec: NamedSharding(mesh, spec), specs.outputs),
        )


class FloorSharded:
    """The cached jit called with no key (unsound): what any prelude must be compared with."""

    def __init__(self, sharded: Any) -> None:
        self.sharded, self.jitted = sharded, None

    def __call__(self, *args: Any) -> Any:
        if self.jitted is None:
            specs, mesh = self.sharded.specs(*args), self.sharded.config.mesh
            named = functools.partial(jax.tree_util.tree_map, lambda spec: NamedSharding(mesh, spec))
            fn = self.sharded.fn
            self.jitted = jax.jit(fn, in_shardings=named(specs.inputs), out_shardings=named(specs.outputs))
        return self.jitted(*args)


# --- the measurement ---------------------------------------------------------------


def minishard_stepper(
    model: Any, wrap: Callable[[Any], Any], place: Callable[[Any], Any], problem: Problem
) -> Any:
    step_fn = wrap(minishard_train_step)
    x, y = place(jnp.asarray(problem.x)), place(jnp.asarray(problem.y))
    state = {"model": place(model), "opt": place(MS_OPTIMIZER.init(model))}

    def step() -> jax.Array:
        state["model"], state["opt"], loss = step_fn(state["model"], state["opt"], x, y)
        return loss

    return step


def bench_variants(problem: Problem, rounds: int, iters: int, warmup: int, number: int) -> dict[str, Any]:
    mesh, rules = one_device_mesh()
    current = minishard_model(problem)
    itemgetter = convert(current, variant_classes("Itemgetter", register_itemgetter))
    bound = convert(current, variant_classes("Dataclass", register_dataclass_bound))

    def shard(tree: Any) -> Any:
        return ms.shard(tree, mesh, rules)

    def plain(tree: Any) -> Any:
        return tree

    def sharded() -> Any:
        return ms.Sharded(mesh, rules)

    steps = {
        "raw": make_raw(problem).step,
        "layers_current": minishard_stepper(current, jax.jit, plain, problem),
        "layers_itemgetter": minishard_stepper(itemgetter, jax.jit, plain, problem),
        "layers_dataclass_bound": minishard_stepper(bound, jax.jit, plain, problem),
        "sharded_current": minishard_stepper(current, sharded(), shard, problem),
        "sharded_flat": minishard_stepper(current, lambda f: FlatSharded(sharded()(f)), shard, problem),
        "sharded_floor": minishard_stepper(current, lambda f: FloorSharded(sharded()(f)), shard, problem),
        "sharded_flat+layers_itemgetter": minishard_stepper(
            itemgetter, lambda f: FlatSharded(sharded()(f)), shard, problem
        ),
    }
    losses = {name: float(step()) for name, step in steps.items()}
    if max(losses.values()) - min(losses.values()) > 1e-5 * abs(losses["raw"]):
        raise AssertionError(f"variants compute different losses: {losses}")
    host, blocked = compare_blocked(steps, "raw", rounds, iters, warmup)

    trees = {"layers_current": current, "layers_itemgetter": itemgetter, "layers_dataclass_bound": bound}
    raw_tree = [(jnp.asarray(w), jnp.asarray(b)) for w, b in problem.params]
    round_trips = {"raw": raw_tree, **trees}

    def round_trip(tree: Any) -> Callable[[], Any]:
        def flatten_unflatten() -> Any:
            leaves, treedef = jax.tree_util.tree_flatten(tree)
            return jax.tree_util.tree_unflatten(treedef, leaves)

        return flatten_unflatten

    isolated: Comparison = compare_calls(
        {name: batched(round_trip(tree), number) for name, tree in round_trips.items()}, "raw", rounds, iters
    )
    return {
        "host_ratio": host.as_json("ratio"),
        "host_diff_us": host.as_json("diff_us"),
        "step_ratio": blocked.as_json("ratio"),
        "round_trip_us": {name: round(stat.median / number, 3) for name, stat in isolated.us.items()},
    }
