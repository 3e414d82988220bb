"""Section 4: ``Sharded`` vs a hand-written ``jax.jit`` on 8 simulated devices, four styles.

For each parallelism style the same minishard MLP step (seed size, batch 256)
runs three ways, blocking after every step (programs with collectives: on
simulated CPU devices, queueing many of them can deadlock XLA's rendezvous):

* ``sharded``: ``ms.Sharded(mesh, rules)``;
* ``handwritten``: ``jax.jit`` with ``in_shardings`` / ``out_shardings`` built
  by hand from the same ``NamedSharding``s (``ShardedFunction.specs``); the
  two must lower to the same program and compute the same losses;
* ``handwritten_copy``: the same jit again, the A/A control.

Next to the timings: the collectives XLA inserted (``ms.collectives``) and
their bytes, the *analytic minimum* computed from the shapes (formula in
``analytic_bytes``), and the parameter bytes each device holds, read from the
arrays' ``addressable_shards``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from contenders import NUM_CLASSES, Problem, minishard_model, minishard_train_step
from harness import Comparison, compare_blocked
from jax.sharding import NamedSharding

import minishard as ms

F32 = 4  # bytes


def AXES(num_sizes: int) -> list[Any]:
    """Megatron logical axes for an mlp of these many sizes: (embed, mlp), (mlp, classes)."""
    return ms.megatron_axes(num_sizes - 1)


@dataclass(frozen=True)
class Style:
    """A parallelism style: mesh shape, logical-axis rules, and what the minimum communication is."""

    name: str
    mesh: dict[str, int]
    rules: Callable[[], Any]
    formula: str


RULE_PAIRS_FSDP = [
    ("batch", "data"), ("embed", "data"), ("mlp", "model"),
    ("classes", None), ("embed", None), ("mlp", None),
]  # fmt: skip

STYLES = (
    Style(
        "data_parallel",
        {"data": 8},
        lambda: ms.AxisRules(batch="data", embed=None, mlp=None, classes=None),
        "all-reduce of every gradient, sum(param bytes), + the loss (4 B)",
    ),
    Style(
        "megatron",
        {"model": 8},
        lambda: ms.AxisRules(batch=None, embed=None, mlp="model", classes=None),
        "all-reduce of the logits' partial sums, B * classes * 4 B (nothing else: the batch is replicated)",
    ),
    Style(
        "2d",
        {"data": 2, "model": 4},
        lambda: ms.AxisRules(batch="data", embed=None, mlp="model", classes=None),
        "logits all-reduce over model, (B/data) * classes * 4 B, + all-reduce over data of each "
        "device's gradient shards, sum(param bytes / model-split), + the loss (4 B)",
    ),
    Style(
        "fsdp",
        {"data": 8, "model": 1},
        lambda: ms.AxisRules.from_pairs(RULE_PAIRS_FSDP),
        "all-gather of each data-sharded weight (its full bytes) + reduce-scatter of its gradient "
        "(full bytes / data) + all-reduce of the replicated parameters' gradients + the loss (4 B)",
    ),
)


def analytic_bytes(style: str, problem: Problem, mesh: Any, specs: list[Any]) -> int:
    """The least bytes (results on one device, summed, as ``ms.collectives`` counts) a step must move.

    ``specs``: the PartitionSpecs of the parameters, in ``problem.params`` order (W, b, W, b).
    """
    shapes = [a.shape for pair in problem.params for a in pair]
    full = [math.prod(s) * F32 for s in shapes]
    data = mesh.shape.get("data", 1)
    model = mesh.shape.get("model", 1)
    if style == "data_parallel":
        return sum(full) + F32
    if style == "megatron":
        return problem.batch * NUM_CLASSES * F32
    if style == "2d":
        local = sum(b // split(mesh, spec) for b, spec in zip(full, specs))
        return problem.batch // data * NUM_CLASSES * F32 + local + F32
    if style == "fsdp":
        sharded = [b for b, spec in zip(full, specs) if "data" in axes_of(spec)]
        replicated = [b for b, spec in zip(full, specs) if "data" not in axes_of(spec)]
        return sum(sharded) + sum(b // data for b in sharded) + sum(replicated) // model + F32
    raise ValueError(style)


def axes_of(spec: Any) -> set[str]:
    names: set[str] = set()
    for entry in spec:
        names |= {entry} if isinstance(entry, str) else set(entry or ())
    return names


def split(mesh: Any, spec: Any) -> int:
    return math.prod(mesh.shape[a] for a in axes_of(spec))


def collectives_json(lowered: Any) -> dict[str, Any]:
    found = ms.collectives(lowered)
    return {
        kind: {
            "count": c.count,
            "bytes": c.bytes,
            "over": [list(a) for a in (getattr(c, "mesh_axes", None) or c.axes)],
        }
        for kind, c in found.items()
    }


def per_device_param_bytes(model: Any) -> dict[str, int]:
    """Parameter bytes on each device, from the placed arrays' ``addressable_shards``."""
    by_device: dict[str, int] = {}
    for leaf in jax.tree_util.tree_leaves(model):
        for shard in leaf.addressable_shards:
            key = str(shard.device.id)
            by_device[key] = by_device.get(key, 0) + shard.data.nbytes
    return by_device


def bench_style(style: Style, problem: Problem, rounds: int, iters: int, warmup: int) -> dict[str, Any]:
    mesh = ms.make_mesh(style.mesh)
    rules = style.rules()
    model = jax.eval_shape(
        lambda: ms.mlp(
            list(problem.sizes), key=jax.random.key(0), activation="relu", axes=AXES(len(problem.sizes))
        )
    )
    model = jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure(model), jax.tree_util.tree_leaves(minishard_model(problem))
    )
    opt = ms.SGD(0.01)
    args = (model, opt.init(model), jnp.asarray(problem.x), jnp.asarray(problem.y))
    sharded = ms.Sharded(mesh, rules)(minishard_train_step)
    specs = sharded.specs(*args)

    def named(tree: Any) -> Any:
        return jax.tree_util.tree_map(lambda spec: NamedSharding(mesh, spec), tree)

    in_shardings, out_shardings = named(specs.inputs), named(specs.outputs)
    handwritten = jax.jit(minishard_train_step, in_shardings=in_shardings, out_shardings=out_shardings)
    control = jax.jit(minishard_train_step, in_shardings=in_shardings, out_shardings=out_shardings)
    placed = jax.device_put(args, in_shardings)
    lowered = sharded.lower(*placed)
    same_program = lowered.as_text() == handwritten.lower(*placed).as_text()

    fns = {"sharded": sharded, "handwritten": handwritten, "handwritten_copy": control}
    states = {name: placed[:2] for name in fns}

    def stepper(name: str) -> Callable[[], jax.Array]:
        def step() -> jax.Array:
            model, opt_state, loss = fns[name](*states[name], *placed[2:])
            states[name] = (model, opt_state)
            return loss

        return step

    steps = {name: stepper(name) for name in fns}
    first_losses = {name: float(step()) for name, step in steps.items()}
    if not np.allclose(list(first_losses.values()), first_losses["handwritten"], rtol=1e-5):
        raise AssertionError(
            f"{style.name}: Sharded and the hand-written jit compute different losses {first_losses}"
        )
    _, blocked = compare_blocked(steps, "handwritten", rounds, iters, warmup)

    param_specs = jax.tree_util.tree_leaves(specs.inputs[0])
    colls = collectives_json(lowered)
    weights_gathered = "all-gather" in colls
    per_device = per_device_param_bytes(placed[0])
    return {
        "mesh": style.mesh,
        "rules": repr(rules),
        "param_specs": [str(s) for s in param_specs],
        "same_program": same_program,
        "ratio": blocked,
        "collectives": {
            "kinds": colls,
            "bytes": sum(c["bytes"] for c in colls.values()),
            "analytic_bytes": analytic_bytes(style.name, problem, mesh, param_specs),
            "formula": style.formula,
            "all_gather_of_weights": weights_gathered,
        },
        "param_bytes_per_device": {
            "min": min(per_device.values()),
            "max": max(per_device.values()),
            "unsharded": ms.tree.tree_bytes(placed[0]),
        },
    }


def fsdp_rules_on_data_only_mesh() -> str:
    """What the issue's ordered FSDP rules give on a mesh with only a ``data`` axis."""
    try:
        ms.Sharded(ms.make_mesh({"data": 8}), ms.AxisRules.from_pairs(RULE_PAIRS_FSDP))
    except ms.ShardingError as error:
        return f"ShardingError: {error}"
    return "accepted"


def bench_parallel(problem: Problem, rounds: int, iters: int, warmup: int) -> dict[str, Any]:
    results = {style.name: bench_style(style, problem, rounds, iters, warmup) for style in STYLES}
    out: dict[str, Any] = {"styles": {}, "fsdp_rules_on_data_only_mesh": fsdp_rules_on_data_only_mesh()}
    for name, r in results.items():
        comparison: Comparison = r.pop("ratio")
        r["sharded_vs_handwritten"] = comparison.ratio["sharded"].as_json()
        r["aa_control"] = comparison.ratio["handwritten_copy"].as_json()
        r["diff_us"] = comparison.diff_us["sharded"].as_json()
        r["step_us"] = comparison.us["handwritten"].as_json()
        out["styles"][name] = r
    return out
