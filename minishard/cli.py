"""``minishard train``: the command line over ``minishard.train.fit``.

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
import os
import sys
from collections.abc import Sequence
from typing import Any

import jax  # importing is fine; the backend (and XLA_FLAGS) starts at the first jax.devices()

from minishard.data import DATASET_INFO, DATASETS, DataError
from minishard.explain import explain
from minishard.layers import ACTIVATIONS, megatron_axes, mlp
from minishard.optim import SGD, exponential_decay
from minishard.rules import AxisRules, ShardingError
from minishard.sharding import make_mesh
from minishard.train import TrainingError, fit

HIDDEN = {"mnist": [512], "cats_vs_dogs": [2048, 1024]}
"""Hidden layer sizes of each dataset's classic MLP; inputs and classes come from DATASET_INFO."""
DEFAULTS = dict(
    dataset="mnist",
    layers=None,  # the dataset's classic MLP
    activation="swish",
    epochs=5,
    batch_size=128,
    lr=0.2,
    decay_rate=0.7,
    decay_steps=1000,
    momentum=0.9,
    mesh="data=2,model=4",
    rules="",
    devices=8,
    seed=0,
)


def _sizes(text: str) -> list[int]:
    try:
        return [int(size) for size in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 784,512,10, got {text!r}") from None


def _pairs(text: str) -> dict[str, str]:
    """``"data=2,model=4"`` -> ``{"data": "2", "model": "4"}``."""
    pairs = {}
    for item in filter(None, text.split(",")):
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise argparse.ArgumentTypeError(f"expected name=value pairs like data=2,model=4, got {item!r}")
        pairs[name.strip()] = value.strip()
    return pairs


def _mesh(text: str) -> dict[str, int]:
    pairs = _pairs(text)
    try:
        return {name: int(size) for name, size in pairs.items()}
    except ValueError:
        raise argparse.ArgumentTypeError(f"mesh axis sizes must be integers, got {text!r}") from None


def _rules(text: str) -> dict[str, str | None]:
    """``"mlp=model,embed=none"`` -> ``{"mlp": "model", "embed": None}``."""
    return {name: None if value.lower() in ("", "none") else value for name, value in _pairs(text).items()}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse ``minishard train ...``; mesh and rules come back as dicts, layers as a list."""
    parser = argparse.ArgumentParser(prog="minishard", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="train an MLP on MNIST (or cats_vs_dogs) on a device mesh")
    train.set_defaults(**DEFAULTS)
    add = train.add_argument
    add("--dataset", choices=sorted(DATASETS))
    add(
        "--layers",
        type=_sizes,
        help="layer sizes (default: 784,512,10 for mnist, 120000,2048,1024,2 for cats_vs_dogs)",
    )
    add("--activation", choices=sorted(ACTIVATIONS))
    add("--epochs", type=int, help="total epochs, also when resuming (default %(default)s)")
    add("--batch-size", type=int, help="global batch size (default %(default)s)")
    add("--lr", type=float, help="initial learning rate (default %(default)s)")
    add("--decay-rate", type=float, help="learning rate factor per --decay-steps (default %(default)s)")
    add("--decay-steps", type=int)
    add("--staircase", action="store_true", help="decay in steps rather than smoothly")
    add("--momentum", type=float, help="(default %(default)s)")
    add("--mesh", type=_mesh, help="mesh axes, e.g. data=2,model=4 (default %(default)s)")
    add("--rules", type=_rules, help="logical=mesh rules, e.g. mlp=model (default: batch=data, mlp=model)")
    add("--devices", type=int, help="CPU devices to simulate when there is no accelerator")
    add("--seed", type=int)
    add("--checkpoint-dir", help="save checkpoints here (every --checkpoint-every steps and per epoch)")
    add("--checkpoint-every", type=int, default=None, help="steps between checkpoints")
    add("--keep", type=int, default=3, help="checkpoints to keep (default %(default)s)")
    add("--resume", action="store_true", help="continue from the latest good checkpoint")
    add("--plot", help="write a PNG of loss and accuracy per epoch")
    add("--log", help="append JSON lines of metrics (per epoch, and every 100 steps)")
    add("--data-dir", help="TFDS data directory (default: $TFDS_DATA_DIR, then ~/tensorflow_datasets)")
    add("--no-download", dest="download", action="store_false", help="never touch the network")
    args = parser.parse_args(argv)
    for name, parse in (("mesh", _mesh), ("rules", _rules)):  # argparse leaves string defaults as they are
        if isinstance(getattr(args, name), str):
            setattr(args, name, parse(getattr(args, name)))
    info = DATASET_INFO[args.dataset]
    args.layers = args.layers or [info.num_features, *HIDDEN[args.dataset], info.num_classes]
    if (args.resume or args.checkpoint_every) and not args.checkpoint_dir:
        parser.error("--resume and --checkpoint-every need --checkpoint-dir")
    return args


def simulate_devices(count: int) -> None:
    """Ask XLA for ``count`` CPU devices; must run before JAX initialises its backend.

    A device count already in ``XLA_FLAGS`` wins (the user set it on purpose); ``train`` says so.
    """
    current = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in current:
        os.environ["XLA_FLAGS"] = f"{current} --xla_force_host_platform_device_count={count}".strip()


def default_rules(mesh_axes: Sequence[str], user: dict[str, str | None]) -> dict[str, Any]:
    """The CLI's rules, then the user's: batch over "data" and mlp over "model" when the mesh has them."""
    rules: dict[str, Any] = {
        "batch": "data" if "data" in mesh_axes else None,
        "embed": None,
        "mlp": "model" if "model" in mesh_axes else None,
        "classes": None,
    }
    return {**rules, **user}


def train(args: argparse.Namespace) -> int:
    """Run ``fit`` as the arguments say; 0 on success, 1 on a clear failure, 2 on bad arguments."""
    devices = jax.devices()
    if devices[0].platform == "cpu":
        print(f"No accelerator: simulating {len(devices)} CPU devices (XLA_FLAGS={os.environ['XLA_FLAGS']})")
        if len(devices) != args.devices:
            print(f"(XLA_FLAGS already set the device count, so --devices {args.devices} is not used)")
    info = DATASET_INFO[args.dataset]
    if args.layers[0] != info.num_features or args.layers[-1] != info.num_classes:
        print(
            f"error: --layers must start with {info.num_features} inputs and end with {info.num_classes} "
            f"classes for {args.dataset}, got {args.layers}",
            file=sys.stderr,
        )
        return 2
    expected_errors: tuple[type[Exception], ...] = (DataError, ShardingError, TrainingError)
    expected_errors += _checkpoint_errors(args)
    try:
        mesh = make_mesh(args.mesh)
        rules = AxisRules(**default_rules(mesh.axis_names, args.rules))
        load = DATASETS[args.dataset]
        options = dict(data_dir=args.data_dir, download=args.download, shuffle_seed=args.seed)
        train_data = load("train", args.batch_size, **options)
        test_data = load("test", args.batch_size, **options)
        key = jax.random.key(args.seed)
        axes = megatron_axes(len(args.layers) - 1)
        model = mlp(args.layers, key=key, activation=args.activation, axes=axes)
        print(f"Rules: {rules}")
        show(explain(model, mesh, rules))
        schedule = exponential_decay(args.lr, args.decay_rate, args.decay_steps, args.staircase)
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
            metrics_log=args.log,
        )
    except expected_errors as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    if args.plot:
        plot_history(history, args.plot)
        print(f"Wrote {args.plot}")
    return 0


def _checkpoint_errors(args: argparse.Namespace) -> tuple[type[Exception], ...]:
    if not args.checkpoint_dir:
        return ()
    from minishard.checkpoint import CheckpointError  # orbax is an optional extra

    return (CheckpointError,)


def show(report: Any) -> None:
    """A rich table in a terminal (when rich is installed), plain text in logs and pipes."""
    if sys.stdout.isatty():
        try:
            import rich

            rich.print(report)
            return
        except ImportError:
            pass
    print(report)


def plot_history(history: list[dict[str, Any]], path: str) -> None:
    """Loss and accuracy per epoch, side by side (matplotlib, an optional extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [record["epoch"] for record in history]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    left.plot(epochs, [r["loss"] for r in history], marker="o")
    left.set(title="training loss", xlabel="epoch")
    right.plot(epochs, [r["train_acc"] for r in history], marker="o", label="train")
    if all("test_acc" in r for r in history):
        right.plot(epochs, [r["test_acc"] for r in history], marker="o", label="test")
    right.set(title="accuracy", xlabel="epoch")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    """The ``minishard`` console script: parse, set up simulated devices, train."""
    args = parse_args(argv)
    simulate_devices(args.devices)
    return train(args)


if __name__ == "__main__":
    sys.exit(main())
