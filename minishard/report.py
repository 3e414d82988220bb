"""Reports on compiled programs: which collectives did XLA insert, how many bytes, over which axes?

You write a program for whole arrays; ``jax.jit`` hands it, with your
shardings, to XLA, whose *SPMD partitioner* rewrites it into the program that
*each device* runs on its own shards. Wherever a device needs data it does not
hold, the partitioner inserts a **collective**:

* ``all-reduce``: everyone ends with the sum of everyone's values (gradients in
  data parallelism, partial dot products when a contracted dimension is split);
* ``all-gather``: everyone ends with all the shards, concatenated;
* ``reduce-scatter``: the sum, but each device keeps only its slice of it;
* ``all-to-all``: device i sends its j-th slice to device j (moves a sharding
  from one dimension to another);
* ``collective-permute``: point-to-point sends along fixed (source, target) pairs.

Collectives are the time a sharded program spends on the interconnect rather
than computing. They appear neither in your Python nor in the jaxpr, only in the
compiled HLO, ``jax.jit(f).lower(*args).compile().as_text()``; ``minishard.hlo``
shows how to read it. Here, 2 groups of 4 devices, ``[2,4]<=[8]``, each add up
an f32[2000] on a (2, 4) mesh of axes ("x", "y"): an all-reduce over "y".

>>> hlo = "%ar = f32[2000]{0} all-reduce(%p), replica_groups=[2,4]<=[8], to_apply=%add"
>>> mesh = jax.sharding.AbstractMesh((2, 4), ("x", "y"))
>>> print(summary(collectives(hlo, mesh)))
all-reduce  x1  8.0 kB  over ('y',)
"""

from __future__ import annotations

import dataclasses
import html
import io
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from minishard.hlo import KINDS, AnyMesh, collective_instructions, instruction_axes, shape_bytes
from minishard.tree import named_leaves

if TYPE_CHECKING:
    from minishard.rules import AxisRules


@dataclasses.dataclass(frozen=True)
class Collective:
    """Every collective instruction of one kind in a compiled program.

    * ``kind``: the HLO opcode, e.g. ``"all-reduce"``.
    * ``count``: how many such instructions the program text holds (one inside
      a loop body counts once, however often the loop runs).
    * ``bytes``: their result sizes on one device, summed.
    * ``axes``: the distinct device groupings they use, each as a tuple of mesh
      axis names, sorted: ``(("y",),)`` when all run over "y";
      ``(("x",), ("x", "y"))`` when some run over "x" and others over both.
      ``"y(2 of 4)"`` names a group holding only 2 of the 4 devices along "y";
      ``"?"`` a group that is no sub-grid of the mesh. For
      ``collective-permute``: the axes along which data moves.
    """

    kind: str
    count: int
    bytes: int
    axes: tuple[tuple[str, ...], ...]

    def __str__(self) -> str:
        return _row(self, width=len(self.kind))


def collectives(
    program: jax.stages.Lowered | jax.stages.Compiled | str, mesh: AnyMesh | None = None
) -> dict[str, Collective]:
    """The collectives of ``program``, keyed by kind, in ``KINDS`` order; ``{}`` if none.

    ``program`` is a ``jit(f).lower(...)`` (compiled here), its ``.compile()``,
    or compiled HLO text (then pass ``mesh``). The mesh names device positions;
    by default it is the one of the program's ``NamedSharding``\\ s. Async pairs (``all-gather-start``
    then ``all-gather-done``) count once: the start carries the groups, the done
    the result (the start's result is a bundle of buffers, not the result).
    """
    if isinstance(program, jax.stages.Lowered):
        program = program.compile()
    if isinstance(program, str):
        text = program
    else:
        mesh = _mesh_of(program) if mesh is None else mesh
        text = program.as_text() or ""
    count: dict[str, int] = dict.fromkeys(KINDS, 0)
    nbytes: dict[str, int] = dict.fromkeys(KINDS, 0)
    axes: dict[str, set[tuple[str, ...]]] = {kind: set() for kind in KINDS}
    for match in collective_instructions(text):
        kind, phase = match["kind"], match["phase"]
        if phase != "-start":
            nbytes[kind] += shape_bytes(match["shape"])
        if phase != "-done":
            if mesh is None:
                raise ValueError(f"found an {kind} but no mesh to name its devices; pass mesh=")
            count[kind] += 1
            axes[kind] |= instruction_axes(match.string, mesh)
    return {
        kind: Collective(kind, count[kind], nbytes[kind], tuple(sorted(axes[kind])))
        for kind in KINDS
        if count[kind]
    }


def summary(colls: Mapping[str, Collective]) -> str:
    """One aligned line per kind, e.g. ``all-reduce  x3  1.6 MB  over ('data',)``."""
    if not colls:
        return "no collectives: every device computes on its own shards alone"
    width = max(len(kind) for kind in colls)
    return "\n".join(_row(c, width) for c in colls.values())


def _row(c: Collective, width: int) -> str:
    over = ", ".join(str(names) for names in c.axes) or "()"
    return f"{c.kind:<{width}}  x{c.count}  {_human_bytes(c.bytes)}  over {over}"


def _human_bytes(n: int) -> str:
    """Decimal units, as interconnect bandwidths are quoted: 1628200 -> '1.6 MB'."""
    size, unit = float(n), "B"
    for bigger in ("kB", "MB", "GB", "TB"):
        if size < 1000:
            break
        size, unit = size / 1000, bigger
    return f"{n} B" if unit == "B" else f"{size:.1f} {unit}"


def _mesh_of(compiled: jax.stages.Compiled) -> AnyMesh | None:
    shardings = jax.tree.leaves((compiled.input_shardings, compiled.output_shardings))
    return next((s.mesh for s in shardings if isinstance(s, jax.sharding.NamedSharding)), None)


# --- explain: where every parameter lives, and what a step communicates -----
#
# ``collectives`` answers "what does this program send?". ``explain`` puts that
# next to the question before it, "what does each device hold?": one row per
# parameter, from ``minishard.sharding.plan`` (the same specs ``Sharded`` uses,
# not re-derived here), with the block each device keeps and its bytes.
#
# A rule of thumb from "How to Scale Your Model" (the scaling book) for reading
# the collectives: an all-gather or a reduce-scatter of B bytes costs about
# B / bandwidth; an all-reduce about twice that (it is a reduce-scatter followed
# by an all-gather).


@dataclasses.dataclass(frozen=True)
class Row:
    """One array of the tree: how big it is, and how much of it one device holds."""

    path: str  # "layers[0].weight"
    shape: tuple[int, ...]  # the whole array
    logical: tuple[str | None, ...]  # its logical axis names ("embed", "mlp")
    spec: jax.sharding.PartitionSpec  # what the rules turned them into
    shard_shape: tuple[int, ...]  # the block each device holds
    dtype: str  # "float32"
    bytes: int  # the whole array
    device_bytes: int  # one device's block


@dataclasses.dataclass(frozen=True)
class Report:
    """What ``explain`` found. ``str(report)`` is a plain-text table; with ``rich``
    installed, ``rich.print(report)`` (or a notebook cell) draws it as a rich table.

    * ``rows``: one ``Row`` per array, in the tree's order;
    * ``total_bytes``: all arrays, unsharded; ``device_bytes``: what one device holds;
    * ``collectives``: the step's collectives by kind, as ``collectives()`` returns
      them (``None`` when no step was given).
    """

    mesh: dict[str, int]
    rows: tuple[Row, ...]
    total_bytes: int
    device_bytes: int
    collectives: dict[str, Collective] | None = None
    step_name: str = "step"

    _HEADER = ("path", "shape", "logical axes", "spec", "bytes", "per device", "bytes/device")

    def _cells(self) -> list[tuple[str, ...]]:
        """The table's rows as strings, shared by the text and the rich renderings."""
        return [
            (
                row.path,
                str(row.shape),
                str(row.logical),
                str(row.spec),
                _human_bytes(row.bytes),
                str(row.shard_shape),
                _human_bytes(row.device_bytes),
            )
            for row in self.rows
        ]

    def _totals(self) -> str:
        ratio = self.total_bytes / self.device_bytes if self.device_bytes else 1.0
        return (
            f"total: {_human_bytes(self.total_bytes)} unsharded, "
            f"{_human_bytes(self.device_bytes)} per device ({ratio:.1f}x less)"
        )

    def _footer(self) -> list[str]:
        lines = [self._totals()]
        if self.collectives is not None:
            lines += [f"collectives of {self.step_name}:"]
            lines += ["  " + line for line in summary(self.collectives).splitlines()]
        return lines

    def __str__(self) -> str:
        n_devices = math.prod(self.mesh.values())
        table = [self._HEADER, *self._cells()]
        widths = [max(len(row[i]) for row in table) for i in range(len(self._HEADER))]
        lines = [f"mesh {self.mesh} ({n_devices} devices)"]
        lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table]
        lines.insert(2, "  ".join("-" * w for w in widths))  # under the header
        return "\n".join(lines + self._footer())

    def __rich__(self) -> Any:
        """A ``rich.table.Table``: rich calls this when printing the report."""
        from rich.table import Table  # optional dependency: imported only when rich renders

        table = Table(title=f"mesh {self.mesh}", caption="\n".join(self._footer()), caption_justify="left")
        for header in self._HEADER:
            numeric = header in ("bytes", "bytes/device")
            table.add_column(header, justify="right" if numeric else "left", no_wrap=header == "path")
        for cells in self._cells():
            table.add_row(*cells)
        return table

    def _repr_html_(self) -> str:
        """Notebooks: the rich table as HTML if rich is installed, else the text table."""
        try:
            from rich.console import Console
        except ImportError:
            return f"<pre>{html.escape(str(self))}</pre>"
        console = Console(record=True, width=160, file=io.StringIO())
        console.print(self)
        return console.export_html(inline_styles=True, code_format="<pre>{code}</pre>")


def explain(
    tree: Any,
    mesh: jax.sharding.Mesh,
    rules: AxisRules | None = None,
    step: Callable[..., Any] | None = None,
    args: Sequence[Any] | None = None,
) -> Report:
    """Every array of ``tree`` (a model, an optimizer state, ...) on ``mesh`` under ``rules``.

    Only the mesh's axis names and sizes are read, so a ``jax.sharding.AbstractMesh``
    will do, unless a step is to be compiled.

    With ``step`` and its example ``args``, the report also lists the
    collectives of the compiled step. ``step`` is a ``Sharded`` function (or
    anything with ``.lower``, such as a ``jax.jit`` function), or a plain
    function, which is then wrapped in ``Sharded(mesh, rules)``.

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
    >>> report.rows[0].device_bytes, report.total_bytes, report.device_bytes
    (128, 848, 224)
    """
    from minishard.sharding import Sharded, plan  # sharding.py is the layer above this module

    leaves = dict(named_leaves(tree))  # path -> array, for each row's dtype
    rows = []
    for leaf in plan(tree, mesh, rules):
        dtype = np.dtype(jnp.result_type(leaves[leaf.path]))
        shard_shape = leaf.shard_shape(mesh)
        rows.append(
            Row(
                path=leaf.path,
                shape=leaf.shape,
                logical=tuple(leaf.logical),
                spec=leaf.spec,
                shard_shape=shard_shape,
                dtype=dtype.name,
                bytes=math.prod(leaf.shape) * dtype.itemsize,
                device_bytes=math.prod(shard_shape) * dtype.itemsize,
            )
        )
    found = None
    if step is not None:
        if args is None:
            raise TypeError("explain: a step needs example args to compile it with, e.g. args=(model, batch)")
        sharded = step if hasattr(step, "lower") else Sharded(mesh, rules)(step)
        found = collectives(sharded.lower(*args))
    return Report(
        mesh=dict(mesh.shape),
        rows=tuple(rows),
        total_bytes=sum(row.bytes for row in rows),
        device_bytes=sum(row.device_bytes for row in rows),
        collectives=found,
        step_name=getattr(getattr(step, "fn", step), "__name__", "step"),
    )


__all__ = ["KINDS", "Collective", "Report", "Row", "collectives", "explain", "summary"]
