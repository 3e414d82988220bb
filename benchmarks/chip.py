"""On a real chip: each prediction of minishard beside what the chip measures (issue 60, docs/tpu.md).

For the GPT at three sizes (the default, nanoGPT's Shakespeare shape 6 x 384 at context 256 and
batch 64, GPT-2 small's body 12 x 768 at context 1,024) in fp32 and bf16, and the MLP: the train
step ``train`` runs (``make_train_step`` under ``Sharded`` on one device, donated), compiled by the
chip's own compiler, then

* its time: the best of ``--rounds`` means of ``--steps`` steps, each waited for;
* the roofline's: ``costs.step_cost`` of the compiled program on the chip's ``hardware`` entry
  (compute at the peak of the step's dtype, HBM bytes by XLA's cost analysis *of the chip's program*);
* its memory: ``memory.budget`` (``explain --memory``'s prediction) against ``memory_analysis()``
  and the chip's measured peak (``device.memory_stats()``), term by term where they meet.

Run on the chip (docs/tpu.md): ``python3 benchmarks/chip.py --json $OUT/chip.json``; off a chip,
``--smoke`` runs one tiny size on the CPU so a test can hold the script to working.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from minishard.costs import Memory, step_cost
from minishard.hardware import HARDWARE, chip_of
from minishard.precision import PRECISIONS
from minishard.run.cli import parse_args
from minishard.run.cli.memory import predict
from minishard.run.cli.models import MODELS
from minishard.run.profiling import Speed
from minishard.run.steps import make_train_step
from minishard.sharding import Sharded, make_mesh

SIZES = {
    "gpt default": ["--model", "gpt"],
    "gpt 6x384 ctx256 b64": [
        *("--model", "gpt", "--depth", "6", "--width", "384", "--heads", "6"),
        *("--context", "256", "--batch-size", "64"),
    ],
    "gpt 12x768 ctx1024 b16": [
        *("--model", "gpt", "--depth", "12", "--width", "768", "--heads", "12"),
        *("--context", "1024", "--batch-size", "16"),
    ],
    "mlp default": ["--model", "mlp", "--parallel", "dp"],
}
SMOKE = {"gpt tiny": ["--model", "gpt", "--depth", "1", "--width", "32", "--heads", "2", "--context", "16"]}


class CompiledStep(NamedTuple):
    """``train``'s step compiled on one device, what it is called with, and what was predicted of it."""

    compiled: Any
    built: Any  # the model
    state: Any  # the optimizer's
    batch: dict[str, jax.Array]
    budget: Any  # memory.budget's prediction (explain --memory's)
    shapes: Any  # the model as shapes
    mesh: Any
    entry: Any  # the model's CLI entry: its loss and unit
    compile_s: float


def compiled_step(flags: list[str], precision: str, attention: str = "dense") -> CompiledStep:
    """``train``'s step for ``flags`` in ``precision`` on the first device, compiled, and what it needs
    (``attention``: ``train --attention``'s core, a flag ``explain`` does not take)."""
    args = parse_args(["explain", "--memory", "--devices", "1", "--precision", precision, *flags])
    args.attention = attention
    budget, (shapes, _, batch_shapes), shape, rules = predict(args)
    entry = MODELS[args.model]
    mesh = make_mesh(shape, devices=jax.devices()[:1])
    optimizer = entry.compiled_optimizer(args)
    built = entry.build(args, jax.random.key(0))
    batch = {
        name: jnp.asarray(np.random.default_rng(0).integers(0, 2, like.shape), like.dtype)
        for name, like in batch_shapes.items()
    }
    step = make_train_step(optimizer, entry.task.loss, 1, PRECISIONS[precision])
    sharded = Sharded(mesh, rules, donate_argnums=(0, 1))(step)
    state = optimizer.init(built)
    started = time.perf_counter()
    compiled = sharded.lower(built, state, batch).compile()
    compile_s = time.perf_counter() - started
    return CompiledStep(compiled, built, state, batch, budget, shapes, mesh, entry, compile_s)


def step_on_chip(flags: list[str], precision: str) -> Callable[[], None]:
    """One step of ``compiled_step``'s, waited for, each call (the model and state carried along)."""
    step = compiled_step(flags, precision)
    carried = [step.built, step.state]

    def run() -> None:
        carried[0], carried[1], *_ = jax.block_until_ready(step.compiled(*carried, step.batch))

    return run


def measure(name: str, flags: list[str], precision: str, steps: int, rounds: int) -> dict[str, Any]:
    """One size in one precision: measured against predicted, time and memory."""
    step = compiled_step(flags, precision)
    compiled, batch, budget = step.compiled, step.batch, step.budget
    device = jax.devices()[0]
    if (chip := chip_of(device.device_kind)) is None and device.platform != "cpu":
        raise SystemExit(f"{device.device_kind!r} is not in minishard.hardware.DEVICE_KINDS: no roofline")
    chip = chip or HARDWARE["v5e"]  # off a chip (--smoke): priced as a v5e, only to run the script
    built, state, *_ = jax.block_until_ready(compiled(step.built, step.state, batch))
    means = []
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(steps):
            built, state, *_ = jax.block_until_ready(compiled(built, state, batch))
        means.append((time.perf_counter() - started) / steps)
    measured = min(means)
    cost = step_cost(compiled, chip, mesh=step.mesh)
    computes_in = PRECISIONS[precision].params
    speed = Speed.of_step(step.entry.task.loss, built, batch, step.entry.task.unit, [device], computes_in)
    compiled_memory = Memory.of(compiled)
    stats = device.memory_stats() or {}
    return {
        "size": name,
        "precision": precision,
        "parameters": int(sum(leaf.size for leaf in jax.tree.leaves(step.shapes))),
        "measured_step_s": measured,
        "rounds_s": means,
        "compile_s": step.compile_s,
        "predicted_step_s": cost.step_s,
        "roofline_s": max(cost.compute_s, cost.hbm_s) + cost.comm_s,
        "compute_s": cost.compute_s,
        "hbm_s": cost.hbm_s,
        "xla_flops": cost.flops,
        "xla_bytes_accessed": cost.bytes_accessed,
        "model_flops": speed.flops,
        "mfu": speed.of(1, measured).get("mfu"),
        "peak_flops": speed.peak,
        "predicted_memory": {term: int(n) for term, n in budget.terms.items()},
        "predicted_temporaries": int(budget.temporaries),
        "predicted_arguments": int(budget.arguments),
        "predicted_table": budget.table(compiled_memory),
        "compiled_memory": {
            "arguments": compiled_memory.arguments,
            "outputs": compiled_memory.outputs,
            "temporaries": compiled_memory.temporaries,
            "aliased": compiled_memory.aliased,
            "total": compiled_memory.total,
        },
        "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
        "device_kind": device.device_kind,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", help="sizes whose name contains this")
    parser.add_argument("--smoke", action="store_true", help="one tiny size, fp32 and bf16, on any device")
    args = parser.parse_args()
    sizes = SMOKE if args.smoke else SIZES
    rows = []
    for name, flags in sizes.items():
        if args.only and args.only not in name:
            continue
        for precision in ("fp32", "bf16"):
            row = measure(name, flags, precision, args.steps, args.rounds)
            rows.append(row)
            ratio = row["predicted_step_s"] / row["measured_step_s"]
            mfu = f"{row['mfu']:.1%}" if row["mfu"] is not None else "n/a"
            print(
                f"{name:24} {precision}: measured {row['measured_step_s'] * 1e3:8.2f} ms, predicted "
                f"{row['predicted_step_s'] * 1e3:8.2f} ms (x{ratio:.2f}; roofline "
                f"{row['roofline_s'] * 1e3:.2f}; compute "
                f"{row['compute_s'] * 1e3:.2f}, HBM {row['hbm_s'] * 1e3:.2f}), MFU {mfu}, "
                f"temporaries {row['compiled_memory']['temporaries'] / 1e9:.3f} GB, peak "
                f"{(row['peak_bytes_in_use'] or 0) / 1e9:.3f} GB, compile {row['compile_s']:.1f} s",
                flush=True,
            )
            print(row["predicted_table"], flush=True)
            if args.json:
                with open(args.json, "w") as out:
                    json.dump(rows, out, indent=1)


if __name__ == "__main__":
    main()
