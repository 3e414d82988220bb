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
* HBM: bytes accessed / HBM bandwidth, and one chip's step is the longer of the two,
  T_chip = max(T_compute, T_HBM) (the roofline), where the bytes are *the chip's* program's:
  XLA:TPU's count after fusion. XLA:CPU's counts every operand of its unfused ops (2-3x the
  chip's here), so a CPU-compiled step is priced by its compute alone, its HBM line shown;
* the step: gradients' collectives hide behind the backward pass (2/3 of a
  training step's FLOPs), not the forward pass, as in the training chapter:
  T = T_chip / 3 + max(2/3 T_chip, T_comms); communication-bound by x k
  when T_comms = k · 2/3 T_chip with k > 1;
* a ring (context parallelism) sends each K/V chunk behind one step's attention of it: hidden
  while seq·q_heads/(kv_heads·|CP|), MaxText's intensity, is large enough (``ring_bound``);
* the flip: data parallelism and FSDP send weights, whose bytes do not grow with the
  batch: the verdict flips at the per-device batch x k; for data parallelism, C / W
  (``critical_batch``).

The chapter's names, section by section. One collective: ``collective_time`` prices it on a
``Hardware`` (``HARDWARE`` by name), and ``sent_bytes`` counts the bytes each device sends on a
ring. Where a step flips: ``critical_batch`` for data parallelism, ``mixed_critical_batch`` for
FSDP beside TP, ``hbm_critical_batch`` for a matmul against HBM, and ``ring_bound`` for a ring
against its attention. One compiled step: ``step_cost`` prices it as a ``StepCost`` (with its
``Memory``; the collectives hide behind ``BACKWARD``, the backward pass's share of the FLOPs),
``compiled_for_a_chip`` says whether its HBM bytes are a chip's, and ``cost_report`` prices a step
function on example arguments. Ranked: ``compare`` prices every style on each of its
``mesh_shapes``, a ``Comparison`` of ``Candidate`` rows. What the model computes: ``model_flops``,
three times the ``matmul_flops`` of its forward pass.

>>> all_gather = collective_time("all-gather", 2048 * 8192 * 2, 4, HARDWARE["v5e"])
>>> round(all_gather * 1e6)  # µs, pop quiz 2
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
import jax.extend

from minishard import _checks_costs
from minishard._hlo import repeated_dot_flops
from minishard.census import as_asked, human_bytes, instructions, mesh_of
from minishard.hardware import HARDWARE, Hardware, hardware_named
from minishard.rules import AnyMesh, AxisRules, ShardingError
from minishard.sharding import Sharded, make_mesh
from minishard.styles import ANY_MODEL, mesh_rules

BACKWARD = 2 / 3  # the share of a training step's FLOPs that communication can hide behind


# --- 1. one collective ------------------------------------------------------------
# Share of V / W each kind costs: (on a torus ring, behind a switch of n GPUs).
_SHARE: dict[str, Callable[[int], tuple[float, float]]] = {
    "all-gather": lambda n: (1.0, (n - 1) / n),
    "reduce-scatter": lambda n: (1.0, (n - 1) / n),
    "all-reduce": lambda n: (2.0, 2 * (n - 1) / n),
    "all-to-all": lambda n: (0.25, (n - 1) / n**2),
    "collective-permute": lambda n: (2.0, 1.0),  # one shard to one neighbour, one direction
}


def collective_time(
    kind: str,
    nbytes: float,
    devices: int,
    hardware: Hardware | str,
    n_axes: float = 1,
    inner: int = 1,
) -> float:
    """Seconds for one collective over ``devices`` (along ``n_axes`` mesh axes, each ``inner``
    devices apart: ``Hardware.bandwidth``), whose result on one device is ``nbytes``.

    ``nbytes`` is what ``minishard.collectives`` reports: for an all-gather the gathered array, for
    a reduce-scatter or an all-to-all one device's 1/n of it. W is
    ``hardware.bandwidth(devices, n_axes)`` (``minishard.hardware``); ``hardware`` may be its name.
    """
    _checks_costs.collective(kind, nbytes, devices, tuple(_SHARE))
    hardware = hardware_named(hardware)
    if devices <= 1:
        return 0.0
    torus, switch = _SHARE[kind](devices)
    share = torus if hardware.topology == "torus" else switch
    around = devices / 2 if hardware.topology == "torus" else devices - 1  # the hops round the ring
    hops = 1 if kind == "collective-permute" else around
    floor = hops * hardware.latency * (2 if kind == "all-reduce" else 1)
    width = hardware.bandwidth(devices, n_axes, inner, point_to_point=kind == "collective-permute")
    return max(floor, _whole(kind, nbytes, devices) * share / width)


def sent_bytes(kind: str, result_bytes: float, p: int) -> float:
    """The bytes each of ``p`` devices sends on a ring, for a collective whose result on it has
    ``result_bytes`` (what ``minishard.collectives`` counts): the book's V times the ring factor.

    An all-gather of V sends ``(p-1)/p·V``; a reduce-scatter, whose result is V/p, the
    same; an all-reduce is the two in turn, ``2(p-1)/p·V``.

    >>> sent_bytes("all-gather", 4096, 4), sent_bytes("reduce-scatter", 1024, 4)   # p = 4
    (3072.0, 3072.0)
    >>> sent_bytes("all-reduce", 4096, 4)
    6144.0
    """
    return _whole(kind, result_bytes, p) * _SHARE[kind](p)[1]


def _whole(kind: str, result_bytes: float, devices: int) -> float:
    """The book's V, the whole array, from one device's result (1/n of it for these two kinds)."""
    return result_bytes * devices if kind in ("reduce-scatter", "all-to-all") else result_bytes


def critical_batch(
    hardware: Hardware | str,
    devices: int | None = None,
    n_axes: float = 1,
) -> float:
    """Examples (tokens) per device above which data parallelism is compute-bound: C / W.

    The scaling book's derivation (training chapter), the one minishard uses. Per weight of
    P parameters, b examples per device: the forward pass (2bP FLOPs) sends nothing; the
    backward pass does two matmuls (the weight's gradient and the input's, 4bP FLOPs), and
    behind them hides the gradient's all-reduce of 2P bf16 bytes, 2 · 2P / W. Equal at
    b = C / W. So the overlap is the backward pass only (``BACKWARD``, 2/3 of the FLOPs);
    float32 gradients double it, 2 C / W; FSDP (all-gather + reduce-scatter) keeps it.
    Behind a switch of ``devices`` GPUs the ring factor (n - 1) / n lowers it (the book's
    2,200 for H100 drops it, n → ∞).
    """
    _checks_costs.optional_count("critical_batch: devices", devices)
    hardware = hardware_named(hardware)
    ring = 1.0 if devices is None or hardware.topology == "torus" else (devices - 1) / devices
    return hardware.flops * ring / hardware.bandwidth(devices or 1, n_axes)


def mixed_critical_batch(
    hardware: Hardware | str, hidden: int, fsdp_axes: int = 2, tensor_axes: int = 1
) -> float:
    """Tokens per device below which FSDP + TP waits on its collectives at best:
    ``4 a^2 / (M_X M_Y F)``.

    a = C / W (``critical_batch``), F the MLP's width; FSDP over M_X torus axes, TP over
    M_Y. On a 3D torus M_X M_Y = 2: ``2 a^2 / F``, about half of what FSDP alone needs.
    """
    alpha = critical_batch(hardware)
    return 4 * alpha**2 / (fsdp_axes * tensor_axes * hidden)


def hbm_critical_batch(hardware: Hardware | str, weight_bytes: float = 2) -> float:
    """Tokens a matmul must multiply each weight by to outrun reading it from HBM: ``C · w / 2W``.

    Per weight of ``weight_bytes`` (bf16: 2), B tokens do 2B FLOPs and read w bytes: equal at
    ``2B / C = w / W`` (the chips cancel: each reads its share of the weights and does its share of
    the FLOPs). A decode step's batch (a token a sequence, ``serving.decode_critical_batch``) and a
    pipeline's microbatch (``layouts.microbatches``) alike; int8 weights halve it.

    >>> round(hbm_critical_batch("v5e"), 1), round(hbm_critical_batch("v5e", 1), 1)
    (243.2, 121.6)
    """
    hardware = hardware_named(hardware)
    return hardware.flops * weight_bytes / (2 * hardware.hbm_bandwidth)


def ring_bound(
    seq: int,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    devices: int,
    hardware: Hardware,
    batch: int = 1,
) -> float:
    """k = a causal zig-zag ring step's sends over the attention they hide behind; > 1: the ring
    waits.

    Each of the p = ``devices`` holds c = seq / p tokens. A step attends them to one K/V chunk
    of c tokens, 4·b·c²·q_heads·head_dim FLOPs, half of it causal (zig-zag: on every device
    alike), while the next K and V chunks leave: 2·b·c·kv_heads·head_dim bf16 bytes. FLOPs per
    byte go as c·q_heads/kv_heads: MaxText's intensity seq·q_heads/(kv_heads·|CP|). A longer
    context hides the ring; more devices on the same context expose it.

    >>> llama3_8b = [ring_bound(seq, 32, 8, 128, 8, HARDWARE["v5p"]) for seq in (8192, 32768)]
    >>> [round(k, 2) for k in llama3_8b]
    [2.49, 0.62]
    """
    chunk = seq / devices
    flops = 4 * batch * chunk**2 * q_heads * head_dim / 2
    kv_bytes = batch * chunk * kv_heads * head_dim * 2
    sends = 2 * collective_time("collective-permute", kv_bytes, devices, hardware)
    attention = flops / hardware.flops
    return sends / attention


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

    @classmethod
    def of(cls, compiled: jax.stages.Compiled) -> Memory:
        stats = compiled.memory_analysis()
        kinds = ("argument", "output", "temp", "alias")
        return cls(*(getattr(stats, f"{kind}_size_in_bytes") for kind in kinds))


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
    chips_bytes: bool = False  # bytes_accessed counted from the chip's own program (XLA:TPU's)

    compute_s = property(lambda self: self.flops / self.hardware.flops)
    hbm_s = property(lambda self: self.bytes_accessed / self.hardware.hbm_bandwidth)
    comm_s = property(lambda self: sum(seconds for _, _, seconds in self.communication))

    @property
    def chip_s(self) -> float:
        """One chip's work, collectives aside: the roofline, the longer of the matmuls and the HBM
        traffic; the matmuls alone where the bytes are not the chip's (XLA:CPU's count)."""
        return max(self.compute_s, self.hbm_s) if self.chips_bytes else self.compute_s

    @property
    def step_s(self) -> float:
        """Forward pass, then the backward pass and the communication overlapped."""
        hidden = self.overlap * self.chip_s
        return self.chip_s - hidden + max(hidden, self.comm_s)

    @property
    def bound(self) -> float:
        """k = communication / the chip's work it can hide behind: > 1 means communication-bound."""
        hidden = self.overlap * self.chip_s
        return self.comm_s / hidden if hidden else math.inf if self.comm_s else 0.0

    @property
    def verdict(self) -> str:
        if self.bound > 1:
            return f"communication-bound by x{self.bound:.1f}"
        return "HBM-bound" if self.chip_s > self.compute_s else "compute-bound"

    @property
    def flip_batch(self) -> float | None:
        """Per-device batch where the verdict flips, if the bytes do not grow with the batch (as a
        pipeline's permuted activations do)."""
        grows = any(kind == "collective-permute" for kind, _, _ in self.communication)
        return None if self.batch is None or not self.comm_s or grows else self.batch * self.bound

    def __str__(self) -> str:
        hw = self.hardware
        mem = self.memory
        size = human_bytes
        kinds = [f"{kind} {size(n)} {_time(s)}" for kind, n, s in self.communication]
        sent = ", ".join(kinds) or "none"
        flip = f"; flips at {self.flip_batch:,.0f} examples per device" if self.flip_batch else ""
        not_the_chips = "XLA:CPU's count: not the chip's, not priced"
        counted = "XLA:TPU's count" if self.chips_bytes else not_the_chips
        per_device = f", {self.batch:g} examples per device" if self.batch else ""
        peak = f"{self.flops:.3g} FLOP at {hw.flops:.3g} FLOP/s"
        accessed = size(int(self.bytes_accessed))
        held = f"{size(mem.total)} of {size(int(hw.hbm_bytes))}"
        parts = f"outputs {size(mem.outputs)}, temporaries {size(mem.temporaries)}"
        lines = [
            f"predicted step on {hw.name}{per_device}",
            f"  compute        {_time(self.compute_s):>9}  {peak}",
            f"  communication  {_time(self.comm_s):>9}  {sent}",
            f"  HBM traffic    {_time(self.hbm_s):>9}  {accessed} ({counted})",
            f"  step           {_time(self.step_s):>9}  {self.verdict}{flip}",
            f"  memory/device  {held}: arguments {size(mem.arguments)}, {parts}",
        ]
        return "\n".join(lines)


def step_cost(
    program: jax.stages.Lowered | jax.stages.Compiled,
    hardware: Hardware | str = "v5p",
    *,
    batch: float | None = None,
    mesh: AnyMesh | None = None,
    overlap: float = BACKWARD,
) -> StepCost:
    """Price a lowered (or compiled) step on ``hardware`` (a ``Hardware`` or a key of ``HARDWARE``:
    "v5p").

    Given the ``Lowered`` program, bytes are counted in the float type it asked
    for (``collectives.as_asked``: XLA:CPU widens bf16 collectives to f32); a
    ``Compiled`` one is counted as compiled. ``batch``: examples per device.
    """
    _checks_costs.optional_positive("step_cost: batch", batch)
    hardware = hardware_named(hardware)
    lowered = program if isinstance(program, jax.stages.Lowered) else None
    compiled = lowered.compile() if lowered is not None else program
    assert isinstance(compiled, jax.stages.Compiled)
    _checks_costs.program_mesh("step_cost", mesh, mesh_of(compiled))
    mesh = mesh if mesh is not None else mesh_of(compiled)
    text = as_asked(lowered) if lowered is not None else compiled.as_text() or ""
    analysis = compiled.cost_analysis() or {}  # per device: XLA analyses the partitioned program
    flops = float(analysis.get("flops", 0.0)) + repeated_dot_flops(text)  # a loop's body, n times
    accessed = float(analysis.get("bytes accessed", 0.0))
    communication = _communication(text, mesh, hardware)
    chips = compiled_for_a_chip(compiled)
    memory = Memory.of(compiled)
    return StepCost(hardware, flops, accessed, communication, memory, batch, overlap, chips)


def compiled_for_a_chip(compiled: jax.stages.Compiled) -> bool:
    """Whether XLA compiled ``compiled`` for an accelerator (a TPU's program, ahead of time or on
    one): then its ``bytes accessed`` are the chip's HBM traffic."""
    shardings = jax.tree.leaves((compiled.input_shardings, compiled.output_shardings))
    return any(device.platform != "cpu" for sharding in shardings for device in sharding.device_set)


def cost_report(
    step: Callable[..., Any],
    args: Sequence[Any],
    mesh: AnyMesh,
    rules: AxisRules | None,
    hardware: Hardware | str = "v5p",
) -> StepCost:
    """``step_cost`` of ``Sharded(mesh, rules)(step)`` on example ``args``, whose last is the batch.

    The batch per device is read from the compiled step: the rows of the batch's first array
    that one device holds. A ``step`` with ``.lower`` (a ``Sharded`` function, a
    ``zero.ZeroStep``) is lowered as it is, and ``rules`` go unused.
    """
    if not hasattr(step, "lower"):  # a Sharded function, a zero.ZeroStep: lowered as it is
        step = Sharded(mesh, rules)(step)  # type: ignore[arg-type]
    lowered = step.lower(*args)
    # how the step splits the batch
    placed = jax.tree.leaves(lowered.compile().input_shardings[0][-1])[0]
    rows = placed.shard_shape(jax.tree.leaves(args[-1])[0].shape)[0]
    return step_cost(lowered, hardware, batch=rows)


# --- 3. every candidate style and mesh shape, ranked ---------------------------------
@dataclasses.dataclass(frozen=True)
class Candidate:
    """One style on one mesh shape; ``cost`` is None when the model does not divide over it."""

    style: str
    mesh: dict[str, int]
    cost: StepCost | None
    why: str = ""


@dataclasses.dataclass(frozen=True)
class Comparison:
    """Every candidate ``compare`` tried, fastest predicted step first."""

    hardware: Hardware
    candidates: tuple[Candidate, ...]

    def __str__(self) -> str:
        heads = f"{'step':>9} {'compute':>9} {'comms':>9} {'memory':>9}"
        lines = [f"  {'style':8} {'mesh':18} {heads}  verdict"]
        for i, candidate in enumerate(self.candidates):
            cost = candidate.cost
            shape = "x".join(f"{k}={v}" for k, v in candidate.mesh.items())
            t = _time
            head = f"{'* ' if i == 0 and cost else '  '}{candidate.style:8} {shape:18} "
            if cost is None:
                lines.append(head + candidate.why)
                continue
            memory = human_bytes(cost.memory.total)
            cells = (t(cost.step_s), t(cost.compute_s), t(cost.comm_s), memory)
            lines.append(head + " ".join(f"{cell:>9}" for cell in cells) + f"  {cost.verdict}")
        return "\n".join([*lines, f"(* the fastest predicted step on {self.hardware.name})"])


def mesh_shapes(style: str, devices: int) -> list[dict[str, int]]:
    """Every way to lay ``devices`` on the style's mesh axes: one for a 1-D style, each divisor for
    2-D."""
    shape, _ = mesh_rules(style, devices)
    if len(shape) == 1:
        return [shape]
    first, second = shape
    return [{first: d, second: devices // d} for d in range(1, devices + 1) if devices % d == 0]


def compare(
    step: Callable[..., Any],
    args: Sequence[Any],
    hardware: Hardware | str = "v5p",
    devices: int = 0,
    styles: Sequence[str] = ANY_MODEL,
    others: Sequence[Candidate] = (),
) -> Comparison:
    """``cost_report`` of ``step`` under every style and mesh shape of ``devices``, fastest first:
    the check of the ranking (``layouts.rank``, from shapes), XLA's own program for each split of
    a model that compiles here. ``args``: the step's example arguments; ``devices``: 0 for all;
    ``styles``: those any model takes, or more (``styles.SEQUENCE``, ``styles.EXPERT``); each
    compiles once. ``others``, priced elsewhere (a pipeline's, ZeRO's), are ranked with them.
    """
    hardware = hardware_named(hardware)
    devices = devices or jax.device_count()  # 0: all
    candidates: list[Candidate] = []
    for style in styles:
        rules = mesh_rules(style, devices)[1]
        for shape in mesh_shapes(style, devices):
            try:
                mesh = make_mesh(shape, devices=jax.devices()[:devices])
                cost = cost_report(step, args, mesh, rules, hardware)
            except ShardingError as error:  # why: "<array>: shape (..), dimension 1 ..."
                candidates.append(Candidate(style, shape, None, error.why))
                continue
            candidates.append(Candidate(style, shape, cost))
    tried = [*candidates, *others]
    fastest = sorted(tried, key=lambda c: math.inf if c.cost is None else c.cost.step_s)
    return Comparison(hardware, tuple(fastest))


# --- 4. what the model computes ---------------------------------------------------------
def model_flops(loss: Callable[..., Any], *args: Any) -> float:
    """A training step's *model* FLOPs: 3 x the matmuls of ``loss(*args)``'s forward pass.

    MFU's numerator (PaLM's appendix B, nanoGPT's ``estimate_mfu``): the work the model
    needs, however it is spread or recomputed, so unlike XLA's count it does not grow
    with ``--remat`` or a pipeline's bubble. Counted from the jaxpr: each ``dot_general``
    is 2 · output elements · contracted size, a loop's body times its length; an
    embedding lookup is a gather, not a matmul (so a GPT comes to nanoGPT's
    6N·tokens + the attention's 12·layers·width·context·tokens, N without the
    embeddings). The backward pass does two matmuls per forward one (the weight's
    gradient and the input's): 3 x. Elementwise work is left out, small beside it.

    >>> w = jax.ShapeDtypeStruct((784, 512), "float32")
    >>> x = jax.ShapeDtypeStruct((32, 784), "float32")
    >>> model_flops(lambda w, x: (x @ w).sum(), w, x) == 3 * 2 * 32 * 784 * 512
    True
    """
    return 3 * matmul_flops(jax.make_jaxpr(loss)(*args).jaxpr)


def matmul_flops(jaxpr: Any) -> float:
    """2 · output · contracted of each ``dot_general`` in ``jaxpr``, inner jaxprs (jit, remat,
    custom_vjp, shard_map) included, a ``scan``'s body ``length`` times, a ``cond``'s largest
    branch."""
    total = 0.0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (contracted, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            output = math.prod(eqn.outvars[0].aval.shape)
            total += 2 * output * math.prod(lhs[d] for d in contracted)
        inner = [matmul_flops(getattr(v, "jaxpr", v)) for v in eqn.params.values() if _is_jaxpr(v)]
        branches = [matmul_flops(b.jaxpr) for b in eqn.params.get("branches", ())]
        total += sum(inner) * eqn.params.get("length", 1) + max(branches, default=0.0)
    return total


def _is_jaxpr(value: Any) -> bool:
    return isinstance(value, jax.extend.core.Jaxpr | jax.extend.core.ClosedJaxpr)


def _communication(
    text: str,
    mesh: AnyMesh | None,
    hardware: Hardware,
) -> tuple[tuple[str, int, float], ...]:
    """``(kind, bytes, seconds)`` per kind: each instruction priced over its own group of
    devices."""
    sent: dict[str, tuple[int, float]] = {}
    for send in instructions(text, mesh):
        n_axes = len(send.groups[0])
        seconds = collective_time(send.kind, send.result_bytes, send.devices, hardware, n_axes)
        total, time = sent.get(send.kind, (0, 0.0))
        sent[send.kind] = (total + send.result_bytes, time + seconds)
    return tuple((kind, n, s) for kind, (n, s) in sent.items())


def _time(seconds: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds * 1e9:.3g} ns"


__all__ = [
    "BACKWARD",
    "HARDWARE",
    "Candidate",
    "Comparison",
    "Hardware",
    "Memory",
    "StepCost",
    "collective_time",
    "compiled_for_a_chip",
    "compare",
    "cost_report",
    "critical_batch",
    "hbm_critical_batch",
    "mixed_critical_batch",
    "mesh_shapes",
    "matmul_flops",
    "model_flops",
    "ring_bound",
    "sent_bytes",
    "step_cost",
]
