"""Context parallelism by hand: ring attention, its backward ring, and the zig-zag balance.

A long context splits the *sequence*: each device holds a chunk of every activation's
tokens. What a transformer does token by token (Linears, LayerNorms, the MLP) runs on each
device alone; attention cannot, since every query needs every key. In a ring, queries stay
and keys and values travel, one ``ppermute`` per step, inside ``jax.shard_map``. Each step
below is checked against ``attention`` on one device (``minishard.sequence`` has the other
ways: all-gather, all-to-all, and Megatron's sequence parallelism):

1. **Attention in pieces.** ``scores`` of queries against keys (summed in float32, ``F32``),
   ``MASK_VALUE`` where a key is not ``visible``; ``attend`` the queries over some keys (what is
   ``Dropped`` of the weights, in training), a ``Partial`` result ``(out, lse)``; ``merge`` two
   partial softmaxes through their log-sum-exp (``merge_weights``: the online softmax, across
   devices). ``attention`` is the whole of it on one device: the oracle. In a bf16 step,
   ``narrow_attend``: the weights as a flash tile holds them (``shifted_exp``), in bf16, and a
   backward of its own that keeps them so, half the bytes of float32's; ``softmax_grad`` is the
   softmax's backward, ``dS = P·(dP - rowsum(dP·P))``, which the ring and the kernel share.
2. **Where the chunks live.** A sequence's chunk order, in order or zig-zag (``CHUNKS``: device
   i holds chunks i and 2p-1-i of 2p); ``chunks`` names them, ``meets`` which chunks a device's
   queries meet at each step, ``needed`` and ``kind`` whether a pair is computed, masked (the
   diagonal) or skipped (all in the future): ``PAIR_KINDS``, by ``kind_index``; ``pair_kinds`` the
   whole grid (a ``Cell`` per device and step) and ``balance`` its slowest device. ``span`` and
   ``held_order`` give the tokens' positions as the devices hold them; ``permute`` deals a
   sequence out in that order.
3. **The ring.** ``ring_forward``, p steps of ``attend`` and ``merge``, K and V passed on.
   Keys and values of fewer heads than the queries (grouped-query attention) travel as they
   are, and are ``repeated`` for the query heads where they arrive: a group's bytes once. A
   ``PairCore`` attends each pair of chunks, by its kind: ``DENSE_PAIRS`` (``attend``) unless
   the ring is given another (``minishard.flash``'s kernels, which come later in the book).
4. **The backward ring.** ``ring_attention`` is ``ring_forward`` with a ``jax.custom_vjp``
   that sends K, V and their gradients round again, so the backward pass keeps one chunk per
   device, whatever p; each pair's gradients come from the final ``(out, lse)``
   (``attend_grads``), a group's ``summed`` before they travel. ``ring_permutes`` counts the
   collective-permutes both rings send.

What lets the ring serve other chapters (the dense core's grouped-query attention, decoding
over a split cache, its memory terms, a report of a compiled step) is ``minishard.composition``'s.

>>> balance(p=4, order="in-order"), balance(p=4, order="zigzag")   # slowest device / mean
(1.6, 1.0)
>>> held_order(seq_len=8, p=2, order="zigzag").tolist()   # device 0 holds chunks 0 and 3 of 4
[0, 1, 6, 7, 2, 3, 4, 5]
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from minishard import _checks_context
from minishard.pipeline import ring_pairs

CHUNKS = {"in-order": 1, "zigzag": 2}
"""The chunk orders of a sequence over the devices, and how many chunks each device holds."""
MASK_VALUE = float(jnp.finfo(jnp.float32).min)
"""A masked score: its weight ``exp(MASK_VALUE - lse)`` is 0, and no NaN appears."""
Partial = tuple[jax.Array, jax.Array]
"""``(out, lse)``: attention of some queries over some of the keys."""
F32 = {"preferred_element_type": jnp.float32}
"""The matrix unit's sums in float32, whatever goes in (bf16 in a bf16 step)."""
Dropped = Callable[[jax.Array], jax.Array] | None
"""What becomes of the softmax's weights (a model's dropout), or None."""
Cell = tuple[str, ...]
"""One device's step in ``pair_kinds``: the ``kind`` of each pair of chunks it meets."""
PAIR_KINDS = ("skipped", "computed", "masked")
"""What a pair of chunks costs, by ``kind_index``: nothing (all its keys in the future), every
score, or every score with the future's masked (the diagonal)."""

# --- 1. attention in pieces: the online softmax ------------------------------------


def visible(q_pos: jax.Array, k_pos: jax.Array) -> jax.Array:
    """The causal mask, ``[queries, keys]``: a query sees the keys at its position or before."""
    return k_pos[None, :] <= q_pos[:, None]


def scores(
    q: jax.Array, k: jax.Array, q_pos: Any, k_pos: Any, causal: bool, dtype: Any = jnp.float32
) -> jax.Array:
    """``q·k / sqrt(head_dim)`` per ``[batch, head, query, key]``; causal: the future masked.
    Heads come before queries: a split of heads and of the sequence propagates as the model's
    layers have it.

    bf16 inputs go into the matrix unit as they are (no float32 copy of q or k is made), and it
    sums in float32; its sums come out in ``dtype``. Float32 (``F32``) keeps every digit; bf16, a
    bf16 step's (``narrow_attend``), writes half the bytes of the largest array the step makes, as
    a plain bf16 step and PyTorch's autocast do; the softmax is taken in float32 either way."""
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=dtype) * q.shape[-1] ** -0.5
    masked = jnp.finfo(dtype).min  # MASK_VALUE in float32; bf16's least (MASK_VALUE rounds to -inf)
    return jnp.where(visible(q_pos, k_pos)[None, None], s, masked) if causal else s


def shifted_exp(s: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A row's softmax in parts, as a flash tile takes it: ``exp(s - top)`` (no exponential
    overflows), the row's ``top`` score and ``total``, the sum of the first; the softmax is the
    first over ``total``, ``lse`` is ``top + log(total)``.

    >>> weights, top, total = shifted_exp(jnp.log(jnp.array([1.0, 3.0])))   # scores log 1, log 3
    >>> lse = top + jnp.log(total)   # log 4
    >>> (weights / total).round(2).tolist(), round(float(lse[0]), 3)
    ([0.25, 0.75], 1.386)
    """
    top = jnp.max(s, axis=-1, keepdims=True)
    weights = jnp.exp(s - top)
    return weights, top, jnp.sum(weights, axis=-1, keepdims=True)


def attend(
    q: Any, k: Any, v: Any, q_pos: Any, k_pos: Any, *, causal: bool = False, dropped: Dropped = None
) -> Partial:
    """Attention of the queries over *these* keys only: ``(out [b, q, h, d], lse [b, q, h])``,
    float32.

    ``lse``, the log of the softmax's denominator, is all a later ``merge`` needs of the scores.
    ``dropped``: a function of the weights ``[b, h, q, k]`` (a model's dropout, in training), or
    None. Float32 values: the weights are float32, and autodiff's backward keeps them. Narrower
    (bf16 in a bf16 step): ``narrow_attend``, whose backward keeps them in the values' dtype.
    """
    if v.dtype != jnp.float32:
        return narrow_attend(q, k, v, q_pos, k_pos, causal=causal, dropped=dropped)
    s = scores(q, k, q_pos, k_pos, causal)
    lse = jax.nn.logsumexp(s, axis=-1)  # [b, h, q]
    weights = jnp.exp(s - lse[..., None])  # the softmax, [b, h, q, k]
    weights = weights if dropped is None else dropped(weights)
    # The weights meet the values in the values' dtype (bf16 in a bf16 step: half the bytes of the
    # [b, h, q, k] array the matrix unit reads), summed in float32, as the flash kernel does.
    out = jnp.einsum("bhqk,bkhd->bqhd", weights.astype(v.dtype), v, **F32)
    return out, lse.swapaxes(1, 2)


def softmax_grad(weights: Any, d_weights: Any, delta: Any) -> Any:
    """The softmax's backward: the scores' gradient ``dS = P·(dP - delta)`` from the weights ``P``,
    their gradient ``dP`` and, per query, ``delta = rowsum(dP·P)``; ``narrow_attend``'s, the
    ring's (``attend_grads``) and the flash kernel's (``flash.tile_grads``).

    Since ``dP_j/dS_i = P_j·(1[i=j] - P_i)``, ``dS_i = Σ_j dP_j·P_j·(1[i=j] - P_i)``, which is
    ``P_i·(dP_i - rowsum(dP·P))``. With ``out = P·v``, ``rowsum(dP·P) = Σ g·out`` (``g`` the
    gradient of ``out``: FlashAttention's form, a sum over head_dim, not keys); a gradient ``dL``
    of ``lse`` adds ``P·dL`` (``dlse/dS = P``): ``delta`` less ``dL``.

    >>> p = jnp.array([[0.25, 0.75]])   # a row's weights; dP = (1, 1): the sum is constant
    >>> softmax_grad(p, jnp.ones((1, 2)), jnp.sum(p, axis=-1, keepdims=True)).tolist()
    [[0.0, 0.0]]
    """
    return weights * (d_weights - delta)


def narrow_attend(
    q: Any, k: Any, v: Any, q_pos: Any, k_pos: Any, *, causal: bool = False, dropped: Dropped = None
) -> Partial:
    """``attend``, by a backward (``_narrow_bwd``) that keeps q, k, v, ``out`` and the weights in
    the values' dtype, where autodiff's keeps float32 ones (``exp``'s gradient reads its output):
    in a bf16 step, half the bytes of the largest array attention keeps, ``[b, h, q, k]``.

    The weights are kept as a flash tile holds them, ``exp(s - top)`` (``shifted_exp``), and each
    query's output is divided by its ``total`` once: no pass over ``[b, h, q, k]`` divides them.
    ``dropped`` must scale each weight by its own factor (dropout's mask), ``dropped(1)``: an
    operand of the custom VJP, made outside it (its random key never enters it); such a scaling
    commutes with that division, is its own transpose, and keeps ``delta = Σ g·out``.
    """
    like = jnp.ones((q.shape[0], q.shape[2], q.shape[1], k.shape[1]), v.dtype)  # [b, h, q, k]
    factors = None if dropped is None else dropped(like)  # each weight's: 0 or 1 / (1 - rate)
    return _narrow(q, k, v, q_pos, k_pos, factors, causal)


def _narrow_fwd(q: Any, k: Any, v: Any, q_pos: Any, k_pos: Any, factors: Any, causal: bool) -> Any:
    s = scores(q, k, q_pos, k_pos, causal, v.dtype)  # bf16 in a bf16 step
    weights, top, total = shifted_exp(s.astype(jnp.float32))
    shifted = weights.astype(v.dtype)  # exp(s - top), in the values' dtype: the softmax · total
    lse = (top + jnp.log(total))[..., 0].swapaxes(1, 2)
    per_query = (1 / total).swapaxes(1, 2)  # 1 / total, [b, q, h, 1] as out is laid
    kept = shifted if factors is None else shifted * factors  # the weights dropped
    out = jnp.einsum("bhqk,bkhd->bqhd", kept, v, **F32) * per_query
    return (out, lse), (q, k, v, shifted, factors, out.astype(v.dtype), per_query)


def _narrow_bwd(causal: bool, residuals: Any, grads: Any) -> Any:
    """FlashAttention's steps (``attend_grads``'), on the kept weights ``P = shifted / total``:
    each matmul reads bf16 in a bf16 step and sums in float32."""
    q, k, v, shifted, factors, out, per_query = residuals
    g, d_lse = grads
    g_in = g.astype(v.dtype)  # as the matrix unit reads it
    g_per_total = (g * per_query).astype(v.dtype)
    kept = shifted if factors is None else shifted * factors
    dv = jnp.einsum("bhqk,bqhd->bkhd", kept, g_per_total, **F32)  # 1. dv = Pᵀ·g (P as dropped)
    d_kept = jnp.einsum("bqhd,bkhd->bhqk", g_in, v, **F32)  # 2. dP = g·vᵀ
    d_weights = d_kept if factors is None else d_kept * factors  # the drop's transpose: itself
    delta = jnp.sum(g * out.astype(jnp.float32), axis=-1) - d_lse  # 3. Σ g·out, less lse's
    delta_per_row = delta.swapaxes(1, 2)[..., None]
    weights = shifted.astype(jnp.float32) * per_query.swapaxes(1, 2)  # P, [b, h, q, k]
    ds = softmax_grad(weights, d_weights, delta_per_row) * q.shape[-1] ** -0.5  # 4. dS of q·k/√d
    dq = jnp.einsum("bhqk,bkhd->bqhd", ds.astype(k.dtype), k, **F32)  # 5. dq = dS·k
    dk = jnp.einsum("bhqk,bqhd->bkhd", ds.astype(q.dtype), q, **F32)  # 6. dk = dSᵀ·q
    grads_in = (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype))
    return (*grads_in, None, None, None)  # none of the positions, nor of the drop's factors


_narrow = jax.custom_vjp(lambda *args: _narrow_fwd(*args)[0], nondiff_argnums=(6,))
_narrow.defvjp(_narrow_fwd, _narrow_bwd)


def merge(out1: jax.Array, lse1: jax.Array, out2: jax.Array, lse2: jax.Array) -> Partial:
    """Two attentions of the same queries over disjoint keys, as one over all of them.

    Part i is normalised by its own denominator ``e^lse_i``; the whole one's is their
    sum, ``e^lse = e^lse1 + e^lse2``, so part i weighs ``e^(lse_i - lse)``.

    >>> q = k = v = jnp.eye(4)[None, :, None, :]    # 4 tokens, 1 head of 4 features
    >>> at = jnp.arange(4)
    >>> left = attend(q, k[:, :2], v[:, :2], at, at[:2])
    >>> right = attend(q, k[:, 2:], v[:, 2:], at, at[2:])
    >>> bool(jnp.allclose(merge(*left, *right)[0], attend(q, k, v, at, at)[0]))
    True
    """
    # the same queries: outputs of one shape, lse per row
    _checks_context.partials(out1, lse1, out2, lse2)
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


def attention(
    q: Any,
    k: Any,
    v: Any,
    q_pos: Any = None,
    k_pos: Any = None,
    *,
    causal: bool = False,
) -> Any:
    """Softmax attention on one device, ``[batch, seq, heads, head_dim]``: the oracle for the rest.

    The queries are at ``q_pos`` (by default ``0, 1, ...``), the keys at ``k_pos`` (by default the
    queries'). Keys and values of fewer heads (grouped-query attention) are
    ``minishard.composition.grouped_attention``'s.
    """
    # float [batch, seq, heads, head_dim] arrays
    _checks_context.qkv("attention", q, k, v, grouped=False)
    q_pos = jnp.arange(q.shape[1]) if q_pos is None else q_pos
    k_pos = q_pos if k_pos is None else k_pos
    return attend(q, k, v, q_pos, k_pos, causal=causal)[0].astype(q.dtype)


# --- 2. where the chunks live, and what each step computes --------------------------


def chunks(device: Any, p: int, order: str = "in-order") -> tuple[Any, ...]:
    """The sequence chunks ``device`` holds (ints or traced): in order, chunk ``device`` of
    ``p``; zig-zag, chunks ``device`` and ``2p-1-device`` of ``2p``, one from each end."""
    # a ring's device (an int), a known chunk order
    _checks_context.chunk_holder(device, p, order, CHUNKS)
    if order == "in-order":
        return (device,)
    return device, 2 * p - 1 - device


def meets(device: Any, step: Any, p: int, order: str = "in-order") -> tuple[Any, Any]:
    """At ``step`` of the ring: the chunks of ``device``'s queries, and of the K and V passing by,
    which move one device on per step: at step s, device d holds device (d - s)'s.

    >>> meets(device=1, step=1, p=4, order="zigzag")   # its own chunks 1 and 6; device 0's 0 and 7
    ((1, 6), (0, 7))
    """
    sender = (device - step) % p
    return chunks(device, p, order), chunks(sender, p, order)


def needed(q_chunk: Any, k_chunk: Any, causal: bool) -> Any:
    """A chunk pair is computed unless the mask is causal and all its keys are in the future."""
    return k_chunk <= q_chunk if causal else True


def kind(q_chunk: int, k_chunk: int, causal: bool = True) -> str:
    """``"computed"``, ``"masked"`` (the diagonal: half of it is in the future) or ``"skipped"``."""
    return PAIR_KINDS[kind_index(q_chunk, k_chunk, causal)]


def kind_index(q_chunk: Any, k_chunk: Any, causal: bool = True) -> Any:
    """The pair's ``kind`` as its index in ``PAIR_KINDS``: an int, or traced where the chunks are
    (in the ring, always: a device's chunks are its ``axis_index``'s), for a ``lax.switch`` to pick
    by.

    >>> [PAIR_KINDS[kind_index(q_chunk=1, k_chunk=k)] for k in (0, 1, 2)]
    ['computed', 'masked', 'skipped']
    """
    if not causal:
        return 1
    diagonal = q_chunk == k_chunk
    return needed(q_chunk, k_chunk, causal) * (1 + diagonal)


def pair_kinds(p: int, order: str = "in-order", causal: bool = True) -> list[list[Cell]]:
    """Per device, per step: the ``kind`` of each pair that ``meets`` names, query chunks major.

    >>> pair_kinds(p=2, order="zigzag")[1]   # device 1 (chunks 1, 2): its own, then device 0's
    [('masked', 'skipped', 'computed', 'masked'), ('computed', 'skipped', 'computed', 'skipped')]
    """
    _checks_context.ring("pair_kinds", p, order, CHUNKS)  # p >= 1 devices, a known chunk order

    def cell(device: int, step: int) -> Cell:
        mine, theirs = meets(device, step, p, order)
        return tuple(kind(q, k, causal) for q in mine for k in theirs)

    return [[cell(d, s) for s in range(p)] for d in range(p)]


def balance(p: int, order: str = "in-order", causal: bool = True) -> float:
    """The slowest device's work over the mean, counting the pairs it computes or masks (a masked
    pair costs a computed one: the mask comes after the matmul). In order, device i works at
    i + 1 steps: 2p/(p+1); zig-zag, every device at 2p + 1 pairs: 1."""
    _checks_context.ring("balance", p, order, CHUNKS)
    grid = pair_kinds(p, order, causal)
    work = [sum(k != "skipped" for cell in row for k in cell) for row in grid]
    mean = sum(work) / p
    return max(work) / mean


def span(chunk: Any, size: int) -> jax.Array:
    """The positions of the ``size`` tokens of chunk number ``chunk``."""
    return chunk * size + jnp.arange(size)


def held_order(seq_len: int, p: int, order: str = "in-order", device: Any = None) -> jax.Array:
    """The positions of the tokens ``device`` holds (by default all devices', in turn), in the
    order it holds them.

    Position embeddings and the causal mask must read these: under zig-zag, tokens are out of order.
    """
    _checks_context.chunked_sequence(seq_len, p, order, CHUNKS, where="held_order")
    size = seq_len // (p * CHUNKS[order])
    devices = range(p) if device is None else [device]
    return jnp.concatenate([span(c, size) for d in devices for c in chunks(d, p, order)])


def permute(x: jax.Array, p: int, order: str, *, axis: int = 1, inverse: bool = False) -> Any:
    """``x``'s sequence (dimension ``axis``) reordered as the devices hold it; ``inverse``: back."""
    held = held_order(x.shape[axis], p, order)
    return jnp.take(x, jnp.argsort(held) if inverse else held, axis=axis)


# --- 3. the ring --------------------------------------------------------------------


def repeated(x: jax.Array, group: int) -> jax.Array:
    """Keys (or values) of fewer heads, each repeated for its ``group`` of query heads
    (grouped-query attention): ``[b, t, heads / group, d]`` -> ``[b, t, heads, d]``, query head
    ``h`` reading K/V head ``h // group``. The ring sends them unrepeated and repeats them where
    they arrive: ``group`` times fewer bytes a step.

    >>> repeated(jnp.arange(2.0).reshape(1, 1, 2, 1), 2)[0, 0, :, 0].tolist()
    [0.0, 0.0, 1.0, 1.0]
    """
    return jnp.repeat(x, group, axis=2)


def summed(grad: jax.Array, group: int) -> jax.Array:
    """``repeated``'s transpose: the gradients of a group's repeated K (or V) heads added into
    their one K/V head's, ``[b, t, heads, d]`` -> ``[b, t, heads / group, d]``: what the backward
    ring sends.

    >>> summed(jnp.arange(4.0).reshape(1, 1, 4, 1), 2)[0, 0, :, 0].tolist()
    [1.0, 5.0]
    """
    b, t, heads, d = grad.shape
    return grad.reshape(b, t, heads // group, group, d).sum(axis=3)


def ring_forward(
    q: Any,
    k: Any,
    v: Any,
    *,
    axis: str,
    causal: bool = False,
    order: str = "in-order",
    pair_core: PairCore | None = None,
) -> Any:
    """The ring's forward pass in ``shard_map``: ``(out, lse)`` of this device's queries, float32.

    p steps, each attending (by ``pair_core``: ``DENSE_PAIRS`` if None) and merging the needed
    pairs that ``meets`` names. K and V leave *before* a step's work, so a GPU or TPU can hide
    the transfer behind it; the last step sends nothing: 2(p-1) collective-permutes. ``jax.grad``
    can differentiate this as it is, and then keeps every step's K, V and scores."""
    _checks_context.context_inputs("ring_attention", q, k, v, axis, order, CHUNKS)
    p = jax.lax.axis_size(axis)
    me = jax.lax.axis_index(axis)
    qs = jnp.split(q, CHUNKS[order], axis=1)
    no_keys_yet = [_nothing_seen(x) for x in qs]

    def step(carry: Any, s: jax.Array) -> tuple[Any, None]:
        acc, kv = carry
        passed = jax.lax.ppermute(kv, axis, ring_pairs(p))  # sent now, used at the next step
        return (_visit(acc, qs, kv, meets(me, s, p, order), causal, pair_core), passed), None

    (acc, kv), _ = jax.lax.scan(step, (tuple(no_keys_yet), (k, v)), jnp.arange(p - 1))
    acc = _visit(acc, qs, kv, meets(me, p - 1, p, order), causal, pair_core)
    return tuple(jnp.concatenate(parts, axis=1) for parts in zip(*acc))


class PairCore(NamedTuple):
    """How the ring attends one pair of chunks: ``attend``, of ``attend``'s signature, the pair's
    ``Partial``; ``grads``, of ``attend_grads``', its share of ``(dq, dk, dv)``.

    The ring calls each with ``causal=True`` on the diagonal (a chunk and itself) and
    ``causal=False`` on a pair whose keys all come before its queries; a skipped pair, never. So a
    core may take the mask from the index, as ``minishard.flash.flash_pairs`` (the Pallas kernels)
    does. ``DENSE_PAIRS`` (``attend``, ``attend_grads``) is the default.
    """

    attend: Callable[..., Partial]
    grads: Callable[..., tuple[jax.Array, jax.Array, jax.Array]]


def _visit(acc: Any, qs: Any, kv: Any, meeting: Any, causal: bool, core: PairCore | None) -> Any:
    """One step: each needed pair attended and merged into its query chunk's running result."""
    mine, theirs = meeting  # the chunks of this device's queries, and of the K and V passing by
    merged = functools.partial(_merged, core or DENSE_PAIRS)
    acc = list(acc)
    k, v = kv
    group = qs[0].shape[2] // k.shape[2]  # query heads per K/V head: 1 but under GQA
    ks = jnp.split(repeated(k, group), len(theirs), axis=1)  # repeated here, after the send
    vs = jnp.split(repeated(v, group), len(theirs), axis=1)
    size = qs[0].shape[1]
    for a, b, which in _pairs(mine, theirs, causal):
        pair = _Pair(qs[a], ks[b], vs[b], span(mine[a], size), span(theirs[b], size))
        acc[a] = _by_kind(which, merged, acc[a], pair)
    return tuple(acc)


def _merged(core: PairCore, masked: bool) -> Callable[[Partial, _Pair], Partial]:
    """A pair attended by ``core.attend`` (``masked``: the diagonal's), merged into the running
    result of its query chunk."""

    def attended(running: Partial, pair: _Pair) -> Partial:
        part = core.attend(pair.q, pair.k, pair.v, pair.q_pos, pair.k_pos, causal=masked)
        return merge(*running, *part)

    return attended


class _Pair(NamedTuple):
    """What a pair of chunks attends with: a query chunk, a key chunk's K and V, their positions."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    q_pos: jax.Array
    k_pos: jax.Array


def _pairs(mine: Any, theirs: Any, causal: bool) -> Iterator[tuple[int, int, Any]]:
    """A step's pairs: the query chunk's index in ``mine``, the key chunk's in ``theirs``, and
    the pair's ``kind_index`` (traced where the chunks are)."""
    for a, b in itertools.product(range(len(mine)), range(len(theirs))):
        yield a, b, kind_index(mine[a], theirs[b], causal)


def _by_kind(which: Any, work: Callable[[bool], Any], kept: Any, operands: Any) -> Any:
    """``work(masked)(kept, operands)`` as ``PAIR_KINDS[which]`` says, masked on the diagonal;
    ``kept`` if skipped. A ``lax.switch`` where ``which`` is traced: a skipped pair costs nothing,
    and each other kind runs code of its own (a kernel's causal grid, or its full one)."""
    branches = [lambda kept, _: kept, work(False), work(True)]
    if isinstance(which, int):
        return branches[which](kept, operands)
    return jax.lax.switch(which, branches, kept, operands)


def _nothing_seen(q: jax.Array) -> Partial:
    """A query chunk's running result before any key: ``(0, -inf)``, which any first part
    replaces (its weight ``e^(-inf - lse)`` is 0)."""
    out = jnp.zeros_like(q, jnp.float32)
    lse = jnp.full_like(q[..., 0], -jnp.inf, jnp.float32)
    return out, lse


# --- 4. the backward ring -----------------------------------------------------------


def ring_attention(
    q: Any,
    k: Any,
    v: Any,
    *,
    axis: str,
    causal: bool = False,
    order: str = "in-order",
    pair_core: PairCore | None = None,
) -> Any:
    """Attention of this device's queries over the whole sequence, inside ``shard_map`` over
    ``axis``.

    ``q, k, v``: this device's ``[batch, seq / p, heads, head_dim]``, its chunks in the
    chunk order ``order``; k and v may have fewer heads, a divisor of q's (grouped-query
    attention), and travel so. The forward pass is ``ring_forward``; the backward pass keeps only
    ``q, k, v, out, lse`` and sends K, V, dK, dV round the ring again. ``pair_core`` attends and
    differentiates each pair (``DENSE_PAIRS`` by default; ``minishard.flash.flash_pairs()``, the
    Pallas kernels).

    >>> import functools, minishard as ms
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = ms.make_mesh({"seq": 4}, devices=jax.devices()[:4])
    >>> q, k, v = jax.random.normal(jax.random.key(0), (3, 1, 16, 2, 8))   # 16 tokens, 4 a device
    >>> mine = functools.partial(ring_attention, axis="seq", causal=True)
    >>> ring = jax.shard_map(mine, mesh=mesh, in_specs=P(None, "seq"), out_specs=P(None, "seq"))
    >>> float(jnp.abs(jax.jit(ring)(q, k, v) - attention(q, k, v, causal=True)).max()) < 1e-5
    True
    """
    return _ring(q, k, v, axis, causal, order, pair_core or DENSE_PAIRS)


def _ring_fwd(q: Any, k: Any, v: Any, axis: str, causal: bool, order: str, core: PairCore) -> Any:
    out, lse = ring_forward(q, k, v, axis=axis, causal=causal, order=order, pair_core=core)
    return out.astype(q.dtype), (q, k, v, out, lse)  # one chunk of each: flat in p


def _ring_bwd(axis: str, causal: bool, order: str, core: PairCore, saved: Any, g: Any) -> Any:
    """The backward ring: K, V and their gradients travel together; dK and dV are home after p
    sends."""
    q, k, v, out, lse = saved
    p = jax.lax.axis_size(axis)
    me = jax.lax.axis_index(axis)
    pieces = CHUNKS[order]
    qs = jnp.split(q, pieces, axis=1)
    split_up = (jnp.split(x, pieces, axis=1) for x in (out, g.astype(jnp.float32), lse))
    upstream = [_Upstream(*chunk) for chunk in zip(*split_up)]
    dqs = tuple(jnp.zeros_like(x, jnp.float32) for x in qs)
    dkv = jnp.zeros_like(k, jnp.float32), jnp.zeros_like(v, jnp.float32)

    def step(carry: Any, s: jax.Array) -> tuple[Any, None]:
        dqs, kv, dkv = carry
        passed = jax.lax.ppermute(kv, axis, ring_pairs(p))  # K and V, sent before this step's work
        meeting = meets(me, s, p, order)
        dqs, dkv = _visit_grads(dqs, dkv, qs, upstream, kv, meeting, causal, core)
        return (dqs, passed, jax.lax.ppermute(dkv, axis, ring_pairs(p))), None

    (dqs, kv, dkv), _ = jax.lax.scan(step, (dqs, (k, v), dkv), jnp.arange(p - 1))
    meeting = meets(me, p - 1, p, order)
    dqs, dkv = _visit_grads(dqs, dkv, qs, upstream, kv, meeting, causal, core)
    dk, dv = jax.lax.ppermute(dkv, axis, ring_pairs(p))  # the last step's gradients, home
    return jnp.concatenate(dqs, axis=1).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _visit_grads(
    dqs: Any, dkv: Any, qs: Any, upstream: Any, kv: Any, meeting: Any, causal: bool, core: PairCore
) -> Any:
    """A backward step: each needed pair adds to its dq (kept) and dk, dv (travelling with k, v,
    of their heads)."""
    mine, theirs = meeting  # the chunks of this device's queries, and of the K and V passing by
    dqs = list(dqs)
    k, v = kv
    dk, dv = dkv
    group = qs[0].shape[2] // k.shape[2]  # query heads per K/V head: 1 but under GQA
    added = functools.partial(_added, core, group)
    ks, vs = (jnp.split(repeated(x, group), len(theirs), axis=1) for x in (k, v))
    dks, dvs = (jnp.split(x, len(theirs), axis=1) for x in (dk, dv))  # a K/V head's: travel
    size = qs[0].shape[1]
    for a, b, which in _pairs(mine, theirs, causal):
        pair = _Pair(qs[a], ks[b], vs[b], span(mine[a], size), span(theirs[b], size))
        sums = _by_kind(which, added, _Sums(dqs[a], dks[b], dvs[b]), (pair, upstream[a]))
        dqs[a] = sums.dq
        dks[b] = sums.dk
        dvs[b] = sums.dv
    return tuple(dqs), (jnp.concatenate(dks, axis=1), jnp.concatenate(dvs, axis=1))


def _added(core: PairCore, group: int, masked: bool) -> Callable[[_Sums, Any], _Sums]:
    """A pair's gradients by ``core.grads``, added to its sums: dk and dv of the repeated heads,
    ``summed`` over each group of query heads. ``masked``: the diagonal's."""

    def differentiated(sums: _Sums, operands: tuple[_Pair, _Upstream]) -> _Sums:
        pair, up = operands
        dq, dk_heads, dv_heads = core.grads(
            pair.q, pair.k, pair.v, up.out, up.g, up.lse, pair.q_pos, pair.k_pos, causal=masked
        )
        dk = summed(dk_heads, group)
        dv = summed(dv_heads, group)
        return _Sums(sums.dq + dq, sums.dk + dk, sums.dv + dv)

    return differentiated


def attend_grads(
    q: Any, k: Any, v: Any, out: Any, g: Any, lse: Any, q_pos: Any, k_pos: Any, causal: bool
) -> Any:
    """One pair's share of ``(dq, dk, dv)``, from the *final* ``out`` and ``lse``, in picotron's
    steps.

    The softmax's weights ``w = exp(s - lse)`` for these keys are recomputed, not kept; ``g`` is
    the gradient of ``out``. Each step is one line:

    >>> q, k, v, g = jax.random.normal(jax.random.key(0), (4, 1, 3, 2, 8))   # 3 tokens, 2 heads
    >>> at = jnp.arange(3)
    >>> out, lse = attend(q, k, v, at, at, causal=True)
    >>> _, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, at, at, causal=True)[0], q, k, v)
    >>> grads = attend_grads(q, k, v, out, g, lse, at, at, causal=True)
    >>> [bool(jnp.allclose(mine, jax_s, atol=1e-5)) for mine, jax_s in zip(grads, vjp(g))]
    [True, True, True]
    """
    q32, k32, v32 = (x.astype(jnp.float32) for x in (q, k, v))
    lse_per_row = lse.swapaxes(1, 2)[..., None]  # [b, h, q, 1], as the scores are laid out
    w = jnp.exp(scores(q, k, q_pos, k_pos, causal) - lse_per_row)  # the weights, [b, h, q, k]
    dv = jnp.einsum("bhqk,bqhd->bkhd", w, g)  # 1. dv = wᵀ·g
    dw = jnp.einsum("bqhd,bkhd->bhqk", g, v32)  # 2. dw = g·vᵀ, the weights' gradient
    delta = jnp.sum(g * out, axis=-1)  # 3. delta = Σ g·out per query: what the softmax takes back
    delta_per_row = delta.swapaxes(1, 2)[..., None]
    ds = softmax_grad(w, dw, delta_per_row) * q.shape[-1] ** -0.5  # 4. ds = w·(dw - delta)/√d
    dq = jnp.einsum("bhqk,bkhd->bqhd", ds, k32)  # 5. dq = ds·k
    dk = jnp.einsum("bhqk,bqhd->bkhd", ds, q32)  # 6. dk = dsᵀ·q
    return dq, dk, dv


class _Upstream(NamedTuple):
    """What the backward pass brings to one query chunk: its output, that output's gradient
    ``g``, and its ``lse``."""

    out: jax.Array
    g: jax.Array
    lse: jax.Array


class _Sums(NamedTuple):
    """The gradients one pair adds to: its query chunk's dq, its key chunk's dk and dv."""

    dq: jax.Array
    dk: jax.Array
    dv: jax.Array


DENSE_PAIRS = PairCore(attend, attend_grads)
"""The ring's default ``PairCore``: each pair's scores in full, ``[b, h, chunk, chunk]``, by XLA."""
_ring = jax.custom_vjp(lambda *args: _ring_fwd(*args)[0], nondiff_argnums=(3, 4, 5, 6))
_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_permutes(p: int) -> tuple[int, int]:
    """The collective-permutes of one ring attention, ``(forward, backward)``: forward, K and V
    at each step but the last; backward, K and V again, and dK and dV at every step (the last:
    home).

    >>> ring_permutes(4)   # 2 x 3 forward; 2 x 3 + 2 x 4 backward
    (6, 14)
    """
    forward = 2 * (p - 1)
    backward = 2 * (p - 1) + 2 * p
    return forward, backward


__all__ = [
    "CHUNKS",
    "Cell",
    "DENSE_PAIRS",
    "Dropped",
    "F32",
    "MASK_VALUE",
    "PAIR_KINDS",
    "PairCore",
    "Partial",
    "attend",
    "attend_grads",
    "attention",
    "balance",
    "chunks",
    "held_order",
    "kind",
    "kind_index",
    "meets",
    "merge",
    "merge_weights",
    "narrow_attend",
    "needed",
    "pair_kinds",
    "permute",
    "repeated",
    "ring_attention",
    "ring_forward",
    "ring_permutes",
    "scores",
    "shifted_exp",
    "softmax_grad",
    "span",
    "summed",
    "visible",
]
