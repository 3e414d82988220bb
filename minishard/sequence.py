"""The sequence split by one collective each: gathered K and V, Ulysses' all-to-all, Megatron's.

``minishard.context`` sends K and V round a ring: p steps of point-to-point sends, each
hidden behind a step of work. Three other ways take one kind of collective each, and
each is again a ``shard_map`` with the sequence split over a mesh axis:

1. **All-gather K and V** (``all_gather_attention``, MaxText's default): every device
   gathers all keys and values and attends its own queries. The simplest, and the most
   memory: all of K and V, and its queries' scores against all of them, p times the ring's.
2. **All-to-all** (``ulysses_attention``, DeepSpeed-Ulysses): trade the sequence split for
   a heads split, attend whole sequences of heads / p heads, trade back: four all-to-alls.
3. **Megatron's sequence parallelism** (``ResidualMLP``): not attention. Under tensor
   parallelism the LayerNorm and the residual add run replicated on every "model" device;
   split them over the sequence instead, and each all-reduce becomes a reduce-scatter and
   an all-gather of the same bytes on the wire (``costs.sent_bytes``), while those activations
   take 1/p of the memory. Once by annotation (the rule ``seq -> "model"``), once by hand.

``over_sequence`` runs any of the attentions (an ``Attend``) on whole ``[batch, seq, heads,
head_dim]`` arrays; ``residual_mlp_by_hand`` is one ``ResidualMLP`` with every collective written
out, and ``by_hand`` runs a stack of them so in a ``shard_map``.

>>> from minishard.costs import sent_bytes
>>> both = sent_bytes("reduce-scatter", 1024, 4) + sent_bytes("all-gather", 4096, 4)
>>> sent_bytes("all-reduce", 4096, 4), both   # p = 4 devices, 4096 bytes of activations
(6144.0, 6144.0)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from minishard import _checks_context
from minishard.constraints import activation_axes, constrain
from minishard.context import CHUNKS, attend, held_order
from minishard.layers import Layer, Linear, Sequential
from minishard.rules import AxisRules, MeshAxes
from minishard.sharding import partition_specs

Attend = Callable[..., jax.Array]  # (q, k, v, *, axis, causal, order) -> out, inside shard_map

# --- 1. whole arrays in, whole arrays out -------------------------------------------


def over_sequence(
    attend_fn: Attend, mesh: Mesh, *, axis: str = "seq", batch_axes: MeshAxes = None, **options: Any
) -> Callable[..., jax.Array]:
    """``attend_fn`` on whole ``[batch, seq, heads, head_dim]`` arrays: a ``shard_map`` that splits
    the sequence over ``axis`` and the batch over ``batch_axes``; ``options`` (``causal``,
    ``order``) go to ``attend_fn``. The sequence must already be dealt out in the chunk order
    (``minishard.context.permute``).

    >>> import minishard as ms
    >>> from minishard.context import attention, ring_attention
    >>> mesh = ms.make_mesh({"seq": 4}, devices=jax.devices()[:4])
    >>> q, k, v = jax.random.normal(jax.random.key(0), (3, 1, 16, 4, 8))   # 4 heads, 16 tokens
    >>> full = attention(q, k, v, causal=True)
    >>> [float(jnp.abs(jax.jit(over_sequence(f, mesh, causal=True))(q, k, v) - full).max()) < 1e-5
    ...  for f in (ring_attention, all_gather_attention, ulysses_attention)]
    [True, True, True]
    """
    _checks_context.mesh_has("over_sequence", axis, tuple(mesh.axis_names))
    spec = P(batch_axes, axis)
    attend_here = functools.partial(attend_fn, axis=axis, **options)
    own = {axis, *((batch_axes,) if isinstance(batch_axes, str) else batch_axes or ())}
    # manual over its own axes only: the heads stay split over "model" (tp) by the annotations
    mapped = jax.shard_map(attend_here, mesh=mesh, in_specs=spec, out_specs=spec, axis_names=own)

    def on_whole_arrays(q: Any, k: Any, v: Any) -> jax.Array:
        order = options.get("order", "in-order")
        _checks_context.whole_sequence(q, k, v, mesh.shape[axis], order, CHUNKS)
        return mapped(q, k, v)

    return on_whole_arrays


# --- 2. all of K and V, gathered ----------------------------------------------------


def all_gather_attention(
    q: Any, k: Any, v: Any, *, axis: str, causal: bool = False, order: str = "in-order"
) -> Any:
    """This device's queries over every key, inside ``shard_map``: ``all_gather`` K and V, attend.

    Two all-gathers of the whole K and V to every device; the backward pass transposes
    them into two reduce-scatters of dK and dV (``psum_scatter``). Nothing is skipped:
    a causal mask only masks, so the work is balanced in any chunk order.
    """
    _checks_context.context_inputs("all_gather_attention", q, k, v, axis, order, CHUNKS)
    p = jax.lax.axis_size(axis)
    me = jax.lax.axis_index(axis)
    k, v = (jax.lax.all_gather(x, axis, axis=1, tiled=True) for x in (k, v))  # every device's
    seq_len = k.shape[1]
    mine = held_order(seq_len, p, order, me)  # this device's queries
    everyone = held_order(seq_len, p, order)  # every device's keys, in turn
    out, _ = attend(q, k, v, mine, everyone, causal=causal)
    return out.astype(q.dtype)


# --- 3. all-to-all: DeepSpeed-Ulysses -------------------------------------------------


def ulysses_attention(
    q: Any, k: Any, v: Any, *, axis: str, causal: bool = False, order: str = "in-order"
) -> Any:
    """Trade the sequence split for a heads split (``all_to_all``), attend, and trade back.

    ``[b, s/p, h, d] -> [b, s, h/p, d]``: each device then holds the whole sequence of
    its heads and attends it as on one device. Each all-to-all moves 1/p of an array:
    on a TPU's bidirectional ring it costs a quarter of an all-gather of that array.
    """
    _checks_context.context_inputs("ulysses_attention", q, k, v, axis, order, CHUNKS)
    p = jax.lax.axis_size(axis)
    _checks_context.heads_split("ulysses_attention", q.shape[2], p, axis)
    all_to_all = functools.partial(jax.lax.all_to_all, axis_name=axis, tiled=True)
    to_heads = functools.partial(all_to_all, split_axis=2, concat_axis=1)  # the sequence for heads
    q, k, v = (to_heads(x) for x in (q, k, v))
    at = held_order(q.shape[1], p, order)  # the whole sequence now: every device's chunks
    out = attend(q, k, v, at, at, causal=causal)[0].astype(v.dtype)
    return all_to_all(out, split_axis=1, concat_axis=2)  # and back


# --- 4. Megatron's sequence parallelism ----------------------------------------------


class ResidualMLP(Layer):
    """``x + down(swish(up(norm(x))))``: a transformer's MLP region, its hidden units split by the
    rules.

    ``up`` is ``("embed", "mlp")``, ``down`` ``("mlp", "embed")``: with ``mlp -> "model"``
    each device holds 1/p of the hidden units, and ``down`` gives partial sums. Where
    they go is the residual stream's sharding, ``("batch", "seq", "embed")``: with
    ``seq -> None`` (tensor parallelism) every device needs all of the sum, an
    all-reduce; with ``seq -> "model"`` (sequence parallelism) each keeps its tokens'
    share, a reduce-scatter, and ``up`` gathers every token again, an all-gather. ``norm``
    (any Layer acting token by token, e.g. a LayerNorm) and the add then see 1/p of them.
    """

    param_fields = ("norm", "up", "down")

    def __init__(self, norm: Layer, width: int, hidden: int, *, key: jax.Array) -> None:
        up_key, down_key = jax.random.split(key)
        self.norm: Any = norm  # a Layer
        self.up = Linear(width, hidden, key=up_key, scale=width**-0.5, axes=("embed", "mlp"))
        self.down = Linear(hidden, width, key=down_key, scale=hidden**-0.5, axes=("mlp", "embed"))

    def __call__(self, x: jax.Array) -> jax.Array:
        stream = activation_axes(jnp.ndim(x), "seq", "embed")  # the rules say where tokens go
        x = constrain(x, stream)
        hidden_axes = activation_axes(jnp.ndim(x), None, "mlp")
        hidden = constrain(jax.nn.swish(self.up(self.norm(x))), hidden_axes)
        return constrain(x + self.down(hidden), stream)


def residual_mlp_by_hand(
    mlp: ResidualMLP,
    x: jax.Array,
    *,
    axis: str,
    sequence_parallel: bool,
) -> Any:
    """``mlp(x)`` on one device, inside ``shard_map``: its hidden units, every collective written
    out.

    ``x``: all tokens (tensor parallelism), or this device's 1/p of them (sequence parallelism).
    """
    h = mlp.norm(x)  # only this device's tokens, under sequence parallelism
    if sequence_parallel:
        h = jax.lax.all_gather(h, axis, axis=1, tiled=True)  # every token, for my hidden units
    partial_sums = jax.nn.swish(h @ mlp.up.weight + mlp.up.bias) @ mlp.down.weight
    if sequence_parallel:
        y = jax.lax.psum_scatter(partial_sums, axis, scatter_dimension=1, tiled=True)  # my tokens'
    else:
        y = jax.lax.psum(partial_sums, axis)  # every token's sum, on every device
    return x + y + mlp.down.bias


def by_hand(
    blocks: Sequential,
    mesh: Mesh,
    *,
    axis: str = "model",
    sequence_parallel: bool = False,
) -> Any:
    """``blocks`` (``ResidualMLP``\\ s) applied by hand to ``[batch, seq, embed]``, in a
    ``shard_map``: the hidden units split over ``axis``, and the tokens too with
    ``sequence_parallel``."""
    specs = partition_specs(blocks, AxisRules(mlp=axis, embed=None), mesh)
    x_spec = P(None, axis) if sequence_parallel else P()

    def body(blocks: Sequential, x: jax.Array) -> jax.Array:
        for mlp in blocks:
            x = residual_mlp_by_hand(mlp, x, axis=axis, sequence_parallel=sequence_parallel)
        return x

    return jax.shard_map(body, mesh=mesh, in_specs=(specs, x_spec), out_specs=x_spec)


__all__ = [
    "Attend",
    "ResidualMLP",
    "all_gather_attention",
    "by_hand",
    "over_sequence",
    "residual_mlp_by_hand",
    "ulysses_attention",
]
