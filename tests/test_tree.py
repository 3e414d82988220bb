"""minishard.tree: naming, counting and weighing the leaves of any pytree."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from named import assert_named
from strategies import EVERY_CONTAINER, build

import minishard
from minishard import mlp
from minishard.tree import count_params, named_leaves, path_str, tree_bytes

KEY = jax.random.key(0)


def test_tree_helpers_on_an_mlp():
    model = mlp([3, 4, 2], key=KEY)
    assert count_params(model) == 3 * 4 + 4 + 4 * 2 + 2
    assert tree_bytes(model) == 4 * count_params(model)
    assert [path for path, _ in named_leaves(model)] == [
        "layers[0].weight",
        "layers[0].bias",
        "layers[2].weight",
        "layers[2].bias",
    ]


def test_tree_bytes_uses_each_leaf_dtype():
    tree = {"a": jnp.zeros((2, 3), jnp.bfloat16), "b": np.zeros(5, np.int8), "c": jnp.zeros((), jnp.float32)}
    assert count_params(tree) == 6 + 5 + 1
    assert tree_bytes(tree) == 6 * 2 + 5 * 1 + 4


def test_named_leaves_in_every_kind_of_container():
    assert [path for path, _ in named_leaves(build(EVERY_CONTAINER, KEY))] == [
        "extras[0][0].left.weight",
        "extras[0][0].left.bias",
        "extras[0][0].right.items[1].weight",
        "extras[0][0].right.items[1].bias",
        "model.layers[0].weight",
        "model.layers[0].bias",
        "model.layers[2].weight",
    ]


def test_named_leaves_of_a_bare_array_is_the_root():
    x = jnp.ones(3)
    [(path, leaf)] = named_leaves(x)
    assert path == "<root>" and leaf is x


def test_path_str_writes_name_keys_as_attributes_and_keeps_brackets_otherwise():
    tree = {"model": [1], "a b": 2, "n": {3: 4}}
    paths = [path_str(path) for path, _ in jax.tree_util.tree_leaves_with_path(tree)]
    assert paths == ["['a b']", "model[0]", "n[3]"]


@pytest.mark.parametrize("helper", [count_params, tree_bytes])
def test_helpers_refuse_leaves_that_are_not_arrays(helper):
    with pytest.raises(TypeError, match=r"leaf b\[0\] is a str \('x'\), not an array"):
        helper({"a": jnp.ones(2), "b": ["x"]})


def test_path_str_writes_a_path_below_a_named_root():
    tree = {"w": [1], "a b": 2}
    paths = [path_str(path, root="params") for path, _ in jax.tree_util.tree_leaves_with_path(tree)]
    assert paths == ["params['a b']", "params.w[0]"]
    assert path_str((), root="params") == "params"


@pytest.mark.parametrize(
    ("helper", "tree", "where", "keys"),
    [
        (count_params, {1: jnp.ones(1), "a": jnp.ones(2)}, "<root>", "[1, 'a']"),
        (named_leaves, {"m": [{"a": jnp.ones(1), 1: jnp.ones(2)}]}, "m[0]", "['a', 1]"),
        (tree_bytes, {"m": {2: jnp.ones(1), "b": jnp.ones(2)}, "n": {3: jnp.ones(1)}}, "m", "[2, 'b']"),
    ],
)
def test_helpers_name_a_dict_whose_keys_cannot_be_sorted(helper, tree, where, keys):
    with pytest.raises(TypeError) as error:
        helper(tree)
    assert str(error.value) == (
        f"{helper.__name__}: the dict at {where} has keys of different types ({keys}), which cannot "
        "be sorted, and JAX flattens a dict in sorted key order; use keys of one type (all str, for example)"
    )


def test_no_module_writes_a_leaf_path_but_path_str():
    package = Path(minishard.__file__).parent
    writers = [path for path in package.rglob("*.py") if "keystr(" in path.read_text()]
    assert writers == []


def test_another_flatten_error_comes_through_unchanged():
    @jax.tree_util.register_pytree_node_class
    class Broken:
        def tree_flatten(self):
            raise ValueError("Broken cannot flatten")

        @classmethod
        def tree_unflatten(cls, aux_data, children):
            return cls()

    with pytest.raises(ValueError, match=r"^Broken cannot flatten$"):
        count_params({"a": Broken()})


# -- bad inputs: each named before any work starts (the call, the exception, words its message holds)
BAD_INPUTS = [
    (lambda: count_params({"a": "x"}), TypeError, ["leaf a is a str"]),
    (lambda: tree_bytes([1.5]), TypeError, ["leaf [0] is a float"]),
]


@pytest.mark.parametrize(("call", "kind", "words"), BAD_INPUTS)
def test_bad_input_is_named(call, kind, words):
    assert_named(call, kind, words)
