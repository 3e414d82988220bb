"""Composition: how one dimension runs inside another.

Each chapter before this one teaches its dimension alone: the pipeline's tick loop knows only its
stage axis, the ring only its sequence axis, an MoE only its experts. This chapter teaches what
lets one of them run inside another, each in a section of its own:

* **The pipeline with other dimensions inside its stages.** ``ComposedPipeline``, a ``Pipeline``
  whose microbatches' rows are split over a data axis (dp+pp) and their tokens over a sequence
  axis (pp+cp: ring attention inside the stages), and whose blocks' statistics (an MoE's, pp+ep)
  leave the tick loop; ``run_composed`` runs it, ``over_the_batch`` adds a tick's statistics up.
* **The ring inside others.** Grouped-query attention (``grouped``, ``grouped_attention``),
  decoding over a split cache (``merge_across``), and a ring's memory and report (``ring_kept``,
  ``ring_in_flight``, ``RingReport``, ``ring_report``).

## The ring inside others

``minishard.context`` teaches the ring alone: queries of one head each, keys of as many heads,
a training step. Three others use it:

1. **Grouped-query attention** (the models, ``minishard.serving``'s cache): keys and values of
   fewer heads than the queries. ``grouped`` makes a group of query heads more queries of one
   K/V head, so ``context.attend`` reads each K/V head once: ``grouped_attention`` is
   ``context.attention`` for such keys.
2. **Decoding over a split cache** (cp decoding): each device holds a share of the cached keys,
   attends every new query to it, and ``merge_across`` merges the p partial softmaxes over the
   mesh axis: ``context.merge`` by all-reduces, the cache never sent.
3. **A step's memory and what it sent** (``minishard.memory``, the CLI's ``explain``):
   ``ring_kept`` is what one ring keeps for its backward pass beyond q, k, v and out;
   ``ring_in_flight`` what passes by while it runs; ``ring_report`` a ``RingReport`` of a
   compiled step's collective-permutes beside ``context.ring_permutes``'s formula.

>>> ring_kept(b=2, t=16, heads=4), ring_in_flight(b=1, t=16, heads=2, head_dim=8)
(128, 2304)
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from minishard import _checks_context, _checks_pipeline, context
from minishard.census import human_bytes, instructions, mesh_of
from minishard.costs import ring_bound
from minishard.hardware import hardware_named
from minishard.layers import lifted, sow
from minishard.pipeline import (
    Pipeline,
    Stacked,
    gpipe,
    join_microbatches,
    run_blocks,
    split_microbatches,
    stage_layers,
)

# === The pipeline with other dimensions inside its stages (dp+pp, pp+cp, pp+ep) ===================
# ``Pipeline.run`` runs by hand over the stage axis alone. Three things let another dimension run
# inside the stages, each a few lines around the same ``gpipe`` loop:
#
# 1. dp+pp: the microbatches' rows split over a data axis, which ``shard_map`` also runs by hand;
#    the layers are the same on every replica (cast to "varying" once, so that their gradient's
#    psum over the replicas runs once, not per tick).
# 2. pp+cp: the tokens split over a sequence axis, and the blocks' ``args`` (a GPT's positions)
#    with them: each device holds its share of the tokens, and ring attention runs on it.
# 3. pp+ep: what the blocks sow (an MoE's ``MoEStats``) leaves each tick as its report, a
#    bubble's zeroed, and is added up over the stages, the microbatches and the replicas.


@dataclasses.dataclass(frozen=True)
class ComposedPipeline(Pipeline):
    """A ``Pipeline`` whose microbatches' rows are over ``data_axis`` and their tokens over
    ``sequence_axis`` (cp's "context"), if given; its blocks may sow statistics (an MoE's).

    >>> import minishard as ms
    >>> mesh = ms.make_mesh({"data": 2, "stage": 4})
    >>> ComposedPipeline(mesh, microbatches=4, data_axis="data").ticks   # 4 + 4 - 1, as a Pipeline
    7
    """

    data_axis: str | None = None
    sequence_axis: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        _checks_pipeline.composed_pipeline(self)

    def run(self, blocks: Stacked, x: jax.Array, *args: Any) -> jax.Array:
        return run_composed(blocks, x, self, *args)


def run_composed(
    blocks: Stacked,
    x: jax.Array,
    pipeline: ComposedPipeline,
    *args: Any,
) -> jax.Array:
    """``blocks(x, *args)`` pipelined, the stages running the pipeline's other axes inside them.

    ``args`` (a GPT's ``[T]`` positions) are the same for every microbatch: each device gets those
    of the tokens it holds. What the blocks sow, added up over the batch, is sown again outside.
    """
    _checks_pipeline.pipeline_batch("run_pipeline", x, pipeline, pipeline.data_axis)
    layers = stage_layers(blocks, pipeline)
    data = pipeline.data_axis
    tokens = pipeline.sequence_axis
    rows = P(None, data, tokens)  # [m, B/m, T, ...]: rows over "data", tokens over "context"
    held = (P(tokens),) * len(args)  # each device's tokens' positions
    in_specs = (P(pipeline.stage_axis), rows, *held)
    out_specs = (rows, P())  # the blocks' statistics: the whole batch's, on every device
    # by hand over its own axes only: another ("model": tp) stays the annotations' inside a stage
    own = {pipeline.stage_axis} | {axis for axis in (data, tokens) if axis}
    loop = functools.partial(_composed_gpipe, pipeline=pipeline)
    mesh = pipeline.mesh
    run = jax.shard_map(loop, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names=own)
    y, stats = run(layers, split_microbatches(x, pipeline.microbatches), *args)
    sow(stats)
    return join_microbatches(y)


def _replicas(pipeline: ComposedPipeline) -> tuple[str, ...]:
    """The axes over which every stage's layers are the same: other examples, other tokens."""
    return tuple(axis for axis in (pipeline.data_axis, pipeline.sequence_axis) if axis)


def _composed_gpipe(layers: Any, xs: jax.Array, *args: Any, pipeline: ComposedPipeline) -> Any:
    """One device's program: ``gpipe``, each tick reporting what its blocks sowed."""
    replicas = _replicas(pipeline)
    if replicas:  # cast once, so that the gradient's psum over them (its transpose) runs once
        layers = jax.lax.pcast(layers, replicas, to="varying")

    def stage_work(here: Any, x: jax.Array, busy: jax.Array) -> tuple[jax.Array, Any]:
        y, stats = lifted(run_blocks)(here, x, *args)
        return y, jax.tree.map(lambda s: jnp.where(busy, s, 0), stats)  # a bubble's: 0

    outputs, stats = gpipe(layers, xs, pipeline, stage_work)
    return outputs, jax.tree.map(lambda s: over_the_batch(s, pipeline), stats)


def over_the_batch(stat: jax.Array, pipeline: ComposedPipeline) -> jax.Array:
    """A statistic of each tick, ``[ticks, ...]``, for the batch.

    Each stage's blocks' and each microbatch's are added up; over the replicas, counts add up
    and losses (a microbatch's mean each) average, as ``experts.all_to_all_moe``'s do.
    """
    replicas = _replicas(pipeline)
    total = jax.lax.psum(stat.sum(0), pipeline.stage_axis)
    if jnp.issubdtype(total.dtype, jnp.integer):
        return jax.lax.psum(total, replicas)
    return jax.lax.pmean(total / pipeline.microbatches, replicas)


# === The ring inside others (grouped-query attention, cp decoding, a ring's memory and report) ===

# --- the ring inside others: 1. grouped-query attention ----------------------------------------


def grouped(q: jax.Array, group: int, *, inverse: bool = False) -> jax.Array:
    """Grouped-query attention as multi-head: ``q`` ``[b, t, heads, d]`` as ``[b, t·group, heads /
    group, d]``, query head ``h`` a query of K/V head ``h // group`` (row ``t·group + h % group``,
    at its token's position), so ``attend`` reads each K/V head once for its group; ``inverse``:
    the outputs back.

    >>> q = jnp.arange(4.0).reshape(1, 1, 4, 1)   # one token, 4 query heads: 2 groups of 2
    >>> grouped(q, 2)[0, :, :, 0].tolist()
    [[0.0, 2.0], [1.0, 3.0]]
    >>> bool((grouped(grouped(q, 2), 2, inverse=True) == q).all())
    True
    """
    b, t, h, d = q.shape
    if inverse:
        by_group = q.reshape(b, t // group, group, h, d).swapaxes(2, 3)
        return by_group.reshape(b, t // group, h * group, d)
    by_group = q.reshape(b, t, h // group, group, d).swapaxes(2, 3)
    return by_group.reshape(b, t * group, h // group, d)


def grouped_attention(
    q: Any, k: Any, v: Any, q_pos: Any = None, k_pos: Any = None, *, causal: bool = False
) -> Any:
    """``context.attention`` where keys and values may have fewer heads, a divisor of the
    queries' (grouped-query attention): the models' dense core.

    >>> q = jax.random.normal(jax.random.key(0), (1, 4, 4, 8))   # 4 query heads
    >>> k = v = jax.random.normal(jax.random.key(1), (1, 4, 2, 8))   # 2 K/V heads
    >>> from minishard.context import attention
    >>> repeated = [jnp.repeat(x, 2, axis=2) for x in (k, v)]   # each K/V head for its group
    >>> ours = grouped_attention(q, k, v, causal=True)
    >>> bool(jnp.allclose(ours, attention(q, *repeated, causal=True), atol=1e-6))
    True
    """
    _checks_context.qkv("grouped_attention", q, k, v)  # float arrays, k's heads a divisor of q's
    q_pos = jnp.arange(q.shape[1]) if q_pos is None else q_pos
    k_pos = q_pos if k_pos is None else k_pos
    group = q.shape[2] // max(k.shape[2], 1)  # query heads per K/V head
    if group == 1:
        return context.attend(q, k, v, q_pos, k_pos, causal=causal)[0].astype(q.dtype)
    rows_at = jnp.repeat(q_pos, group)  # a group's queries, each at its token's position
    out = context.attend(grouped(q, group), k, v, rows_at, k_pos, causal=causal)[0]
    return grouped(out, group, inverse=True).astype(q.dtype)


# --- the ring inside others: 2. decoding over a split cache ------------------------------------


def merge_across(out: jax.Array, lse: jax.Array, axis: str) -> tuple[jax.Array, jax.Array]:
    """``context.merge`` of the p devices of ``axis``, inside ``shard_map``: each device's
    attention of the same queries over its own keys, as one over all of them, on every device.
    Part i weighs ``e^(lse_i - lse)`` as in ``merge``, by three all-reduces: the max, the sum
    of exponentials, the weighted outputs.

    >>> import minishard as ms
    >>> from jax.sharding import PartitionSpec as P
    >>> from minishard.context import attend
    >>> mesh = ms.make_mesh({"seq": 4}, devices=jax.devices()[:4])
    >>> q, k, v = jax.random.normal(jax.random.key(0), (3, 1, 8, 2, 4))   # 8 keys, 2 per device
    >>> at = jnp.arange(8)
    >>> def mine(q, k, v):   # this device's keys, at their positions; then everyone's merged
    ...     here = 2 * jax.lax.axis_index("seq") + jnp.arange(2)
    ...     return merge_across(*attend(q, k, v, at, here), "seq")[0]
    >>> specs = (P(), P(None, "seq"), P(None, "seq"))
    >>> merged = jax.jit(jax.shard_map(mine, mesh=mesh, in_specs=specs, out_specs=P()))
    >>> bool(jnp.allclose(merged(q, k, v), attend(q, k, v, at, at)[0], atol=1e-6))
    True
    """
    top = jax.lax.pmax(lse, axis)  # the largest: no e^(lse_i - top) overflows
    weights = jnp.exp(lse - top)
    total = jax.lax.psum(weights, axis)  # e^(lse - top): the whole denominator, scaled
    merged = jax.lax.psum(weights[..., None] * out, axis) / total[..., None]
    return merged, top + jnp.log(total)


# --- the ring inside others: 3. a step's memory, and what it sent ------------------------------


def ring_kept(b: int, t: int, heads: int) -> int:
    """Numbers one ring attention keeps for its backward pass beyond q, k, v and out (its
    residuals; a dense block keeps those too): the log-sum-exp of each of the ``b·t`` queries
    per head. Not the softmax's weights, ``b heads t s``: ``context.attend_grads`` recomputes
    them pair by pair, as Korthikanti's selective recomputation does
    (``minishard.memory.block_activations``).

    >>> ring_kept(b=2, t=16, heads=4)
    128
    """
    return b * t * heads


def ring_in_flight(b: int, t: int, heads: int, head_dim: int, kv_heads: int | None = None) -> int:
    """Numbers passing by while one ring attention's backward pass runs, per device, beside what
    it kept: K and V, the next K and V, dK and dV and the next ones (the backward ring's carry
    and its two ``ppermute``\\ s), and the dQ being added up: 9 chunks ``[b, t, heads, head_dim]``.
    Under grouped-query attention the 8 of K and V (and their gradients, ``context.summed``)
    have ``kv_heads`` heads; the dQ keeps ``heads``.

    >>> ring_in_flight(b=1, t=16, heads=2, head_dim=8)   # 9 chunks of 256
    2304
    >>> ring_in_flight(b=1, t=16, heads=2, head_dim=8, kv_heads=1)   # 8 of 128, the dQ of 256
    1280
    """
    kv_heads = heads if kv_heads is None else kv_heads
    kv_chunks = 8  # K, V, the next K and V, dK, dV and the next ones
    return (kv_chunks * kv_heads + heads) * b * t * head_dim


@dataclasses.dataclass(frozen=True)
class RingReport:
    """``ring_report``: a step's collective-permutes over ``axis`` (the census's ``(count,
    bytes)``), beside ``context.ring_permutes``'s formula for ``blocks`` rings of float32
    ``chunk``\\ s, one device's K (or V) ``[batch, seq / p, kv_heads, head_dim]``; ``print`` shows
    both and the two chunk orders' balance. ``heads``: the queries' (by default the chunk's; more
    under grouped-query attention), what each step computes with while the chunk's bytes travel.

    >>> import functools, minishard as ms
    >>> from jax.sharding import PartitionSpec as P
    >>> from minishard.context import ring_attention
    >>> mesh = ms.make_mesh({"seq": 4}, devices=jax.devices()[:4])
    >>> mine = functools.partial(ring_attention, axis="seq", causal=True, order="zigzag")
    >>> ring = jax.shard_map(mine, mesh=mesh, in_specs=P(None, "seq"), out_specs=P(None, "seq"))
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
    order: str
    blocks: int  # ring attentions in the step
    chunk: tuple[int, ...]
    sent: tuple[int, int]
    hardware: str | None = None  # a key of HARDWARE: then say if the sends hide behind the work
    heads: int | None = None  # query heads; None: the chunk's (no grouped-query attention)

    @property
    def formula(self) -> tuple[int, int]:
        count = self.blocks * sum(context.ring_permutes(self.p))
        float32 = 4
        return count, count * math.prod(self.chunk) * float32

    def __str__(self) -> str:
        p = self.p
        per_block = sum(context.ring_permutes(p))
        count, nbytes = self.sent
        order = "zig-zag" if self.order == "zigzag" else "in order"
        zigzag = context.balance(p, "zigzag")
        in_order = context.balance(p)
        trips = p - 1
        forward = f"Per block, forward: K and V x {trips} trips;"
        backward = f"backward: K and V x {trips} trips, dK and dV x {p} (the last one home)"
        chunks = f"{self.blocks} blocks x {per_block} chunks {list(self.chunk)} f32"
        lines = [
            f"Ring attention over {self.axis!r}, p = {p}, {order}. {forward}",
            f"  {backward}: {per_block} permutes",
            f"  census: collective-permute over {self.axis} x{count}, {human_bytes(nbytes)}",
            f"  formula: {chunks} = {human_bytes(self.formula[1])}",
            f"  balance (slowest device / mean): zig-zag {zigzag}, in order {in_order:.3g}",
        ]
        return "\n".join(lines + ([self._hidden()] if self.hardware else []))

    def _hidden(self) -> str:
        """``costs.ring_bound``'s verdict on ``hardware``: do the sends hide behind the work?"""
        b, t, kv_heads, head_dim = self.chunk  # the bytes sent: K and V at their own heads
        q_heads = kv_heads if self.heads is None else self.heads  # the work: every query head's
        hardware = hardware_named(str(self.hardware))
        k = ring_bound(t * self.p, q_heads, kv_heads, head_dim, self.p, hardware, batch=b)
        hidden = "hidden behind the blocks"
        waits = "the ring waits; a longer context hides it"
        verdict = hidden if k <= 1 else waits
        ratio = f"a step's sends / the attention they hide behind = {k:.3g}"
        return f"  on {self.hardware}: {ratio}: {verdict}"


def ring_report(
    program: Any, *, axis: str, blocks: int, chunk: Any, order: str = "zigzag", **options: Any
) -> RingReport:
    """A ``RingReport`` of a lowered (or compiled) training step; ``options``: its ``hardware``."""
    compiled = program.compile() if isinstance(program, jax.stages.Lowered) else program
    mesh = mesh_of(compiled)
    p = int(dict(mesh.shape)[axis]) if mesh is not None else 1  # no mesh: nothing sent
    found = instructions(compiled, mesh)
    permutes = [send for send in found if send.kind == "collective-permute"]
    over_axis = [send.result_bytes for send in permutes if send.groups == ((axis,),)]
    sent = (len(over_axis), sum(over_axis))
    return RingReport(axis, p, order, blocks, tuple(chunk), sent, **options)


__all__ = [
    "ComposedPipeline",
    "RingReport",
    "grouped",
    "grouped_attention",
    "merge_across",
    "over_the_batch",
    "ring_in_flight",
    "ring_kept",
    "ring_report",
    "run_composed",
]
