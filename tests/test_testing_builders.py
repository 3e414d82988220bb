"""minishard.testing.builders: models from a user's builder, and MLPs."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from testing_fixtures import (
    EMBED,
    MEGATRON,
    RULES,
    SWAPPED,
    assert_shards_as_planned,
    draw_one,
    residual,
    residual_mlp,
)

import minishard as ms
from minishard.rules import ShardingError
from minishard.sharding import plan
from minishard.testing import (
    MULTIPLES,
    axis_rules,
    meshes,
    mlps,
    models,
    width_units,
)


@given(st.data())
def test_models_come_from_the_users_builder_with_splittable_widths(data):
    mesh = data.draw(meshes(min_sizes={"model": 2}))
    rules = data.draw(axis_rules(mesh=mesh, split=["mlp"]))
    model = data.draw(models(residual_mlp, mesh, rules, fixed={"embed": EMBED}))
    assert isinstance(model, ms.Residual)
    assert model.inner[0].in_features == model.inner[2].out_features == EMBED
    arrays = [("embed", "mlp"), ("mlp",), ("mlp", "embed"), ("embed",)]  # the residual MLP's
    hidden, unit = model.inner[0].out_features, width_units(arrays, mesh, rules)["mlp"]
    assert unit > 1 and hidden // unit in MULTIPLES and hidden % unit == 0
    assert isinstance(model.inner[0].weight, np.ndarray)  # numpy: drawing a model compiles nothing
    assert_shards_as_planned(model, ms.shard(model, mesh, rules), mesh, rules)


def mixed_up_residual(widths):  # gives the mlp width to the embed dimensions, and the other way round
    return residual({"embed": widths["mlp"], "mlp": widths["embed"]}, MEGATRON)


def test_models_say_when_a_builder_mixes_up_its_widths():
    mesh = ms.make_mesh({"data": 2, "model": 4})
    with pytest.raises(ShardingError, match=r"models: mixed_up_residual.*width named after its logical axis"):
        draw_one(models(mixed_up_residual, mesh, RULES))


@given(st.data())
def test_mlps_keep_given_axes_and_end_widths(data):
    mesh, rules = data.draw(meshes()), data.draw(axis_rules())
    model = data.draw(mlps(mesh, rules, in_features=8, out_features=10))  # 10: split 1 or 2 ways only
    assert (model[0].in_features, model[-1].out_features) == (8, 10)
    plan(model, mesh, rules)  # every width splits evenly
    given_axes = data.draw(mlps(mesh, rules, axes=MEGATRON, in_features=8))
    assert [layer.logical_axes for layer in given_axes.layers[::2]] == MEGATRON


def test_mlps_refuse_given_axes_that_cannot_split_a_fixed_width():
    mesh = ms.make_mesh({"data": 2, "model": 4})
    with pytest.raises(ValueError, match=r"Linear 0 with axes \('mlp', 'embed'\) cannot split in_features=6"):
        draw_one(mlps(mesh, RULES, axes=SWAPPED, in_features=6))
