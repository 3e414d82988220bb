"""minishard.constraints: one sharding environment, and ``constrain`` checked in and out of it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import minishard as ms
from minishard.constraints import _CURRENT, LogicalSharding, activation_axes, constrain
from minishard.rules import ShardingError

MESH = ms.make_mesh({"data": 2, "model": 4})
RULES = ms.AxisRules(batch="data", embed="model")


def pinned(x):
    return constrain(x * 2, ("batch", "embed"))


def test_constrain_is_exported_at_the_top():
    assert ms.constrain is constrain


def test_constrain_is_a_no_op_outside_a_context_and_pins_the_sharding_inside():
    x = jnp.ones((16, 8))
    assert constrain(x, ("batch", "embed")) is x
    step = ms.Sharded(MESH, RULES)(pinned)
    assert jax.block_until_ready(step(x)).sharding.spec == P("data", "model")
    with pytest.raises(ShardingError, match=r"constrain: logical axis 'vocab' .* has no rule"):
        ms.Sharded(MESH, RULES)(lambda x: constrain(x, ("batch", "vocab")))(x)


def test_sharded_sets_the_environment_it_built_while_it_traces():
    seen = []

    def step(x):
        seen.append((_CURRENT.get(), activation_axes(2, "embed")))
        return x

    sharded = ms.Sharded(MESH, ms.AxisRules(rows="data", embed="model"), batch_axis="rows")
    jax.block_until_ready(sharded(step)(np.ones((4, 8), np.float32)))
    assert seen and all(env is sharded.logical_sharding for env, _ in seen)
    assert {axes for _, axes in seen} == {("rows", "embed")}
    assert sharded.logical_sharding.batch_target == "data"
    assert sharded.batch_sharding.spec == P("data")
    assert _CURRENT.get() is None  # and unset after


def test_a_wrapped_jit_is_constrained_and_a_later_plain_jit_is_not():
    x = jnp.ones((16, 8))
    wrapped = jax.jit(LogicalSharding(MESH, RULES).wrap(pinned))
    assert jax.block_until_ready(wrapped(x)).sharding.spec == P("data", "model")
    assert "sharding_constraint" in wrapped.lower(x).as_text()
    # JAX caches a trace under the function it is given: the wrapper's is the wrapper's own.
    plain = jax.jit(pinned)
    assert "sharding_constraint" not in plain.lower(x).as_text()
    assert len(jax.block_until_ready(plain(x)).sharding.device_set) == 1


def test_a_sharded_trace_is_not_reused_by_a_later_plain_jit():
    x = jnp.ones((16, 8))
    jax.block_until_ready(ms.Sharded(MESH, RULES)(pinned)(x))
    assert "sharding_constraint" not in jax.jit(pinned).lower(x).as_text()


@pytest.mark.parametrize(
    ("axes", "message"),
    [
        (("batch",), r"^constrain: logical axes \('batch',\) name 1 dims; its shape is \(16, 8\)"),
        (("batch", "embed", None), r"^constrain: logical axes \('batch', 'embed', None\) name 3 dims; its"),
        ("batch", r"^constrain: logical axes must be a tuple .*got 'batch' \(one string: did you mean"),
    ],
)
def test_the_rank_is_checked_outside_a_context_too(axes, message):
    with pytest.raises(ShardingError, match=message):
        constrain(jnp.ones((16, 8)), axes)
    with pytest.raises(ShardingError, match=message):
        ms.Sharded(MESH, RULES)(lambda x: constrain(x, axes))(jnp.ones((16, 8)))


def test_an_activation_that_cannot_split_evenly_is_named_like_a_parameter():
    step = ms.Sharded(MESH, RULES)(lambda x: constrain(x, ("batch", "embed")))
    with pytest.raises(
        ShardingError,
        match=r"^constrain: shape \(4, 6\), dimension 1 \(logical axis 'embed'\) has size 6, which mesh "
        r"axis 'model'=4 cannot split evenly; choose sizes divisible by 4 or change the rules",
    ):
        step(jnp.ones((4, 6)))


def test_the_environment_sends_the_batch_where_sharded_sends_it():
    env = LogicalSharding(jax.sharding.AbstractMesh((2, 4), ("data", "model")), ms.AxisRules(embed="model"))
    assert env.batch_target is None and env.spec(("batch", "embed")) == P(None, "model")  # no rule: whole
    env = LogicalSharding(env.mesh, ms.AxisRules(embed="model"), batch_axis="data")  # a mesh axis
    assert env.batch_target == "data" and env.spec(("data", "embed")) == P("data", "model")
