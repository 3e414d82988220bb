"""nanoGPT's Shakespeare recipe, looped and ``--scan``ned: wall time to val loss 1.47, phase by phase.

Runs docs/gpt.md's recipe command (read from the page, so the two cannot drift; it scans its
blocks, ``--scan``) once as written and once as a loop, without ``--scan`` (or with each variant's
flags added to the loop's), alternating, ``--rounds`` times, each in a fresh process from this
checkout. The clock starts when
the process starts; each phase ends at the first line that says it is done:

* start: Python, JAX and the backend, up to ``Running on ...`` (on a CPU: ``No accelerator ...``);
* build: the model built, placed and planned, up to ``Rules: ...`` and the plan;
* data + trace: up to ``Compiled train_step`` (whose own line says trace, lower and XLA seconds);
* steps: up to the first evaluation with ``val loss <= --target`` (then the run is stopped).

On the chip (issue 61 §3), from the repository root, with ``TFDS_DATA_DIR`` holding tiny_shakespeare:

    python benchmarks/recipe_time.py                      # looped and scanned, one round each
    python benchmarks/recipe_time.py --variant=--scan "--variant=--scan --remat dots" --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
VAL = re.compile(r"^Step (\d+) .*val loss (\d+\.\d+)")
RECIPE = re.compile(r"^minishard train (--model gpt [^\n]*\\\n[^\n]*--dropout[^\n]*)$", re.M)
"""docs/gpt.md's recipe command: two lines, the second with its dropout."""
MARKS = {
    "start": ("Running on ", "No accelerator"),  # a chip's line, or the CPU's
    "plan": ("Rules: ",),
    "compiled": ("Compiled train_step",),
}


def recipe_flags(page: Path = ROOT / "docs" / "gpt.md") -> list[str]:
    """The flags of docs/gpt.md's recipe command (``minishard train --model gpt ... --dropout 0.2 ...``)."""
    found = RECIPE.search(page.read_text())
    if found is None:
        raise SystemExit(f"{page}: no recipe command (minishard train --model gpt ... --dropout ...) found")
    return shlex.split(found.group(1).replace("\\\n", " "))


def looped(flags: list[str]) -> list[str]:
    """The recipe's flags with its blocks as a loop: ``--scan`` taken out."""
    return [flag for flag in flags if flag != "--scan"]


def timed_run(flags: list[str], target: float) -> dict[str, Any]:
    """Seconds from the process's start to each mark and to the first ``val loss <= target``."""
    paths = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]  # the machine's own after ours
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    env.pop("XLA_FLAGS", None)
    start = time.perf_counter()
    run = subprocess.Popen(
        [sys.executable, "-m", "minishard", "train", *flags],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    seen: dict[str, Any] = {"flags": flags, "val": [], "reached": None}
    assert run.stdout is not None
    for line in run.stdout:
        now = time.perf_counter() - start
        for mark, prefixes in MARKS.items():
            if line.startswith(prefixes) and mark not in seen:
                seen[mark] = now
                if mark == "compiled":
                    seen["compile_line"] = line.strip()
        if found := VAL.match(line):
            seen["val"].append((int(found.group(1)), float(found.group(2)), round(now, 1)))
            if float(found.group(2)) <= target:
                seen["reached"] = now
                run.terminate()  # answered: the rest of the run is not timed
                break
    run.wait()
    return seen


def said(run: dict[str, Any], target: float) -> str:
    """One run's line: time to the target, where it was reached, and each phase's seconds."""
    marks = [run.get(mark) for mark in ("start", "plan", "compiled", "reached")]
    if None in marks:
        return f"val <= {target} not reached (evaluations {run['val']})"
    start, plan, compiled, reached = marks
    step = next(step for step, loss, _ in run["val"] if loss <= target)
    return (
        f"val <= {target} at step {step:,} in {reached:.1f} s: start {start:.1f}, build {plan - start:.1f}, "
        f"data + compile {compiled - plan:.1f}, steps and evaluations {reached - compiled:.1f} s\n"
        f"        {run.get('compile_line', '')}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--variant", action="append", help='flags added to the looped command, a run each ("": none)'
    )
    parser.add_argument("--target", type=float, default=1.47)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--flags", nargs=argparse.REMAINDER, default=[], help="more train flags, for every run"
    )
    parser.add_argument("--json", help="write every run here")
    args = parser.parse_args()
    if not os.path.isdir(os.path.join(os.environ.get("TFDS_DATA_DIR", "/nonexistent"), "tiny_shakespeare")):
        parser.error("TFDS_DATA_DIR must hold tiny_shakespeare (the runs read it offline)")
    loop = [*looped(recipe_flags()), *args.flags]
    extras = args.variant or ["", "--scan"]
    variants = {extra or "looped": [*loop, *shlex.split(extra)] for extra in extras}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    for round_ in range(args.rounds):
        for name in list(variants) if round_ % 2 == 0 else list(variants)[::-1]:
            run = timed_run(variants[name], args.target)
            runs[name].append(run)
            print(f"{name}: {said(run, args.target)}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
