"""Where activations live: pin an intermediate array's sharding by its logical axes.

``Sharded`` gives every *parameter* and every *input* a sharding; everything
computed in between is left to XLA's sharding propagation, which guesses each
intermediate's sharding from its neighbours. Usually it guesses well. When it
does not (with FSDP, say, it may split a hidden activation over "data" along
the wrong dimension and then pay all-to-alls and all-gathers to fix it up),
``constrain`` says where an activation must live, in the model's own
vocabulary, as Flax's ``with_logical_constraint`` and MaxText do:

    y = constrain(x @ w, ("batch", "mlp"))

The mesh and the rules come from the surrounding ``Sharded`` call: it builds one
``LogicalSharding`` (the mesh, the rules, where the batch goes) and sets it while
it traces; ``environment()`` is the one in effect. Outside it ``constrain`` checks
only the rank and returns ``x``, so the same model still runs on one device, or
under a plain ``jax.jit``. Inside, it lowers to ``jax.lax.with_sharding_constraint``
on an Auto mesh, and to ``jax.sharding.reshard`` on an Explicit one.

On an Explicit mesh a matmul that contracts a split dimension (the second
Linear of a Megatron pair) is ambiguous, and JAX asks for its output sharding;
``output_sharding`` gives it from the layer's logical axes and the rules, which
is how minishard's ``Linear`` runs unchanged in both modes, and ``as_activation``
lays a bias out as the activation it is added to.

No layer spells the batch axis: ``activation_axes`` puts the one ``Sharded`` named
first (``DEFAULT_BATCH_AXIS``, ``"batch"``, unless it named another).

>>> import jax.numpy as jnp
>>> constrain(jnp.ones((4, 8)), ("batch", "embed")).shape    # no context: nothing to do
(4, 8)
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from minishard import _checks
from minishard.rules import AxisRules, LogicalAxes, MeshAxes, ShardingError

__all__ = [
    "DEFAULT_BATCH_AXIS",
    "LogicalSharding",
    "activation_axes",
    "as_activation",
    "constrain",
    "environment",
    "output_sharding",
]

DEFAULT_BATCH_AXIS = "batch"
"""The logical axis of a batch's leading dimension, unless ``Sharded(batch_axis=...)`` names
another."""


@dataclasses.dataclass(frozen=True)
class LogicalSharding:
    """The sharding environment: a mesh, its rules, and where a batch goes.

    ``Sharded`` builds one and sets it while it traces; ``constrain``,
    ``activation_axes`` and ``output_sharding`` read it. Under a hand-written
    ``jax.jit``, wrap the function, ``jax.jit(LogicalSharding(mesh, rules).wrap(step))``:
    JAX caches a trace under the function it is given, so setting the environment
    around ``jax.jit(step)`` would leave a constrained trace for a later plain
    ``jax.jit(step)`` to reuse.

    >>> from jax.sharding import AbstractMesh
    >>> env = LogicalSharding(AbstractMesh((8,), ("data",)), AxisRules(batch="data", embed=None))
    >>> env.batch_target, env.spec(("batch", "embed"))
    ('data', P('data', None))
    """

    mesh: Mesh
    rules: AxisRules
    batch_axis: str = DEFAULT_BATCH_AXIS
    batch_target: MeshAxes = dataclasses.field(init=False)  # mesh axes of a batch's leading dim
    explicit: bool = dataclasses.field(init=False)  # shardings are part of every array's type

    def __post_init__(self) -> None:  # derived once, here only
        known = self.batch_axis in self.rules or self.batch_axis in self.mesh.axis_names
        target = self.rules.spec((self.batch_axis,), self.mesh)[0] if known else None
        object.__setattr__(self, "batch_target", target)
        object.__setattr__(self, "explicit", AxisType.Explicit in self.mesh.axis_types)

    def sharding(self, logical_axes: LogicalAxes) -> NamedSharding:
        """The rules' sharding; inside a ``shard_map`` (a pipeline's stages), on the mesh as it
        sees it, without the axes it is manual over: there each device holds its part, a
        constraint places the rest."""
        seen = jax.sharding.get_abstract_mesh()  # its own axes Manual; outside one, no axes at all
        if not seen.manual_axes:
            return NamedSharding(self.mesh, self.spec(logical_axes))
        return NamedSharding(seen, _without(self.spec(logical_axes), set(seen.manual_axes)))

    def spec(self, logical_axes: LogicalAxes) -> PartitionSpec:
        """The rules' spec, with the batch axis sent where ``Sharded`` sends the batch."""
        if self.batch_axis not in logical_axes or self.batch_axis in self.rules:
            return self.rules.spec(logical_axes, self.mesh)
        dim = logical_axes.index(self.batch_axis)
        rest = self.rules.spec((*logical_axes[:dim], None, *logical_axes[dim + 1 :]), self.mesh)
        entries = list(rest) + [None] * (len(logical_axes) - len(rest))
        entries[dim] = self.batch_target
        return PartitionSpec(*entries)

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn``, run with this environment in effect: a new function, so its trace is its own."""

        @functools.wraps(fn)
        def within(*args: Any, **kwargs: Any) -> Any:
            token = _CURRENT.set(self)
            try:
                return fn(*args, **kwargs)
            finally:
                _CURRENT.reset(token)

        return within


def _without(spec: PartitionSpec, manual: set[str]) -> PartitionSpec:
    """``spec`` without the mesh axes ``manual``.

    P(("data", "model")) without "data" is P("model")."""
    entries = []
    for entry in spec:  # None, one mesh axis, or a tuple of them
        axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
        auto = tuple(axis for axis in axes if axis not in manual)
        entries.append(auto[0] if len(auto) == 1 else auto or None)
    return PartitionSpec(*entries)


_CURRENT: contextvars.ContextVar[LogicalSharding | None] = contextvars.ContextVar(
    "minishard_logical_sharding", default=None
)


def environment() -> LogicalSharding | None:
    """The ``LogicalSharding`` in effect (``Sharded`` sets one while it traces), or None outside:
    where a layer that writes its own ``shard_map`` (ring attention) finds its mesh and rules."""
    return _CURRENT.get()


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
    context = _CURRENT.get()
    batch = DEFAULT_BATCH_AXIS if context is None else context.batch_axis
    return (batch, *[None] * (ndim - 1 - len(trailing)), *trailing)


def constrain(x: Any, logical_axes: LogicalAxes) -> Any:
    """Pin ``x``'s sharding: its dimensions named by ``logical_axes``, mapped by the rules in
    effect.

    The rank is checked everywhere (shapes are static: it is free); inside
    ``Sharded``, an unknown logical axis or a dimension its mesh axes cannot split
    evenly raises the same ``ShardingError`` as for a parameter.
    """
    _checks.logical_axes("constrain", logical_axes, jax.numpy.shape(x))
    context = _CURRENT.get()
    if context is None:
        return x
    try:
        sharding = context.sharding(tuple(logical_axes))
    except ShardingError as e:
        raise e.retold(lambda why: f"constrain: {why}") from None
    shape = jax.numpy.shape(x)
    _checks.divisible("constrain", shape, tuple(logical_axes), sharding.spec, context.mesh)
    if context.explicit:  # the sharding is the array's type: change the type
        return jax.sharding.reshard(x, sharding)
    return jax.lax.with_sharding_constraint(x, sharding)  # a hint to XLA's propagation


def output_sharding(logical_axes: LogicalAxes) -> NamedSharding | None:
    """On an Explicit mesh, the sharding an ambiguous contraction's output takes; else None.

    Pass it as ``out_sharding=`` to ``jnp.matmul`` or ``jnp.einsum``: None lets JAX decide.
    """
    context = _CURRENT.get()
    if context is None or not context.explicit:
        return None
    # An activation's sharding is a choice, not a contract: where two of its dimensions want
    # the same mesh axis (strict rules batch->data, mlp->data), the later one is replicated.
    names = {name for name in logical_axes if name is not None and name in context.rules}
    fallbacks = [(name, None) for name in sorted(names)]
    lenient = AxisRules.from_pairs([*context.rules.pairs, *fallbacks])
    return dataclasses.replace(context, rules=lenient).sharding(tuple(logical_axes))


def as_activation(param: Any, activation_axes: LogicalAxes) -> Any:
    """On an Explicit mesh, lay ``param`` out as the trailing dimensions of an activation.

    A bias or a scale is added to (or multiplied with) activations; under FSDP it
    is *stored* split over "data" while the activation's batch already uses
    "data", and adding the two is ambiguous. This reshards the parameter to the
    activation's sharding (the FSDP all-gather, said out loud). Elsewhere: ``param``.
    """
    sharding = output_sharding(activation_axes)
    if sharding is None:
        return param
    spec = (*sharding.spec, *[None] * (len(activation_axes) - len(sharding.spec)))
    return jax.sharding.reshard(
        param, NamedSharding(sharding.mesh, PartitionSpec(*spec[len(spec) - param.ndim :]))
    )
