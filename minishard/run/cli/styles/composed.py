"""What each dimension of a composed style sends: the compiled step's collectives, by mesh axis.

A composition (``minishard.styles.compose``) gives each dimension a mesh axis of its own, so a
collective's device groups say whose it is: an all-reduce over "model" is tp's (and sp's, which
rides on its axis), a collective-permute over "stage" the pipeline's, one over "context" the
ring's. ``explain`` prints this after the plan of a composition that is not a named style.

>>> print(by_dimension("dp+tp+pp", [Send("all-reduce", 64, devices=2, groups=(("model",),))] * 3))
collectives by dimension:
  tp (model)  all-reduce x3  192 B
"""

from __future__ import annotations

from collections.abc import Iterable

from minishard.census import Send, axis_name, human_bytes
from minishard.styles import DIMENSIONS, MESH_AXES, dimensions

__all__ = ["by_dimension"]


def by_dimension(name: str, sent: Iterable[Send[int]]) -> str:
    """The collectives ``sent`` (``census.instructions`` of a compiled step), summed per dimension
    of ``name`` and kind, in mesh-axis order; a collective over several axes names each
    (``dp x tp``)."""
    dims = dimensions(name)
    axis = {dim: DIMENSIONS[dim].axis for dim in dims}
    owners = {axis[dim]: "+".join(d for d in dims if axis[d] == axis[dim]) for dim in dims}
    found: dict[tuple[int, str, str], tuple[int, int]] = {}
    for send in sent:
        groups = send.groups
        axes = [axis_name(label) for label in groups[0]] if len(groups) == 1 else ["?"]
        who = " x ".join(owners.get(axis, axis) for axis in axes)
        key = (
            MESH_AXES.index(axes[0]) if axes[0] in MESH_AXES else len(MESH_AXES),
            f"{who} ({', '.join(axes)})",
            send.kind,
        )
        count, total = found.get(key, (0, 0))
        found[key] = (count + 1, total + send.result_bytes)
    if not found:
        return "collectives by dimension: none"
    width = max(len(label) for _, label, _ in found)
    rows = [
        f"  {label:<{width}}  {kind} x{count}  {human_bytes(total)}"
        for (_, label, kind), (count, total) in sorted(found.items())
    ]
    return "\n".join(["collectives by dimension:", *rows])
