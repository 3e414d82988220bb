"""Logical axis rules: the model names its axes, the rules say where they go.

A model author annotates each parameter's dimensions with *logical* names
(``"embed"``, ``"mlp"``); whoever runs the model maps those names to the *mesh*
axes of some hardware (``"data"``, ``"model"``). The same model then runs data-,
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

import math
from collections.abc import Sequence
from typing import Any

from jax.sharding import Mesh, PartitionSpec

from minishard.layers import Axes

P = PartitionSpec
MeshAxes = str | tuple[str, ...] | None
"""Where a logical axis goes: one mesh axis, several (split over their product), or None (replicated)."""


class ShardingError(ValueError):
    """A sharding request that cannot work; the message names what and where, and how to fix it."""


def split_count(mesh: Mesh, target: MeshAxes) -> int:
    """Into how many blocks ``target`` (a PartitionSpec entry) splits a dimension on ``mesh``."""
    return math.prod(mesh.shape[axis] for axis in as_mesh_axes(target))


def as_mesh_axes(target: MeshAxes) -> tuple[str, ...]:
    """A rule's target as a tuple of mesh axis names: None -> (), "model" -> ("model",)."""
    return () if target is None else (target,) if isinstance(target, str) else tuple(target)


class AxisRules:
    """Logical axis name -> mesh axis name(s).

    Two forms:

    * ``AxisRules(embed=None, mlp="model")``: one rule per name; strict.
    * ``AxisRules.from_pairs([("mlp", "model"), ("mlp", None)])``: an ordered
      list with the semantics of Flax's ``logical_to_mesh_axes`` (used by T5X
      and MaxText): rules are tried in order, a dimension takes the first rule
      whose mesh axes are all still free (a later rule for the same name is a
      fallback), a rule to ``None`` claims the dimension as replicated, and a
      mesh axis is never used twice in one array.

    Unlike Flax, a logical name with no rule is an error (Flax silently
    replicates it), unless it is itself the name of a mesh axis: then it maps
    to that axis, so ``axes=(None, "model")`` works with no rules at all.

    >>> AxisRules(embed=None, mlp="model").spec(("embed", "mlp"))
    P(None, 'model')
    """

    def __init__(self, **mapping: MeshAxes) -> None:
        self._init(tuple(mapping.items()), ordered=False)

    @classmethod
    def from_pairs(cls, pairs: Sequence[tuple[str, MeshAxes]]) -> AxisRules:
        """Ordered rules; later rules for a name are fallbacks (Flax semantics)."""
        rules = object.__new__(cls)
        rules._init(tuple((name, target) for name, target in pairs), ordered=True)
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
                    f"AxisRules: rule {name!r} -> {target!r} must map a logical name (str) to a "
                    "mesh axis name, a tuple of them, or None"
                )
        self.pairs = pairs
        self.ordered = ordered

    def __repr__(self) -> str:
        if self.ordered:
            return f"AxisRules.from_pairs({list(self.pairs)!r})"
        return "AxisRules(" + ", ".join(f"{n}={t!r}" for n, t in self.pairs) + ")"

    def __contains__(self, logical: str) -> bool:
        return any(name == logical for name, _ in self.pairs)

    def check_mesh(self, mesh: Mesh) -> None:
        """Every mesh axis a rule names must exist in ``mesh``."""
        for name, target in self.pairs:
            for axis in as_mesh_axes(target):
                if axis not in mesh.axis_names:
                    raise ShardingError(
                        f"rule {name!r} -> {target!r} names mesh axis {axis!r}, but the mesh has "
                        f"axes {mesh.axis_names}; fix the rule or the mesh"
                    )

    def spec(self, logical_axes: Axes, mesh: Mesh | None = None) -> PartitionSpec:
        """The ``PartitionSpec`` for an array whose dimensions have these logical names."""
        return self._resolve(tuple(logical_axes), mesh)[0]

    def explain(self, logical_axes: Axes, mesh: Mesh | None = None) -> str:
        """Which rule decided each dimension, and which rules were skipped and why."""
        spec, notes = self._resolve(tuple(logical_axes), mesh)
        lines = [f"{tuple(logical_axes)} -> {spec}"]
        for dim, dim_notes in enumerate(notes):
            lines += [f"  dim {dim} ({logical_axes[dim]!r}): {note}" for note in dim_notes]
        return "\n".join(lines)

    def _resolve(self, axes: Axes, mesh: Mesh | None) -> tuple[PartitionSpec, list[list[str]]]:
        names = [a for a in axes if a is not None]
        if twice := sorted({a for a in names if names.count(a) > 1}):
            raise ShardingError(f"logical axes {axes}: {twice} name more than one dimension")
        rules = list(self.pairs)
        for name in names:  # identity fallback: a mesh axis name maps to itself
            if name not in self:
                if mesh is None or name not in mesh.axis_names:
                    known = sorted({n for n, _ in self.pairs})
                    where = "" if mesh is None else f" nor a mesh axis {mesh.axis_names}"
                    raise ShardingError(
                        f"logical axis {name!r} (in {axes}) has no rule{where}; add one, e.g. "
                        f"AxisRules({name}='model') or AxisRules({name}=None) to replicate. "
                        f"Rules exist for {known}"
                    )
                rules.append((name, name))
        if mesh is not None:
            AxisRules.from_pairs(rules).check_mesh(mesh)

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
        return P(*result), notes


IDENTITY_RULES = AxisRules()
