"""Four ways to spread a computation over 8 devices, checked against the arithmetic.

Each test compiles a real program on the 8 simulated CPU devices (conftest.py),
reads the collectives XLA's SPMD partitioner inserted (``minishard.collectives``)
and compares them with what a pencil-and-paper analysis predicts, in the
vocabulary of "How to Scale Your Model": a matmul whose contracted dimension is
split ends in an all-reduce of its (small) output; one whose contracted
dimension is whole needs no communication at all.

The model is the MNIST MLP 784 -> 512 -> 10 (1,628,200 bytes of float32), the
batch 64 examples. Every sharded call is followed by ``jax.block_until_ready``:
XLA's CPU backend can deadlock when many programs with collectives are in
flight at once on simulated devices.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import minishard as ms
from minishard.collectives import Collective, bytes_by_mesh_axes, collectives, summary
from minishard.explain import Report, explain
from minishard.sharding import AxisRules, Sharded, make_mesh
from minishard.tree import named_leaves, tree_bytes

SIZES = [784, 512, 10]
BATCH = 64
F32 = 4  # bytes
MEGATRON = [("embed", "mlp"), ("mlp", "embed")]  # split the hidden dimension
OPT = ms.SGD(0.1)


def train_step(model, opt_state, images, labels):
    def loss_fn(model):
        return ms.cross_entropy(model(images), ms.one_hot(labels, SIZES[-1]))

    loss, grads = jax.value_and_grad(loss_fn)(model)
    model, opt_state = OPT.update(model, grads, opt_state)
    return model, opt_state, loss


def example(axes=None):
    """(model, opt_state, images, labels); the batch comes from NumPy, which compiles nothing."""
    model = ms.mlp(SIZES, key=jax.random.key(0), axes=axes)
    rng = np.random.default_rng(0)
    images = rng.standard_normal((BATCH, SIZES[0]), dtype=np.float32)
    labels = rng.integers(0, SIZES[-1], BATCH, dtype=np.int32)
    return model, OPT.init(model), images, labels


def weight_specs(step, args):
    model_specs = step.specs(*args).inputs[0]
    return [spec for path, spec in named_leaves(model_specs)]


def assert_trees_close(a, b):
    for (path, x), (_, y) in zip(named_leaves(a), named_leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6, err_msg=path)


# -- (1) data parallel -------------------------------------------------------------
def test_data_parallel_all_reduces_the_gradients_over_data():
    mesh = make_mesh({"data": 8})
    args = model, *_ = example()  # no axes: every parameter replicated
    step = Sharded(mesh, AxisRules(batch="data"))(train_step)
    assert weight_specs(step, args) == [P(None, None), P(None), P(None, None), P(None)]
    assert step.specs(*args).inputs[2] == P("data")  # 8 examples per device

    found = collectives(step.lower(*args))
    # Each device differentiates the loss of its own 8 examples: its gradient is
    # a partial sum, shaped like the whole model. One all-reduce adds the 8
    # partials: exactly the parameter bytes (XLA fuses the four gradients into
    # one tuple-shaped all-reduce). cross_entropy is a mean over the batch, so
    # the loss is a partial sum too: one more float32 scalar, 4 bytes, rides
    # in the same all-reduce. The parameters themselves never move.
    assert set(found) == {"all-reduce"}
    assert found["all-reduce"].bytes == tree_bytes(model) + F32 == 1_628_200 + 4
    assert found["all-reduce"].mesh_axes == (("data",),)


# -- (2) tensor parallel (Megatron MLP) ----------------------------------------------
def test_tensor_parallel_moves_activations_not_weights():
    mesh = make_mesh({"model": 8})
    args = example(axes=MEGATRON)
    step = Sharded(mesh, AxisRules(embed=None, mlp="model"))(train_step)
    # First Linear: columns split (each device owns 64 hidden units); second:
    # the matching rows. Its bias follows its output, "embed": replicated.
    assert weight_specs(step, args) == [P(None, "model"), P("model"), P("model", None), P(None)]
    assert step.specs(*args).inputs[2] == P()  # no "batch" rule: inputs replicated

    found = collectives(step.lower(*args))
    # Forward: x @ W1 contracts the whole "embed" dim: no communication, h is
    # split over "model". h @ W2 contracts the split "mlp" dim: each device
    # holds a partial (64, 10) logits matrix, and one all-reduce sums them.
    # Backward: dlogits is replicated; dh = dlogits @ W2.T, dW2 = h.T @ dlogits
    # and dW1 = x.T @ dh all come out split exactly like W1 and W2: no
    # communication. So 2,560 bytes of activations move, against 1.6 MB of
    # weights in (1); no all-gather at all: no device ever sees a whole weight.
    assert set(found) == {"all-reduce"}
    assert found["all-reduce"] == Collective("all-reduce", 1, BATCH * SIZES[-1] * F32, (("model",),))


# -- (3) 2-D: data x model -------------------------------------------------------------
RULES_2D = AxisRules(batch="data", embed=None, mlp="model")


def test_2d_combines_both_all_reduces_on_their_own_axes():
    mesh = make_mesh({"data": 2, "model": 4})
    args = model, *_ = example(axes=MEGATRON)
    step = Sharded(mesh, RULES_2D)(train_step)
    assert weight_specs(step, args) == [P(None, "model"), P("model"), P("model", None), P(None)]
    assert step.specs(*args).inputs[2] == P("data")

    found = bytes_by_mesh_axes(step.lower(*args))
    # Over "model", as in (2): the partial logits of this data shard's 32
    # examples, (32, 10) float32.
    # Over "data", as in (1), but each device only all-reduces the gradients of
    # the parameters it holds: 1/4 of W1, b1 and W2, and all of the replicated
    # b2. That is what explain() counts as bytes per device. Plus the 4-byte
    # partial loss.
    held = explain(model, mesh, RULES_2D).device_bytes
    assert held == (784 * 128 + 128 + 128 * 10 + 10) * F32 == 407_080
    assert found == {
        ("all-reduce", ("model",)): BATCH // 2 * SIZES[-1] * F32,
        ("all-reduce", ("data",)): held + F32,
    }


@pytest.mark.parametrize(
    ("shape", "rules", "axes"),
    [
        ({"data": 8}, AxisRules(batch="data"), None),
        ({"model": 8}, AxisRules(embed=None, mlp="model"), MEGATRON),
        ({"data": 2, "model": 4}, RULES_2D, MEGATRON),
    ],
    ids=["data", "tensor", "2d"],
)
def test_sharded_step_computes_what_the_unsharded_step_computes(shape, rules, axes):
    mesh = make_mesh(shape)
    args = example(axes)
    expected = jax.block_until_ready(jax.jit(train_step)(*args))
    got = jax.block_until_ready(Sharded(mesh, rules)(train_step)(*args))
    assert_trees_close(got, expected)
    new_model = got[0]
    specs = jax.tree_util.tree_leaves(ms.partition_specs(new_model, rules, mesh))
    shardings = [leaf.sharding.spec for leaf in jax.tree_util.tree_leaves(new_model)]
    assert shardings == specs  # the updated model keeps its layout


# -- (4) the classic 2-D dot product -------------------------------------------------
def test_4000_dot_products_on_a_2x4_mesh():
    mesh = make_mesh({"x": 2, "y": 4})
    blocks = NamedSharding(mesh, P("x", "y"))

    # Created sharded: each device generates only its own (2000, 2500) blocks,
    # and no 160 MB array ever sits on one device.
    @jax.jit
    def pairs(key):
        a, b = jax.random.split(key)
        return jax.random.normal(a, (4000, 10_000)), jax.random.normal(b, (4000, 10_000))

    a, b = jax.block_until_ready(jax.jit(pairs, out_shardings=(blocks, blocks))(jax.random.key(0)))
    assert {shard.data.shape for shard in a.addressable_shards} == {(2000, 2500)}

    dots = jax.jit(jax.vmap(jnp.vdot), out_shardings=NamedSharding(mesh, P("x")))
    found = collectives(dots.lower(a, b))
    # A device multiplies its 2000 x 2500 blocks and sums along its 2500
    # columns: 2000 partial dot products. The 4 devices of a row ("y") hold the
    # other columns of the same 2000 pairs: one all-reduce of f32[2000] over y.
    # The contracted dimension is split, so the output is reduced; the inputs
    # never move: no all-gather.
    assert found == {"all-reduce": Collective("all-reduce", 1, 2000 * F32, (("y",),))}

    out = jax.block_until_ready(dots(a, b))
    assert out.shape == (4000,) and out.sharding.spec == P("x")
    one = jax.devices()[0]
    expected = jax.jit(jax.vmap(jnp.vdot))(jax.device_put(a, one), jax.device_put(b, one))
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=1e-5, atol=1e-3)


# -- explain(): the report ------------------------------------------------------------
def test_explain_counts_each_devices_share():
    mesh = make_mesh({"data": 2, "model": 4})
    model = ms.mlp(SIZES, key=jax.random.key(0), axes=MEGATRON)
    report = explain(model, mesh, RULES_2D)
    assert isinstance(report, Report) and report.collectives is None
    assert report.mesh == {"data": 2, "model": 4}
    w1, _, w2, b2 = report.rows
    assert (w1.path, w1.shape, w1.logical_axes) == ("layers[0].weight", (784, 512), ("embed", "mlp"))
    assert w1.spec == P(None, "model")
    assert w1.block_shape == (784, 128) and w1.dtype == "float32"
    # Split 4 ways over "model", replicated over "data": a quarter per device.
    assert w1.bytes == 784 * 512 * F32 and w1.device_bytes == w1.bytes // 4
    assert (w2.spec, w2.block_shape, w2.device_bytes) == (P("model", None), (128, 10), w2.bytes // 4)
    assert b2.spec == P(None) and b2.device_bytes == b2.bytes == 10 * F32  # replicated: whole
    assert report.total_bytes == tree_bytes(model) == 1_628_200
    assert report.device_bytes == sum(row.device_bytes for row in report.rows) == 407_080

    text = str(report)
    for row in report.rows:
        assert row.path in text and str(row.spec) in text
    assert "P(None, 'model')" in text and "(784, 128)" in text
    assert "1.6 MB unsharded, 407.1 kB per device" in text
    assert "collectives" not in text


def test_explain_with_a_step_lists_its_collectives():
    mesh = make_mesh({"data": 2, "model": 4})
    args = model, *_ = example(axes=MEGATRON)
    report = explain(model, mesh, RULES_2D, step=train_step, args=args)
    expected = collectives(Sharded(mesh, RULES_2D)(train_step).lower(*args))
    assert report.collectives == expected
    assert report.collectives["all-reduce"].bytes == 32 * 10 * F32 + report.device_bytes + F32
    assert "collectives of train_step:" in str(report)
    assert summary(expected).splitlines()[0] in str(report)
    # An already-Sharded function is lowered as it is.
    sharded = Sharded(mesh, RULES_2D)(train_step)
    assert explain(model, mesh, RULES_2D, step=sharded, args=args).collectives == expected
    with pytest.raises(TypeError, match="args"):
        explain(model, mesh, RULES_2D, step=train_step)


def test_explain_covers_every_leaf_of_any_tree():
    # An optimizer state with momentum: the velocities are shaped like the
    # model and sharded like it; the step counter is a replicated scalar.
    mesh = make_mesh({"data": 2, "model": 4})
    model = ms.mlp(SIZES, key=jax.random.key(0), axes=MEGATRON)
    state = ms.SGD(0.1, momentum=0.9).init(model)
    report = explain(state, mesh, RULES_2D)
    assert [row.path for row in report.rows] == [
        "step",
        "velocity.layers[0].weight",
        "velocity.layers[0].bias",
        "velocity.layers[2].weight",
        "velocity.layers[2].bias",
    ]
    assert report.rows[0].shape == () and report.rows[0].dtype == "int32" and report.rows[0].device_bytes == 4
    assert report.rows[1].spec == P(None, "model")


def test_explain_renders_with_rich():
    pytest.importorskip("rich")
    from rich.console import Console

    mesh = make_mesh({"data": 2, "model": 4})
    args = model, *_ = example(axes=MEGATRON)
    report = explain(model, mesh, RULES_2D, step=train_step, args=args)
    console = Console(record=True, width=200)
    console.print(report)
    text = console.export_text()
    assert "layers[0].weight" in text and "P(None, 'model')" in text and "(784, 128)" in text
    assert "all-reduce" in text and "per device" in text
    assert "<table" in report._repr_html_() or "<pre" in report._repr_html_()
