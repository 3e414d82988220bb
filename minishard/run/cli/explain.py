"""``minishard explain``: where a default model's arrays live under a named style, and what its step costs.

Nothing is trained. Without ``--hardware`` nothing is even allocated: the
model is built by ``jax.eval_shape`` and planned on an ``AbstractMesh``, so any
device count works on any machine; a preset's step is then compiled on up to
``accelerators.SENDS_UP_TO`` simulated devices, to show what it sends. ``--hardware`` (or a
style whose own step is the point, such as ``zero``) compiles the step on
simulated devices and prices it too (``minishard.costs``); ``--compare`` ranks every style and mesh shape
(for the GPT, the sequence styles too, its attention a ring where "context" splits it);
with ``--size llama3-70b`` it ranks a named size's dp x fsdp x tp x pp layouts from its shapes,
compiling nothing (``minishard.layouts``); with ``--size gpt --check`` it then compiles the GPT's
fastest few and sets the prediction beside the compiled step (``rank_check``).
``--topology v5e:2x4`` compiles the step for a TPU slice with XLA:TPU, ahead of
time (``minishard.run.topology``), and sets it beside XLA:CPU's program.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import jax

from minishard.census import collectives, human_bytes, instructions, summary
from minishard.costs import HARDWARE, Candidate, StepCost, compare, mesh_shapes
from minishard.precision import PRECISIONS
from minishard.report import explain
from minishard.rules import AxisRules, ShardingError
from minishard.run.cli import decode, rank_check, ranking, styles
from minishard.run.cli.accelerators import (
    SENDS_UP_TO,
    SIMULATE,
    first_devices,
    fit_devices,
    simulate_devices,
)
from minishard.run.cli.flags import (
    DEFAULT_DEVICES,
    PLOT_FORMATS,
    Error,
    add_model_flags,
    at_least,
    check_output,
    fill_defaults,
    flag_owners,
    refuse_other_models_flags,
)
from minishard.run.cli.memory import print_memory
from minishard.run.cli.models import MODELS
from minishard.run.cli.styles import STYLES, style_args, style_of, train_step, warn_unused, zero_batch
from minishard.run.cli.styles.composed import by_dimension
from minishard.run.cli.styles.style import Style
from minishard.run.cli.tpu_slice import check_topology, cpu_twin
from minishard.run.render import plot_comparison, plot_report, show
from minishard.run.steps import make_train_step
from minishard.run.topology import LoweredOnce, on_cpu_and_tpu, side_by_side
from minishard.sharding import Sharded, ShardedFunction, make_mesh
from minishard.styles import ANY_MODEL, EXPERT, PIPELINED, SEQUENCE, SPLITS

__all__ = [
    "DESCRIPTION",
    "HELP",
    "add_arguments",
    "check",
    "print_priced_step",
    "print_report",
    "print_sends",
    "print_state",
    "run",
]

HELP = "print (and --plot) the plan of a default model under a named style"
DEFAULT_STYLE = "2d"
"""The style without --parallel, for a model whose entry names none."""
MEMORY_STYLES = (*SPLITS, "zero")
"""What ``--memory`` predicts: every preset, and ZeRO's own step (``memory.zero_budget``)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``minishard explain``'s flags: a default model, a named style, a device count; a step to price."""
    add = parser.add_argument
    add("--model", choices=list(MODELS), default="mlp", help="(default %(default)s)")
    styles.add_arguments(parser, help=f"(default: the model's, else {DEFAULT_STYLE})")
    add(
        "--devices",
        type=at_least(1),
        help=f"the devices a plan or a price is for (default {DEFAULT_DEVICES}); a step compiled on a "
        f"machine with chips is compiled on them (default: all; {SIMULATE} simulates instead); "
        "--topology: its chips",
    )
    add("--plot", help=f"draw which devices hold each shard of each parameter ({', '.join(PLOT_FORMATS)})")
    add("--hardware", choices=list(HARDWARE), help="price the train step on this accelerator")
    add(
        "--batch-size",
        dest="batch_size",
        type=ranking.count,
        help="global batch of that step (default: the model's); with --size, in tokens (4M)",
    )
    add(
        "--compare",
        action="store_true",
        help="rank every style and mesh shape (or --size's layouts) on --hardware",
    )
    add("--topology", help="compile for this TPU slice with XLA:TPU, ahead of time (v5e:2x4: 8 devices)")
    add("--memory", action="store_true", help="a train step's bytes per device by term; fits?")
    add(
        "--precision",
        choices=tuple(PRECISIONS),
        default="fp32",
        help="with --memory or --hardware: the step's precision, as train --precision runs it",
    )
    decode.add_arguments(add)
    ranking.add_arguments(add)
    rank_check.add_arguments(add)
    # each model's flags that change the step priced (the GPT's --context)
    add_model_flags(parser, flag_owners(MODELS.values(), lambda entry: entry.explain_flags))


def check(args: argparse.Namespace, error: Error) -> argparse.Namespace:
    """--compare needs --hardware; --batch-size needs a step to compile, and must split over "data".

    The style's hooks are called in the order ``styles/style.py`` writes, here and in ``run``.
    """
    given = args.devices is not None  # a compiled step on a machine with chips: all of them (fit_devices)
    args.devices = args.devices if given else DEFAULT_DEVICES
    check_output("--plot", args.plot, PLOT_FORMATS, error)
    ranking.refuse_budget(args, error)
    rank_check.check(args, error)
    decode.check(args, flag_owners(MODELS.values(), lambda entry: entry.explain_flags), error)
    if args.decode:
        return args  # serving is priced from a named size, not from --model's step
    if args.size:  # --compare --size: layouts ranked from the size's shapes, nothing compiled
        ranking.check(args, flag_owners(MODELS.values(), lambda entry: entry.explain_flags), error)
        return args
    model = MODELS[args.model]
    refuse_other_models_flags(args, model, MODELS.values(), error)  # as train does
    if args.compare and not args.hardware:
        error("argument --compare: needs --hardware, the accelerator to rank the layouts on (e.g. v5p)")
    if args.compare and (args.parallel or args.microbatches):
        flag = "--parallel" if args.parallel else "--microbatches"
        error(f"argument {flag}: --compare ranks every style, each as it trains by default; drop {flag}")
    args.parallel = args.parallel or model.style or DEFAULT_STYLE
    style = style_of(args.parallel)
    topology = args.topology is not None
    args.topology_devices = check_topology(args, given, error) if topology else None
    if args.precision != "fp32" and not (args.memory or args.hardware):
        error("argument --precision: only with --memory or --hardware (a step compiled in it)")
    if args.memory and args.compare:
        error("argument --memory: one style at a time; drop --compare")
    if args.memory and args.parallel not in MEMORY_STYLES:
        error(
            f"argument --memory: it predicts the step of {', '.join(MEMORY_STYLES)}, not --parallel "
            f"{args.parallel}'s"
        )
    compiles = args.hardware or args.compare or style.compiles or args.topology or args.memory
    others = " or ".join(f"--parallel {name}" for name, other in STYLES.items() if other.compiles)
    for flag in ("batch_size", "microbatches"):  # a pipeline's microbatches are its plan's: printed
        if (
            getattr(args, flag) is not None
            and not compiles
            and not (flag == "microbatches" and style.own_step)
        ):
            name = "--" + flag.replace("_", "-")
            error(f"argument {name}: only a compiled step takes it; add --hardware (or {others})")
    if args.microbatches is not None and args.memory and not style.checks_microbatches:  # a pipeline: its own
        error("argument --microbatches: --memory predicts a step of whole batches; drop --microbatches")
    if compiles and not args.topology:
        fit_devices(args, given, error)
    args.mesh = {"data": args.devices} if args.compare else style.mesh(args.devices)  # "data" may span all
    style.check_explain(args, model, error)  # what was given, before the defaults fill the rest
    if args.memory and args.parallel in PIPELINED and getattr(args, "remat", None) not in (None, "none"):
        error(
            f"argument --remat: not with a pipeline (--parallel {args.parallel}); its blocks keep everything"
        )
    fill_defaults(args, model, style)  # the model's --batch-size among them (the GPT's: from "data")
    model.check_explain(args, error)
    ways = style.ways(args.mesh)
    if compiles and args.batch_size % ways:
        error(f"argument --batch-size: {args.batch_size} cannot be split evenly over data={ways} devices")
    if compiles and not style.checks_microbatches:  # accumulated, as train --microbatches M does
        style.check_microbatches(args, error)
    return args


def run(args: argparse.Namespace) -> int:
    """``minishard explain --parallel fsdp [--model vit] [--plot FILE]``: the plan of a default model.

    Nothing is trained or allocated: the model is built by ``jax.eval_shape`` and
    planned on an ``AbstractMesh`` with the style's rules, so any device count
    works on any machine; then a preset's step is compiled to show what it sends
    (``print_sends``). Pricing a step (``--hardware``, ``--compare``) or a
    style's own step (``--parallel zero``) compiles it: see ``print_priced_step``.
    """
    if args.decode:
        return decode.print_decode(args)
    if args.size:
        return ranking.print_ranking(args) or (rank_check.print_check(args) if args.check else 0)
    model, style = MODELS[args.model], style_of(args.parallel)
    if refused := style.before_explain(args):
        return refused  # before any work: a pipeline's step is compiled below, on devices
    if args.memory:
        return print_memory(args)
    if args.hardware or args.compare or style.compiles:
        return print_priced_step(args)
    shape, rules = style.mesh(args.devices), style.rules({})
    mesh = jax.sharding.AbstractMesh(tuple(shape.values()), tuple(shape))
    built = jax.eval_shape(lambda: style.build(model, args, jax.random.key(0)))
    try:
        report = explain(built, mesh, rules)
    except ShardingError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print_report(args, report, shape, rules, f"{args.model} under {args.parallel} on {args.devices} devices")
    print_state(args, built, mesh, rules)
    if type(style) is Style:  # a preset's step (the others show their own, after the plan)
        print_sends(args, model, style, rules)
    return style.after_plan(args, model, rules)


def print_sends(args: argparse.Namespace, model: Any, style: Style, rules: AxisRules) -> None:
    """What the compiled step sends, as ``--hardware`` shows it without the price: on the first
    ``--devices`` devices, if there are that many, and the batch splits over "data"."""
    shape, ways = style.mesh(args.devices), style.ways(style.mesh(args.devices))
    why = f"{args.devices} devices; explain compiles on up to {SENDS_UP_TO} without --hardware"
    if args.devices <= SENDS_UP_TO:
        simulate_devices(args.devices)
        why = f"{args.devices} devices asked, there are {len(jax.devices())}"
        if args.batch_size % ways == 0 and len(jax.devices()) >= args.devices:
            mesh, optimizer = make_mesh(shape, devices=first_devices(args)), model.compiled_optimizer(args)
            built = jax.eval_shape(lambda: style.build(model, args, jax.random.key(0)))
            step = Sharded(mesh, rules)(make_train_step(optimizer, model.task.loss))
            example = (built, jax.eval_shape(optimizer.init, built), model.example(args, args.batch_size))
            compiled = step.lower(*example).compile()
            print(f"collectives of train_step, batch {args.batch_size} (compiled; --hardware prices them):")
            print("\n".join("  " + line for line in summary(collectives(compiled)).splitlines()))
            if args.parallel not in STYLES:  # a composition: whose each collective is
                print(by_dimension(args.parallel, instructions(compiled)))
            return
        if args.batch_size % ways:
            why = f"a batch of {args.batch_size} does not split over data={ways}"
    print(f"(the step is not compiled: {why}; the plan above is all)")


def print_priced_step(args: argparse.Namespace) -> int:
    """``explain --hardware H [--parallel NAME | --compare] [--batch-size B]``, and a style's own step.

    The default model's train step is compiled on ``--devices`` (simulated)
    devices: its plan and collectives, priced on ``--hardware`` (``minishard.costs``).
    A failure is one ``error:`` line (XLA:CPU compiled for 2,048 simulated devices here, not 4,096).
    """
    if first_devices(args) is None:
        return 2
    try:
        return _compile_and_price(args)
    except ShardingError as error:
        print(f"error: {error}", file=sys.stderr)
    except jax.errors.JaxRuntimeError as error:  # e.g. too many simulated devices for XLA:CPU
        first, on = str(error).splitlines()[0], args.topology or f"{args.devices} devices"
        advice = "; try fewer --devices" if not args.topology else ""  # XLA:TPU: out of HBM, say
        print(f"error: XLA cannot compile the step on {on} ({first}){advice}", file=sys.stderr)
    return 1


def _compile_and_price(args: argparse.Namespace) -> int:
    model, style = MODELS[args.model], style_of(args.parallel)
    sequence = args.compare and model.sequence is not None  # the ring ranked with the others
    style = STYLES["cp"] if sequence else style  # whose build gives its attention the "ring" core
    shape, rules = style.mesh(args.devices), style.rules({})
    mesh = make_mesh(shape, devices=args.topology_devices or first_devices(args))  # a TPU's, or CPU's
    step, optimizer, step_args = train_step(args, model, style, mesh)
    built, _, batch = step_args
    if args.compare:
        experts = EXPERT if model.expert_count(args) else ()  # a dense model: ep is dp
        ranked_styles = ANY_MODEL + (SEQUENCE if sequence else ()) + experts
        ranked = compare(step, step_args, args.hardware, args.devices, ranked_styles, _own_steps(args, model))
        print(f"{args.model}, batch {args.batch_size}, on {args.devices} devices: every style and mesh shape")
        print(ranked)
        if model.stack is not None:
            print("(pp and dp+pp price the stacked model each trains: one equal block per stage)")
        if args.plot:
            plot_comparison(ranked, args.plot)
            print(f"Wrote {args.plot}")
        return 0
    # one jit: the style's census, explain's and the price share it (on a topology, one lowering too)
    sharded = (LoweredOnce if args.topology else ShardedFunction)(step, Sharded(mesh, rules))
    programs = on_cpu_and_tpu(sharded, step_args) if args.topology and cpu_twin(args, style) else []
    if (status := style.explain_step(args, model, sharded, optimizer, built, batch)) is not None:
        return status
    report = explain(built, mesh, rules, sharded, step_args, args.hardware)
    title = f"{args.model} under {args.parallel} on {args.devices} devices, batch {args.batch_size}"
    print_report(args, report, shape, rules, title)
    print_state(args, built, mesh, rules)
    if programs:
        print(f"One step, per device, compiled by XLA:CPU ({args.devices} simulated devices) and XLA:TPU:")
        print(side_by_side(programs))
    return style.after_plan(args, model, rules)  # a pipeline: the ticks, permutes and bubble priced above


def _own_steps(args: argparse.Namespace, model: Any) -> list[Candidate]:
    """The styles with a step of their own (pp, dp+pp, zero) on each of their mesh shapes, priced."""
    candidates = []
    for name, style in STYLES.items():
        if not style.own_step:
            continue
        for shape in mesh_shapes(style.like, args.devices):
            try:
                candidates.append(Candidate(name, shape, _own_step_cost(args, model, style, shape)))
            except ValueError as error:  # its flags' checks, or a ShardingError: the row says why
                candidates.append(Candidate(name, shape, None, str(error).removeprefix("argument ")))
    return candidates


def _own_step_cost(args: argparse.Namespace, model: Any, style: Style, shape: dict[str, int]) -> StepCost:
    """The style's own step on ``shape``, built with the style's defaults, as ``train`` would run it."""
    own = style_args(args, model, style, shape)
    built = style.build(model, own, jax.random.key(0))
    mesh = make_mesh(shape, devices=first_devices(args))
    return style.own_step_cost(model, own, built, zero_batch(own, model), mesh)


def print_report(
    args: argparse.Namespace, report: Any, shape: dict[str, int], rules: AxisRules, title: str
) -> None:
    """What ``explain`` prints: a warning for an unused mesh axis, the title, the report, the picture."""
    warn_unused(shape, rules)
    print(title)
    show(report)
    if args.plot:
        plot_report(report, args.plot)
        print(f"Wrote {args.plot}")


def print_state(args: argparse.Namespace, built: Any, mesh: Any, rules: AxisRules) -> None:
    """What a step keeps, per device: the parameters, their gradients (laid out as they are) and each
    field of the optimizer's state (AdamW's two moments, SGD's velocity), as ``Sharded`` places them."""
    optimizer = MODELS[args.model].compiled_optimizer(args)
    state = jax.eval_shape(optimizer.init, built)
    parameters = explain(built, mesh, rules).device_bytes
    kept = {"parameters": parameters, "gradients": parameters}
    fields = state._asdict() if hasattr(state, "_asdict") else {"state": state}
    for name, tree in fields.items():
        if any(leaf.ndim for leaf in jax.tree.leaves(tree)):  # not a step counter alone
            kept[f"{type(optimizer).__name__} {name}"] = explain(tree, mesh, rules).device_bytes
    parts = ", ".join(f"{name} {human_bytes(size)}" for name, size in kept.items())
    print(f"per device: {parts}; {human_bytes(sum(kept.values()))} in all")


DESCRIPTION = run.__doc__
