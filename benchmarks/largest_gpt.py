"""The largest GPT that trains on one TPU v5e chip under each ``--remat`` policy: predicted, found, run.

GPT-2 small's body (12 blocks of width 768, 12 heads, context 1,024) in bf16 with AdamW, ``train``'s
step on one chip; what grows is the batch. (The depth at a fixed batch would grow the program XLA
compiles, each block unrolled, to about 100 blocks under ``full``; the batch keeps the program the
same, so each compile here takes GPT-2 small's time.) The chip's HBM is 16 GiB, of which XLA:TPU
says 15.75 GiB are available to a program (its own refusal, docs/tpu.md).

* ``--predict``: ``memory.budget``'s largest batch (``explain --memory --topology v5e:1x1``'s
  prediction: XLA:TPU's terms), no compile, seconds;
* ``--aot``: the largest batch XLA:TPU compiles, ahead of time here (libtpu, no chip), whose
  ``memory_analysis()`` (arguments + outputs + temporaries - aliased) fits in 15.75 GiB, found by
  bisection started at the prediction (compiles cached as ``benchmarks/memory_aot.py``'s);
* on a chip, the default: 3 steps of each ``FOUND`` batch and of the next larger one, each said to
  train or to run out of memory: ``python3 benchmarks/largest_gpt.py --json $OUT/largest.json``
  (``--only full``: one policy, within a 10-minute command). Where ``FOUND`` has no batch yet for a
  policy, the chip's own compiler finds it first, by the same search (each compile there, on the
  chip's host, takes the time of GPT-2 small's; a batch fits where it compiles and its
  ``memory_analysis()`` is within 15.75 GiB).

Near the limit the compiled bytes grow slower than the batch (XLA's own rematerialization, its
``HloRematerialization`` pass, runs when a program would not fit), so the largest batch XLA:TPU
compiles can lie above the one ``memory.budget`` predicts, which counts no such recomputation.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import memory_aot  # this directory's

BODY = [
    *("--model", "gpt", "--depth", "12", "--width", "768", "--heads", "12"),
    *("--context", "1024", "--precision", "bf16"),
]
HBM = 15.75 * 2**30
"""Bytes a program may use on one TPU v5e, as XLA:TPU says when it refuses one."""
POLICIES = ("none", "full", "dots", "names")
FOUND = {"none": 35, "full": 156, "dots": 41, "names": 133}
"""The largest batch ``--aot`` found per policy (docs/tpu.md): ``none``, ``full`` and ``names``
searched after ``context.narrow_attend`` (a bf16 step keeps its softmax weights in bf16), ``dots``
after the scores left the matrix unit in bf16 (``context.scores``); the chip trains each and one
more."""


def flags(policy: str, batch: int) -> list[str]:
    return [*BODY, "--remat", policy, "--batch-size", str(batch)]


def predicted_total(policy: str, batch: int) -> float:
    """``memory.budget``'s bytes of the step (arguments and temporaries), as XLA:TPU keeps them."""
    from minishard.run.cli import parse_args
    from minishard.run.cli.memory import predict

    args = parse_args(["explain", "--memory", "--topology", "v5e:1x1", *flags(policy, batch)])
    return predict(args)[0].total


def largest(fits: Any, start: int) -> int:
    """The largest batch that ``fits`` (a larger batch needs more: ``fits`` is monotone): from
    ``start``, steps of 1, 2, 4, ... up while it fits (or down while it does not), then bisected."""
    step = 1
    if fits(start):
        low = start
        while fits(low + step):
            low += step
            step *= 2
        high = low + step
    else:
        high = start
        while high - step > 0 and not fits(high - step):
            high -= step
            step *= 2
        low = max(high - step, 0)
    while high - low > 1:
        middle = (low + high) // 2
        if fits(middle):
            low = middle
        else:
            high = middle
    return low


def aot_fits(policy: str, batch: int, cache: dict[str, Any]) -> bool:
    """Whether XLA:TPU compiles the step for one v5e and its memory_analysis fits ``HBM``."""
    seen = memory_aot.compiled(flags(policy, batch), cache, terms=False)
    memory_aot.write_json(memory_aot.CACHE, cache)
    return fits(seen, f"{policy} batch {batch}")


def fits(seen: dict[str, Any], what: str) -> bool:
    """Whether ``seen`` (``memory_aot``'s numbers of one compile) fits ``HBM``; said in one line."""
    if "error" in seen:
        print(f"  {what}: XLA:TPU refuses it: {seen['error'][:120]}", flush=True)
        return False
    total = seen["arguments"] + seen["outputs"] + seen["temporaries"] - seen["aliased"]
    print(f"  {what}: {total / 2**30:.2f} GiB compiled", flush=True)
    return total <= HBM


def chip_fits(policy: str, batch: int) -> bool:
    """Whether the chip's compiler compiles the step at ``batch`` within ``HBM`` (shapes only)."""
    import jax

    from minishard.run.cli import parse_args
    from minishard.run.cli.memory import compiled_memory, predict

    args = parse_args(["explain", "--memory", "--devices", "1", *flags(policy, batch)])
    _, step_args, shape, rules = predict(args)
    try:
        memory = compiled_memory(args, step_args, shape, rules, jax.devices()[:1])
    except jax.errors.JaxRuntimeError as error:  # RESOURCE_EXHAUSTED: over the chip's HBM
        return fits({"error": str(error).splitlines()[0]}, f"{policy} batch {batch}")
    seen = {"arguments": memory.arguments, "outputs": memory.outputs}
    seen |= {"temporaries": memory.temporaries, "aliased": memory.aliased}
    return fits(seen, f"{policy} batch {batch}")


def on_the_chip(policy: str, batch: int, steps: int = 3) -> dict[str, Any]:
    """``steps`` steps of ``train``'s step at ``batch`` on this chip: trained, or out of memory."""
    import chip
    import jax

    row: dict[str, Any] = {"policy": policy, "batch": batch}
    started = time.perf_counter()
    try:
        compiled = chip.compiled_step(["--remat", policy, "--batch-size", str(batch), *BODY], "bf16")
        row["compiled_temporaries"] = compiled.compiled.memory_analysis().temp_size_in_bytes
        model, state = compiled.built, compiled.state
        for _ in range(steps):
            model, state, *rest = jax.block_until_ready(compiled.compiled(model, state, compiled.batch))
        row["trained"] = True
        row["loss"] = float(jax.tree.leaves(rest)[0])
        row["peak_bytes_in_use"] = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
    except Exception as error:  # RESOURCE_EXHAUSTED, at compile time or when run
        row["trained"] = False
        row["error"] = str(error).splitlines()[0][:300]
    row["seconds"] = time.perf_counter() - started
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--predict", action="store_true", help="memory.budget's largest batches only")
    parser.add_argument("--aot", action="store_true", help="search with XLA:TPU ahead of time here")
    parser.add_argument("--only", help="one policy")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    policies = [p for p in POLICIES if not args.only or p == args.only]
    results: dict[str, Any] = {}
    if args.predict or args.aot:
        for policy in policies:
            predicted = largest(lambda b, p=policy: predicted_total(p, b) <= HBM, 16)
            results[policy] = {"predicted": predicted}
            print(f"{policy}: predicted largest batch {predicted}", flush=True)
            if args.aot:
                cache = memory_aot.read_json(memory_aot.CACHE)
                found = largest(lambda b, p=policy, c=cache: aot_fits(p, b, c), predicted)
                results[policy]["found"] = found
                print(f"{policy}: found (XLA:TPU, ahead of time) largest batch {found}", flush=True)
    else:
        rows = []
        for policy in policies:
            predicted = largest(lambda b, p=policy: predicted_total(p, b) <= HBM, 16)
            found = FOUND.get(policy) or largest(lambda b, p=policy: chip_fits(p, b), predicted)
            for batch in (found, found + 1):
                row = on_the_chip(policy, batch) | {"predicted": predicted, "found": found}
                rows.append(row)
                said = "trained" if row["trained"] else f"did not: {row.get('error')}"
                print(f"{policy} batch {batch}: {said}", flush=True)
                if args.json:
                    memory_aot.write_json(args.json, rows)
        results = {"rows": rows}
    if args.json:
        memory_aot.write_json(args.json, results)


if __name__ == "__main__":
    main()
