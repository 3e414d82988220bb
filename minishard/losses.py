"""Losses and metrics for classification, in plain jax.numpy, and the shape of a ``Loss``.

Shapes, ranks and dtypes are known while tracing, so they are checked here at
no cost per step: a label array of the wrong shape would otherwise broadcast
into a silently wrong loss. Label *values* are only known on the device; the
datasets check theirs once, when they load, and for your own data ``one_hot``
has an opt-in checked mode (``checked=True``) that ``jax.experimental.checkify``
turns into a real error, under ``jit`` too:

>>> from jax.experimental import checkify
>>> loss = lambda logits, labels: cross_entropy(logits, one_hot(labels, 2, checked=True))
>>> error, _ = jax.jit(checkify.checkify(loss))(jnp.zeros((2, 2)), jnp.array([0, 5]))
>>> print(error.get())
one_hot: labels must lie in [0, 2), got values from 0 to 5 (`check` failed)

>>> logits = jnp.array([[2.0, 0.0], [0.0, 3.0]])
>>> float(accuracy(logits, jnp.array([0, 0])))
0.5

A training step differentiates a ``Loss``: ``loss(model, batch) -> (value, metrics)``, where
a ``Batch`` names its arrays.

>>> batch = {"image": logits, "label": jnp.array([0, 0])}
>>> loss, (acc,) = classification_loss(lambda image: image, batch)
>>> float(acc)
0.5
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import checkify

from minishard import _checks

__all__ = ["Batch", "Loss", "accuracy", "classification_loss", "cross_entropy", "one_hot"]

Batch = dict[str, Any]
"""Named arrays of one batch: ``{"image", "label"}`` for a classifier, ``{"inputs", "targets"}``
for a language model; numpy on the host (``minishard.run.data``), jax arrays once placed on the
mesh."""
Loss = Callable[[Any, Batch], tuple[jax.Array, tuple[jax.Array, ...]]]
"""``loss(model, batch) -> (value, metrics)``: the mean over the batch, and the scalar metrics
reported beside it (a tuple, maybe empty): what ``jax.value_and_grad(loss, has_aux=True)`` takes."""


def one_hot(labels: jax.Array, num_classes: int, *, checked: bool = False) -> jax.Array:
    """``labels`` (any shape, ints) -> float32 one-hot of shape ``labels.shape + (num_classes,)``.

    A label outside ``[0, num_classes)`` would give a row of zeros (and a wrong
    loss). ``checked=True`` adds a ``checkify.check`` on the values; run the
    function under ``checkify.checkify`` to get the error (see the module docstring).
    """
    labels = jnp.asarray(labels)
    _checks.one_hot(labels, num_classes)
    if checked:
        in_range = jnp.all((labels >= 0) & (labels < num_classes))
        bounds = f"one_hot: labels must lie in [0, {num_classes}),"
        message = bounds + " got values from {lo} to {hi}"
        checkify.check(in_range, message, lo=labels.min(), hi=labels.max())
    return (labels[..., None] == jnp.arange(num_classes)).astype(jnp.float32)


def cross_entropy(logits: jax.Array, targets_onehot: jax.Array) -> jax.Array:
    """Mean over the batch of ``-sum(targets * log_softmax(logits))``.

    ``log_softmax`` is ``logits - logsumexp(logits)``: ``logsumexp`` subtracts the max before
    exponentiating, so large logits never overflow. In float32, a bfloat16 model's logits too."""
    _checks.cross_entropy(logits, targets_onehot)
    logits = logits.astype(jnp.float32)
    log_probs = logits - jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    return -jnp.mean(jnp.sum(targets_onehot * log_probs, axis=-1))


def accuracy(logits: jax.Array, labels: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """Fraction in [0, 1] of rows whose largest logit is the label.

    ``mask`` (1 for real rows, 0 for padding) lets a padded last batch count
    only its real examples.
    """
    _checks.accuracy(logits, labels, mask)
    correct = (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)
    if mask is None:
        return jnp.mean(correct)
    return jnp.sum(correct * mask) / jnp.maximum(jnp.sum(mask), 1)


def classification_loss(model: Any, batch: Batch) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """Cross-entropy of ``model(batch["image"])`` against ``batch["label"]``, and the accuracy."""
    logits = model(batch["image"])
    labels = batch["label"]
    return cross_entropy(logits, one_hot(labels, logits.shape[-1])), (accuracy(logits, labels),)
