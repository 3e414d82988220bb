"""Where a step's time goes on the chip: a ``jax.profiler`` trace of a few steps, its device ops summed.

For one size of ``chip.py`` (``--only``) in one precision: the step as ``chip.py`` compiles it, 5 steps
traced; or, with ``--speed SHAPE``, each of ``chip_speed.py``'s contenders at that shape in turn (the
plain-JAX step beside minishard's, dispatched back to back as ``chip_speed`` times them). Then, from
the trace's events on the chip (``*.trace.json.gz``), the time the chip was busy a
step, that against the step's wall time (the rest: the chip idle, waiting on the host), and the ops
that took the most, grouped by kind (a fusion, a convolution: XLA:TPU's matmuls, a copy ...).

    python3 benchmarks/chip_trace.py --only "6x384" --precision bf16
    python3 benchmarks/chip_trace.py --speed "6x384" --json $OUT/trace.json  # plain against minishard
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import re
import tempfile
import time

import jax
from chip import SIZES, step_on_chip


def busy_ops(directory: str) -> tuple[dict[str, float], int]:
    """Microseconds per op kind on the first TPU's lines, and how many op events were read."""
    ops, count = op_times(directory)
    kinds: dict[str, float] = collections.defaultdict(float)
    for name, (us, _) in ops.items():
        kinds[re.sub(r"[.\d]+$", "", name)] += us
    return kinds, count


def op_times(directory: str) -> tuple[dict[str, tuple[float, str]], int]:
    """Microseconds per op on the first TPU's lines (with the op's HLO where the trace has it)."""
    (path, *_) = sorted(glob.glob(f"{directory}/**/*.trace.json.gz", recursive=True))
    with gzip.open(path) as trace:
        events = json.load(trace)["traceEvents"]
    metadata = [e for e in events if e.get("ph") == "M"]
    names = {e["pid"]: e["args"]["name"] for e in metadata if e.get("name") == "process_name"}
    chips = [pid for pid, name in sorted(names.items()) if "TPU:0" in name]
    if not chips:
        raise SystemExit(f"no TPU:0 in the trace's processes: {sorted(names.values())}")
    device = chips[0]
    threads = {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "thread_name" and e["pid"] == device
    }
    times: dict[str, float] = collections.defaultdict(float)
    texts: dict[str, str] = {}
    count = 0
    for e in events:
        line = threads.get((e.get("pid"), e.get("tid")), "")
        if e.get("ph") == "X" and e.get("pid") == device and "XLA Ops" in line:
            times[e["name"]] += e["dur"]
            texts.setdefault(e["name"], str(e.get("args", {}).get("long_name", "")))
            count += 1
    if not count:
        raise SystemExit(f"no 'XLA Ops' events on {names[device]}: its lines are {sorted(threads.values())}")
    return {name: (us, texts[name]) for name, us in times.items()}, count


def trace_contenders(shape_name: str, steps: int, json_path: str | None) -> None:
    """Each of ``chip_speed``'s contenders at one shape, traced: busy, idle, kinds and the top ops."""
    from chip_speed import CONTENDERS, SHAPES, contender

    name = next(size for size in SHAPES if shape_name in size)
    results = {}
    for label, batch, core, flags in CONTENDERS[name]:
        step, carried, data = contender(SHAPES[name], batch, core, flags)
        for _ in range(2):  # compiled and warm before the trace
            carried[0], carried[1], loss, *_ = step(*carried, data)
        float(loss)
        directory = tempfile.mkdtemp(prefix="chip-trace-")
        with jax.profiler.trace(directory):
            started = time.perf_counter()
            for _ in range(steps):  # back to back, as chip_speed times them
                carried[0], carried[1], loss, *_ = step(*carried, data)
            float(loss)
            wall = (time.perf_counter() - started) / steps
        ops, count = op_times(directory)
        busy = sum(us for us, _ in ops.values()) / 1e3 / steps
        print(f"== {name} {label}: {wall * 1e3:.2f} ms a step (wall), the chip busy {busy:.2f} ms")
        print(f"   ({count / steps:.0f} ops a step)")
        kinds: dict[str, float] = collections.defaultdict(float)
        for op, (us, _) in ops.items():
            kinds[re.sub(r"[.\d]+$", "", op)] += us / 1e3 / steps
        for kind, ms in sorted(kinds.items(), key=lambda item: -item[1])[:8]:
            print(f"  {kind:40} {ms:8.3f} ms  {ms / busy:6.1%}")
        top = sorted(ops.items(), key=lambda item: -item[1][0])[:15]
        for op, (us, text) in top:
            print(f"    {op:36} {us / 1e3 / steps:7.3f} ms  {text[:150]}")
        results[label] = {
            "wall_ms": wall * 1e3,
            "busy_ms": busy,
            "ops": {op: [us / steps, text] for op, (us, text) in ops.items()},
        }
        del step, carried, data
        if json_path:  # after every contender: a run cut short keeps what it traced
            with open(json_path, "w") as out:
                json.dump(results, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="6x384")
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--speed", help="trace chip_speed.py's contenders at the shape named so")
    parser.add_argument("--json", help="with --speed: every op's time a step, per contender")
    args = parser.parse_args()
    if args.speed:
        return trace_contenders(args.speed, args.steps, args.json)
    name = next(size for size in SIZES if args.only in size)
    run = step_on_chip(SIZES[name], args.precision)
    run()  # compiled and warm before the trace
    directory = tempfile.mkdtemp(prefix="chip-trace-")
    with jax.profiler.trace(directory):
        started = time.perf_counter()
        for _ in range(args.steps):
            run()
        wall = (time.perf_counter() - started) / args.steps
    kinds, count = busy_ops(directory)
    busy = sum(kinds.values()) / 1e3 / args.steps
    print(f"{name} {args.precision}: {wall * 1e3:.2f} ms a step (wall, traced), the chip busy {busy:.2f} ms")
    print(f"  ({count / args.steps:.0f} ops a step; idle {max(wall * 1e3 - busy, 0):.2f} ms)")
    for kind, us in sorted(kinds.items(), key=lambda item: -item[1])[:12]:
        print(f"  {kind:40} {us / 1e3 / args.steps:8.3f} ms  {us / 1e3 / args.steps / busy:6.1%}")


if __name__ == "__main__":
    main()
