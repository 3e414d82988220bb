"""minishard.sharding: meshes, plans, shard and Sharded, checked against the arithmetic.

First, three ways to spread a training step over 8 devices (data, tensor, 2-D).

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
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from models import BATCH, F32, MEGATRON, SIZES, example, forward, numpy_mlp, train_step
from named import assert_named

import minishard as ms
from minishard.census import Collective, bytes_by_mesh_axes, collectives
from minishard.report import explain
from minishard.rules import AxisRules, ShardingError
from minishard.sharding import Sharded, make_mesh, named_shardings, partition_specs
from minishard.tree import named_leaves, tree_bytes

MESH = make_mesh({"data": 2, "model": 4})
RULES = AxisRules(batch="data", embed=None, mlp="model")


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
    ids=["dp", "tp", "2d"],
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
    assert shardings == specs  # the updated model keeps its sharding


# -- errors: what and where, before any work ---------------------------------------
class WrongAxesCount(ms.Layer):
    param_fields = ("w",)

    def __init__(self) -> None:
        self.w = np.zeros((2, 3), np.float32)

    def param_logical_axes(self):
        return {"w": ("mlp",)}


TENSOR_RULES = AxisRules(embed=None, mlp="tensor")  # no mesh axis is called "tensor"
UNKNOWN_MESH_AXIS = (
    r"rule 'mlp' -> 'tensor' names mesh axis 'tensor', but the mesh has axes \('data', 'model'\)"
)
MODEL = numpy_mlp([8, 16, 8], axes=[("embed", "mlp"), ("mlp", "embed")])
X = np.ones((4, 8), np.float32)

ERRORS = [
    pytest.param(lambda: TENSOR_RULES.spec(("mlp",), MESH), UNKNOWN_MESH_AXIS, id="rule-axis-spec"),
    pytest.param(lambda: ms.shard(MODEL, MESH, TENSOR_RULES), UNKNOWN_MESH_AXIS, id="rule-axis-shard"),
    pytest.param(lambda: ms.Sharded(MESH, TENSOR_RULES), UNKNOWN_MESH_AXIS, id="rule-axis-Sharded"),
    pytest.param(
        lambda: AxisRules(mlp=("data", "tensor")).spec(("mlp",), MESH),
        r"names mesh axis 'tensor'",
        id="rule-axis-in-tuple",
    ),
    pytest.param(
        lambda: AxisRules(mlp=3),
        r"rule 'mlp' -> 3 must map a logical axis \(str\) to a mesh axis name",
        id="rule-not-a-name",
    ),
    pytest.param(
        lambda: AxisRules(embed=None).spec(("embed", "mlp")),
        r"logical axis 'mlp' \(in \('embed', 'mlp'\)\) has no rule; add one, e\.g\. AxisRules\(mlp='model'\)",
        id="no-rule",
    ),
    pytest.param(
        lambda: AxisRules(embed=None).spec(("mlp",), MESH),
        r"'mlp' .* has no rule nor a mesh axis \('data', 'model'\)",
        id="no-rule-with-mesh",
    ),
    pytest.param(
        lambda: ms.shard(MODEL, MESH, AxisRules(embed=None)),
        r"^layers\[0\]\.weight: logical axis 'mlp'",
        id="no-rule-names-leaf",
    ),
    pytest.param(
        lambda: AxisRules(a="model", b="model").spec(("a", "b")),
        r"dimension 1 \('b'\) maps to a mesh axis that another dimension already uses.*only once",
        id="mesh-axis-twice",
    ),
    pytest.param(
        lambda: AxisRules(mlp="model").spec(("mlp", "mlp")),
        r"\['mlp'\] name more than one dimension",
        id="logical-axis-twice",
    ),
    pytest.param(
        lambda: partition_specs(WrongAxesCount(), AxisRules(mlp=None)),
        r"^w: logical axes \('mlp',\) name 1 dims; its shape is \(2, 3\)",
        id="axes-count",
    ),
    pytest.param(
        lambda: ms.make_mesh({"data": 3}),
        r"needs 3 devices, but 8 cpu device\(s\) were given.*xla_force_host_platform_device_count=N",
        id="mesh-vs-devices",
    ),
    pytest.param(lambda: ms.make_mesh((2, 4)), r"needs one name per axis", id="mesh-without-names"),
    pytest.param(
        lambda: ms.make_mesh({1: 8}),
        r"^make_mesh: axis names must be str, got 1 in \(1,\)$",
        id="mesh-int-axis-name",
    ),
    pytest.param(
        lambda: ms.make_mesh({}),
        r"^make_mesh: the mesh has no axes; name at least one, e\.g\. make_mesh\(\{'data': 8\}\)$",
        id="mesh-without-axes",
    ),
    pytest.param(
        lambda: ms.make_mesh({"data": 1}, devices=[]),
        r"^make_mesh: no devices were given for mesh \{'data': 1\}; pass some \(jax\.devices\(\)\), "
        r"or leave devices=None for all of them$",
        id="mesh-without-devices",
    ),
    pytest.param(
        lambda: named_shardings({"w": P("data"), "b": "model"}, MESH),
        r"^named_shardings: b is 'model' \(str\), not a PartitionSpec; use P\(\.\.\.\) \(None for an "
        r"unspecified leaf\)$",
        id="named-shardings-not-a-spec",
    ),
    pytest.param(
        lambda: named_shardings({"layers": [P(None, ("data", "modle"))]}, MESH),
        r"^named_shardings: layers\[0\]: P\(None, \('data', 'modle'\)\) names mesh axis 'modle', which the "
        r"mesh \{'data': 2, 'model': 4\} lacks$",
        id="named-shardings-unknown-mesh-axis",
    ),
    pytest.param(
        lambda: ms.Sharded(MESH, RULES, donate_argnums=2)(forward),
        r"^forward: donate_argnums=2 names argument 2, but forward takes 2 positional arguments "
        r"\(model, x\)$",
        id="donate-out-of-range",
    ),
    pytest.param(
        lambda: ms.Sharded(MESH, RULES, donate_argnums=(0, -1))(forward),
        r"^forward: donate_argnums=\(0, -1\) must be non-negative ints \(argument positions\); forward "
        r"takes 2 positional arguments$",
        id="donate-negative",
    ),
    pytest.param(
        lambda: ms.Sharded(MESH, RULES, donate_argnums="0")(forward),
        r"^forward: donate_argnums='0' must be non-negative ints",
        id="donate-not-an-int",
    ),
    pytest.param(
        lambda: ms.shard(numpy_mlp([8, 16, 6], axes=[("embed", "mlp")] * 2), MESH, RULES),
        r"^layers\[2\]\.weight: shape \(16, 6\), dimension 1 \(logical axis 'mlp'\) has size 6, "
        r"which mesh axis 'model'=4 cannot split evenly; choose sizes divisible by 4",
        id="indivisible",
    ),
    pytest.param(
        lambda: ms.shard(
            numpy_mlp([8, 12], [("embed", "mlp")]), MESH, AxisRules(mlp=("data", "model"), embed=None)
        ),
        r"^layers\[0\]\.weight: .* size 12, which mesh axis 'data'=2, 'model'=4 cannot split evenly; .* by 8",
        id="indivisible-over-two-axes",
    ),
    pytest.param(
        lambda: ms.Sharded(MESH, RULES)(forward)(MODEL, np.ones((3, 8), np.float32)),
        r"^forward: argument x: shape \(3, 8\), dimension 0 \(logical axis 'batch'\) has size 3, "
        r"which mesh axis 'data'=2",
        id="batch-indivisible",
    ),
    pytest.param(
        lambda: ms.Sharded(MESH, RULES)(forward)(jax.device_put(MODEL, NamedSharding(MESH, P())), X),
        r"^forward: argument model\.layers\[0\]\.weight: is committed to NamedSharding\(.*spec=P\(\).*\), "
        r"but Sharded derived NamedSharding\(.*spec=P\(None, 'model'\).*\)\. Place it with minishard\.shard",
        id="committed-elsewhere",
    ),
]


@pytest.mark.parametrize(("make", "message"), ERRORS)
def test_sharding_errors_say_what_and_where(make, message):
    with pytest.raises(ShardingError, match=message):
        make()


def scaled(model, scale):
    return model(X) * scale


def test_a_sharding_error_keeps_why_and_fix_apart_through_every_rewording():
    with pytest.raises(ms.ShardingError) as caught:
        ms.Sharded(MESH, RULES)(forward)(MODEL, np.ones((3, 8), np.float32))
    error = caught.value  # what costs.compare reads: why, without the fix
    assert error.why.startswith("forward: argument x: shape (3, 8), dimension 0 (logical axis 'batch')")
    assert error.fix == "choose sizes divisible by 2 or change the rules"
    assert str(error) == f"{error.why}; {error.fix}"


@pytest.mark.parametrize("first", [None, 2.0], ids=["first-call", "cached"])
def test_a_string_argument_is_named_by_its_parameter(first):
    step = ms.Sharded(MESH, RULES)(scaled)
    if first is not None:  # a scalar first: the string then meets the cached jit
        jax.block_until_ready(step(MODEL, first))
    with pytest.raises(
        TypeError,
        match=r"^scaled: argument scale: is str 'abc', not an array; a Sharded function takes arrays \(or "
        r"pytrees of them\): pass other values through functools\.partial or a closure$",
    ):
        step(MODEL, "abc")


def test_lower_raises_the_same_named_error_as_a_call():
    step = ms.Sharded(MESH, RULES)(forward)
    jax.block_until_ready(step(MODEL, X))  # the structure is cached: a batch of 3 meets jit's own check
    bad = np.ones((3, 8), np.float32)
    expected = r"^forward: argument x: shape \(3, 8\), dimension 0 \(logical axis 'batch'\) has size 3"
    for how in (step, step.lower, ms.Sharded(MESH, RULES)(forward).lower):
        with pytest.raises(ShardingError, match=expected):
            how(MODEL, bad)


# -- Explicit meshes: the types its shardings imply, however the inputs were placed ---------
def test_an_explicit_mesh_traces_sharded_types_for_unplaced_inputs_too():
    mesh = make_mesh({"data": 2, "model": 4}, explicit=True)
    seen = []

    def forward(model, x):
        seen.append((jax.typeof(model[0].weight), jax.typeof(x)))
        return model(x)

    step = Sharded(mesh, RULES)(forward)
    model = numpy_mlp([8, 16, 8], axes=MEGATRON)
    jax.block_until_ready(step(model, X))  # numpy: unplaced
    jax.block_until_ready(step(ms.shard(model, mesh, RULES), jax.device_put(X, step.config.batch_sharding)))
    assert len(seen) >= 2 and len(set(seen)) == 1, seen
    weight, x = seen[0]
    assert (str(weight), str(x)) == ("float32[8,16@model]", "float32[4@data,8]")


class Bilinear(ms.Layer):
    """Contracts a split dimension without saying where its output goes: ambiguous when Explicit."""

    param_fields = ("weight",)

    def __init__(self):
        self.weight = np.ones((16, 8), np.float32)

    def __call__(self, x):
        return x @ self.weight

    def param_logical_axes(self):
        return {"weight": ("mlp", "embed")}


def test_an_ambiguous_contraction_is_named_for_unplaced_inputs_too():
    model = ms.Sequential([numpy_mlp([8, 16], [("embed", "mlp")])[0], Bilinear()])  # NumPy: unplaced
    step = Sharded(make_mesh({"data": 2, "model": 4}, explicit=True), RULES)(forward)
    with pytest.raises(ShardingError, match=r"^forward: in model\.layers\[1\] \(Bilinear\): Contracting"):
        step(model, X)


def test_a_renamed_batch_axis_on_an_explicit_mesh_trains_like_the_auto_mesh():
    args = example(axes=MEGATRON)
    auto = Sharded(make_mesh({"data": 2, "model": 4}), RULES_2D)(train_step)
    rows_rules = AxisRules(rows="data", embed=None, mlp="model")  # no rule names "batch"
    explicit = make_mesh({"data": 2, "model": 4}, explicit=True)
    rows = Sharded(explicit, rows_rules, batch_axis="rows")(train_step)
    assert rows.specs(*args).inputs[2] == P("data")  # the batch is split, over the renamed axis's rule
    results = []
    for step in (auto, rows):
        state = args
        for _ in range(2):
            state = (*jax.block_until_ready(step(*state))[:2], *args[2:])
        results.append(state[:2])
    assert_trees_close(*results)


def test_sharded_refuses_a_mesh_that_mixes_auto_and_explicit_axes():
    mixed = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit, AxisType.Auto))
    with pytest.raises(ShardingError, match=r"mix Auto and Explicit.*explicit=True"):
        Sharded(mixed, RULES)


def test_plan_is_one_walk_with_specs_and_blocks():
    model = numpy_mlp([8, 16, 8], axes=[("embed", "mlp"), ("mlp", "embed")])
    found = ms.plan(model, MESH, RULES)
    flat = jax.tree_util.tree_flatten  # Layers have no __eq__: compare leaves and structure
    assert flat(found.specs) == flat(partition_specs(model, RULES, MESH))
    assert [(leaf.path, leaf.spec, leaf.shard_shape) for leaf in found.leaves] == [
        ("layers[0].weight", P(None, "model"), (8, 4)),
        ("layers[0].bias", P("model"), (4,)),
        ("layers[2].weight", P("model", None), (4, 8)),
        ("layers[2].bias", P(None), (8,)),
    ]


def test_lower_and_specs_reuse_the_cached_call_path():
    step = Sharded(MESH, RULES)(forward)
    model, x = numpy_mlp([8, 16, 8], axes=[("embed", "mlp"), ("mlp", "embed")]), np.ones((4, 8), np.float32)
    assert step.specs(model, x).inputs[1] == P("data")
    step.lower(model, x)
    jax.block_until_ready(step(model, x))
    assert len(step._plans) == 1  # specs, lower and the call built one jit between them


def test_a_donated_model_used_again_is_named():
    step = Sharded(MESH, RULES, donate_argnums=0)(lambda model, x: (model, model(x)))
    model = ms.shard(numpy_mlp([8, 16, 8], axes=[("embed", "mlp"), ("mlp", "embed")]), MESH, RULES)
    jax.block_until_ready(step(model, np.ones((4, 8), np.float32)))
    with pytest.raises(ShardingError, match=r"argument model\.layers\[0\]\.weight: was deleted.*donated"):
        step(model, np.ones((4, 8), np.float32))


def test_an_explicit_batch_axis_must_be_known():
    with pytest.raises(ShardingError, match=r"batch_axis='rows' has no rule .* and is no mesh axis"):
        Sharded(MESH, RULES, batch_axis="rows")


def test_sharding_error_is_a_value_error():
    assert issubclass(ShardingError, ValueError)


def test_an_indivisible_output_layer_is_named_before_compiling():
    def grow_model():
        return ms.mlp([8, 6, 8], key=jax.random.key(0), axes=[("embed", "mlp"), ("mlp", "embed")])

    expected = r"grow_model: output layers\[0\]\.weight: shape \(8, 6\), dimension 1"
    with pytest.raises(ShardingError, match=expected):
        ms.Sharded(MESH, AxisRules(embed=None, mlp="model"))(grow_model).specs()


def test_sharded_takes_positional_arguments_only():
    def forward(model, x):
        return model(x)

    with pytest.raises(TypeError, match=r"pass arguments by position.*\['x'\]"):
        ms.Sharded(MESH, RULES)(forward)(numpy_mlp([8, 8], [("embed", "mlp")]), x=np.ones((2, 8)))


class Bank(ms.Layer):
    """A layer whose parameter is a dict of arrays that no axis names annotate."""

    param_fields = ("weights",)

    def __init__(self):
        self.weights = {"w": np.ones((8, 4), np.float32)}

    def __call__(self, x):
        return x @ self.weights["w"]


def test_unannotated_arrays_inside_a_layer_are_replicated_by_shard_and_sharded_alike():
    bank = ms.shard(Bank(), MESH, RULES)
    assert bank.weights["w"].sharding.spec == P()
    step = ms.Sharded(MESH, RULES)(lambda layer, x: layer(x))
    assert step.specs(bank, np.ones((4, 8), np.float32)).inputs[0].weights["w"] == P()
    assert step(bank, np.ones((4, 8), np.float32)).shape == (4, 4)  # no "committed to" mismatch


BAD_INPUTS = [
    (lambda: ms.make_mesh({"data": -2, "model": 4}), ShardingError, ["positive ints", "data=-2"]),
    (lambda: ms.make_mesh((2, 4), ("data", "data")), ShardingError, ["'data'] named twice"]),
    (
        lambda: ms.Sharded(make_mesh({"data": 2, "model": 4}), AxisRules(batch="data"), batch_axis="rows"),
        ShardingError,
        ["batch_axis='rows'"],
    ),
]


@pytest.mark.parametrize(("call", "kind", "words"), BAD_INPUTS)
def test_bad_input_is_named(call, kind, words):
    assert_named(call, kind, words)
