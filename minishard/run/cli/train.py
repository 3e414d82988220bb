"""``minishard train``: ``fit`` a model of ``MODELS`` on a device mesh, as the flags say.

    minishard train --model vit --parallel fsdp --epochs 1 --checkpoint-dir runs/vit

Everything here is flags and printing: the model's entry (``models``) says
what is trained and on what, the style's entry (``styles``) how it is spread,
and ``minishard.run.train.fit`` trains. One subtlety: simulated CPU devices
must be requested through ``XLA_FLAGS`` before JAX starts its backend (at the
first ``jax.devices()``, not at ``import jax``), so ``run`` sets the flag
before anything asks for devices.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from typing import Any

import jax  # importing is fine; the backend (and XLA_FLAGS) starts at the first jax.devices()

from minishard.constraints import DEFAULT_BATCH_AXIS
from minishard.optim import Optimizer
from minishard.precision import PRECISIONS
from minishard.report import explain
from minishard.rules import ShardingError
from minishard.run import distributed
from minishard.run.cli import flags, styles
from minishard.run.cli.accelerators import SIMULATE, built_on_the_host, run_devices, simulate_devices
from minishard.run.cli.flags import Error, at_least, default_text, finish_train
from minishard.run.cli.models import MODELS
from minishard.run.cli.models.entry import ModelEntry, Splits
from minishard.run.cli.styles import cli_rules, style_of, warn_unused
from minishard.run.cli.styles.style import Style
from minishard.run.compiling import enable_compilation_cache
from minishard.run.data import check_batch_split
from minishard.run.errors import (
    CheckpointError,
    TrainingError,
    exit_status,
    sigterm_as_interrupt,
    stopped,
)
from minishard.run.horizon import Horizon
from minishard.run.profiling import Profile, add_profile_flags, check_profile_flags
from minishard.run.render import plot_history, show
from minishard.run.resume import check_checkpoint_dir
from minishard.run.steps import loss_scaled_for
from minishard.run.tfds_reading import DataError
from minishard.run.train import FitSettings, fit
from minishard.sharding import Sharded, make_mesh, plan
from minishard.styles import dimensions

__all__ = ["EXPECTED_ERRORS", "HELP", "add_arguments", "check", "run", "train_on_mesh"]

HELP = f"train a model ({', '.join(MODELS)}) on a device mesh, on its data set"
EXPECTED_ERRORS: tuple[type[Exception], ...] = (
    DataError,
    ShardingError,
    TrainingError,
    CheckpointError,
    distributed.DistributedError,
)
"""Failures whose message already says what and where: printed as one ``error:`` line."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``minishard train``'s flags. A flag whose default is ``None`` was not given (see ``check``)."""
    parser.set_defaults(model="mlp", seed=0)
    models = ", ".join(f"{entry.name} ({entry.help})" for entry in MODELS.values())
    parser.add_argument("--model", choices=list(MODELS), help=f"{models} (default %(default)s)")
    datasets = sorted({name for entry in MODELS.values() for name in entry.datasets})
    firsts: dict[str, list[str]] = {}  # each model's first data set, and the models it is first of
    for entry in MODELS.values():
        firsts.setdefault(entry.datasets[0], []).append(entry.name)
    default = "; ".join(f"{name} for {', '.join(takers)}" for name, takers in firsts.items())
    parser.add_argument("--dataset", choices=datasets, help=f"the model's data set (default: {default})")
    _add_model_flags(parser)
    _add_training_flags(parser)
    _add_mesh_flags(parser)
    _add_run_flags(parser)
    _add_process_flags(parser)
    styles.add_arguments(parser, help="a named style's mesh and rules (--mesh and --rules still override)")


def _add_model_flags(parser: argparse.ArgumentParser) -> None:
    """Each model's own flags (``ModelEntry.flags``), once each, naming the models that take them."""
    flags.add_model_flags(parser, flags.flag_owners(MODELS.values()))


def _add_training_flags(parser: argparse.ArgumentParser) -> None:
    """How long, how large and how fast: every model takes these; each gives its own defaults."""

    def add(flag: str, help: str, **options: Any) -> None:
        name = flag.removeprefix("--").replace("-", "_")
        parser.add_argument(flag, help=help + default_text(name, MODELS.values()), **options)

    add("--epochs", "total epochs, also when resuming", type=at_least(1))
    add("--steps", "train by steps instead: total steps, also when resuming", type=at_least(1))
    add(
        "--eval-every",
        "with --steps: steps between evaluations (default: only after the last)",
        type=at_least(1),
    )
    add(
        "--batch-size",
        "global batch size (default: the model's)",
        type=at_least(1),
    )
    add("--lr", "initial (or peak) learning rate", type=flags.positive)
    add("--schedule", "learning rate schedule", choices=("exponential", "cosine"))
    add("--warmup-steps", "cosine: steps of linear warmup", type=at_least(0))
    parser.add_argument(
        "--precision",
        choices=tuple(PRECISIONS),
        default="fp32",
        help="bf16, fp16: each step computes in 16 bits on the float32 model, fp16 with a dynamic loss "
        "scale (minishard.memory, minishard.precision; default fp32)",
    )


def _add_mesh_flags(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add(
        "--mesh",
        type=flags.mesh,
        help=f"mesh axes, e.g. data=2,model=4 (default: --parallel's, else the 2d style's on the "
        f"devices: {flags.DEFAULT_MESH} on {flags.DEFAULT_DEVICES})",
    )
    add("--explicit", action="store_true", help="Explicit mesh axes: shardings are part of array types")
    add(
        "--rules",
        type=flags.rules,
        help="logical=mesh rules, e.g. mlp=model (default: the 2d style's, on the axes of --mesh)",
    )
    own = "".join(f"; the {e.label}'s default run {e.devices[0]}" for e in MODELS.values() if e.devices[1])
    devices = (
        f"without an accelerator, the CPU devices to simulate (default {flags.DEFAULT_DEVICES}{own}); "
        f"on a machine with chips, how many of them (default: all; {SIMULATE} simulates instead)"
    )
    add("--devices", type=at_least(1), help=devices)
    add("--seed", type=at_least(0))


def _add_run_flags(parser: argparse.ArgumentParser) -> None:
    """Checkpoints, what is written at the end, where the data is, and how a failure is shown."""
    add = parser.add_argument
    add("--checkpoint-dir", help="save checkpoints here (every --checkpoint-every steps, and per record)")
    add("--checkpoint-every", type=at_least(1), default=None, help="steps between checkpoints")
    add("--keep", type=at_least(1), default=3, help="checkpoints to keep (default %(default)s)")
    add("--resume", action="store_true", help="continue from the latest good checkpoint")
    add(
        "--resume-from",
        metavar="STEP",
        type=at_least(0),
        help="continue from this checkpoint (implies --resume)",
    )
    add(
        "--overwrite",
        action="store_true",
        help="a fresh run may delete the checkpoints another run left in --checkpoint-dir",
    )
    add(
        "--plot",
        help=f"draw the loss, the metrics and the learning rate ({', '.join(flags.PLOT_FORMATS)})",
    )
    add("--log", help="append JSON lines of metrics (per epoch or evaluation, and every 20 steps)")
    add("--data-dir", help="TFDS data directory (default: $TFDS_DATA_DIR, then ~/tensorflow_datasets)")
    add("--no-download", dest="download", action="store_false", help="never touch the network")
    add(
        "--compile-cache",
        help="keep compiled programs in this directory (JAX's persistent compilation cache)",
    )
    add("--debug", action="store_true", help="show the full traceback of an unexpected error")
    add_profile_flags(parser)


def _add_process_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of a multi-process run; each defaults to the environment (``distributed.detect``)."""
    group = parser.add_argument_group(
        "multi-process run", "one process per host; see docs/multihost.md (default: the environment)"
    )
    add = group.add_argument
    add(
        "--coordinator",
        metavar="HOST:PORT",
        type=flags.address,
        help="process 0's address (default: $JAX_COORDINATOR_ADDRESS, or SLURM's first node)",
    )
    add(
        "--num-processes",
        metavar="N",
        type=flags.integer(1),
        help="processes in the run ($JAX_NUM_PROCESSES)",
    )
    add("--process-id", metavar="I", type=flags.integer(0), help="this process, 0..N-1 ($JAX_PROCESS_ID)")
    add(
        "--init-timeout",
        metavar="SECONDS",
        type=flags.seconds,
        default=distributed.DEFAULT_TIMEOUT,
        help="wait this long for the coordinator and every process (default %(default)s)",
    )


def check(args: argparse.Namespace, error: Error) -> argparse.Namespace:
    """Every flag together, before any work (``flags.finish_train``); the errors are argparse's."""
    model = MODELS[args.model]
    args.parallel_default = args.parallel is None and model.style is not None  # Style.check_mesh
    args.parallel = args.parallel or model.style
    if args.precision != "fp32" and style_of(args.parallel).own_step:
        error(
            f"argument --precision: {args.precision} casts Sharded's step, and --parallel "
            f"{args.parallel} runs a step of its own; give a preset style (dp, tp, fsdp, ...)"
        )
    args = finish_train(args, error, model, style_of(args.parallel), MODELS.values())
    check_profile_flags(args, error)
    if getattr(args, "dropout", None):
        _check_dropout(args, style_of(args.parallel), error)
    return args


def _check_dropout(args: argparse.Namespace, style: Style, error: Error) -> None:
    """--dropout's masks are drawn in fit's own step (its key from the step), on whole batches, in the
    dense attention core: refused where any of the three is not there, before any work."""
    where = f"argument --dropout: {args.dropout:g} with --parallel {args.parallel}"
    if style.own_step:
        error(f"{where}, which runs a step of its own that draws no masks; give dp, fsdp, tp, 2d or tp+sp")
    if "cp" in dimensions(args.parallel):
        error(f"{where}: ring attention never holds the attention weights to drop; give a style without cp")
    if style.microbatches(args) > 1:
        error(f"{where} and --microbatches {args.microbatches}: masks are drawn per batch; give 1")


def run(args: argparse.Namespace) -> int:
    """Set up simulated devices, join the run, ``train_on_mesh``; every way out is one line and a status."""
    simulate_devices(args.devices)  # per process: with 2 processes, --devices 4 makes 8 in all
    if default := getattr(args, "warmup_default", None):  # flags._check_warmup cut it
        print(
            f"note: the default --warmup-steps {default} does not fit in --steps {args.steps}: warming "
            f"up for {args.warmup_steps} (every step but the last); give --warmup-steps below "
            f"{args.steps} for a cosine after the warmup",
            file=sys.stderr,
        )
    try:  # a scheduler's SIGTERM (preemption) stops the run as Ctrl-C does, saying where to resume
        # Join the run that the flags or the environment describe (nothing to do for one process).
        place = args.coordinator, args.num_processes, args.process_id
        with sigterm_as_interrupt():
            distributed.initialize(*place, timeout=args.init_timeout)
            with distributed.print_on_main_only():  # process 0 speaks for the run
                return train_on_mesh(args)
    except KeyboardInterrupt as stop:  # Ctrl-C, or SIGTERM (errors.Terminated)
        print(f"\n{stopped(stop, args.checkpoint_dir)}", file=sys.stderr)
        return distributed.leave(exit_status(stop))  # several processes: exit now, for all
    except Exception as error:
        if args.debug:
            raise
        if isinstance(error, EXPECTED_ERRORS):
            print(f"error: {error}", file=sys.stderr)
        else:
            print(
                f"error: {type(error).__name__}: {error} (run with --debug for the traceback)",
                file=sys.stderr,
            )
        return distributed.leave(1)


def train_on_mesh(args: argparse.Namespace) -> int:
    """Run ``fit`` as the arguments say; 0 on success, 2 on a mesh that does not fit the devices."""
    model, style = MODELS[args.model], style_of(args.parallel)
    resume = dict(resume=args.resume, resume_from=args.resume_from, overwrite=args.overwrite)
    if args.checkpoint_dir:  # another run's checkpoints, a read-only disk, a missing step: before any work
        check_checkpoint_dir(args.checkpoint_dir, **resume)
    if (devices := run_devices(args)) is None:
        return 2
    if args.compile_cache:
        enable_compilation_cache(args.compile_cache)
    mesh = make_mesh(args.mesh, devices=devices, explicit=args.explicit)
    rules = cli_rules(args, mesh.axis_names)
    check_batch_split(Sharded(mesh, rules).batch_sharding, args.batch_size)
    with built_on_the_host():  # its many small operations compile in milliseconds there
        built = style.build(model, args, jax.random.key(args.seed))
    built = style.prepare(built, args, mesh)
    if refused := _check_rule_names(args, built, mesh, rules):
        return refused
    if distributed.is_main_process():
        warn_unused(args.mesh, rules)
    print(f"Rules: {rules}")
    show(explain(built, mesh, rules))  # plans every parameter: a rule that cannot work fails here
    # The data loads after the build, on this thread, never beside it: TFDS's imports swap
    # builtins.__import__ for the whole process (etils' lazy_imports), so an import JAX made meanwhile
    # came back a LazyModule (issue 59: 4 of 55 runs died so).
    splits = model.data(args)
    optimizer = model.optimizer(
        args, Horizon.of(args.epochs, args.steps, args.eval_every, splits.train).total
    )
    optimizer = loss_scaled_for(PRECISIONS[args.precision], optimizer)  # fp16: the loss scaled
    history = _fit(args, model, style, built, optimizer, splits, mesh, rules)
    if args.plot and history and distributed.is_main_process():
        plot_history(history, args.plot, optimizer.learning_rate)
        print(f"Wrote {args.plot}")
    return 0


def _check_rule_names(args: argparse.Namespace, built: Any, mesh: jax.sharding.Mesh, rules: Any) -> int:
    """2 (one ``error:`` line) for a ``--rules`` name no array carries: it would split nothing, silently."""
    carried = {DEFAULT_BATCH_AXIS} | {
        name for leaf in plan(built, mesh, rules).leaves for name in leaf.logical_axes if name is not None
    }
    for name in args.rules:
        if name not in carried:
            near = difflib.get_close_matches(name, carried, n=1, cutoff=0.4)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            print(
                f"error: argument --rules: no array of the {args.model} carries the logical axis {name!r}"
                f"{hint}; its logical axes are {', '.join(sorted(carried))}",
                file=sys.stderr,
            )
            return 2
    return 0


def _fit(
    args: argparse.Namespace,
    model: ModelEntry,
    style: Style,
    built: Any,
    optimizer: Optimizer,
    splits: Splits,
    mesh: jax.sharding.Mesh,
    rules: Any,
) -> list[dict[str, Any]]:
    """``fit``'s run of ``built``, as the flags, the model's entry and the style's entry say."""
    settings = FitSettings(
        mesh=mesh,
        rules=rules,
        epochs=args.epochs,
        steps=args.steps,
        eval_every=args.eval_every,
        eval_data=splits.eval,
        test_data=splits.test,
        task=model.task,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        keep=args.keep,
        resume=args.resume,
        resume_from=args.resume_from,
        overwrite=args.overwrite,
        # what `sample` needs to rebuild the model, without data; the schedule a resume must follow;
        # the precision a refused resume names (fp16's state carries a loss scale)
        info={**model.saved(args), **splits.info, "schedule": _schedule(args), "precision": args.precision},
        make_step=style.make_step(args, mesh),  # None: fit's own Sharded step
        metrics_log=args.log if distributed.is_main_process() else None,  # one writer per file
        log_every=20,
        microbatches=style.microbatches(args),
        precision=None if args.precision == "fp32" else PRECISIONS[args.precision],
        profile=Profile(args.profile, *args.profile_steps) if args.profile else None,
        seed=args.seed if getattr(args, "dropout", None) else None,  # dropout's keys: from the run's seed
    )
    _, _, history = fit(built, optimizer, splits.train, settings)
    return history


def _schedule(args: argparse.Namespace) -> dict[str, Any]:
    """The flags the learning rate follows, by flag: a resume under other values is refused, naming one.

    A cosine spans the run, so its length (``--steps`` or ``--epochs``) is part of it; an
    exponential decay is the same curve however long the run (a run may be continued longer).
    """
    flags = {"--lr": args.lr, "--schedule": args.schedule}
    if args.schedule == "cosine":
        length = ("--steps", args.steps) if args.steps is not None else ("--epochs", args.epochs)
        return {**flags, "--warmup-steps": args.warmup_steps, length[0]: length[1]}
    decay = ("decay_rate", "decay_steps", "staircase")
    return {**flags, **{f"--{name.replace('_', '-')}": getattr(args, name, None) for name in decay}}
