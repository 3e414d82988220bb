"""Training a language model on the next token: its loss, its evaluation, and the chunk order of a batch.

The GPT (``minishard.models.gpt``) is the model; what it is trained to do lives
here, on the run side, as nanoGPT keeps its model file apart from ``train.py``:

* ``in_chunk_order``: where the rules split attention's "seq" over p devices
  (``cp``, ``dp+cp``), every ``[B, T]`` array of a batch is dealt out zig-zag and the
  model reads the tokens' positions; elsewhere the batch is as given;
* ``next_token_loss``: a ``minishard.losses.Loss``, the cross-entropy of every next
  token (nats per token) and its accuracy; ``make_train_step(optimizer, next_token_loss)``
  (``minishard.run.steps``) is the GPT's step under every style, ``zero_train_step``'s too;
* ``next_token_sums``: what an evaluation adds up over a split's padded batches.

Any model is called through ``collect(MoEStats, ...)`` (``minishard.layers``): a model of ``MoE`` MLPs
reports their ``MoEStats`` beside its logits, and the loss adds their auxiliary losses, an
evaluation the share of routings dropped; a dense one reports None.

>>> import jax, numpy as np
>>> from minishard.models.gpt import GPT
>>> model = GPT(vocab=5, context=8, width=16, depth=1, heads=2, key=jax.random.key(0))
>>> ids = np.zeros((2, 9), np.int32)
>>> batch = {"inputs": ids[:, :-1], "targets": ids[:, 1:]}
>>> loss, (accuracy,) = jax.jit(next_token_loss)(model, batch)   # one program, as a step runs it
>>> bool(loss > 0), bool(0 <= accuracy <= 1)
(True, True)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from minishard.context import held_order
from minishard.experts import MoEStats
from minishard.layers import collect
from minishard.losses import Batch, accuracy, cross_entropy, one_hot
from minishard.models.attention import CHUNK_ORDER, sequence_axis

__all__ = ["in_chunk_order", "next_token_loss", "next_token_sums"]


def in_chunk_order(model: Any, batch: Batch) -> tuple[Callable[..., Any], Batch]:
    """``model`` and ``batch`` as the devices hold the sequence, where the rules split attention's "seq".

    Over p devices, every ``[B, T]`` array of the batch is dealt out in ``CHUNK_ORDER``
    (``minishard.context.permute``: zig-zag) and the model reads the tokens' positions, so its
    position embeddings and causal mask follow them. A mean over tokens does not see their
    order: the loss and its gradients are those of the sequence in order. Elsewhere: as given.
    """
    _, p = sequence_axis()
    if p == 1:
        return model, batch
    positions = held_order(batch["inputs"].shape[1], p, CHUNK_ORDER)  # once, on the data
    dealt = {name: jnp.take(x, positions, axis=1) if jnp.ndim(x) == 2 else x for name, x in batch.items()}
    return functools.partial(model, positions=positions), dealt


def next_token_loss(model: Any, batch: Batch, key: Any = None) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """Cross-entropy of every next token (nats per token), and the fraction guessed right: a ``Loss``.

    A GPT of MoE MLPs (``transformer.moe_mlp``) adds their auxiliary losses, ``stats.aux_loss``.
    ``key``: the step's, given by a train step that draws dropout (``make_train_step(..., seed=)``).
    """
    held, batch = in_chunk_order(model, batch)
    held = held if key is None else functools.partial(held, key=key)
    logits, stats = collect(MoEStats, held)(batch["inputs"])
    loss = cross_entropy(logits, one_hot(batch["targets"], logits.shape[-1]))
    return loss if stats is None else loss + stats.aux_loss, (accuracy(logits, batch["targets"]),)


def next_token_sums(model: Any, batch: Batch) -> dict[str, jax.Array]:
    """The summed loss of the real windows of a (possibly padded) batch, how many are real (``count``),
    and with MoE MLPs the share of routings their capacity dropped (``dropped``, times ``count``)."""
    held, batch = in_chunk_order(model, batch)
    logits, stats = collect(MoEStats, held)(batch["inputs"])
    per_window = jax.vmap(lambda lg, t: cross_entropy(lg, one_hot(t, lg.shape[-1])))(logits, batch["targets"])
    sums = {"loss": (per_window * batch["mask"]).sum(), "count": batch["mask"].sum()}
    if stats is None:  # dense MLPs (or stacked for a pipeline): nothing routed
        return sums
    return sums | {"dropped": stats.dropped / stats.routed * sums["count"]}
