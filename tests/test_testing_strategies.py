"""minishard.testing.strategies: meshes of any rank, rules that really split, widths, batches."""

import jax
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import AbstractMesh
from testing_fixtures import (
    EMBED,
    MESH,
    RULES,
    draw_one,
)

import minishard as ms
from minishard.testing import (
    MULTIPLES,
    axis_rules,
    batch_sizes,
    batches,
    meshes,
    split_counts,
    splittable_widths,
    width_units,
)

RANKS = [("data",), ("data", "model"), ("data", "fsdp", "model")]
NAMES = ["embed", "mlp", "heads", "vocab"]


@given(st.data())
def test_meshes_of_any_rank_use_every_device_and_keep_min_sizes(data):
    for mesh_axes in RANKS:
        mesh = data.draw(meshes(mesh_axes=mesh_axes, min_sizes={mesh_axes[-1]: 2}))
        assert mesh.axis_names == mesh_axes and mesh.size == jax.device_count() == 8
        assert mesh.shape[mesh_axes[-1]] >= 2


def test_meshes_refuse_a_single_device_and_say_how_to_simulate_more(monkeypatch):
    monkeypatch.setattr(jax, "device_count", lambda: 1)
    with pytest.raises(
        RuntimeError, match=r"1 cpu device.*XLA_FLAGS=--xla_force_host_platform_device_count=8"
    ):
        meshes()


def test_meshes_refuse_shapes_they_cannot_draw():
    with pytest.raises(ValueError, match="no shape of 8 devices"):
        meshes(min_sizes={"model": 16})
    with pytest.raises(ValueError, match="not among the axes"):
        meshes(min_sizes={"modle": 2})
    with pytest.raises(ValueError, match="multiplying to 8"):
        meshes(shapes=[(2, 2)])
    assert draw_one(meshes(mesh_axes=("x", "y"), shapes=[(2, 2)], devices=4)).shape == {"x": 2, "y": 2}


@given(st.data())
def test_rules_drawn_with_split_really_split_the_name(data):
    mesh = data.draw(meshes())
    rules = data.draw(axis_rules(mesh=mesh, split=["mlp"]))
    for axes in [("embed", "mlp"), ("mlp", "embed"), ("mlp",)]:
        assert split_counts(axes, mesh, rules)[axes.index("mlp")] > 1, (rules, dict(mesh.shape))


def test_split_refuses_a_mesh_that_cannot_split_the_name():
    mesh = ms.make_mesh({"data": 8, "model": 1})
    with pytest.raises(ValueError, match=r"no choice for 'mlp' in \['model', None\].*min_sizes"):
        draw_one(axis_rules({"mlp": ("model", None)}, mesh=mesh, split=["mlp"]))


unique_names = st.lists(st.sampled_from([*NAMES, None]), min_size=1, max_size=3).filter(
    lambda axes: len([a for a in axes if a]) == len({a for a in axes if a})
)


@given(st.data())
def test_splittable_widths_split_every_array_evenly(data):
    axes = data.draw(st.sampled_from(RANKS))
    mesh = data.draw(meshes(axes))
    rules = data.draw(axis_rules({name: [None, *axes, axes] for name in NAMES}, ordered=True))
    arrays = data.draw(st.lists(unique_names.map(tuple), min_size=1, max_size=4))
    widths = data.draw(splittable_widths(arrays, mesh, rules, fixed={"vocab": 8}))
    units = width_units(arrays, mesh, rules)
    for logical_axes in arrays:
        shape = [1 if name is None else widths[name] for name in logical_axes]
        assert all(size % ways == 0 for size, ways in zip(shape, split_counts(logical_axes, mesh, rules)))
    assert widths["vocab"] == 8
    assert all(widths[name] // units[name] in MULTIPLES for name in units if name != "vocab")


def test_a_fixed_width_that_cannot_split_is_refused_with_the_unit_it_needs():
    mesh = AbstractMesh((2, 4), ("data", "model"))
    with pytest.raises(ValueError, match=r"fixed width mlp=6 cannot split into the 4 blocks.*multiple of 4"):
        draw_one(splittable_widths([("embed", "mlp")], mesh, RULES, fixed={"mlp": 6}))


def test_batches_split_over_the_batch_axis():
    x = draw_one(batches(MESH, RULES, (3, EMBED)))
    assert x.shape == (2, 3, EMBED) and x.dtype == np.float32  # the simplest: one row per data block
    assert draw_one(batch_sizes(MESH, ms.AxisRules(batch=("data", "model")))) == 8
