"""Where activations live: pin an intermediate array's layout by its logical axes.

``Sharded`` gives every *parameter* and every *input* a sharding; everything
computed in between is left to XLA's sharding propagation, which guesses each
intermediate's layout from its neighbours. Usually it guesses well. When it
does not (with FSDP, say, it may split a hidden activation over "data" along
the wrong dimension and then pay all-to-alls and all-gathers to fix it up),
``constrain`` says where an activation must live, in the model's own
vocabulary, as Flax's ``with_logical_constraint`` and MaxText do:

    y = constrain(x @ w, ("batch", "mlp"))

The mesh and the rules come from the surrounding ``Sharded`` call, which sets
them (``logical_sharding``) while it traces. Outside such a context ``constrain``
returns ``x`` unchanged, so the same model still runs on one device, or under a
plain ``jax.jit``. Inside one, it lowers to ``jax.lax.with_sharding_constraint``
on an Auto mesh, and to ``jax.sharding.reshard`` on an Explicit one.

On an Explicit mesh a matmul that contracts a split dimension (the second
Linear of a Megatron pair) is ambiguous, and JAX asks for its output sharding;
``output_sharding`` gives it from the layer's logical axes and the rules, which
is how minishard's ``Linear`` runs unchanged in both modes.

>>> import jax.numpy as jnp
>>> constrain(jnp.ones((4, 8)), ("batch", "embed")).shape    # no context: nothing to do
(4, 8)
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from minishard.rules import AxisRules, LogicalAxes, MeshAxes, ShardingError

DEFAULT_BATCH_AXIS = "batch"
"""The logical axis of a batch's leading dimension, unless ``Sharded(batch_axis=...)`` names another."""


@dataclass(frozen=True)
class LogicalSharding:
    """The mesh and rules in effect, and where the batch goes (``Sharded`` always knows that)."""

    mesh: Mesh
    rules: AxisRules
    batch_axis: str = DEFAULT_BATCH_AXIS
    batch_target: MeshAxes = None

    @property
    def explicit(self) -> bool:
        """Explicit mesh axes: shardings are part of every array's type (``jax.typeof``)."""
        return any(kind == AxisType.Explicit for kind in self.mesh.axis_types)

    def sharding(self, logical_axes: LogicalAxes) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(logical_axes))

    def spec(self, logical_axes: LogicalAxes) -> PartitionSpec:
        """The rules' spec, with the batch axis sent where ``Sharded`` sends the batch."""
        if self.batch_axis not in logical_axes or self.batch_axis in self.rules:
            return self.rules.spec(logical_axes, self.mesh)
        dim = logical_axes.index(self.batch_axis)
        rest = self.rules.spec((*logical_axes[:dim], None, *logical_axes[dim + 1 :]), self.mesh)
        entries = list(rest) + [None] * (len(logical_axes) - len(rest))
        entries[dim] = self.batch_target
        return PartitionSpec(*entries)


_CURRENT: contextvars.ContextVar[LogicalSharding | None] = contextvars.ContextVar(
    "minishard_logical_sharding"
)


def current() -> LogicalSharding | None:
    """The logical sharding in effect, or None outside ``Sharded`` (and ``logical_sharding``)."""
    return _CURRENT.get(None)


@contextlib.contextmanager
def logical_sharding(
    mesh: Mesh, rules: AxisRules, batch_axis: str = DEFAULT_BATCH_AXIS, batch_target: MeshAxes = None
) -> Iterator[None]:
    """Make ``constrain`` resolve logical axes with ``rules`` on ``mesh`` inside the block.

    ``Sharded`` does this while it traces; use it yourself around a hand-written
    ``jax.jit`` call (the first call traces, so that is when it must be active)::

        with logical_sharding(mesh, rules):
            out = jax.jit(step)(model, batch)
    """
    token = _CURRENT.set(LogicalSharding(mesh, rules, batch_axis, batch_target))
    try:
        yield
    finally:
        _CURRENT.reset(token)


def activation_axes(ndim: int, *trailing: str | None) -> LogicalAxes:
    """The logical axes of a rank-``ndim`` activation: the batch axis first, ``trailing`` last.

    The batch axis is the one ``Sharded(batch_axis=...)`` named (``"batch"`` by
    default), so no layer spells it; dimensions in between are ``None``. A rank
    with no room for the batch keeps only the last ``ndim`` of ``trailing``.

    >>> activation_axes(3, "embed"), activation_axes(1, "mlp")
    (('batch', None, 'embed'), ('mlp',))
    """
    if ndim <= len(trailing):
        return tuple(trailing[len(trailing) - ndim :])
    context = current()
    batch = DEFAULT_BATCH_AXIS if context is None else context.batch_axis
    return (batch, *[None] * (ndim - 1 - len(trailing)), *trailing)


def constrain(x: Any, logical_axes: LogicalAxes) -> Any:
    """Pin ``x``'s layout: its dimensions named by ``logical_axes``, mapped by the rules in effect.

    An unknown logical axis raises the same ``ShardingError`` as for a parameter.
    """
    context = current()
    if context is None:
        return x
    if len(logical_axes) != jax.numpy.ndim(x):
        shape = jax.numpy.shape(x)
        raise ShardingError(f"constrain: {logical_axes} name {len(logical_axes)} dims; x has shape {shape}")
    try:
        sharding = context.sharding(tuple(logical_axes))
    except ShardingError as e:
        raise ShardingError(f"constrain: {e}") from None
    if context.explicit:  # the sharding is the array's type: change the type
        return jax.sharding.reshard(x, sharding)
    return jax.lax.with_sharding_constraint(x, sharding)  # a hint to XLA's propagation


def output_sharding(logical_axes: LogicalAxes) -> NamedSharding | None:
    """On an Explicit mesh, the sharding an ambiguous contraction's output takes; else None.

    Pass it as ``out_sharding=`` to ``jnp.matmul`` or ``jnp.einsum``: None lets JAX decide.
    """
    context = current()
    if context is None or not context.explicit:
        return None
    # An activation's layout is a choice, not a contract: where two of its dimensions want
    # the same mesh axis (strict rules batch->data, mlp->data), the later one is replicated.
    names = {name for name in logical_axes if name is not None and name in context.rules}
    lenient = AxisRules.from_pairs([*context.rules.pairs, *((name, None) for name in sorted(names))])
    return LogicalSharding(context.mesh, lenient, context.batch_axis, context.batch_target).sharding(
        tuple(logical_axes)
    )


def as_activation(param: Any, activation_axes: LogicalAxes) -> Any:
    """On an Explicit mesh, lay ``param`` out as the trailing dimensions of an activation.

    A bias or a scale is added to (or multiplied with) activations; under FSDP it
    is *stored* split over "data" while the activation's batch already uses
    "data", and adding the two is ambiguous. This reshards the parameter to the
    activation's layout (the FSDP all-gather, said out loud). Elsewhere: ``param``.
    """
    sharding = output_sharding(activation_axes)
    if sharding is None:
        return param
    spec = (*sharding.spec, *[None] * (len(activation_axes) - len(sharding.spec)))
    return jax.sharding.reshard(
        param, NamedSharding(sharding.mesh, PartitionSpec(*spec[len(spec) - param.ndim :]))
    )
