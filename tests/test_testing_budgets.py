"""minishard.testing.budgets: Limits select collectives by kind and mesh axes; the budgets."""

import re

import jax
import numpy as np
import pytest
from jax.sharding import AbstractMesh
from strategies import random_like
from testing_fixtures import (
    MEGATRON,
    MESH,
    RULES,
    compilations,
    forward_by_hand,
    model_and_batch,
)

import minishard as ms
from minishard.testing import (
    Limit,
    assert_collectives,
    data_parallel_limits,
)

HLO = "\n".join(
    [  # on a (2, 4) mesh of axes ("x", "y"):
        "%a = f32[64]{0} all-reduce(%p), replica_groups=[2,4]<=[8], to_apply=%add",  # over y, 256 B
        "%b = f32[2]{0} all-reduce(%q), replica_groups=[4,2]<=[2,4]T(1,0), to_apply=%add",  # over x, 8 B
        "%c = f32[8,4]{1,0} all-gather(%r), replica_groups={{0,1},{2,3},{4,5},{6,7}}, dimensions={0}",
    ]  # %c: over half of y, 128 B
)
MESH_2X4 = AbstractMesh((2, 4), ("x", "y"))


def test_limits_select_collectives_by_kind_and_mesh_axes():
    within = [
        Limit("all-reduce", over="y", count=1, bytes=256),
        Limit("all-reduce", over="x", bytes=8),
        Limit(over="y", count=2, bytes=384),  # the all-gather over half of y goes over y too
        Limit(over=("x", "y"), count=0),  # none spans both
        Limit("all-to-all", count=0),
    ]
    found = assert_collectives(HLO, *within, mesh=MESH_2X4, exhaustive=True)
    assert found["all-reduce"].count == 2
    for limit, found_text in [
        (Limit("all-reduce", count=1), "found 2, 264 B"),
        (Limit(over="y", bytes=383), "found 2, 384 B"),
        (Limit("all-gather", count=0), "found 1, 128 B"),
    ]:
        with pytest.raises(
            AssertionError, match=rf"{re.escape(str(limit))}; {found_text}\n.*its collectives"
        ):
            assert_collectives(HLO, limit, mesh=MESH_2X4)
    with pytest.raises(
        AssertionError, match=r"all-gather over \('y\(2 of 4\)',\) \(128 B\): no limit allows it"
    ):
        assert_collectives(HLO, *within[:2], mesh=MESH_2X4, exhaustive=True)


def test_limits_refuse_unknown_kinds_and_missing_bounds():
    with pytest.raises(ValueError, match="kind 'all_gather' is none of"):
        Limit("all_gather", count=0)
    with pytest.raises(ValueError, match="give a count, bytes or both"):
        Limit("all-gather")


@pytest.mark.parametrize(
    ("bounds", "message"),
    [
        ({"count": -1}, "Limit(None): count must be an int >= 0 (or None), got -1"),
        ({"count": 0.5}, "Limit(None): count must be an int >= 0 (or None), got 0.5"),
        ({"bytes": -1}, "Limit(None): bytes must be an int >= 0 (or None), got -1"),
    ],
)
def test_limits_refuse_bounds_that_cannot_be_met_or_compared(bounds, message):
    with pytest.raises(ValueError) as error:
        Limit(**bounds)
    assert str(error.value) == message


def test_assert_collectives_with_no_limits_is_refused_unless_exhaustive():
    with pytest.raises(ValueError, match=r"^assert_collectives\(the program\): no limits, so nothing would"):
        assert_collectives(HLO, mesh=MESH_2X4)
    with pytest.raises(AssertionError, match=r"all-reduce over \('y',\) \(256 B\): no limit allows it"):
        assert_collectives(HLO, mesh=MESH_2X4, exhaustive=True)  # no limits: the program may send nothing


def test_a_broken_budget_prints_exact_bytes_then_rounded():
    limit = Limit("all-reduce", over="y", bytes=1126)
    assert str(limit) == "all-reduce over 'y': at most 1,126 B (1.1 kB) per device"
    big = HLO.replace("f32[64]", "f32[320]")  # 1,280 B over y
    with pytest.raises(AssertionError, match=re.escape(f"  {limit}; found 1, 1,280 B (1.3 kB)")):
        assert_collectives(big, limit, mesh=MESH_2X4)


AXES = ms.megatron_axes(2)


def gradients(model, x, labels):
    loss = lambda m: ms.cross_entropy(m(x), ms.one_hot(labels, m[-1].out_features))  # noqa: E731
    return jax.value_and_grad(loss)(model)


def test_data_parallel_gradients_are_sent_once_and_a_stray_rule_breaks_the_budget():
    mesh = ms.make_mesh({"data": 8})
    rng = np.random.default_rng(0)  # numpy, not jax.random: nothing to compile for the parameters
    model = random_like(jax.eval_shape(lambda: ms.mlp([8, 16, 4], key=jax.random.key(0), axes=AXES)), rng)
    args = (model, rng.standard_normal((16, 8), np.float32), rng.integers(0, 4, 16))
    data_parallel = ms.AxisRules(batch="data", embed=None, mlp=None, classes=None)
    limits = data_parallel_limits(model)  # the gradients' bytes, and the loss
    found = assert_collectives(gradients, *limits, args=args, mesh=mesh, rules=data_parallel, exhaustive=True)
    assert found["all-reduce"].mesh_axes == (("data",),)
    assert found["all-reduce"].bytes == ms.tree.tree_bytes(model) + 4
    stray = ms.AxisRules(batch="data", embed=None, mlp="data", classes=None)  # mlp: data, not replicated
    with pytest.raises(AssertionError, match=r"gradients breaks its communication budget"):
        assert_collectives(gradients, *limits, args=args, mesh=mesh, rules=stray, exhaustive=True)


def test_the_hand_written_shard_map_reduces_once_per_pair():
    model, x = model_and_batch(MEGATRON)
    once, by_hand = Limit("all-reduce", over="model", count=1), ms.Sharded(MESH, RULES)(forward_by_hand)
    found = assert_collectives(by_hand, once, args=(model, x), exhaustive=True)
    assert list(found) == ["all-reduce"] and found["all-reduce"].mesh_axes == (("model",),)


def test_a_limit_over_a_mistyped_mesh_axis_is_refused_naming_the_mesh_axes():
    message = (
        r"assert_collectives: Limit\(kind='all-reduce', over='modle', count=0, bytes=None\) names mesh axis "
        r"'modle', but the mesh's axes are \('x', 'y'\)"
    )
    with pytest.raises(ValueError, match=message):  # HLO text: the mesh is given
        assert_collectives(HLO, Limit("all-reduce", over="modle", count=0), mesh=MESH_2X4)
    with pytest.raises(ValueError, match=r"over=\('x', 'z'\), count=9, bytes=None\) names mesh axis 'z'"):
        assert_collectives(HLO, Limit(over=("x", "z"), count=9), mesh=MESH_2X4)
    with pytest.raises(TypeError, match="names mesh axes; pass mesh= to check them"):
        assert_collectives(HLO, Limit(over="y", count=9))
    model, x = model_and_batch(MEGATRON)
    typo = Limit(over="modle", count=0)
    with compilations() as compiled, pytest.raises(ValueError, match=r"mesh's axes are \('data', 'model'\)"):
        assert_collectives(ms.Sharded(MESH, RULES)(forward_by_hand), typo, args=(model, x))  # from Sharded
    assert compiled == []  # refused before compiling
    lowered = ms.Sharded(MESH, RULES)(forward_by_hand).lower(model, x)
    with pytest.raises(ValueError, match=r"mesh's axes are \('data', 'model'\)"):  # from the compiled program
        assert_collectives(lowered, typo)
