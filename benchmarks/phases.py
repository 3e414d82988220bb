"""Section 9: one ``Sharded`` call on 8 simulated devices, phase by phase, against raw ``jax.jit``.

The dispatch-bound step ([784, 64, 10], batch 8: one example per device) on a
``data=8`` mesh, every contender with the same leaves and the same
``NamedSharding``\\ s, interleaved and paired with ``raw`` (section 1's method):

* ``raw``: ``jax.jit`` over a list of ``(W, b)`` tuples (C++ pytree nodes);
* ``minimal_pytree``: the same step over the smallest hand-written pytree
  classes of minishard's shape (``Sequential`` of ``Linear, ReLU, Linear``:
  ``register_pytree_node``, a tuple comprehension to flatten, ``setattr`` to
  unflatten): what any Python pytree node costs in JAX, the floor for Layers;
* ``handwritten``: ``jax.jit`` over minishard's model with the shardings
  ``Sharded`` derives, given by hand (section 4's hand-written jit);
* ``sharded``: ``ms.Sharded(mesh, rules)``.

So ``handwritten - raw`` is what Layers cost inside JAX's own call path (its
C++ dispatch calls each Layer's Python ``tree_flatten`` and, for the results,
``tree_unflatten``), ``minimal_pytree - raw`` the part of it any Python pytree
class pays, and ``sharded - handwritten`` ``Sharded``'s own cost.

The phases a ``Sharded`` call could spend time in are timed alone, ``number``
calls per sample: flattening the arguments in Python, the structure key (its
treedef hash and dict look-up), the donation check over the arguments' leaves,
and rebuilding the output Layers (``tree_unflatten``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from contenders import (
    MS_OPTIMIZER,
    Problem,
    minimal_model,
    minimal_train_step,
    minishard_model,
    minishard_train_step,
    raw_train_step,
)
from harness import Comparison, batched, blocked_round, compare_calls
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import minishard as ms

# --- the measurement -------------------------------------------------------------------------


def stepper(fn: Callable[..., Any], state: tuple[Any, ...], data: tuple[Any, ...]) -> Callable[[], Any]:
    """One step: ``fn(*state, *data)`` returns the new state and the loss (last)."""
    box = [state]

    def step() -> Any:
        *box[0], loss = fn(*box[0], *data)
        return loss

    return step


def bench_phases(problem: Problem, rounds: int, iters: int, warmup: int, number: int) -> dict[str, Any]:
    mesh = ms.make_mesh({"data": 8})
    rules = ms.AxisRules(batch="data", embed=None, mlp=None, classes=None)
    replicated, batch = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    x = jax.device_put(jnp.asarray(problem.x), batch)
    y = jax.device_put(jnp.asarray(problem.y), batch)
    params = jax.device_put([(jnp.asarray(w), jnp.asarray(b)) for w, b in problem.params], replicated)
    model = ms.shard(minishard_model(problem), mesh, rules)
    opt_state = MS_OPTIMIZER.init(model)

    sharded = ms.Sharded(mesh, rules)(minishard_train_step)
    specs = sharded.specs(model, opt_state, x, y)
    named = lambda tree: jax.tree_util.tree_map(lambda spec: NamedSharding(mesh, spec), tree)  # noqa: E731
    handwritten = jax.jit(
        minishard_train_step, in_shardings=named(specs.inputs), out_shardings=named(specs.outputs)
    )
    plain = {"in_shardings": (replicated, batch, batch), "out_shardings": (replicated, replicated)}
    steps = {
        "raw": stepper(jax.jit(raw_train_step, **plain), (params,), (x, y)),
        "minimal_pytree": stepper(jax.jit(minimal_train_step, **plain), (minimal_model(params),), (x, y)),
        "handwritten": stepper(handwritten, (model, opt_state), (x, y)),
        "sharded": stepper(sharded, (model, opt_state), (x, y)),
    }
    losses = {name: float(step()) for name, step in steps.items()}
    if max(losses.values()) - min(losses.values()) > 1e-5 * abs(losses["raw"]):
        raise AssertionError(f"the 8-device contenders compute different losses: {losses}")
    blocked_round(steps, warmup)
    host_rounds = [blocked_round(steps, iters)[0] for _ in range(rounds)]
    over = {ref: Comparison.of(host_rounds, ref).diff_us for ref in ("raw", "minimal_pytree", "handwritten")}

    args = (model, opt_state, x, y)
    leaves, treedef = jax.tree_util.tree_flatten(args)
    out_leaves, out_treedef = jax.tree_util.tree_flatten(sharded(*args))
    key = (treedef, tuple(jnp.ndim(leaf) for leaf in leaves))
    plans = {key: None}
    phases = {
        "flatten_arguments": lambda: jax.tree_util.tree_flatten(args),
        "structure_key": lambda: plans.get((treedef, tuple([leaf.ndim for leaf in leaves]))),
        "donation_check": lambda: any(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(args)),
        "unflatten_outputs": lambda: jax.tree_util.tree_unflatten(out_treedef, out_leaves),
    }
    calls = {"nothing": lambda: None, **phases}  # the reference: a Python call doing nothing
    isolated: Comparison = compare_calls(
        {name: batched(fn, number) for name, fn in calls.items()}, "nothing", rounds, max(iters // 4, 3)
    )
    host = Comparison.of(host_rounds, "raw")
    return {
        "mesh": {"data": 8},
        "sizes": list(problem.sizes),
        "batch": problem.batch,
        "host_diff_us": host.as_json("diff_us"),
        "host_ratio": host.as_json("ratio"),
        "breakdown_us": {  # each a paired difference of the same iterations
            "python_pytree_nodes (minimal_pytree - raw)": over["raw"]["minimal_pytree"].as_json(2),
            "layers_beyond_minimal (handwritten - minimal_pytree)": over["minimal_pytree"][
                "handwritten"
            ].as_json(2),
            "sharded_own (sharded - handwritten)": over["handwritten"]["sharded"].as_json(2),
        },
        "phase_us": {
            name: round(stat.median / number, 3) for name, stat in isolated.diff_us.items() if name in phases
        },
    }
