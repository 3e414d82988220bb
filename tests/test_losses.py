"""Losses and metrics: ``one_hot``, ``cross_entropy`` and ``accuracy``.

``jax.nn.one_hot`` and ``optax.softmax_cross_entropy`` are the oracles;
``accuracy`` is checked against the same fraction computed in NumPy.
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.strategies import composite
from named import assert_named
from strategies import dims, seeds

from minishard import accuracy, cross_entropy, one_hot


@composite
def classification_batches(draw):
    """(logits, labels, mask) for a random batch: float32 logits, int labels, 0/1 mask."""
    batch, classes = draw(dims), draw(st.integers(2, 4))
    rng = np.random.default_rng(draw(seeds))
    scale = draw(st.sampled_from([0.1, 1.0, 30.0]))
    logits = (scale * rng.standard_normal((batch, classes))).astype(np.float32)
    labels = rng.integers(0, classes, batch).astype(np.int32)
    mask = rng.integers(0, 2, batch).astype(np.float32)
    return logits, labels, mask


@partial(jax.jit, static_argnums=1)
def both_one_hots(labels, classes):
    return one_hot(labels, classes), jax.nn.one_hot(labels, classes)


@given(shape=st.lists(dims, max_size=2).map(tuple), classes=dims, seed=seeds)
def test_one_hot_matches_jax_nn(shape, classes, seed):
    labels = np.random.default_rng(seed).integers(-1, classes + 1, shape)  # includes out-of-range labels
    ours, expected = both_one_hots(labels, classes)
    assert ours.shape == (*shape, classes) and ours.dtype == jnp.float32
    np.testing.assert_array_equal(ours, expected)


def test_one_hot_rows():
    np.testing.assert_array_equal(one_hot(jnp.array([2, 0]), 3), [[0, 0, 1], [1, 0, 0]])


@jax.jit
def both_cross_entropies(logits, labels):
    targets = one_hot(labels, logits.shape[-1])
    return cross_entropy(logits, targets), optax.softmax_cross_entropy(logits, targets).mean()


@given(batch=classification_batches())
def test_cross_entropy_matches_optax(batch):
    logits, labels, _ = batch
    ours, expected = both_cross_entropies(logits, labels)
    np.testing.assert_allclose(ours, expected, rtol=1e-6, atol=1e-6)


def test_cross_entropy_known_values_and_large_logits():
    uniform = jnp.zeros((3, 4))
    np.testing.assert_allclose(cross_entropy(uniform, one_hot(jnp.array([0, 1, 3]), 4)), np.log(4), rtol=1e-6)
    huge = jnp.array([[1e4, -1e4], [-1e4, 1e4]])
    np.testing.assert_array_equal(cross_entropy(huge, one_hot(jnp.array([0, 1]), 2)), 0.0)
    np.testing.assert_allclose(cross_entropy(huge, one_hot(jnp.array([1, 1]), 2)), 1e4, rtol=1e-6)


@given(batch=classification_batches())
def test_accuracy_is_the_fraction_of_correct_rows(batch):
    logits, labels, mask = batch
    correct = logits.argmax(axis=-1) == labels
    value = float(accuracy(logits, labels))
    assert 0.0 <= value <= 1.0
    np.testing.assert_allclose(value, correct.mean(), rtol=1e-6)
    masked = correct[mask == 1].mean() if mask.any() else 0.0
    np.testing.assert_allclose(float(accuracy(logits, labels, mask)), masked, rtol=1e-6)


@pytest.mark.parametrize(
    ("mask", "expected"), [(None, 0.5), ([1.0, 0.0], 1.0), ([0.0, 1.0], 0.0), ([0.0, 0.0], 0.0)]
)
def test_accuracy_with_a_padding_mask(mask, expected):
    logits = jnp.array([[2.0, 0.0], [0.0, 3.0]])
    mask = None if mask is None else jnp.array(mask)
    assert float(accuracy(logits, jnp.array([0, 0]), mask)) == expected


# -- bad inputs: each named before any work starts (the call, the exception, words its message holds)
BAD_INPUTS = [
    (lambda: one_hot(jnp.array([0.0, 1.0]), 3), TypeError, ["labels must be integers", "float32"]),
    (lambda: one_hot(jnp.array([0, 1]), 0), ValueError, ["num_classes must be a positive int", "0"]),
    (
        lambda: cross_entropy(jnp.zeros((4, 3)), jnp.zeros((4, 1))),
        ValueError,
        ["(4, 3)", "(4, 1)", "one_hot"],
    ),
    (
        lambda: accuracy(jnp.zeros((4, 3)), jnp.zeros((4, 1), jnp.int32)),
        ValueError,
        ["labels (4, 1)", "(4,)"],
    ),
    (lambda: accuracy(jnp.zeros((4, 3)), jnp.zeros(4, jnp.int32), jnp.ones(3)), ValueError, ["mask (3,)"]),
]


@pytest.mark.parametrize(("call", "kind", "words"), BAD_INPUTS)
def test_bad_input_is_named(call, kind, words):
    assert_named(call, kind, words)


def test_the_checked_mode_catches_label_values_under_jit():
    from jax.experimental import checkify

    def loss(logits, labels):
        return cross_entropy(logits, one_hot(labels, 3, checked=True))

    checked = jax.jit(checkify.checkify(loss))
    error, _ = checked(jnp.zeros((2, 3)), jnp.array([0, 2]))
    assert error.get() is None
    error, _ = checked(jnp.zeros((2, 3)), jnp.array([-1, 7]))
    assert "labels must lie in [0, 3), got values from -1 to 7" in error.get()
    assert np.isfinite(float(loss(jnp.zeros((2, 3)), jnp.array([0, 2]))))  # unchecked: no checkify needed
