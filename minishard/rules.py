"""Logical axis rules: the model names its axes, the rules say where they go.

A model author annotates each parameter's dimensions with *logical axes*
(``"embed"``, ``"mlp"``); whoever runs the model maps those names to the *mesh
axes* of some hardware (``"data"``, ``"model"``). The same model then runs data-,
tensor- or 2-D-parallel by changing only the rules, never the model.

An array's ``LogicalAxes`` name its dimensions; a rule sends a name to ``MeshAxes`` (one
mesh axis, several, or None) on ``AnyMesh`` (a mesh, or only its shape); ``split_count``
is into how many shards that splits a dimension, ``as_mesh_axes`` the target as a tuple.
``resolve`` is Flax's algorithm: the rules in order, each an ``Attempt`` that claims a
dimension or is skipped; ``AxisRules`` holds the rules (``IDENTITY_RULES``: none) and its
``explain`` prints a ``RuleTrace``. Rules that cannot place an array raise ``ShardingError``.

>>> rules = AxisRules(embed=None, mlp="model")
>>> rules.spec(("embed", "mlp"))
P(None, 'model')
>>> ordered = AxisRules.from_pairs([("mlp", "model"), ("embed", "model"), ("embed", None)])
>>> print(ordered.explain(("embed", "mlp")))
('embed', 'mlp') -> P(None, 'model')
  dim 0 ('embed'): rule embed->'model' skipped: mesh axis 'model' already used by dim 1
  dim 0 ('embed'): rule embed->None matched: replicated
  dim 1 ('mlp'): rule mlp->'model' matched
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import NamedTuple

from jax.sharding import AbstractMesh, Mesh, PartitionSpec

from minishard import _checks
from minishard._checks import ShardingError  # what every guard raises; defined in the guards' leaf

__all__ = [
    "IDENTITY_RULES",
    "AnyMesh",
    "Attempt",
    "AxisRules",
    "LogicalAxes",
    "MeshAxes",
    "P",
    "RuleTrace",
    "ShardingError",
    "as_mesh_axes",
    "resolve",
    "split_count",
]

P = PartitionSpec
AnyMesh = Mesh | AbstractMesh
"""A mesh with devices, or only its axis names and sizes (enough to plan)."""
LogicalAxes = tuple[str | None, ...]
"""The logical axes of one array, one entry per dimension (``None``: not annotated)."""
MeshAxes = str | tuple[str, ...] | None
"""Where a logical axis goes: one mesh axis, several (split over their product), or None
(replicated)."""


def split_count(mesh: AnyMesh, target: MeshAxes) -> int:
    """Into how many shards ``target`` (a PartitionSpec entry) splits a dimension on ``mesh``."""
    return math.prod(mesh.shape[axis] for axis in as_mesh_axes(target))


def as_mesh_axes(target: MeshAxes) -> tuple[str, ...]:
    """A rule's target as a tuple of mesh axis names: None -> (), "model" -> ("model",)."""
    return () if target is None else (target,) if isinstance(target, str) else tuple(target)


class Attempt(NamedTuple):
    """One rule tried on the dimension it names, and what stopped it, if anything."""

    dim: int
    name: str
    target: MeshAxes
    already_decided: bool  # an earlier rule claimed the dimension
    taken: tuple[str, int] | None  # a mesh axis the rule wants, and the dimension that claimed it

    @property
    def won(self) -> bool:
        return not self.already_decided and self.taken is None

    def __str__(self) -> str:
        rule = f"rule {self.name}->{self.target!r}"
        if self.already_decided:
            return f"{rule} skipped: dimension already decided"
        if self.taken is not None:
            axis, dim = self.taken
            return f"{rule} skipped: mesh axis {axis!r} already used by dim {dim}"
        return f"{rule} matched" + ("" if as_mesh_axes(self.target) else ": replicated")


def resolve(
    logical_axes: LogicalAxes, rules: Sequence[tuple[str, MeshAxes]]
) -> tuple[PartitionSpec, list[Attempt]]:
    """Flax's rule algorithm (``_logical_to_mesh_axes``): one pass over the rules, in list order.

    A rule claims the dimension its logical axis names if that dimension is still open and
    every mesh axis it wants is free; a later rule for the same name is a fallback. Unclaimed:
    replicated; a name on two dimensions: refused. Returns the spec and each rule tried, in order.

    >>> spec, attempts = resolve(("embed", "mlp"), [("mlp", "model"), ("embed", "model")])
    >>> spec, [attempt.won for attempt in attempts]
    (P(None, 'model'), [True, False])
    """
    _checks.each_name_once(logical_axes)  # ("mlp", "mlp"): AxisRules.spec refuses it here too
    entries: list[MeshAxes] = [None] * len(logical_axes)
    decided: set[int] = set()
    claimed: dict[str, int] = {}  # mesh axis -> the dimension that claimed it
    attempts = []
    for name, target in rules:  # rule by rule, not dimension by dimension
        if name not in logical_axes:
            continue
        dim = logical_axes.index(name)
        wanted = as_mesh_axes(target)
        taken = None if dim in decided else _first_taken(wanted, claimed)
        attempts.append(Attempt(dim, name, target, already_decided=dim in decided, taken=taken))
        if attempts[-1].won:
            entries[dim] = target
            decided.add(dim)
            claimed.update(dict.fromkeys(wanted, dim))
    return P(*entries), attempts


def _first_taken(wanted: tuple[str, ...], claimed: dict[str, int]) -> tuple[str, int] | None:
    """The first mesh axis of ``wanted`` that a dimension has claimed, and that dimension."""
    return next(((axis, claimed[axis]) for axis in wanted if axis in claimed), None)


@dataclasses.dataclass(frozen=True)
class RuleTrace:
    """What ``AxisRules.explain`` found: the spec, and every rule tried on each dimension.

    ``print(trace)`` shows it as text, as ``print(minishard.explain(...))`` shows a whole model.
    """

    logical_axes: LogicalAxes
    spec: PartitionSpec
    attempts: tuple[Attempt, ...]  # as ``resolve`` tried them

    def __str__(self) -> str:
        lines = [f"{self.logical_axes} -> {self.spec}"]
        for dim, name in enumerate(self.logical_axes):
            tried = [attempt for attempt in self.attempts if attempt.dim == dim]
            notes = [str(attempt) for attempt in tried]
            if name is None:
                notes = ["not annotated: replicated"]
            elif not any(attempt.won for attempt in tried):
                notes.append("every rule was blocked: replicated (as in Flax)")
            lines += [f"  dim {dim} ({name!r}): {note}" for note in notes]
        return "\n".join(lines)


class AxisRules:
    """Logical axis -> mesh axis (or axes).

    Two forms:

    * ``AxisRules(embed=None, mlp="model")``: one rule per name; strict.
    * ``AxisRules.from_pairs([("mlp", "model"), ("mlp", None)])``: an ordered
      list with the semantics of Flax's ``logical_to_mesh_axes`` (used by T5X
      and MaxText).

    Unlike Flax, a logical axis with no rule is an error (Flax silently
    replicates it), unless it is itself the name of a mesh axis: then it maps
    to that axis, so ``axes=(None, "model")`` works with no rules at all.

    >>> AxisRules(embed=None, mlp="model").spec(("embed", "mlp"))
    P(None, 'model')
    """

    def __init__(self, **mapping: MeshAxes) -> None:
        self._init(tuple(mapping.items()), ordered=False)

    @classmethod
    def from_pairs(cls, pairs: Sequence[tuple[str, MeshAxes]]) -> AxisRules:
        """Ordered rules, resolved *rule by rule* in list order (Flax's semantics).

        For one array, the rules are walked in list order, not its dimensions:
        each rule whose logical axis names a still-undecided dimension claims
        it, if all of the rule's mesh axes are still free in this array;
        otherwise it is skipped, and a later rule for the same name is the
        fallback. A rule to ``None`` claims its dimension as replicated. So
        ``[("mlp", "model"), ("embed", "model"), ("embed", None)]`` gives an
        ``("embed", "mlp")`` weight ``P(None, "model")``: ``mlp`` came first.

        >>> AxisRules.from_pairs([("batch", "data"), ("embed", "data"), ("embed", None)]).spec(
        ...     ("batch", "embed"))
        P('data', None)
        """
        try:
            pairs = tuple((name, target) for name, target in pairs)
        except (TypeError, ValueError):  # not pairs
            _checks.rule_pairs(pairs)
        rules = object.__new__(cls)
        rules._init(pairs, ordered=True)
        return rules

    def _init(self, pairs: tuple[tuple[str, MeshAxes], ...], ordered: bool) -> None:
        for name, target in pairs:
            _checks.rule(name, target)
        self.pairs = tuple((name, tuple(t) if isinstance(t, list) else t) for name, t in pairs)
        self.ordered = ordered

    def __repr__(self) -> str:
        if self.ordered:
            return f"AxisRules.from_pairs({list(self.pairs)!r})"
        return "AxisRules(" + ", ".join(f"{n}={t!r}" for n, t in self.pairs) + ")"

    def __contains__(self, logical_axis: str) -> bool:
        return any(name == logical_axis for name, _ in self.pairs)

    def check_mesh(self, mesh: AnyMesh) -> None:
        """Every mesh axis a rule names must exist in ``mesh``. Run once per mesh, not per array."""
        for name, target in self.pairs:
            _checks.rule_on_mesh(name, target, mesh)

    def spec(self, logical_axes: LogicalAxes, mesh: AnyMesh | None = None) -> PartitionSpec:
        """The ``PartitionSpec`` for an array whose dimensions have these logical axes.

        Pass ``mesh`` so that a logical axis with no rule can fall back to the
        mesh axis of the same name; the rules that match are checked against it.
        With ordered rules a dimension no rule could claim is replicated, as in
        Flax; keyword rules raise instead.
        """
        return self._resolve(logical_axes, mesh)[1]

    def explain(self, logical_axes: LogicalAxes, mesh: AnyMesh | None = None) -> RuleTrace:
        """Which rule decided each dimension, and which rules were skipped and why."""
        return RuleTrace(*self._resolve(logical_axes, mesh))

    def _resolve(
        self, logical_axes: LogicalAxes, mesh: AnyMesh | None
    ) -> tuple[LogicalAxes, PartitionSpec, tuple[Attempt, ...]]:
        """``resolve`` with these rules, then each other name that is a mesh axis, to itself."""
        _checks.logical_axes("", logical_axes)
        axes = tuple(logical_axes)
        _checks.every_name_has_a_rule(self, axes, mesh)
        identity = [(name, name) for name in axes if name is not None and name not in self]
        spec, attempts = resolve(axes, [*self.pairs, *identity])
        _checks.winners_on_mesh(attempts, mesh)
        # keyword rules are strict: a blocked dimension is an error, not replicated
        if not self.ordered:
            _checks.every_dimension_decided(axes, attempts)
        return axes, spec, tuple(attempts)


IDENTITY_RULES = AxisRules()
"""No rules: only logical axes that are themselves mesh axis names are split."""
