"""minishard.context (ring attention, zig-zag) and minishard.sequence (all-gather, Ulysses, Megatron's).

The oracle is always attention on one device, on the sequence in its natural order
(``assert_attention_equivalent``): forward and gradients, float32, tight tolerance.
Sizes come from small fixed sets and every distributed function is compiled once per
(function, mesh, chunk order) and shape, so hypothesis's examples reuse programs. Every
sharded call is waited for before the next (simulated CPU devices deadlock otherwise).
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from named import assert_named

import minishard as ms
from minishard import composition
from minishard import context as cx
from minishard import sequence as sq
from minishard.composition import grouped_attention
from minishard.hardware import HARDWARE
from minishard.models.dropout import dropout
from minishard.models.transformer import LayerNorm
from minishard.styles import style_rules
from minishard.testing import SplitSequence, assert_attention_equivalent, split_sequences


@functools.cache
def seq_mesh(p, axis="seq"):
    return ms.make_mesh({axis: p}, devices=jax.devices()[:p])


def case(p, order, shape):
    return SplitSequence(seq_mesh(p), "seq", order, shape)


@functools.cache
@functools.cache
def whole(attend_fn, p, order):
    """``attend_fn`` on whole arrays in sequence order: a reference for another flavour."""

    def reference(q, k, v, *, causal):
        run = sq.over_sequence(attend_fn, seq_mesh(p), causal=causal, order=order)
        return cx.permute(run(*(cx.permute(x, p, order) for x in (q, k, v))), p, order, inverse=True)

    return reference


@functools.cache
def compiled(attend_fn, p, order, causal, shape, grad=False):
    """The compiled forward (or gradient) of ``attend_fn`` on ``shape``, already in its chunk order."""
    run = sq.over_sequence(attend_fn, seq_mesh(p), causal=causal, order=order)
    fn = jax.grad(lambda *qkv: jnp.sum(run(*qkv)), argnums=(0, 1, 2)) if grad else run
    return jax.jit(fn).lower(*[jax.ShapeDtypeStruct(shape, jnp.float32)] * 3).compile()


# -- 1. attention in pieces -------------------------------------------------------------
@functools.partial(jax.jit, static_argnums=(0, 1))
def merged_halves(cut, causal, q, k, v):
    at = jnp.arange(q.shape[1])
    halves = [
        cx.attend(q, k[:, s], v[:, s], at, at[s], causal=causal) for s in (slice(0, cut), slice(cut, None))
    ]
    return cx.merge(*halves[0], *halves[1]), cx.attend(q, k, v, at, at, causal=causal)


@settings(max_examples=6)
@given(cut=st.sampled_from([3, 6]), causal=st.booleans(), seed=st.integers(0, 3))  # each cut compiles
def test_merging_two_partial_softmaxes_is_attention_over_all_keys(cut, causal, seed):
    q, k, v = np.random.default_rng(seed).normal(size=(3, 1, 8, 2, 4)).astype(np.float32)
    (out, lse), (want, want_lse) = merged_halves(cut, causal, q, k, v)
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-6, atol=1e-6)


# -- 1b. the backward that keeps the weights in the values' dtype (issue 61 §3) ----------------
def autodiffs_attend(q, k, v, q_pos, k_pos, *, causal=False, dropped=None):
    """``attend`` as it was before ``narrow_attend``: float32 weights, differentiated by JAX (which
    keeps them in float32 for exp's gradient), cast to the values' dtype for the matrix unit."""
    s = cx.scores(q, k, q_pos, k_pos, causal)
    lse = jax.nn.logsumexp(s, axis=-1)
    weights = jnp.exp(s - lse[..., None])
    weights = weights if dropped is None else dropped(weights)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights.astype(v.dtype), v, **cx.F32)
    return out, lse.swapaxes(1, 2)


def loss_of(attend_fn, g, causal, dropped=None):
    """``(out, lse)`` of ``attend_fn`` and the gradients in q, k, v of a loss that reads both,
    ``Σ g·out + Σ sin(lse)``, so lse's gradient (what a merge gives it) is not zero; jitted."""

    def loss(q, k, v):
        at = jnp.arange(q.shape[1])
        out, lse = attend_fn(q, k, v, at, at, causal=causal, dropped=dropped)
        return jnp.sum(out * g) + jnp.sum(jnp.sin(lse)), (out, lse)

    return jax.jit(lambda *qkv: jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(*qkv)[::-1])


def assert_within_bf16(got, want, bound=2e-2):
    """Each array within ``bound`` of the largest of ``want``'s: bf16 keeps 8 bits, 0.4% a value."""
    for mine, exact in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        scale = float(jnp.max(jnp.abs(exact)))
        worst = float(jnp.max(jnp.abs(jnp.asarray(mine, jnp.float32) - exact))) / scale
        assert worst < bound, (worst, mine.shape)


@pytest.mark.parametrize(("causal", "rate"), [(False, 0.0), (True, 0.25)])
def test_narrow_attends_backward_is_autodiffs_in_float32_lse_and_dropout_included(causal, rate):
    """``narrow_attend``'s own backward (``softmax_grad``, lse's gradient, dropout's transpose) in
    float32 against JAX's derivative of the float32 ``attend``."""
    q, k, v, g = jax.random.normal(jax.random.key(1), (4, 2, 8, 3, 4))
    dropped = functools.partial(dropout, rate=rate, key=jax.random.key(7)) if rate else None
    mine = loss_of(cx.narrow_attend, g, causal, dropped)(q, k, v)
    autodiff = loss_of(cx.attend, g, causal, dropped)(q, k, v)
    for got, want in zip(jax.tree.leaves(mine), jax.tree.leaves(autodiff), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("causal", "rate"), [(False, 0.0), (True, 0.0), (False, 0.25), (True, 0.25)])
def test_a_bf16_attend_has_the_loss_and_gradients_of_autodiffs_within_bf16s_precision(causal, rate):
    """With and without the mask and dropout: bf16 ``attend`` (weights kept in bf16) and the float32
    weights' autodiff agree within bf16's rounding, and both with float32's exact gradients."""
    q, k, v, g = jax.random.normal(jax.random.key(0), (4, 2, 16, 3, 8))
    dropped = functools.partial(dropout, rate=rate, key=jax.random.key(7)) if rate else None
    narrow = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    mine = loss_of(cx.attend, g, causal, dropped)(*narrow)
    before = loss_of(autodiffs_attend, g, causal, dropped)(*narrow)
    exact = loss_of(cx.attend, g, causal, dropped)(q, k, v)
    assert_within_bf16(mine, before)
    assert_within_bf16(mine, exact)


def test_a_bf16_attend_keeps_only_bf16_weights_for_its_backward_pass():
    """What ``jax.vjp`` keeps of ``[b, h, q, k]`` (its pullback's arrays): bf16 weights alone, where
    autodiff of the float32 softmax keeps float32 weights (and scores, and the mask's booleans)."""
    q, k, v = jax.random.normal(jax.random.key(0), (3, 2, 16, 3, 8), jnp.bfloat16)
    at = jnp.arange(16)

    def kept(attend_fn):
        _, pullback = jax.vjp(lambda q, k, v: attend_fn(q, k, v, at, at, causal=True), q, k, v)
        return {x.dtype for x in jax.tree.leaves(pullback) if x.shape == (2, 3, 16, 16)}

    assert kept(cx.attend) == {jnp.dtype(jnp.bfloat16)}
    assert jnp.dtype(jnp.float32) in kept(autodiffs_attend)


def test_a_bf16_attends_scores_leave_the_matrix_unit_in_bf16_and_its_softmax_is_float32():
    """As the plain bf16 step and PyTorch's autocast take them: ``q·kᵀ`` summed in float32 inside
    the matrix unit, written out in bf16 (half the bytes of the step's largest array, traced on the
    chip: docs/benchmarks.md), then ``exp`` in float32. Float32 attention's scores stay float32."""
    q, k, v = jax.random.normal(jax.random.key(0), (3, 2, 16, 3, 8))
    at = jnp.arange(16)

    def program(dtype):  # the dtypes of the [b, h, q, k] scores and of exp's, in the lowered program
        args = [x.astype(dtype) for x in (q, k, v)]
        attend = jax.jit(lambda q, k, v: cx.attend(q, k, v, at, at, causal=True))
        text = attend.lower(*args).as_text()
        scores = re.findall(r"dot_general .* -> tensor<2x3x16x16x(\w+)>", text)
        exps = re.findall(r"stablehlo.exponential .* : tensor<2x3x16x16x(\w+)>", text)
        return set(scores), set(exps)

    assert program(jnp.bfloat16) == ({"bf16"}, {"f32"})
    assert program(jnp.float32) == ({"f32"}, {"f32"})


def test_a_bf16_attend_with_dropout_differentiates_under_remat():
    """The drop's key never enters the custom VJP (its factors do): ``jax.checkpoint`` traces the
    attention again in the backward pass, and the same gradients come out, no tracer leaked."""
    q, k, v, g = jax.random.normal(jax.random.key(0), (4, 2, 16, 3, 8))
    narrow = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    at = jnp.arange(16)

    def block(q, k, v, key):  # a layer's key, folded in where the block is traced (as the GPT's)
        dropped = functools.partial(dropout, rate=0.25, key=jax.random.fold_in(key, 1))
        return cx.attend(q, k, v, at, at, causal=True, dropped=dropped)[0]

    def grads(remat):
        def loss(q, k, v, key):
            return jnp.sum((jax.checkpoint(block) if remat else block)(q, k, v, key) * g)

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*narrow, jax.random.key(7))

    assert_within_bf16(grads(remat=True), grads(remat=False), bound=1e-3)


def test_float32_attend_is_autodiffs_bit_for_bit():
    q, k, v, g = jax.random.normal(jax.random.key(2), (4, 2, 16, 3, 8))
    dropped = functools.partial(dropout, rate=0.25, key=jax.random.key(7))
    mine = loss_of(cx.attend, g, True, dropped)(q, k, v)
    before = loss_of(autodiffs_attend, g, True, dropped)(q, k, v)
    for a, b in zip(jax.tree.leaves(mine), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("ring", ["ring_attention", "ring_forward differentiated"])
def test_a_bf16_ring_has_float32_attentions_gradients_within_bf16s_precision(ring):
    """Under the ring, bf16: its own backward (``attend_grads``, ``softmax_grad``), and JAX's through
    ``ring_forward``, where each ``merge`` gives a pair's lse a gradient (``narrow_attend``'s dlse)."""
    p, shape = 4, (1, 16, 2, 4)
    fns = {
        "ring_attention": cx.ring_attention,
        "ring_forward differentiated": lambda q, k, v, **kw: cx.ring_forward(q, k, v, **kw)[0],
    }
    run = sq.over_sequence(fns[ring], seq_mesh(p), causal=True, order="zigzag")
    q, k, v, g = jax.random.normal(jax.random.key(3), (4, *shape))

    def loss(attend_fn, *qkv):
        out = attend_fn(*qkv)
        return jnp.sum(jnp.asarray(out, jnp.float32) * g), out

    q, k, v, g = (cx.permute(x, p, "zigzag") for x in (q, k, v, g))  # as the devices hold them
    narrow = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    mine = jax.jit(jax.grad(functools.partial(loss, run), (0, 1, 2), has_aux=True))(*narrow)
    whole = functools.partial(cx.attention, q_pos=cx.held_order(16, p, "zigzag"), causal=True)
    exact = jax.jit(jax.grad(functools.partial(loss, whole), (0, 1, 2), has_aux=True))(q, k, v)
    assert_within_bf16(mine, exact)


# -- 2. where the chunks live -----------------------------------------------------------
@pytest.mark.parametrize("p", [1, 2, 3, 4, 8, 16])
def test_balance_in_order_is_2p_over_p_plus_1_and_zigzag_is_1(p):
    assert cx.balance(p, "in-order") == pytest.approx(2 * p / (p + 1))
    assert cx.balance(p, "zigzag") == 1.0
    assert cx.balance(p, "in-order", causal=False) == cx.balance(p, "zigzag", causal=False) == 1.0


@pytest.mark.parametrize("order", ["in-order", "zigzag"])
@pytest.mark.parametrize("p", [1, 2, 4, 8])
def test_every_query_chunk_meets_every_key_chunk_once(p, order):
    met = {}
    for device in range(p):
        for step in range(p):
            mine, theirs = cx.meets(device, step, p, order)
            for q in mine:
                for k in theirs:
                    met[q, k] = met.get((q, k), 0) + 1
    n = p * cx.CHUNKS[order]
    assert met == {(q, k): 1 for q in range(n) for k in range(n)}


def test_the_schedule_skips_the_future_and_masks_the_diagonal():
    grid = cx.pair_kinds(4, "in-order")
    assert grid[0] == [("masked",), ("skipped",), ("skipped",), ("skipped",)]
    assert grid[3] == [("masked",), ("computed",), ("computed",), ("computed",)]
    zigzag = cx.pair_kinds(4, "zigzag")  # every device: 2 diagonals at step 0, then 2 pairs a step
    assert all(row[0].count("masked") == 2 and row[0].count("computed") == 1 for row in zigzag)
    assert all(cell.count("skipped") == 2 for row in zigzag for cell in row[1:])


@pytest.mark.parametrize("order", ["in-order", "zigzag"])
def test_held_order_lists_each_token_once_in_the_devices_order(order):
    held = np.asarray(cx.held_order(16, 4, order))
    assert sorted(held) == list(range(16))
    per_device = [np.asarray(cx.held_order(16, 4, order, device=d)) for d in range(4)]
    np.testing.assert_array_equal(np.concatenate(per_device), held)
    x = jnp.arange(2 * 16).reshape(2, 16)
    np.testing.assert_array_equal(cx.permute(cx.permute(x, 4, order), 4, order, inverse=True), x)


# -- 3. the ring: equal to attention on one device ----------------------------------------
def test_the_ring_equals_attention_forward_and_gradients():  # the quick loop's case; the property is slow
    assert_attention_equivalent(cx.ring_attention, case(4, "zigzag", (1, 16, 2, 4)), causal=True)


@pytest.mark.slow
@given(split=split_sequences(), causal=st.booleans(), seed=st.integers(0, 3))
def test_the_ring_equals_attention_for_drawn_split_sequences(split, causal, seed):
    assert_attention_equivalent(cx.ring_attention, split, causal=causal, seed=seed)


@pytest.mark.slow
# 2 examples, not 6 (9.9 s): each order's ring equals attention in the drawn property above, so
# zigzag's equals in order's through it; here the two rings side by side, on 2 drawn meshes
@settings(max_examples=2)
@given(split=split_sequences(orders=("zigzag",)), seed=st.integers(0, 3))
def test_zigzag_equals_the_ring_in_order(split, seed):
    in_order = whole(cx.ring_attention, split.devices, "in-order")
    assert_attention_equivalent(cx.ring_attention, split, causal=True, seed=seed, reference=in_order)


@pytest.mark.slow
@settings(max_examples=6)
@given(split=split_sequences(), causal=st.booleans(), seed=st.integers(0, 3))
def test_all_gather_equals_the_ring(split, causal, seed):
    ring = whole(cx.ring_attention, split.devices, split.order)
    assert_attention_equivalent(sq.all_gather_attention, split, causal=causal, seed=seed, reference=ring)


@pytest.mark.slow
@settings(max_examples=6)
@given(split=split_sequences(heads=(1, 2), heads_per_device=True), causal=st.booleans())
def test_ulysses_equals_attention(split, causal):
    assert_attention_equivalent(sq.ulysses_attention, split, causal=causal)


def test_all_gather_and_ulysses_equal_attention():  # the quick loop's case
    for attend_fn in (sq.all_gather_attention, sq.ulysses_attention):
        assert_attention_equivalent(attend_fn, case(2, "zigzag", (1, 8, 2, 4)), causal=True)


def leaking_future_token(q_pos, k_pos):
    return k_pos[None, :] <= q_pos[:, None] + 1  # each query also sees the next token


def skipping_the_diagonal(q_chunk, k_chunk, causal):
    return k_chunk < q_chunk if causal else True


@pytest.mark.parametrize(
    "name, bug, words",
    [
        ("visible", leaking_future_token, ["output:", "position 0 (device 0, chunk 0"]),
        ("needed", skipping_the_diagonal, ["output:", "position 0 (device 0, chunk 0"]),
    ],
)
def test_a_leaked_future_token_or_a_skipped_chunk_fails_the_property(monkeypatch, name, bug, words):
    monkeypatch.setattr(cx, name, bug)
    fresh = lambda *args, **kwargs: cx.ring_attention(*args, **kwargs)  # noqa: E731  (a new trace)
    assert_named(
        lambda: assert_attention_equivalent(fresh, case(2, "zigzag", (1, 8, 2, 4)), causal=True),
        AssertionError,
        words,
    )


def leak_inside_a_chunk(q_pos, k_pos):
    return (k_pos[None, :] <= q_pos[:, None]) | ((q_pos[:, None] == 8) & (k_pos[None, :] == 9))


def test_a_wrong_position_in_the_middle_is_named_with_its_device_and_chunk(monkeypatch):
    monkeypatch.setattr(cx, "visible", leak_inside_a_chunk)  # token 8 sees token 9: both in chunk 4
    fresh = lambda *args, **kwargs: cx.ring_attention(*args, **kwargs)  # noqa: E731
    words = [
        "output: 1 of 16 tokens differ, the first at position 8 (device 3, chunk 4",
        "tokens before it agree",
    ]
    assert_named(
        lambda: assert_attention_equivalent(fresh, case(4, "zigzag", (1, 16, 2, 4)), causal=True),
        AssertionError,
        words,
    )


# -- grouped-query attention: K and V travel at their own heads ---------------------------
def grouped_ring(p, order="zigzag"):
    """The ring on whole arrays in sequence order, its value and gradients of ``sum(sin(out))``."""
    ring = sq.over_sequence(cx.ring_attention, seq_mesh(p), causal=True, order=order)

    def loss(q, k, v):
        held = (cx.permute(x, p, order) for x in (q, k, v))
        return jnp.sum(jnp.sin(cx.permute(ring(*held), p, order, inverse=True)))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def test_the_ring_of_grouped_keys_sends_them_unrepeated_and_equals_grouped_attention():
    p, heads, kv_heads = 4, 4, 2  # groups of 2 query heads
    q = jax.random.normal(jax.random.key(0), (1, 16, heads, 4))
    k, v = jax.random.normal(jax.random.key(1), (2, 1, 16, kv_heads, 4))
    dense = lambda q, k, v: jnp.sum(jnp.sin(grouped_attention(q, k, v, causal=True)))  # noqa: E731
    want_loss, want = jax.jit(jax.value_and_grad(dense, argnums=(0, 1, 2)))(q, k, v)  # one program
    ring = grouped_ring(p)  # one jit: its call's program is the one lowered below, compiled once
    got_loss, got = ring(q, k, v)
    assert float(got_loss) == pytest.approx(float(want_loss), rel=1e-5)
    for name, a, b in zip("qkv", got, want, strict=True):  # dk and dv: a group's summed
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=f"d{name}")
    program = ring.lower(q, k, v).compile()
    permutes = ms.collectives(program)["collective-permute"]
    kv_chunk = 1 * 16 // p * kv_heads * 4 * 4  # one device's K (or V): [1, 4, 2, 4] float32
    assert permutes.bytes == sum(cx.ring_permutes(p)) * kv_chunk  # not the 4 query heads'


# -- the ring's census and memory ----------------------------------------------------------
def test_a_grouped_rings_verdict_sends_its_kv_heads_against_the_query_heads_work():
    """LLaMA-3 8B's attention (32 query heads, 8 K/V) on 8 devices of v5p, 32768 tokens: its sends
    hide (costs.ring_bound 0.62); the same 32 heads ungrouped send 4 times the bytes and wait."""
    p, seq, heads, kv_heads, head_dim = 8, 32768, 32, 8, 128

    def verdict(kv: int, queries: int | None) -> str:
        chunk = (1, seq // p, kv, head_dim)
        report = composition.RingReport("context", p, "zigzag", 32, chunk, (0, 0), "v5p", queries)
        return str(report)

    ungrouped, grouped = verdict(heads, None), verdict(kv_heads, heads)
    for text, kv in ((ungrouped, heads), (grouped, kv_heads)):
        k = ms.costs.ring_bound(seq, heads, kv, head_dim, p, HARDWARE["v5p"])
        assert f"hide behind = {k:.3g}:" in text.splitlines()[-1]
    assert ungrouped.endswith("the ring waits; a longer context hides it")
    assert grouped.endswith("hidden behind the blocks")


@pytest.mark.parametrize("p", [2, 4, 8])
def test_a_ring_forward_sends_k_and_v_2_p_minus_1_times(p):
    shape = (1, 4 * p, 2, 4)
    found = ms.collectives(compiled(cx.ring_attention, p, "zigzag", True, shape))
    chunk_bytes = 4 * 2 * 4 * 4  # [1, 4, 2, 4] float32: one device's K (or V)
    assert set(found) == {"collective-permute"}
    permutes = found["collective-permute"]
    assert (permutes.count, permutes.bytes, permutes.mesh_axes) == (
        2 * (p - 1),
        2 * (p - 1) * chunk_bytes,
        (("seq",),),
    )


@pytest.mark.parametrize(
    "p", [3, 4]
)  # at p=2 XLA unrolls the 1-trip loops and merges the two first K, V sends
def test_its_gradient_sends_k_v_and_dk_dv_round_again(p):
    shape = (1, 4 * p, 2, 4)
    permutes = ms.collectives(compiled(cx.ring_attention, p, "in-order", True, shape, grad=True))[
        "collective-permute"
    ]
    # forward 2(p-1); backward K and V 2(p-1), dK and dV 2p (the last step's sent home)
    assert permutes.count == 2 * (p - 1) + 2 * (p - 1) + 2 * p


def test_the_other_flavours_census():
    p, shape = 4, (1, 16, 4, 8)
    whole_bytes = 16 * 4 * 8 * 4  # one whole [1, 16, 4, 8] float32 array
    gathered = ms.collectives(compiled(sq.all_gather_attention, p, "in-order", True, shape))
    assert set(gathered) == {"all-gather"}
    assert (gathered["all-gather"].count, gathered["all-gather"].bytes) == (2, 2 * whole_bytes)
    swapped = ms.collectives(compiled(sq.ulysses_attention, p, "in-order", True, shape))
    assert set(swapped) == {"all-to-all"}
    assert (swapped["all-to-all"].count, swapped["all-to-all"].bytes) == (4, 4 * whole_bytes // p)


# The custom_vjp ring's backward keeps less than jax.grad through the scan, by more than every step's
# scores: docs/context.md compiles both at p = 8 (1,024 tokens, 8 heads) and asserts it, once (this file
# compiled the same pair at 512 tokens again: 4.9 s).


# -- positions: a permuted sequence computes the same loss -----------------------------------
def tiny_lm_loss(params, tokens, targets, positions, attend):
    """Token and position embeddings, one causal attention, a head: the mean cross-entropy."""
    x = params["embed"][tokens] + params["position"][positions]
    q, k, v = (jnp.einsum("bse,ehd->bshd", x, params[name]) for name in ("q", "k", "v"))
    logits = jnp.einsum("bshd,hdv->bsv", attend(q, k, v), params["out"])
    return ms.cross_entropy(logits, ms.one_hot(targets, logits.shape[-1]))


@pytest.mark.slow  # over 5 s for each chunk order
@pytest.mark.parametrize("order", ["in-order", "zigzag"])
def test_a_model_on_a_permuted_sequence_has_the_loss_and_gradients_of_the_plain_one(order):
    p, seq_len, vocab, width = 4, 16, 11, 8
    keys = jax.random.split(jax.random.key(0), 7)
    params = {
        "embed": jax.random.normal(keys[0], (vocab, width)),
        "position": jax.random.normal(keys[1], (seq_len, width)),
    }
    params |= {name: jax.random.normal(key, (width, 2, 4)) / 3 for name, key in zip("qkv", keys[2:5])}
    params["out"] = jax.random.normal(keys[5], (2, 4, vocab))
    tokens, targets = jax.random.randint(keys[6], (2, 2, seq_len), 0, vocab)
    plain = functools.partial(cx.attention, causal=True)
    want = jax.jit(jax.value_and_grad(tiny_lm_loss), static_argnums=4)(
        params, tokens, targets, jnp.arange(seq_len), plain
    )
    ring = sq.over_sequence(cx.ring_attention, seq_mesh(p), causal=True, order=order)
    held = [cx.permute(x, p, order) for x in (tokens, targets)]
    got = jax.jit(jax.value_and_grad(tiny_lm_loss), static_argnums=4)(
        params, *held, cx.held_order(seq_len, p, order), ring
    )
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


# -- bad input: one line, before any work --------------------------------------------------
def ring_on(p, shape, order="in-order", attend_fn=cx.ring_attention):
    x = jnp.ones(shape)
    return lambda: sq.over_sequence(attend_fn, seq_mesh(p), order=order)(x, x, x)


@pytest.mark.parametrize(
    "call, words",
    [
        (
            lambda: cx.held_order(8, 2, "striped"),
            ["unknown chunk order 'striped'", "'in-order', 'zigzag'"],
        ),
        (
            lambda: cx.held_order(10, 4, "zigzag"),
            ["10 tokens does not split into 8 equal chunks", "multiple of 8"],
        ),
        (ring_on(4, (1, 12, 2, 4), "zigzag"), ["12 tokens does not split into 8 equal chunks"]),
        (
            lambda: cx.ring_attention(*[jnp.ones((1, 4, 2, 4))] * 3, axis="seq"),
            ["'seq' is no axis of a surrounding"],
        ),
        (
            ring_on(4, (1, 8, 2, 4), attend_fn=sq.ulysses_attention),
            ["2 heads do not split over the 4 devices", "'seq'"],
        ),
        (
            lambda: sq.over_sequence(cx.ring_attention, seq_mesh(2, "data")),
            ["over_sequence: axis='seq' is no axis of the mesh", "('data',)"],
        ),
        (ring_on(2, (4, 2, 4)), ["over_sequence: q, k and v must be [batch, seq, heads, head_dim]", "(4, 2"]),
        (
            lambda: cx.ring_attention(*[jnp.ones((4, 2, 4))] * 3, axis="seq"),
            ["ring_attention: q, k and v must be [batch, seq, heads, head_dim]", "on this device"],
        ),
        (ring_on(4, (1, 10, 2, 4)), ["over_sequence: a sequence of 10 tokens does not split into 4 equal"]),
        (lambda: cx.held_order(16, 0), ["held_order: p (the devices of the ring) must be a positive int"]),
        (lambda: cx.held_order(0, 2), ["held_order: seq_len must be a positive int, got 0"]),
        (lambda: cx.pair_kinds(0), ["pair_kinds: p (the devices of the ring) must be a positive int, got 0"]),
        (lambda: cx.pair_kinds(2, "striped"), ["pair_kinds: unknown chunk order 'striped'"]),
        (lambda: cx.balance(0), ["balance: p (the devices of the ring) must be a positive int, got 0"]),
        (
            lambda: cx.chunks(device=5, p=4),
            ["chunks: device=5 is no device of a ring of p=4; devices run 0 to 3"],
        ),
        (
            lambda: cx.merge(*[jnp.ones(s) for s in ((1, 4, 1, 2), (1, 4, 1), (1, 3, 1, 2), (1, 3, 1))]),
            ["merge: out1 (1, 4, 1, 2), lse1 (1, 4, 1), out2 (1, 3, 1, 2), lse2 (1, 3, 1); the two parts"],
        ),
    ],
)
def test_bad_input_is_named(call, words):
    assert_named(call, ValueError, words)


@pytest.mark.parametrize("on_mesh", [False, True])
def test_integer_q_k_v_are_refused_not_truncated(on_mesh):
    x = jnp.ones((1, 4, 2, 4), jnp.int32)
    run = sq.over_sequence(cx.ring_attention, seq_mesh(2)) if on_mesh else cx.attention
    assert_named(lambda: run(x, x, x), TypeError, ["q, k and v must be float arrays, got q int32, k int32"])


# -- 4. Megatron's sequence parallelism ----------------------------------------------------
# Residual MLP blocks with the transformer's LayerNorm (the GPT's and the ViT's).
WIDTH, HIDDEN, DEPTH, BATCH, SEQ = 16, 32, 2, 2, 16


@functools.cache
def residual_blocks():
    keys = jax.random.split(jax.random.key(0), DEPTH)
    return ms.Sequential([sq.ResidualMLP(LayerNorm(WIDTH), WIDTH, HIDDEN, key=key) for key in keys])


def mean_square(blocks, x):
    return jnp.mean(jnp.square(blocks(x)))


plain_step = jax.jit(jax.value_and_grad(mean_square))


@functools.cache
def annotated_step(sequence_parallel):
    rules = style_rules("tp", {"seq": "model" if sequence_parallel else None})
    return ms.Sharded(seq_mesh(4, "model"), rules)(jax.value_and_grad(mean_square))


@functools.cache
def by_hand_step(sequence_parallel):
    run = sq.by_hand(residual_blocks(), seq_mesh(4, "model"), sequence_parallel=sequence_parallel)
    return jax.jit(jax.value_and_grad(lambda blocks, x: jnp.mean(jnp.square(run(blocks, x)))))


@pytest.mark.parametrize(
    "step",
    [
        pytest.param(lambda: by_hand_step(True), id="by hand, sequence parallel"),
        pytest.param(lambda: annotated_step(True), id="annotated, sequence parallel", marks=pytest.mark.slow),
        pytest.param(lambda: by_hand_step(False), id="by hand, tensor parallel", marks=pytest.mark.slow),
        pytest.param(lambda: annotated_step(False), id="annotated, tensor parallel", marks=pytest.mark.slow),
    ],
)
def test_sequence_parallel_blocks_compute_the_plain_loss_and_gradients(step):
    x = jax.random.normal(jax.random.key(1), (BATCH, SEQ, WIDTH))
    want = plain_step(residual_blocks(), x)
    got = jax.block_until_ready(step()(residual_blocks(), x))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_each_all_reduce_becomes_a_reduce_scatter_and_an_all_gather_of_the_same_bytes():
    x = jax.ShapeDtypeStruct((BATCH, SEQ, WIDTH), jnp.float32)
    tp, sp = (ms.collectives(by_hand_step(s).lower(residual_blocks(), x).compile()) for s in (False, True))
    activation = BATCH * SEQ * WIDTH * 4
    assert (tp["all-reduce"].count, tp["all-reduce"].bytes) == (2 * DEPTH, 2 * DEPTH * activation)
    assert (sp["all-gather"].count, sp["all-gather"].bytes) == (2 * DEPTH, 2 * DEPTH * activation)
    assert (sp["reduce-scatter"].count, sp["reduce-scatter"].bytes) == (
        2 * DEPTH,
        2 * DEPTH * activation // 4,
    )
    before = ms.costs.sent_bytes("all-reduce", tp["all-reduce"].bytes, 4)
    after = ms.costs.sent_bytes("all-gather", sp["all-gather"].bytes, 4) + ms.costs.sent_bytes(
        "reduce-scatter", sp["reduce-scatter"].bytes, 4
    )
    assert before == after
    # and one all-reduce more: the gradients of the replicated LayerNorm and bias, each device's tokens' share
    assert sp["all-reduce"].bytes == DEPTH * 3 * WIDTH * 4 + 4  # (+ the loss's partial sums)


def test_the_residual_stream_is_split_over_the_sequence_and_takes_less_memory():
    x = jnp.ones((BATCH, SEQ, WIDTH))
    forward = ms.Sharded(seq_mesh(4, "model"), style_rules("tp", {"seq": "model"}))(lambda b, x: b(x))
    assert forward(residual_blocks(), x).sharding.shard_shape((BATCH, SEQ, WIDTH)) == (BATCH, SEQ // 4, WIDTH)
    temp = [
        by_hand_step(s).lower(residual_blocks(), x).compile().memory_analysis().temp_size_in_bytes
        for s in (False, True)
    ]
    assert temp[1] < temp[0], temp
