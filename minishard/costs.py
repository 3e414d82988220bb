"""What a step costs: a roofline read from the compiled program, in the scaling book's terms.

XLA says what a compiled step *computes* (``cost_analysis()["flops"]``, per
device), *holds* (``memory_analysis()``) and, read by ``minishard.collectives``,
*sends*. Priced with one accelerator's numbers, that is the reasoning of "How to
Scale Your Model" (jax-ml/scaling-book) applied to *your* step:

* compute: FLOPs / peak bf16 FLOP/s;
* a collective of a whole array of V bytes over n devices with link bandwidth W
  (sharding chapter): all-gather and reduce-scatter V / W, all-reduce 2V / W (a
  reduce-scatter then an all-gather), all-to-all V / 4W on a bidirectional TPU
  ring; behind an NVLink switch (GPU chapter) times the ring factor (n - 1) / n,
  and an all-to-all V (n - 1) / (n² W). Never below the hops' latency (~1 µs each);
* the step: gradients' collectives hide behind the backward pass (2/3 of a
  training step's FLOPs), not the forward pass, as in the training chapter:
  T = T_compute / 3 + max(2/3 T_compute, T_comms); communication-bound by x k
  when T_comms = k · 2/3 T_compute with k > 1;
* the flip: data parallelism and FSDP send weights, whose bytes do not grow with the
  batch: the verdict flips at the per-device batch x k; for data parallelism, C / W.

>>> round(collective_time("all-gather", 2048 * 8192 * 2, 4, HARDWARE["v5e"]) * 1e6)  # µs, pop quiz 2
373
>>> round(critical_batch(HARDWARE["v5p"]))  # tokens per chip where data parallelism flips
2550
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax

from minishard._hardware import HARDWARE, Hardware, hardware_named
from minishard.census import as_asked, human_bytes, instructions, mesh_of
from minishard.presets import PRESETS, preset
from minishard.rules import AnyMesh, AxisRules, ShardingError
from minishard.sharding import Sharded, make_mesh

BACKWARD = 2 / 3  # the share of a training step's FLOPs that communication can hide behind


# --- 1. one collective ------------------------------------------------------------
# Share of V / W each kind costs: (on a torus ring, behind a switch of n GPUs).
_SHARE: dict[str, Callable[[int], tuple[float, float]]] = {
    "all-gather": lambda n: (1.0, (n - 1) / n),
    "reduce-scatter": lambda n: (1.0, (n - 1) / n),
    "all-reduce": lambda n: (2.0, 2 * (n - 1) / n),
    "all-to-all": lambda n: (0.25, (n - 1) / n**2),
    "collective-permute": lambda n: (2.0, 1.0),  # one block to one neighbour, one direction
}


def collective_time(kind: str, nbytes: float, devices: int, hardware: Hardware, axes: int = 1) -> float:
    """Seconds for one collective over ``devices``, whose result on one device is ``nbytes``.

    ``nbytes`` is what ``minishard.collectives`` reports: for an all-gather the
    gathered array, for a reduce-scatter or an all-to-all one device's 1/n of it.
    """
    if devices <= 1:
        return 0.0
    whole = nbytes * devices if kind in ("reduce-scatter", "all-to-all") else nbytes  # the book's V
    torus, switch = _SHARE[kind](devices)
    share = torus if hardware.topology == "torus" else switch
    hops = 1 if kind == "collective-permute" else devices / 2 if hardware.topology == "torus" else devices - 1
    floor = hops * hardware.latency * (2 if kind == "all-reduce" else 1)
    return max(floor, whole * share / hardware.bandwidth(devices, axes))


def critical_batch(hardware: Hardware, devices: int | None = None, axes: int = 1) -> float:
    """Examples (tokens) per device above which data parallelism is compute-bound: C / W.

    Per weight of P parameters, the backward pass does 2 matmuls of 2·b·P FLOPs
    on b examples while the all-reduce moves 2P bf16 bytes twice (2 · 2P / W):
    they are equal at b = C / W. Behind a switch of ``devices`` GPUs the ring
    factor (n - 1) / n lowers it (the book's 2,200 for H100 drops it, n → ∞).
    """
    ring = 1.0 if devices is None or hardware.topology == "torus" else (devices - 1) / devices
    return hardware.flops * ring / hardware.bandwidth(devices or 1, axes)


# --- 2. one compiled step ----------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Memory:
    """``memory_analysis()`` per device: arguments (parameters, optimizer state,
    the batch), outputs, temporaries (activations kept for the backward pass,
    gathered weights); ``aliased``: outputs written over donated arguments."""

    arguments: int
    outputs: int
    temporaries: int
    aliased: int = 0

    @property
    def total(self) -> int:
        return self.arguments + self.outputs + self.temporaries - self.aliased


@dataclasses.dataclass(frozen=True)
class StepCost:
    """One step's predicted time on ``hardware``, per device. ``communication``:
    ``(kind, bytes, seconds)`` per collective kind; ``batch``: examples per device."""

    hardware: Hardware
    flops: float
    bytes_accessed: float
    communication: tuple[tuple[str, int, float], ...]
    memory: Memory
    batch: float | None = None
    overlap: float = BACKWARD

    compute_s = property(lambda self: self.flops / self.hardware.flops)
    hbm_s = property(lambda self: self.bytes_accessed / self.hardware.hbm_bandwidth)
    comm_s = property(lambda self: sum(seconds for _, _, seconds in self.communication))

    @property
    def step_s(self) -> float:
        """Forward pass, then the backward pass and the communication overlapped."""
        hidden = self.overlap * self.compute_s
        return self.compute_s - hidden + max(hidden, self.comm_s)

    @property
    def bound(self) -> float:
        """k = communication / the compute it can hide behind: > 1 means communication-bound."""
        hidden = self.overlap * self.compute_s
        return self.comm_s / hidden if hidden else math.inf if self.comm_s else 0.0

    @property
    def verdict(self) -> str:
        return "compute-bound" if self.bound <= 1 else f"communication-bound by x{self.bound:.1f}"

    @property
    def flip_batch(self) -> float | None:
        """Per-device batch where the verdict flips, if the bytes do not grow with the batch."""
        return None if self.batch is None or not self.comm_s else self.batch * self.bound

    def __str__(self) -> str:
        hw, mem, size = self.hardware, self.memory, human_bytes
        sent = ", ".join(f"{kind} {size(n)} {_time(s)}" for kind, n, s in self.communication) or "none"
        flip = f"; flips at {self.flip_batch:,.0f} examples per device" if self.flip_batch else ""
        return "\n".join([
            f"predicted step on {hw.name}" + (f", {self.batch:g} examples per device" if self.batch else ""),
            f"  compute        {_time(self.compute_s):>9}  {self.flops:.3g} FLOP at {hw.flops:.3g} FLOP/s",
            f"  communication  {_time(self.comm_s):>9}  {sent}",
            f"  HBM traffic    {_time(self.hbm_s):>9}  {size(int(self.bytes_accessed))} (XLA:CPU's count)",
            f"  step           {_time(self.step_s):>9}  {self.verdict}{flip}",
            f"  memory/device  {size(mem.total)} of {size(int(hw.hbm_bytes))}: arguments "
            f"{size(mem.arguments)}, outputs {size(mem.outputs)}, temporaries {size(mem.temporaries)}",
        ])  # fmt: skip


def step_cost(
    program: jax.stages.Lowered | jax.stages.Compiled,
    hardware: Hardware | str = "v5p",
    *,
    batch: float | None = None,
    mesh: AnyMesh | None = None,
    overlap: float = BACKWARD,
) -> StepCost:
    """Price a lowered (or compiled) step on ``hardware`` (a ``Hardware`` or a key of ``HARDWARE``: "v5p").

    Given the ``Lowered`` program, bytes are counted in the float type it asked
    for (``collectives.as_asked``: XLA:CPU widens bf16 collectives to f32); a
    ``Compiled`` one is counted as compiled. ``batch``: examples per device.
    """
    hardware = hardware_named(hardware)
    lowered = program if isinstance(program, jax.stages.Lowered) else None
    compiled = lowered.compile() if lowered is not None else program
    assert isinstance(compiled, jax.stages.Compiled)
    mesh = mesh if mesh is not None else mesh_of(compiled)
    text = as_asked(lowered) if lowered is not None else compiled.as_text() or ""
    analysis = compiled.cost_analysis() or {}  # per device: XLA analyses the partitioned program
    stats = compiled.memory_analysis()
    memory = Memory(
        *(getattr(stats, f"{name}_size_in_bytes") for name in ("argument", "output", "temp", "alias"))
    )
    return StepCost(
        hardware, float(analysis.get("flops", 0.0)), float(analysis.get("bytes accessed", 0.0)),
        _communication(text, mesh, hardware), memory, batch, overlap,
    )  # fmt: skip


def cost_report(
    step: Callable[..., Any], args: Sequence[Any], mesh: AnyMesh, rules: AxisRules | None,
    hardware: Hardware | str = "v5p",
) -> StepCost:  # fmt: skip
    """``step_cost`` of ``Sharded(mesh, rules)(step)`` on example ``args``, whose last is the batch.

    The batch per device is the batch's leading dimension over the mesh axes
    the ``batch`` rule names (the whole batch when it has none). A ``step`` with
    ``.lower`` (a ``Sharded`` function, a ``zero.ZeroStep``) is lowered as it is;
    ``rules`` then only says how the batch splits.
    """
    sharded = step if hasattr(step, "lower") else Sharded(mesh, rules)(step)  # type: ignore[arg-type]
    global_batch = jax.tree.leaves(args[-1])[0].shape[0]
    entry = rules.spec(("batch",), mesh)[0] if rules and "batch" in rules else None
    names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    split = math.prod(mesh.shape[name] for name in names)
    return step_cost(sharded.lower(*args), hardware, batch=global_batch / split)


# --- 3. every layout, ranked -------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Layout:
    """One preset on one mesh shape; ``cost`` is None when the model does not divide over it."""

    style: str
    mesh: dict[str, int]
    cost: StepCost | None
    why: str = ""


@dataclasses.dataclass(frozen=True)
class Comparison:
    """Every layout ``compare`` tried, fastest predicted step first."""

    hardware: Hardware
    layouts: tuple[Layout, ...]

    def __str__(self) -> str:
        lines = [f"  {'style':8} {'mesh':18} {'step':>9} {'compute':>9} {'comms':>9} {'memory':>9}  verdict"]
        for i, layout in enumerate(self.layouts):
            cost, shape, t = layout.cost, "x".join(f"{k}={v}" for k, v in layout.mesh.items()), _time
            head = f"{'* ' if i == 0 and cost else '  '}{layout.style:8} {shape:18} "
            if cost is None:
                lines.append(head + layout.why)
                continue
            cells = (t(cost.step_s), t(cost.compute_s), t(cost.comm_s), human_bytes(cost.memory.total))
            lines.append(head + " ".join(f"{cell:>9}" for cell in cells) + f"  {cost.verdict}")
        return "\n".join([*lines, f"(* the fastest predicted step on {self.hardware.name})"])


def mesh_shapes(style: str, devices: int) -> list[dict[str, int]]:
    """Every way to lay ``devices`` on the preset's mesh axes: one for a 1-D style, each divisor for 2-D."""
    shape, _ = preset(style, devices)
    if len(shape) == 1:
        return [shape]
    first, second = shape
    return [{first: d, second: devices // d} for d in range(1, devices + 1) if devices % d == 0]


def compare(
    step: Callable[..., Any], args: Sequence[Any], hardware: Hardware | str = "v5p", devices: int = 0
) -> Comparison:
    """``cost_report`` of ``step`` under every preset and every mesh shape of ``devices``, fastest first.

    ``args`` are the step's example arguments (model, optimizer state, batch);
    ``devices``: 0 for all of them. Each layout compiles once.
    """
    hardware = hardware_named(hardware)
    devices = devices or jax.device_count()  # 0: all of them
    layouts = []
    for style in PRESETS:
        rules = preset(style, devices)[1]
        for shape in mesh_shapes(style, devices):
            try:
                cost = cost_report(step, args, make_mesh(shape), rules, hardware)
            except ShardingError as error:  # "... dimension 1 (logical axis 'heads') has size 4, which ..."
                layouts.append(Layout(style, shape, None, str(error).split(", ", 1)[-1].split(";")[0]))
                continue
            layouts.append(Layout(style, shape, cost))
    fastest = sorted(layouts, key=lambda layout: math.inf if layout.cost is None else layout.cost.step_s)
    return Comparison(hardware, tuple(fastest))


def _communication(text: str, mesh: AnyMesh | None, hardware: Hardware) -> tuple[tuple[str, int, float], ...]:
    """``(kind, bytes, seconds)`` per kind: each instruction priced over its own group of devices."""
    sent: dict[str, tuple[int, float]] = {}
    for kind, nbytes, groups in instructions(text, mesh):
        seconds = collective_time(kind, nbytes, _group_size(groups[0], mesh), hardware, axes=len(groups[0]))
        total, time = sent.get(kind, (0, 0.0))
        sent[kind] = (total + nbytes, time + seconds)
    return tuple((kind, n, s) for kind, (n, s) in sent.items())


def _group_size(axes: tuple[str, ...], mesh: AnyMesh | None) -> int:
    """Devices in a group over ``axes``: "data" is the whole axis, "data(2 of 4)" two of it."""
    if mesh is None or "?" in axes:
        return 1 if mesh is None else math.prod(mesh.axis_sizes)
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    return math.prod(int(a.split("(")[1].split()[0]) if "(" in a else sizes[a] for a in axes)


def _time(seconds: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds * 1e9:.3g} ns"


__all__ = [
    "BACKWARD", "HARDWARE", "Comparison", "Hardware", "Layout", "Memory", "StepCost", "collective_time",
    "compare", "cost_report", "critical_batch", "mesh_shapes", "step_cost",
]  # fmt: skip
