"""Where a run's time goes: its speed (tokens or examples per second, MFU) and a profiler trace.

MFU, model FLOPs utilisation, is the share of the hardware's peak a step turns
into the model's arithmetic: ``costs.model_flops`` (3 x the forward matmuls)
over the step's time, over ``peak_flops``; under ``--remat``, HFU counts the FLOPs the
step runs, the recomputed forward too (``remat.step_flops``). An accelerator's peak is its table
entry (``minishard.hardware``, bf16). A CPU's is *measured*: the best of a few
runs of a 512 x 512 float32 matmul on every device at once, once per machine:
``cached_peak`` keeps it in ``cache_directory()``, by what it depends on
(``peak_key``), and ``MINISHARD_MEASURE_PEAK=1`` measures it again, keeping the higher.
Simulated devices (``--devices 8``) are threads sharing the same cores, so
their measured peak is the cores', split 8 ways, and MFU says what share of
*the machine* the step used, wherever its simulated devices wait on each other.

``Profile`` brackets steps ``first..last`` (counted from 1, the compiling step)
with ``jax.profiler``: a trace TensorBoard's profile plugin and Perfetto open.

>>> Speed(flops=6e9, items=1024, unit="tokens", peak=1e11).of(steps=10, seconds=1.0)
{'step_s': 0.1, 'tokens_per_s': 10240.0, 'mfu': 0.6, 'step_flops': 6000000000.0, 'peak_flops': 100000000000.0}
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import platform
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from minishard.hardware import chip_of
from minishard.remat import step_flops
from minishard.run.errors import TrainingError

__all__ = [
    "MEASURE_AGAIN",
    "PEAK_CACHE",
    "Profile",
    "Speed",
    "add_profile_flags",
    "cache_directory",
    "cached_peak",
    "check_profile",
    "check_profile_flags",
    "format_speed",
    "measured_peak",
    "peak_flops",
    "peak_key",
    "profile_problem",
    "step_range",
]

SIDE = 512  # the measured matmul's side: 2 · 512³ FLOPs per device, large enough to run near peak
PEAK_CACHE = "peak_flops.json"
"""The file in ``cache_directory()`` that keeps each measured peak: ``{peak_key: {"flops", "measured"}}``."""
MEASURE_AGAIN = "MINISHARD_MEASURE_PEAK"
"""An environment variable: set (but to ``0``), the peak is measured again, and the cache keeps the
higher of the two: a busy machine only ever lowers a measured peak, never raises it."""


def peak_flops(devices: Sequence[jax.Device], dtype: str = "float32") -> tuple[float | None, str]:
    """The peak FLOP/s of ``devices`` together for matmuls in ``dtype``, and where it comes from.

    An accelerator's is its table entry (``chip_of`` its ``device_kind``); one the table lacks
    has none (None: no MFU, never a guess); a CPU's is measured.
    """
    first = devices[0]
    if first.platform == "cpu":
        local = tuple(d for d in devices if d.process_index == jax.process_index())
        flops, source = cached_peak(local)
        return flops * len(devices) / len(local), source
    if (chip := chip_of(first.device_kind)) is None:
        return None, f"{first.device_kind!r} is not in minishard.hardware.DEVICE_KINDS: no MFU"
    computes = {"bfloat16": "bf16", "float16": "fp16"}.get(dtype, "float32 at JAX's default precision")
    return chip.peak(dtype) * len(devices), f"{len(devices)} x {chip.name}'s peak, {computes}"


def cache_directory() -> Path:
    """Where minishard keeps what it measures once: ``$MINISHARD_CACHE_DIR`` if set (the tests' own),
    else ``$XDG_CACHE_HOME/minishard``, else (unset, or not an absolute path, as the XDG spec says)
    ``~/.cache/minishard``."""
    if own := os.environ.get("MINISHARD_CACHE_DIR"):
        return Path(own)
    base = os.environ.get("XDG_CACHE_HOME", "")
    return (Path(base) if os.path.isabs(base) else Path.home() / ".cache") / "minishard"


def peak_key(devices: Sequence[jax.Device]) -> str:
    """What a measured peak depends on: the devices (count, platform, kind), the CPU (its model, the
    cores this process may use), JAX's and jaxlib's versions, ``XLA_FLAGS`` (the simulated devices,
    the optimisation level) and the matmul measured. Another of any of these is another entry."""
    first = devices[0]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    flags = " ".join(os.environ.get("XLA_FLAGS", "").split()) or "none"
    return (
        f"{len(devices)} x {first.platform} {first.device_kind}; {cpu_model()}, {cores} cores; "
        f"jax {jax.__version__}, jaxlib {jaxlib.__version__}; XLA_FLAGS {flags}; {SIDE}² float32 matmul"
    )


def cpu_model() -> str:
    """The CPU's model name: ``/proc/cpuinfo``'s on Linux, else what ``platform`` knows."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as info:
        for line in info:
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    return platform.processor() or platform.machine() or "an unknown CPU"


def cached_peak(devices: tuple[jax.Device, ...]) -> tuple[float, str]:
    """``measured_peak(devices)``, measured once per machine (``peak_key``) and kept in
    ``cache_directory()``: the FLOP/s and what the FLOPs line says of them. ``MEASURE_AGAIN`` measures
    anew and keeps the higher peak; a cache that cannot be read is measured anew (then rewritten), and
    one that cannot be written is left as it is: the line says which, and a run never stops for its cache."""
    path, key, how = cache_directory() / PEAK_CACHE, peak_key(devices), f"a {SIDE}² matmul on each device"
    entries, problem = _read_peaks(path)
    again = os.environ.get(MEASURE_AGAIN, "") not in ("", "0")
    if key in entries and not again:
        measured, remeasure = entries[key]["measured"], f"{MEASURE_AGAIN}=1 measures again"
        return entries[key]["flops"], f"{how}, measured {measured}, cached in {path}; {remeasure}"
    flops, said = measured_peak(devices), f"measured{' again' if again else ''}: {how}"
    if key in entries and entries[key]["flops"] > flops:  # a busy minute's: the cached peak stands
        kept, slower = entries[key], f"{flops / 1e9:.3g} GFLOP/s"
        return kept["flops"], f"{said} at {slower}, kept the higher, {kept['measured']}'s in {path}"
    entries[key] = {"flops": flops, "measured": time.strftime("%Y-%m-%d %H:%M")}
    written = _write_peaks(path, entries)
    unreadable = [f"the cache was unreadable ({problem})"] if problem else []
    return flops, "; ".join([said, *unreadable, written or f"cached in {path}"])


def _read_peaks(path: Path) -> tuple[dict[str, dict[str, Any]], str | None]:
    """The cache's entries, and what is wrong with it (None: nothing, or there is no cache yet)."""
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}, None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        return {}, f"{type(error).__name__}: {error}"
    if not isinstance(entries, dict) or not all(_is_peak(entry) for entry in entries.values()):
        return {}, 'not {key: {"flops": F, "measured": T}, ...}'
    return entries, None


def _is_peak(entry: Any) -> bool:
    """``{"flops": a positive number, "measured": a time}``, as ``cached_peak`` writes one."""
    if not isinstance(entry, dict) or not isinstance(entry.get("measured"), str):
        return False
    flops = entry.get("flops")
    return isinstance(flops, int | float) and not isinstance(flops, bool) and flops > 0


def _write_peaks(path: Path, entries: dict[str, dict[str, Any]]) -> str | None:
    """Write the cache whole (a temporary file, then a rename: a reader never sees half); what went
    wrong, or None."""
    written = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(
            "w", encoding="utf-8", dir=path.parent, suffix=".tmp", delete=False
        ) as file:
            written = file.name
            json.dump(entries, file, indent=1, ensure_ascii=False)  # the key's 512² as it is said
        os.replace(written, path)
    except OSError as error:
        if written:  # a full disk, say: no half-written file left behind
            with contextlib.suppress(OSError):
                os.unlink(written)
        return f"not cached: cannot write {path} ({error.strerror or error})"
    return None


@functools.cache
def measured_peak(devices: tuple[jax.Device, ...], repeats: int = 20) -> float:
    """FLOP/s of ``devices`` each multiplying two ``SIDE`` x ``SIDE`` float32 matrices at once, best of
    ``repeats``: the first call compiles, a loaded machine's slow runs are not the peak."""
    mesh = Mesh(np.array(devices), ("d",))
    sharding = NamedSharding(mesh, PartitionSpec("d"))
    x = jax.device_put(jnp.ones((len(devices), SIDE, SIDE), jnp.float32), sharding)
    multiply = jax.jit(lambda a: jnp.einsum("bij,bjk->bik", a, a), out_shardings=sharding)
    multiply(x).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        multiply(x).block_until_ready()
        best = min(best, time.perf_counter() - started)
    return 2 * SIDE**3 * len(devices) / best


@dataclasses.dataclass(frozen=True)
class Speed:
    """What a step's time means: its model FLOPs, the tokens or examples (``unit``) it trains on, and
    the ``peak`` FLOP/s of the devices it runs on."""

    flops: float
    items: int
    unit: str
    peak: float | None  # None: an accelerator minishard.hardware does not hold, so no MFU
    source: str = ""  # where the peak comes from
    hardware: float = 0.0  # FLOPs the step runs, recomputation included (0: not counted)

    @classmethod
    def of_step(
        cls,
        loss: Callable[..., Any],
        model: Any,
        batch: Any,
        unit: str,
        devices: Sequence[jax.Device],
        computes_in: str = "float32",
    ) -> Speed:
        """Training ``model`` with ``loss`` on batches like ``batch`` (tokens: ``[B, T]``) on ``devices``,
        its matmuls in ``computes_in`` (a precision policy's compute dtype: the peak is that dtype's)."""
        # shapes without their shardings: the model's FLOPs do not depend on them (and an Explicit
        # mesh's shardings would ask for the mesh the step is traced under)
        shapes = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (model, batch))
        first = next(iter(batch.values())).shape
        items = first[0] * (first[1] if unit == "tokens" else 1)
        flops = step_flops(loss, *shapes)
        return cls(flops.model, items, unit, *peak_flops(devices, computes_in), hardware=flops.hardware)

    def of(self, steps: int, seconds: float) -> dict[str, float]:
        """``steps`` steps in ``seconds``: the mean step time, items per second, MFU, and what it divides."""
        step_s = seconds / steps
        rate = {"step_s": step_s, f"{self.unit}_per_s": self.items / step_s}
        if self.peak is None:  # a chip the table does not hold: no MFU rather than a guessed peak
            return rate | {"step_flops": self.flops}
        rate["mfu"] = self.flops / step_s / self.peak
        if self.recomputes:
            rate["hfu"] = self.hardware / step_s / self.peak
        return rate | {"step_flops": self.flops, "peak_flops": self.peak}

    @property
    def recomputes(self) -> bool:
        """The step runs more FLOPs than 3 x its forward: ``--remat``'s, and HFU is worth printing. (Without
        it the hardware runs fewer: no gradient of the first layer's input.)"""
        return self.hardware > self.flops

    def said(self) -> str:
        """``Model FLOPs 5.29 G a step (1,024 tokens); peak 92.1 GFLOP/s (measured: ...)``."""
        peak = f"{self.peak / 1e9:.3g} GFLOP/s ({self.source})" if self.peak else f"unknown ({self.source})"
        recomputed = f", {self.hardware / 1e9:.3g} G run (--remat)" if self.recomputes else ""
        flops = f"Model FLOPs {self.flops / 1e9:.3g} G a step{recomputed}"
        return f"{flops} ({self.items:,} {self.unit}); peak {peak}"


def format_speed(speed: dict[str, float]) -> str:
    """``10,240 tokens/s, MFU 60%``, and ``, HFU 75%`` under recomputation: a record's ``speed``.

    A share above 100% is never printed: the step beat the peak, so the peak is wrong (a CPU's
    measured in a busy minute), and the line says so instead.

    >>> format_speed({"tokens_per_s": 1000.0, "mfu": 1.5})
    '1,000 tokens/s, MFU unknown (the step beat the peak: see the peak line)'
    """
    rates = [f"{n:,.0f} {name.removesuffix('_per_s')}/s" for name, n in speed.items() if "_per_s" in name]
    shares = [(name.upper(), speed[name]) for name in ("mfu", "hfu") if name in speed]
    if any(share > 1 for _, share in shares):
        return ", ".join([*rates, "MFU unknown (the step beat the peak: see the peak line)"])
    return ", ".join([*rates, *(f"{name} {share * 100:.3g}%" for name, share in shares)])


def step_range(text: str) -> tuple[int, int]:
    """``--profile-steps``'s type: ``FIRST:LAST``, two step numbers, ``2:4``."""
    first, _, last = text.partition(":")
    try:  # a number below 1 is profile_problem's to refuse: steps count from 1
        return int(first), int(last)
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"expected FIRST:LAST step numbers (e.g. 2:4), got {text!r}")


def profile_problem(directory: str, first: int, last: int, total: int | None) -> str | None:
    """What is wrong with tracing steps ``first..last`` of a run of ``total`` steps into ``directory``
    (a flag's message, without its name), or None; creates the directory, as the trace would."""
    if not 1 <= first <= last or (total is not None and last > total):
        run = f"the run's steps 1..{total}" if total is not None else "steps from 1"
        return f"{first}:{last} is not a range (FIRST:LAST, FIRST <= LAST) of {run}"
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as error:
        return f"cannot create {directory}: {error.strerror}"
    return None if os.access(directory, os.W_OK | os.X_OK) else f"cannot write to {directory}"


def add_profile_flags(parser: argparse.ArgumentParser) -> None:
    """``minishard train``'s ``--profile DIR`` and ``--profile-steps FIRST:LAST``."""
    add = parser.add_argument
    add(
        "--profile",
        metavar="DIR",
        help="write a jax.profiler trace of some steps here (Perfetto, TensorBoard)",
    )
    add(
        "--profile-steps",
        metavar="FIRST:LAST",
        type=step_range,
        help="the steps --profile traces, from 1, the compiling one (default 2:4, cut to the run)",
    )


def check_profile_flags(args: argparse.Namespace, error: Callable[[str], Any]) -> None:
    """--profile's directory writable, and its steps (default 2:4, cut to a shorter run) in the run: a run
    by --epochs is checked once its data says how many steps it takes, still before any step."""
    if args.profile_steps is not None and not args.profile:
        error("argument --profile-steps: give --profile DIR too, where the trace goes")
    if not args.profile:
        return
    if args.profile_steps is None:
        end = min(4, args.steps) if args.steps is not None else 4
        args.profile_steps = (min(2, end), end)
    first, last = args.profile_steps
    if problem := profile_problem(args.profile, first, last, args.steps):
        flag = "--profile-steps" if "range" in problem else "--profile"
        error(f"argument {flag}: {problem}")


def check_profile(profile: Profile | None, total: int) -> None:
    """``profile_problem``, raised as a ``TrainingError`` before the first step."""
    if profile and (problem := profile_problem(profile.directory, profile.first, profile.last, total)):
        raise TrainingError(f"--profile: {problem}")


@dataclasses.dataclass
class Profile:
    """Trace steps ``first`` to ``last`` (counted from 1) into ``directory`` with ``jax.profiler``."""

    directory: str
    first: int = 2  # step 1 compiles: a trace of it would be mostly the compiler
    last: int = 4
    seconds: float = 0.0
    """Spent starting the trace and writing it out (seconds of a GPT's period), not in any step:
    ``fit`` takes them out of the period's time and says them apart (``taken``)."""

    @contextlib.contextmanager
    def step(self, number: int, log: Callable[[str], None]) -> Iterator[None]:
        """Run step ``number`` (its body: the step and its wait), traced if it is in the range."""
        if not self.first <= number <= self.last:
            yield
            return
        started = time.perf_counter()
        if number == self.first:
            jax.profiler.start_trace(self.directory, create_perfetto_trace=True)
        self.seconds += time.perf_counter() - started
        with jax.profiler.StepTraceAnnotation("train", step_num=number):
            yield
        started = time.perf_counter()
        if number == self.last:
            jax.profiler.stop_trace()
            log(f"Wrote a trace of steps {self.first}-{self.last} to {self.directory} (open it in Perfetto)")
        self.seconds += time.perf_counter() - started

    def taken(self) -> float:
        """The tracing's seconds since the last call: those of the period that ends."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds
