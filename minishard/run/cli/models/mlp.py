"""The MLP's entry (``--model mlp``): a multi-layer perceptron on MNIST or cats_vs_dogs.

Its hidden units split Megatron-style; under a pipeline, one identical
256 x 256 block per stage.

>>> MLP.defaults["layers"], MLP.defaults["epochs"]
(None, 5)
"""

from __future__ import annotations

from minishard import pipeline
from minishard.layers import ACTIVATIONS, megatron_axes, mlp
from minishard.run import data
from minishard.run.cli.flags import Error, Flag, sizes
from minishard.run.cli.models.entry import Args, ModelEntry, Stacking
from minishard.run.cli.models.images import (
    SGD_DEFAULTS,
    SGD_FLAGS,
    check_examples,
    image_batch,
    image_splits,
    sgd,
)
from minishard.run.steps import CLASSIFICATION

__all__ = ["HIDDEN", "MLP", "PIPELINE_WIDTH"]


HIDDEN = {"mnist": [512], "cats_vs_dogs": [2048, 1024]}
"""Hidden layer sizes of each dataset's classic MLP; inputs and classes come from DATASET_INFO."""
PIPELINE_WIDTH = 256
"""The MLP's hidden width under a pipeline style when --layers is not given: 784, 256 x (stages + 1), 10."""


def _classic_layers(args: Args) -> None:
    if args.layers is None:
        info = data.DATASET_INFO[args.dataset]
        args.layers = [info.num_features, *HIDDEN[args.dataset], info.num_classes]


def _check_mlp(args: Args, error: Error) -> None:
    info = data.DATASET_INFO[args.dataset]
    if args.layers[0] != info.num_features or args.layers[-1] != info.num_classes:
        error(
            f"argument --layers: must start with {info.num_features} inputs and end with "
            f"{info.num_classes} classes for {args.dataset}, got {','.join(map(str, args.layers))}"
        )
    check_examples(args, error)


def _mlp_stages(args: Args, stages: int) -> None:
    """One identical 256 x 256 block per stage: ``784, 256 x (stages + 1), 10``."""
    if args.layers is None:
        info = data.DATASET_INFO[args.dataset]
        args.layers = [info.num_features, *[PIPELINE_WIDTH] * (stages + 1), info.num_classes]


def _check_mlp_stages(args: Args, stages: int, error: Error) -> None:
    hidden = args.layers[1:-1]
    if len(hidden) < 2 or len(set(hidden)) > 1:
        error("argument --layers: a pipeline stacks equal hidden layers, e.g. 784,256,256,256,256,256,10")
    if (len(hidden) - 1) % stages:
        error(
            f"argument --layers: {len(hidden) - 1} identical {hidden[0]}x{hidden[0]} blocks cannot split "
            f"over {stages} stages; give {stages} blocks ({stages + 1} hidden sizes of {hidden[0]}) "
            "or a multiple"
        )


MLP = ModelEntry(
    name="mlp",
    label="MLP",
    help="a multi-layer perceptron, its hidden units split Megatron-style",
    flags={
        "layers": Flag(
            "layer sizes (default: 784,512,10 for mnist, 120000,2048,1024,2 for cats_vs_dogs)", type=sizes
        ),
        "activation": Flag("between layers", choices=sorted(ACTIVATIONS)),
        **SGD_FLAGS,
    },
    defaults={
        "layers": None,  # the dataset's classic MLP, or under a pipeline one 256 x 256 block per stage
        "activation": "swish",
        **SGD_DEFAULTS,
        "epochs": 5,
        "batch_size": 128,
        "lr": 0.2,
        "schedule": "exponential",
        "warmup_steps": 0,
    },
    datasets=("mnist", "cats_vs_dogs"),
    style=None,
    task=CLASSIFICATION,
    build=lambda args, key: mlp(
        args.layers, key=key, activation=args.activation, axes=megatron_axes(len(args.layers) - 1)
    ),
    data=lambda args: image_splits(args, flatten=True),
    optimizer=sgd,
    example=lambda args, batch_size: image_batch(args, batch_size, flatten=True),
    fill=_classic_layers,
    check=_check_mlp,
    stack=Stacking(
        lambda args, key: pipeline.stacked_mlp(args.layers, key=key, activation=args.activation),
        _mlp_stages,
        _check_mlp_stages,
        resets=("layers",),  # a pipeline's: one 256 x 256 block per stage
    ),
)
