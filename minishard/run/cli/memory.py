"""``minishard explain --memory``: a step's bytes per device, term by term (``minishard.memory``).

The textbook's formulas take one device's sizes; this module reads them from the
plan of the model at hand (the MLP's layers, a transformer's heads and hidden
units as the style splits them, the examples the batch gives each device), so
the prediction needs no compile: ``jax.eval_shape`` and an ``AbstractMesh`` suffice.
ZeRO's own step (``--parallel zero``) places its arrays itself: its terms come from the
shapes it places (``zero_step_budget``), its activations from data parallelism's plan.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from typing import Any, cast

import jax
from jax.sharding import Mesh

from minishard import composition, memory, pipeline, plan
from minishard.census import human_bytes
from minishard.costs import HARDWARE, Memory
from minishard.experts import MoE, capacity, moe_activations
from minishard.memory import Budget
from minishard.models.attention import RINGS
from minishard.pipeline import StackedModel
from minishard.precision import FP32, PRECISIONS, Precision
from minishard.rules import AnyMesh, AxisRules, ShardingError, as_mesh_axes
from minishard.run.cli.accelerators import simulate_devices
from minishard.run.cli.models import MODELS
from minishard.run.cli.styles import style_of
from minishard.run.cli.styles.zero import ZeroStyle
from minishard.run.steps import loss_scaled_for, make_train_step
from minishard.sharding import Sharded, make_mesh
from minishard.zero import ZeroStep

__all__ = [
    "COMPILES_UP_TO",
    "activations",
    "budget",
    "compiled_memory",
    "compiler_of",
    "predict",
    "print_memory",
    "zero_step_budget",
]

COMPILES_UP_TO = 50_000_000
"""Parameters up to which ``--memory`` compiles the step here for its compiled column (a model of
50 M float32 parameters and its AdamW state take 0.8 GB per simulated device at most)."""


def budget(
    args: tuple[Any, Any, Any],
    mesh: AnyMesh,
    rules: AxisRules,
    precision: Precision = FP32,
    compiler: str = "xla:cpu",
) -> Budget:
    """``memory.step_budget`` of ``(model, opt_state, batch)``, what it keeps from
    ``activations``, as ``compiler`` (``memory.COMPILERS``) keeps it."""
    model, _, batch = args
    kept = _kept(model, batch, mesh, rules, precision.params, compiler)
    return memory.step_budget(args, mesh, rules, precision, kept)


def zero_step_budget(step: ZeroStep, model: Any, batch: Any, rules: AxisRules) -> Budget:
    """``memory.zero_budget`` of ZeRO's ``step`` on ``model`` (whole, as built) and ``batch``, placed as the
    step places them; it keeps the activations of data parallelism (``rules``: dp's), whose batch it splits.
    """
    kept = _kept(model, batch, step.mesh, rules, step.compute, "xla:cpu")
    return memory.zero_budget(step, (*step.placed_shapes(model), batch), kept)


def _kept(
    model: Any, batch: Any, mesh: AnyMesh, rules: AxisRules, dtype: str, compiler: str
) -> dict[str, int]:
    """``activations`` and what the style adds, in bytes, ``dtype`` the one the step computes in."""
    kept, added = activations(model, batch, mesh, rules, dtype, compiler)
    return {"activations": kept, **added}


def activations(
    model: Any,
    batch: Any,
    mesh: AnyMesh,
    rules: AxisRules,
    dtype: str = "float32",
    compiler: str = "xla:cpu",
) -> tuple[int, dict[str, int]]:
    """Bytes one device keeps for the backward pass (an MLP's, or a transformer's blocks and head),
    and what its style adds beside them, by name; ``dtype``: the one the step computes in. A
    transformer's blocks keep what ``compiler`` keeps: ``memory.block_activations`` (XLA:CPU's),
    ``memory.kept_on_tpu`` (XLA:TPU's).

    Each size is the whole one over the ways the rules split its *activation's* logical axes
    (``("batch", "seq", "heads", "kv")`` for q, k, v): under ``fsdp`` the weights split over
    "data", the activations split by the batch, as the ordered rules say. Each style's chapter
    says what it changes: a pipeline keeps its stage's blocks of ``pipeline.in_flight``
    microbatches, a ring attention what ``composition.ring_kept`` says (and its chunks pass by,
    ``composition.ring_in_flight``), a mixture of experts its slots (``experts.moe_activations``).
    """
    leaves = {leaf.path: leaf for leaf in plan(model, mesh, rules).leaves}
    first = jax.tree.leaves(batch)[0]
    ways = lambda *axes: _ways(rules, mesh, ("batch", *axes))  # noqa: E731
    b = first.shape[0] // ways()[0]  # examples per device
    c = memory.itemsize(dtype)
    if not hasattr(model, "blocks"):  # minishard.mlp: each Linear's input, then its output
        weights = [leaf for path, leaf in leaves.items() if path.endswith(".weight")]
        axes = [weights[0].logical_axes[0], *[leaf.logical_axes[1] for leaf in weights]]
        sizes = [weights[0].shape[0], *[leaf.shape[1] for leaf in weights]]
        widths = tuple(n // ways(axis)[1] for n, axis in zip(sizes, axes))
        return c * memory.mlp_activations(b, widths), {}
    stacked = isinstance(model, StackedModel)  # a pipeline's: its blocks on "stage"
    block, at = (model.blocks.block, "blocks.block.") if stacked else (model.blocks[0], "blocks[0].")
    before = model.before if stacked else model.embedding
    x = jax.eval_shape(lambda f, ids: f(ids), before, first).shape  # the first block's input
    ends = (lambda m, ids: m.after(m.before(ids))) if stacked else (lambda m, ids: m(ids))
    logits = math.prod(jax.eval_shape(ends, model, first).shape[1:])  # per example: a GPT's, per token
    if hasattr(block, "attention"):
        per_device = (b, x[1], logits)  # examples and tokens on one device, logits per example
        one_block, head, added = _transformer(block, at, leaves, *per_device, ways, dtype, compiler)
    else:  # a pipeline's MLP: each block a Linear (w -> w) and its Swish
        width, added = x[-1], {}
        one_block = lambda n, _: c * memory.mlp_activations(n, (width, width))  # noqa: E731
        inputs = leaves["before.layers[0].weight"].shape[0]
        head = c * memory.mlp_activations(b, (inputs, width, logits))
    if stacked and model.pipeline is not None:  # each stage: its blocks, of every microbatch in flight
        pipe = model.pipeline
        # its inputs and outputs: the whole batch's
        added["pipeline loop"] = 2 * c * math.prod(x) // ways()[0]
        in_flight = pipeline.in_flight(pipe.stages, pipe.microbatches, pipe.repeats)
        blocks = in_flight * (model.blocks.n // pipe.stages) * one_block(b // pipe.microbatches, "none")
        return int(blocks) + head, added
    n, policy = (model.blocks.n, "none") if stacked else (len(model.blocks), model.remat)
    kept, whole = one_block(b, policy), one_block(b, "none")
    return n * kept + (whole - kept) + head, added  # and one block recomputed at a time


def _transformer(
    block: Any,
    at: str,
    leaves: dict[str, Any],
    b: int,
    s: int,
    logits: int,
    ways: Any,
    dtype: str,
    compiler: str,
) -> tuple[Callable[[int, str], int], int, dict[str, int]]:
    """A transformer's block as a function of its examples and its policy, what the head keeps, for
    ``b`` examples of ``s`` tokens on one device, and what the style adds (a ring: its chunks in
    flight), in bytes of ``dtype`` (but what ``compiler`` keeps in another)."""
    width, heads, head_dim = leaves[at + "attention.query"].shape[-3:]
    _, seq, heads_split, _ = ways("seq", "heads", "kv")
    sp = ways("seq", "embed")[1] // seq  # the residual stream's tokens split further (tp+sp)
    t, heads = s // seq, heads // heads_split  # one device's tokens and heads
    kv_heads = leaves[at + "attention.key"].shape[-2] // heads_split  # grouped-query: fewer
    moe = block.mlp if isinstance(block.mlp, MoE) else None
    hidden = 0 if moe else leaves[at + "mlp.layers[0].weight"].shape[-1] // ways("seq", "mlp")[2]
    ring = block.attention.core in RINGS.values()  # its pairs dense or by the kernels: K/V in flight
    c = memory.itemsize(dtype)
    in_flight = composition.ring_in_flight(b, t, heads, head_dim, kv_heads)
    added = {"ring K/V": c * in_flight} if ring else {}
    plain = not ring and moe is None and sp == 1  # what kept_on_tpu was read from

    def one_block(examples: int, recompute: str) -> int:
        sizes = (examples, t, width, heads, head_dim, hidden)
        if compiler == "xla:tpu" and plain:
            tpu = memory.kept_on_tpu(*sizes, dtype, recompute)
            grouped = memory.grouped_kv_on_tpu(examples, t, heads, kv_heads, head_dim, dtype, recompute)
            return sum(tpu.values()) - grouped  # k and v: fewer heads
        recompute = "selective" if ring and recompute == "none" else recompute  # the ring keeps no softmax
        kept = memory.block_activations(*sizes, sp, recompute)
        grouped = memory.grouped_kv(examples, t, heads, kv_heads, head_dim)  # k and v: fewer heads
        kept -= 0 if recompute == "full" else grouped
        kept += composition.ring_kept(examples, t, heads) if ring and recompute == "selective" else 0
        if moe is None or recompute in ("full", "names"):  # these recompute the MLP from its input
            return c * kept
        slots = capacity(t, moe.n_experts, moe.k, moe.capacity_factor)
        e_hidden = leaves[at + "mlp.experts.w_in"].shape[-1]
        return c * (kept + moe_activations(examples, t, moe.n_experts, slots, width, e_hidden))

    return one_block, c * memory.head_activations(b, t, width, logits // seq, sp), added


def _ways(rules: AxisRules, mesh: AnyMesh, axes: tuple[str, ...]) -> tuple[int, ...]:
    """Over how many devices the rules split each of these logical axes of an activation."""
    sizes = dict(mesh.shape)
    spec = (*rules.spec(axes, mesh), *(None,) * len(axes))[: len(axes)]
    named = [() if entry is None else (entry,) if isinstance(entry, str) else entry for entry in spec]
    return tuple(math.prod(sizes[name] for name in entry) for entry in named)


def predict(args: argparse.Namespace) -> tuple[Budget, tuple[Any, Any, Any], dict[str, int], AxisRules]:
    """``explain --memory``'s prediction from its checked flags (``parse_args``), nothing compiled: the
    budget, the step's ``(model, opt_state, batch)`` as shapes, the style's mesh shape and rules. The
    model is as the style prepares it for the mesh: a pipeline's schedule, said in one line.

    Raises ``ShardingError`` where the style's rules cannot split the model.
    """
    model, style = MODELS[args.model], style_of(args.parallel)
    shape, rules = style.mesh(args.devices), style.rules({})
    mesh = jax.sharding.AbstractMesh(tuple(shape.values()), tuple(shape))
    built = jax.eval_shape(lambda: style.build(model, args, jax.random.key(0)))
    built = style.prepare(built, args, cast(Mesh, mesh))  # a pipeline's schedule needs only the mesh's shape
    precision = PRECISIONS[args.precision]
    optimizer = loss_scaled_for(precision, model.compiled_optimizer(args))  # as train runs it
    batch = model.example(args, args.batch_size)
    if isinstance(style, ZeroStyle):  # ZeRO's own step: the state as it places it
        step = style.step(optimizer, cast(Mesh, mesh), model.task)
        step_args = (built, step.placed_shapes(built)[1], batch)
        return zero_step_budget(step, built, batch, rules), step_args, shape, rules
    step_args = (built, jax.eval_shape(optimizer.init, built), batch)
    return budget(step_args, mesh, rules, precision, compiler_of(args)), step_args, shape, rules


def compiler_of(args: argparse.Namespace) -> str:
    """Whose program ``explain --memory`` predicts: XLA:TPU's for a ``--topology`` or on a TPU,
    else XLA:CPU's (``memory.COMPILERS``; a GPU's is predicted as XLA:CPU's, unchecked)."""
    on_tpu = getattr(args, "topology", None) is not None or jax.devices()[0].platform == "tpu"
    return "xla:tpu" if on_tpu else "xla:cpu"


def print_memory(args: argparse.Namespace) -> int:
    """``explain --memory``: the predicted table (no compile, any size), the compiled column where the
    step compiles here, and with ``--hardware`` whether it fits on one accelerator's HBM."""
    simulate_devices(args.devices)  # before JAX starts, in case the step compiles
    try:
        predicted, step_args, shape, rules = predict(args)
    except ShardingError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    count = sum(leaf.size for leaf in jax.tree.leaves(step_args[0]))
    devices = args.topology_devices  # --topology: XLA:TPU compiles it, whatever its size (nothing allocated)
    here = len(jax.devices()) == args.devices
    on_chips = jax.devices()[0].platform != "cpu"  # a chip's compiler: any size, nothing is allocated
    compiles = devices is not None or (here and (on_chips or count <= COMPILES_UP_TO))
    on = args.topology or f"{args.devices} devices"
    where = f"under {args.parallel} on {on}, batch {args.batch_size}, {args.precision}"
    print(f"{args.model} ({count:,} parameters) {where}: bytes per device")
    try:
        compiled = compiled_memory(args, step_args, shape, rules, devices) if compiles else None
    except jax.errors.JaxRuntimeError as error:  # XLA:TPU out of HBM: the compiler's own verdict
        print(f"XLA:TPU refuses it: {str(error).splitlines()[0]}")
        compiles, compiled = True, None
    print(predicted.table(compiled))
    note = gathered_early(predicted, compiled, step_args[0], shape, rules, args.precision)
    on_cpu = devices is None and jax.devices()[0].platform == "cpu"  # XLA:CPU's step, not a chip's
    if note and on_cpu:
        print(note)
    if not compiles:
        print(f"(not compiled here: {count:,} parameters on {args.devices} devices; predicted only)")
    if args.hardware:
        print(predicted.verdict(HARDWARE[args.hardware], args.devices))
    return 0


def gathered_early(
    predicted: Budget,
    compiled: Memory | None,
    model: Any,
    shape: dict[str, int],
    rules: AxisRules,
    precision: str,
) -> str | None:
    """Under FSDP, where XLA:CPU's temporaries exceed the formula's by over 15%, why (one line).

    The formula gathers one weight whole at a time (``gathered``). XLA:CPU runs each all-gather as
    soon as its shard is there, from the start, and keeps the weight whole to its last use in the
    backward pass: at the peak the blocks' weights are whole at once, in float32 (it widens bfloat16
    collectives and computes in float32). Recomputation changes activations, not this peak.
    ``precision``: ``--precision``'s name.
    """
    if compiled is None or "gathered" not in predicted.terms:
        return None
    if compiled.temporaries <= 1.15 * predicted.temporaries:
        return None
    mesh = jax.sharding.AbstractMesh(tuple(shape.values()), tuple(shape))
    batch_spec = rules.spec(("batch",), mesh)  # fsdp splits the weights over the batch's axes
    batch = {axis for entry in batch_spec for axis in as_mesh_axes(entry)}
    gathered = 0  # every weight's numbers on one device once gathered over the batch's axes
    for leaf in plan(model, mesh, rules).leaves:
        split = {axis for entry in leaf.spec for axis in as_mesh_axes(entry)}
        ways = math.prod(shape[axis] for axis in batch & split)
        gathered += math.prod(leaf.shard_shape) * ways if ways > 1 else 0
    copies = "; in bf16 it keeps float32 copies of activations too" if precision != "fp32" else ""
    return (
        "(XLA:CPU gathers each weight ahead of its use and keeps it whole to the backward pass, "
        f"in float32: {human_bytes(4 * gathered)} where 'gathered' holds one, and --remat "
        f"cannot lower that{copies}: docs/memory.md)"
    )


def compiled_memory(
    args: argparse.Namespace,
    step_args: tuple[Any, Any, Any],
    shape: dict[str, int],
    rules: AxisRules,
    devices: Any = None,
) -> Memory:
    """``memory_analysis()`` of the train step of ``predict``'s ``step_args``, as ``train`` compiles it
    from the same flags: the model and state donated, in ``--precision`` (ZeRO's step: placed by it); on
    ``devices`` (a TPU slice's, or simulated CPU devices; None: all of them)."""
    model, precision, style = MODELS[args.model], PRECISIONS[args.precision], style_of(args.parallel)
    if isinstance(style, ZeroStyle):  # its own step, placing the model and state itself
        zero = style.step(model.compiled_optimizer(args), make_mesh(shape, devices=devices), model.task)
        return Memory.of(zero.lower(*zero.placed_shapes(step_args[0]), step_args[2]).compile())
    step = make_train_step(
        loss_scaled_for(precision, model.compiled_optimizer(args)),  # fp16: as train runs it
        model.task.loss,
        precision=None if precision == FP32 else precision,
    )
    sharded = Sharded(make_mesh(shape, devices=devices), rules, donate_argnums=(0, 1))(step)
    return Memory.of(sharded.lower(*step_args).compile())
