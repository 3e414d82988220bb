"""Where ``train`` draws the model on a chip: on the chip, or on the host's CPU and then placed.

Building a model is many small operations (each weight drawn, scaled, stacked), run eagerly one at
a time; on a chip each compiles a program of its own. ``train`` builds inside
``accelerators.built_on_the_host``; this script times both, each in a process of its own,
alternated (nanoGPT's recipe's GPT, docs/gpt.md):

    python3 benchmarks/build_where.py --rounds 2

On a machine without a chip both are the host: the two times agree.
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import time

RECIPE = (
    "train --model gpt --depth 6 --width 384 --heads 6 --context 256 --batch-size 64"
    " --dropout 0.2 --precision bf16 --scan"
)


def build_once(where: str) -> None:
    """Build the recipe's GPT ``where`` ("chip": the default device; "host"), place it, say the time."""
    import jax

    from minishard.run.cli import parse_args
    from minishard.run.cli.accelerators import built_on_the_host
    from minishard.run.cli.models import MODELS

    args = parse_args(RECIPE.split())
    jax.devices()  # the backends started before the clock
    started = time.perf_counter()
    with built_on_the_host() if where == "host" else contextlib.nullcontext():
        model = jax.block_until_ready(MODELS["gpt"].build(args, jax.random.key(0)))
    built = time.perf_counter() - started
    placed = jax.block_until_ready(jax.device_put(model, jax.devices()[0]))
    first = jax.tree.leaves(placed)[0].ravel()[0]
    print(
        f"{where}: built in {built:.2f} s, placed in {time.perf_counter() - started - built:.2f} s, "
        f"first weight {float(first):.8f}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--once", choices=["chip", "host"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.once:
        build_once(args.once)
        return
    for _ in range(args.rounds):
        for where in ("chip", "host"):
            subprocess.run([sys.executable, __file__, "--once", where], check=True)


if __name__ == "__main__":
    main()
