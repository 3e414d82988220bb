"""The ViT of ``minishard.models.vit``: each layer against a reference, then sharded == unsharded.

Models for the property test are built with ``jax.eval_shape`` and filled by
numpy, as ``minishard.testing.mlps`` does: drawing with ``jax.random`` compiles
one small program per parameter shape, seconds per model on a CPU.
"""

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import minishard as ms
import minishard.models.vit as transformer
from minishard.census import bytes_by_mesh_axes
from minishard.composition import ComposedPipeline
from minishard.models.vit import Attention, LayerNorm, PatchEmbedding, ViT, as_stacked, stacked_vit, vit_rules
from minishard.run.steps import make_train_step
from minishard.styles import ANY_MODEL, LOGICAL_AXES, mesh_rules, style_rules
from minishard.testing import assert_sharded_equivalent, meshes

# Fixed small sizes, so that every hypothesis example reuses the same compiled reference:
# 8 heads and 32 hidden units split evenly over "model" = 8, a batch of 8 over "data" = 8.
# One block: a second would only double the compile time; blocks meet through the residual alone.
SMALL = dict(image_size=8, patch_size=4, channels=2, width=16, depth=1, heads=8, mlp_ratio=2, classes=4)
BATCH = 8


def numpy_filled(tree, seed, scale=0.3):
    """``tree`` (arrays or ShapeDtypeStructs) with every float leaf drawn from a seeded normal."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda leaf: (scale * rng.standard_normal(leaf.shape)).astype(leaf.dtype), tree)


@functools.cache
def small_vit(seed=0, remat="none"):
    return numpy_filled(jax.eval_shape(lambda: ViT(**SMALL, key=jax.random.key(0), remat=remat)), seed)


def small_batch(seed=0):
    rng = np.random.default_rng(seed)
    size, channels = SMALL["image_size"], SMALL["channels"]
    images = rng.uniform(0, 1, (BATCH, size, size, channels)).astype(np.float32)
    return {"image": images, "label": rng.integers(0, SMALL["classes"], BATCH).astype(np.int32)}


# --- each layer ----------------------------------------------------------------


def test_layer_norm_normalises_each_token_then_scales_and_shifts():
    x = 3.0 * np.random.default_rng(0).standard_normal((2, 5, 16)).astype(np.float32) + 2.0
    y = LayerNorm(16)(x)  # scale 1, shift 0: only the normalisation
    np.testing.assert_allclose(y.mean(-1), 0.0, atol=1e-5)
    np.testing.assert_allclose(y.var(-1), 1.0, rtol=1e-4)
    scale, bias = jnp.arange(16.0), jnp.full(16, 0.5)
    norm = LayerNorm(16).replace(scale=scale, bias=bias)
    np.testing.assert_allclose(norm(x), y * scale + bias, rtol=1e-5, atol=1e-5)
    assert norm.param_logical_axes() == {"scale": ("embed",), "bias": ("embed",)}


def reference_attention(x, query, key, value, out):
    """Multi-head attention head by head, with matrices and an explicit softmax, in float64."""
    x, query, key, value, out = (np.asarray(a, np.float64) for a in (x, query, key, value, out))
    result = np.zeros_like(x)
    for h in range(query.shape[1]):
        q, k, v = x @ query[:, h], x @ key[:, h], x @ value[:, h]  # [batch, tokens, head_dim]
        logits = q @ k.transpose(0, 2, 1) / np.sqrt(q.shape[-1])  # [batch, tokens, tokens]
        weights = np.exp(logits - logits.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        result += (weights @ v) @ out[h]  # each head adds its share of the output
    return result


def test_attention_matches_a_head_by_head_reference():
    attention = numpy_filled(jax.eval_shape(lambda: Attention(12, 3, key=jax.random.key(0))), seed=1)
    x = np.random.default_rng(2).standard_normal((2, 5, 12)).astype(np.float32)
    assert attention.query.shape == (12, 3, 4) and attention.out.shape == (3, 4, 12)
    expected = reference_attention(x, attention.query, attention.key, attention.value, attention.out)
    got = jax.jit(forward)(attention, x)  # one program, not one per op
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
    assert attention.param_logical_axes()["out"] == ("heads", "kv", "embed")


def test_attention_refuses_heads_that_do_not_divide_the_width():
    with pytest.raises(ValueError, match="multiple of heads"):
        Attention(10, 3, key=jax.random.key(0))


def test_patch_embedding_projects_patches_in_row_major_order():
    shapes = jax.eval_shape(lambda: PatchEmbedding(8, 4, 2, 6, key=jax.random.key(0)))
    embed = numpy_filled(shapes, seed=3)
    images = np.random.default_rng(4).uniform(0, 1, (3, 8, 8, 2)).astype(np.float32)
    tokens = embed(images)
    assert tokens.shape == (3, 4, 6)  # (8 / 4)^2 patches of 4 x 4 x 2 pixels, width 6
    weight, bias = embed.projection.weight, embed.projection.bias
    for row in range(2):
        for col in range(2):
            patch = images[:, 4 * row : 4 * row + 4, 4 * col : 4 * col + 4, :].reshape(3, -1)
            expected = patch @ weight + bias + embed.position_table[2 * row + col]
            np.testing.assert_allclose(tokens[:, 2 * row + col], expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"\[B, 8, 8, 2\]"):
        embed(images[0])  # one image, no batch axis


def test_vit_maps_a_batch_of_images_to_logits_and_names_every_axis():
    model, batch = small_vit(), small_batch()
    logits = jax.jit(forward)(model, batch["image"])  # the program the sharded tests' reference runs
    assert logits.shape == (BATCH, SMALL["classes"])
    leaves = ms.plan(model, None, vit_rules()).leaves
    # embedding: projection (2), position table; per block: 2 norms (4), q, k, v, out, MLP (4); norm, head
    assert len(leaves) == 3 + SMALL["depth"] * 12 + 4
    for leaf in leaves:
        assert leaf.logical_axes and all(axis in LOGICAL_AXES for axis in leaf.logical_axes), leaf.path


def test_one_key_gives_every_layer_its_own_randomness():
    sizes = {**SMALL, "depth": 2}
    model, again = ViT(**sizes, key=jax.random.key(0)), ViT(**sizes, key=jax.random.key(0))
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(again)):
        np.testing.assert_array_equal(a, b)  # reproducible from one seed
    first, second = (block.attention.query for block in model.blocks)
    assert not np.allclose(first, second)  # each block drew from its own key
    assert not np.allclose(model.blocks[0].attention.query, model.blocks[0].attention.key)


def test_vit_rules_are_the_styles_rules_with_overrides_first():
    assert vit_rules("dp").spec(("batch", "embed", "heads")) == P("data", None, None)
    assert vit_rules("tp").spec(("batch", "embed", "heads")) == P(None, None, "model")
    assert vit_rules("2d").spec(("batch", "mlp")) == P("data", "model")
    assert vit_rules("2d", embed="model").spec(("embed",)) == P("model")
    for old in ("data", "tensor"):  # the names vit_rules had before the styles: one name per style now
        with pytest.raises(ValueError, match=f"unknown parallel style '{old}'"):
            vit_rules(old)
    with pytest.raises(ValueError, match="unknown parallel style 'pipeline'; choose from dp, tp, 2d"):
        vit_rules("pipeline")


def loss_and_grads(model, batch):
    def loss_fn(model):
        logits = model(batch["image"])
        return ms.cross_entropy(logits, ms.one_hot(batch["label"], logits.shape[-1]))

    return jax.value_and_grad(loss_fn)(model)


@pytest.mark.slow  # over 5 s
def test_remat_recomputes_the_blocks_without_changing_the_numbers():
    model, batch = small_vit(), small_batch()
    remat = model.replace(remat="full")
    jaxpr = str(jax.make_jaxpr(loss_and_grads)(remat, batch))
    assert jaxpr.count("remat") == SMALL["depth"] and "nothing_saveable" in jaxpr  # jax.checkpoint's
    (loss, grads), (loss_r, grads_r) = (
        jax.jit(loss_and_grads)(model, batch),
        jax.jit(loss_and_grads)(remat, batch),
    )
    np.testing.assert_allclose(loss_r, loss, rtol=1e-6)
    for g, g_r in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_r)):
        np.testing.assert_allclose(g_r, g, rtol=1e-5, atol=1e-7)


# --- sharded == unsharded --------------------------------------------------------


def forward(model, images):  # module level: jit caches compiled code per function
    return model(images)


sgd_step = make_train_step(ms.SGD(0.1))


@pytest.mark.slow  # over 5 s
@settings(max_examples=5)
@given(st.data())
def test_sharded_vit_forward_and_sgd_step_equal_the_unsharded_ones(data):
    mesh = data.draw(meshes(), label="mesh")  # 1x8, 2x4, 4x2 or 8x1 over ("data", "model")
    style = data.draw(st.sampled_from(ANY_MODEL), label="style")
    rules, split = style_rules(style), "batch" if style == "dp" else True  # dp splits no parameter
    seed = data.draw(st.integers(0, 3), label="seed")
    model, batch = small_vit(seed), small_batch(seed)
    options = {"rtol": 1e-4, "atol": 1e-5, "require_split": split}
    assert_sharded_equivalent(forward, model, batch["image"], mesh=mesh, rules=rules, **options)
    state = ms.SGD(0.1).init(model)
    assert_sharded_equivalent(sgd_step, model, state, batch, mesh=mesh, rules=rules, **options)


def renamed_batch_axis(rules, name):
    """``rules`` with the logical axis "batch" called ``name``."""
    return ms.AxisRules.from_pairs(
        [(name if axis == "batch" else axis, mesh_axes) for axis, mesh_axes in rules.pairs]
    )


@pytest.mark.slow  # over 5 s: two meshes, two compiles
def test_the_vit_trains_with_any_batch_axis_name_on_an_explicit_mesh_as_on_an_auto_one():
    # "rows" where the style says "batch", and no rule for "batch": a layer that spelled
    # "batch" in an activation's sharding would fail with "logical axis 'batch' has no rule".
    rows = renamed_batch_axis(style_rules("2d"), "rows")
    assert "batch" not in rows and "rows" in rows
    runs = {}
    for explicit, rules, batch_axis in ((False, style_rules("2d"), None), (True, rows, "rows")):
        mesh = ms.make_mesh({"data": 2, "model": 4}, explicit=explicit)
        step = ms.Sharded(mesh, rules, batch_axis=batch_axis)(sgd_step)
        model, batch = ms.shard(small_vit(), mesh, rules), small_batch()
        state = ms.shard(ms.SGD(0.1).init(model), mesh, rules)
        for _ in range(2):
            model, state, loss, _ = jax.block_until_ready(step(model, state, batch))
        runs[explicit] = model, loss
        assert model.blocks[0].attention.query.sharding.spec == P(None, "model", None)  # heads split
    for got, expected in zip(jax.tree.leaves(runs[True]), jax.tree.leaves(runs[False]), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=2e-5, atol=1e-6)
    explicit_query = runs[True][0].blocks[0].attention.query
    assert str(jax.typeof(explicit_query)).endswith("@model,2]")  # Explicit: the split is in the type


# --- the collectives the module docstring predicts -------------------------------


def megatron_step_collectives(remat):
    """Compile one 2-D momentum-SGD step of the default ViT (from shapes only); its HLO's collectives."""
    mesh, rules = ms.make_mesh({"data": 2, "model": 4}), style_rules("2d")
    model = jax.eval_shape(lambda: ViT(key=jax.random.key(0), remat=remat))
    optimizer = ms.SGD(0.05, momentum=0.9)
    state = jax.eval_shape(optimizer.init, model)
    batch = {
        "image": jax.ShapeDtypeStruct((128, 28, 28, 1), jnp.float32),
        "label": jax.ShapeDtypeStruct((128,), jnp.int32),
    }
    step = ms.Sharded(mesh, rules)(make_train_step(optimizer))
    report = ms.explain(model, mesh, rules, step=step, args=(model, state, batch))
    return model, report, bytes_by_mesh_axes(step.lower(model, state, batch))


@pytest.mark.parametrize("remat", ["none", pytest.param("full", marks=pytest.mark.slow)])
def test_a_2d_step_has_exactly_the_collectives_the_docstring_predicts(remat):
    model, report, by_axes = megatron_step_collectives(remat)
    defaults = inspect.signature(ViT).parameters
    depth, width = defaults["depth"].default, defaults["width"].default
    tokens = (defaults["image_size"].default // defaults["patch_size"].default) ** 2
    assert model.embedding.position_table.shape == (tokens, width)
    f32 = 4
    # Over "model": per block, the sums over heads and over hidden units, forward and backward
    # (with remat the recomputed forward repeats the attention's), of one [128 / 2, tokens, width].
    per_block = 5 if remat == "full" else 4
    activation = 128 // 2 * tokens * width * f32
    model_bytes = depth * per_block * activation
    # Over "data": every gradient, each device's block of it, plus the loss and the accuracy.
    data_bytes = report.device_bytes + 2 * f32
    # remat.after_the_gradient ties each block's recomputation to one number of its gradient, which
    # lives on one device of "data": a 4-byte all-reduce per block
    tie = depth * f32 if remat == "full" else 0
    assert set(report.collectives) == {"all-reduce"}
    assert by_axes == {("all-reduce", ("model",)): model_bytes, ("all-reduce", ("data",)): data_bytes + tie}
    all_reduce = report.collectives["all-reduce"]
    assert all_reduce.mesh_axes == (("data",), ("model",))
    assert all_reduce.bytes == model_bytes + data_bytes + tie
    if remat == "none":
        assert all_reduce.count == 4 * depth + 1  # XLA combines all the "data" ones into one
    for number in (activation, model_bytes, data_bytes):  # the docstring states these numbers
        assert f"{number:,}" in transformer.__doc__, number


# -- the stacked ViT: its blocks on a "stage" axis, for a pipeline ----------------------------
@pytest.mark.slow  # two pipelined programs compile
def test_the_stacked_vit_is_the_same_function_of_the_same_parameters():
    model, images = small_vit(), small_batch()["image"]
    stacked = as_stacked(model)
    shapes = jax.eval_shape(lambda: stacked_vit(**SMALL, key=jax.random.key(0)))
    assert jax.tree.structure(stacked) == jax.tree.structure(shapes) and stacked.blocks.n == SMALL["depth"]
    np.testing.assert_allclose(jax.jit(stacked)(images), jax.jit(model)(images), rtol=1e-5, atol=1e-6)


def test_the_stacked_vit_trains_alike_pipelined_over_data_and_stage_or_data_parallel():
    small = {**SMALL, "depth": 4, "heads": 4}
    model = numpy_filled(jax.eval_shape(lambda: stacked_vit(**small, key=jax.random.key(0))), seed=0)
    axes = {leaf.path: leaf.logical_axes for leaf in ms.plan(model, None, style_rules("dp+pp")).leaves}
    assert axes["blocks.block.attention.query"] == ("stage", "embed", "heads", "kv")
    batch = {**small_batch(), "image": np.tile(small_batch()["image"], (2, 1, 1, 1))}
    batch["label"] = np.tile(batch["label"], 2)  # 16 examples: 4 microbatches of 4, 2 per data device
    losses = {}
    for style in ("dp", "dp+pp"):
        shape, rules = mesh_rules(style, 8)
        mesh = ms.make_mesh(shape)
        piped = (
            model if style == "dp" else model.replace(pipeline=ComposedPipeline(mesh, 4, data_axis="data"))
        )
        step, state = ms.Sharded(mesh, rules)(sgd_step), ms.SGD(0.1).init(piped)
        for _ in range(3):
            piped, state, loss, _ = jax.block_until_ready(step(piped, state, batch))
        losses[style] = float(loss)
    assert losses["dp+pp"] == pytest.approx(losses["dp"], rel=1e-4)
