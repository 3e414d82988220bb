"""Stochastic gradient descent as pure functions over pytrees.

An optimizer is two pure functions, as in optax:

* ``state = opt.init(params)`` builds the optimizer's state, a pytree;
* ``params, state = opt.update(params, grads, state)`` takes one step.

(optax's ``update(grads, state, params)`` returns *updates* that
``optax.apply_updates`` adds to the params; minishard applies them itself, one
call per step. The numbers are the same: the tests check them against optax.)

Nothing is mutated and nothing happens on the side, so ``update`` can be
jitted, and the state can be sharded and checkpointed exactly like the
parameters. The velocity buffer has the parameters' own structure (it *is* a
model-shaped tree), so ``minishard.partition_specs`` shards it like the model
without being told.

>>> import jax.numpy as jnp
>>> opt = SGD(exponential_decay(0.1, decay_rate=0.5, decay_steps=1))
>>> params = {"w": jnp.array(1.0)}
>>> state = opt.init(params)
>>> params, state = opt.update(params, {"w": jnp.array(1.0)}, state)  # lr 0.1
>>> params, state = opt.update(params, {"w": jnp.array(1.0)}, state)  # lr 0.05
>>> round(float(params["w"]), 4), int(state.step)
(0.85, 2)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp

from minishard import _checks

__all__ = ["SGD", "SGDState", "Schedule", "exponential_decay", "warmup_cosine_decay"]

Schedule = Callable[[jax.Array], jax.Array]
"""A learning rate that changes: a function of the step (updates taken so far)."""


def exponential_decay(
    init_value: float, decay_rate: float, decay_steps: int, staircase: bool = False
) -> Schedule:
    """``schedule(step) = init_value * decay_rate ** (step / decay_steps)``.

    With ``staircase=True`` the exponent is floored, so the rate drops in steps
    every ``decay_steps`` updates instead of smoothly. Step 0 uses ``init_value``.
    A ``decay_rate`` above 1 grows the rate; one at or below 0 is refused.
    """
    init_value = _checks.positive("exponential_decay: init_value", init_value)
    decay_rate = _checks.positive("exponential_decay: decay_rate", decay_rate)
    _checks.decay_steps(decay_steps)

    def schedule(step: jax.Array) -> jax.Array:
        exponent = jnp.asarray(step, jnp.float32) / decay_steps
        if staircase:
            exponent = jnp.floor(exponent)
        return init_value * jnp.power(decay_rate, exponent)

    return schedule


def warmup_cosine_decay(
    peak_value: float, warmup_steps: int, decay_steps: int, end_value: float = 0.0
) -> Schedule:
    """Rise linearly from 0 to ``peak_value`` in ``warmup_steps``, then follow a cosine down to ``end_value``.

    The schedule transformers are usually trained with (optax's
    ``warmup_cosine_decay_schedule`` with ``init_value=0``): the warmup keeps the
    first, large and noisy gradients from throwing the attention weights far
    off; the cosine spends most steps at a high rate and lands softly.
    ``decay_steps`` counts the whole run, warmup included.

    >>> schedule = warmup_cosine_decay(1.0, warmup_steps=10, decay_steps=110)
    >>> [round(float(schedule(step)), 3) for step in (0, 5, 10, 60, 110)]
    [0.0, 0.5, 1.0, 0.5, 0.0]
    """
    peak_value = _checks.positive("warmup_cosine_decay: peak_value", peak_value)
    _checks.warmup_cosine(warmup_steps, decay_steps)

    def schedule(step: jax.Array) -> jax.Array:
        step = jnp.asarray(step, jnp.float32)
        warm = peak_value * step / max(warmup_steps, 1)
        progress = jnp.clip((step - warmup_steps) / (decay_steps - warmup_steps), 0.0, 1.0)
        cosine = end_value + (peak_value - end_value) * 0.5 * (1 + jnp.cos(jnp.pi * progress))
        return jnp.where(step < warmup_steps, warm, cosine)

    return schedule


class SGDState(NamedTuple):
    """Only what ``update`` reads, as in optax: nothing is carried for nothing.

    ``step``: updates taken so far, kept when the learning rate is a schedule
    (None for a constant rate: a counter nobody reads would still be one more
    array in and out of every jitted step). ``velocity``: shaped like params
    (None without momentum).
    """

    step: jax.Array | None
    velocity: Any


class SGD:
    """Plain or momentum SGD: ``v = g + momentum * v``; ``p = p - lr(step) * v``.

    ``learning_rate`` is a float or a schedule such as ``exponential_decay``.
    The ``SGD`` object holds only configuration; everything that changes
    lives in the state, which is why ``update`` is safe to ``jax.jit``.
    """

    def __init__(self, learning_rate: float | Schedule, momentum: float = 0.0) -> None:
        self.learning_rate: float | Schedule = _checks.learning_rate(learning_rate)
        _checks.momentum(momentum)
        self.momentum: float = float(momentum)

    def init(self, params: Any) -> SGDState:
        """Step 0 for a schedule and, with momentum, zero velocities shaped (and sharded) like ``params``."""
        step = jnp.zeros((), jnp.int32) if callable(self.learning_rate) else None
        velocity = jax.tree_util.tree_map(jnp.zeros_like, params) if self.momentum else None
        return SGDState(step=step, velocity=velocity)

    def update(self, params: Any, grads: Any, state: SGDState) -> tuple[Any, SGDState]:
        """One step: new params and state. Pure, so it runs inside a jitted train step.

        The schedule is evaluated at ``state.step`` *before* it is incremented,
        so the first update (step 0) uses the schedule's initial value, as in optax.
        """
        _checks.sgd_update(self, params, grads, state)  # a state made by this SGD's init; grads like params
        lr: float | jax.Array
        step: jax.Array | None = None
        if callable(self.learning_rate):
            step = cast(jax.Array, state.step)  # a schedule's state has a step: checked above
            lr, step = self.learning_rate(step), step + 1
        else:
            lr = self.learning_rate
        velocity = grads
        if self.momentum:
            velocity = jax.tree_util.tree_map(lambda g, v: g + self.momentum * v, grads, state.velocity)
        params = jax.tree_util.tree_map(lambda p, v: p - lr * v, params, velocity)
        return params, SGDState(step, velocity if self.momentum else None)
