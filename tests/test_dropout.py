"""Dropout in the GPT (``minishard.models.dropout``): nanoGPT's places, keys a learner can follow
(step, then layer, then place), none at evaluation or in decoding, the same masks in every layout.

Tiny sizes, as tests/test_gpt.py's: 2 blocks, 32 features, 8 heads, a context of 16, 8 windows.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import minishard as ms
from minishard import census, context
from minishard.models import gpt
from minishard.models.attention import Attention
from minishard.models.dropout import EMBEDDINGS, PLACES, dropout, keeps, key_at
from minishard.optim import AdamW
from minishard.pipeline import stack_blocks, unstack_blocks
from minishard.precision import LossScaled
from minishard.run.next_token import next_token_loss, next_token_sums
from minishard.run.steps import make_train_step, step_key
from minishard.styles import mesh_rules

SMALL = dict(vocab=11, context=16, width=32, depth=2, heads=8, mlp_ratio=4)
RATE = 0.2  # nanoGPT's shakespeare-char recipe's
KEY = jax.random.key(7)


@functools.cache
def small_gpt(rate=RATE, **changes):
    """The small GPT of ``rate``, its parameters filled by numpy (no random program per shape)."""
    shapes = jax.eval_shape(lambda: gpt.GPT(**{**SMALL, **changes}, dropout=rate, key=jax.random.key(0)))
    rng = np.random.default_rng(0)
    return jax.tree.map(lambda leaf: jnp.asarray(0.3 * rng.standard_normal(leaf.shape), leaf.dtype), shapes)


def small_batch(seed=0, batch=8):
    ids = np.random.default_rng(seed).integers(0, SMALL["vocab"], (batch, SMALL["context"] + 1))
    return {"inputs": ids[:, :-1].astype(np.int32), "targets": ids[:, 1:].astype(np.int32)}


# --- the mask ------------------------------------------------------------------------------------


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
def test_dropout_zeroes_about_p_of_the_entries_and_scales_the_rest_by_one_over_one_minus_p(rate):
    n = 200_000
    x = jnp.linspace(1.0, 2.0, n)
    dropped = dropout(x, rate, KEY)
    zeroed = dropped == 0
    bound = 5 * np.sqrt(rate * (1 - rate) / n)  # five standard deviations of the binomial's share
    assert abs(float(zeroed.mean()) - rate) < bound
    np.testing.assert_allclose(dropped[~zeroed], x[~zeroed] / (1 - rate), rtol=1e-6)
    assert abs(float(dropped.mean()) - float(x.mean())) < 5 * float(x.mean()) * np.sqrt(rate / (1 - rate) / n)


def test_the_same_key_draws_the_same_mask_and_each_step_layer_and_place_its_own():
    x = jnp.ones((4, 16, 32))

    def mask(key):
        return np.asarray(dropout(x, RATE, key) == 0)

    state = AdamW(1e-3).init({"w": jnp.zeros(3)})
    assert (mask(step_key(0, state)) == mask(jax.random.fold_in(jax.random.key(0), 0))).all()
    later = state._replace(step=state.step + 5)  # the step read from the optimizer's state
    assert (mask(step_key(0, later)) == mask(jax.random.fold_in(jax.random.key(0), 5))).all()
    scaled = LossScaled(AdamW(1e-3)).init({"w": jnp.zeros(3)})._replace(inner=later)  # fp16: the inner step
    assert (mask(step_key(0, scaled)) == mask(step_key(0, later))).all()
    assert (mask(KEY) == mask(KEY)).all()
    others = [step_key(0, later), step_key(1, later), key_at(KEY, 1, 0), key_at(KEY, 2, 0), key_at(KEY, 1, 1)]
    masks = [mask(KEY), *map(mask, others)]  # another step, seed, layer or place: another mask
    assert all((a != b).any() for i, a in enumerate(masks) for b in masks[i + 1 :])


# --- where the GPT drops, and with which keys ---------------------------------------------------


def test_the_gpt_drops_where_nanogpt_does_with_the_keys_it_documents():
    model, ids = small_gpt(), small_batch()["inputs"]
    x = dropout(model.embedding(ids), RATE, key_at(KEY, EMBEDDINGS))
    for layer, block in enumerate(model.blocks, start=1):
        x = block(x, dropout=RATE, key=key_at(KEY, layer))
    np.testing.assert_array_equal(model(ids, key=KEY), model.head(model.norm(x)))

    block, key = model.blocks[1], key_at(KEY, 2)
    x = jax.random.normal(jax.random.key(1), (8, 16, 32))
    positions = jnp.arange(16)
    q, k, v = block.attention.project(block.norm1(x))
    weights = jax.nn.softmax(context.scores(q, k, positions, positions, causal=True), axis=-1)
    weights = dropout(weights, RATE, key_at(key, PLACES["attention weights"]))  # [B, heads, T, T]
    attended = block.attention.combine(jnp.einsum("bhqk,bkhd->bqhd", weights, v))
    x1 = x + dropout(attended, RATE, key_at(key, PLACES["attention out"]))
    x2 = x1 + dropout(block.mlp(block.norm2(x1)), RATE, key_at(key, PLACES["mlp out"]))
    np.testing.assert_allclose(block(x, dropout=RATE, key=key), x2, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("remat", ["none", "full"])
def test_a_scanned_gpt_draws_the_looped_gpts_masks_and_recomputes_them_so(remat):
    looped = small_gpt().replace(remat=remat)
    scanned = looped.replace(blocks=stack_blocks(looped.blocks))  # GPT(scan=True)'s form
    batch = small_batch()
    loss_and_grads = jax.jit(jax.value_and_grad(lambda m: next_token_loss(m, batch, KEY)[0]))
    (want, want_grads), (got, got_grads) = loss_and_grads(looped), loss_and_grads(scanned)
    np.testing.assert_allclose(got, want, rtol=1e-6)  # another layer's masks: 1e-2 away
    program = str(jax.make_jaxpr(lambda m: m(batch["inputs"], key=KEY))(scanned))
    assert ("scan[" in program) and ("remat" in program) == (remat != "none")  # the body checkpointed
    unstacked = got_grads.replace(blocks=tuple(unstack_blocks(got_grads.blocks)))
    for a, b in zip(jax.tree.leaves(unstacked), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_dropout_zero_is_the_old_model_not_one_random_op_in_its_program():
    off, batch = small_gpt(0.0), small_batch()
    keyed = jax.make_jaxpr(lambda m, b, key: next_token_loss(m, b, key))(off, batch, KEY)
    plain = jax.make_jaxpr(lambda m, b, key: next_token_loss(m, b))(off, batch, KEY)
    assert [str(e) for e in keyed.eqns] == [str(e) for e in plain.eqns]  # the very same operations
    on = jax.make_jaxpr(lambda m, b, key: next_token_loss(m, b, key))(small_gpt(), batch, KEY)
    drawn = [e for e in on.eqns if "random" in str(e.primitive) or "threefry" in str(e.primitive)]
    assert drawn and not [e for e in keyed.eqns if "random" in str(e.primitive)]


def test_evaluation_and_decoding_drop_nothing():
    model, off, batch = small_gpt(), small_gpt(0.0), small_batch()
    windows = {**batch, "mask": np.ones(8, np.float32)}  # an evaluation's batch: which rows are real
    summed = [jax.tree.map(float, next_token_sums(each, windows)) for each in (model, off)]
    assert summed[0] == summed[1]
    assert float(next_token_loss(model, batch)[0]) == float(next_token_loss(off, batch)[0])
    assert float(next_token_loss(model, batch, KEY)[0]) != float(next_token_loss(off, batch, KEY)[0])
    prompt = np.array([1, 2, 3])
    np.testing.assert_array_equal(
        gpt.generate(model, prompt, 6, seed=2), gpt.generate(off, prompt, 6, seed=2)
    )


@pytest.mark.slow  # two gradients compile
def test_recomputed_under_remat_a_block_draws_the_same_masks():
    batch = small_batch()

    @jax.jit  # one program each, not op by op (jax.checkpoint's barriers keep the recomputation)
    def loss_and_grads(model):
        return jax.value_and_grad(lambda m: next_token_loss(m, batch, KEY)[0])(model)

    kept, recomputed = loss_and_grads(small_gpt()), loss_and_grads(small_gpt(remat="full"))
    for a, b in zip(jax.tree.leaves(kept), jax.tree.leaves(recomputed), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


DROPOUT_REFUSED = [
    (lambda: gpt.GPT(**SMALL, dropout=1.0, key=KEY), "GPT: dropout must be a rate in [0, 1), got 1.0"),
    (lambda: gpt.GPT(**SMALL, dropout=-0.1, key=KEY), "GPT: dropout must be a rate in [0, 1), got -0.1"),
    (
        lambda: gpt.as_stacked(small_gpt()),
        "as_stacked: a pipeline draws no dropout masks; give a GPT of dropout 0, not 0.2",
    ),
    (
        lambda: Attention(8, 2, key=KEY, causal=True, core="ring")(
            jnp.ones((1, 4, 8)), dropout=RATE, key=KEY
        ),
        "Attention: core 'ring' cannot drop attention weights; use 'dense'",
    ),
    (
        lambda: make_train_step(AdamW(1e-3), next_token_loss, microbatches=2, seed=0),
        "make_train_step: a seed (dropout) draws one mask per batch; give microbatches=1",
    ),
]


@pytest.mark.parametrize(("make", "message"), DROPOUT_REFUSED)
def test_what_cannot_drop_as_nanogpt_does_is_refused_in_one_line(make, message):
    with pytest.raises(ValueError) as error:
        make()
    assert str(error.value) == message


# --- every layout: the same masks, the same losses ------------------------------------------------

OPTIMIZER = AdamW(1e-2, eps=1e-6)  # tests/test_gpt.py's: eps 1e-6 keeps a first step's rounding small
STEPS = 3


@functools.cache
def trained(style, rate=RATE, scan=False, depth=1):
    """``STEPS`` AdamW steps of the small GPT of ``depth`` blocks with dropout ``rate`` under ``style``
    (``scan``: its blocks stacked and scanned): its losses, and the collectives of its compiled step
    (kind -> count, bytes)."""
    shape, rules = mesh_rules(style, 8)
    mesh = ms.make_mesh(shape)
    step = ms.Sharded(mesh, rules)(make_train_step(OPTIMIZER, next_token_loss, seed=3))
    built = small_gpt(rate, depth=depth)
    model = ms.shard(built.replace(blocks=stack_blocks(built.blocks)) if scan else built, mesh, rules)
    state = ms.shard(OPTIMIZER.init(model), mesh, rules)
    sent = census.collectives(step.lower(model, state, small_batch()))
    losses = []
    for seed in range(STEPS):  # wait for each step: simulated devices share two cores
        model, state, loss, _ = jax.block_until_ready(step(model, state, small_batch(seed)))
        losses.append(float(loss))
    return losses, {kind: (c.count, c.bytes) for kind, c in sent.items()}


@pytest.mark.slow  # each style compiles its own AdamW step on 8 devices
@pytest.mark.parametrize(
    ("style", "scan"), [("fsdp", False), ("tp", False), ("tp+sp", False), ("dp", True), ("fsdp", True)]
)
def test_every_layout_draws_the_same_masks_and_trains_to_dp_s_losses(style, scan):
    # 1 block holds every array a layout splits and draws each place's mask (XLA's compile is most of
    # each case). That each block of a scan draws its own key's masks, as the looped blocks draw them:
    # test_a_scanned_gpt_draws_the_looped_gpts_masks_and_recomputes_them_so (2 blocks).
    depth = 1
    expected, _ = trained("dp", depth=depth)
    losses, sent = trained(style, scan=scan, depth=depth)
    np.testing.assert_allclose(losses, expected, rtol=1e-5, atol=1e-5)
    undropped, _ = trained("dp", 0.0, depth=depth)
    assert min(abs(a - b) for a, b in zip(expected, undropped)) > 1e-3  # and dropout drew
    # Each device draws its own shard of the global mask (jax_threefry_partitionable): dropout sends
    # nothing. Unpartitionable, fsdp's masks cost 14 more all-gathers and 28 collective-permutes.
    assert sent == trained(style, 0.0, scan, depth)[1]


@pytest.mark.parametrize("rate", [0.1, 0.2, 0.5])
def test_each_half_of_a_draw_drops_at_the_rate_and_neighbours_drop_independently(rate):
    """``keeps`` reads two entries from each 32-bit draw: each drops at ``rate`` (within 4 standard
    errors over 2**20 entries), and a pair from one draw drops together at ``rate ** 2``."""
    mask = np.asarray(keeps(jax.random.key(3), rate, (1024, 1025)))  # an odd row: the last half unused
    dropped = ~mask
    n = dropped.size
    assert abs(dropped.mean() - rate) < 4 * (rate * (1 - rate) / n) ** 0.5
    pairs = dropped[:, 0:1024:2] & dropped[:, 1:1024:2]  # the high and low halves of one draw
    assert abs(pairs.mean() - rate**2) < 4 * (rate**2 * (1 - rate**2) / pairs.size) ** 0.5
    assert abs(dropped[:, 0::2].mean() - dropped[:, 1::2].mean()) < 8 * (rate * (1 - rate) / n) ** 0.5
