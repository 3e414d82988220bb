"""Where a step's time goes on the chip: a ``jax.profiler`` trace of a few steps, its device ops summed.

For one size of ``chip.py`` (``--only``) in one precision: the step as ``chip.py`` compiles it, 5 steps
traced; then, from the trace's events on the chip (``*.trace.json.gz``), the time the chip was busy a
step, that against the step's wall time (the rest: the chip idle, waiting on the host), and the ops
that took the most, grouped by kind (a fusion, a convolution: XLA:TPU's matmuls, a copy ...).

    python3 benchmarks/chip_trace.py --only "6x384" --precision bf16
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
    kinds: dict[str, float] = collections.defaultdict(float)
    count = 0
    for e in events:
        line = threads.get((e.get("pid"), e.get("tid")), "")
        if e.get("ph") == "X" and e.get("pid") == device and "XLA Ops" in line:
            kinds[re.sub(r"[.\d]+$", "", e["name"])] += e["dur"]
            count += 1
    if not count:
        raise SystemExit(f"no 'XLA Ops' events on {names[device]}: its lines are {sorted(threads.values())}")
    return kinds, count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="6x384")
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
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
