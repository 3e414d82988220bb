"""The residual MLP of docs/testing.md, and the mutations that each assertion must catch.

``minishard.Residual(inner)`` around a tensor-parallel (Megatron) MLP:
``x + inner(x)``. ``MUTATIONS`` breaks it in the ways a real model gets broken
(a swapped or dropped annotation, a rule sending a name to the wrong mesh
axis, an extra collective, a hand-written ``shard_map`` that reduces with the
wrong operation), each next to the unbroken version. Everything a test
compiles is defined here once, at module level: ``jax.jit`` caches compiled
code per function. Two helpers for the tests of every minishard.testing module
close it: ``compilations`` and ``draw_one``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import jax
import numpy as np
from hypothesis import find, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import minishard as ms
from minishard.rules import LogicalAxes
from minishard.sharding import plan
from minishard.tree import path_str

MEGATRON: list[LogicalAxes] = [("embed", "mlp"), ("mlp", "embed")]
SWAPPED: list[LogicalAxes] = [("mlp", "embed"), ("embed", "mlp")]
DROPPED: list[LogicalAxes] = [("embed", "mlp"), (None, None)]  # the second half forgot its axes
RULES = ms.AxisRules(batch="data", embed=None, mlp="model")
WRONG_RULES = ms.AxisRules(batch="data", embed=None, mlp="data")  # mlp sent to the data axis
EMBED, HIDDEN, BATCH = 16, 32, 8
MESH = ms.make_mesh({"data": 2, "model": 4})


def residual(widths: Mapping[str, int], axes: list[LogicalAxes]) -> ms.Residual:
    inner = ms.mlp([widths["embed"], widths["mlp"], widths["embed"]], key=jax.random.key(0), axes=axes)
    return ms.Residual(inner)


def residual_mlp(widths: Mapping[str, int]) -> ms.Residual:
    """The builder ``minishard.testing.models`` calls: widths keyed by logical axis."""
    return residual(widths, MEGATRON)


def swapped_residual_mlp(widths: Mapping[str, int]) -> ms.Residual:
    return residual(widths, SWAPPED)


def forward(model: ms.Residual, x: jax.Array) -> jax.Array:
    return model(x)


def forward_gathering(model: ms.Residual, x: jax.Array) -> jax.Array:
    """The same numbers, plus an all-gather: the hidden activations pinned to be replicated."""
    first, activation, second = model.inner
    hidden = jax.lax.with_sharding_constraint(activation(first(x)), NamedSharding(MESH, P()))
    return x + second(hidden)


def _megatron_by_hand(reduce: Callable[[jax.Array, str], jax.Array]) -> Callable[..., jax.Array]:
    """The residual MLP as a hand-written ``shard_map``: each device its slice of the hidden units."""

    def local(x: jax.Array, w1: jax.Array, b1: jax.Array, w2: jax.Array, b2: jax.Array) -> jax.Array:
        partial = jax.nn.swish(x @ w1 + b1) @ w2  # this device's share of the output
        return x + reduce(partial, "model") + b2

    specs = (P("data"), P(None, "model"), P("model"), P("model", None), P())

    def by_hand(model: ms.Residual, x: jax.Array) -> jax.Array:
        first, _, second = model.inner
        run = jax.shard_map(local, mesh=MESH, in_specs=specs, out_specs=P("data"))
        return run(x, first.weight, first.bias, second.weight, second.bias)

    return by_hand


forward_by_hand = _megatron_by_hand(jax.lax.psum)
forward_by_hand_pmean = _megatron_by_hand(jax.lax.pmean)  # the bug: averages the partial sums


class Mutation(NamedTuple):
    """One version of the residual MLP's test set-up; the user's intention stays the same."""

    axes: list[LogicalAxes]  # the model's annotations
    rules: ms.AxisRules  # the rules it is placed and compiled with
    fn: Callable[..., Any]  # the forward pass


MUTATIONS = {
    "correct": Mutation(MEGATRON, RULES, forward),
    "correct shard_map": Mutation(MEGATRON, RULES, forward_by_hand),
    "swapped halves": Mutation(SWAPPED, RULES, forward),
    "dropped annotation": Mutation(DROPPED, RULES, forward),
    "mlp -> data rule": Mutation(MEGATRON, WRONG_RULES, forward),
    "extra all-gather": Mutation(MEGATRON, RULES, forward_gathering),
    "pmean for psum": Mutation(MEGATRON, RULES, forward_by_hand_pmean),
}


def model_and_batch(axes: list[LogicalAxes], seed: int = 0) -> tuple[ms.Residual, np.ndarray]:
    """A residual MLP (numpy parameters: nothing compiles) and a batch for it."""
    shapes = jax.eval_shape(lambda: residual({"embed": EMBED, "mlp": HIDDEN}, axes))
    rng = np.random.default_rng(seed)
    model = jax.tree.map(lambda leaf: (0.25 * rng.standard_normal(leaf.shape)).astype(leaf.dtype), shapes)
    return model, rng.standard_normal((BATCH, EMBED)).astype(np.float32)


def intended_shards(hidden: int, model_ways: int) -> dict[str, tuple[int, ...]]:
    """What the user means: the hidden units split over "model", everything else whole."""
    shard = hidden // model_ways
    return {
        "inner.layers[0].weight": (EMBED, shard),
        "inner.layers[0].bias": (shard,),
        "inner.layers[2].weight": (shard, EMBED),
        "inner.layers[2].bias": (EMBED,),
    }


@contextlib.contextmanager
def compilations() -> Iterator[list[str]]:
    """Collect the names of the functions XLA compiles inside the block."""
    compiled: list[str] = []

    def listener(event: str, duration: float, **kwargs: Any) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(kwargs.get("fun_name", "?"))

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield compiled
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def draw_one(strategy: st.SearchStrategy[Any]) -> Any:
    """The simplest example of ``strategy`` (deterministic: hypothesis shrinks it)."""
    return find(strategy, lambda _: True, settings=settings(database=None, max_examples=1))


def assert_shards_as_planned(tree: Any, placed: Any, mesh: jax.sharding.Mesh, rules: ms.AxisRules) -> None:
    """Every device holds exactly the shard ``plan`` computes for each leaf of ``placed``."""
    leaves = jax.tree_util.tree_leaves_with_path(placed)
    plans = plan(tree, mesh, rules).leaves
    assert [leaf.path for leaf in plans] == [path_str(path) for path, _ in leaves]
    for leaf, (_, array) in zip(plans, leaves, strict=True):
        shapes = [shard.data.shape for shard in array.addressable_shards]
        assert shapes == [leaf.shard_shape] * mesh.size, f"{leaf.path} (spec {leaf.spec})"
