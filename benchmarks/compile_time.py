"""Section 3: how long the first call takes to trace, lower and compile, in a fresh process each time.

JAX caches traces, lowerings and executables inside a process, and so do the
libraries on top of it; a second measurement in the same process would
measure those caches. So every sample is a new Python process (this file run
with ``--worker NAME``) that

1. imports everything and builds the contender (model, optimizer, batch);
2. compiles an unrelated tiny function, so that backend start-up and the
   process's first trace are billed to nobody (the models are built with
   ``eval_shape`` plus the problem's arrays: no eager random initialisation
   warms anyone's caches before the clock starts);
3. times ``step.lower(*args)`` (trace + lower to StableHLO; for ``Sharded``
   also deriving the shardings) and ``lowered.compile()`` (XLA) separately,
   in *CPU* seconds of the process (``time.process_time``, all threads) and
   in wall seconds. Ratios use CPU time: other people's processes on a shared
   machine stretch wall time at random, but not the work our process does.

The parent runs one process per contender per round, in rotating order, and
pairs each contender's sample with the reference's sample of the same round.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness import Stat, order

HERE = Path(__file__).resolve().parent


def sample(name: str, sizes: Sequence[int], batch: int) -> dict[str, float]:
    """One fresh-process measurement of ``name``: seconds to lower and to compile."""
    command = [
        sys.executable,
        str(HERE / "compile_time.py"),
        "--worker",
        name,
        "--sizes",
        ",".join(map(str, sizes)),
    ]
    command += ["--batch", str(batch)]
    done = subprocess.run(command, capture_output=True, text=True, check=False, env=os.environ.copy())
    if done.returncode:
        raise RuntimeError(f"compile worker {name} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def bench_compile(
    names: Sequence[str], reference: str, sizes: Sequence[int], batch: int, rounds: int
) -> dict[str, Any]:
    """Per contender: paired ratios of CPU time (lower + compile, lower, compile) and of wall time."""
    samples: list[dict[str, dict[str, float]]] = []
    for r in range(rounds):
        samples.append({name: sample(name, sizes, batch) for name in order(list(names), r)})
    out: dict[str, Any] = {"ratio": {}, "lower_ratio": {}, "compile_ratio": {}, "cpu_s": {}, "wall_ratio": {}}
    for name in names:

        def ratios(part: str, name: str = name) -> Stat:
            return Stat.of([s[name][part] / s[reference][part] for s in samples])

        out["ratio"][name] = ratios("total").as_json()
        out["lower_ratio"][name] = ratios("lower").as_json()
        out["compile_ratio"][name] = ratios("compile").as_json()
        out["wall_ratio"][name] = ratios("wall").as_json()
        out["cpu_s"][name] = {
            part: Stat.of([s[name][part] for s in samples]).as_json()
            for part in ("lower", "compile", "total")
        }
    return out


def worker(name: str, sizes: Sequence[int], batch: int) -> dict[str, float]:
    import jax
    import jax.numpy as jnp
    from contenders import FACTORIES, Problem

    # Backend start-up and the first-ever trace / lowering / compile, billed to nobody.
    jax.block_until_ready(jax.jit(lambda a: jnp.tanh(a) * 2)(jnp.ones(4)))
    contender = FACTORIES[name](Problem.make(sizes, batch))
    wall0, t0 = time.perf_counter(), time.process_time()
    lowered = contender.lower()
    t1 = time.process_time()
    lowered.compile()
    t2, wall2 = time.process_time(), time.perf_counter()
    return {"lower": t1 - t0, "compile": t2 - t1, "total": t2 - t0, "wall": wall2 - wall0}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="one fresh-process compile-time sample (used by run.py)")
    parser.add_argument("--worker", required=True)
    parser.add_argument("--sizes", required=True)
    parser.add_argument("--batch", type=int, required=True)
    opts = parser.parse_args()
    sys.path.insert(0, str(HERE))
    print(json.dumps(worker(opts.worker, [int(s) for s in opts.sizes.split(",")], opts.batch)))
