"""What the two image models (the MLP, the ViT) share: momentum SGD and its schedule, their data.

Both train by epochs on ``--dataset``'s labelled images (``minishard.run.data``),
its test split evaluated every epoch, with ``sgd`` at ``learning_rate``.

>>> sorted(SGD_FLAGS) == sorted(SGD_DEFAULTS)
True
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from minishard.optim import SGD, LearningRate, exponential_decay, warmup_cosine_decay
from minishard.run import data
from minishard.run.cli.flags import Error, Flag, at_least, positive, unit_interval
from minishard.run.cli.models.entry import Args, Splits

__all__ = [
    "SGD_DEFAULTS",
    "SGD_FLAGS",
    "check_examples",
    "image_batch",
    "image_splits",
    "learning_rate",
    "sgd",
]


SGD_FLAGS = {
    "momentum": Flag("SGD momentum, in [0, 1)", type=unit_interval),
    "decay_rate": Flag("learning rate factor per --decay-steps", type=positive),
    "decay_steps": Flag("steps per --decay-rate", type=at_least(1)),
    "staircase": Flag("decay in steps rather than smoothly", action="store_true"),
}
SGD_DEFAULTS = {"momentum": 0.9, "decay_rate": 0.7, "decay_steps": 1000, "staircase": False}


def learning_rate(args: Args, total_steps: int) -> LearningRate:
    """--schedule's: exponential decay (--decay-rate per --decay-steps), or warmup then cosine to 0."""
    if args.schedule == "cosine":
        return warmup_cosine_decay(args.lr, min(args.warmup_steps, total_steps - 1), total_steps)
    return exponential_decay(args.lr, args.decay_rate, args.decay_steps, args.staircase)


def sgd(args: Args, total_steps: int) -> SGD:
    """Momentum SGD at ``learning_rate``: the MLP's and the ViT's optimizer."""
    return SGD(learning_rate(args, total_steps), momentum=args.momentum)


def image_splits(args: Args, flatten: bool) -> Splits:
    """--dataset's train split to train on, its test split evaluated every epoch (``minishard.run.data``)."""
    load = data.DATASETS[args.dataset]
    options = dict(data_dir=args.data_dir, download=args.download, shuffle_seed=args.seed, flatten=flatten)
    return Splits(load("train", args.batch_size, **options), load("test", args.batch_size, **options))


def image_batch(args: Args, batch_size: int, flatten: bool) -> dict[str, jax.ShapeDtypeStruct]:
    """The shapes of a batch of --dataset's labelled images (flattened for the MLP)."""
    info = data.DATASET_INFO[args.dataset]
    image = (info.num_features,) if flatten else info.input_shape
    return {
        "image": jax.ShapeDtypeStruct((batch_size, *image), jnp.float32),
        "label": jax.ShapeDtypeStruct((batch_size,), jnp.int32),
    }


def check_examples(args: Args, error: Error) -> None:
    if args.batch_size > (examples := data.DATASET_INFO[args.dataset].train_examples):
        error(f"argument --batch-size: {args.batch_size} exceeds the {examples} training examples")
