"""Context parallelism by hand: ring attention, its backward ring, and the zig-zag balance.

A long context splits the *sequence*: each device holds a chunk of every activation's
tokens. What a transformer does token by token (Linears, LayerNorms, the MLP) runs on each
device alone; attention cannot, since every query needs every key. In a ring, queries stay
and keys and values travel, one ``ppermute`` per step, inside ``jax.shard_map``. In three
steps, each checked against ``attention`` on one device (``minishard.sequence`` has the
other ways: all-gather, all-to-all, and Megatron's sequence parallelism):

1. **Attention in pieces.** ``attend`` queries over some keys; ``merge`` two such
   partial softmaxes through their log-sum-exp: the online softmax, across devices.
2. **Where the chunks live.** In order, or zig-zag (device i holds chunks i and 2p-1-i
   of 2p); ``meets`` says which chunks a device's queries meet at each step, ``kind``
   whether a pair is computed, masked (the diagonal) or skipped (all in the future).
3. **The ring.** ``ring_attention``, p steps; its ``jax.custom_vjp`` sends K, V and their
   gradients round again, so the backward pass keeps one chunk per device, whatever p
   (``ring_kept``; ``ring_in_flight``, the chunks passing by).
4. **What it sends.** ``ring_report`` counts a compiled step's collective-permutes beside
   the formula (``ring_permutes``), and shows the balance of both layouts.

>>> balance(p=4, layout="in-order"), balance(p=4, layout="zigzag")   # slowest device / mean
(1.6, 1.0)
>>> positions(seq_len=8, p=2, layout="zigzag").tolist()   # device 0 holds chunks 0 and 3 of 4
[0, 1, 6, 7, 2, 3, 4, 5]
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from minishard import _checks
from minishard.census import human_bytes, instructions, mesh_of
from minishard.costs import ring_bound
from minishard.hardware import hardware_named
from minishard.pipeline import ring_pairs

CHUNKS = {"in-order": 1, "zigzag": 2}
"""The layouts of a sequence over the devices, and how many chunks each device holds."""
MASK_VALUE = float(jnp.finfo(jnp.float32).min)  # a masked score: weight exp(MASK_VALUE - lse) is 0, no NaN
Partial = tuple[jax.Array, jax.Array]  # (out, lse): attention over some of the keys
F32 = {"preferred_element_type": jnp.float32}  # the matrix unit's sums in float32, whatever goes in
Dropped = Callable[[jax.Array], jax.Array] | None  # what becomes of the softmax's weights (dropout), or None

# --- 1. attention in pieces: the online softmax ------------------------------------


def visible(q_pos: jax.Array, k_pos: jax.Array) -> jax.Array:
    """The causal mask, ``[queries, keys]``: a query sees the keys at its position or before."""
    return k_pos[None, :] <= q_pos[:, None]


def scores(q: jax.Array, k: jax.Array, q_pos: Any, k_pos: Any, causal: bool) -> jax.Array:
    """``q·k / sqrt(head_dim)`` per ``[batch, head, query, key]`` in float32 (heads before queries: a split
    of heads and of the sequence propagates as the model's layers have it); causal: the future masked.

    bf16 inputs go into the matrix unit as they are, its sums come out in float32 (``F32``): the
    softmax is taken in float32, and no float32 copy of q or k is made."""
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, **F32) * q.shape[-1] ** -0.5
    return jnp.where(visible(q_pos, k_pos)[None, None], s, MASK_VALUE) if causal else s


def attend(
    q: Any, k: Any, v: Any, q_pos: Any, k_pos: Any, *, causal: bool = False, dropped: Dropped = None
) -> Partial:
    """Attention of the queries over *these* keys only: ``(out [b, q, h, d], lse [b, q, h])``, float32.

    ``lse``, the log of the softmax's denominator, is all a later ``merge`` needs of the scores.
    ``dropped``: a function of the weights ``[b, h, q, k]`` (a model's dropout, in training), or None.
    """
    s = scores(q, k, q_pos, k_pos, causal)
    lse = jax.nn.logsumexp(s, axis=-1)  # [b, h, q]
    weights = jnp.exp(s - lse[..., None])  # the softmax, [b, h, q, k]
    weights = weights if dropped is None else dropped(weights)
    # The weights meet the values in the values' dtype (bf16 in a bf16 step: half the bytes of the
    # [b, h, q, k] array the matrix unit reads), summed in float32, as the flash kernel does.
    out = jnp.einsum("bhqk,bkhd->bqhd", weights.astype(v.dtype), v, **F32)
    return out, lse.swapaxes(1, 2)


def merge(out1: jax.Array, lse1: jax.Array, out2: jax.Array, lse2: jax.Array) -> Partial:
    """Two attentions of the same queries over disjoint keys, as one over all of them.

    Part i is normalised by its own denominator ``e^lse_i``; the whole one's is their
    sum, ``e^lse = e^lse1 + e^lse2``, so part i weighs ``e^(lse_i - lse)``.

    >>> q = k = v = jnp.eye(4)[None, :, None, :]    # 4 tokens, 1 head of 4 features
    >>> at = jnp.arange(4)
    >>> left, right = attend(q, k[:, :2], v[:, :2], at, at[:2]), attend(q, k[:, 2:], v[:, 2:], at, at[2:])
    >>> bool(jnp.allclose(merge(*left, *right)[0], attend(q, k, v, at, at)[0]))
    True
    """
    _checks.partials(out1, lse1, out2, lse2)  # the same queries: outputs of one shape, an lse per row
    w1, w2, lse = merge_weights(lse1, lse2)
    return w1[..., None] * out1 + w2[..., None] * out2, lse


def merge_weights(lse1: jax.Array, lse2: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``merge``'s arithmetic: each part's weight in the whole, ``e^(lse_i - lse)``, and the
    whole's ``lse``; the one home of the online softmax, which ``minishard.flash`` runs by tiles.

    >>> [round(float(x), 3) for x in merge_weights(jnp.log(1.0), jnp.log(3.0))]   # sums 1 and 3
    [0.25, 0.75, 1.386]
    """
    lse = jnp.logaddexp(lse1, lse2)
    return jnp.exp(lse1 - lse), jnp.exp(lse2 - lse), lse


def merge_across(out: jax.Array, lse: jax.Array, axis: str) -> Partial:
    """``merge`` of the p devices of ``axis``, inside ``shard_map``: each device's attention of the same
    queries over its own keys, as one over all of them, on every device. Part i weighs ``e^(lse_i - lse)``
    as in ``merge``, by three all-reduces: the max, the sum of exponentials, the weighted outputs.

    >>> import functools, minishard as ms
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = ms.make_mesh({"seq": 4}, devices=jax.devices()[:4])
    >>> q, k, v = jax.random.normal(jax.random.key(0), (3, 1, 8, 2, 4))   # 8 keys, 2 per device
    >>> at = jnp.arange(8)
    >>> def mine(q, k, v):   # this device's keys, at their positions; then everyone's merged
    ...     here = 2 * jax.lax.axis_index("seq") + jnp.arange(2)
    ...     return merge_across(*attend(q, k, v, at, here), "seq")[0]
    >>> merged = jax.shard_map(mine, mesh=mesh, in_specs=(P(), P(None, "seq"), P(None, "seq")), out_specs=P())
    >>> bool(jnp.allclose(merged(q, k, v), attend(q, k, v, at, at)[0], atol=1e-6))
    True
    """
    top = jax.lax.pmax(lse, axis)  # the largest: no e^(lse_i - top) overflows
    weights = jnp.exp(lse - top)
    total = jax.lax.psum(weights, axis)  # e^(lse - top): the whole denominator, scaled
    return jax.lax.psum(weights[..., None] * out, axis) / total[..., None], top + jnp.log(total)


def attention(q: Any, k: Any, v: Any, q_pos: Any = None, k_pos: Any = None, *, causal: bool = False) -> Any:
    """Softmax attention on one device, ``[batch, seq, heads, head_dim]``, the queries at ``q_pos`` (``0, 1,
    ...``), the keys at ``k_pos`` (the queries'): the oracle for the rest, and the models' dense core.
    Keys and values may have fewer heads, a divisor of the queries' (grouped-query attention, ``grouped``)."""
    _checks.qkv("attention", q, k, v)  # float [batch, seq, heads, head_dim] arrays, k and v of one shape
    q_pos = jnp.arange(q.shape[1]) if q_pos is None else q_pos
    k_pos = q_pos if k_pos is None else k_pos
    if (group := q.shape[2] // max(k.shape[2], 1)) > 1:  # a group of query heads: more queries of a K/V head
        out = attend(grouped(q, group), k, v, jnp.repeat(q_pos, group), k_pos, causal=causal)[0]
        return grouped(out, group, inverse=True).astype(q.dtype)
    return attend(q, k, v, q_pos, k_pos, causal=causal)[0].astype(q.dtype)


def grouped(q: jax.Array, group: int, *, inverse: bool = False) -> jax.Array:
    """Grouped-query attention as multi-head: ``q`` ``[b, t, heads, d]`` as ``[b, t·group, heads / group,
    d]``, query head ``h`` a query of K/V head ``h // group`` (row ``t·group + h % group``, at its token's
    position), so ``attend`` reads each K/V head once for its group; ``inverse``: the outputs back.

    >>> q = jnp.arange(4.0).reshape(1, 1, 4, 1)   # one token, 4 query heads: 2 groups of 2
    >>> grouped(q, 2)[0, :, :, 0].tolist(), bool((grouped(grouped(q, 2), 2, inverse=True) == q).all())
    ([[0.0, 2.0], [1.0, 3.0]], True)
    """
    b, t, h, d = q.shape
    if inverse:
        return q.reshape(b, t // group, group, h, d).swapaxes(2, 3).reshape(b, t // group, h * group, d)
    return q.reshape(b, t, h // group, group, d).swapaxes(2, 3).reshape(b, t * group, h // group, d)


# --- 2. where the chunks live, and what each step computes --------------------------


def chunks(device: Any, p: int, layout: str = "in-order") -> tuple[Any, ...]:
    """The sequence chunks ``device`` holds (ints or traced): in order, chunk ``device`` of
    ``p``; zig-zag, chunks ``device`` and ``2p-1-device`` of ``2p``, one from each end."""
    _checks.chunk_holder(device, p, layout, CHUNKS)  # a device of the ring (when an int), a known layout
    return (device,) if layout == "in-order" else (device, 2 * p - 1 - device)


def meets(device: Any, step: Any, p: int, layout: str = "in-order") -> tuple[Any, Any]:
    """At ``step`` of the ring: the chunks of ``device``'s queries, and of the K and V passing by,
    which move one device on per step: at step s, device d holds device (d - s)'s.

    >>> meets(device=1, step=1, p=4, layout="zigzag")   # its own chunks 1 and 6; device 0's 0 and 7
    ((1, 6), (0, 7))
    """
    return chunks(device, p, layout), chunks((device - step) % p, p, layout)


def needed(q_chunk: Any, k_chunk: Any, causal: bool) -> Any:
    """A chunk pair is computed unless the mask is causal and all its keys are in the future."""
    return k_chunk <= q_chunk if causal else True


def kind(q_chunk: int, k_chunk: int, causal: bool = True) -> str:
    """``"computed"``, ``"masked"`` (the diagonal: half of it is in the future) or ``"skipped"``."""
    if not needed(q_chunk, k_chunk, causal):
        return "skipped"
    return "masked" if causal and q_chunk == k_chunk else "computed"


def pair_kinds(p: int, layout: str = "in-order", causal: bool = True) -> list[list[tuple[str, ...]]]:
    """Per device, per step: the ``kind`` of each pair that ``meets`` names, query chunks major.

    >>> pair_kinds(p=2, layout="zigzag")[1]   # device 1 (chunks 1, 2): step 0 its own, step 1 device 0's
    [('masked', 'skipped', 'computed', 'masked'), ('computed', 'skipped', 'computed', 'skipped')]
    """
    _checks.ring("pair_kinds", p, layout, CHUNKS)  # p >= 1 devices, a known layout

    def cell(device: int, step: int) -> tuple[str, ...]:
        mine, theirs = meets(device, step, p, layout)
        return tuple(kind(q, k, causal) for q in mine for k in theirs)

    return [[cell(d, s) for s in range(p)] for d in range(p)]


def balance(p: int, layout: str = "in-order", causal: bool = True) -> float:
    """The slowest device's work over the mean, counting the pairs it computes or masks (a masked
    pair costs a computed one: the mask comes after the matmul). In order, device i works at
    i + 1 steps: 2p/(p+1); zig-zag, every device at 2p + 1 pairs: 1."""
    _checks.ring("balance", p, layout, CHUNKS)
    work = [sum(k != "skipped" for cell in row for k in cell) for row in pair_kinds(p, layout, causal)]
    return max(work) / (sum(work) / p)


def span(chunk: Any, size: int) -> jax.Array:
    """The positions of the ``size`` tokens of chunk number ``chunk``."""
    return chunk * size + jnp.arange(size)


def positions(seq_len: int, p: int, layout: str = "in-order", device: Any = None) -> jax.Array:
    """The positions of the tokens ``device`` holds (by default all devices', in turn), as held.

    Position embeddings and the causal mask must read these: under zig-zag, tokens are out of order.
    """
    _checks.sequence_layout(seq_len, p, layout, CHUNKS, where="positions")
    size, devices = seq_len // (p * CHUNKS[layout]), range(p) if device is None else [device]
    return jnp.concatenate([span(c, size) for d in devices for c in chunks(d, p, layout)])


def permute(x: jax.Array, p: int, layout: str, *, axis: int = 1, inverse: bool = False) -> jax.Array:
    """``x``'s sequence (dimension ``axis``) reordered as the devices hold it; ``inverse``: back again."""
    order = positions(x.shape[axis], p, layout)
    return jnp.take(x, jnp.argsort(order) if inverse else order, axis=axis)


# --- 3. the ring -------------------------------------------------------------------


def _when(run: Any, fn: Callable[..., Any], kept: Any, *operands: Any) -> Any:
    """``fn(kept, *operands)`` if ``run``, else ``kept``: a ``lax.cond``, so a skipped pair costs nothing."""
    if run is True:
        return fn(kept, *operands)
    return jax.lax.cond(run, fn, lambda kept, *_: kept, kept, *operands)


def _pairs(mine: Any, theirs: Any, size: int, causal: bool) -> Any:
    """A step's pairs: (query chunk index, key chunk index, needed?, the two chunks' positions)."""
    for a, b in itertools.product(range(len(mine)), range(len(theirs))):
        yield a, b, needed(mine[a], theirs[b], causal), span(mine[a], size), span(theirs[b], size)


def _visit(acc: Any, qs: Any, kv: Any, mine: Any, theirs: Any, causal: bool) -> Any:
    """One step: each needed pair attended and merged into its query chunk's running result."""

    def merged(running: Partial, *pair: Any) -> Partial:
        return merge(*running, *attend(*pair, causal=causal))

    acc = list(acc)
    ks, vs = (jnp.split(x, len(theirs), axis=1) for x in kv)
    for a, b, run, *at in _pairs(mine, theirs, qs[0].shape[1], causal):
        acc[a] = _when(run, merged, acc[a], qs[a], ks[b], vs[b], *at)
    return tuple(acc)


def ring_forward(q: Any, k: Any, v: Any, *, axis: str, causal: bool = False, layout: str = "in-order") -> Any:
    """The ring's forward pass, inside ``shard_map``: ``(out, lse)`` of this device's queries, float32.

    p steps, each attending and merging the needed pairs that ``meets`` names. The next step's K and V
    leave *before* this step's work, so a GPU or TPU can hide the transfer behind it; the last
    step sends nothing: 2(p-1) collective-permutes. ``jax.grad`` can differentiate this as it
    is, and then keeps every step's K, V and scores.
    """
    _checks.context_inputs("ring_attention", q, k, v, axis, layout, CHUNKS)
    p, me = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
    qs = jnp.split(q, CHUNKS[layout], axis=1)
    acc = tuple((jnp.zeros_like(x, jnp.float32), jnp.full_like(x[..., 0], -jnp.inf, jnp.float32)) for x in qs)

    def step(carry: Any, s: jax.Array) -> tuple[Any, None]:
        acc, kv = carry
        passed = jax.lax.ppermute(kv, axis, ring_pairs(p))  # sent now, used at the next step
        return (_visit(acc, qs, kv, *meets(me, s, p, layout), causal), passed), None

    (acc, kv), _ = jax.lax.scan(step, (acc, (k, v)), jnp.arange(p - 1))
    acc = _visit(acc, qs, kv, *meets(me, p - 1, p, layout), causal)
    return tuple(jnp.concatenate(parts, axis=1) for parts in zip(*acc))


def attend_grads(q: Any, k: Any, v: Any, out: Any, g: Any, lse: Any, *at: Any) -> Any:
    """One pair's share of ``(dq, dk, dv)``, from the *final* ``out`` and ``lse``, in picotron's steps.

    The softmax's weights ``w = exp(s - lse)`` for these keys are recomputed, not kept (``at``:
    positions, causal); ``g`` is the gradient of ``out``. Each step is one line:

    >>> q, k, v, g = jax.random.normal(jax.random.key(0), (4, 1, 3, 2, 8))   # 3 tokens, 2 heads of 8
    >>> at = jnp.arange(3)
    >>> out, lse = attend(q, k, v, at, at, causal=True)
    >>> _, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, at, at, causal=True)[0], q, k, v)
    >>> grads = attend_grads(q, k, v, out, g, lse, at, at, True)   # positions, causal
    >>> [bool(jnp.allclose(mine, jax_s, atol=1e-5)) for mine, jax_s in zip(grads, vjp(g))]
    [True, True, True]
    """
    w = jnp.exp(scores(q, k, *at) - lse.swapaxes(1, 2)[..., None])  # the weights, [b, h, q, k]
    dv = jnp.einsum("bhqk,bqhd->bkhd", w, g)  # 1. dv = wᵀ·g
    dp = jnp.einsum("bqhd,bkhd->bhqk", g, v.astype(jnp.float32))  # 2. dp = g·vᵀ, the weights' gradient
    delta = jnp.sum(g * out, axis=-1)  # 3. delta = Σ g·out per query: what the softmax takes back
    ds = w * (dp - delta.swapaxes(1, 2)[..., None]) * q.shape[-1] ** -0.5  # 4. ds: the scores' gradient
    dq = jnp.einsum("bhqk,bkhd->bqhd", ds, k.astype(jnp.float32))  # 5. dq = ds·k
    dk = jnp.einsum("bhqk,bqhd->bkhd", ds, q.astype(jnp.float32))  # 6. dk = dsᵀ·q
    return dq, dk, dv


def _visit_grads(dqs: Any, dkv: Any, rows: Any, kv: Any, mine: Any, theirs: Any, causal: bool) -> Any:
    """A backward step: each needed pair adds to its dq (kept) and dk, dv (travelling with k, v)."""

    def added(grads: Any, *pair: Any) -> Any:
        return tuple(a + b for a, b in zip(grads, attend_grads(*pair, causal)))

    dqs = list(dqs)
    ks, vs, dks, dvs = (jnp.split(x, len(theirs), axis=1) for x in (*kv, *dkv))
    for a, b, run, *at in _pairs(mine, theirs, rows[0][0].shape[1], causal):
        q, *rest = rows[a]  # the queries, and their out, g and lse
        dqs[a], dks[b], dvs[b] = _when(run, added, (dqs[a], dks[b], dvs[b]), q, ks[b], vs[b], *rest, *at)
    return tuple(dqs), (jnp.concatenate(dks, axis=1), jnp.concatenate(dvs, axis=1))


def _ring_bwd(axis: str, causal: bool, layout: str, residuals: Any, g: jax.Array) -> Any:
    """The backward ring: K, V and their gradients travel together; dK and dV are home after p sends."""
    q, k, v, out, lse = residuals
    p, me = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
    g = g.astype(jnp.float32)
    rows = list(zip(*(jnp.split(x, CHUNKS[layout], axis=1) for x in (q, out, g, lse))))
    dqs = tuple(jnp.zeros_like(row[0], jnp.float32) for row in rows)
    dkv = jnp.zeros_like(k, jnp.float32), jnp.zeros_like(v, jnp.float32)

    def step(carry: Any, s: jax.Array) -> tuple[Any, None]:
        dqs, kv, dkv = carry
        passed = jax.lax.ppermute(kv, axis, ring_pairs(p))  # K and V, sent before this step's work
        dqs, dkv = _visit_grads(dqs, dkv, rows, kv, *meets(me, s, p, layout), causal)
        return (dqs, passed, jax.lax.ppermute(dkv, axis, ring_pairs(p))), None

    (dqs, kv, dkv), _ = jax.lax.scan(step, (dqs, (k, v), dkv), jnp.arange(p - 1))
    dqs, dkv = _visit_grads(dqs, dkv, rows, kv, *meets(me, p - 1, p, layout), causal)
    dk, dv = jax.lax.ppermute(dkv, axis, ring_pairs(p))  # the last step's gradients, home
    return jnp.concatenate(dqs, axis=1).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _ring_fwd(q: Any, k: Any, v: Any, axis: str, causal: bool, layout: str) -> Any:
    out, lse = ring_forward(q, k, v, axis=axis, causal=causal, layout=layout)
    return out.astype(q.dtype), (q, k, v, out, lse)  # one chunk of each: flat in p


_ring = jax.custom_vjp(lambda *args: _ring_fwd(*args)[0], nondiff_argnums=(3, 4, 5))
_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_attention(
    q: Any, k: Any, v: Any, *, axis: str, causal: bool = False, layout: str = "in-order"
) -> Any:
    """Attention of this device's queries over the whole sequence, inside ``shard_map`` over ``axis``.

    ``q, k, v``: this device's ``[batch, seq / p, heads, head_dim]``, its chunks of
    ``layout``. The forward pass is ``ring_forward``; the backward pass keeps only
    ``q, k, v, out, lse`` and sends K, V, dK, dV round the ring again.

    >>> import functools, minishard as ms
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = ms.make_mesh({"seq": 4}, devices=jax.devices()[:4])
    >>> q, k, v = jax.random.normal(jax.random.key(0), (3, 1, 16, 2, 8))   # 16 tokens, 4 per device
    >>> ring = jax.shard_map(functools.partial(ring_attention, axis="seq", causal=True), mesh=mesh,
    ...                      in_specs=P(None, "seq"), out_specs=P(None, "seq"))
    >>> float(jnp.abs(ring(q, k, v) - attention(q, k, v, causal=True)).max()) < 1e-5
    True
    """
    return _ring(q, k, v, axis, causal, layout)


def ring_kept(b: int, t: int, heads: int) -> int:
    """Numbers one ring attention keeps for its backward pass beyond q, k, v and out (``_ring_fwd``'s
    residuals; a dense block keeps those too): the log-sum-exp of each of the ``b·t`` queries per head.
    Not the softmax's weights, ``b heads t s``: ``attend_grads`` recomputes them pair by pair, as
    Korthikanti's selective recomputation does (``minishard.memory.block_activations``).

    >>> ring_kept(b=2, t=16, heads=4)
    128
    """
    return b * t * heads


def ring_in_flight(b: int, t: int, heads: int, head_dim: int) -> int:
    """Numbers passing by while one ring attention's backward pass runs, per device, beside what it
    kept: K and V, the next K and V, dK and dV and the next ones (``_ring_bwd``'s carry and its two
    ``ppermute``\\ s), and the dQ being added up: 9 chunks ``[b, t, heads, head_dim]``.

    >>> ring_in_flight(b=1, t=16, heads=2, head_dim=8)   # 9 chunks of 256
    2304
    """
    return 9 * b * t * heads * head_dim


# --- 4. what the ring sends, read from a compiled step -----------------------------


def ring_permutes(p: int) -> tuple[int, int]:
    """The collective-permutes of one ring attention, ``(forward, backward)``: forward, K and V at
    each step but the last; backward, K and V again, and dK and dV at every step (the last: home).

    >>> ring_permutes(4)   # 2 x 3 forward; 2 x 3 + 2 x 4 backward
    (6, 14)
    """
    return 2 * (p - 1), 2 * (p - 1) + 2 * p


@dataclasses.dataclass(frozen=True)
class RingReport:
    """``ring_report``: a step's collective-permutes over ``axis`` (the census's ``(count, bytes)``),
    beside ``ring_permutes``'s formula for ``blocks`` rings of float32 ``chunk``\\ s, one device's K
    (or V) ``[batch, seq / p, heads, head_dim]``; ``print`` shows both and the two layouts' balance.

    >>> import functools, minishard as ms
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = ms.make_mesh({"seq": 4}, devices=jax.devices()[:4])
    >>> ring = jax.shard_map(functools.partial(ring_attention, axis="seq", causal=True, layout="zigzag"),
    ...                      mesh=mesh, in_specs=P(None, "seq"), out_specs=P(None, "seq"))
    >>> grads = jax.jit(jax.grad(lambda q, k, v: ring(q, k, v).sum(), argnums=(0, 1, 2)))
    >>> x = jax.ShapeDtypeStruct((1, 16, 2, 8), jnp.float32)   # 16 tokens, 4 per device
    >>> report = ring_report(grads.lower(x, x, x), axis="seq", blocks=1, chunk=(1, 4, 2, 8))
    >>> report.sent == report.formula   # 20 permutes of 256 bytes, as the formula says
    True
    >>> print(report)
    Ring attention over 'seq', p = 4, zig-zag. Per block, forward: K and V x 3 trips;
      backward: K and V x 3 trips, dK and dV x 4 (the last one home): 20 permutes
      census: collective-permute over seq x20, 5.1 kB
      formula: 1 blocks x 20 chunks [1, 4, 2, 8] f32 = 5.1 kB
      balance (slowest device / mean): zig-zag 1.0, in order 1.6
    """

    axis: str
    p: int
    layout: str
    blocks: int  # ring attentions in the step
    chunk: tuple[int, ...]
    sent: tuple[int, int]
    hardware: str | None = None  # a key of HARDWARE: then say whether the sends hide behind the work

    @property
    def formula(self) -> tuple[int, int]:
        count = self.blocks * sum(ring_permutes(self.p))
        return count, count * math.prod(self.chunk) * 4

    def __str__(self) -> str:
        p, per_block, (count, nbytes) = self.p, sum(ring_permutes(self.p)), self.sent
        layout = "zig-zag" if self.layout == "zigzag" else "in order"
        lines = [
            f"Ring attention over {self.axis!r}, p = {p}, {layout}. "
            f"Per block, forward: K and V x {p - 1} trips;",
            f"  backward: K and V x {p - 1} trips, dK and dV x {p} (the last one home): {per_block} permutes",
            f"  census: collective-permute over {self.axis} x{count}, {human_bytes(nbytes)}",
            f"  formula: {self.blocks} blocks x {per_block} chunks {list(self.chunk)} f32 = "
            f"{human_bytes(self.formula[1])}",
            f"  balance (slowest device / mean): zig-zag {balance(p, 'zigzag')}, in order {balance(p):.3g}",
        ]
        return "\n".join(lines + ([self._hidden()] if self.hardware else []))

    def _hidden(self) -> str:
        """``costs.ring_bound``'s verdict on ``hardware``: do the sends hide behind the attention?"""
        (b, t, heads, head_dim), hardware = self.chunk, hardware_named(str(self.hardware))
        k = ring_bound(t * self.p, heads, heads, head_dim, self.p, hardware, batch=b)
        verdict = "hidden behind the blocks" if k <= 1 else "the ring waits; a longer context hides it"
        return f"  on {self.hardware}: a step's sends / the attention they hide behind = {k:.3g}: {verdict}"


def ring_report(
    program: Any, *, axis: str, blocks: int, chunk: Any, layout: str = "zigzag", **options: Any
) -> RingReport:
    """A ``RingReport`` of a lowered (or compiled) training step; ``options``: its ``hardware``."""
    compiled = program.compile() if isinstance(program, jax.stages.Lowered) else program
    mesh = mesh_of(compiled)
    p = int(dict(mesh.shape)[axis]) if mesh is not None else 1  # no mesh: nothing sent
    found = instructions(compiled, mesh)
    sent = [n for kind, n, groups, _ in found if kind == "collective-permute" and groups == ((axis,),)]
    return RingReport(axis, p, layout, blocks, tuple(chunk), (len(sent), sum(sent)), **options)


__all__ = [
    "CHUNKS",
    "Dropped",
    "MASK_VALUE",
    "Partial",
    "RingReport",
    "attend",
    "attend_grads",
    "attention",
    "balance",
    "chunks",
    "grouped",
    "kind",
    "meets",
    "merge",
    "merge_across",
    "merge_weights",
    "needed",
    "pair_kinds",
    "permute",
    "positions",
    "ring_attention",
    "ring_forward",
    "ring_in_flight",
    "ring_kept",
    "ring_permutes",
    "ring_report",
    "scores",
    "span",
    "visible",
]
