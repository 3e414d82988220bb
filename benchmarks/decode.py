"""Sharded decoding on the simulated devices: prefill and per-token decode time per style and batch.

A GPT of width 128, depth 2, 8 heads, context 64 (float32), the prompt 32 tokens; each
row is the median of 5 timed calls after one warm-up (compiles excluded), on the 8
simulated CPU devices that share this machine's cores:

    python benchmarks/decode.py

What the numbers can mean: the dispatch and the work of one step here, and how they move
with the batch. What they cannot: the 8 "devices" are threads of one CPU sharing its
memory, so a split buys no bandwidth and an all-reduce is a memory copy: the roofline of
a real chip (``minishard.serving``) is what prices a style, not these times.
"""

from __future__ import annotations

from simulated import FLAG  # noqa: F401  # first: 8 simulated devices before JAX starts

# isort: split

import statistics
import time

import jax
import jax.numpy as jnp

from minishard.models.gpt import GPT
from minishard.run.cli.sample import decoder, placed

WIDTH, DEPTH, HEADS, CONTEXT, PROMPT = 128, 2, 8, 64, 32


def timed(fn, repeats: int = 5) -> float:
    """Median seconds of ``fn()`` (blocked on), after one warm-up call."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def times(model, step, batch: int) -> tuple[float, float]:
    """Seconds of one prefill of ``batch`` prompts and of one decode step after it."""
    prompt, one = jnp.zeros((batch, PROMPT), jnp.int32), jnp.zeros((batch, 1), jnp.int32)
    prefill = timed(lambda: step(model, prompt, model.init_cache(batch), jnp.asarray(0)))
    state = {"caches": step(model, prompt, model.init_cache(batch), jnp.asarray(0))[1]}

    def decode():  # the caches donated: each call takes the last one's
        logits, state["caches"] = step(model, one, state["caches"], jnp.asarray(PROMPT))
        return logits

    return prefill, timed(decode)


def main() -> None:
    model = GPT(65, CONTEXT, WIDTH, DEPTH, HEADS, 4, key=jax.random.key(0))
    print(f"{'style':>5}  {'batch':>5}  {'prefill ms':>10}  {'decode ms/token':>15}")
    for parallel in ("none", "tp", "dp", "2d", "cp", "dp+cp"):
        placed_model = model if parallel == "none" else placed(model, parallel)
        for batch in (8, 32):
            prefill, decode = times(placed_model, decoder(parallel), batch)
            print(f"{parallel:>5}  {batch:>5}  {prefill * 1e3:>10.2f}  {decode * 1e3:>15.2f}")


if __name__ == "__main__":
    main()
