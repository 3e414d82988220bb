"""How near the published peak a chip's matmuls run: what the layout ranking's bound leaves out.

``explain --compare`` prices every matmul at the chip's published peak (``hardware.HARDWARE``), so
its MFU is an upper bound (issue 63: 1.76x PaLM's published MFU, 1.97x Megatron's). This measures
the factor on the chip at hand: XLA's bf16 matmul at square sizes, and at the shapes a transformer
block multiplies (``tokens x width`` by ``width x 4·width``, GPT-2 small's and nanoGPT's), each the
best of ``--rounds`` programs of ``--repeat`` there-and-back pairs (one dispatch: the host's
~0.1 ms a call is not the matmul's), in TFLOP/s and as a fraction of the published bf16 peak.

    python3 benchmarks/matmul_peak.py --json $OUT/matmul.json     # on the chip
    python3 benchmarks/matmul_peak.py --smoke                       # tiny sizes, any device
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp

from minishard.hardware import chip_of

SHAPES = {  # name: (m, k, n), a [m, k] by [k, n] matmul and back
    "square 1,024": (1024, 1024, 1024),
    "square 2,048": (2048, 2048, 2048),
    "square 4,096": (4096, 4096, 4096),
    "square 8,192": (8192, 8192, 8192),
    "GPT-2 small's MLP (16 x 1,024 tokens, 768 -> 3,072 -> 768)": (16384, 768, 3072),
    "nanoGPT's MLP (64 x 256 tokens, 384 -> 1,536 -> 384)": (16384, 384, 1536),
    "nanoGPT's attention out (384 -> 384, twice)": (16384, 384, 384),
}
SMOKE = {"tiny": (64, 32, 48)}


def seconds_a_matmul(m: int, k: int, n: int, repeat: int, rounds: int) -> float:
    """One matmul's seconds: ``[m, k] @ [k, n]`` and back, ``@ [n, k]``, ``repeat`` times in one
    program (a ``fori_loop``, each product the next one's operand: one dispatch, nothing hoisted,
    nothing between them), the best of ``rounds``, halved."""
    a = jax.random.normal(jax.random.key(0), (m, k), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (k, n), jnp.bfloat16) * k**-0.5
    c = jax.random.normal(jax.random.key(2), (n, k), jnp.bfloat16) * n**-0.5
    there_and_back = jax.jit(lambda x: jax.lax.fori_loop(0, repeat, lambda _, y: (y @ b) @ c, x))
    there_and_back(a).block_until_ready()  # compiled before the clock starts
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        there_and_back(a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return best / (2 * repeat)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="a tiny size on any device")
    args = parser.parse_args()
    device = jax.devices()[0]
    chip = chip_of(device.device_kind)
    peak = chip.peak("bfloat16") if chip else None
    print(f"jax {jax.__version__} on {device.device_kind}; published bf16 peak: {peak or 'not known'}")
    rows = []
    for name, (m, k, n) in (SMOKE if args.smoke else SHAPES).items():
        seconds = seconds_a_matmul(m, k, n, args.repeat, args.rounds)
        flops = 2 * m * k * n / seconds
        share = flops / peak if peak else None
        rows.append({"shape": name, "mkn": [m, k, n], "us": seconds * 1e6, "flops": flops, "of_peak": share})
        said = f"{share:6.1%} of the peak" if share is not None else "no published peak"
        print(f"{name:58} {seconds * 1e6:9.1f} us  {flops / 1e12:7.1f} TFLOP/s  {said}", flush=True)
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"device": device.device_kind, "peak": peak, "rows": rows}, file, indent=1)


if __name__ == "__main__":
    main()
