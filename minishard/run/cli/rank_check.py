"""``minishard explain --compare --size S --check [N]``: the ranking's top layouts, compiled.

``--compare --size`` ranks layouts from a size's shapes (``minishard.layouts``), nothing compiled.
For minishard's own GPT (``serving.MINISHARD_GPT``) on the process's devices, ``--check N`` compiles the
real train step of the N fastest layouts that fit and that a composition builds (each dimension
its mesh axis: dp and fsdp "data", tp "model", pp "stage"), as ``explain --model gpt --parallel
NAME`` does, and sets what the ranking predicted beside what XLA compiled: the step's price, the
parameters and the memory a device holds, and the bytes each dimension's collectives send. The
compiled step is float32, so the predictions are priced at 4 bytes a number (``price``'s
``itemsize``), and its memory as the step compiled keeps it (``layouts.Kept``): float32
activations, none recomputed, beside 16 bytes a parameter (float32 AdamW's, as mixed precision's).
The layouts it compiles are the fastest of that step (``compiled_kept``): nothing recomputed,
where ``--compare``'s own table ranks each block recomputed.

A published size (``--size llama3-405b``) is compiled scaled down to 8 devices
(``minishard.run.cli.scaled``: its model, its batch, and ``--layout`` if given), priced on 8 of its
chip; with ``--topology v5e:2x4`` either is compiled by XLA:TPU for the slice, ahead of time
(``minishard.run.topology``), and priced on its chips.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax

from minishard import layouts, serving
from minishard.census import axis_name, human_bytes, instructions
from minishard.costs import StepCost, sent_bytes, step_cost
from minishard.layouts import Layout, LayoutCost, human_seconds
from minishard.precision import FP32
from minishard.report import explain
from minishard.run.cli import scaled
from minishard.run.cli.accelerators import simulate_devices
from minishard.run.cli.flags import Error, at_least
from minishard.run.cli.models import MODELS
from minishard.run.cli.models.entry import ModelEntry
from minishard.run.cli.styles import style_args, style_of, train_step
from minishard.run.topology import chip_count, hardware_of, tpu_devices
from minishard.sharding import Sharded, make_mesh
from minishard.styles import DIMENSIONS

__all__ = [
    "CHECKED",
    "FLOAT32",
    "Built",
    "Checked",
    "add_arguments",
    "check",
    "check_scaled",
    "compiled_kept",
    "compile_layout",
    "composition",
    "print_check",
    "print_scaled_check",
    "scaled_run",
]

CHECKED = 3
"""Layouts ``--check`` compiles without a count."""
FLOAT32 = 4
"""Bytes a number of the compiled step: ``explain`` compiles the GPT's float32 step."""


def add_arguments(add: Callable[..., object]) -> None:
    """``--check [N]``: compile the ranking's N fastest layouts that fit."""
    add(
        "--check",
        type=at_least(1),
        nargs="?",
        const=CHECKED,
        help=f"with --compare --size: compile the N fastest layouts that fit (default {CHECKED}); "
        f"a published size scaled down to {scaled.DEVICES} devices; --topology: for a TPU slice",
    )


def check(args: argparse.Namespace, error: Error) -> None:
    """``--check`` ranks, then compiles the GPT's step on every device of this process (a published
    size's scaled down, ``check_scaled``), or of ``--topology``'s slice: before any work."""
    args.check_devices = args.check_topology = None  # where it compiles, if not on this process's
    if args.check is None:
        return
    if not (args.compare and args.size):
        error("argument --check: only with --compare --size (it compiles the ranking's layouts)")
    if (args.repeats or 1) > 1:  # what it compiles is minishard's pipeline, GPipe's, r = 1
        error("argument --repeats: --check compiles each pipeline un-interleaved (r = 1)")
    if args.size != "gpt":
        return check_scaled(args, error)
    if args.context not in (None, rows := serving.MINISHARD_GPT.position_rows):
        error(f"argument --context: --check compiles the default GPT, of {rows} positions")
    if args.topology is not None:
        return _check_slice(args, error, priced_on=args.hardware)
    simulate_devices(args.devices)  # before the backend starts: the count the CLI simulates
    if args.devices != (there := len(jax.devices())):
        error(f"argument --devices: --check compiles on this process's devices, {there}, not {args.devices}")


def check_scaled(args: argparse.Namespace, error: Error) -> None:
    """A published size's ``--check``: its sequence must outlast ``scaled.WIDTH_CUT``; a
    ``--topology`` has ``scaled.DEVICES`` chips, which price the scaled run."""
    if args.context is not None and args.context < (cut := scaled.WIDTH_CUT):
        error(f"argument --context: --check cuts the sequence by {cut}; {args.context} leaves none")
    if args.topology is not None:
        return _check_slice(args, error)
    simulate_devices(scaled.DEVICES)


def _check_slice(args: argparse.Namespace, error: Error, priced_on: str = "") -> None:
    """--check --topology: a slice of ``scaled.DEVICES`` chips (the GPT's: of --hardware's chip),
    whose devices it compiles on with XLA:TPU; ``--compare --size`` reads no other --topology."""
    try:
        chips, chip = chip_count(args.topology), hardware_of(args.topology)
        if chips != (devices := scaled.DEVICES):
            raise ValueError(f"--check compiles on {devices} devices; {args.topology} is {chips}")
        if priced_on not in ("", chip):
            raise ValueError(f"{args.topology}'s chips are {chip}, not --hardware {priced_on}")
        args.check_devices = tpu_devices(args.topology)
    except ValueError as why:
        error(f"argument --topology: {why}")
    args.check_topology, args.topology = args.topology, None


def composition(layout: Layout) -> tuple[str, dict[str, int]] | str:
    """The ``--parallel`` composition and mesh that build ``layout``, or why none does.

    tp is Megatron's with the sequence split between blocks, ``+sp``, but beside pp (``tp+pp``).

    >>> composition(Layout(dp=2, tp=4)), composition(Layout(dp=2, fsdp=4))[:27]
    (('dp+tp+sp', {'data': 2, 'model': 4}), 'HSDP (dp x fsdp) is not a c')
    """
    ways = layout.ways()
    if "dp" in ways and "fsdp" in ways:
        return "HSDP (dp x fsdp) is not a composition: both split the batch over 'data'"
    dims = list(ways) or ["dp"]
    if "tp" in dims and "pp" not in dims:  # sp and pp do not compose (styles.CONFLICTS)
        dims.insert(dims.index("tp") + 1, "sp")
    return "+".join(dims), layout.mesh() or {"data": 1}


class Built(NamedTuple):
    """What ``compile_layout`` compiles: a model's entry, the shapes that price it, the devices."""

    entry: ModelEntry
    size: serving.Decoder
    devices: Sequence[jax.Device]


class Checked(NamedTuple):
    """One layout, predicted (``layouts.price`` and ``bytes_sent`` at float32) and compiled: the step
    priced on the same chip (``costs.step_cost``), parameter bytes per device, bytes sent per dimension
    (a collective over two mesh axes as ``dp x tp``), and the seconds it took to compile."""

    predicted: LayoutCost
    expected: dict[str, float]
    compiled: StepCost
    parameters: int
    sent: dict[str, float]
    seconds: float


def compile_layout(
    args: argparse.Namespace,
    layout: Layout,
    name: str,
    shape: dict[str, int],
    built: Built | None = None,
) -> Checked:
    """Compile the GPT's train step of ``layout`` under ``name`` on ``shape``, as ``explain --hardware``
    does, and price the same step from the size's shapes; ``built``: another GPT's entry, the shapes
    that price it and the devices it compiles on (a scaled run, a TPU slice: ``scaled_run``)."""
    here = args.check_devices or jax.devices()[: args.devices]  # a slice's, or this process's
    built = built or Built(MODELS["gpt"], serving.SIZES[args.size], here)
    entry, style, tokens = built.entry, style_of(name), args.batch_size
    gpt = argparse.Namespace(**{**vars(args), "model": "gpt", "batch_size": tokens // args.context})
    own = style_args(gpt, entry, style, shape)  # its defaults, checked: ValueError says why not
    mesh, rules = make_mesh(shape, devices=built.devices), style.rules({})
    started = time.perf_counter()
    step, _, step_args = train_step(own, entry, style, mesh, shapes=True)  # compiled, never run
    # compiled once: a float32 step's collectives are as its partitioner asked (census.as_asked), so
    # the price and the census read the one program (XLA:TPU's takes minutes on 2 cores)
    program = Sharded(mesh, rules)(step).lower(*step_args).compile()
    compiled = step_cost(program, args.hardware)
    sent: dict[str, float] = {}
    dims = {DIMENSIONS[dim].axis: dim for dim in layout.ways()}
    for send in instructions(program.as_text() or "", mesh):
        axes = [axis_name(label) for label in send.groups[0]]
        who = " x ".join(dims.get(axis, axis) for axis in axes)
        sent[who] = sent.get(who, 0.0) + sent_bytes(send.kind, send.result_bytes, send.devices)
    seconds = time.perf_counter() - started
    parameters = explain(step_args[0], mesh, rules).device_bytes
    model, chip, context = built.size, args.hardware, args.context
    kept = compiled_kept(own)
    predicted = layouts.price(model, layout, tokens, chip, kept, context=context, itemsize=FLOAT32)
    m = getattr(own, "microbatches", None) or 1  # the compiled pipeline's, which its sends follow
    expected = layouts.bytes_sent(model, layout, tokens, FLOAT32, context, m)
    return Checked(predicted, expected, compiled, parameters, sent, seconds)


def compiled_kept(args: argparse.Namespace) -> layouts.Kept:
    """What the compiled step keeps and recomputes: float32, under the GPT's --remat (none by
    default). The layouts ``--check`` compiles are ranked under it too: the fastest of the step
    compiled, whose recomputed FLOPs (``layouts.recomputed_flops``) and memory are its own."""
    return layouts.Kept(precision=FP32, remat=getattr(args, "remat", None) or "none")


def print_check(args: argparse.Namespace) -> int:
    """Compile the ``--check`` fastest layouts that fit and build; print predicted -> compiled."""
    if args.size != "gpt":
        return print_scaled_check(args)
    model, tokens, devices = serving.SIZES[args.size], args.batch_size, args.devices
    kept = compiled_kept(args)  # ranked as the step compiled: its memory, what it recomputes
    ranking = layouts.rank(model, tokens, devices, args.hardware, args.context, kept=kept)
    compiled = f"the GPT's float32 step, {_compiler(args)}"
    print(f"\n--check {args.check}: the fastest that fit, compiled ({compiled})")
    checked = _compile_each(args, [cost.layout for cost in ranking.costs if cost.fits], args.check)
    print(_table(checked, model))
    print(_order(checked))
    return 0


def _table(checked: list[Checked], model: serving.Decoder) -> str:
    """Per layout: step, parameters, memory, and each dimension's bytes sent, predicted -> compiled."""
    lines = [f"  {'layout':16} {'':14} {'predicted':>10} {'compiled':>10} {'ratio':>6}"]
    for row in checked:
        layout = row.predicted.layout
        shards = layout["fsdp"] * layout["tp"] * layout["pp"]
        rows: list[tuple[str, float, float, Callable[[Any], str]]] = [
            ("step", row.predicted.step_s, row.compiled.step_s, human_seconds),
            ("parameters", FLOAT32 * model.params / shards, row.parameters, _bytes),
            ("memory", row.predicted.memory.total, row.compiled.memory.total, _bytes),
        ]
        for who in [*row.expected, *(who for who in row.sent if who not in row.expected)]:
            rows.append((f"{who} sends", row.expected.get(who, 0.0), row.sent.get(who, 0.0), _bytes))
        for i, (what, guess, found, show) in enumerate(rows):
            ratio = f"{found / guess:6.2f}" if guess else f"{'-':>6}"
            name = str(layout) if i == 0 else ""
            lines.append(f"  {name:16} {what:14} {show(guess):>10} {show(found):>10} {ratio}")
    return "\n".join(lines)


def _bytes(n: float) -> str:
    return human_bytes(int(n)) if n else "-"


def _order(checked: list[Checked]) -> str:
    """Whether the compiled prices rank the layouts as the predictions do, and if not, why."""
    predicted = [str(row.predicted.layout) for row in sorted(checked, key=lambda row: row.predicted.step_s)]
    compiled = [str(row.predicted.layout) for row in sorted(checked, key=lambda row: row.compiled.step_s)]
    if predicted == compiled:
        return f"the compiled steps rank them as predicted: {', '.join(compiled)}"
    why = []
    if any(row.predicted.layout["pp"] > 1 for row in checked):
        why.append("the compiled price has no pipeline bubble (it cannot tell a stage's idle ticks)")
    if any(row.compiled.comm_s > row.compiled.compute_s for row in checked):
        why.append("each collective's latency, not its bytes, prices so small a model's step")
    why.append("the compiled price hides every collective behind the backward pass, not each pass's own")
    return f"the compiled steps rank them {', '.join(compiled)}, not as predicted: {'; '.join(why)}"


# --- a published run, scaled down -----------------------------------------------------------


def scaled_run(args: argparse.Namespace) -> tuple[argparse.Namespace, Built]:
    """The flags of ``args``'s published run cut to ``scaled.DEVICES`` (``scaled``'s rules): the
    GPT's shape flags, the batch and sequence, the devices, and the chip (a slice's, if given)."""
    size, chip = scaled.scaled_down(serving.SIZES[args.size]), args.hardware
    tokens, context = scaled.scaled_batch(args.batch_size, args.devices, args.context)
    shape = {"width": size.width, "depth": size.layers, "heads": size.heads, "mlp_ratio": 1}
    batch = {"batch_size": tokens, "context": context, "devices": scaled.DEVICES}
    run = {**shape, **batch, "kv_heads": size.kv_heads}
    chip = hardware_of(args.check_topology) if args.check_topology else args.hardware
    own = argparse.Namespace(**{**vars(args), **run, "hardware": chip})
    devices = args.check_devices or jax.devices()[: scaled.DEVICES]
    return own, Built(scaled.entry_of(size), scaled.as_built(size, context), devices)


def print_scaled_check(args: argparse.Namespace) -> int:
    """Rank the scaled run on ``scaled.DEVICES``, compile its ``--check`` fastest that fit and the
    published ``--layout`` scaled (``scaled.scaled_layout``); print predicted -> compiled."""
    own, built = scaled_run(args)
    size, tokens, context = built.size, own.batch_size, own.context
    on = f"{scaled.DEVICES} devices of {own.hardware}"
    compiled = f"compiled (float32, {_compiler(args)})"
    print(f"\n--check {args.check}: {args.size} scaled down to {on}, {compiled}")
    heads = f"{size.heads} heads ({size.kv_heads} key/value) of {size.head_dim}"
    mlp = f"{'gated ' if size.gated else ''}MLP of {size.hidden}"
    print(f"  {size.layers} layers of {size.width}, {heads}, {mlp}, ", end="")
    print(f"vocabulary {size.vocab}: {size.params:,} parameters")
    print(f"  {tokens // context} sequences of {context} tokens a step")
    kept = compiled_kept(own)  # ranked as the step compiled: its memory, what it recomputes
    ranking = layouts.rank(size, tokens, scaled.DEVICES, own.hardware, context, kept=kept)
    fastest = [cost.layout for cost in ranking.costs if cost.fits]
    checked = _compile_each(own, fastest, args.check, built)
    theirs = scaled.scaled_layout(args.layout) if args.layout is not None else None
    if theirs is not None and theirs not in _layouts(checked):
        print(f"  --layout {args.layout}, scaled:")
        checked += _compile_each(own, [theirs], 1, built)
    print(_table(checked, size))
    print(_order(checked))
    return 0


def _compile_each(
    args: argparse.Namespace, candidates: list[Layout], count: int, built: Built | None = None
) -> list[Checked]:
    """The first ``count`` of ``candidates`` that a composition builds, compiled; a line each."""
    checked: list[Checked] = []
    for layout in candidates:
        if len(checked) == count:
            break
        made = composition(layout)
        if isinstance(made, str):
            print(f"  {layout}: skipped, {made}")
            continue
        try:
            checked.append(compile_layout(args, layout, *made, built))
        except ValueError as why:
            print(f"  {layout}: skipped, --parallel {made[0]} refuses it ({why})")
            continue
        mesh = ",".join(f"{axis}={size}" for axis, size in made[1].items())
        seconds = checked[-1].seconds
        print(f"  {layout}: --parallel {made[0]} on {mesh}, compiled in {seconds:.1f} s")
    return checked


def _layouts(checked: list[Checked]) -> list[Layout]:
    return [row.predicted.layout for row in checked]


def _compiler(args: argparse.Namespace) -> str:
    return f"XLA:TPU for {args.check_topology}" if args.check_topology else "XLA:CPU"
