"""The ViT's entry (``--model vit``): a Vision Transformer on MNIST or cats_vs_dogs.

Its attention heads and MLPs split Megatron-style; a warmup and a cosine.

>>> VIT.defaults["width"], VIT.defaults["schedule"]
(64, 'cosine')
"""

from __future__ import annotations

from typing import Any

import jax

from minishard.models.vit import ViT, stacked_vit
from minishard.run import data
from minishard.run.cli.flags import Error, Flag, at_least
from minishard.run.cli.models.entry import Args, ModelEntry, Stacking
from minishard.run.cli.models.images import (
    SGD_DEFAULTS,
    SGD_FLAGS,
    check_examples,
    image_batch,
    image_splits,
    sgd,
)
from minishard.run.cli.models.transformer import (
    TRANSFORMER_FLAGS,
    check_depth_stages,
    check_heads,
    depth_over_stages,
)
from minishard.run.steps import CLASSIFICATION

__all__ = ["VIT"]


def _vit(args: Args, key: jax.Array, stacked: bool = False) -> Any:
    """``ViT`` (or, for a pipeline, ``stacked_vit``) on --dataset's images."""
    height, _, channels = data.DATASET_INFO[args.dataset].input_shape
    shape = (height, args.patch_size, channels, args.width, args.depth, args.heads, args.mlp_ratio)
    classes = data.DATASET_INFO[args.dataset].num_classes
    return (
        stacked_vit(*shape, classes, key=key) if stacked else ViT(*shape, classes, key=key, remat=args.remat)
    )


def _check_vit(args: Args, error: Error) -> None:
    check_heads(args, error)
    if (height := data.DATASET_INFO[args.dataset].input_shape[0]) % args.patch_size:
        error(f"argument --patch-size: {args.patch_size} must divide the image size {height}")
    check_examples(args, error)


VIT = ModelEntry(
    name="vit",
    label="ViT",
    help="a Vision Transformer, its attention heads and MLPs split Megatron-style",
    flags={
        **TRANSFORMER_FLAGS,
        "patch_size": Flag("square patches; must divide the image", type=at_least(1)),
        **SGD_FLAGS,
    },
    # A transformer wants a warmup and a cosine. Its 3 epochs (136-217 s each on 2 CPU cores): 0.971 test
    # accuracy after epoch 3 of a 6-epoch cosine was measured; a 3-epoch cosine has finished its decay there.
    defaults={
        "width": 64,
        "depth": 4,
        "heads": 4,
        "patch_size": 7,
        "mlp_ratio": 2,
        "remat": "none",
        **SGD_DEFAULTS,
        "epochs": 3,
        "batch_size": 128,
        "lr": 0.1,
        "schedule": "cosine",
        "warmup_steps": 300,
    },
    datasets=("mnist", "cats_vs_dogs"),
    style=None,
    task=CLASSIFICATION,
    build=_vit,
    data=lambda args: image_splits(args, flatten=False),
    optimizer=sgd,
    example=lambda args, batch_size: image_batch(args, batch_size, flatten=False),
    check=_check_vit,
    stack=Stacking(lambda args, key: _vit(args, key, stacked=True), depth_over_stages(4), check_depth_stages),
)
