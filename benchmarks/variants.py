"""Section 7: where minishard's remaining per-call cost sits. Bounds, measured in the same harness.

minishard's per-call cost over raw JAX has two sources. Each is measured here
against a *bound*: a variant built outside ``minishard/`` that removes the
cost in a way minishard cannot adopt, so the gap says how much is left to win.

* **Layer pytrees** (``minishard_jit`` pays them): ``jax.jit`` calls a
  Layer's ``tree_flatten`` for every Layer of every argument and its
  ``tree_unflatten`` for every Layer of every result, on every call.

  - ``layers``: the code as it is (per-class ``operator.itemgetter``s, one
    ``dict.update``);
  - ``layers_dataclass_bound``: ``jax.tree_util.register_dataclass`` (C++
    flatten). Its unflatten *calls* ``cls(**fields)``, i.e. ``__init__``,
    which minishard forbids (JAX unflattens with placeholder leaves, where
    ``__init__``'s checks would be wrong): a bound on what C++ buys.

* **Sharded's prelude** (``minishard_sharded`` paid it on top until issue 28:
  one flatten of the arguments, the look-up of their structure). ``Sharded``
  now calls the last call's jit on the arguments as given, and checks their
  structure only when jit traces, so it should sit on its floor:

  - ``sharded``: the code as it is;
  - ``sharded_floor``: the cached jit called directly, with no structure check
    at all (unsound: a scalar arriving where an array was would be
    mis-sharded): the floor.

All run the dispatch-bound training step, interleaved and paired with
``raw`` exactly like section 1.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from contenders import MS_OPTIMIZER, Problem, make_raw, minishard_model, minishard_train_step, one_device_mesh
from harness import Comparison, batched, compare_blocked, compare_calls
from jax.sharding import NamedSharding

import minishard as ms

# --- Layer variants ------------------------------------------------------------------


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
    bound = convert(current, variant_classes("Dataclass", register_dataclass_bound))

    def shard(tree: Any) -> Any:
        return ms.shard(tree, mesh, rules)

    def plain(tree: Any) -> Any:
        return tree

    def sharded() -> Any:
        return ms.Sharded(mesh, rules)

    steps = {
        "raw": make_raw(problem).step,
        "layers": minishard_stepper(current, jax.jit, plain, problem),
        "layers_dataclass_bound": minishard_stepper(bound, jax.jit, plain, problem),
        "sharded": minishard_stepper(current, sharded(), shard, problem),
        "sharded_floor": minishard_stepper(current, lambda f: FloorSharded(sharded()(f)), shard, problem),
    }
    losses = {name: float(step()) for name, step in steps.items()}
    if max(losses.values()) - min(losses.values()) > 1e-5 * abs(losses["raw"]):
        raise AssertionError(f"variants compute different losses: {losses}")
    host, blocked = compare_blocked(steps, "raw", rounds, iters, warmup)

    trees = {"layers": current, "layers_dataclass_bound": bound}
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
