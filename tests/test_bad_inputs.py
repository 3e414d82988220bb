"""Bad inputs to ``sharding`` are named before any work starts: what, where, how to fix.

One row per input: the call, the exception type, and words its message must
hold. The rows of tree, rules, layers, losses and optim live in their own test
files (``BAD_INPUTS`` there); these belong in ``tests/test_sharding.py``.
"""

import pytest

import minishard as ms
from minishard.rules import AxisRules, ShardingError

MESH = ms.make_mesh({"data": 2, "model": 4})

ROWS = [
    (lambda: ms.make_mesh({"data": -2, "model": 4}), ShardingError, ["positive ints", "data=-2"]),
    (lambda: ms.make_mesh((2, 4), ("data", "data")), ShardingError, ["'data'] named twice"]),
    (
        lambda: ms.Sharded(MESH, AxisRules(batch="data"), batch_axis="rows"),
        ShardingError,
        ["batch_axis='rows'"],
    ),
]


@pytest.mark.parametrize(("call", "kind", "words"), ROWS)
def test_bad_input_is_named(call, kind, words):
    with pytest.raises(kind) as error:
        call()
    for word in words:
        assert word in str(error.value), f"{word!r} not in: {error.value}"
