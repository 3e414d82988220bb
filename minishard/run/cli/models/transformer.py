"""What every transformer here (the ViT, the GPT) shares: its shape flags and their checks.

Heads must divide the width, and under a pipeline the depth rounds up to, and
splits over, the stages. A model whose ``blocks`` are ``transformer.Block`` offers
the styles the operations ``SequenceSplit`` asks for with ``ring_cores`` and
``attention_shape`` (``ExpertSplit``'s, ``moe_layers``, is the chapter's: ``minishard.experts``).

>>> sorted(TRANSFORMER_FLAGS)
['depth', 'heads', 'mlp_ratio', 'remat', 'width']
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from minishard.models.attention import RINGS
from minishard.pipeline import StackedModel
from minishard.remat import POLICIES
from minishard.run.cli.flags import Error, Flag, at_least
from minishard.run.cli.models.entry import Args

__all__ = [
    "TRANSFORMER_FLAGS",
    "attention_shape",
    "check_depth_stages",
    "check_heads",
    "depth_over_stages",
    "ring_cores",
]


def check_heads(args: Args, error: Error) -> None:
    if args.width % args.heads:
        error(f"argument --heads: {args.heads} heads must divide --width {args.width}")


def depth_over_stages(default: int) -> Callable[[Args, int], None]:
    """A transformer's ``Stacking.fill``: --depth (``default`` if not given) rounded up to the stages."""

    def fill(args: Args, stages: int) -> None:
        if args.depth is None:
            args.depth = stages * -(-default // stages)

    return fill


def check_depth_stages(args: Args, stages: int, error: Error) -> None:
    if args.depth % stages:
        error(
            f"argument --depth: {args.depth} blocks cannot split over {stages} stages; "
            f"give a multiple of {stages}"
        )


def ring_cores(model: Any) -> Any:
    """``model`` with every block's attention core a ring (``minishard.context``), its pairs of
    chunks attended as its core attends (``RINGS``: ``--attention flash``'s by the kernels): cp's
    build; a pipeline's model (``StackedModel``) has one stacked block."""
    ring = lambda b: b.replace(attention=b.attention.replace(core=RINGS[b.attention.core]))  # noqa: E731
    if isinstance(model, StackedModel):
        return model.replace(blocks=model.blocks.replace(block=ring(model.blocks.block)))
    return model.replace(blocks=tuple(ring(b) for b in model.blocks))


def attention_shape(model: Any) -> tuple[int, int, int, int]:
    """``(attention layers, query heads, key/value heads, head_dim)`` of ``model``'s blocks: what a
    ring sends per layer (grouped keys and values travel at their own heads) and computes."""
    attention = model.blocks[0].attention  # every block alike
    head_dim = attention.width // attention.heads
    return len(model.blocks), attention.heads, attention.kv_heads, head_dim


TRANSFORMER_FLAGS = {
    "width": Flag("features per token", type=at_least(1)),
    "depth": Flag("transformer blocks", type=at_least(1)),
    "heads": Flag("attention heads; must divide --width", type=at_least(1)),
    "mlp_ratio": Flag("MLP hidden units per feature", type=at_least(1)),
    "remat": Flag("what each block keeps for the backward pass (minishard.remat)", choices=tuple(POLICIES)),
}
"""The flags of every transformer here (the ViT, the GPT): its shape, and rematerialisation."""
