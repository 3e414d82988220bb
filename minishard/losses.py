"""Losses and metrics for classification, written out in plain jax.numpy.

>>> import jax.numpy as jnp
>>> logits = jnp.array([[2.0, 0.0], [0.0, 3.0]])
>>> float(accuracy(logits, jnp.array([0, 0])))
0.5
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def one_hot(labels: jax.Array, num_classes: int) -> jax.Array:
    """``labels`` (any shape, ints) -> float32 one-hot of shape ``labels.shape + (num_classes,)``."""
    return (jnp.asarray(labels)[..., None] == jnp.arange(num_classes)).astype(jnp.float32)


def cross_entropy(logits: jax.Array, targets_onehot: jax.Array) -> jax.Array:
    """Mean over the batch of ``-sum(targets * log_softmax(logits))``.

    ``log_softmax`` is ``logits - logsumexp(logits)``: ``logsumexp`` subtracts
    the max before exponentiating, so large logits never overflow.
    """
    log_probs = logits - jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    return -jnp.mean(jnp.sum(targets_onehot * log_probs, axis=-1))


def accuracy(logits: jax.Array, labels: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """Fraction in [0, 1] of rows whose largest logit is the label.

    ``mask`` (1 for real rows, 0 for padding) lets a padded last batch count
    only its real examples.
    """
    correct = (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)
    if mask is None:
        return jnp.mean(correct)
    return jnp.sum(correct * mask) / jnp.maximum(jnp.sum(mask), 1)
