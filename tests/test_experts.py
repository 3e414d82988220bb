"""minishard.experts: routing, the layer against a loop over tokens, expert parallelism by hand and by rules.

The oracles: ``minishard.testing.moe_reference``, a numpy loop over tokens (each through its
top-k experts, an expert taking at most ``capacity`` tokens of a group), and the layer on one
device for the layer by hand over a mesh. Sizes come from small fixed sets, so that examples
reuse compiled programs; every sharded call is waited for (simulated devices can deadlock
XLA's rendezvous otherwise).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from named import assert_named

import minishard as ms
from minishard.census import bytes_by_mesh_axes, collectives
from minishard.experts import (
    ExpertParallel,
    ExpertReport,
    Experts,
    MoE,
    MoEStats,
    all_to_all_moe,
    balance_loss,
    capacity,
    top_k,
    z_loss,
)
from minishard.layers import collect, sow
from minishard.models.gpt import GPT
from minishard.models.transformer import Block, apply_blocks, moe_mlp
from minishard.rules import ShardingError
from minishard.testing import assert_moe_equivalent, assert_placement, expert_parallels, moe_reference, moes

FEATURES, HIDDEN = 8, 16
KEY = jax.random.key(0)


def apply(moe, x):  # for Sharded: a plain function, traced anew under each one's rules
    return collect(MoEStats, moe)(x)


forward = jax.jit(apply)  # one function: jit's cache holds a program per shape (and its first trace)


def tokens(groups, length, seed=0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(groups, length, FEATURES)), jnp.float32)


def random_moe(n_experts=8, k=2, capacity_factor=1.0, seed=0):
    """A layer with random normal parameters (no near ties), each ``1 / sqrt(fan-in)``."""
    build = lambda: MoE(n_experts, k, capacity_factor, features=FEATURES, hidden=HIDDEN, key=KEY)  # noqa: E731
    return random_moe_like(jax.eval_shape(build), seed)


def random_moe_like(shapes, seed=0):
    """``shapes`` (``jax.eval_shape``'s) filled: each matrix ``1 / sqrt(fan-in)``, a vector 1."""
    rng = np.random.default_rng(seed)  # numpy, not jax.random: nothing to compile per shape
    fan_in = lambda a: a.shape[-2] if a.ndim > 1 else 1  # noqa: E731
    return jax.tree.map(lambda a: np.float32(rng.standard_normal(a.shape) / math.sqrt(fan_in(a))), shapes)


# -- 1. routing ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("tokens", "n_experts", "k", "factor", "slots"),
    [
        (64, 8, 2, 1.25, 20),  # 16 routings each if even, 25% slack
        (64, 8, 2, 1.0, 16),
        (64, 8, 2, 4.0, 64),  # n_experts / k: a slot for every token
        (3, 8, 1, 1.0, 1),  # ceil(0.375)
        (10, 1, 1, 1.1, 11),  # not 12: 1.1 * 10 is 11.000000000000002 in floats
    ],
)
def test_capacity_is_the_formula(tokens, n_experts, k, factor, slots):
    assert capacity(tokens, n_experts, k, factor) == slots


both_top_k = jax.jit(lambda probs, k: (top_k(probs, k), jax.lax.top_k(probs, k)), static_argnums=1)


@settings(max_examples=8)
@given(st.sampled_from([(2, 1), (2, 2), (8, 1), (8, 2), (8, 5)]), st.integers(0, 2**32 - 1))
def test_top_k_is_lax_top_k(sizes, seed):
    n_experts, k = sizes
    logits = np.random.default_rng(seed).normal(size=(3, 5, n_experts)).astype(np.float32)
    mine, lax = both_top_k(jax.nn.softmax(logits), k)
    for got, want in zip(mine, lax, strict=True):
        np.testing.assert_array_equal(got, want)


@settings(max_examples=8)
@given(moes(), st.sampled_from([1, 2]), st.sampled_from([4, 8]), st.integers(0, 3))
def test_the_layer_is_the_loop_over_tokens(moe, groups, length, seed):
    x = tokens(groups, length, seed)
    y, stats = forward(moe, x)
    want, dropped = moe_reference(moe, x)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    assert (int(stats.dropped), int(stats.routed)) == (dropped, moe.k * groups * length)


@settings(max_examples=6)
@given(moes(capacity_factors=(None,)), st.integers(0, 3))
def test_with_a_slot_for_every_token_nothing_is_dropped(moe, seed):
    x = tokens(2, 8, seed)
    y, stats = forward(moe, x)
    assert int(stats.dropped) == 0
    np.testing.assert_allclose(y, moe_reference(moe, x)[0], rtol=1e-5, atol=1e-5)


def test_a_token_past_every_slot_keeps_only_its_residual():
    moe = random_moe(n_experts=2, k=1, capacity_factor=1 / 3)  # capacity(6, 2, 1, 1/3) = 1 slot each
    y, stats = forward(moe, jnp.ones((1, 6, FEATURES)))  # six equal tokens, one expert: one slot
    assert int(stats.dropped) == 5
    assert np.all(np.asarray(y[0, 1:]) == 0) and np.any(np.asarray(y[0, 0]) != 0)


def test_no_token_sees_a_later_token_nor_another_group():
    moe, x = random_moe(capacity_factor=1.0), tokens(2, 8)
    changed = x.at[0, 5].set(3 * x[0, 5])  # may take or free slots: only for itself and later tokens
    y, y_changed = forward(moe, x)[0], forward(moe, changed)[0]
    np.testing.assert_array_equal(y[0, :5], y_changed[0, :5])
    np.testing.assert_array_equal(y[1], y_changed[1])


# -- the auxiliary losses, by hand --------------------------------------------------------------
PROBS = np.array([[0.8, 0.2], [0.6, 0.4], [0.3, 0.7], [0.9, 0.1]])  # 4 tokens, 2 experts
SHIFTS = np.array([1.0, 2.0, 0.0, -1.0])  # logits log(p) + shift: the same softmax, logsumexp = shift


def hand_moe(k, balance_weight=0.1, z_weight=0.01):
    """A router whose logits for token i (the one-hot input e_i) are ``log(PROBS[i]) + SHIFTS[i]``."""
    weights = {"balance_weight": balance_weight, "z_weight": z_weight}
    moe = random_moe_like(jax.eval_shape(lambda: MoE(2, k, 2.0, features=4, hidden=4, key=KEY, **weights)))
    return moe.replace(router=moe.router.replace(weight=np.float32(np.log(PROBS) + SHIFTS[:, None])))


def test_the_auxiliary_losses_are_switchs_and_st_moes():
    _, stats = forward(hand_moe(k=1), jnp.eye(4)[None])
    # top-1 picks experts 0, 0, 1, 0: f = (3/4, 1/4); mean probabilities P = (0.65, 0.35)
    assert float(stats.balance_loss) == pytest.approx(2 * (0.75 * 0.65 + 0.25 * 0.35))  # 1.15
    assert float(stats.z_loss) == pytest.approx(np.mean(SHIFTS**2))  # 1.5
    assert float(stats.aux_loss) == pytest.approx(0.1 * 1.15 + 0.01 * 1.5)
    _, stats = forward(hand_moe(k=2), jnp.eye(4)[None])  # both experts for every token: f = (1/2, 1/2)
    assert float(stats.balance_loss) == pytest.approx(1.0)


@jax.jit
def losses_of(probs):  # top-1
    return balance_loss(probs, top_k(probs, 1)[1]), z_loss(jnp.log(probs))


def test_a_router_that_cannot_choose_balances_and_one_that_always_chooses_one_expert_does_not():
    balance, z = losses_of(jnp.full((2, 6, 4), 0.25))
    assert (float(balance), float(z)) == pytest.approx((1.0, 0.0))  # P uniform: 1; logsumexp(log p) = 0
    balance, _ = losses_of(jax.nn.one_hot(jnp.zeros((2, 6), int), 4) * 0.97 + 0.01)  # always expert 0
    assert float(balance) == pytest.approx(4 * 0.98)  # f = (1, 0, 0, 0) and P_0 = 0.98: nearly n_experts
    assert float(jax.jit(z_loss)(jnp.zeros((2, 6, 4)))) == pytest.approx(math.log(4) ** 2)


# -- the stats, collected: collect and sow --------------------------------------------------------
def added(*stats):
    return functools.reduce(lambda a, b: jax.tree.map(jnp.add, a, b), stats)


def assert_same_stats(got, want):
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))


def test_collect_adds_up_every_moe_it_calls_in_call_order():
    first, second, x = random_moe(seed=1), random_moe(n_experts=4, k=1, seed=2), tokens(2, 8)
    y, stats = jax.jit(collect(MoEStats, lambda x: second(first(x))))(x)
    middle, first_stats = jax.jit(collect(MoEStats, first))(x)
    out, second_stats = jax.jit(collect(MoEStats, second))(middle)
    np.testing.assert_array_equal(y, out)
    assert_same_stats(stats, added(first_stats, second_stats))
    assert int(stats.routed) == 2 * 8 * (2 + 1)  # both layers' routings, k = 2 then 1
    assert jax.jit(collect(MoEStats, jnp.sin))(x)[1] is None  # no MoE ran


def test_an_inner_collection_keeps_its_stats_unless_they_are_handed_on():
    moe, x = random_moe(), tokens(2, 8)
    (_, one), (_, none), (_, handed_on) = (
        collect(MoEStats, moe)(x),
        collect(MoEStats, lambda x: collect(MoEStats, moe)(x)[0])(x),
        collect(MoEStats, lambda x: sow(collect(MoEStats, moe)(x)[1]))(x),
    )
    assert none is None
    assert_same_stats(handed_on, one)


def test_a_collection_closes_when_its_function_raises():
    moe, x = random_moe(), tokens(2, 8)

    def failing(x):
        moe(x)
        raise ZeroDivisionError

    def outer(x):
        with pytest.raises(ZeroDivisionError):
            collect(MoEStats, failing)(x)
        return moe(x)  # to outer's collection, not to the failed one's

    assert_same_stats(collect(MoEStats, outer)(x)[1], collect(MoEStats, moe)(x)[1])


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Calls:
    count: jax.Array


def test_a_collection_takes_only_its_own_type():
    moe, x = random_moe(), tokens(2, 8)

    def counted_moe(x):
        sow(Calls(jnp.array(1)))
        return moe(x)

    (_, calls), moe_stats = collect(MoEStats, collect(Calls, counted_moe))(x)
    assert int(calls.count) == 1  # the inner collection took the Calls
    assert_same_stats(moe_stats, collect(MoEStats, moe)(x)[1])  # and passed the MoEStats on out
    with pytest.raises(TypeError, match=r"^collect: kind must be a type .*, got 'MoEStats'$"):
        collect("MoEStats", moe)


def blocks_loss(blocks, x, remat):
    y, stats = collect(MoEStats, apply_blocks)(blocks, x, remat=remat)
    return jnp.sum(jnp.sin(y)) + stats.aux_loss, stats


@functools.cache
def moe_blocks():
    """Two pre-norm blocks, each MLP 4 experts: what ``apply_blocks`` wraps in ``jax.checkpoint``."""

    def build():
        keys = jax.random.split(KEY, 2)
        return tuple(Block(FEATURES, 2, HIDDEN, key=k, causal=True, mlp=moe_mlp(4, k=2)) for k in keys)

    return random_moe_like(jax.eval_shape(build))  # by numpy: no jax.random program per shape


def test_under_remat_the_gradients_and_the_stats_equal_the_plain_ones_and_no_tracer_leaks():
    blocks, x = moe_blocks(), tokens(2, 8)
    with jax.checking_leaks():  # a tracer kept inside jax.checkpoint's trace would be caught here
        runs = {
            remat: jax.jit(jax.value_and_grad(blocks_loss, has_aux=True), static_argnums=2)(blocks, x, remat)
            for remat in ("none", "full")
        }
    (plain_loss, plain_stats), plain_grads = runs["none"]
    (remat_loss, remat_stats), remat_grads = runs["full"]
    assert int(plain_stats.routed) == 2 * 2 * 8 * 2  # both blocks' routings: the stats left checkpoint
    assert_same_stats(remat_stats, plain_stats)
    np.testing.assert_allclose(remat_loss, plain_loss, rtol=1e-6)
    for (path, a), b in zip(ms.tree.named_leaves(remat_grads), jax.tree.leaves(plain_grads), strict=True):
        # float32 recomputed in another order: within 1e-6 of the leaf's largest element (an element
        # of 4e-3 beside 1.3 was 2.4e-7 off under jaxlib 0.10's XLA:CPU)
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * float(np.abs(b).max()), err_msg=path)
    assert float(jnp.abs(plain_grads[0].mlp.router.weight).sum()) > 0  # the aux loss reaches the router


def test_a_plain_moe_gpt_returns_its_logits_alone_and_keeps_nothing():
    sizes = dict(vocab=5, context=8, width=16, depth=2, heads=2)
    shapes = jax.eval_shape(lambda: GPT(**sizes, key=KEY, mlp=moe_mlp(4, k=2)))
    model = jax.tree.map(jnp.asarray, random_moe_like(shapes))  # by numpy: no program per shape
    ids = jnp.zeros((2, 8), jnp.int32)
    forward = jax.jit(lambda m, ids: m(ids))
    with jax.checking_leaks():  # a kept tracer outliving its trace would be caught here
        logits = [forward(model, ids) for _ in range(2)]  # traced once, then from jit's cache
    assert all(isinstance(out, jax.Array) and out.shape == (2, 8, 5) for out in logits)
    counted, stats = jax.jit(collect(MoEStats, model))(ids)
    np.testing.assert_array_equal(counted, logits[0])
    assert int(stats.routed) == 2 * 2 * 8 * 2  # the collection opened after still gets both blocks'


# -- 2. expert parallelism by annotation -----------------------------------------------------------
EP_RULES = ms.AxisRules.from_pairs(
    [("expert", "expert"), ("batch", "expert"), ("embed", None), ("mlp", None)]
)  # "expert" first: the slots [E, G, C, M] split by expert, activations by batch


def bare(moe, x):
    """``MoE.__call__`` without its two ``constrain``\\ s: what XLA's partitioner does by itself."""
    dispatch, combine, stats = moe.route(x)
    out = moe.experts(jnp.einsum("gsm,gsec->egcm", x, dispatch))
    return jnp.einsum("egcm,gsec->gsm", out, combine), stats


def test_the_rules_place_the_stacked_experts():
    mesh = ms.make_mesh({"expert": 8})
    placed = ms.shard(random_moe(), mesh, EP_RULES)
    blocks = {
        "experts.w_in": (1, FEATURES, HIDDEN),
        "experts.w_out": (1, HIDDEN, FEATURES),
        "router.weight": (8, 8),
    }
    assert_placement(placed, mesh, blocks)


def test_xla_gathers_the_experts_unless_the_slots_are_constrained():
    mesh, moe, x = ms.make_mesh({"expert": 8}), random_moe(), tokens(16, 8)
    weights = (moe.experts.w_in.size + moe.experts.w_out.size) * 4
    by_itself = ms.Sharded(mesh, EP_RULES)(bare)
    found = collectives(by_itself.lower(moe, x))
    assert "all-to-all" not in found and found["all-gather"].bytes == weights  # every expert, everywhere
    layer = ms.Sharded(mesh, EP_RULES)(apply)
    found = collectives(layer.lower(moe, x))
    slots = moe.n_experts * 2 * capacity(8, 8, 2, 1.0) * FEATURES * 4  # E x 2 groups x C x M, float32
    assert "all-gather" not in found and (found["all-to-all"].count, found["all-to-all"].bytes) == (
        2,
        2 * slots,
    )
    np.testing.assert_allclose(
        jax.block_until_ready(layer(moe, x))[0], forward(moe, x)[0], rtol=1e-5, atol=1e-6
    )


# -- 3. expert parallelism by hand ------------------------------------------------------------------
DP_EP = ExpertParallel(ms.make_mesh({"data": 2, "expert": 4}), data_axis="data")


def test_by_hand_equals_one_device_forward_and_gradients_drops_included():
    moe, x = random_moe(capacity_factor=1.0), tokens(8, 12)
    _, stats = assert_moe_equivalent(moe, x, DP_EP)
    assert int(stats.dropped) > 0  # the equality held where tokens were dropped, too


@pytest.mark.slow
@settings(max_examples=6)
@given(st.data())
def test_by_hand_equals_one_device_on_every_mesh_that_splits_the_experts(data):
    moe = data.draw(moes(n_experts=(4, 8)))
    assert_moe_equivalent(
        moe, tokens(8, 8, data.draw(st.integers(0, 3))), data.draw(expert_parallels(moe.n_experts, 8))
    )


def summed_with_aux_loss(moe, x):
    y, stats = apply(moe, x)
    return jnp.sum(y) + stats.aux_loss


@pytest.mark.parametrize(
    "parallel", [ExpertParallel(ms.make_mesh({"expert": 8})), DP_EP], ids=["ep", "dp+ep"]
)
def test_one_layer_sends_two_all_to_alls_forward_four_with_the_backward(parallel):
    moe, x = random_moe().replace(parallel=parallel), tokens(16, 8)
    devices = parallel.mesh.size
    slots = moe.n_experts * (16 // devices) * capacity(8, 8, 2, 1.0)  # E x G/D x C on one device
    found = collectives(forward.lower(moe, x))["all-to-all"]
    assert (found.count, found.bytes, found.mesh_axes) == (2, 2 * slots * FEATURES * 4, (("expert",),))
    # with respect to x too, as in a model whose earlier layers learn: else the fourth is dead code
    grad = jax.jit(jax.grad(summed_with_aux_loss, argnums=(0, 1)))
    found = collectives(grad.lower(moe, x))["all-to-all"]
    assert (found.count, found.bytes) == (4, 4 * slots * FEATURES * 4)


def test_with_data_parallelism_each_experts_gradient_is_summed_over_data_only():
    moe, x = random_moe().replace(parallel=DP_EP), tokens(16, 8)
    grad = jax.jit(jax.grad(lambda m, x: jnp.sum(m(x)[0])))
    sent = bytes_by_mesh_axes(grad.lower(moe, x))
    local_experts = (moe.experts.w_in.size + moe.experts.w_out.size) // 4  # 2 of the 8 on each device
    assert sent["all-reduce", ("data",)] == local_experts * 4  # float32


# -- the testing tools catch what they are for ----------------------------------------------------
class PerLocalBatch(MoE):
    """A classic slip: a weight that counts the groups this device sees, not the batch's."""

    def route(self, x):
        dispatch, combine, stats = super().route(x)
        return dispatch, combine * (8 / x.shape[0]), stats


def test_assert_moe_equivalent_refuses_a_negative_tolerance():
    with pytest.raises(ValueError) as error:
        assert_moe_equivalent(random_moe(), tokens(4, 8), DP_EP, atol=-1.0)
    assert str(error.value) == "assert_moe_equivalent: atol must be a finite number >= 0, got -1.0"


def test_assert_moe_equivalent_names_what_the_hand_written_run_gets_wrong():
    moe, x = random_moe(), tokens(8, 8)
    slip = PerLocalBatch.tree_unflatten(moe.tree_flatten()[1], moe.tree_flatten()[0])
    with pytest.raises(
        AssertionError, match=r"output: by hand over \{'data': 2, 'expert': 4\} != one device"
    ):
        assert_moe_equivalent(slip, x, DP_EP, reference=False)


def test_assert_moe_equivalent_refuses_an_expert_axis_that_splits_nothing():
    one = ExpertParallel(ms.make_mesh({"expert": 1}, devices=jax.devices()[:1]))
    assert_named(
        lambda: assert_moe_equivalent(random_moe(), tokens(8, 8), one), ValueError, ["size 1 splits nothing"]
    )


# -- 4. bad input ----------------------------------------------------------------------------------
EXPERT4 = ms.make_mesh({"expert": 4}, devices=jax.devices()[:4])
BAD_INPUTS = [
    (lambda: MoE(3, k=4, features=8, hidden=8, key=KEY), ValueError, ["k=4", "n_experts=3", "from 1 to 3"]),
    (lambda: MoE(3, k=0, features=8, hidden=8, key=KEY), ValueError, ["k=0", "from 1 to 3"]),
    (
        lambda: MoE(0, k=1, features=8, hidden=8, key=KEY),
        ValueError,
        ["n_experts must be a positive int", "0"],
    ),
    (
        lambda: MoE(4, 2, 0, features=8, hidden=8, key=KEY),
        ValueError,
        ["capacity_factor=0", "> 0", "never drops"],
    ),
    (lambda: MoE(4, 2, -1.0, features=8, hidden=8, key=KEY), ValueError, ["capacity_factor=-1.0", "> 0"]),
    (lambda: MoE(4, 2, float("nan"), features=8, hidden=8, key=KEY), ValueError, ["capacity_factor=nan"]),
    (lambda: MoE(4, features=8, hidden=8, key=KEY, z_weight=-1), ValueError, ["z_weight=-1", ">= 0"]),
    (lambda: Experts(4, 8, 0, key=KEY), ValueError, ["Experts: hidden must be a positive int", "0"]),
    (lambda: capacity(16, 0, 1, 1.25), ValueError, ["capacity: n_experts must be a positive int, got 0"]),
    (lambda: capacity(16, 4, 1, 0.0), ValueError, ["capacity: capacity_factor must be a finite number > 0"]),
    (
        lambda: Experts(4, 8, 8, key=KEY, activation="gelu"),
        ValueError,
        ["unknown activation 'gelu'", "swish"],
    ),
    (lambda: random_moe()(jnp.ones((2, 5, 7))), ValueError, ["shape (2, 5, 7)", "[..., tokens, 8]"]),
    (lambda: random_moe()(jnp.ones(8)), ValueError, ["shape (8,)", "[..., tokens, 8]"]),
    (lambda: random_moe()([[1.0] * 8]), TypeError, ["MoE takes an array", "list"]),
    (
        lambda: ExpertParallel(EXPERT4, expert_axis="experts"),
        ValueError,
        ["expert_axis='experts'", "not an axis"],
    ),
    (
        lambda: ExpertParallel(EXPERT4, data_axis="expert"),
        ValueError,
        ["data_axis='expert'", "a mesh axis of their own"],
    ),
    (
        lambda: ExpertParallel(ms.make_mesh({"model": 2, "expert": 4})),
        ValueError,
        ["{'model': 2}", "data parallelism only", "rules and Sharded"],
    ),
    (
        lambda: all_to_all_moe(random_moe(n_experts=6), tokens(4, 8), ExpertParallel(EXPERT4)),
        ValueError,
        ["6 experts do not split over mesh axis 'expert' of 4 devices", "multiple of 4"],
    ),
    (
        lambda: all_to_all_moe(random_moe(), tokens(6, 8), ExpertParallel(EXPERT4)),
        ValueError,
        ["6 groups", "'expert'=4", "divide by 4"],
    ),
    (
        lambda: ms.Sharded(EXPERT4, EP_RULES)(apply).lower(random_moe(n_experts=6), tokens(4, 8)),
        ShardingError,
        ["experts.w_in", "logical axis 'expert'", "size 6", "'expert'=4"],
    ),
]


@pytest.mark.parametrize(("call", "kind", "words"), BAD_INPUTS)
def test_bad_input_is_named_before_any_compile(call, kind, words):
    assert_named(call, kind, words)


def test_the_expert_report_names_a_lone_expert_and_ranges_of_more():
    homes = (((0, 1), (0,)), ((1, 3), (1, 5)))
    report = ExpertReport(homes, (3, 2, 2, 4), 4, 1, {}, 0, 8)
    assert str(report).splitlines()[1:3] == ["  expert 0: devices 0", "  experts 1-2: devices 1, 5"]
