"""The default GPT run's wall time to a validation loss, at two commits side by side (issue 49 §2).

Each commit runs as a user runs it: ``python -m minishard train --model gpt`` from an exported
copy of that commit's tree (``git archive``), in a fresh process with XLA's default flags, this
checkout's virtual environment, and the same offline data. The clock starts when the process
starts (imports, data, compile and evaluations included) and stops at the first evaluation that
prints ``val loss <= --target``; the run then ends (``--steps`` caps it). The commits run one
after the other, ``--rounds`` times, alternating, and each row says the load the machine had.
Last, the newer commit's GPT step on one device (``--devices 1``, 100 steps): the share of the
measured matmul peak its run prints as MFU for steps 51-100 (issue 49's target: 60%).

    python benchmarks/time_to_val.py                       # 03dc224 against HEAD, val loss 1.88
    python benchmarks/time_to_val.py --commits 03dc224 HEAD --rounds 2 --json runs/ttv.json
    python benchmarks/time_to_val.py --flags --devices 8   # the same, both runs with extra train flags

Needs a git checkout (``git archive``) and ``TFDS_DATA_DIR`` pointing at tiny_shakespeare.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VAL = re.compile(r"val loss (\d+\.\d+)")
MFU = re.compile(r"MFU ([\d.]+)%")


def exported(commit: str, into: Path) -> Path:
    """``commit``'s tree as files under ``into`` (nothing installed: run with it on ``PYTHONPATH``)."""
    tree = into / commit
    tree.mkdir()
    archive = subprocess.run(["git", "archive", commit], cwd=ROOT, capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(tree, filter="data")
    return tree


def time_to_val(tree: Path, target: float, steps: int, flags: list[str]) -> dict[str, object]:
    """Seconds from the process's start to the first ``val loss <= target``; the val losses seen."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    env.pop("XLA_FLAGS", None)  # the run's own: its simulated devices, XLA's default optimisation
    command = [sys.executable, "-m", "minishard", "train", "--model", "gpt", "--steps", str(steps), *flags]
    load = os.getloadavg()[0]
    start = time.perf_counter()
    run = subprocess.Popen(
        command, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    seen: list[float] = []
    mfu: list[float] = []  # each record's, where the commit prints it (issue 49 §1 on)
    reached = None
    assert run.stdout is not None
    for line in run.stdout:
        if found := MFU.search(line):
            mfu.append(float(found.group(1)))
        if found := VAL.search(line):
            seen.append(float(found.group(1)))
            if float(found.group(1)) <= target:
                reached = time.perf_counter() - start
                run.terminate()  # the question is answered: the rest of the run is not timed
                break
    run.wait()
    return {
        "seconds": reached, "val_losses": seen, "mfu_percent": mfu,
        "load_before": load, "load_after": os.getloadavg()[0],
    }  # fmt: skip


def one_device_mfu(tree: Path, steps: int = 100) -> float | None:
    """The default GPT's step on one device, as a % of the matmul peak measured in the same run: the
    MFU it prints for steps ``steps // 2 + 1`` to ``steps`` (the compiling step in the first half)."""
    # the peak measured in this run, not read from the user's cache: a cached one may be a slow minute's
    env = {**os.environ, "PYTHONPATH": str(tree), "MINISHARD_CACHE_DIR": str(tree)}
    env.pop("XLA_FLAGS", None)
    flags = ["--devices", "1", "--steps", str(steps), "--eval-every", str(steps // 2)]
    command = [sys.executable, "-m", "minishard", "train", "--model", "gpt", *flags]
    out = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True).stdout
    found = MFU.findall(out)
    return float(found[-1]) if found else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commits", nargs=2, default=["03dc224", "HEAD"], metavar=("BEFORE", "AFTER"))
    parser.add_argument("--target", type=float, default=1.88, help="the val loss to reach (default 1.88)")
    parser.add_argument("--steps", type=int, default=2000, help="the run's steps at most (default 2000)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--flags", nargs=argparse.REMAINDER, default=[], help="more train flags, for both")
    parser.add_argument("--json", help="write every run's numbers here")
    args = parser.parse_args(argv)
    if not os.path.isdir(os.path.join(os.environ.get("TFDS_DATA_DIR", "/nonexistent"), "tiny_shakespeare")):
        parser.error("TFDS_DATA_DIR must hold tiny_shakespeare (the runs read it offline)")
    results: dict[str, list[dict[str, object]]] = {commit: [] for commit in args.commits}
    with tempfile.TemporaryDirectory(prefix="minishard-ttv-") as tmp:
        trees = {commit: exported(commit, Path(tmp)) for commit in args.commits}
        for round_ in range(args.rounds):
            order = args.commits if round_ % 2 == 0 else args.commits[::-1]  # alternate who runs first
            for commit in order:
                result = time_to_val(trees[commit], args.target, args.steps, args.flags)
                results[commit].append(result)
                seconds = result["seconds"]
                said = f"{seconds:.1f} s" if isinstance(seconds, float) else "not reached"
                print(
                    f"{commit:>8}: val loss <= {args.target} in {said} (evaluations {result['val_losses']}; "
                    f"load {result['load_before']:.1f} -> {result['load_after']:.1f})",
                    flush=True,
                )
        one_device = one_device_mfu(trees[args.commits[1]])  # the second commit's (the newer)
    best = {c: min((r["seconds"] for r in runs if isinstance(r["seconds"], float)), default=None)
            for c, runs in results.items()}  # fmt: skip
    before, after = (best[c] for c in args.commits)
    if isinstance(before, float) and isinstance(after, float):
        print(f"best of {args.rounds}: {args.commits[0]} {before:.1f} s, {args.commits[1]} {after:.1f} s: "
              f"{before / after:.2f}x")  # fmt: skip
    if isinstance(one_device, float):
        print(f"{args.commits[1]}: the GPT step on one device, {one_device:.1f}% of the measured matmul peak")
    if args.json:
        runs = {"target": args.target, "flags": args.flags, "runs": results, "one_device_mfu": one_device}
        Path(args.json).write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
