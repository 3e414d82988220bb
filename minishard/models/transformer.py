"""The pieces every transformer here shares: LayerNorm, the MLP and the pre-norm Block around attention.

The ViT (``minishard.models.vit``) and the GPT (``minishard.models.gpt``) are
the same stack of blocks around different ends: patches in and a class out,
or characters in and the next character out. What they share lives here, once:

* ``LayerNorm``: each token's features to mean 0 and variance 1, scaled and shifted;
* ``Attention`` (``minishard.models.attention``, with its cores and the ``KVCache``):
  multi-head self-attention, heads as a dimension of their own;
* ``dense_mlp``: the Megatron MLP, ``Linear(embed -> mlp)``, Swish, ``Linear(mlp -> embed)``;
  ``Block(..., mlp=...)`` takes any other builder of the same arguments: ``moe_mlp``'s mixture
  of experts (``minishard.experts``), called as the dense MLP is (its stats: ``collect``);
* ``Block``: ``x + attention(norm(x))``, then ``x + mlp(norm(x))``; ``cached``
  runs it on new tokens only, reading and extending a ``KVCache``. Where the rules
  split "seq", its residual stream is pinned there (``residual_stream``): under
  ``tp+sp`` that is Megatron's sequence parallelism, under ``cp`` the tokens stay put;
  and its gradient is computed once (``_gradient_once``: a speed trick for XLA:CPU);
* ``apply_blocks``: the blocks in order, each under a recomputation policy (``minishard.remat``; an
  MoE's stats handed out of ``jax.checkpoint``'s trace, never left in it); ``Stacked`` blocks
  (``minishard.pipeline``) as one ``lax.scan``, each block called, keyed and recomputed as the loop's.

>>> import jax, jax.numpy as jnp
>>> block = Block(8, 2, 16, key=jax.random.key(0), causal=True)
>>> x = jax.random.normal(jax.random.key(1), (1, 5, 8))   # [batch, seq, width]
>>> forward = jax.jit(Block.__call__)   # one compiled program per shape, not one per operation
>>> y = forward(block, x)
>>> bool(jnp.allclose(forward(block, x[:, :3])[:, :3], y[:, :3], atol=1e-6))   # causal: the future is unseen
True
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from minishard.constraints import activation_axes, as_activation, constrain, environment
from minishard.experts import MoE
from minishard.layers import Layer, Sequential, lifted, mlp, sow
from minishard.models.attention import Attention, KVCache
from minishard.models.dropout import PLACES, key_at
from minishard.models.dropout import dropout as drop
from minishard.pipeline import Stacked
from minishard.remat import checkpointed
from minishard.rules import LogicalAxes


class LayerNorm(Layer):
    """Normalise each token's features to mean 0 and variance 1, then scale and shift them.

    The statistics are over the last axis only, so each token (and each
    example) is normalised on its own: nothing is shared across the batch,
    which is why a data-parallel LayerNorm needs no communication.

    >>> import jax.numpy as jnp
    >>> [round(v, 2) for v in LayerNorm(4)(jnp.array([1.0, 2.0, 3.0, 4.0])).tolist()]
    [-1.34, -0.45, 0.45, 1.34]
    """

    param_fields = ("scale", "bias")
    static_fields = ("features", "eps")

    def __init__(self, features: int, *, eps: float = 1e-6) -> None:
        self.features, self.eps = int(features), float(eps)
        self.scale, self.bias = jnp.ones(features), jnp.zeros(features)

    def __call__(self, x: jax.Array) -> jax.Array:
        mean = x.mean(-1, keepdims=True)
        var = jnp.square(x - mean).mean(-1, keepdims=True)
        axes = activation_axes(jnp.ndim(x), "embed")  # how scale and bias meet x (Explicit mode)
        scale, bias = as_activation(self.scale, axes), as_activation(self.bias, axes)
        return (x - mean) * jax.lax.rsqrt(var + self.eps) * scale + bias

    def param_logical_axes(self) -> dict[str, LogicalAxes]:
        return {"scale": ("embed",), "bias": ("embed",)}


# --- the MLP and the block -------------------------------------------------------------------


def dense_mlp(width: int, hidden: int, *, key: jax.Array) -> Sequential:
    """``minishard.mlp([width, hidden, width])`` with Megatron axes: hidden units split like the heads."""
    megatron = [("embed", "mlp"), ("mlp", "embed")]
    return mlp([width, hidden, width], key=key, scale=width**-0.5, axes=megatron)


MLPBuilder = Callable[..., Layer]
"""``builder(width, hidden, *, key) -> Layer`` from ``[..., width]`` to ``[..., width]``, as ``dense_mlp``
and ``moe_mlp``'s."""


def moe_mlp(n_experts: int, k: int = 2, capacity_factor: float = 1.25, **options: Any) -> MLPBuilder:
    """A builder of ``MoE`` MLPs, each expert ``hidden // k`` units: the dense MLP's active parameters.

    A token runs through ``k`` experts, so ``k`` experts of a ``k``-th of the dense MLP's hidden
    units compute what it computes per token, with ``n_experts / k`` times its parameters.
    ``options`` go to ``MoE`` (``balance_weight``, ``z_weight``, ``activation``).

    >>> block = Block(8, 2, 16, key=jax.random.key(0), mlp=moe_mlp(4, k=2))
    >>> block.mlp.experts.w_in.shape   # 4 experts of 16 // 2 hidden units
    (4, 8, 8)
    """

    def build(width: int, hidden: int, *, key: jax.Array) -> MoE:
        return MoE(n_experts, k, capacity_factor, features=width, hidden=hidden // k, key=key, **options)

    return build


class Block(Layer):
    """A pre-norm transformer block: ``x + attention(norm(x))``, then ``x + mlp(norm(x))``.

    The MLP is ``dense_mlp`` unless ``mlp`` builds another (same arguments):
    the hidden units split over "model" like the heads. Pre-norm (normalise
    the input of each branch, not the sum) keeps the residual path an identity
    from input to output, which lets deep stacks train with less learning-rate
    warmup (Xiong et al., 2020). ``causal``, ``core`` and ``kv_heads`` go to ``Attention``.
    """

    param_fields = ("norm1", "attention", "norm2", "mlp")

    def __init__(
        self,
        width: int,
        heads: int,
        hidden: int,
        *,
        key: jax.Array,
        causal: bool = False,
        core: str = "dense",
        mlp: MLPBuilder = dense_mlp,
        kv_heads: int | None = None,
    ) -> None:
        k_attention, k_mlp = jax.random.split(key)
        self.norm1, self.norm2 = LayerNorm(width), LayerNorm(width)
        self.attention = Attention(width, heads, key=k_attention, causal=causal, core=core, kv_heads=kv_heads)
        self.mlp: Any = mlp(width, hidden, key=k_mlp)

    def __call__(
        self, x: jax.Array, positions: jax.Array | None = None, *, dropout: float = 0.0, key: Any = None
    ) -> jax.Array:
        """With a ``key`` (training): dropout on the attention weights and on each branch before its add,
        each place's key ``key_at(key, PLACES[place])`` (``minishard.models.dropout``)."""
        x = residual_stream(x)
        weights, out = (key_at(key, PLACES[place]) for place in ("attention weights", "attention out"))
        attended = self.attention(self.norm1(x), positions, dropout=dropout, key=weights)
        x = residual_stream(x + drop(attended, dropout, out))
        return residual_stream(self.residual_mlp(x, dropout, key_at(key, PLACES["mlp out"])))

    def cached(self, x: jax.Array, positions: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
        """The block on new tokens only, their keys and values added to ``cache``."""
        mixed, cache = self.attention.cached(self.norm1(x), positions, cache)
        return self.residual_mlp(x + mixed), cache

    def residual_mlp(self, x: jax.Array, dropout: float = 0.0, key: Any = None) -> jax.Array:
        """``x + mlp(norm(x))``: a dropped routing adds nothing, the token keeps its residual. With a
        ``key``, the MLP's output dropped at rate ``dropout`` before the add."""
        return x + drop(self.mlp(self.norm2(x)), dropout, key)


def residual_stream(x: jax.Array) -> jax.Array:
    """``x`` ``[B, T, width]`` pinned to ``("batch", "seq", "embed")``, where the rules split "seq".

    Under ``tp+sp`` ("seq" over "model", after heads and hidden units) the LayerNorms and
    residual adds then run on 1/p of the tokens, and each all-reduce of the heads' or hidden
    units' partial sums becomes a reduce-scatter and an all-gather (``minishard.sequence``).
    Elsewhere XLA's propagation places the stream, and, unless a rule splits the heads or the
    hidden units, its gradient is computed once (``_gradient_once``).
    """
    env, stream = environment(), activation_axes(3, "seq", "embed")
    if env is None or (*env.spec(stream), None, None)[1] is None:  # no rule splits "seq" here
        split_inside = env is not None and any(env.spec((axis,))[0] for axis in ("heads", "mlp"))
        return x if split_inside else _gradient_once(x)
    return constrain(x, stream)


@jax.custom_vjp
def _gradient_once(x: jax.Array) -> jax.Array:
    """``x``, its gradient divided by 1: the same numbers, computed once instead of once per reader.

    The stream's gradient is a chain of cheap elementwise ops (the residual adds, the LayerNorms'
    backward) that XLA:CPU copies into every fusion reading it: each block's weight gradients
    recomputed the chain from the loss down (12.6% of a step's op time). XLA does not copy an
    expensive op, a divide, into several fusions, so the chain is computed once: the default
    GPT's step 54-59 ms -> 46-49 ms on 2 devices, 82 -> 69 ms on 1, the same numbers to float32's
    rounding (the fusions around the divide may sum in another order; docs/benchmarks.md). Not
    where a rule splits the heads or the hidden units (tp, fsdp): there the gradient can be a
    partial sum, and the divide would move its collectives.
    """
    return x


def _keep_nothing(x: jax.Array) -> tuple[jax.Array, None]:
    return x, None


def _divided_by_one(_: None, gradient: jax.Array) -> tuple[jax.Array]:
    return (gradient / (gradient * 0 + 1),)  # 1, but not a constant XLA could fold away


_gradient_once.defvjp(_keep_nothing, _divided_by_one)


def _call_block(block: Block, x: jax.Array, positions: jax.Array | None, key: Any, dropout: float) -> Any:
    """A block as a function of (parameters, input, key): the form ``jax.checkpoint`` wraps (the rate,
    a Python float, stays out of its arguments: bound by ``functools.partial``)."""
    return block(x, positions, dropout=dropout, key=key)


def _remat_block(policy: str, dropout: float) -> Callable[..., jax.Array]:
    """``_call_block`` under ``jax.checkpoint`` with ``policy``; its MoEStats (None if dense) sown
    again outside (``jax.checkpoint`` traces the block on its own: they leave it as an output).
    Recomputed, a block draws its masks again from the same key: the same masks."""
    block_and_sown = checkpointed(lifted(functools.partial(_call_block, dropout=dropout)), policy)

    def call(block: Block, x: jax.Array, positions: jax.Array | None, key: Any) -> jax.Array:
        x, sown = block_and_sown(block, x, positions, key)
        sow(sown)
        return x

    return call


def apply_blocks(
    blocks: tuple[Block, ...] | Stacked,
    x: jax.Array,
    positions: jax.Array | None = None,
    *,
    remat: str = "none",
    dropout: float = 0.0,
    key: Any = None,
) -> jax.Array:
    """The blocks in order, each under the recomputation policy ``remat`` (``minishard.remat.POLICIES``);
    with a ``key`` (training), block i drops at rate ``dropout`` with ``key_at(key, i + 1)``.
    ``Stacked`` blocks run as one ``lax.scan`` (``_scan_blocks``), each block called as the loop calls it."""
    call: Callable[..., jax.Array] = functools.partial(_call_block, dropout=dropout)
    if remat != "none":
        call = _remat_block(remat, dropout)
    if isinstance(blocks, Stacked):
        return _scan_blocks(call, blocks, x, positions, key)
    for layer, block in enumerate(blocks, start=1):  # a loop over layers (unrolled by jit), never examples
        x = call(block, x, positions, key_at(key, layer))
    return x


def _scan_blocks(call: Callable[..., Any], blocks: Stacked, x: jax.Array, positions: Any, key: Any) -> Any:
    """The loop of ``apply_blocks`` as one ``lax.scan`` over the stacked blocks and their layer numbers:
    XLA compiles one block, not ``n`` (MaxText's ``scan_layers``). Block i is still called with
    ``key_at(key, i + 1)`` (its layer number scanned beside its parameters) under the same policy, so
    it draws the loop's masks; what the blocks sow leaves the scan and is summed (``run_blocks``)."""

    def body(h: jax.Array, layer_and_block: tuple[jax.Array, Any]) -> tuple[jax.Array, Any]:
        layer, block = layer_and_block
        return lifted(call)(block, h, positions, key_at(key, layer))

    layers = jnp.arange(1, blocks.n + 1)  # the loop's layer numbers: block i is layer i + 1
    y, sown = jax.lax.scan(body, x, (layers, blocks.block))
    sow(jax.tree.map(lambda s: s.sum(0), sown))
    return y


__all__ = [
    "Block",
    "LayerNorm",
    "MLPBuilder",
    "apply_blocks",
    "dense_mlp",
    "moe_mlp",
    "residual_stream",
]
