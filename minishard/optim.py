"""Optimizers as pure functions over pytrees: SGD, and AdamW for transformers.

An optimizer is two pure functions, as in optax:

* ``state = opt.init(params)`` builds the optimizer's state, a pytree;
* ``params, state = opt.update(params, grads, state)`` takes one step.

Anything with these two functions and a ``learning_rate`` is an ``Optimizer``: ``SGD``
carries an ``SGDState`` (the step, a velocity), ``AdamW`` an ``AdamWState`` (the step, two
moments), and only ``weight_decay_mask``'s matrices decay, after ``global_norm`` clips. A
``LearningRate`` is a function of the step: ``exponential_decay``, ``warmup_cosine_decay``.

(optax's ``update(grads, state, params)`` returns *updates* that
``optax.apply_updates`` adds to the params; minishard applies them itself, one
call per step. The numbers are the same: the tests check them against optax.)

Nothing is mutated and nothing happens on the side, so ``update`` can be
jitted, and the state can be sharded and checkpointed exactly like the
parameters. The velocity buffer has the parameters' own structure (it *is* a
model-shaped tree), so ``minishard.partition_specs`` shards it like the model
without being told. AdamW keeps two such trees (its moments): 8 bytes per
parameter beside the 4 of the weights, which is why sharding them pays.

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
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp

from minishard import _checks
from minishard.layers import Layer
from minishard.tree import path_str

__all__ = [
    "SGD",
    "AdamW",
    "AdamWState",
    "LearningRate",
    "Optimizer",
    "SGDState",
    "exponential_decay",
    "global_norm",
    "warmup_cosine_decay",
    "weight_decay_mask",
]

LearningRate = Callable[[jax.Array], jax.Array]
"""A learning rate that changes: a function of the step (updates taken so far)."""


def exponential_decay(
    init_value: float, decay_rate: float, decay_steps: int, staircase: bool = False
) -> LearningRate:
    """``rate(step) = init_value * decay_rate ** (step / decay_steps)``.

    With ``staircase=True`` the exponent is floored, so the rate drops in steps
    every ``decay_steps`` updates instead of smoothly. Step 0 uses ``init_value``.
    A ``decay_rate`` above 1 grows the rate; one at or below 0 is refused.
    """
    _checks.positive("exponential_decay: init_value", init_value)
    _checks.positive("exponential_decay: decay_rate", decay_rate)
    _checks.count("exponential_decay: decay_steps", decay_steps)
    init_value = float(init_value)
    decay_rate = float(decay_rate)

    def rate(step: jax.Array) -> jax.Array:
        exponent = jnp.asarray(step, jnp.float32) / decay_steps
        if staircase:
            exponent = jnp.floor(exponent)
        return init_value * jnp.power(decay_rate, exponent)

    return rate


def warmup_cosine_decay(
    peak_value: float, warmup_steps: int, decay_steps: int, end_value: float = 0.0
) -> LearningRate:
    """Rise linearly from 0 to ``peak_value`` in ``warmup_steps``, then follow a cosine down to
    ``end_value``.

    The learning rate transformers are usually trained with (optax's
    ``warmup_cosine_decay_schedule`` with ``init_value=0``): the warmup keeps the
    first, large and noisy gradients from throwing the attention weights far
    off; the cosine spends most steps at a high rate and lands softly.
    ``decay_steps`` counts the whole run, warmup included.

    >>> rate = warmup_cosine_decay(1.0, warmup_steps=10, decay_steps=110)
    >>> [round(float(rate(step)), 3) for step in (0, 5, 10, 60, 110)]
    [0.0, 0.5, 1.0, 0.5, 0.0]
    """
    _checks.positive("warmup_cosine_decay: peak_value", peak_value)
    _checks.warmup_cosine(warmup_steps, decay_steps, peak_value, end_value)
    peak_value = float(peak_value)

    def rate(step: jax.Array) -> jax.Array:
        step = jnp.asarray(step, jnp.float32)
        warm = peak_value * step / max(warmup_steps, 1)
        progress = jnp.clip((step - warmup_steps) / (decay_steps - warmup_steps), 0.0, 1.0)
        cosine = end_value + (peak_value - end_value) * 0.5 * (1 + jnp.cos(jnp.pi * progress))
        return jnp.where(step < warmup_steps, warm, cosine)

    return rate


class SGDState(NamedTuple):
    """Only what ``update`` reads, as in optax: nothing is carried for nothing.

    ``step``: updates taken so far, an int32 scalar, for a constant rate too (then
    only a counter: "the state starts at step 0" holds for every SGD, and a resumed
    run knows where it stands). ``velocity``: shaped like params (None without momentum).
    """

    step: jax.Array
    velocity: Any


class SGD:
    """Plain or momentum SGD: ``v = g + momentum * v``; ``p = p - lr(step) * v``.

    ``learning_rate`` is a float or a ``LearningRate`` such as ``exponential_decay(...)``.
    The ``SGD`` object holds only configuration; everything that changes
    lives in the state, which is why ``update`` is safe to ``jax.jit``.
    """

    def __init__(self, learning_rate: float | LearningRate, momentum: float = 0.0) -> None:
        _checks.learning_rate(learning_rate)
        _checks.momentum(momentum)
        rate = learning_rate if callable(learning_rate) else float(learning_rate)
        self.learning_rate: float | LearningRate = rate
        self.momentum: float = float(momentum)

    def init(self, params: Any) -> SGDState:
        """Step 0; with momentum, zero velocities shaped (and sharded) like ``params``."""
        velocity = jax.tree_util.tree_map(jnp.zeros_like, params) if self.momentum else None
        return SGDState(step=jnp.zeros((), jnp.int32), velocity=velocity)

    def update(
        self, params: Any, grads: Any, state: SGDState, *, axis_name: str | None = None
    ) -> tuple[Any, SGDState]:
        """One step: new params and state. Pure, so it runs inside a jitted train step.

        The learning rate is evaluated at ``state.step`` *before* it is incremented,
        so the first update (step 0) uses its initial value, as in optax.
        ``axis_name`` is AdamW's (its clipping reads every piece); each SGD element steps on its
        own.
        """
        # a state from this SGD's init, the grads shaped alike
        _checks.sgd_update(self, params, grads, state, path_str)
        lr = self.learning_rate(state.step) if callable(self.learning_rate) else self.learning_rate
        velocity = grads
        if self.momentum:
            carried = lambda g, v: g + self.momentum * v  # noqa: E731
            velocity = jax.tree_util.tree_map(carried, grads, state.velocity)
        params = jax.tree_util.tree_map(lambda p, v: p - lr * v, params, velocity)
        return params, SGDState(state.step + 1, velocity if self.momentum else None)


# --- AdamW --------------------------------------------------------------------


def global_norm(tree: Any, axis_name: str | None = None) -> jax.Array:
    """``sqrt(sum of every element squared)`` over the whole tree, as one vector's length.

    ``axis_name``: inside ``jax.shard_map``, where each device holds its own
    piece of the tree (ZeRO's shards), the squares are summed over that mesh axis too.

    >>> float(global_norm({"a": jnp.array([3.0]), "b": jnp.array([[4.0]])}))
    5.0
    """
    squares = sum(jnp.sum(jnp.square(leaf)) for leaf in jax.tree.leaves(tree))
    return jnp.sqrt(jax.lax.psum(squares, axis_name) if axis_name else squares)


def weight_decay_mask(params: Any) -> Any:
    """``params`` with ``True`` for each matrix, ``False`` for each vector: which parameters decay.

    A Layer's parameter is a matrix if its layer annotates it with two or more
    logical axes; an array outside Layers, if it has two or more dimensions
    (beyond a stack's leading ones). Biases and norms' scales shift and scale;
    pulling them toward 0 only hurts (nanoGPT decays 2-D tensors only). Logical
    axes survive where ranks do not: under a pipeline a bias is ``[stage,
    features]``, under ZeRO every array is flat. The walk is ``plan``'s: a
    ``Stacked`` block's arrays lead with the axes its stack names.

    >>> from minishard.layers import Linear
    >>> mask = weight_decay_mask(Linear(3, 2, key=jax.random.key(0)))
    >>> mask.weight, mask.bias
    (True, False)
    """
    return _decays(params, ())


def _decays(tree: Any, leading: tuple[Any, ...]) -> Any:
    """The mask of ``tree``, whose arrays lead with ``leading`` logical axes (a stack's)."""

    def mask_of(node: Any) -> Any:
        if not isinstance(node, Layer):
            return jnp.ndim(node) - len(leading) >= 2
        axes = node.param_logical_axes()
        children, aux_data = node.tree_flatten()
        masks = [
            len(axes[name]) >= 2
            if name in axes and hasattr(child, "shape")
            else _decays(child, (*leading, *axes.get(name, ())))
            for name, child in zip(node.param_fields, children)
        ]
        return type(node).tree_unflatten(aux_data, masks)

    return jax.tree.map(mask_of, tree, is_leaf=lambda x: isinstance(x, Layer))


class AdamWState(NamedTuple):
    """``step``: updates taken so far (the bias corrections and a learning rate read it); ``mu``,
    ``nu``: the running means of the gradients and of their squares, each shaped like params."""

    step: jax.Array
    mu: Any
    nu: Any


class AdamW:
    """Adam with decoupled weight decay (Loshchilov & Hutter, 2019) and gradient clipping:
    nanoGPT's.

    One step: if the gradients' ``global_norm`` exceeds ``clip_norm``, all of
    them shrink by one factor to that norm. Then, per element,
    ``mu = b1 mu + (1 - b1) g``, ``nu = b2 nu + (1 - b2) g²``, and
    ``p = p - lr(step) (mu_hat / (sqrt(nu_hat) + eps) + weight_decay p)``, with
    ``mu_hat = mu / (1 - b1^(step + 1))`` (the same for ``nu``): the moments start
    at 0, and this undoes their pull toward it. Each parameter moves by about
    ``lr`` whatever its gradient's scale. The decay is *decoupled*: added to the
    step, not to the gradient, so Adam's scaling does not shrink it; and only
    matrices decay (``weight_decay_mask``). ``b2 = 0.99``: nanoGPT's for tiny_shakespeare.

    >>> opt = AdamW(0.1, weight_decay=0.0)
    >>> state = opt.init({"w": 0.0})
    >>> params, state = opt.update({"w": jnp.array(1.0)}, {"w": jnp.array(50.0)}, state)
    >>> round(float(params["w"]), 4), int(state.step)   # the first step is lr, whatever g is
    (0.9, 1)
    """

    def __init__(
        self,
        learning_rate: float | LearningRate,
        b1: float = 0.9,
        b2: float = 0.99,
        eps: float = 1e-8,
        weight_decay: float = 0.1,
        clip_norm: float | None = 1.0,
    ) -> None:
        _checks.learning_rate(learning_rate, "AdamW")
        _checks.adamw(b1, b2, eps, weight_decay, clip_norm)
        rate = learning_rate if callable(learning_rate) else float(learning_rate)
        self.learning_rate: float | LearningRate = rate
        self.b1 = float(b1)
        self.b2 = float(b2)
        self.eps = float(eps)
        self.weight_decay = float(weight_decay)
        self.clip_norm = None if clip_norm is None else float(clip_norm)

    def init(self, params: Any) -> AdamWState:
        """Step 0 and two trees of zeros shaped (and sharded) like ``params``: two, not one twice,
        or a step that donates its state would be handed the same buffers twice."""
        mu, nu = (jax.tree_util.tree_map(jnp.zeros_like, params) for _ in range(2))
        return AdamWState(jnp.zeros((), jnp.int32), mu, nu)

    def update(
        self, params: Any, grads: Any, state: AdamWState, *, axis_name: str | None = None
    ) -> tuple[Any, AdamWState]:
        """One step; ``axis_name`` (in ``shard_map``): the mesh axis the gradients are split on."""
        _checks.adamw_update(params, grads, state, path_str)
        b1 = self.b1
        b2 = self.b2
        step = state.step
        if self.clip_norm is not None:
            norm = global_norm(grads, axis_name)
            limit = self.clip_norm
            grads = jax.tree.map(lambda g: jnp.where(norm < limit, g, g / norm * limit), grads)
        mu = jax.tree.map(lambda m, g: (1 - b1) * g + b1 * m, state.mu, grads)
        nu = jax.tree.map(lambda v, g: (1 - b2) * jnp.square(g) + b2 * v, state.nu, grads)
        lr = self.learning_rate(step) if callable(self.learning_rate) else self.learning_rate
        # the bias corrections
        mu_fix = 1 - b1 ** (step + 1)
        nu_fix = 1 - b2 ** (step + 1)

        def adamw(p: jax.Array, m: jax.Array, v: jax.Array, decays: bool) -> jax.Array:
            direction = (m / mu_fix) / (jnp.sqrt(v / nu_fix) + self.eps)
            return p - lr * (direction + self.weight_decay * p if decays else direction)

        params = jax.tree.map(adamw, params, mu, nu, weight_decay_mask(params))
        return params, AdamWState(step + 1, mu, nu)


class Optimizer(Protocol):
    """What a training step takes, as in optax: two pure functions and the learning rate.

    ``SGD`` and ``AdamW`` are two; so is any object with the same three names.
    ``minishard.zero`` passes ``axis_name``: the mesh axis the gradients are split over.
    """

    learning_rate: Any  # a float, or a LearningRate of the step (drawn by --plot)

    def init(self, params: Any) -> Any: ...

    def update(
        self, params: Any, grads: Any, state: Any, *, axis_name: str | None = None
    ) -> tuple[Any, Any]: ...
