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

import math
import numbers
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp

Schedule = Callable[[jax.Array], jax.Array]


def _positive(where: str, value: Any) -> float:
    """A finite number > 0, or an error naming the argument: a negative rate would ascend."""
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(f"{where} must be a finite number > 0, got {value!r}")
    return float(value)


def exponential_decay(
    init_value: float, decay_rate: float, decay_steps: int, staircase: bool = False
) -> Schedule:
    """``schedule(step) = init_value * decay_rate ** (step / decay_steps)``.

    With ``staircase=True`` the exponent is floored, so the rate drops in steps
    every ``decay_steps`` updates instead of smoothly. Step 0 uses ``init_value``.
    A ``decay_rate`` above 1 grows the rate; one at or below 0 is refused.
    """
    init_value = _positive("exponential_decay: init_value", init_value)
    decay_rate = _positive("exponential_decay: decay_rate", decay_rate)
    if isinstance(decay_steps, bool) or not isinstance(decay_steps, int) or decay_steps <= 0:
        raise ValueError(f"exponential_decay: decay_steps must be a positive int, got {decay_steps!r}")

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
    peak_value = _positive("warmup_cosine_decay: peak_value", peak_value)
    for name, steps in (("warmup_steps", warmup_steps), ("decay_steps", decay_steps)):
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"warmup_cosine_decay: {name} must be an int >= 0, got {steps!r}")
    if decay_steps <= warmup_steps:
        raise ValueError(
            f"warmup_cosine_decay: decay_steps {decay_steps} must exceed warmup_steps {warmup_steps}"
        )

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
    (None without momentum); earlier versions called it ``momentum``, and their
    checkpoints still load.
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
        if not callable(learning_rate):
            learning_rate = _positive(
                "SGD: learning_rate (a number, or a callable of the step)", learning_rate
            )
        if isinstance(momentum, bool) or not isinstance(momentum, numbers.Real) or not 0.0 <= momentum < 1.0:
            raise ValueError(f"SGD: momentum must be a number in [0, 1), got {momentum!r}")
        self.learning_rate: float | Schedule = learning_rate
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
        _check_same_structure(params, grads)
        lr: float | jax.Array
        step: jax.Array | None
        if callable(self.learning_rate):
            if state.step is None:
                raise ValueError(
                    "SGD.update: this SGD's learning rate is a schedule, but the state has no step; "
                    "make the state with the same SGD's init"
                )
            lr, step = self.learning_rate(state.step), state.step + 1
        else:  # a step counter given is kept counting: the state leaves with the structure it came in
            lr, step = self.learning_rate, None if state.step is None else state.step + 1
        velocity = grads
        if self.momentum:
            velocity = jax.tree_util.tree_map(lambda g, v: g + self.momentum * v, grads, state.velocity)
        params = jax.tree_util.tree_map(lambda p, v: p - lr * v, params, velocity)
        return params, SGDState(step, velocity if self.momentum else None)


def _check_same_structure(params: Any, grads: Any) -> None:
    """Gradients must mirror the parameters; name the first place where they do not."""
    p_leaves, p_def = jax.tree_util.tree_flatten_with_path(params)
    g_leaves, g_def = jax.tree_util.tree_flatten_with_path(grads)
    p_def, g_def = cast(Any, p_def), cast(Any, g_def)  # PyTreeDef comes without type stubs
    if p_def == g_def and all(jnp.shape(p) == jnp.shape(g) for (_, p), (_, g) in zip(p_leaves, g_leaves)):
        return
    for (p_path, p), (g_path, g) in zip(p_leaves, g_leaves):
        if p_path != g_path or jnp.shape(p) != jnp.shape(g):
            where = jax.tree_util.keystr(p_path)
            raise ValueError(
                f"SGD.update: grads do not match params at params{where} (shape {jnp.shape(p)}): grads has "
                f"{jax.tree_util.keystr(g_path)} with shape {jnp.shape(g)}"
            )
    raise ValueError(
        f"SGD.update: grads have {len(g_leaves)} arrays, params {len(p_leaves)} (or other containers); "
        "compute grads with jax.grad with respect to the same params"
    )
