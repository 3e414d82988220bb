"""A published run's model and layout, scaled down to 8 devices, so that ``--check`` compiles them.

LLaMA-3 405B on 16,384 H100 cannot be compiled here; a model of its proportions on 8 simulated
devices can, with its layout cut to 8 devices the same way. ``scaled_down`` is the one rule for
the model, ``scaled_layout`` for the layout, ``scaled_batch`` for the batch; ``entry_of`` builds
the result as minishard's GPT (``minishard.models.gpt``) with the size's MLP, which ``rank_check``
compiles and sets beside the ranking's prediction of the same shapes (``as_built``).

>>> from minishard.serving import LLAMA3_405B
>>> small = scaled_down(LLAMA3_405B)
>>> small.layers, small.width, small.heads, small.kv_heads, small.hidden, small.vocab, small.gated
(4, 512, 128, 8, 1664, 127, True)
>>> str(scaled_layout(Layout(dp=128, tp=8, pp=16)))   # Meta's 16,384 GPUs, on 8
'dp 2 x tp 2 x pp 2'
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax

from minishard.layers import Layer, Linear
from minishard.layouts import Layout
from minishard.models.gpt import GPT, stacked_gpt
from minishard.models.transformer import MLPBuilder, dense_mlp
from minishard.run.cli.models import MODELS
from minishard.run.cli.models.entry import ModelEntry
from minishard.serving import Decoder

__all__ = [
    "DEPTH",
    "DEVICES",
    "WIDTH_CUT",
    "GatedMLP",
    "as_built",
    "entry_of",
    "mlp_of",
    "scaled_batch",
    "scaled_down",
    "scaled_layout",
]

DEVICES = 8
"""The devices a scaled run is compiled on: this process's 8 simulated ones, or a slice's."""
WIDTH_CUT = 32
"""What every width (the residual stream, the MLP, each head) and the sequence are divided by."""
DEPTH = 4
"""Layers of a scaled model: each is a compile's worth of time, and 4 split over pp 2 or 4."""


def scaled_down(size: Decoder, devices: int = DEVICES) -> Decoder:
    """``size`` cut to compile on ``devices``, its proportions kept where the GPT can keep them.

    * width and MLP divided by ``WIDTH_CUT``: the MLP's ratio to the width kept, gated or not;
    * the heads kept, and the key/value heads, unless there are more of them than ``devices``:
      then both cut by one factor to as many key/value heads as devices, so the group (query heads
      per key/value head) is kept, any tp of the devices splits them (the GPT's ``--kv-heads``
      split over "model"), and a head is not 5 numbers wide (Megatron's 160 of 25,600 / 32);
    * each head ``width / heads`` wide: the GPT's attention is as wide as its stream (PaLM's is
      2/3 of it: 1.5x wider here; LLaMA's and Megatron's are as wide);
    * ``DEPTH`` layers; the vocabulary divided by the width's and the depth's cuts together, so
      the embeddings keep their share of the parameters (1.0% of LLaMA-3 405B's).

    >>> from minishard.serving import MEGATRON_1T, PALM_540B
    >>> shapes = [scaled_down(size) for size in (PALM_540B, MEGATRON_1T)]
    >>> [(s.width, s.heads, s.kv_heads, s.head_dim, s.vocab) for s in shapes]
    [(576, 48, 1, 12, 271), (800, 8, 8, 100, 50)]
    """
    groups = max(1, size.kv_heads // devices)  # 160 heads of their own (Megatron): 8 of 8
    heads, width = size.heads // groups, size.width // WIDTH_CUT
    vocab = round(size.vocab / WIDTH_CUT * DEPTH / size.layers)
    return dataclasses.replace(
        size,
        layers=DEPTH,
        width=width,
        heads=heads,
        kv_heads=size.kv_heads // groups,
        head_dim=width // heads,
        hidden=size.hidden // WIDTH_CUT,
        vocab=vocab,
        position_rows=0,
    )


def scaled_layout(layout: Layout, devices: int = DEVICES) -> Layout:
    """``layout`` on ``devices`` (a power of two): its dimensions share the ``log2(devices)``
    doublings as they share ``log2`` of its own devices, whole ones by the largest remainders.

    Meta's dp 128 x tp 8 x pp 16 is 7 + 3 + 4 of 14 doublings: on 8 devices 1.5, 0.64 and 0.86
    of 3: dp 1, then pp and tp (the largest remainders) 1 each.

    >>> palm, megatron = Layout(dp=2, fsdp=256, tp=12), Layout(dp=6, tp=8, pp=64)
    >>> str(scaled_layout(palm)), str(scaled_layout(megatron))
    ('fsdp 4 x tp 2', 'dp 2 x tp 2 x pp 2')
    """
    doublings = round(math.log2(devices))
    logs = {name: math.log2(ways) for name, ways in layout.ways().items()}
    shares = {name: doublings * log / sum(logs.values()) for name, log in logs.items()}
    whole = {name: int(share) for name, share in shares.items()}
    by_remainder = sorted(shares, key=lambda name: shares[name] - whole[name], reverse=True)
    for name in by_remainder[: doublings - sum(whole.values())]:
        whole[name] += 1
    return Layout(**{name: 2**n for name, n in whole.items() if n})


def scaled_batch(tokens: int, devices: int, context: int, on: int = DEVICES) -> tuple[int, int]:
    """The scaled run's tokens and sequence: the sequence divided by ``WIDTH_CUT``; on each of the
    ``on`` devices the published run's tokens a device, in whole sequences, a multiple of ``on``.

    >>> scaled_batch(16 * 2**20, 16384, 8192)   # LLaMA-3 405B: 1,024 tokens a GPU; 32 of 256
    (8192, 256)
    """
    sequence = context // WIDTH_CUT
    sequences = math.ceil(tokens / devices * on / sequence / on) * on
    return sequences * sequence, sequence


def as_built(size: Decoder, context: int) -> Decoder:
    """The shapes of ``entry_of(size)``'s GPT, which its prediction prices: a learned table of
    ``context`` positions, and the GPT's biases (LayerNorms', the MLP's, the head's)."""
    return dataclasses.replace(size, position_rows=context, biases=True)


class GatedMLP(Layer):
    """LLaMA's and PaLM's MLP: ``down(swish(gate(x)) * up(x))``, three ``width x hidden`` matrices.

    The up and down matrices have biases, the gate none: the dense MLP's ``hidden + width``, which
    ``Decoder.params`` counts for a model with biases. All split their hidden units over "model".

    >>> import jax, jax.numpy as jnp
    >>> mlp = GatedMLP(8, 24, key=jax.random.key(0))
    >>> mlp(jnp.ones((2, 8))).shape, mlp.gate.param_logical_axes()
    ((2, 8), {'weight': ('embed', 'mlp')})
    """

    param_fields = ("gate", "up", "down")

    def __init__(self, width: int, hidden: int, *, key: jax.Array) -> None:
        gate, up, down = jax.random.split(key, 3)
        into, out = ("embed", "mlp"), ("mlp", "embed")
        self.gate = Linear(width, hidden, key=gate, scale=width**-0.5, axes=into, use_bias=False)
        self.up = Linear(width, hidden, key=up, scale=width**-0.5, axes=into)
        self.down = Linear(hidden, width, key=down, scale=hidden**-0.5, axes=out)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jax.nn.swish(self.gate(x)) * self.up(x))


def mlp_of(size: Decoder) -> MLPBuilder:
    """The builder of ``size``'s MLP, of its own ``hidden`` units (LLaMA's 3.25 x the width is no
    integer ``mlp_ratio``): gated, or the GPT's two matrices."""

    def build(width: int, _: int, *, key: jax.Array) -> Layer:
        return (GatedMLP if size.gated else dense_mlp)(width, size.hidden, key=key)

    return build


def entry_of(size: Decoder) -> ModelEntry:
    """The GPT's entry (``--model gpt``), building ``size``'s shapes: its vocabulary, heads, key and
    value heads, and MLP. The args it builds from carry the same --width, --depth and --heads,
    which the styles check (``rank_check.scaled_args``)."""

    def build(args: Any, key: jax.Array, stacked: bool = False) -> Any:
        shape = (size.vocab, args.context, size.width, size.layers, size.heads, 1)
        make = stacked_gpt if stacked else GPT
        return make(*shape, key=key, kv_heads=size.kv_heads, mlp=mlp_of(size))

    gpt = MODELS["gpt"]
    assert gpt.stack is not None  # the GPT stacks its blocks for a pipeline
    stack = dataclasses.replace(gpt.stack, build=lambda args, key: build(args, key, stacked=True))
    return dataclasses.replace(gpt, build=build, stack=stack)
