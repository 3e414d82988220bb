"""The guards of attention split over devices (context.py, sequence.py, flash.py).

What each checks, and the words it says. A reader may skip this file, as ``minishard._checks``,
whose shared checks it uses; it imports nothing else of minishard.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from minishard._checks import count, is_count


def chunked_sequence(
    seq_len: Any, p: Any, order: Any, chunks: dict[str, int], where: str = "context"
) -> None:
    """A known chunk order, whose chunks split the sequence evenly over ``p`` devices."""
    ring(where, p, order, chunks)
    count(f"{where}: seq_len", seq_len)
    if seq_len % (p * chunks[order]):
        n = p * chunks[order]
        raise ValueError(
            f"{where}: a sequence of {seq_len} tokens does not split into {n} equal chunks ({chunks[order]} "
            f"on each of {p} devices, chunk order {order!r}); use a multiple of {n} tokens"
        )


def ring(where: str, p: Any, order: Any, chunks: dict[str, int]) -> None:
    """A ring of ``p`` devices (a positive int), its sequence dealt out in a known chunk order."""
    count(f"{where}: p (the devices of the ring)", p)
    if order not in chunks:
        known = ", ".join(map(repr, chunks))
        raise ValueError(f"{where}: unknown chunk order {order!r}; choose from {known}")


def chunk_holder(device: Any, p: Any, order: Any, chunks: dict[str, int]) -> None:
    """A device of the ring: from 0 to p - 1 (checked when it is an int; traced, it cannot be wrong)."""
    ring("chunks", p, order, chunks)
    if isinstance(device, int | np.integer) and not 0 <= device < p:
        raise ValueError(
            f"chunks: device={device!r} is no device of a ring of p={p}; devices run 0 to {p - 1}"
        )


def qkv(where: str, q: Any, k: Any, v: Any, *, here: str = "", grouped: bool = True) -> None:
    """q, k and v: float ``[batch, seq, heads, head_dim]`` arrays, k and v of one shape, q of theirs but
    its length (a cache's keys outnumber its queries) and, ``grouped``, its heads a multiple of theirs
    (grouped-query attention); an int would be truncated."""
    shapes = [jnp.shape(x) for x in (q, k, v)]
    if (
        {len(shapes[0]), len(shapes[1])} != {4}
        or shapes[1] != shapes[2]
        or shapes[0][::3] != shapes[1][::3]
        or shapes[0][2] % max(shapes[1][2], 1)
        or (not grouped and shapes[0][2] != shapes[1][2])
    ):
        heads = ", and hold a multiple of their heads" if grouped else ""
        raise ValueError(
            f"{where}: q, k and v must be [batch, seq, heads, head_dim] arrays of one shape (q may be "
            f"shorter or longer{heads}), got {shapes}{here}"
        )
    if ints := [f"{n} {jnp.result_type(x)}" for n, x in zip("qkv", (q, k, v)) if not _floating(x)]:
        raise TypeError(
            f"{where}: q, k and v must be float arrays, got {', '.join(ints)}; attention's softmax weights "
            "would be truncated to integers (cast with .astype(jnp.float32))"
        )


def _floating(x: Any) -> bool:
    return bool(jnp.issubdtype(jnp.result_type(x), jnp.floating))


def partials(out1: Any, lse1: Any, out2: Any, lse2: Any) -> None:
    """Two attentions of the same queries: outputs ``[b, q, h, d]`` of one shape, each lse ``[b, q, h]``."""
    shapes = [jnp.shape(x) for x in (out1, lse1, out2, lse2)]
    if shapes[0] != shapes[2] or not shapes[1] == shapes[3] == shapes[0][:-1]:
        raise ValueError(
            f"merge: out1 {shapes[0]}, lse1 {shapes[1]}, out2 {shapes[2]}, lse2 {shapes[3]}; the two parts "
            "attend the same queries: out1 and out2 of one shape [batch, queries, heads, head_dim], each lse "
            "that shape without head_dim"
        )


def context_inputs(where: str, q: Any, k: Any, v: Any, axis: Any, order: Any, chunks: dict[str, int]) -> None:
    """Inside ``shard_map`` over ``axis``: q, k, v of one ``[batch, seq, heads, head_dim]`` shape,
    but k's and v's heads may be a divisor of q's (grouped-query attention)."""
    qkv(where, q, k, v, here=" on this device")
    try:
        p = jax.lax.axis_size(axis)
    except NameError:
        raise ValueError(
            f"{where}: {axis!r} is no axis of a surrounding jax.shard_map; call it inside one whose mesh "
            "has it (minishard.sequence.over_sequence builds one)"
        ) from None
    chunked_sequence(jnp.shape(q)[1] * p, p, order, chunks)


def whole_sequence(q: Any, k: Any, v: Any, p: int, order: Any, chunks: dict[str, int]) -> None:
    """``over_sequence``'s whole arrays: q, k, v alike, their sequence dealt out evenly over ``p`` devices."""
    qkv("over_sequence", q, k, v)
    chunked_sequence(jnp.shape(q)[1], p, order, chunks, where="over_sequence")


def heads_split(where: str, heads: int, p: int, axis: str) -> None:
    """DeepSpeed-Ulysses gives each device whole heads: they must split evenly."""
    if heads % p:
        raise ValueError(
            f"{where}: {heads} heads do not split over the {p} devices of axis {axis!r}: Ulysses gives "
            f"each device whole heads; use a multiple of {p} heads, or ring_attention"
        )


def mesh_has(where: str, axis: str, mesh_axes: tuple[str, ...]) -> None:
    """The sequence's mesh axis is one of the mesh's."""
    if axis not in mesh_axes:
        raise ValueError(
            f"{where}: axis={axis!r} is no axis of the mesh, whose axes are {mesh_axes}; split the "
            "sequence over one of them, or make the mesh with it"
        )


def flash(
    q: Any,
    k: Any,
    v: Any,
    blocks: Any,
    interpret: bool,
    row_tile: int,
    score_tile: int,
    where: str = "flash_attention",
    tokens: str = "sequence",
) -> None:
    """The flash kernel's inputs: q, k, v of one ``[batch, seq, heads, head_dim]`` shape, blocks that
    tile the sequence (divisors of it, multiples of the TPU's 8 sublanes or the whole; on a TPU query
    blocks of 128 lanes), tiles that fit VMEM, and a TPU to run on (or the interpreter). ``where``
    names the caller, ``tokens`` what its sequence is (a ring's pair's: "chunk")."""
    qkv(where, q, k, v, grouped=False)
    if jnp.shape(q) != jnp.shape(k):
        raise ValueError(f"{where}: q {jnp.shape(q)} and k {jnp.shape(k)}: one sequence, one shape")
    seq_len, head_dim = jnp.shape(q)[1], jnp.shape(q)[3]
    for name, block in zip(("block_q", "block_k"), blocks):
        if not is_count(block) or seq_len % block or (block % 8 and block != seq_len):
            fits = [n for n in range(8, min(seq_len, 1024) + 1, 8) if seq_len % n == 0] or [seq_len]
            raise ValueError(
                f"{where}: {name}={block} does not tile the {tokens} of {seq_len} tokens; use a "
                f"divisor of it that is a multiple of 8 (the TPU's sublanes) or {seq_len} itself: "
                f"{', '.join(map(str, fits[-4:]))}"
            )
    flash_tiles(blocks, head_dim, jnp.dtype(q.dtype).itemsize, row_tile, score_tile, where)
    if not interpret and blocks[0] % 128 and blocks[0] != seq_len:
        fits = [n for n in range(128, min(seq_len, 1024) + 1, 128) if seq_len % n == 0] or [seq_len]
        raise ValueError(
            f"{where}: block_q={blocks[0]}: on a TPU the backward pass lays a query block's lse "
            f"along the 128 lanes, so block_q is a multiple of 128 or the whole {tokens} ({seq_len}): "
            f"{', '.join(map(str, fits[-4:]))} (the interpreter takes any multiple of 8)"
        )
    device = getattr(jax.config, "jax_default_device", None) or jax.devices()[0]  # where it would run
    platform = getattr(device, "platform", str(device))
    if not interpret and platform != "tpu":
        raise ValueError(
            f"{where}: the Pallas kernel runs on a TPU, and this device is a {platform}; pass "
            "interpret=True to run it here (slowly, as the tests do), or use minishard.context.attention"
        )


def flash_tiles(
    blocks: Any, head_dim: int, itemsize: int, row_tile: int, score_tile: int, where: str = "flash_attention"
) -> None:
    """The flash kernel's tiles fit VMEM: a ``[block, head_dim]`` tile and the float32 score tile."""
    rows = max(blocks) * max(head_dim, 128) * itemsize  # a tile's lanes: 128 at least
    if rows > row_tile:
        raise ValueError(
            f"{where}: head_dim {head_dim} makes [{max(blocks)}, {head_dim}] tiles of "
            f"{rows / 2**20:g} MiB, over the {row_tile / 2**20:g} MiB that fit VMEM beside the rest; "
            f"use smaller blocks (at most {row_tile // (max(head_dim, 128) * itemsize)} rows) or heads"
        )
    if blocks[0] * blocks[1] * 4 > score_tile:
        raise ValueError(
            f"{where}: block_q x block_k = {blocks[0]} x {blocks[1]} makes a float32 score tile of "
            f"{blocks[0] * blocks[1] * 4 / 2**20:g} MiB, over the {score_tile / 2**20:g} MiB that fit "
            f"VMEM three times; use blocks with block_q x block_k <= {score_tile // 4:,}"
        )
