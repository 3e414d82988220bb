"""The report, ``explain()``: where every array of a model lives on a mesh, and what a step sends.

``minishard.collectives`` answers "what does this program send?". ``explain``
puts that next to the question before it, "what does each device hold?": one
row per array, read from ``minishard.sharding.plan`` (the same plan ``Sharded``
uses, not re-derived here), with the shard each device keeps and its bytes.
Only the mesh's axis names and sizes are needed, so an ``AbstractMesh`` plans a
model far too big for this machine (with ``jax.eval_shape`` for the model). The
``Report`` holds one ``Row`` per array, the totals, and with a step its collectives
and its cost.

>>> import jax
>>> from minishard import AxisRules, mlp
>>> model = mlp([8, 16, 4], key=jax.random.key(0), axes=[("embed", "mlp"), ("mlp", "embed")])
>>> mesh = jax.sharding.AbstractMesh((2, 4), ("data", "model"))  # only shapes needed here
>>> report = explain(model, mesh, AxisRules(embed=None, mlp="model"))
>>> print(report)
mesh {'data': 2, 'model': 4} (8 devices)
path              shape    logical axes      spec              bytes  per device  bytes/device
----------------  -------  ----------------  ----------------  -----  ----------  ------------
layers[0].weight  (8, 16)  ('embed', 'mlp')  P(None, 'model')  512 B  (8, 4)      128 B
layers[0].bias    (16,)    ('mlp',)          P('model',)       64 B   (4,)        16 B
layers[2].weight  (16, 4)  ('mlp', 'embed')  P('model', None)  256 B  (4, 4)      64 B
layers[2].bias    (4,)     ('embed',)        P(None,)          16 B   (4,)        16 B
total: 848 B unsharded, 224 B per device (3.8x less)
>>> report.rows[0].leaf.spec, report.rows[0].device_bytes, report.total_bytes, report.device_bytes
(P(None, 'model'), 128, 848, 224)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from minishard.census import Collective, collectives, human_bytes, summary
from minishard.costs import Hardware, StepCost, cost_report
from minishard.rules import AnyMesh, AxisRules
from minishard.sharding import LeafPlan, Sharded, plan
from minishard.tree import named_leaves

__all__ = ["Report", "Row", "explain"]


@dataclasses.dataclass(frozen=True)
class Row:
    """One array of the tree: its plan (``sharding.LeafPlan``: its path, shape, logical axes,
    spec and shard), how big it is, and how much of it one device holds."""

    leaf: LeafPlan  # the plan's own record of the array, as ``Sharded`` places it
    dtype: str  # "float32"
    bytes: int  # the whole array
    device_bytes: int  # one device's shard


@dataclasses.dataclass(frozen=True)
class Report:
    """What ``explain`` found. ``str(report)`` is a plain-text table (``minishard.run.render``
    draws it as a rich table, as HTML, or as a picture of which devices hold each shard).

    * ``rows``: one ``Row`` per array, in the tree's order;
    * ``total_bytes``: all arrays, unsharded; ``device_bytes``: what one device holds;
    * ``collectives``: the step's collectives by kind, as ``collectives()`` returns
      them (``None`` when no step was given);
    * ``cost``: the step priced on an accelerator (``minishard.costs``), when one was named.
    """

    mesh: dict[str, int]
    rows: tuple[Row, ...]
    total_bytes: int
    device_bytes: int
    collectives: dict[str, Collective] | None = None
    step_name: str = "step"
    cost: StepCost | None = None

    HEADER: ClassVar[tuple[str, ...]] = (
        "path",
        "shape",
        "logical axes",
        "spec",
        "bytes",
        "per device",
        "bytes/device",
    )

    def cells(self) -> list[tuple[str, ...]]:
        """The table's rows as strings, one per ``HEADER`` column: for ``str`` and the renderers."""
        return [
            (
                row.leaf.path,
                str(row.leaf.shape),
                str(row.leaf.logical_axes),
                str(row.leaf.spec),
                human_bytes(row.bytes),
                str(row.leaf.shard_shape),
                human_bytes(row.device_bytes),
            )
            for row in self.rows
        ]

    def footer(self) -> list[str]:
        """The lines under the table: the totals, and the step's collectives if there was a step."""
        ratio = self.total_bytes / self.device_bytes if self.device_bytes else 1.0
        lines = [
            f"total: {human_bytes(self.total_bytes)} unsharded, "
            f"{human_bytes(self.device_bytes)} per device ({ratio:.1f}x less)"
        ]
        if self.collectives is not None:
            lines += [f"collectives of {self.step_name}:"]
            lines += ["  " + line for line in summary(self.collectives).splitlines()]
        return lines + (str(self.cost).splitlines() if self.cost else [])

    def __str__(self) -> str:
        n_devices = math.prod(self.mesh.values())
        table = [self.HEADER, *self.cells()]
        widths = [max(len(row[i]) for row in table) for i in range(len(self.HEADER))]
        lines = [f"mesh {self.mesh} ({n_devices} devices)"]
        lines += [_padded(row, widths) for row in table]
        lines.insert(2, "  ".join("-" * w for w in widths))  # under the header
        return "\n".join(lines + self.footer())


def _padded(cells: Sequence[str], widths: Sequence[int]) -> str:
    """One line of the table: each cell padded to its column's width, two spaces between."""
    return "  ".join(cell.ljust(width) for cell, width in zip(cells, widths)).rstrip()


def explain(
    tree: Any,
    mesh: AnyMesh,
    rules: AxisRules | None = None,
    step: Callable[..., Any] | None = None,
    args: Sequence[Any] | None = None,
    hardware: Hardware | str | None = None,
) -> Report:
    """Every array of ``tree`` (a model, an optimizer state, ...) on ``mesh`` under ``rules``.

    Only the mesh's axis names and sizes are read, so a ``jax.sharding.AbstractMesh``
    will do, unless a step is to be compiled (the module docstring shows a report).

    With ``step`` and its example ``args``, the report also lists the collectives of the
    compiled step. ``step`` is a ``Sharded`` function (or anything with ``.lower``, such as a
    ``jax.jit`` function), or a plain function, which is then wrapped in ``Sharded(mesh,
    rules)``. With ``hardware`` too ("v5p", a key of ``costs.HARDWARE``), ``report.cost``
    prices it there (``costs.cost_report``).
    """
    rows = _rows(tree, mesh, rules)
    found, cost = _compiled(step, args, mesh, rules, hardware)
    return Report(
        mesh=dict(mesh.shape),
        rows=rows,
        total_bytes=sum(row.bytes for row in rows),
        device_bytes=sum(row.device_bytes for row in rows),
        collectives=found,
        step_name=getattr(getattr(step, "fn", step), "__name__", "step"),
        cost=cost,
    )


def _rows(tree: Any, mesh: AnyMesh, rules: AxisRules | None) -> tuple[Row, ...]:
    """One Row per array, from the plan ``Sharded`` uses, with each array's bytes."""
    arrays = dict(named_leaves(tree))  # path -> array, for each row's dtype
    rows = []
    for leaf in plan(tree, mesh, rules).leaves:
        dtype = np.dtype(jnp.result_type(arrays[leaf.path]))
        rows.append(
            Row(
                leaf=leaf,
                dtype=dtype.name,
                bytes=math.prod(leaf.shape) * dtype.itemsize,
                device_bytes=math.prod(leaf.shard_shape) * dtype.itemsize,
            )
        )
    return tuple(rows)


def _compiled(
    step: Callable[..., Any] | None,
    args: Sequence[Any] | None,
    mesh: AnyMesh,
    rules: AxisRules | None,
    hardware: Hardware | str | None,
) -> tuple[dict[str, Collective] | None, StepCost | None]:
    """Compile ``step`` on ``args`` (in ``Sharded`` unless it can ``.lower``), count, price."""
    if step is None:
        if hardware is not None:
            raise TypeError("explain: hardware= prices a step; give the step and its args too")
        return None, None
    if args is None:
        raise TypeError(
            "explain: a step needs example args to compile it with, e.g. args=(model, batch)",
        )
    sharded: Any = step
    if not hasattr(step, "lower"):
        if not isinstance(mesh, jax.sharding.Mesh):
            raise TypeError(
                "explain: compiling a step needs a mesh of real devices, not an AbstractMesh",
            )
        sharded = Sharded(mesh, rules)(step)
    cost = None if hardware is None else cost_report(sharded, args, mesh, rules, hardware)
    return collectives(sharded.lower(*args)), cost
