"""``minishard explain --memory``: a step's bytes per device, term by term (``minishard.memory``).

The textbook's formulas take one device's sizes; this module reads them from the
plan of the model at hand (the MLP's layers, a transformer's heads and hidden
units as the style splits them, the examples the batch gives each device), so
the prediction needs no compile: ``jax.eval_shape`` and an ``AbstractMesh`` suffice.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

import jax

from minishard import memory, plan
from minishard.costs import HARDWARE, Memory
from minishard.memory import Budget, Precision
from minishard.models.gpt import GPT
from minishard.rules import AnyMesh, AxisRules, ShardingError
from minishard.run.cli.flags import simulate_devices
from minishard.run.cli.models import MODELS
from minishard.run.cli.styles import style_of
from minishard.run.steps import make_train_step
from minishard.sharding import Sharded, make_mesh

__all__ = ["COMPILES_UP_TO", "activations", "budget", "predict", "print_memory"]

COMPILES_UP_TO = 50_000_000
"""Parameters up to which ``--memory`` compiles the step here for its compiled column (a model of
50 M float32 parameters and its AdamW state take 0.8 GB per simulated device at most)."""


def budget(
    args: tuple[Any, Any, Any], mesh: AnyMesh, rules: AxisRules, precision: Precision = memory.FP32
) -> Budget:
    """``memory.step_budget`` of ``(model, opt_state, batch)``, its activations from ``activations``."""
    model, _, batch = args
    kept = activations(model, batch, mesh, rules) * memory.itemsize(precision.params)
    return memory.step_budget(args, mesh, rules, precision, kept)


def activations(model: Any, batch: Any, mesh: AnyMesh, rules: AxisRules) -> int:
    """Numbers one device keeps for the backward pass: an MLP's, or a transformer's blocks and head.

    Each size is the whole one over the ways the rules split its *activation's* logical axes
    (``("batch", "seq", "heads", "kv")`` for q, k, v): under ``fsdp`` the weights split over
    "data", the activations split by the batch, as the ordered rules say.
    """
    leaves = {leaf.path: leaf for leaf in plan(model, mesh, rules).leaves}
    first = jax.tree.leaves(batch)[0]
    ways = lambda *axes: _ways(rules, mesh, ("batch", *axes))  # noqa: E731
    b = first.shape[0] // ways()[0]  # examples per device
    if not hasattr(model, "blocks"):  # minishard.mlp: each Linear's input, then its output
        weights = [leaf for path, leaf in leaves.items() if path.endswith(".weight")]
        axes = [weights[0].logical_axes[0], *[leaf.logical_axes[1] for leaf in weights]]
        sizes = [weights[0].shape[0], *[leaf.shape[1] for leaf in weights]]
        return memory.mlp_activations(b, tuple(n // ways(axis)[1] for n, axis in zip(sizes, axes)))
    s = jax.eval_shape(lambda m, x: m.embedding(x), model, first).shape[1]  # tokens per example
    width, heads, head_dim = leaves["blocks[0].attention.query"].shape
    hidden = leaves["blocks[0].mlp.layers[0].weight"].shape[1]
    _, seq, heads_split, _ = ways("seq", "heads", "kv")
    sp = ways("seq", "embed")[1]  # the residual stream's tokens split (tp+sp)
    shape = (b, s // seq, width, heads // heads_split, head_dim, hidden // ways("seq", "mlp")[2])
    kept, whole = (memory.block_activations(*shape, sp=sp // seq, recompute=p) for p in (model.remat, "none"))
    outputs = leaves["head.weight"].shape[1] * (s if isinstance(model, GPT) else 1)  # per token or image
    head = memory.head_activations(b, s // seq, width, outputs, sp // seq)
    return len(model.blocks) * kept + (whole - kept) + head  # and one block recomputed at a time


def _ways(rules: AxisRules, mesh: AnyMesh, axes: tuple[str, ...]) -> tuple[int, ...]:
    """Over how many devices the rules split each of these logical axes of an activation."""
    sizes = dict(mesh.shape)
    spec = (*rules.spec(axes, mesh), *(None,) * len(axes))[: len(axes)]
    named = [() if entry is None else (entry,) if isinstance(entry, str) else entry for entry in spec]
    return tuple(math.prod(sizes[name] for name in entry) for entry in named)


def predict(args: argparse.Namespace) -> tuple[Budget, tuple[Any, Any, Any], dict[str, int], AxisRules]:
    """``explain --memory``'s prediction from its checked flags (``parse_args``), nothing compiled: the
    budget, the step's ``(model, opt_state, batch)`` as shapes, the style's mesh shape and rules.

    Raises ``ShardingError`` where the style's rules cannot split the model.
    """
    model, style = MODELS[args.model], style_of(args.parallel)
    shape, rules = style.mesh(args.devices), style.rules({})
    built = jax.eval_shape(lambda: style.build(model, args, jax.random.key(0)))
    optimizer = model.compiled_optimizer(args)
    step_args = (built, jax.eval_shape(optimizer.init, built), model.example(args, args.batch_size))
    mesh = jax.sharding.AbstractMesh(tuple(shape.values()), tuple(shape))
    return budget(step_args, mesh, rules, memory.PRECISIONS[args.precision]), step_args, shape, rules


def print_memory(args: argparse.Namespace) -> int:
    """``explain --memory``: the predicted table (no compile, any size), the compiled column where the
    step compiles here, and with ``--hardware`` whether it fits on one accelerator's HBM."""
    simulate_devices(args.devices)  # before JAX starts, in case the step compiles
    try:
        predicted, step_args, shape, rules = predict(args)
    except ShardingError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    model, precision = MODELS[args.model], memory.PRECISIONS[args.precision]
    count = sum(leaf.size for leaf in jax.tree.leaves(step_args[0]))
    devices = args.topology_devices  # --topology: XLA:TPU compiles it, whatever its size (nothing allocated)
    compiles = devices is not None or (count <= COMPILES_UP_TO and len(jax.devices()) == args.devices)
    step = make_train_step(
        model.compiled_optimizer(args),
        model.task.loss,
        precision=None if precision == memory.FP32 else precision,
    )
    on = args.topology or f"{args.devices} devices"
    where = f"under {args.parallel} on {on}, batch {args.batch_size}, {args.precision}"
    print(f"{args.model} ({count:,} parameters) {where}: bytes per device")
    try:
        compiled = _compiled(step_args, step, shape, rules, devices) if compiles else None
    except jax.errors.JaxRuntimeError as error:  # XLA:TPU out of HBM: the compiler's own verdict
        print(f"XLA:TPU refuses it: {str(error).splitlines()[0]}")
        compiles, compiled = True, None
    print(predicted.table(compiled))
    if not compiles:
        print(f"(not compiled here: {count:,} parameters on {args.devices} devices; predicted only)")
    if args.hardware:
        print(predicted.verdict(HARDWARE[args.hardware], args.devices))
    return 0


def _compiled(
    args: tuple[Any, Any, Any], step: Any, shape: dict[str, int], rules: AxisRules, devices: Any
) -> Memory:
    """``memory_analysis()`` of the train step as ``train`` compiles it: the model and state donated
    (on ``devices``: a TPU slice's, or None for the simulated CPU devices)."""
    sharded = Sharded(make_mesh(shape, devices=devices), rules, donate_argnums=(0, 1))(step)
    return Memory.of(sharded.lower(*args).compile())
