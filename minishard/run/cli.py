"""``minishard train``: the command line over ``minishard.run.train.fit``.

>>> args = parse_args(["train", "--mesh", "data=2,model=4", "--rules", "mlp=model"])
>>> args.mesh, args.rules, args.layers
({'data': 2, 'model': 4}, {'mlp': 'model'}, [784, 512, 10])

Everything here is argument parsing and printing; the work happens in
``fit``. One subtlety: simulated CPU devices must be requested through
``XLA_FLAGS`` before JAX starts its backend (at the first ``jax.devices()``,
not at ``import jax``), so ``main`` sets the flag before it asks for devices.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import jax  # importing is fine; the backend (and XLA_FLAGS) starts at the first jax.devices()
import jax.numpy as jnp

from minishard.layers import ACTIVATIONS, megatron_axes, mlp
from minishard.models.vit import VIT_AXES, ViT
from minishard.optim import SGD, Schedule, exponential_decay, warmup_cosine_decay
from minishard.presets import PRESETS, preset
from minishard.report import explain
from minishard.rules import AxisRules, ShardingError
from minishard.run import distributed, launch
from minishard.run.data import DATASET_INFO, DATASETS, DataError
from minishard.run.render import plot_report, show
from minishard.run.train import TrainingError, enable_compilation_cache, fit
from minishard.sharding import Sharded, make_mesh

try:  # orbax is an optional extra (minishard[checkpoint])
    from minishard.run.checkpoint import CheckpointError
except ImportError:
    CheckpointError = TrainingError  # type: ignore[misc,assignment]  # never raised without orbax

HIDDEN = {"mnist": [512], "cats_vs_dogs": [2048, 1024]}
"""Hidden layer sizes of each dataset's classic MLP; inputs and classes come from DATASET_INFO."""
DEFAULTS = dict(
    model="mlp",
    dataset="mnist",
    layers=None,  # the dataset's classic MLP
    activation="swish",
    width=64,
    depth=4,
    heads=4,
    patch_size=7,
    mlp_ratio=2,
    batch_size=128,
    decay_rate=0.7,
    decay_steps=1000,
    momentum=0.9,
    mesh="data=2,model=4",
    rules="",
    devices=8,
    seed=0,
)
MODEL_DEFAULTS = {
    "mlp": dict(epochs=5, lr=0.2, schedule="exponential", warmup_steps=0),
    "vit": dict(epochs=6, lr=0.1, schedule="cosine", warmup_steps=300),
}
"""What differs between the two models' defaults: a transformer wants a warmup and a cosine."""


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


PLOT_FORMATS = (".png", ".pdf", ".svg")
LOG_FORMATS = (".jsonl", ".json", ".log", ".txt")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse ``minishard train ...`` and check every flag before any data is loaded.

    Mesh and rules come back as dicts, layers as a list. A bad flag exits with
    argparse's one-line ``error: argument --flag: ...`` and status 2.
    """
    parser = argparse.ArgumentParser(prog="minishard", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="train an MLP on MNIST (or cats_vs_dogs) on a device mesh")
    train.set_defaults(**DEFAULTS)
    add = train.add_argument
    add(
        "--model", choices=sorted(MODEL_DEFAULTS), help="an MLP or a Vision Transformer (default %(default)s)"
    )
    add("--dataset", choices=sorted(DATASETS))
    add(
        "--layers",
        type=_sizes,
        help="layer sizes (default: 784,512,10 for mnist, 120000,2048,1024,2 for cats_vs_dogs)",
    )
    add("--activation", choices=sorted(ACTIVATIONS))
    add("--width", type=_at_least(1), help="ViT: features per token (default %(default)s)")
    add("--depth", type=_at_least(1), help="ViT: transformer blocks (default %(default)s)")
    add("--heads", type=_at_least(1), help="ViT: attention heads; must divide --width (default %(default)s)")
    add(
        "--patch-size",
        type=_at_least(1),
        help="ViT: square patches; must divide the image (default %(default)s)",
    )
    add("--mlp-ratio", type=_at_least(1), help="ViT: MLP hidden units per feature (default %(default)s)")
    add(
        "--remat", action="store_true", help="ViT: recompute each block in the backward pass (jax.checkpoint)"
    )
    add("--epochs", type=_at_least(1), help="total epochs, also when resuming (default: mlp 5, vit 6)")
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
    add("--mesh", type=_mesh, help="mesh axes, e.g. data=2,model=4 (default %(default)s)")
    add("--explicit", action="store_true", help="Explicit mesh axes: shardings are part of array types")
    add(
        "--parallel",
        choices=PRESETS,
        help="a named style's mesh and rules (--mesh and --rules still override)",
    )
    add("--rules", type=_rules, help="logical=mesh rules, e.g. mlp=model (default: batch=data, mlp=model)")
    add("--devices", type=_at_least(1), help="CPU devices to simulate when there is no accelerator")
    add("--seed", type=_at_least(0))
    add("--checkpoint-dir", help="save checkpoints here (every --checkpoint-every steps and per epoch)")
    add("--checkpoint-every", type=_at_least(1), default=None, help="steps between checkpoints")
    add("--keep", type=_at_least(1), default=3, help="checkpoints to keep (default %(default)s)")
    add("--resume", action="store_true", help="continue from the latest good checkpoint")
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
    commands.add_parser("launch", help=launch.HELP, add_help=False)
    commands.add_parser(
        "explain", help="print (and --plot) the plan of a default model", add_help=False
    )  # listed here, parsed by launch.main
    args = parser.parse_args(argv)
    if args.parallel and "--mesh" not in (argv if argv is not None else sys.argv):
        args.mesh = preset(args.parallel, args.devices)[0]
    for name, parse in (("mesh", _mesh), ("rules", _rules)):  # argparse leaves string defaults as they are
        if isinstance(getattr(args, name), str):
            setattr(args, name, parse(getattr(args, name)))
    for name, value in MODEL_DEFAULTS[args.model].items():  # what the user did not set, per model
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    info = DATASET_INFO[args.dataset]
    args.layers = args.layers or [info.num_features, *HIDDEN[args.dataset], info.num_classes]
    _check_together(args, train.error)  # "minishard train: error: ...", as argparse words its own
    return args


def _check_together(args: argparse.Namespace, error: Callable[[str], NoReturn]) -> None:
    """The checks that need several flags at once (each ends with a one-line ``error:``)."""
    info = DATASET_INFO[args.dataset]
    if args.layers[0] != info.num_features or args.layers[-1] != info.num_classes:
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
    elif args.remat:
        error("argument --remat: only the ViT has blocks to recompute; add --model vit")
    if (args.resume or args.checkpoint_every) and not args.checkpoint_dir:
        error("--resume and --checkpoint-every need --checkpoint-dir")
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
    for flag, path, formats in (("--plot", args.plot, PLOT_FORMATS), ("--log", args.log, LOG_FORMATS)):
        if path is None:
            continue
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


def default_rules(
    mesh_axes: Sequence[str], user: dict[str, str | None], model: str = "mlp"
) -> dict[str, Any]:
    """The CLI's rules, then the user's: the batch over "data"; MLP hidden units (and the ViT's
    heads) over "model", when the mesh has those axes; every other logical axis replicated."""
    model_axis = "model" if "model" in mesh_axes else None
    rules: dict[str, Any] = {"batch": "data" if "data" in mesh_axes else None, "embed": None, "classes": None}
    rules["mlp"] = model_axis
    if model == "vit":
        rules.update({name: None for name in VIT_AXES if name not in rules}, heads=model_axis)
    return {**rules, **user}


def cli_rules(args: argparse.Namespace, mesh_axes: Sequence[str]) -> AxisRules:
    """``--parallel``'s ordered rules (``--rules`` first, so they win), or the default rules."""
    if not args.parallel:
        return AxisRules(**default_rules(mesh_axes, args.rules, args.model))
    return AxisRules.from_pairs([*args.rules.items(), *preset(args.parallel, args.devices)[1].pairs])


def build_model(args: argparse.Namespace, key: Any) -> Any:
    """The MLP (Megatron axes) or the ViT the arguments describe."""
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
    model = build_model(args, jax.random.key(args.seed))
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
        resume=args.resume,
        metrics_log=args.log if distributed.is_main_process() else None,  # one writer per file
        log_every=20,
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
    """The ``minishard`` console script: parse, set up simulated devices, train.

    Every failure reaches the user as one ``error:`` line (``--debug`` shows the
    traceback); Ctrl-C stops with one line that says where to resume from.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["launch"]:  # minishard launch -n 2 -- train ...: N processes of this same main
        return launch.main(argv[1:])
    if argv[:1] == ["explain"]:  # no devices, no data: shapes only
        return explain_command(argv[1:])
    args = parse_args(argv)
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


def explain_command(argv: Sequence[str]) -> int:
    """``minishard explain --parallel fsdp [--model vit] [--plot FILE]``: the plan of a default model.

    Nothing is trained or allocated: the model is built by ``jax.eval_shape`` and
    planned on an ``AbstractMesh``, so any device count works on any machine.
    """
    parser = argparse.ArgumentParser(prog="minishard explain", description=explain_command.__doc__)
    parser.add_argument("--model", choices=sorted(MODEL_DEFAULTS), default="mlp")
    parser.add_argument("--parallel", choices=PRESETS, default="2d", help="(default %(default)s)")
    parser.add_argument("--devices", type=_at_least(1), default=8, help="(default %(default)s)")
    parser.add_argument("--plot", help="draw which devices hold each block of each parameter (.png)")
    options = parser.parse_args(argv)
    flags = ["--model", options.model, "--parallel", options.parallel, "--devices", str(options.devices)]
    args = parse_args(["train", *flags, "--batch-size", str(options.devices * 16)])
    mesh = jax.sharding.AbstractMesh(tuple(args.mesh.values()), tuple(args.mesh))
    model = jax.eval_shape(lambda: build_model(args, jax.random.key(0)))
    try:
        report = explain(model, mesh, cli_rules(args, mesh.axis_names))
    except ShardingError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"{options.model} under {options.parallel} on {options.devices} devices")
    show(report)
    if options.plot:
        plot_report(report, options.plot)
        print(f"Wrote {options.plot}")
    return 0


def _latest_checkpoint(directory: str | None) -> str:
    """``"; the latest checkpoint is step 300 in runs/x: ..."``, read from the directory listing."""
    steps = sorted(int(p.name) for p in Path(directory).iterdir() if p.name.isdigit()) if directory else []
    if not steps:
        return ": no checkpoint was written" if directory else ""
    return f"; the latest checkpoint is step {steps[-1]} in {directory}: continue with --resume"


if __name__ == "__main__":
    sys.exit(main())
