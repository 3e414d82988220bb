"""nanoGPT's Shakespeare recipe (docs/gpt.md): its step's compile, looped and ``--scan``ned (issue 61).

Each case runs in a fresh process (JAX caches traces and executables in a process) and times, in
wall seconds: building the model's parameters (``build``: what ``train`` does before its plan),
tracing and lowering ``train``'s step (``lower``: the recipe's flags, one device, bf16, dropout
0.2, the model and state donated, as ``fit`` compiles it) and XLA compiling it (``compile``), for

* ``cpu``: XLA:CPU, on this machine;
* ``tpu-aot``: XLA:TPU for one v5e chip (``v5e:1x1``), compiled here ahead of time by libtpu, no
  chip needed (docs/tpu.md); ``build`` is not measured there (it runs on the CPU);
* ``here``: the first device this process has (on the chip: the chip itself).

Beside the seconds, the compiled step's temporaries (MB) and the bytes its compiler estimates it
accesses (MB, ``cost_analysis``): what a scan adds to the step's traffic, before any chip runs it.

    python benchmarks/recipe_compile.py                          # cpu and tpu-aot, loop and scan
    python benchmarks/recipe_compile.py --targets here --rounds 3   # on the chip

``--depth`` changes the recipe's 6 blocks; ``--flags`` adds train flags (``--remat full``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

RECIPE = [
    *("--model", "gpt", "--width", "384", "--heads", "6", "--context", "256", "--batch-size", "64"),
    *("--dropout", "0.2", "--lr", "1e-3", "--steps", "5000", "--warmup-steps", "100"),
    *("--eval-every", "250", "--precision", "bf16", "--devices", "1"),
]
"""docs/gpt.md's recipe command, less its --depth (6), on one device."""
TARGETS = ("cpu", "tpu-aot", "here")


def measure(target: str, flags: list[str]) -> dict[str, float]:
    """In this process: seconds to build the parameters, to lower the step and to compile it."""
    import jax

    from minishard.precision import PRECISIONS
    from minishard.run.cli import parse_args
    from minishard.run.cli.models import MODELS
    from minishard.run.cli.styles import style_of
    from minishard.run.steps import loss_scaled_for, make_train_step
    from minishard.run.topology import tpu_devices
    from minishard.sharding import Sharded, make_mesh

    args = parse_args(["train", *RECIPE, *flags])
    entry, style = MODELS["gpt"], style_of(args.parallel)
    devices = tpu_devices("v5e:1x1") if target == "tpu-aot" else jax.devices()[:1]
    jax.jit(lambda x: x + 1)(1.0).block_until_ready()  # the backend's start is billed to nobody
    times = {"build": float("nan")}
    if target != "tpu-aot":
        start = time.perf_counter()
        jax.block_until_ready(style.build(entry, args, jax.random.key(args.seed)))
        times["build"] = time.perf_counter() - start
    model = jax.eval_shape(lambda: style.build(entry, args, jax.random.key(args.seed)))
    precision = PRECISIONS[args.precision]
    optimizer = loss_scaled_for(precision, entry.compiled_optimizer(args))
    step = make_train_step(optimizer, entry.task.loss, 1, precision, seed=args.seed)
    mesh = make_mesh(style.mesh(args.devices), devices=devices)
    sharded = Sharded(mesh, style.rules({}), donate_argnums=(0, 1))(step)
    state, batch = jax.eval_shape(optimizer.init, model), entry.example(args, args.batch_size)
    start = time.perf_counter()
    lowered = sharded.lower(model, state, batch)
    times["lower"] = time.perf_counter() - start
    start = time.perf_counter()
    compiled = lowered.compile()
    times["compile"] = time.perf_counter() - start
    memory, cost = compiled.memory_analysis(), compiled.cost_analysis() or {}
    times["temporaries_mb"] = memory.temp_size_in_bytes / 1e6 if memory is not None else float("nan")
    times["accessed_mb"] = float(cost.get("bytes accessed", float("nan"))) / 1e6  # the compiler's estimate
    return times


def in_fresh_process(module: str, call: str, env: dict[str, str]) -> dict[str, Any]:
    """``module.call`` (a module of this folder) run in a new Python process with ``env``, its
    JSON-printed result read back: each measurement starts from a cold JAX."""
    here = os.path.dirname(os.path.abspath(__file__))
    printed = f"print(json.dumps({module}.{call}))"
    code = f"import json, sys; sys.path.insert(0, {here!r}); import {module}; {printed}"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{module}.{call} failed:\n{done.stderr[-3000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def fresh(target: str, flags: list[str]) -> dict[str, float]:
    """``measure`` in a new process, XLA's default flags (no simulated devices)."""
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    env.pop("XLA_FLAGS", None)
    if target == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
    return in_fresh_process("recipe_compile", f"measure({target!r}, {flags!r})", env)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", nargs="+", choices=TARGETS, default=["cpu", "tpu-aot"])
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--forms", nargs="+", choices=("loop", "scan"), default=["loop", "scan"])
    parser.add_argument("--rounds", type=int, default=1, help="fresh processes per case (the median)")
    parser.add_argument("--flags", nargs=argparse.REMAINDER, default=[], help="more train flags")
    parser.add_argument("--json", help="write every sample here")
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    for target in args.targets:
        for scan in (form == "scan" for form in args.forms):
            flags = ["--depth", str(args.depth), *(["--scan"] if scan else []), *args.flags]
            samples = [fresh(target, flags) for _ in range(args.rounds)]
            median = {part: statistics.median(s[part] for s in samples) for part in samples[0]}
            rows.append({"target": target, "scan": scan, "flags": flags, "samples": samples})
            said = ", ".join(f"{part} {value:5.1f}" for part, value in median.items())
            print(f"{target:8} depth {args.depth} {'scan' if scan else 'loop'}: {said}", flush=True)
    if args.json:
        with open(args.json, "w") as file:
            json.dump(rows, file, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
