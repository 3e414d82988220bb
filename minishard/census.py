"""The census, ``collectives()``: what a sharded program sends between devices, read from its HLO.

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
compiled HLO, ``jax.jit(f).lower(*args).compile().as_text()``. A collective
there reads like::

    %all-reduce = f32[2000]{0} all-reduce(%fusion), channel_id=1,
                  replica_groups=[2,4]<=[8], use_global_device_ids=true, to_apply=%add

* ``f32[2000]{0}``: the result *on one device* (``{0}``: its dimensions' order in memory);
  long tuples of results are numbered with comments, ``/*index=5*/``;
* ``replica_groups``: which devices combine their values, written in one of
  three notations: explicit lists ``{{0,1,2,3},{4,5,6,7}}``, an iota
  ``[2,4]<=[8]`` (the numbers 0..7 reshaped to 2 groups of 4, optionally
  transposed: ``[4,2]<=[2,4]T(1,0)``), or XLA's own mesh,
  ``mesh['axis_0'=2,'axis_1'=4] {'axis_1'}`` (groups span the listed axes);
* ``source_target_pairs`` (collective-permute): who sends to whom.

Device numbers are positions in the flattened mesh, ``mesh.devices.flat``, so
a group translates back to mesh axis names: the axes along which its devices'
coordinates vary. Here, 2 groups of 4 devices each add up an f32[2000] on a
(2, 4) mesh of axes ("x", "y"): an all-reduce over "y".

>>> hlo = "%ar = f32[2000]{0} all-reduce(%p), replica_groups=[2,4]<=[8], to_apply=%add"
>>> mesh = jax.sharding.AbstractMesh((2, 4), ("x", "y"))
>>> print(summary(collectives(hlo, mesh)))
all-reduce  x1  8.0 kB  over ('y',)

Each kind's run is a ``Collective`` (the kinds in ``KINDS`` order); ``instructions`` yields each
instruction one at a time, as a ``Send``, and ``bytes_by_mesh_axes`` sums the bytes per kind and
mesh axes. A ``Program`` is what they read: a lowered or compiled program, or its HLO text, whose
mesh ``mesh_of`` finds. ``axis_name`` gives the mesh axis a group's label names, and
``human_bytes`` writes a byte count as interconnect bandwidths are quoted. On a CPU, ``as_asked``
gives the program with each collective in the dtype the program sends (section 2).

A rule of thumb from "How to Scale Your Model" (the scaling book) for reading
them: an all-gather or a reduce-scatter of B bytes costs about B / bandwidth;
an all-reduce about twice that (a reduce-scatter followed by an all-gather).
"""

from __future__ import annotations

import dataclasses
import glob
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Generic, NamedTuple, TypeVar

import jax

from minishard import _hlo
from minishard._hlo import KINDS, PartOfAxis, narrowed
from minishard.rules import AnyMesh

# --- 1. what a program sends ---------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Collective:
    """Every collective instruction of one kind in a compiled program.

    * ``kind``: the HLO opcode, e.g. ``"all-reduce"``.
    * ``count``: how many times such instructions run in one call of the program:
      one inside a loop body counts once per trip (``runs_per_call``), so a
      ``psum`` in a 5-step ``lax.scan`` counts 5; one in a loop whose trip count
      XLA cannot prove counts once.
    * ``bytes``: their result sizes on one device, summed over those runs.
    * ``mesh_axes``: the distinct device groupings they use, each as a tuple of
      mesh axis names, sorted: ``(("y",),)`` when all run over "y";
      ``(("x",), ("x", "y"))`` when some run over "x" and others over both.
      ``"y(2 of 4)"`` names a group holding only 2 of the 4 devices along "y";
      ``"?"`` a group that is no sub-grid of the mesh. For
      ``collective-permute``: the axes along which data moves.
    """

    kind: str
    count: int
    bytes: int
    mesh_axes: tuple[tuple[str, ...], ...]

    def __str__(self) -> str:
        return _row(self, width=len(self.kind))


Program = jax.stages.Lowered | jax.stages.Compiled | str


def collectives(program: Program, mesh: AnyMesh | None = None) -> dict[str, Collective]:
    """The collectives of ``program``, keyed by kind, in ``KINDS`` order; ``{}`` if none.

    ``program`` is a ``jit(f).lower(...)`` (compiled here), its ``.compile()``,
    or compiled HLO text (then pass ``mesh``). The mesh names device positions;
    by default it is the one of the program's ``NamedSharding``\\ s.
    """
    found: dict[str, Collective] = {}
    for send in instructions(program, mesh):
        kind = send.kind
        seen = found.get(kind, Collective(kind, 0, 0, ()))
        axes = tuple(sorted(set(seen.mesh_axes) | set(send.groups)))
        found[kind] = Collective(kind, seen.count + 1, seen.bytes + send.result_bytes, axes)
    return {kind: found[kind] for kind in KINDS if kind in found}


def bytes_by_mesh_axes(
    program: Program, mesh: AnyMesh | None = None
) -> dict[tuple[str, tuple[str, ...]], int]:
    r"""Bytes per (kind, mesh axes): separates, say, the all-reduce over "data" from the one over
    "model".

    >>> over_y = "%a = f32[8]{0} all-reduce(%p), replica_groups=[2,4]<=[8], to_apply=%add"
    >>> over_x = "%b = f32[2]{0} all-reduce(%q), replica_groups=[4,2]<=[2,4]T(1,0), to_apply=%add"
    >>> hlo = "\n".join([over_y, over_x])
    >>> bytes_by_mesh_axes(hlo, jax.sharding.AbstractMesh((2, 4), ("x", "y")))
    {('all-reduce', ('y',)): 32, ('all-reduce', ('x',)): 8}
    """
    found: dict[tuple[str, tuple[str, ...]], int] = {}
    for send in instructions(program, mesh):
        groups = send.groups
        mesh_axes = groups[0] if len(groups) == 1 else ("?",)  # groups of different shapes: rare
        found[send.kind, mesh_axes] = found.get((send.kind, mesh_axes), 0) + send.result_bytes
    return found


Bytes = TypeVar("Bytes", int, float)
"""A count of bytes: an ``int`` where the census counted them, a ``float`` where a layout predicts
a share of them (``Send[float]``)."""


class Send(NamedTuple, Generic[Bytes]):
    """One collective sent: its ``kind`` and ``result_bytes``, its result on one device, among
    ``devices`` in a group. The census reads each run of an instruction from a compiled program
    (``instructions``), with ``groups``, the mesh axes of each distinct group shape, sorted (nearly
    always one). A layout predicts the ones a step runs (``layouts.sends``): for a ``dimension``, in
    the ``backward`` pass or the forward, ``times`` over, among ``devices`` where fewer than the
    dimension's (0: all of them); ``of_weights``: its bytes are the weights' (whatever the batch),
    not the activations'."""

    kind: str
    result_bytes: Bytes
    devices: int = 0
    groups: tuple[tuple[str, ...], ...] = ()
    dimension: str = ""
    backward: bool = False
    times: int = 1
    of_weights: bool = False


def axis_name(label: str) -> str:
    """The mesh axis a group's label names: ``"y"`` for ``"y"`` and for ``"y(2 of 4)"``, 2 of its 4
    devices (``_hlo.PartOfAxis``); ``"?"`` for a group that is no sub-grid.

    >>> hlo = ("%ar = f32[8]{0} all-reduce(%p), "
    ...        "replica_groups={{0,1},{2,3},{4,5},{6,7}}, to_apply=%add")
    >>> [send] = instructions(hlo, jax.sharding.AbstractMesh((2, 4), ("x", "y")))
    >>> send.groups, [axis_name(label) for label in send.groups[0]]
    ((('y(2 of 4)',),), ['y'])
    """
    return label.axis if isinstance(label, PartOfAxis) else label


def instructions(program: Program, mesh: AnyMesh | None = None) -> Iterator[Send[int]]:
    """Each collective the program runs, in program order, as a ``Send``.

    An instruction inside a loop body is yielded once per trip (XLA's ``known_trip_count``).
    Async pairs (``all-gather-start`` then ``all-gather-done``) count once: the start carries the
    groups, the done the result; each done is paired with the oldest open start of its kind.
    XLA:TPU's ``all-reduce-scatter`` fusion (an all-reduce and the slice each device keeps) is one
    reduce-scatter.

    >>> hlo = ("%ar = f32[8]{0} all-reduce(%p), "
    ...        "replica_groups={{0,1},{2,3},{4,5},{6,7}}, to_apply=%add")
    >>> mesh = jax.sharding.AbstractMesh((2, 4), ("x", "y"))
    >>> [send] = instructions(hlo, mesh)  # 2 of the 4 along y
    >>> send.kind, send.result_bytes, send.groups, send.devices
    ('all-reduce', 32, (('y(2 of 4)',),), 2)
    """
    text, mesh = _text_and_mesh(program, mesh)
    started: dict[str, list[tuple[tuple[tuple[str, ...], ...], int]]] = {kind: [] for kind in KINDS}
    runs = _hlo.runs_per_call(text)
    fused = _hlo.fused_reduce_scatters(text)
    for computation, match in _hlo.located(text):
        kind, phase, nbytes = _hlo.sent_as(match, fused.get(computation))
        if phase == "-done":  # the result of a start seen before
            groups, devices = started[kind].pop(0) if started[kind] else ((("?",),), 1)
        else:
            groups, devices = _groups(kind, match.string, mesh)
        if phase == "-start":
            started[kind].append((groups, devices))
        else:
            yield from [Send(kind, nbytes, devices, groups)] * runs.get(computation, 1)


def _groups(
    kind: str,
    instruction: str,
    mesh: AnyMesh | None,
) -> tuple[tuple[tuple[str, ...], ...], int]:
    """The mesh axes of each distinct group shape of ``instruction``, sorted, and the devices in a
    group."""
    if mesh is None:
        raise ValueError(f"found an {kind} but no mesh to name its devices; pass mesh=")
    axes = tuple(sorted(_hlo.instruction_axes(instruction, mesh)))
    return axes, _hlo.group_size(instruction, mesh)


def _text_and_mesh(program: Program, mesh: AnyMesh | None) -> tuple[str, AnyMesh | None]:
    """The compiled HLO text, and the mesh that names its devices."""
    if isinstance(program, jax.stages.Lowered):
        program = program.compile()
    if isinstance(program, str):
        return program, mesh
    return program.as_text() or "", mesh_of(program) if mesh is None else mesh


def summary(found: Mapping[str, Collective]) -> str:
    """One aligned line per kind, e.g. ``all-reduce  x3  1.6 MB  over ('data',)``."""
    if not found:
        return "no collectives: every device computes on its own shards alone"
    width = max(len(kind) for kind in found)
    return "\n".join(_row(c, width) for c in found.values())


def _row(c: Collective, width: int) -> str:
    over = ", ".join(str(names) for names in c.mesh_axes) or "()"
    return f"{c.kind:<{width}}  x{c.count}  {human_bytes(c.bytes)}  over {over}"


def human_bytes(n: int) -> str:
    """Decimal units, as interconnect bandwidths are quoted: 1628200 -> '1.6 MB'."""
    size = float(n)
    unit = "B"
    for bigger in ("kB", "MB", "GB", "TB"):
        if size < 1000:
            break
        size = size / 1000
        unit = bigger
    return f"{n} B" if unit == "B" else f"{size:.1f} {unit}"


def mesh_of(compiled: jax.stages.Compiled) -> AnyMesh | None:
    shardings = jax.tree.leaves((compiled.input_shardings, compiled.output_shardings))
    return next((s.mesh for s in shardings if isinstance(s, jax.sharding.NamedSharding)), None)


# --- 2. bytes in the dtypes the program sends -----------------------------------
# XLA:CPU computes no bfloat16: a late pass (``float-normalization-bf16``) widens
# every bf16 collective to f32 between two converts, so the compiled CPU program
# moves twice the bytes a GPU or TPU would. XLA's SPMD partitioner, which inserts
# the collectives, wrote each in the dtype the program sends: ``as_asked(lowered)``
# is the compiled program with its collectives in those dtypes, and
# ``collectives(as_asked(lowered), mesh)`` counts the bytes an accelerator would move.


def as_asked(lowered: jax.stages.Lowered) -> str:
    """The compiled HLO text, each collective in the dtype XLA's SPMD partitioner wrote for it.

    Feed it to ``collectives`` or ``instructions`` (with ``mesh=``) to count the bytes a
    GPU or TPU would move, each collective in its own dtype (bfloat16 weights gathered,
    float32 gradients reduced). A float32 program comes back as it compiled.

    >>> mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    >>> psum = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "data"), mesh=mesh,
    ...                              in_specs=jax.P("data"), out_specs=jax.P()))
    >>> lowered = psum.lower(jax.numpy.ones(8 * 1024, jax.numpy.bfloat16))
    >>> on_cpu = collectives(lowered)["all-reduce"]
    >>> on_an_accelerator = collectives(as_asked(lowered), mesh)["all-reduce"]
    >>> on_cpu.bytes, on_an_accelerator.bytes
    (4096, 2048)
    """
    if not _hlo.names_a_narrow_float(lowered.as_text()):  # nothing to widen: compiled once, shared
        return lowered.compile().as_text() or ""
    with tempfile.TemporaryDirectory() as folder:  # the partitioner's output, dumped as it compiles
        dump: dict[str, str | bool] = {
            "xla_dump_to": folder,
            "xla_dump_hlo_pass_re": "spmd-partitioning",
        }
        text = lowered.compile(dump).as_text() or ""
        dumped = sorted(glob.glob(f"{folder}/*after_spmd-partitioning*"))
        if not dumped:  # 1 device: nothing dumped
            return text
        return narrowed(text, Path(dumped[0]).read_text())


__all__ = [
    "KINDS",
    "Collective",
    "Program",
    "Send",
    "as_asked",
    "axis_name",
    "bytes_by_mesh_axes",
    "collectives",
    "human_bytes",
    "instructions",
    "mesh_of",
    "summary",
]
