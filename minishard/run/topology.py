"""A TPU slice that is not here: compile a step for it ahead of time, and read what XLA:TPU makes of it.

``libtpu`` (``pip install 'minishard[tpu]'``) holds XLA:TPU, the compiler a Cloud
TPU runs. ``jax.experimental.topologies`` describes a slice by name, ``v5e:2x4``
(a generation, then chips along each axis of its torus), without owning one: its
devices make a mesh like any other, a step lowers on it, and ``.compile()`` is
XLA:TPU's real program, with its collectives, its memory and its FLOPs. Nothing
runs: those devices cannot hold an array. A real TPU adds the run times; the
program is the same one. MaxText's ``train_compile.py`` does this to catch an
out-of-memory before a job is scheduled.

    topology name -> devices -> mesh -> lower -> compile (XLA:TPU) -> census, memory, cost

``side_by_side`` compiles one step twice, for XLA:CPU's simulated devices and the
slice's, and puts what each compiler made of it in one table.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from minishard.census import KINDS, Collective, collectives, human_bytes, mesh_of
from minishard.costs import Memory
from minishard.sharding import Sharded, ShardedFunction, make_mesh

__all__ = [
    "GENERATIONS",
    "INSTALL",
    "CompiledStep",
    "LoweredOnce",
    "TORUS_AXES",
    "chip_count",
    "compile_for",
    "hardware_of",
    "on_cpu_and_tpu",
    "overlapped",
    "side_by_side",
    "tpu_devices",
]

GENERATIONS = {"v4": "v4p", "v5e": "v5e", "v5p": "v5p", "v6e": "v6e"}
"""The TPU generations a topology may name, each with its entry of ``minishard.hardware.HARDWARE``."""
TORUS_AXES = {"v4": 3, "v5e": 2, "v5p": 3, "v6e": 2}
"""Each generation's chips are a torus of this many axes (v5e and v6e: 2-d slices; v4 and v5p: 3-d);
XLA:TPU would accept a shape of another rank, and describe a slice that is not sold."""
INSTALL = "pip install 'minishard[tpu]'"
_OPCODE = re.compile(  # `%name = SHAPE opcode(%first_operand, ...`
    r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+)\s*=\s*.*?\s(?P<op>[a-z][\w\-]*)\((?P<operand>%[\w.\-]+)?"
)
_NAME = re.compile(r"(?P<generation>[a-z0-9]+):(?P<shape>\d+(x\d+){1,2})")


def tpu_devices(topology: str) -> list[jax.Device]:
    """The devices of the TPU slice ``topology`` ("v5e:2x4": 8 chips), to make a mesh of and compile on.

    A name that is no topology, an unknown generation, or a shape XLA:TPU refuses
    is one ``ValueError`` line naming it; so is a missing libtpu (with how to install it).
    """
    generation, shape = _parse(topology)
    if importlib.util.find_spec("libtpu") is None:
        raise ValueError(f"compiling for {topology} needs XLA:TPU, which libtpu holds: {INSTALL}")
    from jax.experimental import topologies

    chips = [int(n) for n in shape.split("x")]
    per_host = (min(chips[0], 2), min(chips[1], 2), 1)  # a host holds at most 2x2 chips
    try:
        description = topologies.get_topology_desc(
            platform="tpu",
            topology_name=topology,
            chip_config_name="megacore" if generation == "v4" else "default",  # one device per chip, as
            # jax.make_mesh needs; a v4 chip's two cores are otherwise two devices
            chips_per_host_bounds=per_host,
            num_slices=1,
        )
    except jax.errors.JaxRuntimeError as error:  # "INVALID_ARGUMENT: Topology layout ... is not divisible"
        why = str(error).splitlines()[0].split(": ", 1)[-1]
        raise ValueError(f"XLA:TPU refuses the topology {topology!r}: {why}") from None
    return list(description.devices)


def chip_count(topology: str) -> int:
    """The chips of a topology, read from its name before JAX starts: ``"v5e:2x4"`` -> 8."""
    return math.prod(int(n) for n in _parse(topology)[1].split("x"))


def hardware_of(topology: str) -> str:
    """The ``HARDWARE`` entry a topology's chips are priced with: ``"v5e:2x4"`` -> ``"v5e"``."""
    return GENERATIONS[_parse(topology)[0]]


def _parse(topology: str) -> tuple[str, str]:
    """``"v5e:2x4"`` -> ``("v5e", "2x4")``; anything else is refused by name."""
    found = _NAME.fullmatch(topology)
    if found is None:
        raise ValueError(f"topology {topology!r}: write GENERATION:SHAPE, e.g. v5e:2x4 or v5p:2x2x2")
    if found["generation"] not in GENERATIONS:
        known = ", ".join(GENERATIONS)
        raise ValueError(f"topology {topology!r}: unknown TPU generation {found['generation']!r} ({known})")
    generation, shape = found["generation"], found["shape"]
    if (axes := TORUS_AXES[generation]) != len(sizes := shape.split("x")):
        example = "x".join(["2"] * axes)
        raise ValueError(
            f"topology {topology!r}: a {generation} slice is a {axes}-d torus of chips, "
            f"not {len(sizes)}-d; "
            f"write {axes} sizes, e.g. {generation}:{example}"
        )
    return generation, shape


@dataclasses.dataclass(frozen=True)
class CompiledStep:
    """What one compiler made of a step, per device: its collectives (``minishard.collectives``),
    memory (``costs.Memory``), ``cost_analysis()``'s FLOPs and bytes accessed, and the compile time."""

    compiler: str  # "XLA:CPU", "XLA:TPU"
    collectives: dict[str, Collective]
    memory: Memory
    flops: float
    bytes_accessed: float
    compile_s: float
    text: str  # the compiled HLO, for what no column shows (the -start/-done pairs)


def compile_for(lowered: jax.stages.Lowered) -> CompiledStep:
    """Compile ``lowered`` (timed) and read the program: the platform of its devices names the compiler."""
    start = time.perf_counter()
    compiled = lowered.compile()
    seconds = time.perf_counter() - start
    analysis = compiled.cost_analysis() or {}
    mesh = mesh_of(compiled)
    platform = mesh.devices.flat[0].platform if isinstance(mesh, jax.sharding.Mesh) else "?"
    return CompiledStep(
        compiler=f"XLA:{platform.upper()}",
        collectives=collectives(compiled),
        memory=Memory.of(compiled),
        flops=float(analysis.get("flops", 0.0)),
        bytes_accessed=float(analysis.get("bytes accessed", 0.0)),
        compile_s=seconds,
        text=compiled.as_text() or "",
    )


class LoweredOnce(ShardedFunction):
    """A ``Sharded`` step lowered once per argument shapes, so compiled once: ``explain``'s census, its
    price and ``on_cpu_and_tpu`` share one XLA:TPU compile (a GPT's is minutes on 2 cores).

    ``Lowered.compile()`` keeps its executable, but every ``lower`` makes a new ``Lowered``.
    """

    def __init__(self, fn: Callable[..., Any], config: Sharded) -> None:
        super().__init__(fn, config)
        self._lowered: dict[Any, jax.stages.Lowered] = {}

    def lower(self, *args: Any) -> jax.stages.Lowered:
        leaves, treedef = jax.tree.flatten(args)
        key = treedef, tuple((np.shape(leaf), str(getattr(leaf, "dtype", type(leaf)))) for leaf in leaves)
        if key not in self._lowered:
            self._lowered[key] = super().lower(*args)
        return self._lowered[key]


def on_cpu_and_tpu(step: ShardedFunction, args: Sequence[Any]) -> list[CompiledStep]:
    """``step`` (a ``Sharded`` function on a topology's mesh) compiled twice: by XLA:CPU, on as many
    simulated CPU devices in a mesh of the same shape, and by XLA:TPU, as it is."""
    config = step.config
    cpu_mesh = make_mesh(dict(config.mesh.shape), devices=jax.devices("cpu")[: config.mesh.size])
    on_cpu = Sharded(cpu_mesh, config.rules, config.batch_axis)(step.fn)
    return [compile_for(on_cpu.lower(*args)), compile_for(step.lower(*args))]


def overlapped(text: str) -> dict[str, list[str]]:
    """Each asynchronous collective (``all-gather-start`` ... ``all-gather-done``) of a scheduled
    program, by the name of its start, with the opcodes XLA placed between its halves: the work it
    overlaps with the transfer. A compiled program's text is in its execution order.

    >>> overlapped("\\n".join(["%s = f32[8] all-gather-start(%p)", "%f = f32[8] fusion(%q)",
    ...                         "%d = f32[8] all-gather-done(%s)"]))
    {'s': ['fusion']}
    """
    running: dict[str, list[str]] = {}
    found: dict[str, list[str]] = {}
    for line in text.splitlines():
        if (instruction := _OPCODE.match(line)) is None:
            continue
        op, kind = instruction["op"], instruction["op"].rpartition("-")[0]
        if kind in KINDS and op.endswith("-start"):
            running[instruction["name"]] = []
        elif kind in KINDS and op.endswith("-done") and (start := instruction["operand"][1:]) in running:
            found[start] = running.pop(start)
        else:
            for between in running.values():
                between.append(op)
    return found


def side_by_side(programs: Sequence[CompiledStep]) -> str:
    """One column per compiler: each collective kind (count, bytes, mesh axes), memory, FLOPs, compiling."""
    kinds = list(dict.fromkeys(kind for program in programs for kind in program.collectives))
    rows: dict[str, list[str]] = {"": [program.compiler for program in programs]}
    for kind in kinds:
        rows[kind] = [_sent(program.collectives.get(kind)) for program in programs]
    numbers: Mapping[str, Any] = {
        "arguments": lambda p: human_bytes(p.memory.arguments),
        "outputs": lambda p: human_bytes(p.memory.outputs),
        "temporaries": lambda p: human_bytes(p.memory.temporaries),
        "FLOPs": lambda p: f"{p.flops:.3g}",
        "bytes accessed": lambda p: human_bytes(int(p.bytes_accessed)),
        "async pairs": _async,
        "compile time": lambda p: f"{p.compile_s:.1f} s",
    }
    rows.update({name: [show(program) for program in programs] for name, show in numbers.items()})
    widths = [max(len(row[i]) for row in rows.values()) for i in range(len(programs))]
    first = max(len(name) for name in rows)
    return "\n".join(
        f"  {name:<{first}}  " + "  ".join(f"{cell:<{w}}" for cell, w in zip(cells, widths)).rstrip()
        for name, cells in rows.items()
    )


def _async(program: CompiledStep) -> str:
    """``x2, 31 ops between``: the asynchronous collectives, and what runs while they travel."""
    pairs = overlapped(program.text)
    return f"x{len(pairs)}, {sum(map(len, pairs.values()))} ops between" if pairs else "-"


def _sent(found: Collective | None) -> str:
    """``x2 1.6 MB over data``, or ``-`` where a compiler emits none of that kind."""
    if found is None:
        return "-"
    axes = "; ".join(",".join(names) for names in found.mesh_axes)
    return f"x{found.count} {human_bytes(found.bytes)} over {axes}"
