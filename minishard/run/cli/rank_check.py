"""``minishard explain --compare --size gpt --check [N]``: the ranking's top layouts, compiled and measured.

``--compare --size`` ranks layouts from a size's shapes (``minishard.layouts``), nothing compiled.
For minishard's own GPT (``serving.MINISHARD_GPT``) on the process's devices, ``--check N`` compiles the
real train step of the N fastest layouts that fit and that a composition builds (each dimension
its mesh axis: dp and fsdp "data", tp "model", pp "stage"), as ``explain --model gpt --parallel
NAME`` does, and sets what the ranking predicted beside what XLA compiled: the step's price, the
parameters and the memory a device holds, and the bytes each dimension's collectives send. The
compiled step is float32, so the predictions are priced at 4 bytes a number (``price``'s
``itemsize``); the memory's prediction stays mixed precision's, 16 bytes a parameter, as is
float32 AdamW's.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from minishard import layouts, serving
from minishard.census import as_asked, human_bytes, instructions
from minishard.costs import StepCost, sent_bytes, step_cost
from minishard.layouts import Layout, LayoutCost, human_seconds
from minishard.report import explain
from minishard.run.cli.accelerators import simulate_devices
from minishard.run.cli.flags import at_least
from minishard.run.cli.models import MODELS
from minishard.run.cli.styles import style_args, style_of, train_step
from minishard.sharding import Sharded, make_mesh

__all__ = ["CHECKED", "FLOAT32", "Checked", "add_arguments", "check", "composition", "print_check"]

CHECKED = 3
"""Layouts ``--check`` compiles without a count."""
FLOAT32 = 4
"""Bytes a number of the compiled step: ``explain`` compiles the GPT's float32 step."""
AXES = {"dp": "data", "fsdp": "data", "tp": "model", "pp": "stage", "cp": "context"}
"""The mesh axis each dimension of a layout takes (``minishard.styles.DIMENSIONS``)."""


def add_arguments(add: Callable[..., object]) -> None:
    """``--check [N]``: compile the ranking's N fastest layouts that fit."""
    add(
        "--check",
        type=at_least(1),
        nargs="?",
        const=CHECKED,
        help=f"with --compare --size gpt: compile the N fastest layouts that fit (default {CHECKED})",
    )


def check(args: argparse.Namespace, error: Callable[[str], object]) -> None:
    """``--check`` ranks, then compiles the GPT's step on every device of this process: before any work."""
    if args.check is None:
        return
    if not args.compare:
        error("argument --check: only with --compare --size gpt (it compiles the ranking's layouts)")
    if args.size != "gpt":
        error(f"argument --check: compiles minishard's own GPT (--size gpt), not --size {args.size}")
    if args.context not in (None, rows := serving.MINISHARD_GPT.position_rows):
        error(f"argument --context: --check compiles the default GPT, of {rows} positions")
    simulate_devices(args.devices)  # before the backend starts: the count the CLI simulates
    if args.devices != (there := len(jax.devices())):
        error(f"argument --devices: --check compiles on this process's devices, {there}, not {args.devices}")


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
    return "+".join(dims), {AXES[dim]: size for dim, size in ways.items()} or {"data": 1}


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


def compile_layout(args: argparse.Namespace, layout: Layout, name: str, shape: dict[str, int]) -> Checked:
    """Compile the GPT's train step of ``layout`` under ``name`` on ``shape``, as ``explain --hardware``
    does, and price the same step from the size's shapes."""
    entry, style, tokens = MODELS["gpt"], style_of(name), args.batch_size
    gpt = argparse.Namespace(**{**vars(args), "model": "gpt", "batch_size": tokens // args.context})
    own = style_args(gpt, entry, style, shape)  # its defaults, checked: ValueError says why not
    mesh, rules = make_mesh(shape, devices=jax.devices()[: args.devices]), style.rules({})
    started = time.perf_counter()
    step, _, step_args = train_step(own, entry, style, mesh)
    lowered = Sharded(mesh, rules)(step).lower(*step_args)
    compiled = step_cost(lowered, args.hardware)  # compiles; the census below reuses the program
    sent: dict[str, float] = {}
    dims = {AXES[dim]: dim for dim in layout.ways()}
    for kind, nbytes, groups, devices in instructions(as_asked(lowered), mesh):
        axes = [axis.split("(")[0] for axis in groups[0]]
        who = " x ".join(dims.get(axis, axis) for axis in axes)
        sent[who] = sent.get(who, 0.0) + sent_bytes(kind, nbytes, devices)
    seconds = time.perf_counter() - started
    parameters = explain(step_args[0], mesh, rules).device_bytes
    model, chip, context = serving.SIZES[args.size], args.hardware, args.context
    predicted = layouts.price(model, layout, tokens, chip, context=context, itemsize=FLOAT32)
    m = getattr(own, "microbatches", None) or 1  # the compiled pipeline's, which its sends follow
    expected = layouts.bytes_sent(model, layout, tokens, FLOAT32, context, m)
    return Checked(predicted, expected, compiled, parameters, sent, seconds)


def print_check(args: argparse.Namespace) -> int:
    """Compile the ``--check`` fastest layouts that fit and build; print predicted -> compiled."""
    model, tokens, devices = serving.SIZES[args.size], args.batch_size, args.devices
    ranking = layouts.rank(model, tokens, devices, args.hardware, args.context)
    checked: list[Checked] = []
    print(f"\n--check {args.check}: the fastest that fit, compiled (the GPT's float32 step, XLA:CPU)")
    for cost in (cost for cost in ranking.costs if cost.fits):
        if len(checked) == args.check:
            break
        built = composition(cost.layout)
        if isinstance(built, str):
            print(f"  {cost.layout}: skipped, {built}")
            continue
        try:
            checked.append(compile_layout(args, cost.layout, *built))
        except ValueError as why:
            print(f"  {cost.layout}: skipped, --parallel {built[0]} refuses it ({why})")
            continue
        mesh = ",".join(f"{axis}={size}" for axis, size in built[1].items())
        print(f"  {cost.layout}: --parallel {built[0]} on {mesh}, compiled in {checked[-1].seconds:.1f} s")
    print(_table(checked, model))
    print(_order(checked))
    return 0


def _table(checked: list[Checked], model: serving.Decoder) -> str:
    """Per layout: step, parameters, memory, and each dimension's bytes sent, predicted -> compiled."""
    lines = [f"  {'layout':16} {'':14} {'predicted':>10} {'compiled':>10} {'ratio':>6}"]
    for row in checked:
        layout = row.predicted.layout
        shards = layout.fsdp * layout.tp * layout.pp
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
    if any(row.predicted.layout.pp > 1 for row in checked):
        why.append("the compiled price has no pipeline bubble (it cannot tell a stage's idle ticks)")
    if any(row.compiled.comm_s > row.compiled.compute_s for row in checked):
        why.append("each collective's latency, not its bytes, prices so small a model's step")
    why.append("the compiled price hides every collective behind the backward pass, not each pass's own")
    return f"the compiled steps rank them {', '.join(compiled)}, not as predicted: {'; '.join(why)}"
