"""Where a GPT step's time goes: a ``--profile`` trace of the default run, read back and drawn.

Runs ``minishard train --model gpt --steps 20 --devices 8 --profile DIR`` (the default GPT on 8
simulated devices, steps 2 to 4 traced) and prints its mean step time; reads the trace
(``minishard.run.trace_reading``) and prints, per traced step: its time on the host
(dispatch, then the wait for its loss), the dispatch, the host gap before the next step,
each device's mean time in collectives (the gradients' all-reduce), the least any device
spent there (the last to arrive waits for no one) and that mean's share of the step.
``--plot`` draws one step (``--step``, default the middle one) as a time line, the host
over the 8 devices (docs/training.md). ``--trace DIR`` reads a trace already written
instead of training.

    python benchmarks/gpt_trace.py --plot docs/gpt_trace.png
"""

from __future__ import annotations

from simulated import FLAG  # noqa: F401  # first: 8 simulated devices before JAX starts

# isort: split

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Sequence

from minishard.run.cli import main as minishard
from minishard.run.render import plot_trace
from minishard.run.trace_reading import TracedStep, read_trace


def traced(directory: str, steps: int) -> list[TracedStep]:
    """Train the default GPT for ``steps`` steps, tracing steps 2 to 4 into ``directory``; read them, and
    say the run's own mean step (its ``--log``: steps 2 to ``steps``, the traced ones among them)."""
    log = os.path.join(directory, "metrics.jsonl")
    flags = ["--steps", str(steps), "--devices", "8", "--profile", directory, "--log", log]
    if minishard(["train", "--model", "gpt", *flags]) != 0:
        raise SystemExit("minishard train failed")
    with open(log) as lines:
        speed = [json.loads(line) for line in lines if '"speed"' in line][-1]["speed"]
    print(f"\nthe run: {speed['step_s'] * 1e3:.1f} ms a step (steps 2-{steps}), MFU {speed['mfu']:.1%}")
    return read_trace(directory)


def table(steps: list[TracedStep]) -> str:
    """A row per traced step: its times in ms, and the collectives' share of it."""
    header = (
        f"{'step':>4} {'step ms':>8} {'dispatch':>8} {'gap':>6} {'in coll.':>8} {'least':>6} {'share':>6}"
    )
    rows = []
    for step in steps:
        t = step.times()
        gap = f"{t['gap_ms']:6.1f}" if "gap_ms" in t else f"{'-':>6}"
        times = f"{t['step_ms']:8.1f} {t['dispatch_ms']:8.1f} {gap} {t['collective_ms']:8.1f}"
        rows.append(f"{step.number:>4} {times} {t['least_collective_ms']:6.1f} {t['collective_share']:6.0%}")
    return "\n".join([header, *rows])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--steps", type=int, default=20, help="the run's steps (steps 2 to 4 are traced)")
    parser.add_argument("--trace", metavar="DIR", help="read this --profile DIR instead of training")
    parser.add_argument("--step", type=int, help="the step --plot draws (default: the middle traced one)")
    parser.add_argument("--plot", metavar="PNG")
    opts = parser.parse_args(argv)
    load = os.getloadavg()
    steps = (
        read_trace(opts.trace) if opts.trace else traced(tempfile.mkdtemp(prefix="gpt-trace-"), opts.steps)
    )
    print(table(steps))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"{len(steps[0].ops)} devices on {cores} cores; load average {load} -> {os.getloadavg()}")
    if opts.plot:
        number = opts.step or steps[len(steps) // 2].number
        t = next(step for step in steps if step.number == number).times()
        title = (
            f"minishard train --model gpt, step {number} on {len(steps[0].ops)} simulated devices "
            f"({cores} cores): {t['step_ms']:.0f} ms, {t['collective_share']:.0%} of each device's "
            f"in collectives"
        )
        plot_trace(steps, number, opts.plot, title)
        print(f"Wrote {opts.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
