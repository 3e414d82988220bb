"""The measuring method every comparison in this suite shares.

The machine is shared: other people's tests run on the same cores, and a step
time can swing by 2x from one minute to the next. A lone absolute time means
little there; a ratio of two contenders measured *side by side* means a lot.
So every comparison is

* **interleaved**: all contenders run in one process and take turns, one call
  each per iteration, so a burst of load from elsewhere hits all of them;
* **rotated**: the order changes every iteration (rotated, and reversed every
  other cycle), so everyone goes first equally often and nobody always runs
  right after the same neighbour;
* **paired**: a ratio compares two contenders' calls *of the same iteration*;
  its median over the iterations of a round is that round's ratio;
* **repeated**: several rounds; we report the median of the round values and
  their range ``[min, max]``: a range that straddles 1.0 is noise, not signal;
* **controlled**: an A/A contender (a second, identical copy of the
  reference) shows how far apart two *equal* contenders land;
* **GC-free**: garbage collection is off inside timed loops (collected before).
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import jax

Step = Callable[[], Any]
"""One call of a contender: it advances the contender's own state and returns what to block on."""


@dataclass(frozen=True)
class Stat:
    """The median of some per-round values and their range across rounds."""

    median: float
    lo: float
    hi: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Stat:
        return cls(statistics.median(values), min(values), max(values))

    def as_json(self, digits: int = 4) -> dict[str, Any]:
        return {
            "median": round(self.median, digits),
            "range": [round(self.lo, digits), round(self.hi, digits)],
        }

    def fmt(self, spec: str = ".3f") -> str:
        """``1.042 [1.031, 1.050]``."""
        return f"{self.median:{spec}} [{self.lo:{spec}}, {self.hi:{spec}}]"


@contextmanager
def no_gc() -> Iterator[None]:
    """Collect garbage first, then keep the collector out of the timed region."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def order(names: Sequence[str], i: int) -> list[str]:
    """The calling order of iteration ``i``: rotated by ``i``, reversed on every other cycle."""
    n = len(names)
    shift = i % n
    rotated = [*names[shift:], *names[:shift]]
    return rotated[::-1] if (i // n) % 2 else rotated


Samples = dict[str, list[float]]
"""Per contender, one time (seconds) per iteration; index i of every list is the same iteration."""


def blocked_round(steps: Mapping[str, Step], iters: int) -> tuple[Samples, Samples]:
    """``iters`` iterations of one blocking call per contender: (host times, step times).

    ``t0; out = step(); t1; block_until_ready(out); t2``: the host time
    ``t1 - t0`` is the Python + dispatch work until the call returns, the step
    time ``t2 - t0`` includes the computation.
    """
    names = list(steps)
    host: Samples = {name: [] for name in names}
    step: Samples = {name: [] for name in names}
    clock, block = time.perf_counter, jax.block_until_ready
    with no_gc():
        for i in range(iters):
            for name in order(names, i):
                t0 = clock()
                out = steps[name]()
                t1 = clock()
                block(out)
                t2 = clock()
                host[name].append(t1 - t0)
                step[name].append(t2 - t0)
    return host, step


def pipelined_round(steps: Mapping[str, Step], iters: int, burst: int) -> Samples:
    """``iters`` iterations of ``burst`` calls per contender, blocking only after the last.

    JAX dispatches asynchronously: while step ``k`` computes, Python already
    prepares step ``k + 1``, so host overhead hides behind computation. A
    sample is the burst's time divided by ``burst``. Only for programs without
    collectives: on simulated CPU devices, many queued sharded programs with
    collectives can deadlock XLA's in-process rendezvous.
    """
    names = list(steps)
    per_step: Samples = {name: [] for name in names}
    clock, block = time.perf_counter, jax.block_until_ready
    with no_gc():
        for i in range(iters):
            for name in order(names, i):
                fn = steps[name]
                t0 = clock()
                for _ in range(burst):
                    out = fn()
                block(out)
                per_step[name].append((clock() - t0) / burst)
    return per_step


def paired_ratio(a: Sequence[float], b: Sequence[float]) -> float:
    """Median over iterations of ``a[i] / b[i]``."""
    return statistics.median(x / y for x, y in zip(a, b))


def paired_diff(a: Sequence[float], b: Sequence[float]) -> float:
    """Median over iterations of ``a[i] - b[i]``."""
    return statistics.median(x - y for x, y in zip(a, b))


@dataclass
class Comparison:
    """Every contender against the reference, over several rounds of one kind of sample.

    ``ratio``: paired ratio to the reference; ``diff_us``: paired difference
    in microseconds; ``us``: the contender's own median, for context only
    (absolute times are never quoted alone: they depend on the load).
    """

    reference: str
    ratio: dict[str, Stat]
    diff_us: dict[str, Stat]
    us: dict[str, Stat]

    @classmethod
    def of(cls, rounds: Sequence[Samples], reference: str) -> Comparison:
        names = list(rounds[0])
        return cls(
            reference,
            ratio={n: Stat.of([paired_ratio(r[n], r[reference]) for r in rounds]) for n in names},
            diff_us={n: Stat.of([paired_diff(r[n], r[reference]) * 1e6 for r in rounds]) for n in names},
            us={n: Stat.of([statistics.median(r[n]) * 1e6 for r in rounds]) for n in names},
        )

    def as_json(self, what: str = "ratio") -> dict[str, Any]:
        return {name: stat.as_json() for name, stat in getattr(self, what).items()}


def compare_blocked(
    steps: Mapping[str, Step], reference: str, rounds: int, iters: int, warmup: int
) -> tuple[Comparison, Comparison]:
    """(host comparison, step comparison) of blocking calls, after ``warmup`` untimed iterations."""
    blocked_round(steps, warmup)
    host_rounds, step_rounds = zip(*(blocked_round(steps, iters) for _ in range(rounds)))
    return Comparison.of(host_rounds, reference), Comparison.of(step_rounds, reference)


def compare_pipelined(
    steps: Mapping[str, Step], reference: str, rounds: int, iters: int, burst: int
) -> Comparison:
    """Per-step time of bursts of ``burst`` asynchronous calls, after one untimed iteration."""
    pipelined_round(steps, 1, burst)
    return Comparison.of([pipelined_round(steps, iters, burst) for _ in range(rounds)], reference)


def compare_calls(
    fns: Mapping[str, Callable[[], Any]], reference: str, rounds: int, iters: int
) -> Comparison:
    """Cheap host-only functions (no JAX computation): ``iters`` interleaved calls per round."""
    for fn in fns.values():
        fn()
    return Comparison.of([blocked_round(fns, iters)[0] for _ in range(rounds)], reference)


def batched(fn: Callable[[], Any], number: int) -> Callable[[], None]:
    """``fn`` called ``number`` times back to back: one sample of a call too short to time alone."""

    def calls() -> None:
        for _ in range(number):
            fn()

    return calls
