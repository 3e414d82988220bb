"""Attention, every transformer's: its core, a pure function, and the layer of projections around it.

* ``"dense"``: the attention *core*, the textbook's one softmax attention,
  ``minishard.composition.grouped_attention`` (``minishard.context.attention`` for keys and values
  of fewer heads), a pure function of ``[batch, seq, heads, head_dim]``
  queries, keys and values and of each token's position; ``causal=True`` lets a
  query see only keys at positions at or before its own. The mask reads the
  positions, never a lower-triangle of the array index: a chapter that reorders the
  tokens (context parallelism deals them out zig-zag) or keeps them in a cache passes
  their positions, and the same mask stays right;
* ``ring_core``: ring attention (``minishard.context``) over the devices the rules give "seq";
* ``flash_core``: flash attention, the Pallas kernel for a TPU (``minishard.flash``), in order;
* ``ring_flash_core``: the ring, each pair of chunks attended by the kernels (``RINGS``: what a
  split sequence makes of each core);
* ``KVCache``: one block's keys and values, a pytree ``Sharded`` lays out like the heads;
* ``Attention``: the projections around the core, heads as a dimension of
  their own. Its static field ``core`` names the core in ``ATTENTION_CORES``,
  so another one is one dict entry and one argument: ``"ring"``.

``minishard.models.transformer`` builds its blocks from these.

>>> import jax, jax.numpy as jnp
>>> attention = Attention(8, 2, key=jax.random.key(0), causal=True)
>>> x = jax.random.normal(jax.random.key(1), (1, 5, 8))   # [batch, seq, width]
>>> attention(x).shape
(1, 5, 8)
>>> q = k = jnp.ones((1, 3, 1, 2))
>>> v = q * jnp.arange(3.0)[None, :, None, None]   # token s carries the value s
>>> out = ATTENTION_CORES["dense"](q, k, v, jnp.arange(3), jnp.arange(3), causal=True)
>>> out[0, :, 0, 0].round(4).tolist()   # equal scores: each query averages the values it sees
[0.0, 0.5, 1.0]
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from minishard import composition, context, flash
from minishard.constraints import activation_axes, environment, output_sharding
from minishard.layers import Layer, check_key
from minishard.models.dropout import dropout as drop
from minishard.remat import ATTENTION, QKV
from minishard.rules import LogicalAxes, MeshAxes
from minishard.sequence import over_sequence

# --- the attention cores: the textbook's softmax attention, dense or round a ring ------------


AttentionCore = Callable[..., jax.Array]
"""``core(q, k, v, q_positions, k_positions, *, causal) -> [B, T, H, D]``, as
``composition.grouped_attention``."""

CHUNK_ORDER = "zigzag"
"""The chunk order a split sequence is dealt out in (``minishard.context.chunks``): device i holds chunks
i and 2p-1-i."""


def sequence_axis() -> tuple[str | None, int]:
    """The mesh axis the rules give attention's "seq" (``[batch, seq, heads, head_dim]``), and its size:
    ``(None, 1)`` where the sequence is whole (no rule splits it there, or outside ``Sharded``)."""
    env = environment()
    axis: MeshAxes = (*env.spec(activation_axes(4, "seq", "heads", "kv")), None, None)[1] if env else None
    if env is None or axis is None:
        return None, 1
    if not isinstance(axis, str):
        raise ValueError(f"ring attention: 'seq' goes over one mesh axis, not {axis}")
    return axis, int(env.mesh.shape[axis])


def ring_core(
    q: Any,
    k: Any,
    v: Any,
    q_positions: Any,
    k_positions: Any,
    *,
    causal: bool,
    pair_core: context.PairCore | None = None,
) -> jax.Array:
    """``minishard.context.ring_attention`` over the mesh axis of "seq", the batch split as the rules say.

    The tokens must be held dealt out in ``CHUNK_ORDER`` (``minishard.run.next_token.in_chunk_order``
    does it to a batch): the ring reads their positions from the chunk order, not from its arguments.
    Where the sequence is whole the ring has one device, and is ``composition.grouped_attention`` itself.
    Grouped keys and values travel as they are, ``kv_heads`` heads: the ring repeats them for the
    query heads where they arrive (``context.repeated``). ``pair_core`` attends each pair of chunks
    (``context.DENSE_PAIRS`` by default).
    """
    axis, p = sequence_axis()
    env = environment()
    if env is None or axis is None or p == 1:
        return composition.grouped_attention(q, k, v, q_positions, k_positions, causal=causal)
    ring_here = functools.partial(
        context.ring_attention, causal=causal, order=CHUNK_ORDER, pair_core=pair_core
    )
    if axis in jax.sharding.get_abstract_mesh().manual_axes:  # in a pipeline's stages: each holds its tokens
        return ring_here(q, k, v, axis=axis)
    batch_axes = env.spec(activation_axes(4, "seq", "heads", "kv"))[0]
    ring = over_sequence(ring_here, env.mesh, axis=axis, batch_axes=batch_axes)
    return ring(q, k, v)


def flash_core(
    q: Any,
    k: Any,
    v: Any,
    q_positions: Any,
    k_positions: Any,
    *,
    causal: bool,
    interpret: bool = False,
) -> jax.Array:
    """``minishard.flash.flash_attention``, the Pallas kernel, on a TPU (``interpret``: in a Pallas
    interpreter, anywhere: the ``"flash-interpreted"`` core, the tests' on CPU).

    The kernel's mask is the index's: the tokens must be in order, at ``0 .. T - 1`` (a training
    window; a split sequence attends by ring, a cache by ``cached_attention``), so the positions go
    unread. Where ``Sharded`` lays the batch and heads out over devices, each device runs the kernel
    on its own (a ``shard_map``: XLA cannot split a kernel). Grouped K/V heads go in repeated.
    """
    del q_positions, k_positions  # in order: the kernel's causal skip reads the index
    k, v = (context.repeated(x, q.shape[2] // x.shape[2]) for x in (k, v))
    attend = functools.partial(flash.flash_attention, causal=causal, interpret=interpret)
    env = environment()
    if env is None or jax.sharding.get_abstract_mesh().manual_axes:  # whole, or inside a shard_map
        return attend(q, k, v)
    spec = env.spec(activation_axes(4, "seq", "heads", "kv"))  # [batch, seq, heads, head_dim]
    if spec[1:2] not in ((), (None,)):
        raise ValueError(f"Attention: core 'flash' and 'seq' split over {spec[1]}: use 'ring-flash'")
    # check_vma off: a kernel's outputs do not say how they vary over the mesh (each device its own)
    on_each = jax.shard_map(attend, mesh=env.mesh, in_specs=spec, out_specs=spec, check_vma=False)
    return on_each(q, k, v)


def ring_flash_core(
    q: Any,
    k: Any,
    v: Any,
    q_positions: Any,
    k_positions: Any,
    *,
    causal: bool,
    interpret: bool = False,
) -> jax.Array:
    """``ring_core`` with each pair of chunks attended by the Pallas kernels
    (``minishard.flash.flash_pairs``: the causal grid on the diagonal, the full one below it); where
    the sequence is whole (one device on "seq"), ``flash_core``. ``interpret``: in Pallas's TPU
    interpreter (the ``"ring-flash-interpreted"`` core, the tests' on CPU)."""
    axis, p = sequence_axis()
    if axis is None or p == 1:
        return flash_core(q, k, v, q_positions, k_positions, causal=causal, interpret=interpret)
    pairs = flash.flash_pairs(interpret=interpret)
    return ring_core(q, k, v, q_positions, k_positions, causal=causal, pair_core=pairs)


ATTENTION_CORES: dict[str, AttentionCore] = {
    "dense": composition.grouped_attention,
    "ring": ring_core,
    "flash": flash_core,
    "flash-interpreted": functools.partial(flash_core, interpret=True),
    "ring-flash": ring_flash_core,
    "ring-flash-interpreted": functools.partial(ring_flash_core, interpret=True),
}
"""The cores ``Attention(core=...)`` can name."""
RINGS = {
    "dense": "ring",
    "ring": "ring",
    "flash": "ring-flash",
    "flash-interpreted": "ring-flash-interpreted",
}
"""The core each core becomes where the sequence splits over devices (cp's build): a ring whose
pairs of chunks are attended as the core attends (XLA's dense, or the kernels)."""


def cached_attention(q: Any, keys: Any, values: Any, q_positions: Any) -> jax.Array:
    """New tokens' queries (at ``q_positions``) over a block's cache, whose slot s holds position s; causal.

    Where the rules split the cache's "seq" over a mesh axis (cp: "context"), each device holds a
    contiguous share of the slots and attends every query to them alone; the partial softmaxes merge
    across the axis (``composition.merge_across``): all-reduces of the queries' outputs, never the cache.
    Elsewhere the cache is whole on each device: ``composition.grouped_attention``.
    """
    axis, p = sequence_axis()
    env, slots = environment(), jnp.arange(keys.shape[1])
    if env is None or axis is None or p == 1:
        return composition.grouped_attention(q, keys, values, q_positions, slots, causal=True)
    split = (*env.spec(activation_axes(4, "seq", "heads", "kv")), None, None, None)[:4]  # the cache's
    whole = P(split[0], None, *split[2:])  # every new token on every device of the axis
    attend_here = functools.partial(_attend_share, axis=axis)
    return jax.shard_map(
        attend_here, mesh=env.mesh, in_specs=(whole, P(*split), P(*split), P()), out_specs=whole
    )(q, keys, values, q_positions)


def _attend_share(q: Any, keys: Any, values: Any, q_positions: Any, *, axis: str) -> jax.Array:
    """Inside ``shard_map``: the queries over this device's slots of the cache, merged with the others'."""
    group, share = q.shape[2] // keys.shape[2], keys.shape[1]  # a group's query heads: more queries
    held = jax.lax.axis_index(axis) * share + jnp.arange(share)  # in order: device i, slots i·share ...
    q_at = jnp.repeat(q_positions, group)
    out, lse = context.attend(composition.grouped(q, group), keys, values, q_at, held, causal=True)
    merged, _ = composition.merge_across(out, lse, axis)
    return composition.grouped(merged, group, inverse=True).astype(q.dtype)


class KVCache(Layer):
    """One block's keys and values for every position of a sequence: ``[B, S, kv_heads, head_dim]`` each.

    Decoding one token at a time, a block needs the keys and values of every
    earlier token; keeping them turns each step's work from the whole context
    to one token. It is a pytree like a model and names its axes, so
    ``Sharded`` lays it out by the rules: under ``tp`` each device keeps the
    cache of its own heads, next to those heads' weights. Empty slots hold
    zeros; the causal mask hides them (their positions lie ahead). Under grouped-query attention it
    holds the ``kv_heads`` heads alone: its bytes per token shrink by ``heads / kv_heads``.

    >>> cache = KVCache(2, 16, heads=4, head_dim=8)
    >>> cache.keys.shape, cache.param_logical_axes()["keys"][1:]
    ((2, 16, 4, 8), ('seq', 'heads', 'kv'))
    """

    param_fields = ("keys", "values")

    def __init__(self, batch: int, length: int, heads: int, head_dim: int) -> None:
        self.keys = jnp.zeros((batch, length, heads, head_dim))
        self.values = jnp.zeros((batch, length, heads, head_dim))

    def write(self, k: jax.Array, v: jax.Array, start: jax.Array) -> KVCache:
        """The cache with ``k`` and ``v`` (``[B, n, H, D]``) at positions ``start .. start + n - 1``."""
        at = (0, start, 0, 0)
        keys = jax.lax.dynamic_update_slice(self.keys, k.astype(self.keys.dtype), at)
        values = jax.lax.dynamic_update_slice(self.values, v.astype(self.values.dtype), at)
        return self.replace(keys=keys, values=values)  # type: ignore[return-value]

    def param_logical_axes(self) -> dict[str, LogicalAxes]:
        axes = activation_axes(4, "seq", "heads", "kv")  # the batch first: Sharded's name for it
        return {"keys": axes, "values": axes}


class Attention(Layer):
    """Multi-head self-attention, heads as a dimension of their own.

    ``query`` is ``[width, heads, head_dim]``, ``key`` and ``value`` are
    ``[width, kv_heads, head_dim]``; ``out`` is ``[heads, head_dim, width]``.
    Every einsum keeps ``h`` (heads) as an index until the last one sums over
    it, so with ``heads -> "model"`` each device computes whole heads alone and
    only that last sum crosses devices.

    ``kv_heads`` (static; by default ``heads``) below ``heads`` is grouped-query
    attention (Ainslie et al., 2023): each group of ``heads / kv_heads`` query heads
    shares one key and value head (``composition.grouped``), and a ``KVCache`` keeps
    ``kv_heads`` heads; 1 is multi-query attention. Their heads split over "model"
    as the queries' do, so under ``tp`` the model axis must divide ``kv_heads`` too.

    No biases: the LayerNorm before attention shifts its output by a learned
    ``bias``, and ``bias @ query`` already is a bias of the queries (the same
    for keys and values); an out bias would only add a constant to the
    residual stream, as the MLP's biases do.

    ``causal`` (static) masks the future: a language model's attention.
    ``core`` (static) names the attention core in ``ATTENTION_CORES``.

    >>> import jax, jax.numpy as jnp
    >>> attention = jax.eval_shape(lambda: Attention(8, 2, key=jax.random.key(0)))  # shapes only
    >>> x = jax.ShapeDtypeStruct((3, 5, 8), jnp.float32)   # [batch, tokens, width]
    >>> attention.query.shape, jax.eval_shape(lambda a, x: a(x), attention, x).shape
    ((8, 2, 4), (3, 5, 8))
    >>> jax.eval_shape(lambda: Attention(8, 2, key=jax.random.key(0), kv_heads=1)).key.shape   # MQA
    (8, 1, 4)
    """

    param_fields = ("query", "key", "value", "out")
    static_fields = ("width", "heads", "kv_heads", "causal", "core")

    def __init__(
        self,
        width: int,
        heads: int,
        *,
        key: jax.Array,
        causal: bool = False,
        core: str = "dense",
        kv_heads: int | None = None,
    ) -> None:
        kv_heads = heads if kv_heads is None else kv_heads
        if width % heads:
            raise ValueError(f"Attention: width {width} must be a multiple of heads {heads}")
        if kv_heads < 1 or heads % kv_heads:
            raise ValueError(f"Attention: kv_heads {kv_heads} must divide heads {heads}")
        if core not in ATTENTION_CORES:
            raise ValueError(f"Attention: unknown core {core!r}; choose from {', '.join(ATTENTION_CORES)}")
        check_key("Attention", key)
        self.width, self.heads, self.causal, self.core = int(width), int(heads), bool(causal), core
        self.kv_heads, head_dim = int(kv_heads), width // heads
        q_key, k_key, v_key, out_key = jax.random.split(key, 4)  # one key per weight
        normal = jax.random.normal
        self.query = normal(q_key, (width, heads, head_dim)) / math.sqrt(width)  # fan-in scaling
        self.key = normal(k_key, (width, kv_heads, head_dim)) / math.sqrt(width)
        self.value = normal(v_key, (width, kv_heads, head_dim)) / math.sqrt(width)
        self.out = normal(out_key, (heads, head_dim, width)) / math.sqrt(width)

    def __call__(
        self, x: jax.Array, positions: jax.Array | None = None, *, dropout: float = 0.0, key: Any = None
    ) -> jax.Array:
        """``[B, T, width]`` -> ``[B, T, width]``; ``positions`` ``[T]`` default to ``0 .. T - 1``.
        With a ``key`` (training), the softmax's weights are dropped at rate ``dropout``."""
        positions = jnp.arange(x.shape[1]) if positions is None else positions
        q, k, v = checkpoint_name(self.project(x), QKV)  # what remat's "names" policy saves
        if key is None:
            mixed = ATTENTION_CORES[self.core](q, k, v, positions, positions, causal=self.causal)
        elif self.core != "dense":  # only the dense core forms the weights: not a ring's or flash's tiles
            raise ValueError(f"Attention: core {self.core!r} cannot drop attention weights; use 'dense'")
        else:  # nanoGPT's attention dropout: the softmax's weights, where context.attend makes them
            k, v = (context.repeated(x, self.heads // self.kv_heads) for x in (k, v))  # one per query head
            dropped = functools.partial(drop, rate=dropout, key=key)
            out, _ = context.attend(q, k, v, positions, positions, causal=self.causal, dropped=dropped)
            mixed = out.astype(q.dtype)
        return checkpoint_name(self.combine(mixed), ATTENTION)

    def cached(self, x: jax.Array, positions: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
        """Attention of new tokens (at ``positions``, consecutive) to every cached one and each other."""
        q, k, v = self.project(x)
        cache = cache.write(k, v, positions[0])  # split over positions (cp): on the device of each slot
        return self.combine(cached_attention(q, cache.keys, cache.values, positions)), cache

    def project(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``x`` ``[B, T, width]`` -> queries ``[B, T, heads, head_dim]``, keys and values (``kv_heads``)."""
        # One einsum for q, k and v (c: which of the three), so that in the backward pass the
        # gradient into x is one sum over (c, h, k): one all-reduce over "model", not three.
        # Grouped, the queries have more heads than k and v: one einsum for them, one for k and v, and
        # under tp the backward pass all-reduces two partial gradients into x, not one.
        if self.kv_heads == self.heads:
            q, k, v = _projected(x, self.query, self.key, self.value)
            return q, k, v
        (q,), (k, v) = _projected(x, self.query), _projected(x, self.key, self.value)
        return q, k, v

    def combine(self, mixed: jax.Array) -> jax.Array:
        """``[B, T, heads, head_dim]`` -> ``[B, T, width]``: the one sum over heads."""
        # With heads split, a partial sum per device -> all-reduce.
        out = output_sharding(activation_axes(3, "seq", "embed"))
        return jnp.einsum("bthk,hke->bte", mixed, self.out, out_sharding=out)

    def param_logical_axes(self) -> dict[str, LogicalAxes]:
        qkv: LogicalAxes = ("embed", "heads", "kv")
        return {"query": qkv, "key": qkv, "value": qkv, "out": ("heads", "kv", "embed")}


def _projected(x: jax.Array, *weights: jax.Array) -> jax.Array:
    """``x`` through the ``[width, heads, head_dim]`` ``weights`` of one shape, stacked: ``[c, B, T, heads,
    head_dim]``. On an Explicit mesh the contraction names its output's sharding (output_sharding);
    elsewhere output_sharding is None and XLA decides."""
    stacked = (None, *activation_axes(4, "seq", "heads", "kv"))  # [which weight, b, t, h, k]
    return jnp.einsum("bte,cehk->cbthk", x, jnp.stack(weights), out_sharding=output_sharding(stacked))


__all__ = [
    "ATTENTION_CORES",
    "CHUNK_ORDER",
    "Attention",
    "AttentionCore",
    "KVCache",
    "RINGS",
    "cached_attention",
    "ring_core",
    "ring_flash_core",
    "sequence_axis",
]
