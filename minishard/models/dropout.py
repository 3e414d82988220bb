"""Dropout, nanoGPT's: in training, each entry zeroed with probability ``rate``, the rest scaled up.

A GPT (``minishard.models.gpt``) of ``dropout=p`` drops in nanoGPT's places, and only in a call
given a key (a training step's): evaluation and decoding pass none and drop nothing.

* after the embeddings (tokens + positions), ``[B, T, width]``;
* on the attention weights, the softmax's probabilities ``[B, heads, T, T]`` (``context.attend``'s
  ``dropped``): the dense core's only; another core (a ring) never holds them whole, and refuses a key;
* on each residual branch before its add: the attention's output projection and the MLP's output.

Each draw has a key a learner can follow: the step's (``fold_in(key(seed), step)``,
``minishard.run.steps``), then ``fold_in`` of the layer (0: the embeddings, block i: i + 1), then of
the place in the block (``PLACES``). Nothing random is stored: a resumed run draws a straight run's
masks. A mask (``keeps``) is drawn on the array's *global* shape, two neighbouring entries from each
32-bit draw; JAX's threefry is partitionable
(``jax_threefry_partitionable``), so each device draws its own shard of the same mask, and every
layout (dp, fsdp, tp) drops the same entries.

>>> import jax, jax.numpy as jnp
>>> x = jnp.ones((2, 1000))
>>> dropped = dropout(x, 0.25, jax.random.key(0))
>>> sorted({round(value, 4) for value in dropped.ravel().tolist()})   # zeroed, or scaled by 1 / (1 - 0.25)
[0.0, 1.3333]
>>> dropout(x, 0.25, None) is x, dropout(x, 0.0, jax.random.key(0)) is x   # no key or no rate: x
(True, True)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["EMBEDDINGS", "PLACES", "dropout", "keeps", "key_at"]

EMBEDDINGS = 0
"""The embeddings' layer number; block i is layer i + 1."""
PLACES = {"attention weights": 0, "attention out": 1, "mlp out": 2}
"""Where a block drops, each place's number: its key is ``fold_in(layer's key, number)``."""


def dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
    """``x``, each entry zeroed with probability ``rate``, the rest divided by ``1 - rate``: its mean kept.

    No key (evaluation, decoding) or a rate of 0: ``x`` itself, not one random op in the program.
    """
    if key is None or rate == 0:
        return x
    kept = keeps(key, rate, x.shape)  # the global shape: the same mask in every layout
    return jnp.where(kept, x / (1 - rate), jnp.zeros_like(x))


def keeps(key: jax.Array, rate: float, shape: tuple[int, ...]) -> jax.Array:
    """A mask of ``shape``, each entry False with probability ``rate`` (to 1 / 2**16), from half
    the random draws.

    ``jax.random.bernoulli`` spends a whole 32-bit threefry draw on each entry; a drop needs 16
    bits. So each 32-bit draw decides two neighbours along the last axis, its high and its low half: half
    the threefry work, which is most of dropout's time on a TPU (the attention weights' mask is
    ``[batch, heads, T, T]``). Entry ``j`` of a row reads half ``j % 2`` of draw ``j // 2``, a pure
    function of its global index, so the mask is still the same in every layout.
    """
    *rows, last = shape
    words = jax.random.bits(key, (*rows, (last + 1) // 2), jnp.uint32)
    halves = jnp.stack([words >> 16, words & 0xFFFF], axis=-1).reshape(*rows, -1)[..., :last]
    return halves >= round(rate * 2**16)


def key_at(key: jax.Array | None, *path: int | jax.Array) -> jax.Array | None:
    """``fold_in(fold_in(key, path[0]), path[1]) ...``: a layer's key, a place's; None stays None."""
    for number in path:
        key = None if key is None else jax.random.fold_in(key, number)
    return key
