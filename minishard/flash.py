"""Flash attention by hand: causal attention as a Pallas kernel for a TPU, forward and backward.

``context.attention`` is three XLA operations: the scores ``q·kᵀ``, a softmax, the weighted sum
of the values. Between them the scores live in HBM, the chip's main memory: ``[batch, heads, T,
T]`` numbers, 3 GiB of float32 at batch 16, 12 heads and T = 2,048, written, read back, and kept
for the backward pass. A *kernel* is a program for the chip's core that says where each number
lives; this one never writes the scores anywhere:

1. **Tiles in VMEM.** A TPU core computes out of its own small memory, VMEM (tens of MiB beside
   the matrix unit). The kernel runs on a *grid* of steps ``(batch·heads, query block i, key
   block j)``; before each step Pallas copies one tile of queries ``[block_q, head_dim]`` and one
   of keys and of values ``[block_k, head_dim]`` from HBM into VMEM (the ``BlockSpec``\\ s say
   which), and the step computes their ``[block_q, block_k]`` scores there (``tile_scores``).
   The queries' running result waits in VMEM *scratch* across the key blocks and leaves for HBM
   once, after the last: only q, k, v, the output and one log-sum-exp per query ever touch HBM.
   The full ``T x T`` scores never exist. ``Blocks`` are ``(block_q, block_k)``, ``BLOCK`` by
   default; the tiles must fit VMEM (``SCORE_TILE_BYTES``, ``ROW_TILE_BYTES``).
2. **The online softmax.** A key block's attention is a partial softmax, ``(out, lse)``; it joins
   the running one as ``context.merge`` joins two devices' in the ring, by the one home of that
   arithmetic, ``context.merge_weights`` (``forward_kernel``). The backward pass keeps only
   ``lse``, and recomputes each tile's weights from it (``tile_grads``: ``context.attend_grads``'s
   steps, tile by tile), in two grids: ``dq_kernel`` over the key blocks, ``dkv_kernel`` over the
   query blocks.
3. **The causal skip.** A key block whose first key comes after a query block's last query is
   all future: its step does nothing (``runs``; ``crosses``: only a tile across the diagonal is
   masked), and its ``BlockSpec`` names a block already in VMEM (``key_tile``, ``query_tile``),
   so not even the copy happens. Of ``n x n`` square blocks ``n(n+1)/2`` run, about half the
   FLOPs at long T (``causal_share``); XLA's attention computes every score, then masks half.
4. **The kernels called.** ``flash_attention`` lays the arrays out as the kernels tile them
   (``laid``; a ``Shape``: the blocks, the heads side by side in a row, ``head_dim``) and runs
   the three kernels as one ``jax.custom_vjp``.
5. **A ring's pairs.** ``flash_pairs`` hands ``context.ring_attention`` the kernels as its
   ``context.PairCore``: ``flash_attend``, a pair's partial softmax ``(out, lse)``, and
   ``flash_attend_grads``, its gradients from the ring's whole ``out``, ``g`` and ``lse``; the
   causal grid on the diagonal, the full one where every key is visible.

>>> causal_share(seq_len=4096, block_q=512, block_k=512)   # 36 of 64 blocks run
0.5625
>>> q, k, v = jax.random.normal(jax.random.key(0), (3, 1, 256, 2, 64))   # [batch, T, heads, d]
>>> out = flash_attention(q, k, v, causal=True, block_q=128, block_k=128, interpret=True)
>>> bool(jnp.allclose(out, context.attention(q, k, v, causal=True), atol=1e-5))
True

On a CPU, ``interpret=True`` runs the same kernel in a Pallas interpreter (slowly): the tests'
way. Its plain one, the grid a loop of XLA operations, or inside a ``shard_map`` whose axes q
varies over (a ring's), its TPU one, every load and store a call back into Python. On the chip
the tiles go in as they come (bf16 into the matrix unit, float32 out).
"""

from __future__ import annotations

import functools
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from minishard import _checks_context, context

BLOCK = 512
"""The default block of queries and of keys, capped at T: large tiles keep the matrix unit fed."""
SCORE_TILE_BYTES = 4 * 2**20
"""The largest float32 score tile, ``block_q x block_k x 4`` bytes: the backward pass holds three
of them in VMEM beside its q, k, v tiles, and XLA:TPU gives a kernel 16 MiB of it (v5e; 8 MiB
failed to compile)."""
ROW_TILE_BYTES = 2**20
"""The largest ``[block, head_dim]`` tile: the backward pass holds six, and their float32 sums."""
Blocks = tuple[int, int]  # (block_q, block_k)
Shape = tuple[Blocks, int, int]  # (blocks, heads side by side in an array row, head_dim)
CONTRACT_LAST = (((1,), (1,)), ((), ()))  # a·bᵀ: contract both tiles' last axis (head_dim)
SEMANTICS: tuple[Literal["parallel", "arbitrary"], ...] = ("parallel", "parallel", "arbitrary")
"""How the grid's axes run: the last sums into scratch, in order; the others in any order."""

# --- 1. the grid: which steps run, and which tiles they copy ------------------------------------


def runs(q_block: Any, k_block: Any, blocks: Blocks, causal: bool) -> Any:
    """A step runs unless the mask is causal and its first key comes after its last query."""
    block_q, block_k = blocks
    return k_block * block_k <= (q_block + 1) * block_q - 1 if causal else True


def crosses(q_block: Any, k_block: Any, blocks: Blocks) -> Any:
    """The step's tile crosses the diagonal: some of its keys come after some of its queries."""
    block_q, block_k = blocks
    return (k_block + 1) * block_k - 1 > q_block * block_q


def causal_share(seq_len: int, block_q: int, block_k: int) -> float:
    """The share of the grid's steps a causal kernel runs: ``(n + 1) / 2n`` of n square blocks."""
    blocks = (block_q, block_k)
    steps = [(i, j) for i in range(seq_len // block_q) for j in range(seq_len // block_k)]
    return sum(bool(runs(i, j, blocks, True)) for i, j in steps) / len(steps)


def key_tile(q_block: Any, k_block: Any, blocks: Blocks, causal: bool) -> Any:
    """The key block step ``(i, j)`` copies: past the last that runs, that one again. Pallas copies
    a tile only when its index changes, so a skipped step costs no copy either."""
    last_run = jax.lax.div((q_block + 1) * blocks[0] - 1, blocks[1])
    return jnp.minimum(k_block, last_run) if causal else k_block


def query_tile(k_block: Any, q_block: Any, blocks: Blocks, causal: bool) -> Any:
    """The backward pass's mirror: the query block keys ``j`` copy, never one before the first that
    sees them (the dk, dv grid runs the queries innermost, from 0)."""
    first_run = jax.lax.div(k_block * blocks[1], blocks[0])
    return jnp.maximum(q_block, first_run) if causal else q_block


def _when_runs(step: Any, q_block: Any, k_block: Any, blocks: Blocks, causal: bool) -> None:
    """``step(at, masked)`` if tile ``at = (i, j)`` runs: masked only where it crosses the diagonal.
    The grid's indices are read here, outside the branches: each branch is handed them."""
    at = (q_block, k_block)
    if not causal:
        return step(at, False)
    crossing = crosses(q_block, k_block, blocks)
    pl.when(runs(q_block, k_block, blocks, causal) & crossing)(lambda: step(at, True))
    pl.when(runs(q_block, k_block, blocks, causal) & ~crossing)(lambda: step(at, False))
    return None


# --- 2. the forward kernel: one step of the grid --------------------------------------------------


def tile_scores(
    q: Any, k: Any, at: tuple[Any, Any], blocks: Blocks, masked: bool, keys_major: bool = False
) -> Any:
    """``q·kᵀ`` of tile ``at = (i, j)``, ``[block_q, block_k]``, float32 out of the matrix unit
    whatever goes in (q comes scaled by ``1/sqrt(head_dim)``); ``keys_major``: ``k·qᵀ``, its
    transpose, computed as such. ``masked``: the future of each query at ``MASK_VALUE``."""
    s = (
        jax.lax.dot_general(k, q, CONTRACT_LAST, **context.F32)
        if keys_major
        else jax.lax.dot_general(q, k, CONTRACT_LAST, **context.F32)
    )
    if not masked:
        return s
    queries = at[0] * blocks[0] + jax.lax.broadcasted_iota(jnp.int32, s.shape, int(keys_major))
    keys = at[1] * blocks[1] + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1 - int(keys_major))
    return jnp.where(keys <= queries, s, context.MASK_VALUE)


def _forward_step(refs: Any, blocks: Blocks, at: Any, masked: bool) -> None:
    """Tile ``at``'s partial softmax ``(out, lse)``, merged into the running one in VMEM scratch."""
    q_ref, k_ref, v_ref, _, _, out_sum, lse_sum = refs
    s = tile_scores(q_ref[...], k_ref[...], at, blocks, masked)
    weights, top, total = context.shifted_exp(s)  # top and total [block_q, 1]
    # the tile's out, times total
    values = jnp.dot(weights.astype(v_ref.dtype), v_ref[...], **context.F32)
    w_sum, w_tile, lse = context.merge_weights(lse_sum[...], top + jnp.log(total))
    out_sum[...] = w_sum * out_sum[...] + (w_tile / total) * values  # divides [block_q, 1] only
    lse_sum[...] = lse


def forward_kernel(*refs: Any, blocks: Blocks, causal: bool) -> None:
    """Step ``(row, i, j)``: start the running softmax at ``j = 0``, merge tile ``(i, j)`` in if it
    runs, and after the last key block write ``out`` and ``lse`` to HBM.

    ``refs``: the tiles of q, k, v (inputs), of out and lse (outputs), and the scratch sums."""
    out_ref, lse_ref, out_sum, lse_sum = refs[3:]
    i = pl.program_id(1)  # the query block
    j = pl.program_id(2)  # the key block

    @pl.when(j == 0)
    def _start() -> None:
        out_sum[...] = jnp.zeros_like(out_sum)
        lse_sum[...] = jnp.full_like(lse_sum, -jnp.inf)  # nothing seen: weight e^(-inf - lse) = 0

    _when_runs(functools.partial(_forward_step, refs, blocks), i, j, blocks, causal)

    @pl.when(j == pl.num_programs(2) - 1)
    def _finish() -> None:
        out_ref[...] = out_sum[...].astype(out_ref.dtype)
        lse_ref[...] = lse_sum[...]


# --- 3. the backward kernels: dq over the key blocks, dk and dv over the query blocks --------


def tile_grads(tiles: Any, at: Any, blocks: Blocks, masked: bool, keys_major: bool = False) -> Any:
    """One tile's weights ``w = exp(s - lse)``, recomputed, and the scores' gradient
    ``ds = w·(dp - delta)`` (``context.softmax_grad``; q already scaled, so no ``1/sqrt(d)``).
    ``keys_major``: both transposed, ``[block_k, block_q]``; lse and delta rows of the queries."""
    q, k, v, g, lse, delta = tiles
    w = jnp.exp(tile_scores(q, k, at, blocks, masked, keys_major) - lse)
    pair = (v, g) if keys_major else (g, v)
    dp = jax.lax.dot_general(*pair, CONTRACT_LAST, **context.F32)  # g·vᵀ: the weights' gradient
    return w, context.softmax_grad(w, dp, delta)


def _dq_step(refs: Any, blocks: Blocks, at: Any, masked: bool) -> None:
    """dq += ds·k for tile ``at``."""
    k_ref = refs[1]
    dq_sum = refs[-1]  # the scratch sum, last
    tiles = [ref[...] for ref in refs[:6]]
    _, ds = tile_grads(tiles, at, blocks, masked)
    dq_sum[...] += jnp.dot(ds.astype(k_ref.dtype), k_ref[...], **context.F32)


def dq_kernel(*refs: Any, blocks: Blocks, causal: bool) -> None:
    """Step ``(row, i, j)``: dq of query block i, summed over the key blocks j in VMEM scratch.

    ``refs``: the tiles of q, k, v, g, lse, delta; of dq (the output); the scratch sum."""
    dq_ref, dq_sum = refs[-2:]
    i = pl.program_id(1)  # the query block
    j = pl.program_id(2)  # the key block

    @pl.when(j == 0)
    def _start() -> None:
        dq_sum[...] = jnp.zeros_like(dq_sum)

    _when_runs(functools.partial(_dq_step, refs, blocks), i, j, blocks, causal)

    @pl.when(j == pl.num_programs(2) - 1)
    def _finish() -> None:
        dq_ref[...] = dq_sum[...].astype(dq_ref.dtype)


def _dkv_step(refs: Any, blocks: Blocks, at: Any, masked: bool) -> None:
    """dv += wᵀ·g and dk += dsᵀ·q for tile ``at``, ``wᵀ`` and ``dsᵀ`` computed keys major: no
    transpose of a tile, and lse and delta come as rows, dense along the 128 lanes."""
    q_ref, _, _, g_ref = refs[:4]  # the tiles of q, k, v, g
    dk_sum, dv_sum = refs[-2:]  # the scratch sums, last
    tiles = [ref[...] for ref in refs[:6]]
    w_t, ds_t = tile_grads(tiles, at, blocks, masked, keys_major=True)  # [block_k, block_q]
    dv_sum[...] += jnp.dot(w_t.astype(g_ref.dtype), g_ref[...], **context.F32)
    dk_sum[...] += jnp.dot(ds_t.astype(q_ref.dtype), q_ref[...], **context.F32)


def dkv_kernel(*refs: Any, blocks: Blocks, causal: bool) -> None:
    """Step ``(row, j, i)``: dk and dv of key block j, summed over the query blocks i in scratch.

    ``refs``: the tiles of q, k, v, g, lse, delta; of dk and dv (the outputs); their sums."""
    dk_ref, dv_ref, dk_sum, dv_sum = refs[-4:]
    j = pl.program_id(1)  # the key block: this grid runs keys major
    i = pl.program_id(2)  # the query block

    @pl.when(i == 0)
    def _start() -> None:
        dk_sum[...] = jnp.zeros_like(dk_sum)
        dv_sum[...] = jnp.zeros_like(dv_sum)

    _when_runs(functools.partial(_dkv_step, refs, blocks), i, j, blocks, causal)

    @pl.when(i == pl.num_programs(2) - 1)
    def _finish() -> None:
        dk_ref[...] = dk_sum[...].astype(dk_ref.dtype)
        dv_ref[...] = dv_sum[...].astype(dv_ref.dtype)


# --- 4. the kernels called: tiles of HBM arrays, and the custom VJP ------------------------------


def _pallas(kernel: Any, grid: Any, tiles: Any, outs: Any, scratch: Any, interpret: bool) -> Any:
    """``kernel`` over ``grid``: ``tiles`` the inputs' ``BlockSpec``\\ s, ``outs`` ``(array, tile)``
    per output, ``scratch`` the float32 VMEM shapes that live across the grid's last axis."""

    def call(*operands: Any) -> Any:
        # Inside a shard_map (a ring's), the outputs vary over its axes as q, the first input, does.
        varying = jax.typeof(operands[0]).manual_axis_type
        arrays = [jax.ShapeDtypeStruct(a.shape, a.dtype, manual_axis_type=varying) for a, _ in outs]
        # Interpreted: Pallas's plain interpreter (the grid a loop of XLA ops, quick to compile), or
        # its TPU one where q varies over a shard_map's axes (the plain one's scratch cannot vary,
        # and JAX refuses to mix them: "Primitive max requires varying manual axes to match")
        interpreter = (pltpu.InterpretParams() if varying.varying else True) if interpret else False
        return pl.pallas_call(
            kernel,
            grid=grid,
            in_specs=tiles,
            out_specs=[tile for _, tile in outs],
            out_shape=arrays,
            scratch_shapes=[pltpu.VMEM(shape, jnp.float32) for shape in scratch],
            compiler_params=pltpu.CompilerParams(dimension_semantics=SEMANTICS),
            interpret=interpreter,
        )(*operands)

    return call


def _tiles(shape: Shape, rows_at: Any, keys_at: Any, lanes: bool = False) -> Any:
    """``BlockSpec``\\ s of a query block's rows, of its lse (or delta: ``[block_q, 1]``, or with
    ``lanes`` ``[1, block_q]``), and of a key block's rows, in arrays of ``heads`` side by side."""
    (block_q, block_k), heads, head_dim = shape
    rows = pl.BlockSpec((None, block_q, head_dim), lambda r, *at: _row(r, rows_at(*at), heads))
    per_row = pl.BlockSpec(
        (None, 1, block_q) if lanes else (None, block_q, 1),
        lambda r, *at: (r, 0, rows_at(*at)) if lanes else (r, rows_at(*at), 0),
    )
    keys = pl.BlockSpec((None, block_k, head_dim), lambda r, *at: _row(r, keys_at(*at), heads))
    return rows, per_row, keys


def _row(r: Any, block: Any, heads: int) -> tuple[Any, Any, Any]:
    """Grid row ``r``'s tile in an array of ``heads`` heads side by side: row ``r // heads``, head
    ``r % heads`` (its ``head_dim`` lanes), sequence block ``block``."""
    return r // heads, block, r % heads


# A ring calls each kernel at each step alike: jitted, each is traced and lowered once per shape
# (XLA compiles it in at each call, so the program, on a TPU too, is the same)
_STATIC = ("shape", "causal", "interpret", "out_dtype")  # what picks a kernel, beside the arrays
_traced_once = functools.partial(jax.jit, static_argnames=_STATIC)


@_traced_once
def _forward(
    q: Any, k: Any, v: Any, shape: Shape, causal: bool, interpret: bool, out_dtype: Any = None
) -> Any:
    """``out`` (q's shape, in ``out_dtype``: q's by default) and ``lse [rows, T, 1]`` (rows:
    batch·heads), grid ``(rows, i, j)``."""
    blocks, heads, head_dim = shape
    keys_at = functools.partial(key_tile, blocks=blocks, causal=causal)
    rows, per_row, keys = _tiles(shape, lambda i, j: i, keys_at)
    grid = (q.shape[0] * heads, q.shape[1] // blocks[0], k.shape[1] // blocks[1])
    out = jax.ShapeDtypeStruct(q.shape, out_dtype or q.dtype)
    outs = [(out, rows), (_per_row(q, heads), per_row)]
    scratch = [(blocks[0], head_dim), (blocks[0], 1)]
    kernel = functools.partial(forward_kernel, blocks=blocks, causal=causal)
    return _pallas(kernel, grid, [rows, keys, keys], outs, scratch, interpret)(q, k, v)


def _per_row(q: Any, heads: int) -> jax.ShapeDtypeStruct:
    """One float32 per query and head: lse, delta."""
    return jax.ShapeDtypeStruct((q.shape[0] * heads, q.shape[1], 1), jnp.float32)


@_traced_once
def _dq(operands: Any, shape: Shape, causal: bool, interpret: bool, out_dtype: Any = None) -> Any:
    """dq (q's shape) on the forward's grid ``(rows, i, j)``: the key blocks innermost."""
    q, k = operands[:2]
    blocks, heads, head_dim = shape
    keys_at = functools.partial(key_tile, blocks=blocks, causal=causal)
    rows, per_row, keys = _tiles(shape, lambda i, j: i, keys_at)
    grid = (q.shape[0] * heads, q.shape[1] // blocks[0], k.shape[1] // blocks[1])
    kernel = functools.partial(dq_kernel, blocks=blocks, causal=causal)
    outs = [(jax.ShapeDtypeStruct(q.shape, out_dtype or q.dtype), rows)]
    tiles = [rows, keys, keys, rows, per_row, per_row]
    return _pallas(kernel, grid, tiles, outs, [(blocks[0], head_dim)], interpret)(*operands)[0]


@_traced_once
def _dkv(operands: Any, shape: Shape, causal: bool, interpret: bool, out_dtype: Any = None) -> Any:
    """dk and dv (k's shape) on the grid ``(rows, j, i)``: the query blocks innermost, their lse,
    delta ``[rows, 1, T]``, a new tile at each step: dense, 4 bytes a query, not 128 lanes' 512."""
    q, k = operands[:2]
    blocks, heads, head_dim = shape
    rows_at = functools.partial(query_tile, blocks=blocks, causal=causal)
    rows, per_row, keys = _tiles(shape, rows_at, lambda j, i: j, lanes=True)
    grid = (q.shape[0] * heads, k.shape[1] // blocks[1], q.shape[1] // blocks[0])
    kernel = functools.partial(dkv_kernel, blocks=blocks, causal=causal)
    outs = [(jax.ShapeDtypeStruct(k.shape, out_dtype or k.dtype), keys)] * 2
    tiles = [rows, keys, keys, rows, per_row, per_row]
    return _pallas(kernel, grid, tiles, outs, [(blocks[1], head_dim)] * 2, interpret)(*operands)


def _flash_fwd(q: Any, k: Any, v: Any, shape: Shape, causal: bool, interpret: bool) -> Any:
    out, lse = _forward(q, k, v, shape, causal, interpret)
    return out, (q, k, v, out, lse)  # what the backward pass keeps: no weights, one lse per query


def _flash_bwd(
    shape: Shape, causal: bool, interpret: bool, residuals: Any, g: Any, out_dtype: Any = None
) -> Any:
    """Two grids: dq summed over the key blocks, dk and dv over the query blocks. ``delta =
    Σ g·out`` per query and head (``context.attend_grads``' step 3): one XLA reduction, before.
    The gradients in ``out_dtype``: the inputs' by default."""
    q, k, v, out, lse = residuals
    rows, seq_len = q.shape[:2]  # rows: batch·heads, or batch with the heads side by side
    heads = shape[1]
    per_head = (g.astype(jnp.float32) * out.astype(jnp.float32)).reshape(rows, seq_len, heads, -1)
    delta = per_head.sum(-1).swapaxes(1, 2).reshape(rows * heads, seq_len, 1)  # as lse is laid
    tiles = (q, k, v, g.astype(q.dtype))
    along_lanes = (lse.swapaxes(1, 2), delta.swapaxes(1, 2))  # [rows, 1, T]
    dk, dv = _dkv((*tiles, *along_lanes), shape, causal, interpret, out_dtype)
    return _dq((*tiles, lse, delta), shape, causal, interpret, out_dtype), dk, dv


_flash = jax.custom_vjp(lambda *args: _flash_fwd(*args)[0], nondiff_argnums=(3, 4, 5))
_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention(
    q: Any,
    k: Any,
    v: Any,
    *,
    causal: bool = False,
    block_q: int | None = None,
    block_k: int | None = None,
    interpret: bool = False,
) -> Any:
    """``context.attention(q, k, v, causal=causal)`` by the kernels: ``[batch, T, heads, head_dim]``
    arrays, the tokens in order (the mask is the index's), blocks of ``BLOCK`` capped at T.

    A tile's lanes are ``head_dim`` wide: a multiple of 128 (the TPU's lanes), each head is a tile
    of the arrays as they are, ``[batch, T, heads · head_dim]``, no copy; narrower, the heads go
    before the tokens first, ``[batch · heads, T, head_dim]``, one XLA copy there and one back.
    ``interpret``: run in a Pallas interpreter, on any backend (the tests do, on CPU).
    """
    asked = (block_q, block_k)
    shape = _kernel_shape(q, k, v, asked, interpret, where="flash_attention", tokens="sequence")
    out = _flash(*_kernel_inputs(q, k, v), shape, causal, interpret)
    return laid(out, _side_by_side(q), like=q)


def _kernel_shape(
    q: Any,
    k: Any,
    v: Any,
    asked: Any,
    interpret: bool,
    *,
    where: str,
    tokens: str,
) -> Shape:
    """The kernels' ``Shape`` of q, k, v: the ``asked`` blocks (``BLOCK`` capped at T, where
    None), checked to tile T, fit VMEM and run here; the heads side by side or not; head_dim.
    ``where`` and ``tokens`` (what T is) name them in an error."""
    seq_len, heads, head_dim = q.shape[1:]
    blocks = (asked[0] or min(BLOCK, seq_len), asked[1] or min(BLOCK, seq_len))
    limits = (ROW_TILE_BYTES, SCORE_TILE_BYTES)
    # blocks that tile T and fit VMEM, a TPU (or the interpreter)
    _checks_context.flash(q, k, v, blocks, interpret, *limits, where=where, tokens=tokens)
    return blocks, heads if _side_by_side(q) else 1, head_dim


def _side_by_side(x: Any) -> bool:
    """Each head a tile of the lanes as it lies: ``head_dim`` a multiple of the TPU's 128 lanes."""
    return x.shape[3] % 128 == 0


def _kernel_inputs(q: Any, k: Any, v: Any) -> tuple[Any, Any, Any]:
    """q scaled by ``1/sqrt(head_dim)``, k and v: each ``laid`` as the kernels tile it."""
    scaled = (q.astype(jnp.float32) * q.shape[3] ** -0.5).astype(q.dtype)  # fused into the copy
    side_by_side = _side_by_side(q)
    return laid(scaled, side_by_side), laid(k, side_by_side), laid(v, side_by_side)


def laid(x: Any, side_by_side: bool, like: Any = None) -> Any:
    """``[batch, T, heads, head_dim]`` as the kernels tile it: ``[batch, T, heads · head_dim]``
    side by side (a reshape, free), else ``[batch · heads, T, head_dim]`` (a copy); ``like``: back
    to its shape.

    >>> laid(jnp.zeros((2, 16, 3, 64)), side_by_side=False).shape
    (6, 16, 64)
    """
    if like is not None:
        b, t, h, d = like.shape
        return x.reshape(b, t, h, d) if side_by_side else x.reshape(b, h, t, d).swapaxes(1, 2)
    b, t, h, d = x.shape
    return x.reshape(b, t, h * d) if side_by_side else x.swapaxes(1, 2).reshape(b * h, t, d)


# --- 5. a ring's pairs of chunks, by the kernels ------------------------------------------------


def flash_attend(
    q: Any,
    k: Any,
    v: Any,
    q_pos: Any,
    k_pos: Any,
    *,
    causal: bool = False,
    block_q: int | None = None,
    block_k: int | None = None,
    interpret: bool = False,
) -> context.Partial:
    """``context.attend`` by the forward kernel: ``(out, lse)`` of the queries over these keys
    alone, float32, for a ring to ``context.merge``. The mask is the index's, so ``q_pos`` and
    ``k_pos`` go unread: a ring's pair is a chunk and itself (``causal``) or keys all before the
    queries (not), and on both the index's mask is the positions'.

    >>> q, k, v = jax.random.normal(jax.random.key(0), (3, 1, 16, 2, 8))
    >>> at = jnp.arange(16)
    >>> _, lse = flash_attend(q, k, v, at, at, causal=True, block_q=8, block_k=8, interpret=True)
    >>> bool(jnp.allclose(lse, context.attend(q, k, v, at, at, causal=True)[1], atol=1e-5))
    True
    """
    del q_pos, k_pos  # the diagonal, or all visible: the index's mask is right
    asked = (block_q, block_k)
    shape = _kernel_shape(q, k, v, asked, interpret, where="flash_attend", tokens="chunk")
    out, lse = _forward(*_kernel_inputs(q, k, v), shape, causal, interpret, out_dtype=jnp.float32)
    batch, seq_len, heads = q.shape[:3]
    per_head = lse.reshape(batch, heads, seq_len).swapaxes(1, 2)  # [b, T, h], as attend's
    return laid(out, _side_by_side(q), like=q), per_head


def flash_attend_grads(
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    g: Any,
    lse: Any,
    q_pos: Any,
    k_pos: Any,
    causal: bool,
    *,
    block_q: int | None = None,
    block_k: int | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``context.attend_grads`` by the backward kernels: one pair's share of ``(dq, dk, dv)``,
    float32, from the *whole* softmax's ``out``, its gradient ``g`` and ``lse`` (a ring's), the
    mask the index's as in ``flash_attend``."""
    del q_pos, k_pos  # the diagonal, or all visible: the index's mask is right
    asked = (block_q, block_k)
    shape = _kernel_shape(q, k, v, asked, interpret, where="flash_attend_grads", tokens="chunk")
    side_by_side = _side_by_side(q)
    batch, seq_len, heads = lse.shape
    lse_rows = lse.swapaxes(1, 2).reshape(batch * heads, seq_len, 1)  # as the forward writes it
    residuals = (*_kernel_inputs(q, k, v), laid(out, side_by_side), lse_rows)
    grads = _flash_bwd(shape, causal, interpret, residuals, laid(g, side_by_side), jnp.float32)
    dq_scaled, dk, dv = (laid(x, side_by_side, like=q) for x in grads)
    dq = dq_scaled * q.shape[3] ** -0.5  # the kernels' q came scaled: the chain rule's factor
    return dq, dk, dv


@functools.cache  # one object per blocks: a ring's custom_vjp sees the same core each time
def flash_pairs(
    block_q: int | None = None, block_k: int | None = None, interpret: bool = False
) -> context.PairCore:
    """A ring's ``context.PairCore`` by the kernels: ``flash_attend`` and ``flash_attend_grads``,
    blocks of ``BLOCK`` capped at the chunk unless given. The ring switches each pair of chunks to
    the causal grid on its diagonal and the full one where every key is visible.

    ``context.ring_attention(q, k, v, axis="seq", causal=True, pair_core=flash_pairs())`` in a
    ``shard_map`` (tests/test_flash.py runs it interpreted, on 4 CPU devices).

    >>> pairs = flash_pairs(block_q=8, interpret=True)
    >>> pairs is flash_pairs(block_q=8, interpret=True), pairs.attend.func.__name__
    (True, 'flash_attend')
    """
    options: dict[str, Any] = {"block_q": block_q, "block_k": block_k, "interpret": interpret}
    attend = functools.partial(flash_attend, **options)
    grads = functools.partial(flash_attend_grads, **options)
    return context.PairCore(attend, grads)


__all__ = [
    "BLOCK",
    "Blocks",
    "Shape",
    "ROW_TILE_BYTES",
    "SCORE_TILE_BYTES",
    "causal_share",
    "crosses",
    "dkv_kernel",
    "dq_kernel",
    "flash_attend",
    "flash_attend_grads",
    "flash_attention",
    "flash_pairs",
    "forward_kernel",
    "key_tile",
    "laid",
    "query_tile",
    "runs",
    "tile_grads",
    "tile_scores",
]
