"""Logical axis rules: the model names its axes, the rules say where they go.

A model author annotates each parameter's dimensions with *logical axes*
(``"embed"``, ``"mlp"``); whoever runs the model maps those names to the *mesh
axes* of some hardware (``"data"``, ``"model"``). The same model then runs data-,
tensor- or 2-D-parallel by changing only the rules, never the model.

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
from typing import Any

from jax.sharding import AbstractMesh, Mesh, PartitionSpec

P = PartitionSpec
AnyMesh = Mesh | AbstractMesh
"""A mesh with devices, or only its axis names and sizes (enough to plan)."""
LogicalAxes = tuple[str | None, ...]
"""The logical axes of one array, one entry per dimension (``None``: not annotated)."""
MeshAxes = str | tuple[str, ...] | None
"""Where a logical axis goes: one mesh axis, several (split over their product), or None (replicated)."""


class ShardingError(ValueError):
    """A sharding request that cannot work; the message names what and where, and how to fix it."""


def split_count(mesh: AnyMesh, target: MeshAxes) -> int:
    """Into how many blocks ``target`` (a PartitionSpec entry) splits a dimension on ``mesh``."""
    return math.prod(mesh.shape[axis] for axis in as_mesh_axes(target))


def as_mesh_axes(target: MeshAxes) -> tuple[str, ...]:
    """A rule's target as a tuple of mesh axis names: None -> (), "model" -> ("model",)."""
    return () if target is None else (target,) if isinstance(target, str) else tuple(target)


@dataclasses.dataclass(frozen=True)
class RuleTrace:
    """What ``AxisRules.explain`` found: the spec, and per dimension which rules matched or were skipped.

    ``print(trace)`` shows it as text, as ``print(minishard.explain(...))`` shows a whole model.
    """

    logical_axes: LogicalAxes
    spec: PartitionSpec
    notes: tuple[tuple[str, ...], ...]  # per dimension, in the order the rules were tried

    def __str__(self) -> str:
        lines = [f"{self.logical_axes} -> {self.spec}"]
        for dim, dim_notes in enumerate(self.notes):
            lines += [f"  dim {dim} ({self.logical_axes[dim]!r}): {note}" for note in dim_notes]
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
        rules = object.__new__(cls)
        try:
            pairs = tuple((name, target) for name, target in pairs)
        except (TypeError, ValueError):
            raise ShardingError(
                f"AxisRules.from_pairs: expected (logical axis, mesh axes) pairs, got {pairs!r:.200}"
            ) from None
        rules._init(pairs, ordered=True)
        return rules

    def _init(self, pairs: tuple[tuple[str, MeshAxes], ...], ordered: bool) -> None:
        for name, target in pairs:
            names_mesh_axes = (
                target is None
                or isinstance(target, str)
                or (isinstance(target, tuple | list) and all(isinstance(a, str) for a in target))
            )
            if not isinstance(name, str) or not names_mesh_axes:
                raise ShardingError(
                    f"AxisRules: rule {name!r} -> {target!r} must map a logical axis (str) to a "
                    "mesh axis name, a tuple of them, or None"
                )
            axes = as_mesh_axes(target)
            if len(set(axes)) < len(axes):
                raise ShardingError(
                    f"AxisRules: rule {name!r} -> {target!r} names a mesh axis twice; an array "
                    "dimension can be split over each mesh axis only once"
                )
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
            _check_rule_on_mesh(name, target, mesh)

    def spec(self, logical_axes: LogicalAxes, mesh: AnyMesh | None = None) -> PartitionSpec:
        """The ``PartitionSpec`` for an array whose dimensions have these logical axes.

        Pass ``mesh`` so that a logical axis with no rule can fall back to the
        mesh axis of the same name; the rules that match are checked against it.
        """
        return self.explain(logical_axes, mesh).spec

    def explain(self, logical_axes: LogicalAxes, mesh: AnyMesh | None = None) -> RuleTrace:
        """Which rule decided each dimension, and which rules were skipped and why."""
        axes = _checked_logical_axes(logical_axes)
        rules = list(self.pairs)
        for name in axes:  # identity fallback: a mesh axis name maps to itself
            if name is not None and name not in self:
                if mesh is None or name not in mesh.axis_names:
                    known = sorted({n for n, _ in self.pairs})
                    where = "" if mesh is None else f" nor a mesh axis {mesh.axis_names}"
                    raise ShardingError(
                        f"logical axis {name!r} (in {axes}) has no rule{where}; add one, e.g. "
                        f"AxisRules({name}='model') or AxisRules({name}=None) to replicate. "
                        f"Rules exist for {known}"
                    )
                rules.append((name, name))

        unassigned = object()
        result: list[Any] = [None if a is None else unassigned for a in axes]
        notes: list[list[str]] = [["not annotated: replicated"] if a is None else [] for a in axes]
        used: dict[str, int] = {}  # mesh axis -> the dimension that took it
        for name, target in rules:  # Flax's order: rule by rule, not dimension by dimension
            if name not in axes:
                continue
            dim, wanted = axes.index(name), as_mesh_axes(target)
            if result[dim] is not unassigned:
                notes[dim].append(f"rule {name}->{target!r} skipped: dimension already decided")
            elif taken := [a for a in wanted if a in used]:
                by = used[taken[0]]
                notes[dim].append(
                    f"rule {name}->{target!r} skipped: mesh axis {taken[0]!r} already used by dim {by}"
                )
            else:
                if mesh is not None:
                    _check_rule_on_mesh(name, target, mesh)
                result[dim] = target
                used.update(dict.fromkeys(wanted, dim))
                notes[dim].append(f"rule {name}->{target!r} matched" + ("" if wanted else ": replicated"))
        for dim, entry in enumerate(result):
            if entry is unassigned:
                if not self.ordered:
                    raise ShardingError(
                        f"logical axes {axes}: dimension {dim} ({axes[dim]!r}) maps to a mesh axis that "
                        f"another dimension already uses ({notes[dim][-1]}); a mesh axis can split an "
                        "array only once. Give a fallback with an ordered list, e.g. "
                        f"AxisRules.from_pairs([..., ({axes[dim]!r}, None)])"
                    )
                result[dim] = None
                notes[dim].append("every rule was blocked: replicated (as in Flax)")
        return RuleTrace(axes, P(*result), tuple(map(tuple, notes)))


def _check_rule_on_mesh(name: str, target: MeshAxes, mesh: AnyMesh) -> None:
    for axis in as_mesh_axes(target):
        if axis not in mesh.axis_names:
            raise ShardingError(
                f"rule {name!r} -> {target!r} names mesh axis {axis!r}, but the mesh has "
                f"axes {mesh.axis_names}; fix the rule or the mesh"
            )


def _checked_logical_axes(logical_axes: Any) -> LogicalAxes:
    """A tuple of str-or-None, each name used once; a bare string is a common slip."""
    if isinstance(logical_axes, str) or not isinstance(logical_axes, Sequence):
        raise ShardingError(
            f"logical axes must be a tuple with one name (or None) per dimension, got {logical_axes!r}; "
            f"for one dimension write ({logical_axes!r},)"
        )
    axes = tuple(logical_axes)
    if bad := [a for a in axes if a is not None and not isinstance(a, str)]:
        raise ShardingError(f"logical axes {axes}: {bad} are not names (str) or None")
    names = [a for a in axes if a is not None]
    if twice := sorted({a for a in names if names.count(a) > 1}):
        raise ShardingError(f"logical axes {axes}: {twice} name more than one dimension")
    return axes


IDENTITY_RULES = AxisRules()
"""No rules: only logical axes that are themselves mesh axis names are split."""
