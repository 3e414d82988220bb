"""Stochastic gradient descent as pure functions over pytrees.

An optimizer is two pure functions, as in optax:

* ``state = opt.init(params)`` builds the optimizer's state, a pytree;
* ``params, state = opt.update(params, grads, state)`` takes one step.

(optax's ``update(grads, state, params)`` returns *updates* that
``optax.apply_updates`` adds to the params; minishard applies them itself, one
call per step. The numbers are the same: the tests check them against optax.)

Nothing is mutated and nothing happens on the side, so ``update`` can be
jitted, and the state can be sharded and checkpointed exactly like the
parameters. The momentum buffer has the parameters' own structure (it *is* a
model-shaped tree of velocities), so ``minishard.partition_specs`` shards it
like the model without being told.

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
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

Schedule = Callable[[jax.Array], jax.Array]


def exponential_decay(
    init_value: float, decay_rate: float, decay_steps: int, staircase: bool = False
) -> Schedule:
    """``schedule(step) = init_value * decay_rate ** (step / decay_steps)``.

    With ``staircase=True`` the exponent is floored, so the rate drops in steps
    every ``decay_steps`` updates instead of smoothly. Step 0 uses ``init_value``.
    """
    if decay_steps <= 0:
        raise ValueError(f"exponential_decay: decay_steps must be positive, got {decay_steps}")

    def schedule(step: jax.Array) -> jax.Array:
        exponent = jnp.asarray(step, jnp.float32) / decay_steps
        if staircase:
            exponent = jnp.floor(exponent)
        return init_value * jnp.power(decay_rate, exponent)

    return schedule


class SGDState(NamedTuple):
    """``step``: updates taken so far; ``momentum``: velocities shaped like params (None without momentum)."""

    step: jax.Array
    momentum: Any


class SGD:
    """Plain or momentum SGD: ``v = g + momentum * v``; ``p = p - lr(step) * v``.

    ``learning_rate`` is a float or a schedule such as ``exponential_decay``.
    The ``SGD`` object holds only configuration; everything that changes
    lives in the state, which is why ``update`` is safe to ``jax.jit``.
    """

    def __init__(self, learning_rate: float | Schedule, momentum: float = 0.0) -> None:
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"SGD: momentum must be in [0, 1), got {momentum}")
        self.learning_rate = learning_rate
        self.momentum = momentum

    def init(self, params: Any) -> SGDState:
        """Step 0 and, with momentum, zero velocities shaped (and later sharded) like ``params``."""
        velocity = jax.tree_util.tree_map(jnp.zeros_like, params) if self.momentum else None
        return SGDState(step=jnp.zeros((), jnp.int32), momentum=velocity)

    def update(self, params: Any, grads: Any, state: SGDState) -> tuple[Any, SGDState]:
        """One step: new params and state. Pure, so it runs inside a jitted train step."""
        lr = self.learning_rate(state.step) if callable(self.learning_rate) else self.learning_rate
        velocity = grads
        if self.momentum:
            velocity = jax.tree_util.tree_map(lambda g, v: g + self.momentum * v, grads, state.momentum)
        params = jax.tree_util.tree_map(lambda p, v: p - lr * v, params, velocity)
        return params, SGDState(state.step + 1, velocity if self.momentum else None)
