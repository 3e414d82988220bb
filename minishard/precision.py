"""Mixed precision: a step's dtypes, fp16's loss scale, where the cast sits, and the gradients'
dtype.

This chapter is what a precision costs in numbers and in bytes sent; the next, ``minishard.memory``,
what it costs in bytes held:

1. **A step's dtypes.** A ``Precision`` names the dtype of each per-parameter array, of the
   ``DTYPES`` a number takes: the weights the step computes with (``compute`` casts to it),
   the gradients, a float32 master copy. ``FP32`` is minishard's default, ``MIXED`` the
   Playbook's mixed precision, ``BF16`` and ``FP16`` what ``train --precision`` runs
   (``PRECISIONS`` by flag).
2. **fp16 needs a loss scale.** float16 has 5 exponent bits: a gradient below
   6e-8 rounds to zero. Multiply the loss by a large ``scale`` before ``grad``,
   divide the gradients by it after, and the small ones survive; where the scale
   is too large a gradient overflows to inf, and the step is skipped, the scale
   halved. After ``period`` finite steps in a row the scale doubles again
   (dynamic loss scaling, Micikevicius et al. 2018; ``jmp.DynamicLossScale``'s
   defaults, which the tests drive step by step beside this one). bfloat16 keeps
   float32's 8 exponent bits and needs none of it. The state is a ``LossScale``
   (from ``INITIAL``; ``adjust`` doubles it after ``PERIOD`` finite steps by ``FACTOR``,
   halves it on an overflow, never below ``FLOOR``; ``all_finite`` tells which);
   ``scaled`` is the loss ``grad`` sees, and ``LossScaled`` the optimizer that
   unscales, its state a ``LossScaledState``.
3. **Where the cast sits under FSDP.** Cast each weight's shard to bfloat16, and
   the all-gather moves 2 bytes a number; gather the float32 weight first, and 4
   (levanter#426); ``gathered`` is that all-gather, said out loud. ``census.as_asked``
   reads a step's collectives as XLA's SPMD partitioner wrote them, before XLA:CPU
   widens bfloat16 ones to float32.
4. **In which dtype gradients are reduced.** Differentiated through the cast,
   a gradient leaves the backward pass in the compute dtype, and the partitioner
   all-reduces it there, whatever the optimizer wants after (jax#27496).
   ``reduced_in`` makes the reduction the step's own: each replica's gradients,
   cast to the dtype asked for, then summed over the ``replicas``.

>>> state = adjust(LossScale.start(), all_finite({"w": jnp.array([1.0, jnp.inf])}))
>>> float(state.scale), int(state.good)   # an overflow: halve the scale, count again from 0
(16384.0, 0)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from minishard import _checks, _checks_precision
from minishard.constraints import activation_axes, constrain, environment
from minishard.optim import Optimizer
from minishard.rules import AxisRules
from minishard.tree import cast_floating

# --- 1. a step's dtypes -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Precision:
    """The dtypes of a step's per-parameter arrays (``jmp``'s policy, seen from memory).

    ``params``: the weights the step computes with; ``grads``: the gradients as
    reduced; ``master``: a copy the optimizer updates, when ``params`` is lower
    (bfloat16 weights lose small updates); ``accumulated``: a copy of the gradients
    summed over microbatches (Megatron's "main grads"), when ``grads`` is lower.
    """

    params: str = "float32"
    grads: str = "float32"
    master: str | None = None
    accumulated: str | None = None

    def __post_init__(self) -> None:
        for name, dtype in dataclasses.asdict(self).items():
            allowed = (*DTYPES, None) if name in OPTIONAL else DTYPES
            _checks.one_of(f"Precision: {name}", dtype, allowed)
        _checks_precision.copies_as_wide(dataclasses.asdict(self))

    def compute(self, tree: Any) -> Any:
        """``tree`` as the step computes with it: every floating array in ``params``'s dtype (jmp's
        ``cast_to_compute``). Differentiated through, the gradients come back in the master's dtype.

        >>> BF16.compute({"w": jnp.ones(2, jnp.float32), "ids": jnp.ones(2, jnp.int32)})["w"].dtype
        dtype(bfloat16)
        """
        return cast_floating(tree, self.params)


DTYPES = ("float32", "bfloat16", "float16")
"""The dtypes a precision takes."""
OPTIONAL = ("master", "accumulated")
FP32 = Precision()
"""minishard's default: everything in float32, no copies."""
MIXED = Precision("bfloat16", "bfloat16", master="float32")
"""Mixed precision: bfloat16 weights and gradients, a float32 master copy (and float32 moments)."""
BF16 = Precision("bfloat16", "float32", master="float32")
"""What ``train --precision bf16`` runs: the float32 model is the master copy, cast to bfloat16 for
each step's forward and backward passes; its gradients come back (and are reduced) in float32."""
FP16 = Precision("float16", "float32", master="float32")
"""What ``train --precision fp16`` runs: BF16's policy in float16, whose 5 exponent bits need a loss
scale (``LossScaled``): the gradients of the scaled loss, reduced in float32."""
PRECISIONS = {"fp32": FP32, "bf16": BF16, "fp16": FP16}
"""The precisions ``--precision`` names."""

# --- 2. fp16: the dynamic loss scale ----------------------------------------------------------

# jmp's ``DynamicLossScale`` defaults:
INITIAL = 2.0**15
"""The scale to start at, 2^15."""
PERIOD = 2000
"""After this many finite steps in a row, the scale grows."""
FACTOR = 2.0
"""The scale doubles after ``PERIOD`` finite steps, and halves on an overflow."""
FLOOR = 1.0
"""The scale never falls below 1."""


class LossScale(NamedTuple):
    """The loss scale's state, a pytree: ``scale`` (float32), and ``good`` (int32), the finite
    steps since the scale last changed; sharded and saved with the optimizer's state it is in."""

    scale: jax.Array
    good: jax.Array

    @classmethod
    def start(cls, scale: float = INITIAL) -> LossScale:
        _checks_precision.loss_scale_start(scale)
        return cls(jnp.asarray(scale, jnp.float32), jnp.zeros((), jnp.int32))


def all_finite(tree: Any) -> jax.Array:
    """One boolean: is every number of every array in ``tree`` finite (no inf, no NaN)? A tree
    without arrays has none that is not: ``True``, as ``jmp.all_finite`` says."""
    each = [jnp.isfinite(leaf).all() for leaf in jax.tree.leaves(tree)]
    return jnp.stack([*each, True]).all()


def adjust(
    state: LossScale,
    finite: jax.Array,
    period: int = PERIOD,
    factor: float = FACTOR,
    floor: float = FLOOR,
) -> LossScale:
    """The next scale: halved (not below ``floor``) after an overflow, doubled after ``period``
    finite steps in a row (kept if doubling overflows float32), else the same.

    >>> state = LossScale.start(4.0)
    >>> for finite in (True, True, False, False, False, True):
    ...     state = adjust(state, jnp.array(finite), period=2)
    ...     print(float(state.scale), int(state.good))
    4.0 1
    8.0 0
    4.0 0
    2.0 0
    1.0 0
    1.0 1
    """
    _checks_precision.loss_scale("adjust", period, factor, floor)
    _checks_precision.scalar_bool("adjust: finite", finite)
    doubled = jnp.where(jnp.isfinite(state.scale * factor), state.scale * factor, state.scale)
    grown = jnp.where(state.good == period - 1, doubled, state.scale)
    shrunk = jnp.maximum(floor, state.scale / factor)
    scale = jnp.where(finite, grown, shrunk)
    good = jnp.where(finite, (state.good + 1) % period, 0).astype(jnp.int32)
    return LossScale(scale, good)


class LossScaledState(NamedTuple):
    """``inner``: the optimizer's own state; ``loss_scale``: the ``LossScale`` the step reads."""

    inner: Any
    loss_scale: LossScale


class LossScaled:
    """``optimizer`` behind a dynamic loss scale: an ``Optimizer`` whose state carries the scale.

    The train step multiplies the loss by ``state.loss_scale.scale`` before ``grad``;
    ``update`` takes those scaled gradients, unscales them, and where any is not finite
    returns ``params`` and the optimizer's state as they were (the step skipped, bit for
    bit) with the scale halved.

    >>> from minishard import SGD
    >>> opt = LossScaled(SGD(1.0))
    >>> state = opt.init({"w": 0.0})
    >>> params, state = opt.update({"w": jnp.array(1.0)}, {"w": jnp.array(jnp.inf)}, state)
    >>> float(params["w"]), float(state.loss_scale.scale), int(state.inner.step)
    (1.0, 16384.0, 0)
    """

    def __init__(
        self,
        optimizer: Optimizer,
        initial: float = INITIAL,
        period: int = PERIOD,
        factor: float = FACTOR,
    ) -> None:
        _checks_precision.optimizer("LossScaled: optimizer", optimizer)
        _checks.positive("LossScaled: initial", initial)
        _checks_precision.loss_scale("LossScaled", period, factor, FLOOR)
        self.optimizer = optimizer
        self.initial = initial
        self.period = period
        self.factor = factor
        self.learning_rate = optimizer.learning_rate

    def init(self, params: Any) -> LossScaledState:
        return LossScaledState(self.optimizer.init(params), LossScale.start(self.initial))

    def update(
        self, params: Any, grads: Any, state: LossScaledState, *, axis_name: str | None = None
    ) -> tuple[Any, LossScaledState]:
        """One step on the gradients of the scaled loss, or none where they overflowed."""
        _checks_precision.loss_scaled_state("LossScaled.update", state, LossScaledState)
        unscaled = jax.tree.map(lambda g: g * (1 / state.loss_scale.scale), grads)
        finite = all_finite(unscaled)
        stepped = self.optimizer.update(params, unscaled, state.inner, axis_name=axis_name)
        params, inner = jax.tree.map(
            lambda new, old: jnp.where(finite, new, old), stepped, (params, state.inner)
        )
        loss_scale = adjust(state.loss_scale, finite, self.period, self.factor)
        return params, LossScaledState(inner, loss_scale)


def scaled(loss: Callable[..., Any], scale: jax.Array) -> Callable[..., Any]:
    """``loss(model, batch) -> (value, aux)`` as ``grad`` should see it under fp16:
    ``(value * scale, (value, aux))``, the unscaled value kept in the aux for the record."""

    def scaled_loss(model: Any, batch: Any) -> tuple[jax.Array, Any]:
        value, aux = loss(model, batch)
        return value * scale, (value, aux)

    return scaled_loss


# --- 3. where the cast sits under FSDP ------------------------------------------------------


def gathered(tree: Any) -> Any:
    """Every array of ``tree`` constrained whole on each device: FSDP's all-gather, said out loud
    (inside ``Sharded``; elsewhere ``tree``). Cast after it, the gather moves float32."""
    return jax.tree.map(lambda x: constrain(x, (None,) * jnp.ndim(x)), tree)


# --- 4. in which dtype gradients are reduced ------------------------------------------------


def replicas() -> tuple[int, tuple[str, ...]]:
    """How many ways the ``Sharded`` step in effect splits its batch (its data-parallel
    replicas), and over which mesh axes; ``(1, ())`` outside one."""
    context = environment()
    target = None if context is None else context.batch_target
    axes = () if target is None else (target,) if isinstance(target, str) else tuple(target)
    n = math.prod(dict(context.mesh.shape)[axis] for axis in axes) if context else 1
    return n, axes


def reduced_in(dtype: str, value_and_grad: Callable[..., Any]) -> Callable[..., Any]:
    """``value_and_grad(model, batch)``, its gradients summed over the replicas in ``dtype``.

    Each replica's slice of the batch becomes one row of a ``vmap`` whose rows lie on
    the batch's mesh axes (``spmd_axis_name``; inside a row the batch is whole): each
    device computes its own gradients, nothing summed yet. The mean over rows, taken
    in ``dtype``, is the all-reduce, and the census reads it in ``dtype``. The values
    and metrics are means of equal slices: the same.
    """
    _checks.one_of("reduced_in: dtype", dtype, ("float32", "bfloat16", "float16"))

    def reduced(model: Any, batch: Any) -> Any:
        n, axes = replicas()
        context = environment()
        if context is None or n == 1:
            return value_and_grad(model, batch)  # one replica: nothing to reduce
        # inside a row, the rules without the rows' mesh axes
        rules = [(name, to) for name, to in context.rules.pairs if not set(axes) & _named(to)]
        in_a_row = dataclasses.replace(context, rules=AxisRules.from_pairs(rules))
        within = in_a_row.wrap(value_and_grad)
        rows = jax.tree.map(lambda x: x.reshape(n, -1, *x.shape[1:]), batch)
        out, grads = jax.vmap(within, in_axes=(None, 0), spmd_axis_name=axes)(model, rows)
        # one row per device
        row = lambda g: constrain(g.astype(dtype), activation_axes(g.ndim))  # noqa: E731
        mean = lambda g: (_sum_rows(row(g)) / n).astype(g.dtype)  # noqa: E731
        return jax.tree.map(lambda o: o.mean(0), out), jax.tree.map(mean, grads)

    return reduced


def _named(target: Any) -> set[str]:
    """The mesh axes a rule's target names: none, one, or a tuple of them."""
    return set() if target is None else {target} if isinstance(target, str) else set(target)


def _sum_rows(x: jax.Array) -> jax.Array:
    """The sum over the first axis in ``x``'s dtype (``jnp.sum`` adds bfloat16 in float32)."""
    return jax.lax.reduce(x, jnp.zeros((), x.dtype), jax.lax.add, (0,))


__all__ = [
    "BF16",
    "DTYPES",
    "FP16",
    "FP32",
    "MIXED",
    "PRECISIONS",
    "Precision",
    "FACTOR",
    "FLOOR",
    "INITIAL",
    "PERIOD",
    "LossScale",
    "LossScaled",
    "LossScaledState",
    "adjust",
    "all_finite",
    "gathered",
    "reduced_in",
    "replicas",
    "scaled",
]
