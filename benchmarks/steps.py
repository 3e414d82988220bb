"""Sections 1 and 2: per-step cost of each library's MLP step, and the cost of flattening its model.

1. **Per-step cost.** Every contender of ``contenders.py`` takes turns, one
   step each per iteration, in three modes:

   * *blocked*: each step ends with ``block_until_ready`` (the step time);
   * *host*: the time until the call returns, from the same blocked loop
     (Python work plus dispatch: what a library adds on the host);
   * *pipelined*: bursts of asynchronous steps, blocking after the last one,
     so host work overlaps the computation. Allowed here because these are
     single-device programs without collectives.

2. **Flatten cost.** ``jax.jit`` flattens its arguments and unflattens its
   results on every call, so a model object's flatten + unflatten is paid on
   every step. One sample is a round trip (flatten, then unflatten) repeated
   ``number`` times; ratios are to the raw list of ``(W, b)`` tuples.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from contenders import CONTROL, FLOOR, REFERENCE, Contender, Problem, available, build, check_same_losses
from harness import Comparison, batched, compare_blocked, compare_calls, compare_pipelined


def bench_steps(
    problem: Problem, names: Sequence[str], rounds: int, iters: int, warmup: int, burst: int, pipe_iters: int
) -> dict[str, Any]:
    """Blocked, host and pipelined comparisons of the named contenders on one problem."""
    names, skipped = available(names)
    contenders = build(problem, names)
    losses = check_same_losses(contenders)
    steps = {name: c.step for name, c in contenders.items()}
    host, blocked = compare_blocked(steps, REFERENCE, rounds, iters, warmup)
    pipelined = compare_pipelined(steps, REFERENCE, rounds, pipe_iters, burst)
    return {
        "comparisons": {"host": host, "blocked": blocked, "pipelined": pipelined},
        "contenders": contenders,
        "losses_first_two_steps": losses[0][:1] + losses[1][:1],
        "skipped": skipped,
    }


def round_trip(
    flatten: Callable[[], tuple[Any, Any]], unflatten: Callable[[Any, Any], Any]
) -> Callable[[], Any]:
    return lambda: unflatten(*flatten())


def tree_round_trip(tree: Any) -> Callable[[], Any]:
    """``tree_flatten`` then ``tree_unflatten``: what jit does to an argument and a result."""

    def flatten() -> tuple[Any, Any]:
        return jax.tree_util.tree_flatten(tree)

    return round_trip(flatten, lambda leaves, treedef: jax.tree_util.tree_unflatten(treedef, leaves))


def flatten_cases(contenders: dict[str, Contender]) -> dict[str, tuple[Callable[[], Any], int]]:
    """Per model representation: (a round-trip function, its number of leaves)."""
    cases: dict[str, Any] = {}

    def add(name: str, fn: Callable[[], Any], tree: Any) -> None:
        cases[name] = (fn, len(jax.tree_util.tree_leaves(tree)))

    model = {name: c.model() for name, c in contenders.items()}
    add(REFERENCE, tree_round_trip(model[REFERENCE]), model[REFERENCE])
    add(CONTROL, tree_round_trip(model[CONTROL]), model[CONTROL])
    if FLOOR in model:
        add(FLOOR, tree_round_trip(model[FLOOR]), model[FLOOR])
    if "minishard_jit" in model:
        add("minishard", tree_round_trip(model["minishard_jit"]), model["minishard_jit"])
    if "nnx_jit" in model:
        from flax import nnx

        module = model["nnx_jit"]
        state = nnx.state(module)
        add("nnx_split_merge", round_trip(lambda: nnx.split(module), nnx.merge), state)
        add("nnx_state_pytree", tree_round_trip(state), state)
        add("nnx_module_pytree", tree_round_trip(module), module)
    if "linen" in model:
        add("linen_params", tree_round_trip(model["linen"]), model["linen"])
    if "eqx_filter_jit" in model:
        import equinox as eqx

        module = model["eqx_filter_jit"]
        add("eqx_module_pytree", tree_round_trip(module), module)
        partition = round_trip(lambda: eqx.partition(module, eqx.is_array), eqx.combine)
        add("eqx_partition_combine", partition, module)
    return cases


def bench_flatten(contenders: dict[str, Contender], rounds: int, iters: int, number: int) -> dict[str, Any]:
    """Paired comparison of model round trips; ``us`` and ``diff_us`` are per single round trip."""
    cases = flatten_cases(contenders)
    comparison = compare_calls(
        {name: batched(fn, number) for name, (fn, _) in cases.items()}, REFERENCE, rounds, iters
    )
    per_call = {
        "us": {name: stat.median / number for name, stat in comparison.us.items()},
        "diff_us": {name: stat.median / number for name, stat in comparison.diff_us.items()},
    }
    return {
        "ratio": comparison.as_json("ratio"),
        "us_per_round_trip": {k: round(v, 3) for k, v in per_call["us"].items()},
        "diff_us_per_round_trip": {k: round(v, 3) for k, v in per_call["diff_us"].items()},
        "leaves": {name: leaves for name, (_, leaves) in cases.items()},
    }


def comparisons_json(comparisons: dict[str, Comparison]) -> dict[str, Any]:
    """Ratios, µs differences and (for context) medians of each mode."""
    return {
        mode: {"ratio": c.as_json("ratio"), "diff_us": c.as_json("diff_us"), "us": c.as_json("us")}
        for mode, c in comparisons.items()
    }
