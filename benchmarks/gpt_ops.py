"""Where the one-device GPT step's time goes, by kind of op: how near 60% of the matmul peak it can get.

Runs the default GPT on one device in a child process (``minishard train --model gpt --devices 1``,
60 steps), traces steps 21-25 (``--profile``) and has XLA dump the compiled step's HLO. Each op in
the trace is classed by what its HLO computes:

* ``matmul``: a dot (XLA:CPU calls most of them ``ynn_fusion``: YNNPACK's kernels);
* ``reduction``: a sum or max with no dot (LayerNorm's statistics, the bias gradients, softmax's
  sums, the gradient norm; YNNPACK runs many of them too);
* ``data movement``: copies, transposes, pads, slices, concatenations: a layout XLA:CPU's dots ask for;
* ``elementwise``: the rest (Swish, exp, LayerNorm's scaling, AdamW's update).

The trace slows every op by a per-op cost, so these shares are rough. The ceiling is not: every dot
of the compiled step is then run alone (``lax.dot_general`` on its operands' shapes, best of 5),
and their FLOPs (the model FLOPs: the matmuls are all of them) over their summed time is the
step's MFU were every other op free: for these shapes on XLA:CPU, what issue 49's 60% asks of
the matmuls alone. The step time and MFU are the run's own, over untraced steps 31-60.

    python benchmarks/gpt_ops.py
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from minishard.run.trace_reading import TracedStep, read_trace

KINDS = ("matmul", "reduction", "data movement", "elementwise", "collective")
MOVES = {
    "copy", "transpose", "bitcast", "pad", "slice", "concatenate", "reshape", "broadcast", "iota",
    "parameter", "constant", "tuple", "get-tuple-element", "dynamic-slice", "dynamic-update-slice",
}  # fmt: skip
SHAPE = re.compile(r"%([\w.-]+) = \w+\[([\d,]*)\]")
DOT = re.compile(r" dot\(%([\w.-]+), %([\w.-]+)\), ([^\n]*)")
DIMS = re.compile(r"(\w+_dims)=\{([\d,]*)\}")
INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.-]+) = (?:\([^)]*\)|\S+) ([\w-]+)\((?:.*calls=%?([\w.-]+))?")


def op_kinds(hlo: str) -> dict[str, str]:
    """The kind of every op the program runs (an ENTRY instruction), by the opcodes it computes: its
    own, and a fusion's computation's."""
    bodies: dict[str, set[str]] = collections.defaultdict(set)  # a computation's opcodes
    entry: dict[str, tuple[str, str]] = {}  # an entry instruction's opcode, the computation it calls
    computation = ""
    for line in hlo.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            computation = "ENTRY" if line.startswith("ENTRY") else line.split()[0].lstrip("%")
        elif match := INSTRUCTION.match(line):
            name, opcode, called = match.groups()
            bodies[computation].add(opcode)
            if computation == "ENTRY":
                entry[name] = (opcode, called or "")
    return {name: kind({opcode} | bodies[called]) for name, (opcode, called) in entry.items()}


def kind(opcodes: set[str]) -> str:
    """``matmul``, ``collective``, ``reduction``, ``data movement`` or ``elementwise``, in that order."""
    if opcodes & {"dot", "convolution"}:
        return "matmul"
    if any(o.startswith(("all-", "reduce-scatter", "collective-")) for o in opcodes):
        return "collective"
    if opcodes & {"reduce", "reduce-window"}:
        return "reduction"
    return "data movement" if opcodes <= MOVES | {"fusion"} else "elementwise"


Dot = tuple[tuple[int, ...], tuple[int, ...], tuple[Any, Any]]  # its operands' shapes, its dimension numbers


def dots(hlo: str) -> list[Dot]:
    """Every dot in ``hlo``: its operands' shapes and ``lax.dot_general``'s dimension numbers."""
    shapes = {name: tuple(int(d) for d in dims.split(",") if d) for name, dims in SHAPE.findall(hlo)}
    found = []
    for lhs, rhs, attributes in DOT.findall(hlo):
        dims = {key: tuple(int(d) for d in value.split(",") if d) for key, value in DIMS.findall(attributes)}
        numbers = (
            (dims.get("lhs_contracting_dims", ()), dims.get("rhs_contracting_dims", ())),
            (dims.get("lhs_batch_dims", ()), dims.get("rhs_batch_dims", ())),
        )
        found.append((shapes[lhs], shapes[rhs], numbers))
    return found


def alone(dot: Dot, repeats: int = 5) -> tuple[float, float]:
    """One dot on its own: its FLOPs and its best time in seconds (20 calls back to back: their dispatch
    hides behind the work, as a step's ops do)."""
    lhs_shape, rhs_shape, numbers = dot
    lhs, rhs = jnp.ones(lhs_shape), jnp.ones(rhs_shape)
    multiply = jax.jit(lambda a, b: jax.lax.dot_general(a, b, numbers))
    out = multiply(lhs, rhs).block_until_ready()
    contracted = math.prod(lhs_shape[d] for d in numbers[0][0])
    best, calls = float("inf"), 20
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(calls):
            out = multiply(lhs, rhs)
        out.block_until_ready()
        best = min(best, (time.perf_counter() - started) / calls)
    return 2 * out.size * contracted, best


def report(hlo: str, traced: list[TracedStep], speed: dict[str, float]) -> str:
    """The traced steps' op time by kind, then the step's dots each run alone: the MFU's ceiling."""
    kinds = op_kinds(hlo)
    spent: collections.Counter[str] = collections.Counter()
    seen: dict[str, set[str]] = collections.defaultdict(set)
    for op in (op for step in traced for ops in step.ops.values() for op in ops):
        spent[kinds[op.name]] += op.length / 1e3 / len(traced)
        seen[kinds[op.name]].add(op.name)
    total = sum(spent.values())
    lines = [
        f"\nthe one-device GPT step: {speed['step_s'] * 1e3:.1f} ms untraced, MFU {speed['mfu']:.1%}",
        f"traced steps {traced[0].number}-{traced[-1].number}: {total:.1f} ms of ops a step (slowed)",
        *(f"  {k:<14} {spent[k]:7.1f} ms {spent[k] / total:6.1%}  {len(seen[k])} ops a step" for k in KINDS),
    ]
    timed = [alone(dot) for dot in dots(hlo)]
    flops, seconds = sum(f for f, _ in timed), sum(s for _, s in timed)
    ceiling, rest = flops / seconds / speed["peak_flops"], (speed["step_s"] - seconds) * 1e3
    model, peak = speed["step_flops"] / 1e9, speed["peak_flops"] / 1e9
    return "\n".join([
        *lines,
        f"its {len(timed)} matmuls, each run alone: {seconds * 1e3:.1f} ms, {flops / 1e9:.2f} GFLOP (model"
        f" FLOPs {model:.2f} G), {ceiling:.0%} of the run's peak ({peak:.0f} GFLOP/s): the step's MFU",
        f"were every other op free (those take the other {rest:.1f} ms)",
    ])  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--steps", type=int, default=60, help="the run's steps (21-25 traced; default 60)")
    opts = parser.parse_args(argv)
    if not os.path.isdir(os.path.join(os.environ.get("TFDS_DATA_DIR", "/nonexistent"), "tiny_shakespeare")):
        parser.error("TFDS_DATA_DIR must hold tiny_shakespeare (the run reads it offline)")
    directory = tempfile.mkdtemp(prefix="gpt-ops-")
    log, dump = os.path.join(directory, "metrics.jsonl"), os.path.join(directory, "hlo")
    os.environ.pop("XLA_FLAGS", None)  # one device, here (where the dots are timed) and in the run
    flags = ["--devices", "1", "--steps", str(opts.steps), "--eval-every", str(opts.steps // 2), "--log", log]
    traced_flags = ["--profile", directory, "--profile-steps", "21:25"]
    dumping = f"--xla_dump_to={dump} --xla_dump_hlo_module_re=train_step"
    env = {**os.environ, "XLA_FLAGS": dumping, "MINISHARD_CACHE_DIR": directory}  # the peak measured afresh
    command = [sys.executable, "-m", "minishard", "train", "--model", "gpt", *flags, *traced_flags]
    subprocess.run(command, env=env, check=True)
    with open(log) as lines:
        speed = [json.loads(line) for line in lines if '"speed"' in line][-1]["speed"]  # steps 31-60
    (hlo,) = Path(dump).glob("*train_step*cpu_after_optimizations.txt")
    print(report(hlo.read_text(), read_trace(directory), speed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
