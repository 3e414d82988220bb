"""A Vision Transformer (ViT) written as minishard Layers, ready to shard in 1-D or 2-D.

The pieces, in the order an image meets them:

* ``PatchEmbedding``: cut a ``[B, H, W, C]`` batch into ``p x p`` patches,
  project each patch to ``width`` features and add a learned position
  embedding per patch: ``[B, tokens, width]``;
* ``Block`` (``depth`` of them), pre-norm: ``x + Attention(LayerNorm(x))``,
  then ``x + MLP(LayerNorm(x))``;
* ``ViT``: a last ``LayerNorm``, ``MeanPool`` (the mean over tokens), a
  ``Linear`` head to the classes.

``LayerNorm`` and ``Block`` are ``minishard.models.transformer``'s, ``Attention``
``minishard.models.attention``'s,
the same the GPT is built from (a ViT's attention is not ``causal``).

Every parameter names its logical axes. Heads are a dimension of their own
(``query`` is ``[width, heads, head_dim]``, not ``[width, width]``), so a rule
can split them without any reshaping in the model:

=====================  ============================  ==========================
parameter              logical axes                  the ``2d`` style
=====================  ============================  ==========================
patch projection       ``("patch", "embed")``        replicated
position table         ``("seq", "embed")``          replicated
LayerNorm scale, bias  ``("embed",)``                replicated
query, key, value      ``("embed", "heads", "kv")``  heads over "model"
attention out          ``("heads", "kv", "embed")``  heads over "model"
MLP in                 ``("embed", "mlp")``          hidden units over "model"
MLP out                ``("mlp", "embed")``          hidden units over "model"
head                   ``("embed", "classes")``      replicated
=====================  ============================  ==========================

The styles of ``minishard.styles`` (``dp``, ``tp``, ``2d``, ``fsdp``,
``fsdp+tp``) run the same model data-, tensor- (Megatron), 2-D- or fully
sharded data-parallel; only the rules change. ``vit_rules(style)`` gives a
style's rules. The model names the batch axis nowhere: every activation's
sharding comes from ``activation_axes``, so ``Sharded(batch_axis=...)`` can
call it what it likes.

Where the collectives of a Megatron block come from
---------------------------------------------------
With heads and MLP hidden units split over "model", each device holds whole
heads and a slice of the hidden units; everything between the two ends of a
sub-layer is local. The two ends are where the "model" devices meet (the
``f`` and ``g`` operators of the Megatron-LM paper, Shoeybi et al. 2019):

* forward, attention out projection ``"bthk,hke->bte"``: it sums over heads,
  and each device holds only its heads, so it has a *partial* sum of the
  output: **all-reduce over "model"** (``g``). The same after the MLP's second
  Linear, which sums over the hidden units: a second all-reduce.
* backward, the mirror images (``f``): the gradient flowing back into
  ``LayerNorm(x)`` before ``query``/``key``/``value`` is a sum over heads of
  each head's contribution, partial on each device: an all-reduce; and one
  before the MLP's first Linear. (The forward ``f`` and the backward ``g``
  are identities: the input is already on every "model" device.) ``Attention``
  computes q, k and v in *one* einsum so that their three contributions are
  added before that all-reduce: with three separate einsums, XLA all-reduces
  each of them, 6 per block instead of 4.

That is 4 all-reduces over "model" per block and training step, each of one
activation ``[B / data, tokens, width]`` float32 on each device. With
"data" = 2, the gradients of all parameters are then summed over "data" (the
data-parallel all-reduce), each device sending its own shard of the
parameters: 1/4 of the attention and MLP weights, all of the rest.

Measured with ``minishard.explain`` (and checked by ``tests/test_vit.py``)
for the default ``ViT`` (28x28x1 images, patch 7: 16 tokens; width 64, depth 4,
4 heads of 16, MLP 128) and ``minishard.run.steps.make_train_step`` (momentum SGD)
at batch 128 with ``mesh_rules("2d", 8)`` (data=2 x model=4)::

    all-reduce  x17  4.4 MB  over ('data',), ('model',)

* over "model": 4 per block x 4 blocks = 16 all-reduces, each of
  64 examples (128 / data 2) x 16 tokens x 64 features x 4 bytes = 262,144
  bytes: **4,194,304 bytes**;
* over "data": XLA's all-reduce combiner fuses the gradients of all
  parameters, the loss and the accuracy into **one** all-reduce of each
  device's shard of them: per block 2 LayerNorms 2x2x64 + q, k, v 3x(64x1x16)
  + out 1x16x64 + MLP in 64x32+32 + MLP out 32x64+64 = 8,544 numbers; the
  rest, patch projection 49x64+64, position table 16x64, last LayerNorm 2x64 and
  head 64x10+10, = 5,002; (4 x 8,544 + 5,002 + 2 scalars) x 4 bytes =
  **156,720 bytes**.

So 4.2 MB over "model" against 0.16 MB over "data": for a model this small,
its activations outweigh its weights, and tensor parallelism costs far more
communication than data parallelism (``mesh_rules("dp", 8)``, data=8, all-reduces
the 551,464 bytes of gradients, plus loss and accuracy, and nothing else).

Rematerialisation: ``ViT(..., remat="full")`` wraps each block's call in
``jax.checkpoint`` with ``jax.checkpoint_policies.nothing_saveable``: the
backward pass keeps only each block's input and recomputes everything inside
the block (attention weights ``[B, heads, tokens, tokens]`` included) when it
needs it, trading one extra forward pass for memory. The recomputation
repeats the attention's forward all-reduce (the MLP's input needs its sum;
nothing in the backward needs the MLP's output), so with remat a step has 5
all-reduces over "model" per block instead of 4: 5,242,880 bytes here.

>>> import jax, jax.numpy as jnp
>>> def build():
...     return ViT(image_size=8, patch_size=4, width=16, depth=1, heads=2, classes=3, key=jax.random.key(0))
>>> model = jax.eval_shape(build)   # traced, not computed: parameters as ShapeDtypeStructs
>>> images = jax.ShapeDtypeStruct((5, 8, 8, 1), jnp.float32)   # 5 images of 8x8x1
>>> jax.eval_shape(lambda model, images: model(images), model, images).shape
(5, 3)
>>> vit_rules("2d").spec(model.blocks[0].attention.param_logical_axes()["query"])
P(None, 'model', None)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from minishard.constraints import activation_axes, as_activation, output_sharding
from minishard.layers import Layer, Linear, Sequential, check_input, check_key
from minishard.models.attention import Attention
from minishard.models.transformer import Block, LayerNorm, apply_blocks
from minishard.pipeline import StackedModel, stack
from minishard.remat import POLICIES
from minishard.rules import AxisRules, LogicalAxes, MeshAxes
from minishard.styles import style_rules


def vit_rules(style: str = "2d", **overrides: MeshAxes) -> AxisRules:
    """The rules of the style ``style`` (``minishard.styles``), ``overrides`` first: they win.

    >>> vit_rules("tp").spec(("embed", "heads", "kv"))   # Megatron: heads over "model"
    P(None, 'model', None)
    >>> vit_rules("dp", heads="data").spec(("embed", "heads", "kv"))   # an override wins
    P(None, 'data', None)
    """
    return style_rules(style, overrides)


class PatchEmbedding(Layer):
    """``[B, H, W, C]`` images -> ``[B, tokens, width]``: patches, a shared Linear, positions.

    A patch of ``p x p x C`` pixels is flattened and projected by one
    ``Linear`` (the same for every patch: a convolution with stride ``p``,
    written as a reshape and a matmul). Attention itself ignores order, so a
    learned ``position_table`` ``[tokens, width]`` tells each token where its
    patch was.

    >>> import jax, jax.numpy as jnp
    >>> embed = PatchEmbedding(image_size=28, patch_size=7, channels=1, width=32, key=jax.random.key(0))
    >>> embed(jnp.zeros((2, 28, 28, 1))).shape   # 4 x 4 = 16 patches of 7 x 7 pixels
    (2, 16, 32)
    """

    param_fields = ("projection", "position_table")
    static_fields = ("image_size", "patch_size", "channels")

    def __init__(
        self, image_size: int, patch_size: int, channels: int, width: int, *, key: jax.Array
    ) -> None:
        if image_size % patch_size:
            raise ValueError(
                f"PatchEmbedding: image_size {image_size} is not a multiple of patch {patch_size}"
            )
        check_key("PatchEmbedding", key)
        self.image_size, self.patch_size, self.channels = int(image_size), int(patch_size), int(channels)
        tokens, pixels = (image_size // patch_size) ** 2, patch_size * patch_size * channels
        k_proj, k_pos = jax.random.split(key)
        self.projection = Linear(pixels, width, key=k_proj, scale=pixels**-0.5, axes=("patch", "embed"))
        # Standard normal, as large as the patch features: ViT's 0.02 suits Adam, but under plain
        # SGD such small positions stay invisible for hundreds of steps, and the model cannot
        # tell where a patch was.
        self.position_table = jax.random.normal(k_pos, (tokens, width))

    def __call__(self, images: jax.Array) -> jax.Array:
        check_input("PatchEmbedding", images)
        size, p, c = self.image_size, self.patch_size, self.channels
        if jnp.ndim(images) != 4 or jnp.shape(images)[1:] != (size, size, c):
            raise ValueError(
                f"PatchEmbedding expects a batch of images [B, {size}, {size}, {c}], got shape "
                f"{jnp.shape(images)}; for one image, add a batch axis: images[None]"
            )
        g = size // p  # patches per side
        # [B, g, p, g, p, C] -> [B, g, g, p, p, C] -> [B, g*g, p*p*C]: local to each example,
        # so a batch split over "data" stays split, with no communication.
        # On an Explicit mesh a reshape must say where its output goes (None elsewhere: JAX decides).
        split = jnp.reshape(images, (-1, g, p, g, p, c), out_sharding=output_sharding(activation_axes(6)))
        patches = jnp.reshape(
            split.transpose(0, 1, 3, 2, 4, 5),
            (-1, g * g, p * p * c),
            out_sharding=output_sharding(activation_axes(3)),
        )
        table = as_activation(self.position_table, activation_axes(3, "seq", "embed"))
        return self.projection(patches) + table

    def param_logical_axes(self) -> dict[str, LogicalAxes]:
        return {"position_table": ("seq", "embed")}  # the projection (a Linear) answers for itself


class MeanPool(Layer):
    """``[B, tokens, width]`` -> ``[B, width]``: the mean over tokens, a parameter-free layer."""

    def __call__(self, x: jax.Array) -> jax.Array:
        return x.mean(axis=1)


class ViT(Layer):
    """A Vision Transformer classifier: ``[B, H, W, C]`` images -> ``[B, classes]`` logits.

    Pooling: the mean of the last tokens (``MeanPool``), not a class token. It
    needs no extra parameter or token (16 tokens, not 17), treats every patch
    alike, and classifies as well ("Better plain ViT baselines for
    ImageNet-1k", Beyer et al. 2022, use it for that reason). ``pool`` is a
    layer of its own, so another one drops in with ``model.replace(pool=...)``;
    ``examples/vit_2d_mesh.py`` writes an attention pool.

    ``remat="full"`` wraps each block's call in ``jax.checkpoint`` (policy
    ``nothing_saveable``): less memory, one more forward pass per step; ``minishard.remat``
    has the other policies.

    >>> import jax
    >>> model = jax.eval_shape(lambda: ViT(key=jax.random.key(0)))   # shapes only: nothing drawn
    >>> len(model.blocks), model.blocks[0].attention.query.shape, model.head.weight.shape
    (4, (64, 4, 16), (64, 10))
    """

    param_fields = ("embedding", "blocks", "norm", "pool", "head")
    static_fields = ("remat",)

    def __init__(
        self,
        image_size: int = 28,
        patch_size: int = 7,
        channels: int = 1,
        width: int = 64,
        depth: int = 4,
        heads: int = 4,
        mlp_ratio: int = 2,
        classes: int = 10,
        *,
        key: jax.Array,
        remat: str = "none",
    ) -> None:
        check_key("ViT", key)
        if remat not in POLICIES:
            raise ValueError(f"ViT: remat must be a policy of {', '.join(POLICIES)}, got {remat!r}")
        keys = jax.random.split(key, depth + 2)  # one key per layer, as minishard.mlp does
        self.embedding = PatchEmbedding(image_size, patch_size, channels, width, key=keys[0])
        self.blocks = tuple(Block(width, heads, mlp_ratio * width, key=k) for k in keys[2:])
        self.norm = LayerNorm(width)
        self.pool: Any = MeanPool()  # any Layer [B, tokens, width] -> [B, width]
        self.head = Linear(width, classes, key=keys[1], scale=width**-0.5, axes=("embed", "classes"))
        self.remat = remat  # a policy of minishard.remat.POLICIES

    def __call__(self, images: jax.Array) -> jax.Array:
        x = apply_blocks(self.blocks, self.embedding(images), remat=self.remat)
        return self.head(self.pool(self.norm(x)))

    def param_logical_axes(self) -> dict[str, LogicalAxes]:
        return {}  # every parameter lives in a sub-layer, which answers for itself


def as_stacked(model: ViT) -> StackedModel:
    """The same ViT with its blocks stacked on a "stage" axis (``minishard.pipeline.stack``), for pp.

    The embedding runs before the stack and the norm, pool and head after it,
    outside the pipeline. Same parameters, same function (no remat).
    """
    return stack(model.embedding, model.blocks, Sequential([model.norm, model.pool, model.head]))


def stacked_vit(*args: Any, key: jax.Array, **kwargs: Any) -> StackedModel:
    """``as_stacked(ViT(*args, key=key, **kwargs))``: the ViT of the same seed, ready for a pipeline
    (``minishard train --model vit --parallel pp``).

    >>> model = jax.eval_shape(lambda: stacked_vit(key=jax.random.key(0)))
    >>> model.blocks.n, model.blocks.block.attention.query.shape
    (4, (4, 64, 4, 16))
    """
    return as_stacked(ViT(*args, key=key, **kwargs))


__all__ = [
    "Attention",
    "Block",
    "LayerNorm",
    "MeanPool",
    "PatchEmbedding",
    "ViT",
    "as_stacked",
    "stacked_vit",
    "vit_rules",
]
