"""Layers are pytrees: structure, transformations, construction checks, tree helpers.

* Structure: random nestings of layers in every kind of container flatten and
  unflatten to the same tree, ``tree_map`` keeps static data, and the leaves
  JAX finds (paths, shapes, counts, bytes) are the ones the description says.
* Transformations: ``jit``, ``grad``, ``vmap`` and ``jacobian`` take and give
  back models; ``jit`` recompiles when static data changes and only then.
* Construction: a layer refuses bad fields and bad inputs with messages that
  name the culprit, but JAX's own rebuilding (``tree_unflatten``) checks nothing
  and never runs ``__init__``.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P
from named import assert_named
from strategies import (
    EVERY_CONTAINER,
    Box,
    assert_trees_close,
    assert_trees_equal,
    blueprints,
    build,
    expected_leaves,
    mlp_sizes,
    seeds,
)

import minishard as ms
from minishard import Layer, Linear, Sequential, cross_entropy, mlp
from minishard.sharding import partition_specs
from minishard.tree import count_params, named_leaves, tree_bytes

KEY = jax.random.key(0)
tree_leaves = jax.tree_util.tree_leaves
tree_structure = jax.tree_util.tree_structure


class Scale(Layer):
    """A user layer: one parameter, one static field, and a count of ``__init__`` calls."""

    param_fields = ("factor",)
    static_fields = ("name",)
    inits = 0

    def __init__(self, factor, name="scale"):
        type(self).inits += 1
        self.factor = factor
        self.name = name

    def __call__(self, x):
        return self.factor * x


def for_any_model(test):
    """Run ``test(blueprint)`` on random model descriptions, and always on ``EVERY_CONTAINER``."""
    return given(blueprint=blueprints())(example(blueprint=EVERY_CONTAINER)(test))


def sum_of_squares(tree):
    return sum((jnp.sum(leaf**2) for leaf in tree_leaves(tree)), start=jnp.zeros(()))


# -- structure ---------------------------------------------------------------
@for_any_model
def test_flatten_unflatten_round_trip(blueprint):
    tree = build(blueprint, KEY)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    rebuilt = jax.tree_util.tree_unflatten(treedef, leaves)
    assert tree_structure(rebuilt) == treedef
    assert_trees_equal(rebuilt, tree)


@for_any_model
def test_tree_map_doubles_every_parameter_and_keeps_static_data(blueprint):
    tree = build(blueprint, KEY)
    doubled = jax.tree_util.tree_map(lambda a: 2 * a, tree)
    assert tree_structure(doubled) == tree_structure(tree)
    for new, old in zip(tree_leaves(doubled), tree_leaves(tree), strict=True):
        np.testing.assert_array_equal(new, 2 * np.asarray(old))


@for_any_model
def test_leaves_match_the_description(blueprint):
    tree = build(blueprint, KEY)
    expected = expected_leaves(blueprint)
    size = sum(int(np.prod(shape)) for _, shape in expected)
    assert len(tree_leaves(tree)) == len(expected)
    assert [(path, leaf.shape) for path, leaf in named_leaves(tree)] == [
        (path.removeprefix("."), shape) for path, shape in expected
    ]
    assert count_params(tree) == size
    assert tree_bytes(tree) == 4 * size  # float32


@for_any_model
def test_unflatten_accepts_placeholder_leaves(blueprint):
    # JAX rebuilds trees around non-arrays (object(), ints for in_axes, tracers):
    # if tree_unflatten ran __init__ or the __setattr__ checks, this would raise.
    treedef = tree_structure(build(blueprint, KEY))
    placeholders = [object() for _ in range(treedef.num_leaves)]
    rebuilt = jax.tree_util.tree_unflatten(treedef, placeholders)
    assert tree_structure(rebuilt) == treedef
    assert all(a is b for a, b in zip(tree_leaves(rebuilt), placeholders, strict=True))


@for_any_model
def test_jit_and_grad_pass_any_nesting_through(blueprint):
    tree = build(blueprint, KEY)
    same, grads = jax.jit(lambda t: (t, jax.grad(sum_of_squares)(t)))(tree)
    assert_trees_equal(same, tree)
    assert_trees_close(grads, jax.tree_util.tree_map(lambda a: 2 * a, tree))


def test_static_data_is_part_of_the_treedef():
    def linear(axes):
        return Linear(3, 2, key=KEY, axes=axes)

    assert tree_structure(linear(("embed", "mlp"))) == tree_structure(linear(("embed", "mlp")))
    assert tree_structure(linear(("embed", "mlp"))) != tree_structure(linear(("mlp", "embed")))
    assert tree_structure(Box([], "a")) != tree_structure(Box([], "b"))
    assert tree_structure(Linear(3, 2, key=KEY)) != tree_structure(Linear(3, 2, key=KEY, use_bias=False))


def test_tree_unflatten_and_transformations_never_call_init():
    model = Sequential([Scale(jnp.ones(2)), Scale(jnp.full(2, 3.0), name="triple")])
    before = Scale.inits
    treedef = tree_structure(model)
    rebuilt = jax.tree_util.tree_unflatten(treedef, [object()] * treedef.num_leaves)
    grads = jax.grad(lambda m: jnp.sum(m(jnp.arange(2.0))))(model)
    batched = jax.vmap(model)(jnp.ones((4, 2)))
    jax.jit(lambda m: m)(model)
    assert Scale.inits == before
    assert type(rebuilt[1]) is Scale and rebuilt[1].name == "triple"
    np.testing.assert_array_equal(grads[0].factor, [0.0, 3.0])  # d/d a of sum(b * a * x) = b * x
    np.testing.assert_array_equal(batched, np.full((4, 2), 3.0))


# -- transformations over models ---------------------------------------------
def reference_mlp(params, x):
    """``minishard.mlp``'s network written on a plain list of (weight, bias)."""
    *hidden, (w_out, b_out) = params
    for w, b in hidden:
        x = jax.nn.swish(x @ w + b)
    return x @ w_out + b_out


def linear_params(model):
    return [(layer.weight, layer.bias) for layer in model if isinstance(layer, Linear)]


@given(sizes=mlp_sizes(), seed=seeds)
def test_grad_wrt_a_model_is_a_model_matching_plain_jax(sizes, seed):
    model = mlp(sizes, key=jax.random.key(seed), scale=1.0)
    x = np.random.default_rng(seed).standard_normal((4, sizes[0]), np.float32)
    targets = np.eye(sizes[-1], dtype=np.float32)[np.arange(4) % sizes[-1]]
    grads, reference = jax.jit(
        lambda m: (
            jax.grad(lambda m: cross_entropy(m(x), targets))(m),
            jax.grad(lambda p: cross_entropy(reference_mlp(p, x), targets))(linear_params(m)),
        )
    )(model)
    assert type(grads) is Sequential
    assert tree_structure(grads) == tree_structure(model)
    assert_trees_close(linear_params(grads), reference, rtol=1e-6, atol=1e-7)


@given(sizes=mlp_sizes(), batch=st.integers(1, 4), seed=seeds)
def test_vmap_over_single_examples_equals_the_batched_call(sizes, batch, seed):
    model = mlp(sizes, key=jax.random.key(seed), scale=1.0)
    x = np.random.default_rng(seed).standard_normal((batch, sizes[0]), np.float32)
    one_by_one, batched = jax.jit(lambda m, x: (jax.vmap(m)(x), m(x)))(model, x)
    np.testing.assert_allclose(one_by_one, batched, rtol=1e-6, atol=1e-6)


def test_vmap_with_in_axes_over_a_stack_of_models():
    models = [Linear(3, 2, key=jax.random.key(i), scale=1.0) for i in range(4)]
    stacked = jax.tree_util.tree_map(lambda *leaves: jnp.stack(leaves), *models)
    in_axes = jax.tree_util.tree_map(lambda _: 0, models[0])  # a Linear whose leaves are ints
    x = jnp.arange(3.0)
    out = jax.vmap(lambda m, x: m(x), in_axes=(in_axes, None))(stacked, x)
    np.testing.assert_allclose(out, jnp.stack([m(x) for m in models]), rtol=1e-6)


def test_jacobian_of_a_linear_is_a_linear_of_jacobians():
    layer = Linear(3, 2, key=KEY)
    x = jnp.array([1.0, 2.0, 3.0])
    jac = jax.jacobian(lambda m: m(x))(layer)
    eye = np.eye(2)
    assert type(jac) is Linear and tree_structure(jac) == tree_structure(layer)
    np.testing.assert_array_equal(jac.bias, eye)  # dy_j/db_k = [j == k]
    np.testing.assert_array_equal(jac.weight, np.einsum("jk,i->jik", eye, x))  # dy_j/dW_ik = x_i [j == k]


def test_jacobian_from_model_to_model_nests_models():
    layer = Linear(2, 1, key=KEY)
    jac = jax.jacobian(lambda m: jax.tree_util.tree_map(lambda a: 3 * a, m))(layer)
    # Outer structure: the output. Each output leaf holds a Linear of derivatives.
    assert type(jac) is Linear and type(jac.weight) is Linear and type(jac.bias) is Linear
    np.testing.assert_array_equal(jac.weight.weight, 3 * np.eye(2).reshape(2, 1, 2, 1))
    np.testing.assert_array_equal(jac.weight.bias, np.zeros((2, 1, 1)))
    np.testing.assert_array_equal(jac.bias.bias, [[3.0]])


def test_jit_retraces_when_static_data_changes_and_only_then():
    traces = 0

    @jax.jit
    def forward(model, x):
        nonlocal traces
        traces += 1  # Python side effect: runs while tracing, not when cached code runs
        return model(x)

    x = jnp.ones((2, 3))
    layer = Linear(3, 2, key=KEY, axes=("embed", "mlp"))
    shifted = jax.tree_util.tree_map(lambda a: a + 1, layer)
    forward(layer, x)
    np.testing.assert_allclose(forward(shifted, x), layer(x) + 4, rtol=1e-6)  # 3 weights + 1 bias
    forward(Linear(3, 2, key=jax.random.key(7), axes=("embed", "mlp")), x)
    assert traces == 1
    forward(Linear(3, 2, key=KEY, axes=("mlp", "embed")), x)
    assert traces == 2


# -- construction checks -----------------------------------------------------
@pytest.mark.parametrize("shape", [(), (5,), (2, 4), (2, 3, 1)])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_linear_rejects_a_wrong_trailing_dimension(shape, jit):
    layer = Linear(3, 2, key=KEY)
    call = jax.jit(lambda m, x: m(x)) if jit else (lambda m, x: m(x))
    with pytest.raises(ValueError, match=re.escape(f"last dimension is 3, got shape {shape}")):
        call(layer, jnp.ones(shape))


@pytest.mark.parametrize(("n_in", "n_out", "field"), [(0, 2, "in_features"), (2, -1, "out_features")])
def test_linear_rejects_nonpositive_sizes(n_in, n_out, field):
    with pytest.raises(ValueError, match=f"{field} must be a positive int"):
        Linear(n_in, n_out, key=KEY)


@pytest.mark.parametrize("sizes", [[], [3]])
def test_mlp_needs_at_least_two_sizes(sizes):
    with pytest.raises(ValueError, match="at least two sizes"):
        mlp(sizes, key=KEY)


def test_mlp_rejects_unknown_activation_and_wrong_axes_count():
    with pytest.raises(ValueError, match="unknown activation 'gelu'"):
        mlp([2, 2], key=KEY, activation="gelu")
    with pytest.raises(ValueError, match="2 Linear layers need 2 axes pairs, got 1"):
        mlp([2, 3, 2], key=KEY, axes=[("embed", "mlp")])


@pytest.mark.parametrize(
    ("factor", "message"),
    [
        ([0.5, 2.0], r"Scale\.factor\[0\] is a float"),
        ("big", r"Scale\.factor is a str"),
        (1.5, r"Scale\.factor is a float"),
        ({"w": jnp.ones(2), "b": "x"}, r"Scale\.factor\.b is a str"),
    ],
)
def test_a_parameter_must_hold_arrays(factor, message):
    with pytest.raises(TypeError, match=message):
        Scale(factor)


def test_a_parameter_may_hold_numpy_arrays_and_nested_arrays():
    assert Scale(np.ones(2)).name == "scale"
    assert count_params(Scale({"w": jnp.ones(2), "b": (np.ones(3),)})) == 5


@pytest.mark.parametrize(
    ("name", "message"),
    [
        (jnp.ones(2), r"static field Scale\.name holds an array"),
        (np.ones(2), r"static field Scale\.name holds an array"),
        (["a", "b"], r"static field Scale\.name = \['a', 'b'\] is not hashable"),
        ({"a": 1}, r"static field Scale\.name = \{'a': 1\} is not hashable"),
    ],
)
def test_a_static_field_must_be_hashable_and_not_an_array(name, message):
    with pytest.raises(TypeError, match=message):
        Scale(jnp.ones(2), name=name)


def test_a_built_layer_is_immutable_and_says_how_to_change_it():
    layer = Scale(jnp.ones(2))
    with pytest.raises(AttributeError, match=r"cannot assign Scale\.factor.*layer\.replace\(factor=\.\.\.\)"):
        layer.factor = jnp.zeros(2)
    with pytest.raises(AttributeError, match=r"cannot assign Scale\.extra"):
        layer.extra = 1
    with pytest.raises(AttributeError, match=r"cannot delete Scale\.name"):
        del layer.name
    np.testing.assert_array_equal(layer.factor, jnp.ones(2))  # unchanged


def test_unflattened_and_subclassed_layers_are_frozen_too():
    rebuilt = jax.tree_util.tree_map(lambda a: 2 * a, Scale(jnp.ones(2)))  # via tree_unflatten
    with pytest.raises(AttributeError, match="immutable"):
        rebuilt.factor = jnp.zeros(2)

    class Named(Scale):
        static_fields = ("name", "tag")

        def __init__(self, factor):
            super().__init__(factor, name="n")  # the parent's __init__ must not freeze it early
            self.tag = "t"

    named = Named(jnp.ones(1))
    assert (named.name, named.tag) == ("n", "t")
    with pytest.raises(AttributeError, match="immutable"):
        named.tag = "u"


def test_replace_returns_a_checked_copy_with_the_same_treedef():
    layer = Linear(3, 2, key=KEY, axes=("embed", "mlp"))
    zeroed = layer.replace(bias=jnp.zeros(2))
    assert tree_structure(zeroed) == tree_structure(layer) and zeroed is not layer
    np.testing.assert_array_equal(zeroed.bias, np.zeros(2))
    np.testing.assert_array_equal(layer.bias, Linear(3, 2, key=KEY).bias)  # the original is untouched
    np.testing.assert_allclose(jax.jit(lambda m, x: m(x))(zeroed, jnp.ones(3)), jnp.ones(3) @ layer.weight)
    with pytest.raises(TypeError, match=r"Linear\.bias is a str"):
        layer.replace(bias="x")
    with pytest.raises(AttributeError, match=r"Linear\.colour is neither in param_fields"):
        layer.replace(colour=1)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"weight": jnp.ones((3, 3))}, "Linear.weight has shape (3, 3), but a Linear(4 -> 2) needs (4, 2)"),
        ({"weight": None}, "Linear.weight has shape None, but a Linear(4 -> 2) needs (4, 2)"),
        ({"bias": jnp.ones(4)}, "Linear.bias has shape (4,), but a Linear(4 -> 2) needs (2,)"),
        ({"in_features": 5}, "Linear.weight has shape (4, 2), but a Linear(5 -> 2) needs (5, 2)"),
    ],
)
def test_replace_runs_the_layer_check_on_the_copy(changes, message):
    layer = Linear(4, 2, key=KEY)
    with pytest.raises(ValueError) as error:
        layer.replace(**changes)
    assert str(error.value) == f"{message}; change the sizes with it, or build a new Linear"
    resized = layer.replace(in_features=3, weight=jnp.ones((3, 2)))  # together, they fit
    assert resized(jnp.ones(3)).shape == (2,)
    assert layer.replace(bias=None).param_logical_axes() == {"weight": (None, None)}


def test_replace_refuses_logical_axes_of_the_wrong_rank():
    with pytest.raises(ms.ShardingError) as error:
        Linear(4, 2, key=KEY).replace(logical_axes=("a",))
    assert str(error.value) == "Linear.logical_axes: logical axes ('a',) name 1 dims; its shape is (4, 2)"


def test_a_user_layer_check_runs_after_init_and_replace_but_never_in_jax_rebuilds():
    class Positive(Layer):
        param_fields = ("w",)
        checks = 0

        def __init__(self, w):
            self.w = w

        def check(self):
            type(self).checks += 1
            if not bool(jnp.all(self.w > 0)):
                raise ValueError("Positive.w must be > 0")

    layer = Positive(jnp.ones(2))
    with pytest.raises(ValueError, match=r"Positive\.w must be > 0"):
        Positive(-jnp.ones(2))
    with pytest.raises(ValueError, match=r"Positive\.w must be > 0"):
        layer.replace(w=jnp.zeros(2))
    before = Positive.checks
    jax.tree_util.tree_map(lambda a: -a, layer)  # tree_unflatten: no check, no __init__
    jax.jit(lambda m: m)(layer)
    assert Positive.checks == before


def test_a_donated_model_called_directly_names_the_parameter_and_donation():
    model = mlp([4, 3, 2], key=KEY)
    double = jax.jit(lambda m: jax.tree_util.tree_map(lambda a: 2 * a, m), donate_argnums=0)
    doubled = double(model)
    assert doubled(jnp.ones(4)).shape == (2,)  # the returned model is the one to call
    with pytest.raises(RuntimeError) as error:
        model(jnp.ones(4))
    assert str(error.value) == (
        "Linear(4 -> 3).weight was deleted: this model was donated to a jitted function (donate_argnums), "
        "which reused its arrays' memory for its outputs. Call the model that function returned, or do "
        "not donate this one"
    )


@pytest.mark.parametrize("axes", ["embed", ("embed", "mlp"), [None, ("mlp", "embed")]])
def test_mlp_axes_must_be_a_list_of_pairs(axes):
    with pytest.raises(TypeError) as error:
        mlp([2, 3, 2], key=KEY, axes=axes)
    assert str(error.value) == (
        f"mlp: axes must be a list with one (in, out) pair of logical axes per Linear, got {axes!r}; "
        "did you mean a list of tuples, such as [('embed', 'mlp'), ('mlp', 'classes')]?"
    )


def test_linear_axes_as_one_string_asks_for_a_tuple():
    with pytest.raises(ms.ShardingError) as error:
        Linear(2, 3, key=KEY, axes="mlp")
    assert str(error.value) == (
        "Linear: axes: logical axes must be a tuple with one name (or None) per dimension, got 'mlp' "
        "(one string: did you mean a tuple?); for 2 dimensions write ('mlp', ...)"
    )


def test_a_declared_field_never_assigned_is_named():
    class Forgetful(Layer):
        param_fields = ("w", "b")

        def __init__(self):
            self.w = jnp.ones(2)

    with pytest.raises(TypeError, match=r"Forgetful\.__init__ never set \['b'\]"):
        Forgetful()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"param_fields": "w"}, r"Bad\.param_fields must be a tuple of field names, got 'w'; .*\('w',\)"),
        (
            {"param_fields": ("w",), "static_fields": ("w",)},
            r"\['w'\] listed in both param_fields and static",
        ),
    ],
)
def test_field_lists_are_checked_when_the_class_is_defined(fields, message):
    with pytest.raises(TypeError, match=message):
        type("Bad", (Layer,), fields)


def test_param_logical_axes():
    assert Linear(3, 2, key=KEY, axes=("embed", "mlp")).param_logical_axes() == {
        "weight": ("embed", "mlp"),
        "bias": ("mlp",),
    }
    assert Linear(3, 2, key=KEY, use_bias=False).param_logical_axes() == {"weight": (None, None)}
    assert Scale(jnp.ones((2, 3))).param_logical_axes() == {}  # the default annotates nothing
    [leaf] = ms.plan(Scale(jnp.ones((2, 3))), None).leaves
    assert (leaf.logical_axes, leaf.spec) == ((None, None), ms.rules.P())  # so the plan replicates it


def test_residual_adds_its_input_and_is_planned_through_its_inner_layers():
    inner = ms.mlp([4, 8, 4], key=KEY, axes=[("embed", "mlp"), ("mlp", "embed")])
    block = ms.Residual(inner)
    x = jnp.arange(8.0).reshape(2, 4)
    np.testing.assert_allclose(block(x), x + inner(x))
    specs = partition_specs(block, ms.AxisRules(embed=None, mlp="model"))
    assert (specs.inner[0].weight, specs.inner[2].weight) == (P(None, "model"), P("model", None))
    grads = jax.grad(lambda b: jnp.sum(b(x)))(block)
    assert type(grads) is ms.Residual and grads.inner[0].weight.shape == (4, 8)


def test_a_plain_function_in_sequential_is_refused_with_the_fix():
    with pytest.raises(TypeError, match=r"Sequential.layers\[1\] is the function 'relu'.*such as ReLU\(\)"):
        ms.Sequential([ms.Linear(2, 2, key=jax.random.key(0)), jax.nn.relu])


def test_megatron_axes_needs_a_linear():
    assert ms.megatron_axes(2) == [("embed", "mlp"), ("mlp", "classes")]
    with pytest.raises(ValueError, match="megatron_axes: num_linear must be a positive int, got 0"):
        ms.megatron_axes(0)


# -- bad inputs: each named before any work starts (the call, the exception, words its message holds)
class Forgetful(Layer):
    param_fields = ("w", "b")

    def __init__(self):
        self.w = jnp.ones(2)


def layer_class(**fields):
    return type("Bad", (Layer,), fields)


def _set_rate(self):
    self.rate = float("nan")


BAD_INPUTS = [
    (
        lambda: Linear(2, 3, key=KEY, axes="mlp"),
        ms.ShardingError,
        ["Linear: axes: logical axes must be a tuple", "'mlp'"],
    ),
    (lambda: Linear(2, 3, key=KEY, axes=None), ms.ShardingError, ["logical axes must be a tuple", "None"]),
    (lambda: Linear(2, 3, key=KEY, axes=("embed", 3)), ms.ShardingError, ["[3] are not names (str) or None"]),
    (lambda: Linear(2, 3, key=KEY, axes=("embed",)), ms.ShardingError, ["name 1 dims; its shape is (2, 3)"]),
    (lambda: Linear(2, 3, key=0), TypeError, ["Linear: key must be a PRNG key", "jax.random.key(0)"]),
    (lambda: Linear(2, 3, key=KEY, scale="big"), TypeError, ["scale must be a finite number", "'big'"]),
    (lambda: mlp("784,10", key=KEY), TypeError, ["sizes must be a list of ints", "'784,10'"]),
    (lambda: layer_class(param_fields="w"), TypeError, ["param_fields must be a tuple", "('w',)"]),
    (lambda: layer_class(param_fields=("w",), static_fields=("w",)), TypeError, ["in both param_fields"]),
    (Forgetful, TypeError, ["Forgetful.__init__ never set ['b']"]),
    (lambda: mlp([2, 2], key=KEY)([1.0, 2.0]), TypeError, ["takes an array", "list"]),
    (lambda: mlp([2, 2], key=KEY)("ab"), TypeError, ["takes an array", "str"]),
    (lambda: ms.megatron_axes(0), ValueError, ["num_linear must be a positive int", "0"]),
    (lambda: layer_class(static_fields=("rate",), __init__=_set_rate)(), ValueError, ["Bad.rate is NaN"]),
]


@pytest.mark.parametrize(("call", "kind", "words"), BAD_INPUTS)
def test_bad_input_is_named(call, kind, words):
    assert_named(call, kind, words)
