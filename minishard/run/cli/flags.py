"""Flags: the types argparse reads them with, and the checks that need several at once.

Every flag is checked before any work starts (no data read, no device asked
for), and a bad one is argparse's one ``error: argument --flag: ...`` line and
exit status 2. A type checks one flag; ``finish_train`` checks them together,
asking the model's entry and the style's entry for their own checks, so a new
model or style never edits this module.

>>> mesh("data=2,model=4"), rules("mlp=model,embed=none")
({'data': 2, 'model': 4}, {'mlp': 'model', 'embed': None})
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from minishard.run import distributed
from minishard.run.cli.accelerators import fit_devices
from minishard.styles import mesh_rules

if TYPE_CHECKING:
    from minishard.run.cli.models.entry import ModelEntry
    from minishard.run.cli.styles.style import Style

__all__ = [
    "DEFAULT_DEVICES",
    "DEFAULT_MESH",
    "LOG_FORMATS",
    "PLOT_FORMATS",
    "Error",
    "Flag",
    "add_model_flags",
    "address",
    "at_least",
    "check_output",
    "default_text",
    "fill_defaults",
    "finish_train",
    "flag_owners",
    "integer",
    "mesh",
    "number",
    "pairs",
    "positive",
    "refuse_other_models_flags",
    "rules",
    "seconds",
    "sizes",
    "unit_interval",
]

Error = Callable[[str], NoReturn]
"""A parser's ``error``: prints ``usage`` and ``prog: error: <message>``, exits with status 2."""
DEFAULT_MESH = "data=2,model=4"
"""The mesh without --mesh or --parallel on 8 devices: the 2d style's (on N devices, ``mesh_rules("2d", N)``;
with --parallel: the style's mesh)."""
DEFAULT_DEVICES = 8
"""``train --devices``'s default, unless the model's default run names its own (``ModelEntry.devices``)."""
PLOT_FORMATS = (".png", ".pdf", ".svg")
LOG_FORMATS = (".jsonl", ".json", ".log", ".txt")


# -- types: one flag each ------------------------------------------------------------------------
def sizes(text: str) -> list[int]:
    """``"784,512,10"`` -> ``[784, 512, 10]``: at least two positive sizes."""
    try:
        found = [int(size) for size in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 784,512,10, got {text!r}") from None
    if len(found) < 2 or min(found) < 1:
        raise argparse.ArgumentTypeError(
            f"expected at least two positive sizes like 784,512,10, got {text!r}"
        )
    return found


def at_least(least: int) -> Callable[[str], int]:
    """An argparse type: an int >= ``least``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be at least {least}, got {value}")
        return value

    return parse


def number(accept: Callable[[float], bool], wanted: str) -> Callable[[str], float]:
    """An argparse type: a float that ``accept`` takes, e.g. ``number(lambda x: x > 0, "> 0")``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value) or not accept(value):
            raise argparse.ArgumentTypeError(f"must be a finite number {wanted}, got {text}")
        return value

    return parse


positive = number(lambda x: x > 0, "> 0")
unit_interval = number(lambda x: 0 <= x < 1, "in [0, 1)")


def pairs(text: str) -> dict[str, str]:
    """``"data=2,model=4"`` -> ``{"data": "2", "model": "4"}``; a name given twice is an error."""
    found: dict[str, str] = {}
    for item in filter(None, text.split(",")):
        name, sep, value = (part.strip() for part in item.partition("="))
        if not sep or not name:
            raise argparse.ArgumentTypeError(f"expected name=value pairs like data=2,model=4, got {item!r}")
        if name in found:
            raise argparse.ArgumentTypeError(f"{name!r} is given twice in {text!r}")
        found[name] = value
    return found


def mesh(text: str) -> dict[str, int]:
    """``"data=2,model=4"`` -> ``{"data": 2, "model": 4}``: axis names and sizes >= 1."""
    given = pairs(text)
    if not given:
        raise argparse.ArgumentTypeError("expected at least one axis, like data=8")
    try:
        shape = {name: int(size) for name, size in given.items()}
    except ValueError:
        raise argparse.ArgumentTypeError(f"mesh axis sizes must be integers, got {text!r}") from None
    if bad := [f"{name}={size}" for name, size in shape.items() if size < 1]:
        raise argparse.ArgumentTypeError(f"mesh axis sizes must be at least 1, got {', '.join(bad)}")
    return shape


def rules(text: str) -> dict[str, str | None]:
    """``"mlp=model,embed=none"`` -> ``{"mlp": "model", "embed": None}``."""
    return {name: None if value.lower() in ("", "none") else value for name, value in pairs(text).items()}


def address(text: str) -> str:
    """``HOST:PORT``, as ``distributed.split_address`` reads it."""
    try:
        distributed.split_address(text)
    except distributed.DistributedError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def integer(least: int) -> Callable[[str], int]:
    """An argparse type for a process count or id: an integer >= ``least``."""

    def parse(text: str) -> int:
        if not text.lstrip("-").isdigit() or int(text) < least:
            raise argparse.ArgumentTypeError(f"must be an integer >= {least}, got {text!r}")
        return int(text)

    return parse


def seconds(text: str) -> float:
    """A number of seconds > 0 (not infinite)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}")
    return value


@dataclasses.dataclass(frozen=True)
class Flag:
    """One flag a model (or a few) takes: its help and how argparse reads it; each model gives its default.

    ``Flag("features per token", type=at_least(1))`` in the ViT's entry is
    ``--width``, ``"ViT: features per token (default 64)"`` in ``--help``.
    """

    help: str
    type: Callable[[str], Any] | None = None
    choices: Sequence[str] | None = None
    action: str | None = None  # "store_true": a switch, given or not

    def add_to(self, parser: argparse.ArgumentParser, name: str, owners: Sequence[ModelEntry]) -> None:
        """Add ``--name`` to ``parser``, its help naming the models that take it and their defaults."""
        options: dict[str, Any] = {"action": self.action} if self.action else {"type": self.type}
        if self.choices is not None:
            options["choices"] = self.choices
        shown = "" if self.action else default_text(name, owners)
        help = f"{', '.join(entry.label for entry in owners)}: {self.help}{shown}"
        parser.add_argument("--" + name.replace("_", "-"), default=None, help=help, **options)


def default_text(name: str, models: Iterable[ModelEntry]) -> str:
    """``" (default 128)"``, or per model ``" (default: mlp 0.2, vit 0.1)"``; nothing if none sets one."""
    models = list(models)
    defaults = {entry.name: entry.defaults[name] for entry in models if entry.defaults.get(name) is not None}
    if len(set(map(str, defaults.values()))) == 1 and len(defaults) == len(models):
        return f" (default {next(iter(defaults.values()))})"
    return (
        f" (default: {', '.join(f'{model} {value}' for model, value in defaults.items())})"
        if defaults
        else ""
    )


def check_output(flag: str, path: str | None, formats: Sequence[str], error: Error) -> None:
    """A file to write at the end: its format, and that its directory takes a file, checked at the start."""
    if path is None:
        return
    if os.path.splitext(path)[1].lower() not in formats:
        error(f"argument {flag}: {path} must end with one of {', '.join(formats)}")
    if not os.path.isdir(directory := os.path.dirname(os.path.abspath(path))):
        error(f"argument {flag}: the directory of {path} does not exist; create it first")
    try:  # tried, not guessed: os.access lets root write anywhere, /proc included
        tempfile.NamedTemporaryFile(dir=directory).close()
    except OSError as e:
        error(f"argument {flag}: {path} cannot be written ({e.strerror or e})")


# -- train's flags together -----------------------------------------------------------------------
def finish_train(
    args: argparse.Namespace, error: Error, model: ModelEntry, style: Style, models: Iterable[ModelEntry]
) -> argparse.Namespace:
    """Fill in what was not given (per model, per style) and check the flags together.

    Each check ends with one ``error:`` line. The order: flags of another model, the
    style's own refusals, the defaults, then every check (the hooks': ``styles/style.py``).
    """
    refuse_other_models_flags(args, model, models, error)
    given = args.devices is not None
    if not given:  # the default run (the model's style, no --mesh) may have a count of its own
        default_run = args.parallel == model.style and args.mesh is None
        args.devices, args.devices_reason = model.devices if default_run else (DEFAULT_DEVICES, "")
    fit_devices(args, given, error)  # on a machine with chips: no more than there are
    style.finish(args, error)
    if args.mesh is None:  # decided from the parsed values: --mesh given (in any spelling) always wins
        args.mesh = style.mesh(args.devices) if args.parallel else mesh_rules("2d", args.devices)[0]
    args.rules = args.rules or {}
    style.check_mesh(args, error)  # before the model's checks: dp on model=8 is no fault of --heads
    args.resume = args.resume or args.resume_from is not None
    warmup_given = args.warmup_steps is not None
    fill_defaults(args, model, style)
    if args.dataset not in model.datasets:
        error(
            f"argument --dataset: the {model.label} trains on {', '.join(model.datasets)}, not {args.dataset}"
        )
    model.check(args, error)
    _check_duration(args, model, error)
    _check_warmup(args, warmup_given, error)
    _check_checkpointing(args, error)
    _check_batch(args, error)
    check_output("--plot", args.plot, PLOT_FORMATS, error)
    check_output("--log", args.log, LOG_FORMATS, error)
    style.check_microbatches(args, error)
    style.check(args, model, error)
    return args


def fill_defaults(args: argparse.Namespace, model: ModelEntry, style: Style) -> argparse.Namespace:
    """What was not given, from the style (a pipeline's stacked blocks), then the model's entry."""
    for name in ("dataset", *model.flags):  # explain takes none of them: all the model's defaults
        setattr(args, name, getattr(args, name, None))
    args.dataset = args.dataset or model.datasets[0]
    style.fill(args, model)
    if getattr(args, "epochs", None) is None and getattr(args, "steps", None) is None:
        args.epochs, args.steps = model.defaults.get("epochs"), model.defaults.get("steps")
    for name, value in model.defaults.items():
        if getattr(args, name, None) is None and name not in ("epochs", "steps", "eval_every"):
            setattr(args, name, value)
    if args.steps is not None and getattr(args, "eval_every", None) is None:
        args.eval_every = model.defaults.get("eval_every")
    model.fill(args)
    return args


def flag_owners(
    models: Iterable[ModelEntry], names: Callable[[ModelEntry], Iterable[str]] | None = None
) -> dict[str, list[ModelEntry]]:
    """``{flag: the models that take it}``, each flag once: ``--width`` is the ViT's and the GPT's.

    ``names(entry)`` picks which of an entry's flags count: all of them (``train``), or
    only those that change the step ``explain`` prices (``ModelEntry.explain_flags``).
    """
    owners: dict[str, list[ModelEntry]] = {}
    for entry in models:
        for name in entry.flags if names is None else names(entry):
            owners.setdefault(name, []).append(entry)
    return owners


def add_model_flags(parser: argparse.ArgumentParser, owners: Mapping[str, Sequence[ModelEntry]]) -> None:
    """Each flag of ``owners`` once, its help naming the models that take it (``Flag.add_to``)."""
    for name, takers in owners.items():
        takers[0].flags[name].add_to(parser, name, takers)


def refuse_other_models_flags(
    args: argparse.Namespace, model: ModelEntry, models: Iterable[ModelEntry], error: Error
) -> None:
    """A flag of another model would be silently ignored: it is an error that names who takes it."""
    for name, takers in flag_owners(models).items():
        if model not in takers and getattr(args, name, None) is not None:
            labels = " and the ".join(entry.label for entry in takers)
            takes = "takes" if len(takers) == 1 else "take"
            error(
                f"argument --{name.replace('_', '-')}: only the {labels} {takes} it, and --model is "
                f"{model.name}; add --model {takers[0].name}"
            )


def _check_duration(args: argparse.Namespace, model: ModelEntry, error: Error) -> None:
    """By epochs (if the model has them) or by steps, not both; --eval-every only by steps."""
    if args.epochs is not None and args.steps is not None:
        error("argument --steps: give --epochs or --steps, not both")
    if args.epochs is not None and "epochs" not in model.defaults:  # e.g. batches drawn per step
        error(f"argument --epochs: the {model.label} trains by steps; give --steps")
    if args.eval_every is not None and args.steps is None:
        error("argument --eval-every: only with --steps (by epochs, every epoch is evaluated)")


def _check_warmup(args: argparse.Namespace, given: bool, error: Error) -> None:
    """A cosine's warmup ends before the run does: a given one is refused, a default one cut (said first)."""
    if args.schedule != "cosine" or None in (args.steps, args.warmup_steps) or args.warmup_steps < args.steps:
        return
    if given:
        error(
            f"argument --warmup-steps: {args.warmup_steps} warmup steps do not end within --steps "
            f"{args.steps} (the learning rate would only rise); give fewer than {args.steps}"
        )
    args.warmup_default, args.warmup_steps = args.warmup_steps, args.steps - 1  # train says so, first


def _check_checkpointing(args: argparse.Namespace, error: Error) -> None:
    """What needs a checkpoint directory, and what cannot go together."""
    if not args.checkpoint_dir:
        for flag, given in (("--resume-from", args.resume_from is not None), ("--overwrite", args.overwrite)):
            if given:
                error(f"argument {flag}: needs --checkpoint-dir")
    if (args.resume or args.checkpoint_every) and not args.checkpoint_dir:
        error("--resume and --checkpoint-every need --checkpoint-dir")
    if args.overwrite and args.resume:
        error(
            "argument --overwrite: a resumed run keeps its checkpoints; "
            "give --overwrite or --resume, not both"
        )
    if args.checkpoint_dir and os.path.exists(args.checkpoint_dir) and not os.path.isdir(args.checkpoint_dir):
        error(f"argument --checkpoint-dir: {args.checkpoint_dir} is a file, not a directory")


def _check_batch(args: argparse.Namespace, error: Error) -> None:
    """The global batch splits evenly over the mesh's "data" devices, and over the processes."""
    data_ways = args.mesh.get("data", 1)
    if args.batch_size % data_ways:
        error(
            f"argument --batch-size: {args.batch_size} cannot be split evenly over data={data_ways} devices"
        )
    try:  # each process reads batch_size / processes rows of every global batch
        processes = distributed.detect(args.coordinator, args.num_processes, args.process_id).num_processes
    except distributed.DistributedError as e:
        error(str(e))
    if args.batch_size % processes:
        error(f"argument --batch-size: {args.batch_size} cannot be split evenly over {processes} processes")
