"""The GPT of ``minishard.models.gpt``: causal by positions, the same loss under every style, and
decoding with a KV cache that equals recomputing the whole context.

Tiny sizes throughout (2 blocks, 32 features, a context of 16): 8 heads of 4 and
128 hidden units split evenly over "model" = 8, a batch of 8 windows over "data" = 8.
Models are built from shapes and filled by numpy, as tests/test_vit.py does.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from strategies import assert_trees_equal

import minishard as ms
from minishard import context as cx
from minishard.composition import ComposedPipeline
from minishard.constraints import LogicalSharding
from minishard.experts import MoEStats
from minishard.layers import collect
from minishard.models import gpt
from minishard.models.attention import ATTENTION_CORES, Attention, KVCache
from minishard.models.transformer import moe_mlp
from minishard.optim import AdamW, weight_decay_mask
from minishard.pipeline import stack_blocks
from minishard.run.cli.sample import sample
from minishard.run.next_token import in_chunk_order, next_token_loss
from minishard.run.steps import make_train_step
from minishard.run.text_data import Vocabulary
from minishard.serving import Decoder
from minishard.styles import LOGICAL_AXES, mesh_rules
from minishard.zero import flat_padded, zero_train_step

SMALL = dict(vocab=11, context=16, width=32, depth=2, heads=8, mlp_ratio=4)
BATCH = 8


def numpy_filled(tree, seed, scale=0.3):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda leaf: (scale * rng.standard_normal(leaf.shape)).astype(leaf.dtype), tree)


@functools.cache
def small_gpt(seed=0, **changes):
    sizes = {**SMALL, **changes}
    return numpy_filled(jax.eval_shape(lambda: gpt.GPT(**sizes, key=jax.random.key(0))), seed)


def small_batch(seed=0, batch=BATCH):
    ids = np.random.default_rng(seed).integers(0, SMALL["vocab"], (batch, SMALL["context"] + 1))
    return {"inputs": ids[:, :-1].astype(np.int32), "targets": ids[:, 1:].astype(np.int32)}


def forward(model, ids, positions=None):  # module level: jit caches compiled code per function
    return model(ids, positions)


# --- the model ---------------------------------------------------------------------------------


def test_the_gpt_maps_ids_to_next_character_logits_and_names_every_axis():
    model, batch = small_gpt(), small_batch()
    assert jax.jit(forward)(model, batch["inputs"]).shape == (BATCH, SMALL["context"], SMALL["vocab"])
    leaves = ms.plan(model, None, mesh_rules("tp", 8)[1]).leaves
    assert len(leaves) == 2 + SMALL["depth"] * 12 + 4  # tables; per block 2 norms, q k v out, MLP; norm, head
    for leaf in leaves:
        assert leaf.logical_axes and all(axis in LOGICAL_AXES for axis in leaf.logical_axes), leaf.path
    axes = {leaf.path: leaf.logical_axes for leaf in leaves}
    assert axes["embedding.tokens"] == ("vocab", "embed") and axes["head.weight"] == ("embed", "vocab")


def reference_causal_attention(q, k, v):
    """Head by head, a lower-triangular mask over the index, float64."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    out = np.zeros_like(q)
    tril = np.tril(np.ones((q.shape[1], k.shape[1]), bool))
    for h in range(q.shape[2]):
        logits = q[:, :, h] @ k[:, :, h].transpose(0, 2, 1) / np.sqrt(q.shape[-1])
        logits = np.where(tril, logits, -np.inf)
        weights = np.exp(logits - logits.max(-1, keepdims=True))
        out[:, :, h] = (weights / weights.sum(-1, keepdims=True)) @ v[:, :, h]
    return out


def test_the_attention_core_matches_a_masked_reference_and_is_causal_by_positions():
    q, k, v = np.random.default_rng(0).standard_normal((3, 2, 6, 3, 4)).astype(np.float32)
    positions = jnp.arange(6)
    dense = jax.jit(functools.partial(ATTENTION_CORES["dense"], causal=True))  # one program, not op by op
    got = dense(q, k, v, positions, positions)
    np.testing.assert_allclose(got, reference_causal_attention(q, k, v), rtol=1e-5, atol=1e-6)
    # Tokens dealt out of order (as zig-zag context parallelism does) carry their positions with them:
    order = np.array([0, 5, 1, 4, 2, 3])
    shuffled = dense(q[:, order], k[:, order], v[:, order], order, order)
    np.testing.assert_allclose(shuffled, got[:, order], rtol=1e-5, atol=1e-6)


def test_under_dp_and_dp_cp_every_chunk_of_attention_is_the_textbooks_attend(monkeypatch):
    # One softmax attention: the dense core is grouped_attention's, each ring step's pair context.attend
    # (the ring's default PairCore, DENSE_PAIRS).
    calls = []
    counted = lambda *a, **kw: calls.append(a[0].shape) or ATTEND(*a, **kw)  # noqa: E731
    monkeypatch.setattr(cx, "attend", counted)
    monkeypatch.setattr(cx, "DENSE_PAIRS", cx.PairCore(counted, cx.attend_grads))
    for style, core, chunk in (("dp", "dense", (8, 16, 8, 4)), ("dp+cp", "ring", (4, 2, 8, 4))):
        shape, rules = mesh_rules(style, 8)
        calls.clear()
        ms.Sharded(ms.make_mesh(shape), rules)(forward).lower(small_gpt(core=core), small_batch()["inputs"])
        # dp: one call per block on the whole batch (as traced); dp+cp: per block, a device's pairs of 2 x 2
        # zig-zag chunks at each of the 4 ring steps traced (a lax.scan traces its step once, and the last)
        assert set(calls) == {chunk} and len(calls) % SMALL["depth"] == 0, (style, calls)


ATTEND = cx.attend


def test_the_gpt_never_looks_ahead_and_reads_positions_not_the_index():
    model, ids = small_gpt(), small_batch()["inputs"]
    logits = jax.jit(forward)(model, ids)
    changed = ids.copy()
    changed[:, 9] = (changed[:, 9] + 1) % SMALL["vocab"]  # a different character at position 9
    after = jax.jit(forward)(model, changed)
    np.testing.assert_allclose(after[:, :9], logits[:, :9], rtol=1e-5, atol=1e-6)  # nothing before it moves
    assert not np.allclose(after[:, 9:], logits[:, 9:])
    order = np.random.default_rng(1).permutation(SMALL["context"])
    permuted = jax.jit(forward)(model, ids[:, order], jnp.asarray(order))
    np.testing.assert_allclose(permuted, logits[:, order], rtol=1e-4, atol=1e-5)


def apply(model, ids):  # a StackedModel takes the ids alone
    return model(ids)


def test_the_stacked_gpt_is_the_same_function_of_the_same_parameters():
    model = small_gpt()
    stacked = gpt.as_stacked(model)
    assert stacked.blocks.n == 2 and stacked.blocks.block.attention.query.shape == (2, 32, 8, 4)
    shapes = jax.eval_shape(lambda: gpt.stacked_gpt(**SMALL, key=jax.random.key(3)))
    assert jax.tree.structure(stacked) == jax.tree.structure(shapes)
    ids = small_batch()["inputs"]
    expected = jax.jit(forward)(model, ids)
    np.testing.assert_allclose(jax.jit(apply)(stacked, ids), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # jax.random compiles a program per parameter shape: seconds per model on a CPU
def test_one_key_gives_every_block_its_own_randomness_and_stacked_gpt_the_same_numbers():
    model = gpt.GPT(**SMALL, key=jax.random.key(3))
    first, second = (block.attention.query for block in model.blocks)
    assert not np.allclose(first, second)
    assert not np.allclose(model.blocks[0].attention.query, model.blocks[0].attention.key)
    stacked = gpt.stacked_gpt(**SMALL, key=jax.random.key(3))
    for a, b in zip(jax.tree.leaves(stacked), jax.tree.leaves(gpt.as_stacked(model)), strict=True):
        np.testing.assert_array_equal(a, b)


def test_the_gpt_refuses_bad_input_before_any_work():
    with pytest.raises(ValueError, match=r"T <= context 16\), got int32\[2, 17\]"):
        small_gpt()(jnp.zeros((2, 17), jnp.int32))
    with pytest.raises(ValueError, match=r"character ids \[B, T\]"):
        small_gpt()(jnp.zeros((2, 16)))  # floats, not ids
    with pytest.raises(
        ValueError,
        match="unknown core 'sparse'; choose from dense, ring, flash, flash-interpreted, ring-flash, ",
    ):
        Attention(8, 2, key=jax.random.key(0), core="sparse")
    with pytest.raises(ValueError, match="temperature must be a finite number > 0, got 0"):
        gpt.generate(small_gpt(), np.array([1]), 3, temperature=0)
    with pytest.raises(ValueError, match=r"tokens must be an int >= 0, got 2\.5"):
        gpt.generate(small_gpt(), np.array([1]), 2.5)
    with pytest.raises(ValueError, match="the prompt is empty"):
        gpt.generate(small_gpt(), np.array([], np.int32), 3)


def test_a_gpt_of_no_size_is_refused_naming_the_argument():
    for name in ("context", "vocab", "heads"):
        with pytest.raises(ValueError) as error:
            gpt.GPT(**(SMALL | {name: 0}), key=jax.random.key(0))
        assert str(error.value) == f"GPT: {name} must be a positive int, got 0"


GENERATE_REFUSES = [
    ({"temperature": float("inf")}, "generate: temperature must be a finite number > 0, got inf"),
    ({"prompt": [1, 40]}, "generate: prompt id 40 (at 1) is outside the vocabulary of 11: ids run from 0 to"),
    ({"prompt": [-1]}, "generate: prompt id -1 (at 0) is outside the vocabulary of 11"),
    ({"prompt": [[1, 2]]}, r"generate: the prompt must be a list of ids [P], got int64[1, 2]"),
    ({"prompt": [1.5]}, r"generate: the prompt must be a list of ids [P], got float64[1]"),
]


@pytest.mark.parametrize(("change", "message"), GENERATE_REFUSES)
def test_generate_refuses_what_would_sample_silently_wrong(change, message):
    arguments = {"prompt": [1], "tokens": 2} | change
    with pytest.raises(ValueError) as error:
        gpt.generate(small_gpt(), np.asarray(arguments.pop("prompt")), **arguments)
    assert str(error.value).startswith(message)


def test_generate_takes_a_numpy_count_of_tokens():
    assert gpt.generate(small_gpt(), np.array([1, 2]), np.int64(3)).shape == (5,)


def test_only_matrices_decay_whether_blocks_are_a_tuple_a_stack_or_zero_shards():
    model = small_gpt()

    def decayed(tree):
        return sorted(path for path, leaf in ms.tree.named_leaves(weight_decay_mask(tree)) if leaf)

    expected = ["embedding.position_table", "embedding.tokens", "head.weight"]
    block = ["attention.key", "attention.out", "attention.query", "attention.value"]
    block += ["mlp.layers[0].weight", "mlp.layers[2].weight"]
    assert decayed(model) == sorted(expected + [f"blocks[{i}].{name}" for i in (0, 1) for name in block])
    stacked = gpt.as_stacked(model)  # every leaf gains a "stage" dimension: ranks would lie
    assert decayed(stacked) == sorted(["before.position_table", "before.tokens", "after.layers[1].weight"]
                                      + [f"blocks.block.{name}" for name in block])  # fmt: skip
    flat = jax.tree.map(lambda leaf: flat_padded(leaf, 8), model)  # ZeRO's blocks: every leaf 1-D
    assert decayed(flat) == decayed(model)


# --- every style: the same losses, each array where its style says ----------------------------

# eps 1e-6, not nanoGPT's 1e-8: a first step is lr * g / (|g| + eps), which magnifies the float
# rounding of a gradient near eps (one weight moved by 0.8% of a step on another CPU's vector width).
OPTIMIZER = AdamW(1e-2, eps=1e-6)
STEP = make_train_step(OPTIMIZER, next_token_loss)
SGD_STEP = make_train_step(ms.SGD(0.1), next_token_loss)
STEPS = 3
LAYOUTS = {  # style -> (a parameter, its spec): what the style is for
    "dp": ("blocks[0].attention.query", P()),
    "tp": ("blocks[0].attention.query", P(None, "model", None)),
    "2d": ("blocks[0].mlp.layers[0].weight", P(None, "model")),
    "fsdp": ("embedding.tokens", P(None, "data")),
    "fsdp+tp": ("blocks[0].attention.out", P("model", None, "data")),
    "pp": ("blocks.block.attention.query", P("stage", None, None, None)),
    "dp+pp": ("blocks.block.mlp.layers[0].weight", P("stage", None, None)),
    "cp": ("embedding.position_table", P("context", None)),  # the one parameter that names "seq"
    "dp+cp": ("embedding.position_table", P("context", None)),
    "tp+sp": ("embedding.position_table", P("model", None)),
}
CORE = {"cp": "ring", "dp+cp": "ring"}  # the sequence split: ring attention; every other style: dense


# A block per stage (pp on 4 devices); every other style: 1 block, which holds every array a style
# splits (XLA's compile is most of each case; test_compose.py's depth() says the same). Many blocks in
# one step: pp's 4 here, and test_one_megatron_step_equals_one_data_parallel_step_leaf_by_leaf's 2.
DEPTH = {"pp": 4, "dp+pp": 4}


@functools.cache
def trained(style, depth=1):
    """``STEPS`` AdamW steps of the small GPT under ``style``: its losses, model and optimizer state."""
    model = gpt.GPT(**{**SMALL, "depth": depth}, core=CORE.get(style, "dense"), key=jax.random.key(0))
    if style.startswith("zero"):  # "zero-2" (parameters whole between steps) or "zero" (ZeRO-3)
        level = 2 if style == "zero-2" else 3
        step = zero_train_step(OPTIMIZER, ms.make_mesh({"data": 8}), level=level, loss=next_token_loss)
        model = step.shard(model)
        state = step.init(model)
    else:
        devices = jax.devices()[: 4 if style == "pp" else 8]
        shape, rules = mesh_rules(style, len(devices))
        mesh = ms.make_mesh(shape, devices=devices)
        if style in DEPTH:  # the same GPT, its blocks stacked and pipelined: a microbatch per stage
            pipe = ComposedPipeline(mesh, 4, data_axis="data" if style == "dp+pp" else None)
            model = gpt.as_stacked(model).replace(pipeline=pipe)
        step = ms.Sharded(mesh, rules)(STEP)
        model, state = ms.shard(model, mesh, rules), ms.shard(OPTIMIZER.init(model), mesh, rules)
    losses = []
    for seed in range(STEPS):  # wait for each step: simulated devices share two cores
        model, state, loss, _ = jax.block_until_ready(step(model, state, small_batch(seed)))
        losses.append(float(loss))
    return losses, model, state


STYLES = ["tp", "2d", "fsdp", "fsdp+tp", "pp", "dp+pp", "zero", "zero-2", "cp", "dp+cp", "tp+sp"]
"""The styles trained below; tests/test_compose.py leaves its compositions among them to this test."""


@pytest.mark.slow  # each style compiles its own AdamW step
@pytest.mark.parametrize("style", STYLES)
def test_every_style_trains_the_same_gpt_to_the_same_losses(style):
    depth = DEPTH.get(style, 1)
    expected, _, _ = trained("dp", depth)
    losses, model, state = trained(style, depth)
    np.testing.assert_allclose(losses, expected, rtol=1e-5, atol=1e-5)
    if style.startswith("zero"):  # both moments a flat 1/8 per device; ZeRO-3's parameters too
        split = (state.mu, state.nu) if style == "zero-2" else (model, state.mu, state.nu)
        assert all(leaf.sharding.spec == P("data") for leaf in jax.tree.leaves(split))
        return
    path, spec = LAYOUTS[style]
    for tree in (model, state.mu, state.nu):  # the moments are laid out like their parameters
        (leaf,) = [leaf for name, leaf in ms.tree.named_leaves(tree) if name == path]
        assert leaf.sharding.spec == spec, (path, leaf.sharding.spec)


@pytest.mark.slow  # two AdamW steps compile on 8 devices
def test_one_megatron_step_equals_one_data_parallel_step_leaf_by_leaf():
    # test_every_style_... compares losses over 3 steps; here every parameter after one step.
    model, batch = small_gpt(), small_batch()
    state = OPTIMIZER.init(model)
    results = {}
    for style in ("dp", "tp"):
        shape, rules = mesh_rules(style, 8)
        mesh = ms.make_mesh(shape)
        out = jax.block_until_ready(ms.Sharded(mesh, rules)(STEP)(model, state, batch))
        results[style] = out
    assert results["tp"][0].blocks[1].attention.key.sharding.spec == P(None, "model", None)
    assert float(results["tp"][2]) == pytest.approx(float(results["dp"][2]), rel=1e-6)
    for a, b in zip(jax.tree.leaves(results["tp"][0]), jax.tree.leaves(results["dp"][0])):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def value_and_grads(model, batch):  # module level: Sharded caches compiled code per function
    return jax.value_and_grad(next_token_loss, has_aux=True)(model, batch)


@pytest.mark.slow  # two programs compile on 8 devices
@pytest.mark.parametrize("kv_heads", [8, 2])  # grouped: K and V travel at their 2 heads, 1/4 the bytes
def test_under_dp_cp_the_ring_gpt_has_the_loss_and_gradients_of_dp(kv_heads):
    # The batch dealt out zig-zag over "context" = 4, positions following; K and V round the ring.
    # One block: what the ring sends is per block (XLA's compile is most of the test).
    batch, results = small_batch(), {}
    for style, core in (("dp", "dense"), ("dp+cp", "ring")):
        shape, rules = mesh_rules(style, 8)
        step = ms.Sharded(ms.make_mesh(shape), rules)(value_and_grads)
        model = small_gpt(core=core, kv_heads=kv_heads, depth=1)
        results[style] = jax.block_until_ready(step(model, batch))
    program = step.lower(model, batch)  # dp+cp's
    (loss, (acc,)), grads = results["dp+cp"]
    assert float(loss) == pytest.approx(float(results["dp"][0][0]), rel=1e-6)
    assert float(acc) == float(results["dp"][0][1][0])
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(results["dp"][1]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # Per block: 2(p-1) permutes of a K or V chunk forward, as many backward and 2p of dK, dV:
    # 20 chunks of [batch 8/2, 16/4 tokens, kv_heads, 4] float32, 2,048 bytes each at 8 heads.
    head_dim = SMALL["width"] // SMALL["heads"]
    chunk = BATCH // 2 * SMALL["context"] // 4 * kv_heads * head_dim * 4
    sent = ms.census.bytes_by_mesh_axes(program)[("collective-permute", ("context",))]
    assert sent == (2 * 3 + 2 * 3 + 2 * 4) * chunk


def test_the_batch_is_dealt_out_only_where_attention_splits_the_sequence():
    model, batch = small_gpt(), small_batch()
    assert in_chunk_order(model, batch) == (model, batch)  # outside Sharded: as given
    for style, dealt in (("dp+cp", True), ("tp+sp", False)):  # tp+sp: heads take "model" first
        shape, rules = mesh_rules(style, 8)
        env = LogicalSharding(ms.make_mesh(shape), rules)
        held, inputs = env.wrap(lambda: in_chunk_order(model, batch))()
        order = np.asarray(cx.held_order(SMALL["context"], 4, "zigzag")) if dealt else np.arange(16)
        np.testing.assert_array_equal(inputs["targets"], batch["targets"][:, order])
        assert (held is not model) == dealt


@pytest.mark.slow  # three programs compile
def test_remat_and_microbatches_change_the_memory_not_the_numbers():
    # One block: remat wraps each block alike (XLA's compile of the three steps is most of the test)
    model, batch = small_gpt(depth=1), small_batch()
    state = OPTIMIZER.init(model)
    plain = jax.jit(STEP)(model, state, batch)
    arrays = 2 + 12 + 4  # tables; the block's 2 norms, q k v out, MLP; norm, head
    with pytest.raises(ValueError, match=f"the same {arrays} arrays as params, but their trees differ"):
        jax.jit(STEP)(model.replace(remat="full"), state, batch)  # a static field is part of the tree
    rematted = model.replace(remat="full")
    remat = jax.jit(STEP)(rematted, OPTIMIZER.init(rematted), batch)
    micro = jax.jit(make_train_step(OPTIMIZER, next_token_loss, microbatches=4))(model, state, batch)
    assert "remat" in str(jax.make_jaxpr(STEP)(rematted, OPTIMIZER.init(rematted), batch))
    for other in (remat, micro):
        assert float(other[2]) == pytest.approx(float(plain[2]), rel=1e-5)
        for a, b in zip(jax.tree.leaves(other[1].mu), jax.tree.leaves(plain[1].mu)):  # the gradients' mean
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)


# --- decoding with a KV cache -------------------------------------------------------------------


def test_cached_decoding_gives_the_logits_of_recomputing_the_whole_context():
    model, ids = small_gpt(), small_batch(batch=2)["inputs"]
    full = jax.jit(forward)(model, ids)  # every position at once, no cache
    prompt = 5
    logits, caches = gpt.decode_step(model, ids[:, :prompt], model.init_cache(2), jnp.asarray(0))
    np.testing.assert_allclose(logits, full[:, :prompt], rtol=1e-5, atol=1e-5)
    for t in range(prompt, SMALL["context"]):  # one token at a time, each reading the cache
        logits, caches = gpt.decode_step(model, ids[:, t : t + 1], caches, jnp.asarray(t))
        np.testing.assert_allclose(logits[:, 0], full[:, t], rtol=1e-5, atol=1e-5)
    assert all(isinstance(cache, KVCache) for cache in caches) and len(caches) == SMALL["depth"]
    assert np.abs(np.asarray(caches[1].keys[:, -1])).min() > 0  # the last slot written, the whole cache full


def decode(model, ids, caches, start):  # module level: one jit cache for the sharded decoding
    return model.decode(ids, start, caches)


def recomputed_generation(model, prompt, tokens, temperature, seed):
    """``gpt.generate`` without a cache: the whole window through the model for every token.

    The window is padded to the context (one shape, one compile): causal, the model never
    reads the padding for the window's last position.
    """
    context, key = SMALL["context"], jax.random.key(seed)
    window, out = list(prompt), list(prompt)
    for i in range(tokens):
        padded = jnp.asarray([window + [0] * (context - len(window))])
        logits = jax.jit(forward)(model, padded)[0, len(window) - 1]
        out.append(int(jax.random.categorical(jax.random.fold_in(key, i), logits / temperature)))
        window = window + out[-1:] if len(window) < context else out[-(context // 2) :]
    return out


@pytest.mark.slow  # one compile per window length of the reference
def test_generation_with_the_cache_equals_recomputing_and_one_seed_gives_one_text():
    model = small_gpt(seed=2)
    prompt = np.array([3, 1, 4, 1, 5], np.int32)
    got = gpt.generate(model, prompt, 30, temperature=0.8, seed=7)  # past the context: one restart
    assert got.tolist() == recomputed_generation(model, prompt.tolist(), 30, 0.8, seed=7)
    assert got.tolist() == gpt.generate(model, prompt, 30, temperature=0.8, seed=7).tolist()
    assert got.tolist() != gpt.generate(model, prompt, 30, temperature=0.8, seed=8).tolist()
    shape, rules = mesh_rules("tp", 8)  # the same text with the cache's heads split over "model"
    step = ms.Sharded(ms.make_mesh(shape), rules, donate_argnums=2)(decode)
    assert gpt.generate(model, prompt, 30, temperature=0.8, seed=7, step=step).tolist() == got.tolist()
    long = np.arange(20, dtype=np.int32) % SMALL["vocab"]  # longer than the context: read its last 16
    assert gpt.generate(model, long, 2, seed=0).tolist()[:20] == long.tolist()  # and keep all of it


def test_under_tp_the_cache_splits_its_heads_over_model_next_to_their_weights():
    model = small_gpt()
    shape, rules = mesh_rules("tp", 8)
    mesh = ms.make_mesh(shape)
    step = ms.Sharded(mesh, rules, donate_argnums=2)(decode)
    prompt = jnp.asarray([[3, 1, 4]], jnp.int32)
    specs = step.specs(model, prompt, model.init_cache(1), jnp.asarray(0))
    assert [cache.keys for cache in specs.inputs[2]] == [P(None, None, "model", None)] * SMALL["depth"]
    logits, caches = step(model, prompt, model.init_cache(1), jnp.asarray(0))
    assert caches[0].values.sharding.spec == P(None, None, "model", None)  # and it stays so
    np.testing.assert_allclose(logits, jax.jit(forward)(model, prompt), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("style", "kv_heads"), [("cp", 8), ("dp+cp", 2)])  # dp+cp: grouped queries too
def test_under_cp_each_device_keeps_its_positions_of_the_cache_and_decodes_the_unsharded_logits(
    style, kv_heads
):
    model, ids = small_gpt(seed=1, kv_heads=kv_heads), small_batch(batch=2)["inputs"]
    shape, rules = mesh_rules(style, 4)  # cp: 4 slots of 16 per device; dp+cp: 8 per device, a sequence each
    step = ms.Sharded(ms.make_mesh(shape, devices=jax.devices()[:4]), rules, donate_argnums=2)(decode)
    logits, caches = step(model, ids[:, :5], model.init_cache(2), jnp.asarray(0))  # the prompt: 5 slots of 16
    assert caches[0].keys.sharding.spec == P(rules.spec(("batch",))[0], "context", None, None)
    for shard in caches[0].keys.addressable_shards:  # contiguous: the first device's slots 0 .. share - 1
        written = np.abs(np.asarray(shard.data)).sum(axis=(0, 2, 3)) > 0
        assert written.tolist() == [shard.index[1].start + s < 5 for s in range(written.size)]
    full = jax.jit(forward)(model, ids)
    np.testing.assert_allclose(logits, full[:, :5], rtol=1e-5, atol=1e-5)
    for t in range(5, SMALL["context"]):  # one token at a time, written to every device's slots in turn
        logits, caches = step(model, ids[:, t : t + 1], caches, jnp.asarray(t))
        np.testing.assert_allclose(logits[:, 0], full[:, t], rtol=1e-5, atol=1e-5)


# --- grouped-query attention ---------------------------------------------------------------------


def tiled(model, interleaved=False):
    """``model`` as multi-head attention: each key and value head repeated for the query heads of its
    group (query head h reads K/V head h // group); ``interleaved``, the wrong grouping (h % kv_heads)."""

    def mha(block):
        attention = block.attention
        group = attention.heads // attention.kv_heads
        k, v = (
            jnp.tile(w, (1, group, 1)) if interleaved else jnp.repeat(w, group, 1)
            for w in (attention.key, attention.value)
        )
        return block.replace(attention=attention.replace(key=k, value=v, kv_heads=attention.heads))

    return model.replace(blocks=tuple(mha(block) for block in model.blocks))


def test_kv_heads_equal_to_heads_is_the_multi_head_gpt_and_keeps_its_checkpoint_shapes():
    mha, same = (gpt.GPT(**SMALL, key=jax.random.key(0), **kv) for kv in ({}, {"kv_heads": 8}))
    assert jax.tree.structure(mha) == jax.tree.structure(same)
    for a, b in zip(jax.tree.leaves(mha), jax.tree.leaves(same), strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="Attention: kv_heads 3 must divide heads 8"):
        gpt.GPT(**SMALL, kv_heads=3, key=jax.random.key(0))


@pytest.mark.parametrize("kv_heads", [1, 2])  # multi-query, and groups of 4 query heads
def test_grouped_queries_compute_the_multi_head_gpt_whose_keys_and_values_are_tiled(kv_heads):
    model, ids = small_gpt(seed=1, kv_heads=kv_heads), small_batch(batch=2)["inputs"]
    assert model.blocks[0].attention.key.shape == (SMALL["width"], kv_heads, SMALL["width"] // 8)
    expected = jax.jit(forward)(tiled(model), ids)
    np.testing.assert_allclose(jax.jit(forward)(model, ids), expected, rtol=1e-5, atol=1e-5)
    logits, caches = gpt.decode_step(model, ids[:, :5], model.init_cache(2), jnp.asarray(0))
    logits, caches = gpt.decode_step(model, ids[:, 5:6], caches, jnp.asarray(5))  # through the cache
    np.testing.assert_allclose(logits[:, 0], expected[:, 5], rtol=1e-5, atol=1e-5)
    if kv_heads > 1:  # a real check of the grouping: the other order of heads computes another model
        assert not np.allclose(jax.jit(forward)(tiled(model, interleaved=True), ids), expected, atol=1e-3)


def test_the_cache_keeps_the_kv_heads_alone_its_bytes_per_token_as_serving_prices_them():
    per_token = {}
    for kv_heads in (8, 2, 1):
        caches = small_gpt(kv_heads=kv_heads).init_cache(3)
        assert caches[0].keys.shape == (3, SMALL["context"], kv_heads, 4)
        cached = sum(leaf.nbytes for leaf in jax.tree.leaves(caches))
        per_token[kv_heads] = cached / (3 * SMALL["context"])
        shape = dict(layers=2, width=32, heads=8, kv_heads=kv_heads, head_dim=4, hidden=128, vocab=11)
        assert per_token[kv_heads] == Decoder(**shape).kv_bytes_per_token("float32")
    assert per_token[8] == 4 * per_token[2] == 8 * per_token[1] == 2 * 2 * 8 * 4 * 4  # K, V; L, heads, D, f32


@pytest.mark.slow  # two decode programs compile on 4 devices, one more on 1
def test_under_tp_grouped_decoding_splits_the_kv_heads_and_draws_the_unsharded_text():
    model, prompt = small_gpt(seed=2, kv_heads=4), np.array([3, 1, 4, 1, 5], np.int32)
    shape, rules = mesh_rules("tp", 4)  # 4 key and value heads, each beside its 2 query heads
    step = ms.Sharded(ms.make_mesh(shape, devices=jax.devices()[:4]), rules, donate_argnums=2)(decode)
    specs = step.specs(model, prompt[None], model.init_cache(1), jnp.asarray(0))
    assert [cache.keys for cache in specs.inputs[2]] == [P(None, None, "model", None)] * SMALL["depth"]
    assert specs.inputs[0].blocks[0].attention.value == P(None, "model", None)
    got = gpt.generate(model, prompt, 14, temperature=0.8, seed=7, step=step)  # past the context: a restart
    assert got.tolist() == gpt.generate(model, prompt, 14, temperature=0.8, seed=7).tolist()


def test_sample_continues_a_prompt_as_text_and_names_a_character_it_cannot_read():
    vocab = Vocabulary(" :EMORabcdeh")
    model = small_gpt(vocab=len(vocab))
    text = sample(model, vocab, "ROMEO:", tokens=8, temperature=0.8, seed=0, stream=gpt.stream)
    assert text.startswith("ROMEO:") and len(text) == 14 and set(text) <= set(vocab.characters)
    assert text == sample(model, vocab, "ROMEO:", tokens=8, temperature=0.8, seed=0, stream=gpt.stream)
    with pytest.raises(ValueError, match="the character 'J' \\(at 0\\) is not in the vocabulary"):
        sample(model, vocab, "JULIET:", tokens=3, stream=gpt.stream)


# --- an Explicit mesh, and a batch axis of another name ------------------------------------------


@pytest.mark.slow  # two meshes, two compiles
def test_the_gpt_trains_on_an_explicit_mesh_with_any_batch_axis_name_as_on_an_auto_one():
    # "rows" where the style says "batch": a layer that spelled "batch" would find no rule for it.
    # SGD, not AdamW: Adam's g / sqrt(v) turns a last-ulp difference of a tiny gradient into a
    # visible one, and this test compares every parameter.
    rules = ms.AxisRules.from_pairs(
        [("rows" if axis == "batch" else axis, target) for axis, target in mesh_rules("fsdp+tp", 8)[1].pairs]
    )
    runs = {}
    for explicit, step_rules, batch_axis in (
        (False, mesh_rules("fsdp+tp", 8)[1], None),
        (True, rules, "rows"),
    ):
        mesh = ms.make_mesh({"data": 2, "model": 4}, explicit=explicit)
        step = ms.Sharded(mesh, step_rules, batch_axis=batch_axis)(SGD_STEP)
        model = ms.shard(small_gpt(), mesh, step_rules)
        state = ms.shard(ms.SGD(0.1).init(model), mesh, step_rules)
        for seed in range(2):
            model, state, loss, _ = jax.block_until_ready(step(model, state, small_batch(seed)))
        runs[explicit] = model, loss
    for got, expected in zip(jax.tree.leaves(runs[True]), jax.tree.leaves(runs[False]), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=2e-5, atol=1e-6)
    tokens = runs[True][0].embedding.tokens
    assert str(jax.typeof(tokens)).endswith("@data]")  # fsdp: the table's features split, in its type


# --- MoE MLPs: the experts over "expert" -----------------------------------------------------------

MOE = dict(n_experts=8, k=2)


@functools.cache
def moe_gpt(capacity_factor):
    """The small GPT, every MLP 8 experts of 128 // 2 hidden units; 4.0 = 8 / 2 drops nothing."""
    mlp = moe_mlp(**MOE, capacity_factor=capacity_factor)
    return numpy_filled(jax.eval_shape(lambda: gpt.GPT(**SMALL, key=jax.random.key(0), mlp=mlp)), 0)


def loss_and_grads(model, batch):
    (loss, _), grads = jax.value_and_grad(next_token_loss, has_aux=True)(model, batch)
    return loss, grads, collect(MoEStats, model)(batch["inputs"])[1]


def test_an_moe_gpt_adds_its_routers_losses_and_keeps_the_dense_gpts_active_parameters():
    model, batch = moe_gpt(1.25), small_batch()
    logits, stats = jax.jit(lambda m, ids: collect(MoEStats, m)(ids))(model, batch["inputs"])
    mlp = model.blocks[0].mlp
    assert mlp.experts.w_in.shape == (8, SMALL["width"], 4 * SMALL["width"] // 2)  # k of them: 4 x width
    assert int(stats.routed) == SMALL["depth"] * BATCH * SMALL["context"] * 2  # every block, every token, k
    dense_loss = ms.cross_entropy(logits, ms.one_hot(batch["targets"], SMALL["vocab"]))
    loss, _ = jax.jit(next_token_loss)(model, batch)
    assert float(loss) == pytest.approx(float(dense_loss + stats.aux_loss), rel=1e-6)
    assert float(stats.aux_loss) > 0 and int(stats.dropped) > 0  # capacity 1.25 on random routers
    stacked = gpt.as_stacked(model)  # its blocks in a lax.scan: their stats leave it
    stacked_logits, stacked_stats = jax.jit(lambda m, ids: collect(MoEStats, m)(ids))(
        stacked, batch["inputs"]
    )
    np.testing.assert_allclose(stacked_logits, logits, rtol=1e-5, atol=1e-5)
    assert int(stacked_stats.routed) == int(stats.routed)
    np.testing.assert_allclose(stacked_stats.aux_loss, stats.aux_loss, rtol=1e-5)


def test_a_scanned_moe_gpt_sums_its_blocks_stats_out_of_the_scan_as_the_loop_does():
    model, ids = moe_gpt(1.25), small_batch()["inputs"]
    scanned = model.replace(blocks=stack_blocks(model.blocks))  # GPT(scan=True)'s form
    run = jax.jit(lambda m, ids: collect(MoEStats, m)(ids))
    (logits, stats), (scanned_logits, scanned_stats) = run(model, ids), run(scanned, ids)
    np.testing.assert_allclose(scanned_logits, logits, rtol=1e-5, atol=1e-5)
    assert int(scanned_stats.routed) == int(stats.routed) and int(scanned_stats.dropped) == int(stats.dropped)
    np.testing.assert_allclose(scanned_stats.aux_loss, stats.aux_loss, rtol=1e-5)


@pytest.mark.slow  # jax.random compiles a program per parameter shape: seconds per model on a CPU
def test_gpt_scan_holds_the_looped_gpts_parameters_stacked_and_decodes_the_same_text():
    sizes = dict(vocab=5, context=8, width=8, depth=3, heads=2, key=jax.random.key(2))
    looped, scanned = gpt.GPT(**sizes), gpt.GPT(**sizes, scan=True)
    assert scanned.blocks.n == 3 and scanned.blocks.block.attention.query.shape == (3, 8, 2, 4)
    assert_trees_equal(scanned.looped_blocks(), looped.blocks)  # the same draws, bit for bit
    assert_trees_equal(scanned.replace(blocks=looped.blocks), looped)
    prompt = np.array([1, 2, 3])
    np.testing.assert_array_equal(gpt.generate(scanned, prompt, 12), gpt.generate(looped, prompt, 12))


@pytest.mark.slow  # two sharded programs compile
@pytest.mark.parametrize("style", ["ep", "dp+ep"])
def test_an_moe_gpt_under_expert_parallelism_equals_it_on_one_device(style):
    model, batch = moe_gpt(4.0), small_batch()
    want_loss, want_grads, want_stats = jax.jit(loss_and_grads)(model, batch)
    shape, rules = mesh_rules(style, 8)
    mesh = ms.make_mesh(shape)
    placed = ms.shard(model, mesh, rules)
    assert placed.blocks[0].mlp.experts.w_in.sharding.spec == P("expert", None, None)
    got = jax.block_until_ready(ms.Sharded(mesh, rules)(loss_and_grads)(placed, batch))
    got_loss, got_grads, got_stats = got
    assert int(got_stats.dropped) == int(want_stats.dropped) == 0
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    for (path, got), want in zip(ms.tree.named_leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6, err_msg=path)
    forward = ms.Sharded(mesh, rules)(lambda m, ids: collect(MoEStats, m)(ids)).lower(model, batch["inputs"])
    assert ms.collectives(forward)["all-to-all"].count == 2 * SMALL["depth"]  # tokens out and home, per block


def test_the_residual_streams_gradient_is_divided_by_one_except_under_tensor_parallelism(
    monkeypatch,
):
    from minishard.models import transformer

    model, batch = small_gpt(), small_batch()

    def loss(model):
        return next_token_loss(model, batch)[0]

    def barriers(function):  # the residual_stream calls that divide their gradient by 1
        fresh = lambda m: function(m)  # noqa: E731  # a new function: jax caches a trace per function
        return str(jax.make_jaxpr(fresh)(model)).count("custom_vjp_call")

    once = jax.jit(jax.grad(loss))(model)
    assert barriers(loss) == 3 * SMALL["depth"]  # three residual_stream calls a block
    monkeypatch.setattr(transformer, "_gradient_once", lambda x: x)  # the plain stream
    assert barriers(loss) == 0
    plain = jax.jit(jax.grad(loss))(model)
    for a, b in zip(jax.tree.leaves(once), jax.tree.leaves(plain), strict=True):
        # dividing by 1 is exact; the fusions around it sum in another order: off by up to 1.3e-6 of
        # the array's largest gradient on a Zen 3 (AVX2), so 1e-5 of it; a wrong gradient is off by O(1)
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(np.abs(b).max()))
    monkeypatch.undo()
    for style, on in (("dp", True), ("dp+pp", True), ("fsdp", False), ("tp", False), ("tp+sp", False)):
        shape, rules = mesh_rules(style, 8)
        env = LogicalSharding(ms.make_mesh(shape), rules)
        assert barriers(env.wrap(loss)) == (3 * SMALL["depth"] if on else 0), style
