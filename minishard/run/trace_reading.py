"""Reading a ``--profile`` trace back: each traced step's host spans and every device's XLA ops.

``minishard train --profile DIR`` (``profiling.Profile``) writes Chrome's trace format,
``DIR/plugins/profile/<time>/<host>.trace.json.gz``: a list of ``traceEvents``, each
``"ph": "X"`` event a span of ``dur`` µs from ``ts`` on one thread (``tid``). Three kinds say
where a step's time goes:

* ``train`` (``args.step_num``), ``Profile``'s annotation on the host: one step, from its dispatch
  to the end of the wait for its loss;
* ``PjitFunction(<name>)`` on the same thread: Python dispatching a compiled program;
* an XLA op (``args.hlo_op``, ``args.device_ordinal``): a fusion, a matmul or a collective
  (``COLLECTIVES``) run by one device's program. On simulated CPU devices the devices are
  threads of one process: an op's span is wall time, which counts the time its thread waited
  for a core, and a collective's counts the wait at the rendezvous for the slowest device.

A program's run on all devices (its ops share a ``run_id``) belongs to the step its first op
started in: a slow device may still run a step's ops after the host has begun the next (the host
waits for one device's copy of the loss). So the last traced step may lose its latest ops: the
trace stops once the host has its loss.

>>> Span("all-reduce.48", 10.0, 25.0).collective, Span("dot_fusion.3", 0.0, 1.0).collective
(True, False)
"""

from __future__ import annotations

import bisect
import dataclasses
import gzip
import itertools
import json
import math
import os
from pathlib import Path
from typing import Any

__all__ = ["COLLECTIVES", "Span", "TracedStep", "read_trace", "traced_steps"]

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
"""How the names of XLA's collective ops begin (``all-reduce.48``, ``all-gather-start.2``)."""


@dataclasses.dataclass(frozen=True)
class Span:
    """What ran (an op's or a host event's name), from ``start`` to ``end``, µs on the trace's clock."""

    name: str
    start: float
    end: float

    @property
    def length(self) -> float:
        return self.end - self.start

    @property
    def collective(self) -> bool:
        return self.name.startswith(COLLECTIVES)


@dataclasses.dataclass(frozen=True)
class TracedStep:
    """Step ``number`` as the trace shows it: the host's ``train`` span, the programs it dispatched
    (``calls``), each device's ops that started in it, and the host time until the next traced step
    began (``gap``, µs; None after the last)."""

    number: int
    host: Span
    calls: tuple[Span, ...]
    ops: dict[int, tuple[Span, ...]]
    gap: float | None

    def collective_time(self) -> dict[int, float]:
        """Per device, the µs its ops spent in collectives during the step."""
        return {device: sum(op.length for op in ops if op.collective) for device, ops in self.ops.items()}

    def times(self) -> dict[str, float]:
        """In ms: the step (its ``train`` span), its dispatch (``calls``), the host gap after it (none after
        the last), each device's mean time in collectives and the least of any device (the last to
        reach the rendezvous waits for no one: about the collective's own cost); the mean's share."""
        spent = [t for t in self.collective_time().values() if t > 0] or [0.0]  # 0: its op was cut off
        mean = sum(spent) / len(spent)
        gap = {} if self.gap is None else {"gap_ms": self.gap / 1e3}
        return {
            "step_ms": self.host.length / 1e3,
            "dispatch_ms": sum(call.length for call in self.calls) / 1e3,
            **gap,
            "collective_ms": mean / 1e3,
            "least_collective_ms": min(spent) / 1e3,
            "collective_share": mean / self.host.length,
        }


def read_trace(directory: str | os.PathLike[str]) -> list[TracedStep]:
    """The traced steps of the newest trace ``--profile`` wrote under ``directory`` (one host's file)."""
    found = sorted(Path(directory).glob("plugins/profile/*/*.trace.json.gz"))
    if not found:
        raise FileNotFoundError(
            f"no plugins/profile/*/*.trace.json.gz under {directory}: not a --profile DIR"
        )
    return traced_steps(json.loads(gzip.decompress(found[-1].read_bytes()))["traceEvents"])


def traced_steps(events: list[dict[str, Any]]) -> list[TracedStep]:
    """``events`` (a trace's ``traceEvents``) grouped by the ``train`` span each began in."""
    spans = sorted((e for e in events if e.get("ph") == "X"), key=lambda e: e["ts"])
    steps = [e for e in spans if e["name"] == "train"]
    if not steps:
        raise ValueError("no `train` spans in the trace: it was not written by --profile's steps")
    starts = [e["ts"] for e in steps]
    calls: list[list[Span]] = [[] for _ in steps]
    for e in spans:  # the host's dispatches, not the one nested in each (jit's C++ and Python layers)
        if e["tid"] != steps[0]["tid"] or not e["name"].startswith("PjitFunction("):
            continue
        span = Span(e["name"], e["ts"], e["ts"] + e["dur"])
        if (i := bisect.bisect_right(starts, span.start) - 1) >= 0 and span.start >= _end(calls[i]):
            calls[i].append(span)
    ops: list[dict[int, list[Span]]] = [{} for _ in steps]
    for launch in _launches(spans):  # a launch belongs to the step its first op started in
        if (i := bisect.bisect_right(starts, launch[0][1].start) - 1) >= 0:
            for device, span in launch:
                ops[i].setdefault(device, []).append(span)
    hosts = [Span("train", e["ts"], e["ts"] + e["dur"]) for e in steps]
    gaps = [after.start - host.end for host, after in itertools.pairwise(hosts)]
    return [
        TracedStep(
            int(e["args"]["step_num"]), host, tuple(called), {d: tuple(on[d]) for d in sorted(on)}, gap
        )
        for e, host, called, on, gap in zip(steps, hosts, calls, ops, [*gaps, None])
    ]


def _end(spans: list[Span]) -> float:
    """Where the last of ``spans`` ends (-inf: there is none)."""
    return spans[-1].end if spans else -math.inf


def _launches(spans: list[dict[str, Any]]) -> list[list[tuple[int, Span]]]:
    """The XLA ops of each launch of a program on every device (they share a ``run_id``), in the order
    the launches began: ``(device, op)`` each."""
    launches: dict[str, list[tuple[int, Span]]] = {}
    for e in spans:
        if "hlo_op" in (args := e.get("args", {})) and "device_ordinal" in args:
            span = Span(e["name"], e["ts"], e["ts"] + e["dur"])
            launches.setdefault(args.get("run_id", ""), []).append((int(args["device_ordinal"]), span))
    return list(launches.values())
