"""Causal attention, forward + backward in bf16, on one TPU: minishard's Pallas kernel (a few block
sizes), XLA's ``jax.nn.dot_product_attention`` and JAX's own Pallas kernel
(``jax.experimental.pallas.ops.tpu.flash_attention``, its default blocks and 512 blocks). Issue 61 §1.

Each contender's time is the best of ``--repeat`` calls of one jitted ``vjp`` (outputs and the three
gradients, ``block_until_ready``) after two warm-up calls; its error is the largest difference of
its output and gradients from XLA's, over XLA's largest value (bf16 rounds at about 0.4%).
minishard's kernel and XLA's take the GPT's shape ``[batch, seq, heads, head_dim]`` (at head_dim 64
minishard's time includes its copies to ``[batch·heads, seq, head_dim]`` and back; at 128 there are
none); JAX's kernel takes its own, ``[batch, heads, seq, head_dim]``, made before the clock starts.
On the chip, from the repository's root (2 to 4 minutes, mostly compiling):

    PYTHONPATH=. python benchmarks/flash.py --json runs/flash.json

``--smoke``: tiny shapes on any backend, the kernels interpreted (the test's run): minishard's in
Pallas's plain interpreter, JAX's in its TPU one.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu import flash_attention as jax_flash

from minishard import flash

SHAPES = [  # (context, batch, heads, head_dim): the table
    (256, 64, 12, 64),
    (1024, 16, 12, 64),
    (1024, 16, 6, 128),
    (4096, 4, 12, 64),
    (4096, 4, 6, 128),
]
SMOKE_SHAPES = [(128, 1, 2, 64)]
BLOCKS = [(256, 256), (512, 512), (512, 1024), (1024, 512), (1024, 1024)]  # minishard's, capped at T
SMOKE_BLOCKS = [(64, 64), (128, 128)]


def minishard_attention(blocks: tuple[int, int], interpret: bool) -> Callable:
    return functools.partial(
        flash.flash_attention, causal=True, block_q=blocks[0], block_k=blocks[1], interpret=interpret
    )


def xla_attention(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)


def jax_kernel(block: int | None) -> Callable:
    """JAX's kernel on ``[b, t, h, d]`` arrays handed to it as ``[b, h, t, d]`` (outside the clock)."""

    def attend(q, k, v):  # q, k, v: [b, h, t, d]
        t, d = q.shape[2], q.shape[3]
        sizes = None
        if block is not None:
            b = min(block, t)
            sizes = jax_flash.BlockSizes(
                block_q=b,
                block_k_major=b,
                block_k=b,
                block_b=1,
                block_q_major_dkv=b,
                block_k_major_dkv=b,
                block_k_dkv=b,
                block_q_dkv=b,
                block_k_major_dq=b,
                block_k_dq=b,
                block_q_dq=b,
            )
        return jax_flash.flash_attention(q, k, v, causal=True, sm_scale=d**-0.5, block_sizes=sizes)

    return attend


def contenders(seq_len: int, smoke: bool) -> dict[str, tuple[Callable, bool]]:
    """name -> (attention, takes heads before the sequence)."""
    found: dict[str, tuple[Callable, bool]] = {}
    for blocks in SMOKE_BLOCKS if smoke else BLOCKS:
        capped = (min(blocks[0], seq_len), min(blocks[1], seq_len))
        name = f"minishard {capped[0]}x{capped[1]}"
        if name not in found and (capped[0] * capped[1] * 4 <= flash.SCORE_TILE_BYTES):
            found[name] = (minishard_attention(capped, interpret=smoke), False)
    found["XLA dot_product_attention"] = (xla_attention, False)
    found["JAX flash, default blocks"] = (jax_kernel(None), True)
    found["JAX flash, 512 blocks"] = (jax_kernel(512), True)
    return found


def fwd_bwd(attend: Callable) -> Callable:
    """One jitted forward and backward: the output and dq, dk, dv for the cotangent ``g``."""

    def run(q, k, v, g):
        out, vjp = jax.vjp(attend, q, k, v)
        return (out, *vjp(g))

    return jax.jit(run)


def best_ms(run: Callable, args: tuple, repeat: int) -> float:
    jax.block_until_ready(run(*args))  # compile and warm up
    jax.block_until_ready(run(*args))
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        jax.block_until_ready(run(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def relative_error(got: tuple, want: tuple, heads_major: bool) -> float:
    """max |got - want| / max |want| over the output and the three gradients, in float32."""
    worst = 0.0
    for a, b in zip(got, want):
        a = a.swapaxes(1, 2) if heads_major else a
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        worst = max(worst, float(jnp.abs(a - b).max() / jnp.abs(b).max()))
    return worst


def measure(shape: tuple[int, int, int, int], smoke: bool, repeat: int) -> list[dict]:
    seq_len, batch, heads, head_dim = shape
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, g = (jax.random.normal(key, (batch, seq_len, heads, head_dim), jnp.bfloat16) for key in keys)
    reference = fwd_bwd(xla_attention)(q, k, v, g)
    rows = []
    for name, (attend, heads_major) in contenders(seq_len, smoke).items():
        args = tuple(x.swapaxes(1, 2) for x in (q, k, v, g)) if heads_major else (q, k, v, g)
        interpreting = pltpu.force_tpu_interpret_mode() if smoke and heads_major else contextlib.nullcontext()
        with interpreting:
            run = fwd_bwd(attend)
            ms = best_ms(run, args, repeat)
            error = relative_error(run(*args), reference, heads_major)
        rows.append(
            {
                "context": seq_len,
                "batch": batch,
                "heads": heads,
                "head_dim": head_dim,
                "contender": name,
                "ms": round(ms, 3),
                "error": error,
            }
        )
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| context, batch, heads x dim | contender | ms (fwd + bwd) | vs XLA | error vs XLA |",
        "|---|---|---:|---:|---:|",
    ]
    for row in rows:
        xla = next(
            r["ms"]
            for r in rows
            if r["contender"].startswith("XLA")
            and r["context"] == row["context"]
            and r["head_dim"] == row["head_dim"]
        )
        where = f"{row['context']:,}, {row['batch']}, {row['heads']} x {row['head_dim']}"
        speed = f"{row['ms']:.2f} | {xla / row['ms']:.2f}x"
        lines.append(f"| {where} | {row['contender']} | {speed} | {row['error']:.1e} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument(
        "--smoke", action="store_true", help="tiny shapes, the kernels interpreted: any backend"
    )
    parser.add_argument("--repeat", type=int, default=10, help="timed calls per contender (best of)")
    args = parser.parse_args()
    if not args.smoke and jax.default_backend() != "tpu":
        parser.error(
            f"this backend is {jax.default_backend()}: the kernels need a TPU; --smoke runs them here"
        )
    rows = [
        row
        for shape in (SMOKE_SHAPES if args.smoke else SHAPES)
        for row in measure(shape, args.smoke, args.repeat)
    ]
    device = jax.devices()[0]
    print(
        f"{device.device_kind}, jax {jax.__version__}, bf16, causal, best of {args.repeat} after 2 warm-ups\n"
    )
    print(table(rows))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        doc = {"device": device.device_kind, "jax": jax.__version__, "repeat": args.repeat, "rows": rows}
        args.json.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
