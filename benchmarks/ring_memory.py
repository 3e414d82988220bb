"""Ring attention's backward memory against the ring size: the flat ``custom_vjp`` and ``jax.grad``.

One attention layer (8 heads of 16, zig-zag, causal, float32) with 128 tokens on each
device, over rings of p = 2, 4 and 8 devices (256, 512 and 1,024 tokens). JAX's transpose
of the ring's ``lax.scan`` keeps what every one of the p steps computed, so its memory per
device grows with p; the ``custom_vjp`` rotates K and V round again instead and keeps one
step's worth, the same for every p. Temporary memory per device, read from each compiled
program's ``memory_analysis()`` (docs/context.md quotes it):

    python benchmarks/ring_memory.py
"""

from __future__ import annotations

from simulated import FLAG  # noqa: F401  # first: 8 simulated devices before JAX starts

# isort: split

import jax
import jax.numpy as jnp

import minishard as ms
from minishard import context as cx
from minishard import sequence as sq
from minishard.census import human_bytes

PER_DEVICE, HEADS, HEAD_DIM = 128, 8, 16  # tokens per device


def temporary_bytes(attend_fn, p: int) -> int:
    """Per device: the compiled gradient of ``sum(attention)`` over a ring of ``p`` devices."""
    mesh = ms.make_mesh({"seq": p}, devices=jax.devices()[:p])
    run = sq.over_sequence(attend_fn, mesh, causal=True, order="zigzag")
    x = jax.ShapeDtypeStruct((1, PER_DEVICE * p, HEADS, HEAD_DIM), jnp.float32)
    grad = jax.grad(lambda *qkv: jnp.sum(run(*qkv)), argnums=(0, 1, 2))
    return jax.jit(grad).lower(x, x, x).compile().memory_analysis().temp_size_in_bytes


def naive_ring(q, k, v, **options):  # the same forward pass, differentiated by JAX
    return cx.ring_forward(q, k, v, **options)[0]


def main() -> None:
    print(f"{'p':>2}  {'tokens':>6}  {'custom_vjp ring':>15}  {'jax.grad through the scan':>25}  ratio")
    for p in (2, 4, 8):
        flat, naive = temporary_bytes(cx.ring_attention, p), temporary_bytes(naive_ring, p)
        row = f"{p:>2}  {PER_DEVICE * p:>6,}  {human_bytes(flat):>15}  {human_bytes(naive):>25}"
        print(f"{row}  {naive / flat:5.1f}")


if __name__ == "__main__":
    main()
