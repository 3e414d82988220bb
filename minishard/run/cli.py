"""``minishard train | explain | launch``: the command line over ``minishard.run.train.fit``.

>>> args = parse_args(["train", "--mesh", "data=2,model=4", "--rules", "mlp=model"])
>>> args.mesh, args.rules, args.layers
({'data': 2, 'model': 4}, {'mlp': 'model'}, [784, 512, 10])

Everything here is argument parsing and printing; the work happens in
``fit``, ``minishard.explain`` and ``minishard.run.launch``. One subtlety:
simulated CPU devices must be requested through ``XLA_FLAGS`` before JAX
starts its backend (at the first ``jax.devices()``, not at ``import jax``),
so ``main`` sets the flag before it asks for devices.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

import jax  # importing is fine; the backend (and XLA_FLAGS) starts at the first jax.devices()
import jax.numpy as jnp

from minishard import pipeline
from minishard.census import collectives, summary
from minishard.costs import HARDWARE, compare, cost_report
from minishard.layers import ACTIVATIONS, megatron_axes, mlp
from minishard.models.vit import ViT, stacked_vit
from minishard.optim import SGD, Schedule, exponential_decay, warmup_cosine_decay
from minishard.presets import PIPELINED, STYLES, preset, preset_rules, rules_for_mesh
from minishard.report import explain
from minishard.rules import AxisRules, ShardingError
from minishard.run import distributed, launch
from minishard.run.data import DATASET_INFO, DATASETS, DataError
from minishard.run.render import plot_comparison, plot_report, show
from minishard.run.train import (
    TrainingError,
    check_checkpoint_dir,
    enable_compilation_cache,
    fit,
    make_train_step,
)
from minishard.sharding import Sharded, make_mesh
from minishard.zero import zero_train_step

try:  # orbax is an optional extra (minishard[checkpoint])
    from minishard.run.checkpoint import CheckpointError
except ImportError:
    CheckpointError = TrainingError  # type: ignore[misc,assignment]  # never raised without orbax


HIDDEN = {"mnist": [512], "cats_vs_dogs": [2048, 1024]}
"""Hidden layer sizes of each dataset's classic MLP; inputs and classes come from DATASET_INFO."""
DEFAULT_MESH = "data=2,model=4"
"""The mesh without --mesh or --parallel (with --parallel: the style's mesh)."""
DEFAULTS = dict(
    model="mlp",
    dataset="mnist",
    batch_size=128,
    decay_rate=0.7,
    decay_steps=1000,
    momentum=0.9,
    devices=8,
    seed=0,
)
MODEL_FLAGS: dict[str, dict[str, Any]] = {
    "mlp": dict(layers=None, activation="swish"),  # layers None: the dataset's classic MLP
    "vit": dict(width=64, depth=4, heads=4, patch_size=7, mlp_ratio=2, remat=False),
}
"""The flags that shape each model, with their defaults; giving one to the other model is an error."""
MODEL_DEFAULTS: dict[str, dict[str, Any]] = {
    "mlp": dict(epochs=5, lr=0.2, schedule="exponential", warmup_steps=0),
    "vit": dict(epochs=3, lr=0.1, schedule="cosine", warmup_steps=300),
}
"""What differs between the two models' training defaults: a transformer wants a warmup and a cosine.
The ViT's 3 epochs (136-217 s each on 2 CPU cores): 0.971 test accuracy after epoch 3 of a 6-epoch
cosine was measured; a 3-epoch cosine has finished its decay there."""


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(size) for size in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 784,512,10, got {text!r}") from None
    if len(sizes) < 2 or min(sizes) < 1:
        raise argparse.ArgumentTypeError(
            f"expected at least two positive sizes like 784,512,10, got {text!r}"
        )
    return sizes


def _at_least(least: int) -> Callable[[str], int]:
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


def _number(accept: Callable[[float], bool], wanted: str) -> Callable[[str], float]:
    """An argparse type: a float that ``accept`` takes, e.g. ``_number(lambda x: x > 0, "> 0")``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value) or not accept(value):
            raise argparse.ArgumentTypeError(f"must be a finite number {wanted}, got {text}")
        return value

    return parse


_positive = _number(lambda x: x > 0, "> 0")
_momentum = _number(lambda x: 0 <= x < 1, "in [0, 1)")


def _pairs(text: str) -> dict[str, str]:
    """``"data=2,model=4"`` -> ``{"data": "2", "model": "4"}``; a name given twice is an error."""
    pairs: dict[str, str] = {}
    for item in filter(None, text.split(",")):
        name, sep, value = (part.strip() for part in item.partition("="))
        if not sep or not name:
            raise argparse.ArgumentTypeError(f"expected name=value pairs like data=2,model=4, got {item!r}")
        if name in pairs:
            raise argparse.ArgumentTypeError(f"{name!r} is given twice in {text!r}")
        pairs[name] = value
    return pairs


def _mesh(text: str) -> dict[str, int]:
    pairs = _pairs(text)
    if not pairs:
        raise argparse.ArgumentTypeError("expected at least one axis, like data=8")
    try:
        mesh = {name: int(size) for name, size in pairs.items()}
    except ValueError:
        raise argparse.ArgumentTypeError(f"mesh axis sizes must be integers, got {text!r}") from None
    if bad := [f"{name}={size}" for name, size in mesh.items() if size < 1]:
        raise argparse.ArgumentTypeError(f"mesh axis sizes must be at least 1, got {', '.join(bad)}")
    return mesh


def _rules(text: str) -> dict[str, str | None]:
    """``"mlp=model,embed=none"`` -> ``{"mlp": "model", "embed": None}``."""
    return {name: None if value.lower() in ("", "none") else value for name, value in _pairs(text).items()}


EXPLAIN_HELP = "print (and --plot) the plan of a default model under a named style"
PLOT_FORMATS = (".png", ".pdf", ".svg")
LOG_FORMATS = (".jsonl", ".json", ".log", ".txt")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse ``minishard train|explain|launch ...`` and check every flag before any work.

    For ``train``, mesh and rules come back as dicts, layers as a list. A bad
    flag exits with argparse's one-line ``error: argument --flag: ...`` and
    status 2. No flag may be abbreviated (``--mes`` is not ``--mesh``).
    """
    parser = argparse.ArgumentParser(
        prog="minishard", description=__doc__.split("\n\n")[0], allow_abbrev=False
    )
    commands = parser.add_subparsers(dest="subcommand", required=True)  # launch has its own "command"
    add = commands.add_parser  # allow_abbrev is per parser: each subcommand parses its own flags
    train = add(
        "train", help="train an MLP or a ViT on MNIST (or cats_vs_dogs) on a device mesh", allow_abbrev=False
    )
    add_train_arguments(train)
    explainer = add("explain", help=EXPLAIN_HELP, allow_abbrev=False)
    add_explain_arguments(explainer)
    launcher = add(
        "launch", help=launch.HELP, description=launch.HELP, epilog=launch.EXAMPLE, allow_abbrev=False
    )
    launch.add_arguments(launcher)
    args = parser.parse_args(argv)
    if args.subcommand == "launch":
        return launch.check(args, launcher.error)
    if args.subcommand == "explain":
        _check_output("--plot", args.plot, PLOT_FORMATS, explainer.error)
        check_cost_flags(args, explainer.error)
        return _fill_model_defaults(args)
    args = finish_zero(args, train.error)  # --parallel zero: dp's mesh and rules, ZeRO's step
    return _finish_train(args, train.error)  # "minishard train: error: ...", as argparse words its own


def add_train_arguments(train: argparse.ArgumentParser) -> None:
    """``minishard train``'s flags. A flag whose default is ``None`` was not given (see ``_finish_train``)."""
    train.set_defaults(**DEFAULTS)
    add = train.add_argument
    add(
        "--model", choices=sorted(MODEL_DEFAULTS), help="an MLP or a Vision Transformer (default %(default)s)"
    )
    add("--dataset", choices=sorted(DATASETS))
    add(
        "--layers",
        type=_sizes,
        help="MLP: layer sizes (default: 784,512,10 for mnist, 120000,2048,1024,2 for cats_vs_dogs)",
    )
    add("--activation", choices=sorted(ACTIVATIONS), help="MLP: between layers (default swish)")
    vit = MODEL_FLAGS["vit"]
    add("--width", type=_at_least(1), help=f"ViT: features per token (default {vit['width']})")
    add("--depth", type=_at_least(1), help=f"ViT: transformer blocks (default {vit['depth']})")
    add(
        "--heads",
        type=_at_least(1),
        help=f"ViT: attention heads; must divide --width (default {vit['heads']})",
    )
    add(
        "--patch-size",
        type=_at_least(1),
        help=f"ViT: square patches; must divide the image (default {vit['patch_size']})",
    )
    add(
        "--mlp-ratio",
        type=_at_least(1),
        help=f"ViT: MLP hidden units per feature (default {vit['mlp_ratio']})",
    )
    add(
        "--remat",
        action="store_true",
        default=None,
        help="ViT: recompute each block in the backward pass (jax.checkpoint)",
    )
    add("--epochs", type=_at_least(1), help="total epochs, also when resuming (default: mlp 5, vit 3)")
    add("--batch-size", type=_at_least(1), help="global batch size (default %(default)s)")
    add("--lr", type=_positive, help="initial (or peak) learning rate (default: mlp 0.2, vit 0.1)")
    add(
        "--schedule",
        choices=("exponential", "cosine"),
        help="learning rate schedule (default: mlp exponential, vit cosine)",
    )
    add("--warmup-steps", type=_at_least(0), help="cosine: steps of linear warmup (default: vit 300)")
    add(
        "--decay-rate",
        type=_positive,
        help="learning rate factor per --decay-steps (default %(default)s)",
    )
    add("--decay-steps", type=_at_least(1))
    add("--staircase", action="store_true", help="decay in steps rather than smoothly")
    add("--momentum", type=_momentum, help="in [0, 1) (default %(default)s)")
    add(
        "--mesh",
        type=_mesh,
        help=f"mesh axes, e.g. data=2,model=4 (default: --parallel's, else {DEFAULT_MESH})",
    )
    add("--explicit", action="store_true", help="Explicit mesh axes: shardings are part of array types")
    add(
        "--parallel",
        choices=PARALLEL_STYLES,
        help="a named style's mesh and rules (--mesh and --rules still override)",
    )
    add(
        "--rules",
        type=_rules,
        help="logical=mesh rules, e.g. mlp=model (default: the 2d style's, on the axes of --mesh)",
    )
    add("--devices", type=_at_least(1), help="CPU devices to simulate when there is no accelerator")
    add("--seed", type=_at_least(0))
    add("--checkpoint-dir", help="save checkpoints here (every --checkpoint-every steps and per epoch)")
    add("--checkpoint-every", type=_at_least(1), default=None, help="steps between checkpoints")
    add("--keep", type=_at_least(1), default=3, help="checkpoints to keep (default %(default)s)")
    add("--resume", action="store_true", help="continue from the latest good checkpoint")
    add(
        "--resume-from",
        metavar="STEP",
        type=_at_least(0),
        help="continue from this checkpoint (implies --resume)",
    )
    add(
        "--overwrite",
        action="store_true",
        help="a fresh run may delete the checkpoints another run left in --checkpoint-dir",
    )
    add("--plot", help=f"write a chart of loss and accuracy ({', '.join(PLOT_FORMATS)})")
    add("--log", help="append JSON lines of metrics (per epoch, and every 100 steps)")
    add("--data-dir", help="TFDS data directory (default: $TFDS_DATA_DIR, then ~/tensorflow_datasets)")
    add("--no-download", dest="download", action="store_false", help="never touch the network")
    add(
        "--compile-cache",
        help="keep compiled programs in this directory (JAX's persistent compilation cache)",
    )
    add("--debug", action="store_true", help="show the full traceback of an unexpected error")
    distributed.add_arguments(train)  # --coordinator, --num-processes, --process-id, --init-timeout
    add_pipeline_arguments(train)


def add_explain_arguments(explainer: argparse.ArgumentParser) -> None:
    """``minishard explain``'s flags: a default model, a named style, a device count."""
    explainer.description = explain_command.__doc__
    explainer.set_defaults(dataset="mnist")  # the default model's shapes: MNIST's
    add = explainer.add_argument
    add("--model", choices=sorted(MODEL_DEFAULTS), default="mlp", help="(default %(default)s)")
    add("--parallel", choices=PARALLEL_STYLES, default="2d", help="(default %(default)s)")
    add_pipeline_arguments(explainer)
    add("--devices", type=_at_least(1), default=8, help="(default %(default)s)")
    add("--plot", help=f"draw which devices hold each block of each parameter ({', '.join(PLOT_FORMATS)})")
    add_cost_arguments(explainer)


def _finish_train(args: argparse.Namespace, error: Callable[[str], NoReturn]) -> argparse.Namespace:
    """Fill in what was not given (per model, per style) and check the flags together."""
    for other, flags in MODEL_FLAGS.items():  # a flag of the other model would be silently ignored
        if given := [name for name in flags if other != args.model and getattr(args, name) is not None]:
            flag, model = "--" + given[0].replace("_", "-"), {"mlp": "MLP", "vit": "ViT"}[other]
            error(
                f"argument {flag}: only the {model} takes it, and --model is {args.model}; "
                f"add --model {other}"
            )
    if args.mesh is None:  # decided from the parsed values: --mesh given (in any spelling) always wins
        args.mesh = preset(args.parallel, args.devices)[0] if args.parallel else _mesh(DEFAULT_MESH)
    args.rules = args.rules or {}
    args.resume = args.resume or args.resume_from is not None
    for name, value in MODEL_DEFAULTS[args.model].items():  # what the user did not set, per model
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    _check_together(_fill_model_defaults(args), error)
    _check_pipeline(args, error)
    return args


def _fill_model_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """The shape of ``args.model`` from its flags, or their defaults (MLP: the dataset's classic sizes)."""
    _fill_pipeline_defaults(args)
    for name, value in MODEL_FLAGS[args.model].items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    if args.model == "mlp" and args.layers is None:
        info = DATASET_INFO[args.dataset]
        args.layers = [info.num_features, *HIDDEN[args.dataset], info.num_classes]
    return args


def _check_together(args: argparse.Namespace, error: Callable[[str], NoReturn]) -> None:
    """The checks that need several flags at once (each ends with a one-line ``error:``)."""
    info = DATASET_INFO[args.dataset]
    if args.model == "mlp" and (args.layers[0] != info.num_features or args.layers[-1] != info.num_classes):
        error(
            f"argument --layers: must start with {info.num_features} inputs and end with "
            f"{info.num_classes} classes for {args.dataset}, got {','.join(map(str, args.layers))}"
        )
    if args.model == "vit":
        height = info.input_shape[0]
        if args.width % args.heads:
            error(f"argument --heads: {args.heads} heads must divide --width {args.width}")
        if height % args.patch_size:
            error(f"argument --patch-size: {args.patch_size} must divide the image size {height}")
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
    if args.batch_size > info.train_examples:
        error(f"argument --batch-size: {args.batch_size} exceeds the {info.train_examples} training examples")
    if args.checkpoint_dir and os.path.exists(args.checkpoint_dir) and not os.path.isdir(args.checkpoint_dir):
        error(f"argument --checkpoint-dir: {args.checkpoint_dir} is a file, not a directory")
    _check_output("--plot", args.plot, PLOT_FORMATS, error)
    _check_output("--log", args.log, LOG_FORMATS, error)


def _check_output(
    flag: str, path: str | None, formats: Sequence[str], error: Callable[[str], NoReturn]
) -> None:
    """A file to write at the end: its format and its directory are checked at the start."""
    if path is None:
        return
    if os.path.splitext(path)[1].lower() not in formats:
        error(f"argument {flag}: {path} must end with one of {', '.join(formats)}")
    if not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        error(f"argument {flag}: the directory of {path} does not exist; create it first")


def simulate_devices(count: int) -> None:
    """Ask XLA for ``count`` CPU devices; must run before JAX initialises its backend.

    A device count already in ``XLA_FLAGS`` wins (the user set it on purpose); ``train`` says so.
    """
    current = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in current:
        os.environ["XLA_FLAGS"] = f"{current} --xla_force_host_platform_device_count={count}".strip()


def cli_rules(args: argparse.Namespace, mesh_axes: Sequence[str]) -> AxisRules:
    """``--parallel``'s ordered rules (``--rules`` first, so they win), or the rules for this mesh."""
    if not args.parallel:
        return rules_for_mesh(mesh_axes, args.rules)
    return preset_rules(args.parallel, args.rules)


def unused_mesh_axes(mesh: Mapping[str, int], rules: AxisRules) -> list[str]:
    """The mesh axes (of more than one device) that no rule names: every array is whole on each.

    >>> unused_mesh_axes({"data": 2, "model": 4}, AxisRules(batch="data", mlp=None))
    ['model']
    """
    named = {
        axis for _, target in rules.pairs for axis in ((target,) if isinstance(target, str) else target or ())
    }
    return [axis for axis, size in mesh.items() if size > 1 and axis not in named]


def warn_unused(mesh: Mapping[str, int], rules: AxisRules) -> None:
    """One ``warning:`` line per mesh axis no rule uses: it only makes copies."""
    for axis in unused_mesh_axes(mesh, rules):
        print(
            f"warning: no rule uses mesh axis {axis!r}: every array is replicated over its {mesh[axis]} "
            f"devices (they all compute the same); add a rule (--rules NAME={axis}) or drop it from --mesh",
            file=sys.stderr,
        )


def build_model(args: argparse.Namespace, key: Any) -> Any:
    """The MLP (Megatron axes) or the ViT the arguments describe (their blocks stacked under pp, dp+pp)."""
    if args.parallel in PIPELINED:
        return stacked_model(args, key)
    if args.model == "mlp":
        return mlp(args.layers, key=key, activation=args.activation, axes=megatron_axes(len(args.layers) - 1))
    height, _, channels = DATASET_INFO[args.dataset].input_shape
    classes = DATASET_INFO[args.dataset].num_classes
    return ViT(height, args.patch_size, channels, args.width, args.depth, args.heads, args.mlp_ratio, classes,
               key=key, remat=args.remat)  # fmt: skip


def learning_rate(args: argparse.Namespace, steps_per_epoch: int) -> Schedule:
    if args.schedule == "cosine":
        total = steps_per_epoch * args.epochs
        return warmup_cosine_decay(args.lr, min(args.warmup_steps, total - 1), total)
    return exponential_decay(args.lr, args.decay_rate, args.decay_steps, args.staircase)


def train(args: argparse.Namespace) -> int:
    """Run ``fit`` as the arguments say; 0 on success, 2 on a mesh that does not fit the devices."""
    resume = dict(resume=args.resume, resume_from=args.resume_from, overwrite=args.overwrite)
    if args.checkpoint_dir:  # another run's checkpoints, a read-only disk, a missing step: before any work
        check_checkpoint_dir(args.checkpoint_dir, **resume)
    devices = jax.devices()  # with several processes: the devices of all of them
    if jax.process_count() > 1:
        print(f"{jax.process_count()} processes x {jax.local_device_count()} devices: {len(devices)} in all")
    elif devices[0].platform == "cpu":
        print(f"No accelerator: simulating {len(devices)} CPU devices (XLA_FLAGS={os.environ['XLA_FLAGS']})")
        if len(devices) != args.devices:
            print(f"(XLA_FLAGS already set the device count, so --devices {args.devices} is not used)")
    if (needed := math.prod(args.mesh.values())) != len(devices):
        axes = ",".join(f"{name}={size}" for name, size in args.mesh.items())
        print(
            f"error: argument --mesh: {axes} needs {needed} devices, there are {len(devices)}",
            file=sys.stderr,
        )
        return 2
    if args.compile_cache:
        enable_compilation_cache(args.compile_cache)
    mesh = make_mesh(args.mesh, explicit=args.explicit)
    rules = cli_rules(args, mesh.axis_names)
    distributed.check_batch_split(Sharded(mesh, rules).batch_sharding, args.batch_size)
    model = pipelined(build_model(args, jax.random.key(args.seed)), args, mesh)
    if distributed.is_main_process():
        warn_unused(args.mesh, rules)
    print(f"Rules: {rules}")
    show(explain(model, mesh, rules))  # plans every parameter: a rule that cannot work fails here
    load = DATASETS[args.dataset]
    options = dict(data_dir=args.data_dir, download=args.download, shuffle_seed=args.seed)
    options["flatten"] = args.model == "mlp"  # the ViT takes [B, H, W, C] images
    train_data = load("train", args.batch_size, **options)
    test_data = load("test", args.batch_size, **options)
    schedule = learning_rate(args, train_data.steps_per_epoch)
    _, _, history = fit(
        model,
        SGD(schedule, momentum=args.momentum),
        train_data,
        mesh=mesh,
        rules=rules,
        epochs=args.epochs,
        eval_data=test_data,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        keep=args.keep,
        **resume,
        make_step=zero_step(args, mesh),  # None: fit's own Sharded step
        metrics_log=args.log if distributed.is_main_process() else None,  # one writer per file
        log_every=20,
        microbatches=1 if args.parallel in PIPELINED else args.microbatches,  # a pipeline's are its own
    )
    if args.plot and history and distributed.is_main_process():
        plot_history(history, args.plot, schedule)
        print(f"Wrote {args.plot}")
    return 0


EXPECTED_ERRORS: tuple[type[Exception], ...] = (
    DataError,
    ShardingError,
    TrainingError,
    CheckpointError,
    distributed.DistributedError,
)
"""Failures whose message already says what and where: printed as one ``error:`` line."""


def plot_history(history: list[dict[str, Any]], path: str, schedule: Schedule | None = None) -> None:
    """Three panels: the loss at every logged step, accuracy per epoch, the learning rate (matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [record["epoch"] for record in history]
    curve = [point for record in history for point in record.get("loss_curve", [])]
    steps_per_epoch = history[-1]["steps"]
    fig, (loss, acc, rate) = plt.subplots(1, 3, figsize=(13, 3.5))
    if curve:
        loss.plot([step / steps_per_epoch for step, _ in curve], [value for _, value in curve], lw=1)
    loss.plot(epochs, [r["loss"] for r in history], marker="o", label="epoch mean")
    loss.set(title="training loss", xlabel="epoch", yscale="log")
    loss.legend()
    acc.plot(epochs, [r["train_acc"] for r in history], marker="o", label="train")
    if all("test_acc" in r for r in history):
        acc.plot(epochs, [r["test_acc"] for r in history], marker="o", label="test")
    acc.set(title="accuracy", xlabel="epoch")
    acc.legend()
    if schedule is not None:
        steps = list(range(0, steps_per_epoch * epochs[-1] + 1, max(1, steps_per_epoch // 20)))
        rate.plot(
            [step / steps_per_epoch for step in steps], [float(schedule(jnp.asarray(step))) for step in steps]
        )
    rate.set(title="learning rate", xlabel="epoch")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    """The ``minishard`` console script: ``train``, ``explain`` or ``launch``, as parsed.

    Every failure reaches the user as one ``error:`` line (``--debug`` shows the
    traceback); Ctrl-C stops with one line that says where to resume from.
    """
    args = parse_args(argv)
    if args.subcommand == "launch":  # minishard launch -n 2 -- train ...: N processes of this same main
        return launch.run(args)
    if args.subcommand == "explain":  # no devices, no data: shapes only
        return explain_command(args)
    return train_command(args)


def train_command(args: argparse.Namespace) -> int:
    """Set up simulated devices, join the run, ``train``; every way out is one line and a status."""
    simulate_devices(args.devices)  # per process: with 2 processes, --devices 4 makes 8 in all
    try:
        # Join the run that the flags or the environment describe (nothing to do for one process).
        place = args.coordinator, args.num_processes, args.process_id
        distributed.initialize(*place, timeout=args.init_timeout)
        with distributed.print_on_main_only():  # process 0 speaks for the run
            return train(args)
    except KeyboardInterrupt:
        print(f"\ninterrupted{_latest_checkpoint(args.checkpoint_dir)}", file=sys.stderr)
        return distributed.leave(130)  # with several processes: exit now, the others cannot go on
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


def explain_command(args: argparse.Namespace) -> int:
    """``minishard explain --parallel fsdp [--model vit] [--plot FILE]``: the plan of a default model.

    Nothing is trained or allocated: the model is built by ``jax.eval_shape`` and
    planned on an ``AbstractMesh`` with the style's rules, so any device count
    works on any machine. Pricing a step (``--hardware``, ``--compare``) or ZeRO's
    step (``--parallel zero``) compiles it: see ``cost_command``.
    """
    if args.parallel in PIPELINED and (refused := _check_pipeline_explain(args)):
        return refused  # before any work: a pipeline's step is compiled below, on devices
    if args.hardware or args.compare or args.parallel == ZERO:
        return cost_command(args)
    shape, rules = preset(args.parallel, args.devices)
    mesh = jax.sharding.AbstractMesh(tuple(shape.values()), tuple(shape))
    model = jax.eval_shape(lambda: build_model(args, jax.random.key(0)))
    try:
        report = explain(model, mesh, rules)
    except ShardingError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print_report(args, report, shape, rules, f"{args.model} under {args.parallel} on {args.devices} devices")
    return explain_pipeline(args, rules) if args.parallel in PIPELINED else 0


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


# -- pipelines: --parallel pp and dp+pp, --microbatches (docs/pipeline.md) ---------------------
PIPELINE_WIDTH = 256
"""The MLP's hidden width under a pipeline style when --layers is not given: 784, 256 x (stages + 1), 10."""
EXPLAIN_BATCH = 128
"""The batch of the training step ``explain --parallel pp`` compiles (train's default --batch-size)."""


def add_pipeline_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--microbatches",
        type=_at_least(1),
        help="split each batch into M: gradient accumulation, or under pp and dp+pp the pipeline's "
        "microbatches (default: 1; under pp and dp+pp 2 per stage)",
    )


def _fill_pipeline_defaults(args: argparse.Namespace) -> None:
    """Under pp and dp+pp, one stacked block per stage unless given, and 2 microbatches per stage.

    The MLP gets ``784, 256 x (stages + 1), 10``: ``stages`` identical 256 x 256
    blocks. The ViT's depth (4) rounds up to a multiple of the stages.
    """
    if args.parallel not in PIPELINED:
        args.microbatches = args.microbatches or 1
        return
    stages = _stages(args)
    args.microbatches = args.microbatches or 2 * stages
    if args.model == "mlp" and getattr(args, "layers", None) is None:
        info = DATASET_INFO[args.dataset]
        args.layers = [info.num_features, *[PIPELINE_WIDTH] * (stages + 1), info.num_classes]
    if args.model == "vit" and getattr(args, "depth", None) is None:
        args.depth = stages * math.ceil(MODEL_FLAGS["vit"]["depth"] / stages)


def _stages(args: argparse.Namespace) -> int:
    """The pipeline's stages: the "stage" axis of --mesh (train), or of the style's mesh."""
    mesh = getattr(args, "mesh", None) or preset(args.parallel, args.devices)[0]
    return int(mesh.get("stage", 1))


def _check_pipeline(args: argparse.Namespace, error: Callable[[str], NoReturn]) -> None:
    """A pipeline's flags, together: its blocks split over the stages, its batch into microbatches."""
    m, data = args.microbatches, args.mesh.get("data", 1)
    if args.batch_size % (m * data):
        error(
            f"argument --microbatches: --batch-size {args.batch_size} does not split into {m} microbatches "
            f"over data={data} devices ({args.batch_size} is not a multiple of {m * data})"
        )
    if args.parallel not in PIPELINED:
        return
    if "stage" not in args.mesh:
        error(
            f"argument --mesh: --parallel {args.parallel} puts stacked blocks on a 'stage' axis; it has none"
        )
    for flag, given in (("--remat", args.model == "vit" and args.remat), ("--explicit", args.explicit)):
        if given:
            error(f"argument {flag}: not with a pipeline (--parallel {args.parallel})")
    stages, hidden = args.mesh["stage"], args.layers[1:-1] if args.model == "mlp" else []
    if args.model == "mlp" and (len(hidden) < 2 or len(set(hidden)) > 1):
        error("argument --layers: a pipeline stacks equal hidden layers, e.g. 784,256,256,256,256,256,10")
    if args.model == "vit" and args.depth % stages:
        error(
            f"argument --depth: {args.depth} blocks cannot split over {stages} stages; "
            f"give a multiple of {stages}"
        )
    if args.model == "mlp" and (len(hidden) - 1) % stages:
        error(
            f"argument --layers: {len(hidden) - 1} identical {hidden[0]}x{hidden[0]} blocks cannot split "
            f"over {stages} stages; give {stages} blocks ({stages + 1} hidden sizes of {hidden[0]}) "
            "or a multiple"
        )


def stacked_model(args: argparse.Namespace, key: Any) -> pipeline.StackedModel:
    """The MLP (its equal hidden layers) or the ViT (its blocks) with the blocks stacked on "stage"."""
    if args.model == "mlp":
        return pipeline.stacked_mlp(args.layers, key=key)
    height, _, channels = DATASET_INFO[args.dataset].input_shape
    classes = DATASET_INFO[args.dataset].num_classes
    return stacked_vit(height, args.patch_size, channels, args.width, args.depth, args.heads, args.mlp_ratio,
                       classes, key=key)  # fmt: skip


def pipelined(model: Any, args: argparse.Namespace, mesh: Any) -> Any:
    """Under pp and dp+pp, ``model`` with its schedule on ``mesh``, said in one line; else ``model``."""
    if args.parallel not in PIPELINED:
        return model
    plan = pipeline.Schedule(mesh, args.microbatches, data_axis="data" if "data" in mesh.axis_names else None)
    p, m = plan.stages, plan.microbatches
    print(
        f"Pipeline: {model.blocks.n} blocks over {p} stages, {m} microbatches of "
        f"{getattr(args, 'batch_size', EXPLAIN_BATCH) // m} examples, {plan.ticks} ticks; "
        f"bubble {pipeline.bubble_fraction(p, m):.3f}"
    )
    return model.replace(schedule=plan)


def _check_pipeline_explain(args: argparse.Namespace) -> int:
    """Simulate the devices ``explain_pipeline`` compiles on; 2 (one ``error:`` line) if they cannot."""
    simulate_devices(args.devices)
    split = args.microbatches * preset(args.parallel, args.devices)[0].get("data", 1)
    if args.devices > len(jax.devices()):
        problem = f"--devices: {args.devices} devices asked, there are {len(jax.devices())}"
    elif EXPLAIN_BATCH % split:  # a microbatch's rows split over "data"
        problem = f"--microbatches: a batch of {EXPLAIN_BATCH} is not a multiple of {split}"
    else:
        return 0
    print(f"error: argument {problem}", file=sys.stderr)
    return 2


def explain_pipeline(args: argparse.Namespace, rules: AxisRules) -> int:
    """Compile one training step of the pipelined model and print what it costs (``pipeline_report``)."""
    shape, batch_size = preset(args.parallel, args.devices)[0], EXPLAIN_BATCH
    mesh = make_mesh(shape, devices=jax.devices()[: args.devices])
    info = DATASET_INFO[args.dataset]
    model = pipelined(jax.eval_shape(lambda: build_model(args, jax.random.key(0))), args, mesh)
    image = (info.num_features,) if args.model == "mlp" else info.input_shape
    batch = {
        "image": jax.ShapeDtypeStruct((batch_size, *image), jnp.float32),
        "label": jax.ShapeDtypeStruct((batch_size,), jnp.int32),
    }
    optimizer = SGD(0.1, momentum=0.9)
    step = Sharded(mesh, rules)(make_train_step(optimizer))
    r = pipeline.pipeline_report(step, (model, jax.eval_shape(optimizer.init, model), batch))
    p, m = r["stages"], r["microbatches"]
    print(f"\nOne training step (batch {batch_size}), compiled:")
    print(f"  stages {p}, microbatches {m}, ticks {r['ticks']} (read from the compiled loop)")
    print(f"  bubble {r['bubble']:.3f} from the program, {r['bubble_formula']:.3f} = (p-1)/(m+p-1)")
    print(f"  collective-permute over 'stage': {r['permute_bytes']} bytes per step")
    print(f"  temporary memory: {r['temp_bytes'] / 1e6:.2f} MB per device")
    print(pipeline.draw(pipeline.schedule(p, m)))
    return 0


# -- what a step costs (minishard.costs), and ZeRO by hand (minishard.zero) ---------------------
ZERO = "zero"
"""``--parallel zero``: data parallelism written by hand (``minishard.zero``) at ``ZERO_STAGE``:
parameters, gradients and SGD velocity split over "data". The other styles are presets."""
ZERO_STAGE = 3
PARALLEL_STYLES = (*STYLES, ZERO)
METRIC_BYTES = 2 * 4
"""What any train step all-reduces besides gradients: its loss and accuracy, two float32 scalars."""


def add_cost_arguments(explainer: argparse.ArgumentParser) -> None:
    """``minishard explain``'s flags that compile the default model's train step and price it."""
    add = explainer.add_argument
    add("--hardware", choices=list(HARDWARE), help="price the train step on this accelerator")
    add("--batch", type=_at_least(1), help=f"global batch of that step (default {DEFAULTS['batch_size']})")
    add("--compare", action="store_true", help="rank every preset and mesh shape on --hardware")


def check_cost_flags(args: argparse.Namespace, error: Callable[[str], NoReturn]) -> None:
    """--compare needs --hardware; --batch needs a step to compile, and must split over "data"."""
    compiles = args.hardware or args.compare or args.parallel == ZERO
    if args.compare and not args.hardware:
        error("argument --compare: needs --hardware, the accelerator to rank the layouts on (e.g. v5p)")
    if args.batch is not None and not compiles:
        error("argument --batch: only a compiled step takes it; add --hardware (or --parallel zero)")
    if args.parallel == ZERO and args.plot and not args.compare:
        error("argument --plot: --parallel zero has no plan to draw (it splits flat blocks); use --compare")
    args.batch = args.batch or DEFAULTS["batch_size"]
    whole = args.compare or args.parallel == ZERO  # "data" may span every device
    ways = args.devices if whole else preset(args.parallel, args.devices)[0].get("data", 1)
    if compiles and args.batch % ways:
        error(f"argument --batch: {args.batch} cannot be split evenly over data={ways} devices")


def finish_zero(args: argparse.Namespace, error: Callable[[str], NoReturn]) -> argparse.Namespace:
    """``train --parallel zero``: dp's mesh ("data" over every device) and rules, and ``args.zero``."""
    args.zero = args.parallel == ZERO
    if args.zero:
        if args.rules or args.explicit:
            flag = "--rules" if args.rules else "--explicit"
            error(f"argument {flag}: --parallel zero places every array itself (minishard.zero); drop {flag}")
        if args.mesh is not None and list(args.mesh) != ["data"]:
            error(f"argument --mesh: --parallel zero runs on one axis, data=N; got {args.mesh}")
        args.parallel = "dp"
    return args


def zero_step(args: argparse.Namespace, mesh: jax.sharding.Mesh) -> Callable[[SGD], Any] | None:
    """``fit``'s ``make_step`` for ``--parallel zero`` (None otherwise: fit's own Sharded step)."""
    if not args.zero:
        return None
    print(f"ZeRO-{ZERO_STAGE} by hand (minishard.zero): every array split 1/{mesh.size} per device")
    return lambda optimizer: zero_train_step(optimizer, mesh, stage=ZERO_STAGE)


def example_batch(args: argparse.Namespace) -> dict[str, jax.Array]:
    """``--batch`` blank examples shaped for ``args.model`` (the MLP's flattened): to compile a step."""
    shape = DATASET_INFO[args.dataset].input_shape
    image = (math.prod(shape),) if args.model == "mlp" else shape
    return {"image": jnp.zeros((args.batch, *image)), "label": jnp.zeros(args.batch, jnp.int32)}


def cost_command(args: argparse.Namespace) -> int:
    """``explain --hardware H [--parallel NAME | --compare] [--batch B]`` and ``explain --parallel zero``.

    The default model's train step is compiled on ``--devices`` (simulated)
    devices: its plan and collectives, priced on ``--hardware`` (``minishard.costs``).
    A failure is one ``error:`` line (XLA:CPU compiled for 2,048 simulated devices here, not 4,096).
    """
    simulate_devices(args.devices)
    if (found := len(jax.devices())) != args.devices:
        print(f"error: argument --devices: {args.devices} asked, there are {found}", file=sys.stderr)
        return 2
    try:
        return _compile_and_price(args)
    except ShardingError as error:
        print(f"error: {error}", file=sys.stderr)
    except jax.errors.JaxRuntimeError as error:  # e.g. too many simulated devices for XLA:CPU
        first = str(error).splitlines()[0]
        print(
            f"error: XLA cannot compile the step on {found} devices ({first}); try fewer --devices",
            file=sys.stderr,
        )
    return 1


def _compile_and_price(args: argparse.Namespace) -> int:
    optimizer, model = SGD(0.1, momentum=0.9), build_model(args, jax.random.key(0))  # train's momentum
    step_args = (model, optimizer.init(model), example_batch(args))
    if args.compare:
        ranked = compare(make_train_step(optimizer), step_args, args.hardware, args.devices)
        print(f"{args.model}, batch {args.batch}, on {args.devices} devices: every preset and mesh shape")
        print(ranked)
        if args.plot:
            plot_comparison(ranked, args.plot)
            print(f"Wrote {args.plot}")
        return 0
    if args.parallel == ZERO:
        return zero_report(args, optimizer, model, step_args[-1])
    shape, rules = preset(args.parallel, args.devices)
    report = explain(model, make_mesh(shape), rules, make_train_step(optimizer), step_args, args.hardware)
    title = f"{args.model} under {args.parallel} on {args.devices} devices, batch {args.batch}"
    print_report(args, report, shape, rules, title)
    return 0


def zero_report(args: argparse.Namespace, optimizer: SGD, model: Any, batch: dict[str, jax.Array]) -> int:
    """What ZeRO's step sends, against the analytic minimum: an all-gather of the parameters
    (each padded to split evenly) plus a reduce-scatter of their gradients; no gradient all-reduce."""
    n, mesh = args.devices, make_mesh({"data": args.devices})
    step = zero_train_step(optimizer, mesh, stage=ZERO_STAGE)
    placed = step.shard(model)
    step_args = (placed, step.init(placed), batch)
    found = collectives(step.lower(*step_args))
    kinds = ("all-gather", "reduce-scatter", "all-reduce")
    sent = {kind: found[kind].bytes if kind in found else 0 for kind in kinds}
    whole = sum((leaf.size + -leaf.size % n) * leaf.dtype.itemsize for leaf in jax.tree.leaves(model))
    print(f"{args.model} under zero (ZeRO-{ZERO_STAGE} by hand) on {n} devices, batch {args.batch}")
    print("collectives of the zero step:\n" + "\n".join("  " + line for line in summary(found).splitlines()))
    gradient = max(sent["all-reduce"] - METRIC_BYTES, 0)
    reduced = f"{sent['all-reduce']:,} B all-reduced, {METRIC_BYTES} B of it the loss and accuracy"
    print(f"full-gradient all-reduce: {gradient:,} B ({reduced})")
    gathered, scattered = sent["all-gather"], sent["reduce-scatter"]
    print(f"sent: all-gather {gathered:,} B + reduce-scatter {scattered:,} B = {gathered + scattered:,} B")
    minimum = whole + whole // n  # every parameter gathered, 1/n of every gradient scattered to each
    print(f"the minimum: the parameters (padded to split {n} ways) {whole:,} B + 1/{n}: {minimum:,} B")
    if args.hardware:
        print(cost_report(step, step_args, mesh, preset("dp", n)[1], args.hardware))
    return 0


def _latest_checkpoint(directory: str | None) -> str:
    """``"; the latest checkpoint is step 300 in runs/x: ..."``, read from the directory listing.

    Ctrl-C may come before the directory exists (during the data load or the compile).
    """
    if not directory:
        return ""
    try:
        steps = sorted(int(p.name) for p in Path(directory).iterdir() if p.name.isdigit())
    except OSError:  # not created yet (or unreadable): nothing was written there
        steps = []
    if not steps:
        return f": no checkpoint was written in {directory}"
    return f"; the latest checkpoint is step {steps[-1]} in {directory}: continue with --resume"


if __name__ == "__main__":
    sys.exit(main())


__all__ = [
    "add_cost_arguments", "add_explain_arguments", "add_train_arguments", "build_model", "check_cost_flags",
    "cli_rules", "cost_command", "example_batch", "explain_command", "finish_zero", "learning_rate", "main",
    "parse_args", "plot_history", "print_report", "simulate_devices", "train", "train_command",
    "unused_mesh_axes", "warn_unused", "zero_report", "zero_step",
]  # fmt: skip
