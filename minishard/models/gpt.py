"""A GPT written as minishard Layers: characters in, the next character's logits out.

A decoder-only transformer, nanoGPT's shape (``karpathy/nanoGPT``, ``model.py``):

* ``Embedding``: each character id looks up a learned vector (``tokens``,
  ``[vocab, width]``) and each position another (``position_table``,
  ``[context, width]``); their sum is the token's first state ``[B, T, width]``;
* ``Block`` (``depth`` of them, ``minishard.models.transformer``, the ViT's own):
  ``x + Attention(LayerNorm(x))``, causal, then ``x + MLP(LayerNorm(x))``;
* ``GPT``: a last ``LayerNorm``, then a ``Linear`` head to ``vocab`` logits.

The head is **not tied** to the token table (nanoGPT ties them). Tying saves
``vocab x width`` numbers (65 x 128 here, 1% of the model) but makes one
parameter live at both ends of the model: a pipeline holds the embedding on
its first stage and the head on its last, and the two would have to meet
every step. Untied, ``stacked_gpt`` is the same function of the same
parameters, and each table names its own axes: ``("vocab", "embed")`` for the
lookup, ``("embed", "vocab")`` for the head. No style splits ``"vocab"`` (65
characters do not divide), so under ``tp`` the head stays whole and the
Megatron splits are the heads and the MLP's hidden units, as in the ViT.

=====================  ============================  =========================
parameter              logical axes                  the ``tp`` style
=====================  ============================  =========================
token table            ``("vocab", "embed")``        replicated
position table         ``("seq", "embed")``          replicated
LayerNorm scale, bias  ``("embed",)``                replicated
query, key, value      ``("embed", "heads", "kv")``  heads over "model"
attention out          ``("heads", "kv", "embed")``  heads over "model"
MLP in, out            ``("embed", "mlp")``, back    hidden units over "model"
head                   ``("embed", "vocab")``        replicated
MoE experts            ``("expert", "embed", ...)``  over "expert" (``ep``)
=====================  ============================  =========================

Under context parallelism (``cp``, ``dp+cp``: ``core="ring"``, or ``"ring-flash"`` for the
Pallas kernels on each pair of chunks) the blocks attend by ring
attention over the tokens at ``positions``: the run side deals each batch out zig-zag over the
devices of "context" (``minishard.run.next_token``); ``docs/context.md`` measures it against ``dp``.

``GPT(mlp=moe_mlp(8, k=2))`` makes every MLP a mixture of experts
(``minishard.experts``), the same function of its ids: ``collect(MoEStats, model)(ids)``
gives the logits and the blocks' ``MoEStats`` added up, which the training loss
adds (``minishard.run.next_token``).

Decoding keeps a ``KVCache`` per block (``init_cache``): ``decode`` runs only
the new tokens through the blocks, each attending to the cached keys and
values of every earlier one, and ``generate`` draws a
continuation one character at a time with a jitted step that donates the
cache, so XLA updates it in place. Under ``cp`` each device keeps its share of the cache's
positions, and the partial attentions merge across "context" (``attention.cached_attention``).

>>> import jax
>>> model = jax.eval_shape(lambda: GPT(key=jax.random.key(0)))   # nanoGPT's CPU shape, no numbers drawn
>>> len(model.blocks), model.embedding.tokens.shape, model.head.weight.shape
(4, (65, 128), (128, 65))
>>> ids = jax.ShapeDtypeStruct((2, 64), jax.numpy.int32)
>>> jax.eval_shape(lambda m, ids: m(ids), model, ids).shape   # a distribution per position
(2, 64, 65)
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from minishard.constraints import activation_axes, as_activation, constrain, output_sharding
from minishard.layers import Layer, Linear, Sequential, check_input, check_key
from minishard.models.attention import KVCache
from minishard.models.dropout import EMBEDDINGS, dropout, key_at
from minishard.models.transformer import Block, LayerNorm, MLPBuilder, apply_blocks, dense_mlp
from minishard.pipeline import Stacked, StackedModel, stack, stack_blocks, unstack_blocks
from minishard.remat import POLICIES
from minishard.rules import LogicalAxes


class Embedding(Layer):
    """``[B, T]`` character ids -> ``[B, T, width]``: a learned vector per character plus one per position.

    Attention itself ignores order; the ``position_table`` is how a token
    knows where it stands. It is read at the tokens' *positions* (``0 .. T - 1``
    unless given), so a cache or a reordered sequence finds the right rows.

    >>> import jax, jax.numpy as jnp
    >>> embed = Embedding(vocab=5, context=8, width=3, key=jax.random.key(0))
    >>> x = embed(jnp.array([[1, 4]]))
    >>> bool(jnp.allclose(x[0, 1], embed.tokens[4] + embed.position_table[1]))
    True
    """

    param_fields = ("tokens", "position_table")

    def __init__(self, vocab: int, context: int, width: int, *, key: jax.Array) -> None:
        check_key("Embedding", key)
        k_tokens, k_positions = jax.random.split(key)
        # Standard normal, as large as what the blocks add to the residual stream at first.
        self.tokens = jax.random.normal(k_tokens, (vocab, width))
        self.position_table = jax.random.normal(k_positions, (context, width))

    def __call__(self, ids: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        check_input("Embedding", ids)
        context = self.position_table.shape[0]
        if jnp.ndim(ids) != 2 or not jnp.issubdtype(ids.dtype, jnp.integer) or ids.shape[1] > context:
            raise ValueError(
                f"Embedding expects character ids [B, T] (integers, T <= context {context}), got "
                f"{ids.dtype}{list(jnp.shape(ids))}"
            )
        positions = jnp.arange(ids.shape[1]) if positions is None else positions
        axes = activation_axes(3, "seq", "embed")  # where the tables' rows land (Explicit mode)
        tokens, table = as_activation(self.tokens, axes), as_activation(self.position_table, axes)
        # A gather; on an Explicit mesh it names its output's sharding, elsewhere None: XLA decides.
        return tokens.at[ids].get(out_sharding=output_sharding(axes)) + table[positions]

    def param_logical_axes(self) -> dict[str, LogicalAxes]:
        return {"tokens": ("vocab", "embed"), "position_table": ("seq", "embed")}


class GPT(Layer):
    """A decoder-only transformer: ``[B, T]`` character ids -> ``[B, T, vocab]`` next-character logits.

    The defaults are nanoGPT's CPU configuration (``README.md``: 4 layers,
    4 heads, 128 features, a context of 64 characters), with the ViT's MLP
    (``mlp_ratio`` 4, Swish). ``core`` names the attention core
    (``minishard.models.attention.ATTENTION_CORES``), ``mlp`` builds each
    block's MLP, ``remat`` names the recomputation policy of each block (``minishard.remat``). ``kv_heads``
    (by default ``heads``) fewer than ``heads`` is grouped-query attention: each
    group of ``heads / kv_heads`` query heads shares one key and value head, and
    the cache keeps ``kv_heads`` heads (``minishard.models.attention.Attention``). ``dropout`` (static)
    is the rate of nanoGPT's dropout, drawn only in a call given the step's ``key``: a training step's
    (``minishard.models.dropout``); evaluation and decoding pass none. ``scan`` stacks the blocks
    (``minishard.pipeline.stack_blocks``) and runs them as one ``lax.scan``: the same parameters and
    the same function, masks and remat included, compiled as one block (``transformer.apply_blocks``).

    >>> import jax
    >>> model = GPT(vocab=5, context=8, width=16, depth=2, heads=2, key=jax.random.key(0))
    >>> model(jax.numpy.zeros((3, 8), jax.numpy.int32)).shape
    (3, 8, 5)
    """

    param_fields = ("embedding", "blocks", "norm", "head")
    static_fields = ("remat", "dropout")

    def __init__(
        self,
        vocab: int = 65,
        context: int = 64,
        width: int = 128,
        depth: int = 4,
        heads: int = 4,
        mlp_ratio: int = 4,
        *,
        key: jax.Array,
        remat: str = "none",
        core: str = "dense",
        mlp: MLPBuilder = dense_mlp,
        kv_heads: int | None = None,
        dropout: float = 0.0,
        scan: bool = False,
    ) -> None:
        check_key("GPT", key)
        if remat not in POLICIES:
            raise ValueError(f"GPT: remat must be a policy of {', '.join(POLICIES)}, got {remat!r}")
        if not 0 <= dropout < 1:
            raise ValueError(f"GPT: dropout must be a rate in [0, 1), got {dropout!r}")
        kv_heads = heads if kv_heads is None else kv_heads
        sizes = {"vocab": vocab, "context": context, "width": width, "depth": depth, "heads": heads}
        for name, size in (sizes | {"mlp_ratio": mlp_ratio, "kv_heads": kv_heads}).items():
            if isinstance(size, bool) or not isinstance(size, int | np.integer) or size < 1:
                raise ValueError(f"GPT: {name} must be a positive int, got {size!r}")
        keys = jax.random.split(key, depth + 2)  # one key per layer
        self.embedding = Embedding(vocab, context, width, key=keys[0])
        block = functools.partial(
            Block, width, heads, mlp_ratio * width, causal=True, core=core, mlp=mlp, kv_heads=kv_heads
        )
        blocks = tuple(block(key=k) for k in keys[2:])
        self.blocks = stack_blocks(blocks) if scan else blocks  # the same numbers, stacked or not
        self.norm = LayerNorm(width)
        self.head = Linear(width, vocab, key=keys[1], scale=width**-0.5, axes=("embed", "vocab"))
        self.remat = remat  # a policy of minishard.remat.POLICIES
        self.dropout = float(dropout)  # the rate of every dropout in training (minishard.models.dropout)

    def __call__(self, ids: jax.Array, positions: jax.Array | None = None, *, key: Any = None) -> jax.Array:
        """Logits of ``ids``; given the step's ``key`` (training), with dropout at rate ``self.dropout``."""
        key = key if self.dropout else None  # dropout 0: no random op in the program, whatever the key
        # The tokens' states as the rules lay out activations: left to XLA, the gather would take the
        # table's sharding (under fsdp "embed" over "data") and every device compute the whole batch.
        x = constrain(self.embedding(ids, positions), activation_axes(3, "seq", "embed"))
        x = dropout(x, self.dropout, key_at(key, EMBEDDINGS))
        x = apply_blocks(self.blocks, x, positions, remat=self.remat, dropout=self.dropout, key=key)
        return self.head(self.norm(x))

    def decode(
        self, ids: jax.Array, start: jax.Array, caches: tuple[KVCache, ...]
    ) -> tuple[jax.Array, tuple[KVCache, ...]]:
        """Logits of ``ids`` ``[B, n]`` at positions ``start, start + 1, ...``; earlier ones in ``caches``."""
        positions = start + jnp.arange(ids.shape[1])
        x, written = self.embedding(ids, positions), []
        for block, cache in zip(self.looped_blocks(), caches):
            x, cache = block.cached(x, positions, cache)
            written.append(cache)
        return self.head(self.norm(x)), tuple(written)

    def init_cache(self, batch: int) -> tuple[KVCache, ...]:
        """An empty ``KVCache`` per block, room for the whole context, of the ``kv_heads`` heads."""
        attention, length = self.looped_blocks()[0].attention, self.embedding.position_table.shape[0]
        head_dim = attention.width // attention.heads
        return tuple(KVCache(batch, length, attention.kv_heads, head_dim) for _ in self.looped_blocks())

    def looped_blocks(self) -> tuple[Block, ...]:
        """The blocks one by one, as a loop runs them (decoding's): a scanned GPT's sliced from the stack."""
        if isinstance(self.blocks, Stacked):
            return tuple(unstack_blocks(self.blocks))
        return self.blocks

    def param_logical_axes(self) -> dict[str, LogicalAxes]:
        return {}  # every parameter lives in a sub-layer, which answers for itself


def as_stacked(model: GPT) -> StackedModel:
    """The same GPT with its blocks stacked on a "stage" axis (``minishard.pipeline.stack``), for pp.

    The embedding runs before the stack and the last norm and the head after
    it, outside the pipeline. Same parameters, same function (no remat), an MoE GPT's stats too;
    ``minishard.pipeline.unstack`` gives the GPT back (a pipeline's checkpoint decodes so).
    """
    if model.dropout:  # a pipeline's stages call the blocks without a key
        raise ValueError(
            f"as_stacked: a pipeline draws no dropout masks; give a GPT of dropout 0, not {model.dropout}"
        )
    return stack(model.embedding, model.looped_blocks(), Sequential([model.norm, model.head]))


def stacked_gpt(*args: Any, key: jax.Array, **kwargs: Any) -> StackedModel:
    """``as_stacked(GPT(*args, key=key, **kwargs))``: the GPT of the same seed, ready for a pipeline.

    >>> model = jax.eval_shape(lambda: stacked_gpt(depth=2, key=jax.random.key(0)))
    >>> model.blocks.n, model.blocks.block.attention.param_logical_axes()["query"]
    (2, ('embed', 'heads', 'kv'))
    """
    return as_stacked(GPT(*args, key=key, **kwargs))


# --- decoding with a KV cache ------------------------------------------------------------------


@functools.partial(jax.jit, donate_argnums=2)
def decode_step(model: GPT, ids: jax.Array, caches: tuple[KVCache, ...], start: jax.Array) -> Any:
    """``model.decode`` jitted, the caches donated: XLA writes the new keys and values in place."""
    return model.decode(ids, start, caches)


def generate(
    model: GPT,
    prompt: np.ndarray,
    tokens: int,
    *,
    temperature: float = 1.0,
    seed: int = 0,
    step: Callable[..., Any] = decode_step,
) -> np.ndarray:
    """``prompt`` (ids ``[P]``) and ``tokens`` more ids, each drawn from ``softmax(logits / temperature)``.

    Token ``i`` is drawn with ``jax.random.fold_in(key(seed), i)``: the same seed, the same text.
    The prompt fills the cache in one call; then one call per token. When the
    cache is full (the learned positions end at the context), it restarts from
    the last half-context of text, so every token still sees at least that much.
    ``step`` is ``decode_step`` or the same function under ``Sharded``; ``stream`` gives
    the new ids one step at a time, as they are drawn, and decodes a batch.
    """
    new = stream(model, prompt, tokens, temperature=temperature, seed=seed, step=step)
    return np.asarray([*np.asarray(prompt).tolist(), *(ids[0] for ids in new)], np.int32)


def stream(
    model: GPT,
    prompt: np.ndarray,
    tokens: int,
    *,
    temperature: float = 1.0,
    seed: int = 0,
    step: Callable[..., Any] = decode_step,
    batch: int = 1,
) -> Iterator[list[int]]:
    """``generate``'s new ids, as soon as each step draws them (a long continuation prints as it goes):
    ``batch`` continuations of ``prompt`` decoded together, one new id per row per step. Row ``b`` is
    drawn with ``seed + b``, as a lone sequence of that seed is: the same text. Only the last context
    of each row is kept. The arguments are checked before the first id.

    >>> model = GPT(vocab=5, context=8, width=8, depth=1, heads=2, key=jax.random.key(0))
    >>> rows = list(stream(model, np.array([1, 2]), 3, seed=4, batch=2))   # 3 steps of 2 rows
    >>> [ids[1] for ids in rows] == [ids[0] for ids in stream(model, np.array([1, 2]), 3, seed=5)]
    True
    """
    context = model.embedding.position_table.shape[0]
    _check_generate(model, prompt, tokens, temperature, batch)
    ids = [int(i) for i in np.asarray(prompt)]
    rows = [collections.deque(ids, maxlen=context) for _ in range(batch)]  # a longer prompt: its end
    keys = [jax.random.key(seed + b) for b in range(batch)]
    logits, caches, filled = _prefill(model, rows, context, step)
    for i in range(tokens):
        for b, row in enumerate(rows):
            scaled = logits[b, -1] / temperature  # below 1: sharper than the model's own distribution
            row.append(int(jax.random.categorical(jax.random.fold_in(keys[b], i), scaled)))
        yield [row[-1] for row in rows]
        if filled == context:  # no position left: start again from the last half-context
            logits, caches, filled = _prefill(model, rows, context // 2, step)
        else:
            new = jnp.asarray([[row[-1]] for row in rows])
            logits, caches = step(model, new, caches, jnp.asarray(filled))
            filled += 1


def _check_generate(model: GPT, prompt: Any, tokens: Any, temperature: Any, batch: Any) -> None:
    """Refuse, by name, what would sample silently wrong: a uniform draw (temperature inf), a clamped id."""
    if not np.isfinite(temperature) or not temperature > 0:
        raise ValueError(f"generate: temperature must be a finite number > 0, got {temperature}")
    if isinstance(tokens, bool) or not isinstance(tokens, int | np.integer) or tokens < 0:
        raise ValueError(f"generate: tokens must be an int >= 0, got {tokens!r}")
    if isinstance(batch, bool) or not isinstance(batch, int | np.integer) or batch < 1:
        raise ValueError(f"generate: batch must be an int >= 1, got {batch!r}")
    ids, vocab = np.asarray(prompt), model.embedding.tokens.shape[0]
    if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
        raise ValueError(f"generate: the prompt must be a list of ids [P], got {ids.dtype}{list(ids.shape)}")
    if not ids.size:
        raise ValueError("generate: the prompt is empty; give it at least one character")
    if (wrong := np.flatnonzero((ids < 0) | (ids >= vocab))).size:
        raise ValueError(
            f"generate: prompt id {ids[wrong[0]]} (at {wrong[0]}) is outside the vocabulary of {vocab}: "
            f"ids run from 0 to {vocab - 1}"
        )


def _prefill(model: GPT, rows: list[Any], kept: int, step: Callable[..., Any]) -> tuple[jax.Array, Any, int]:
    """Fresh caches holding each row's last ``kept`` ids; the logits of the last one."""
    ids = jnp.asarray([list(row)[-kept:] for row in rows], jnp.int32)
    logits, caches = step(model, ids, model.init_cache(len(rows)), jnp.asarray(0))
    return logits, caches, ids.shape[1]


__all__ = [
    "GPT",
    "Embedding",
    "as_stacked",
    "decode_step",
    "generate",
    "stacked_gpt",
    "stream",
]
