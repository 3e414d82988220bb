"""Every bad input to the library is named before any work starts: what, where, how to fix.

One row per input: the call, the exception type, and words its message must
hold. The calls are cheap (no data, no compile) because the checks run first.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import minishard as ms
from minishard.layers import Layer
from minishard.losses import accuracy, cross_entropy, one_hot
from minishard.optim import SGD, exponential_decay
from minishard.rules import AxisRules, ShardingError
from minishard.tree import count_params, tree_bytes

KEY = jax.random.key(0)
MESH = ms.make_mesh({"data": 2, "model": 4})


class Forgetful(Layer):
    param_fields = ("w", "b")

    def __init__(self):
        self.w = jnp.ones(2)


def layer_class(**fields):
    return type("Bad", (Layer,), fields)


ROWS = [
    # layers
    (
        lambda: ms.Linear(2, 3, key=KEY, axes="mlp"),
        TypeError,
        ["axes must be a tuple of 2 logical axes", "'mlp'"],
    ),
    (
        lambda: ms.Linear(2, 3, key=KEY, axes=None),
        TypeError,
        ["axes must be a tuple of 2 logical axes", "None"],
    ),
    (lambda: ms.Linear(2, 3, key=KEY, axes=("embed", 3)), TypeError, ["logical axes (str or None)", "3"]),
    (lambda: ms.Linear(2, 3, key=0), TypeError, ["Linear: key must be a PRNG key", "jax.random.key(0)"]),
    (lambda: ms.Linear(2, 3, key=KEY, scale="big"), TypeError, ["scale must be a finite number", "'big'"]),
    (lambda: ms.mlp("784,10", key=KEY), TypeError, ["sizes must be a list of ints", "'784,10'"]),
    (lambda: layer_class(param_fields="w"), TypeError, ["param_fields must be a tuple", "('w',)"]),
    (lambda: layer_class(param_fields=("w",), static_fields=("w",)), TypeError, ["in both param_fields"]),
    (Forgetful, TypeError, ["Forgetful.__init__ never set ['b']"]),
    (lambda: ms.mlp([2, 2], key=KEY)([1.0, 2.0]), TypeError, ["takes an array", "list"]),
    (lambda: ms.mlp([2, 2], key=KEY)("ab"), TypeError, ["takes an array", "str"]),
    (lambda: ms.megatron_axes(0), ValueError, ["at least one Linear", "num_linear=0"]),
    # static data
    (lambda: layer_class(static_fields=("rate",), __init__=_set_rate)(), ValueError, ["Bad.rate is NaN"]),
    # meshes and rules
    (lambda: ms.make_mesh({"data": -2, "model": 4}), ShardingError, ["positive ints", "data=-2"]),
    (lambda: ms.make_mesh((2, 4), ("data", "data")), ShardingError, ["'data'] named twice"]),
    (lambda: AxisRules.from_pairs([("mlp",)]), ShardingError, ["(logical axis, mesh axes) pairs"]),
    (lambda: AxisRules.from_pairs("mlp"), ShardingError, ["(logical axis, mesh axes) pairs"]),
    (lambda: AxisRules(mlp=("model", "model")), ShardingError, ["names a mesh axis twice"]),
    (lambda: AxisRules(mlp="model").spec("mlp"), ShardingError, ["for one dimension write ('mlp',)"]),
    (
        lambda: ms.Sharded(MESH, AxisRules(batch="data"), batch_axis="rows"),
        ShardingError,
        ["batch_axis='rows'"],
    ),
    # losses
    (lambda: one_hot(jnp.array([0.0, 1.0]), 3), TypeError, ["labels must be integers", "float32"]),
    (lambda: one_hot(jnp.array([0, 1]), 0), ValueError, ["num_classes must be an int >= 1", "0"]),
    (
        lambda: cross_entropy(jnp.zeros((4, 3)), jnp.zeros((4, 1))),
        ValueError,
        ["(4, 3)", "(4, 1)", "one_hot"],
    ),
    (
        lambda: accuracy(jnp.zeros((4, 3)), jnp.zeros((4, 1), jnp.int32)),
        ValueError,
        ["labels (4, 1)", "(4,)"],
    ),
    (lambda: accuracy(jnp.zeros((4, 3)), jnp.zeros(4, jnp.int32), jnp.ones(3)), ValueError, ["mask (3,)"]),
    # the optimizer
    (lambda: SGD(-0.1), ValueError, ["learning_rate", "-0.1"]),
    (lambda: SGD(0.0), ValueError, ["learning_rate", "> 0"]),
    (lambda: SGD(float("nan")), ValueError, ["learning_rate", "nan"]),
    (lambda: SGD("0.1"), ValueError, ["learning_rate", "'0.1'"]),
    (lambda: SGD(0.1, momentum=1.5), ValueError, ["momentum must be a number in [0, 1)", "1.5"]),
    (lambda: exponential_decay(0.1, -0.5, 100), ValueError, ["decay_rate", "-0.5"]),
    (lambda: exponential_decay(0.1, 0.5, 0), ValueError, ["decay_steps must be a positive int", "0"]),
    (
        lambda: SGD(0.1).update({"w": jnp.ones(2)}, {"w": jnp.ones(3)}, SGD(0.1).init({"w": jnp.ones(2)})),
        ValueError,
        ["grads do not match params at params.w", "(2,)", "(3,)"],
    ),
    # tree helpers
    (lambda: count_params({"a": "x"}), TypeError, ["leaf a is a str"]),
    (lambda: tree_bytes([1.5]), TypeError, ["leaf [0] is a float"]),
]


def _set_rate(self):
    self.rate = float("nan")


@pytest.mark.parametrize(("call", "kind", "words"), ROWS)
def test_bad_input_is_named(call, kind, words):
    with pytest.raises(kind) as error:
        call()
    for word in words:
        assert word in str(error.value), f"{word!r} not in: {error.value}"


def test_the_checked_mode_catches_label_values_under_jit():
    from jax.experimental import checkify

    def loss(logits, labels):
        return cross_entropy(logits, one_hot(labels, 3, checked=True))

    checked = jax.jit(checkify.checkify(loss))
    error, _ = checked(jnp.zeros((2, 3)), jnp.array([0, 2]))
    assert error.get() is None
    error, _ = checked(jnp.zeros((2, 3)), jnp.array([-1, 7]))
    assert "labels must lie in [0, 3), got values from -1 to 7" in error.get()
    assert np.isfinite(float(loss(jnp.zeros((2, 3)), jnp.array([0, 2]))))  # unchecked: no checkify needed
