"""minishard.testing: its strategies, its three assertions, and what each assertion catches.

The first properties use the strategies to check minishard itself: on meshes
(1x8, 2x4, 4x2 or 8x1 on the 8 simulated devices), rules and MLPs drawn at
random, sharded forward passes and training steps equal the unsharded ones,
every device holds the block ``plan`` predicts, spec trees have the model's
structure, and an impossible request fails with a ``ShardingError`` naming the
leaf before anything is compiled.

Then the strategies themselves (meshes of any rank, rules that really split a
name, widths for any arrays, models from a user's builder), and the *mutation
matrix*: the residual MLP of docs/testing.md (``testing_fixtures``), broken in
the ways real models break, must pass all three assertions when correct, and
each break must be caught by the assertion meant for it.

Compiling is what costs time here, so the functions under test live at module
level (jit caches compiled code per function) and widths stay small.
"""

import contextlib
import itertools
import re
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import Phase, find, given, settings
from hypothesis import strategies as st
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P
from strategies import random_like, seeds
from testing_fixtures import (
    BATCH,
    EMBED,
    HIDDEN,
    MEGATRON,
    MESH,
    MUTATIONS,
    RULES,
    SWAPPED,
    WRONG_RULES,
    Residual,
    forward_by_hand,
    intended_blocks,
    model_and_batch,
    residual,
    residual_mlp,
    swapped_residual_mlp,
)
from testing_fixtures import forward as residual_forward

import minishard as ms
from minishard.rules import ShardingError
from minishard.sharding import partition_specs, plan
from minishard.testing import (
    MULTIPLES,
    Limit,
    assert_collectives,
    assert_layout,
    assert_sharded_equivalent,
    axis_rules,
    batch_sizes,
    batches,
    data_parallel_limits,
    megatron_limits,
    meshes,
    mlps,
    models,
    register_profiles,
    split_counts,
    splittable_widths,
    width_units,
)
from minishard.tree import path_str

OPTIMIZER = ms.SGD(ms.exponential_decay(0.1, decay_rate=0.5, decay_steps=10), momentum=0.9)


def forward(model, x):
    return model(x)


def loss_fn(model, x, labels):
    return ms.cross_entropy(model(x), ms.one_hot(labels, model[-1].out_features))


def train_step(model, opt_state, x, labels):
    loss, grads = jax.value_and_grad(loss_fn)(model, x, labels)
    model, opt_state = OPTIMIZER.update(model, grads, opt_state)
    return model, opt_state, loss


@st.composite
def setups(draw: st.DrawFn) -> tuple[jax.sharding.Mesh, ms.AxisRules, ms.Sequential, np.ndarray]:
    """A mesh, rules, an MLP they can split, and a batch of inputs for it."""
    mesh, rules = draw(meshes()), draw(axis_rules())
    model = draw(mlps(mesh, rules))
    rng = np.random.default_rng(draw(seeds))
    x = rng.standard_normal((draw(batch_sizes(mesh, rules)), model[0].in_features), np.float32)
    return mesh, rules, model, x


def assert_blocks_as_planned(tree: Any, placed: Any, mesh: jax.sharding.Mesh, rules: ms.AxisRules) -> None:
    """Every device holds exactly the block ``plan`` computes for each leaf of ``placed``."""
    leaves = jax.tree_util.tree_leaves_with_path(placed)
    plans = plan(tree, mesh, rules).leaves
    assert [leaf.path for leaf in plans] == [path_str(path) for path, _ in leaves]
    for leaf, (_, array) in zip(plans, leaves, strict=True):
        blocks = [shard.data.shape for shard in array.addressable_shards]
        assert blocks == [leaf.block_shape] * mesh.size, f"{leaf.path} (spec {leaf.spec})"


@contextlib.contextmanager
def compilations() -> Iterator[list[str]]:
    """Collect the names of the functions XLA compiles inside the block."""
    compiled: list[str] = []

    def listener(event: str, duration: float, **kwargs: Any) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(kwargs.get("fun_name", "?"))

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield compiled
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


# -- equal results ---------------------------------------------------------------
@given(setups())
def test_forward_pass_is_sharding_invariant(setup):
    mesh, rules, model, x = setup
    assert_sharded_equivalent(forward, model, x, mesh=mesh, rules=rules)


@pytest.mark.slow  # a training step compiles per example: 5 to 20 s
@given(setups(), seeds)
def test_sgd_step_is_sharding_invariant_and_keeps_the_planned_blocks(setup, seed):
    mesh, rules, model, x = setup
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, model[-1].out_features, len(x))
    # A nonzero velocity and step, so the momentum term and the schedule count.
    opt_state = ms.SGDState(np.int32(rng.integers(0, 20)), random_like(model, rng))
    new_model, new_state, _ = assert_sharded_equivalent(
        train_step, model, opt_state, x, labels, mesh=mesh, rules=rules, rtol=1e-4, atol=1e-5
    )
    assert_blocks_as_planned(model, new_model, mesh, rules)
    assert_blocks_as_planned(model, new_state.velocity, mesh, rules)  # velocities are laid out like params


def test_a_difference_is_reported_with_the_output_path():
    runs = itertools.count()

    def drifts(x):  # the host callback answers something new on every run
        run = jax.pure_callback(lambda: np.float32(next(runs)), jax.ShapeDtypeStruct((), np.float32))
        return {"sum": jnp.sum(x), "run": run}

    mesh, rules = ms.make_mesh({"data": 8, "model": 1}), ms.AxisRules(batch="data")
    with pytest.raises(AssertionError, match=re.escape("output run: sharded != unsharded")):
        assert_sharded_equivalent(drifts, np.ones((8, 2), np.float32), mesh=mesh, rules=rules)


# -- layouts -----------------------------------------------------------------------
@given(setups())
def test_shard_places_the_blocks_plan_computes(setup):
    mesh, rules, model, _ = setup
    assert_blocks_as_planned(model, jax.block_until_ready(ms.shard(model, mesh, rules)), mesh, rules)


@jax.tree_util.register_pytree_node_class
class TrainState:
    """A user container (no key paths): a model and an array that belongs to no Layer."""

    def __init__(self, model: Any, ema: Any) -> None:
        self.model, self.ema = model, ema

    def tree_flatten(self) -> tuple[tuple[Any, Any], None]:
        return (self.model, self.ema), None

    @classmethod
    def tree_unflatten(cls, aux_data: None, children: tuple[Any, Any]) -> "TrainState":
        return cls(*children)


@given(setups())
def test_partition_specs_have_the_params_treedef(setup):
    mesh, rules, model, _ = setup
    state = TrainState(model, np.zeros((3, 2), np.float32))
    specs = partition_specs(state, rules, mesh)
    assert jax.tree_util.tree_structure(specs) == jax.tree_util.tree_structure(state)
    assert specs.ema == P()  # an array outside Layers is replicated
    for linear, linear_blueprints in zip(model, specs.model):
        if isinstance(linear, ms.Linear):
            assert linear_blueprints.weight == rules.spec(linear.logical_axes, mesh)
            assert linear_blueprints.bias == rules.spec(linear.logical_axes[1:], mesh)


# -- impossible requests fail early and say where ------------------------------------
def first_indivisible(model: ms.Sequential, model_axis_size: int) -> str | None:
    """Path of the first parameter with an "mlp" dimension the model axis cannot split."""
    for i, layer in enumerate(model):
        if isinstance(layer, ms.Linear):
            for name, axes in (("weight", layer.logical_axes), ("bias", layer.logical_axes[1:])):
                shape = getattr(layer, name).shape
                if any(axis == "mlp" and size % model_axis_size for axis, size in zip(axes, shape)):
                    return f"layers[{i}].{name}"
    return None


@given(
    meshes(shapes=[(1, 8), (2, 4), (4, 2)]),
    axis_rules({"batch": ("data",), "embed": (None,), "mlp": ("model",)}),
    mlps(),  # no mesh given: any widths, divisible or not
)
def test_indivisible_widths_raise_naming_the_leaf_before_compiling(mesh, rules, model):
    bad = first_indivisible(model, mesh.shape["model"])
    if bad is None:
        assert_blocks_as_planned(model, ms.shard(model, mesh, rules), mesh, rules)
        return
    message = rf"{re.escape(bad)}: shape .* cannot split evenly"
    with pytest.raises(ShardingError, match=message):
        ms.shard(model, mesh, rules)
    x = np.zeros((mesh.shape["data"], model[0].in_features), np.float32)
    with compilations() as compiled, pytest.raises(ShardingError, match=rf"argument model\.{message}"):
        ms.Sharded(mesh, rules)(forward)(model, x)
    assert compiled == []


def test_compilations_sees_a_compile():
    with compilations() as compiled:
        jax.block_until_ready(jax.jit(lambda x: x + 1)(np.float32(1)))
    assert compiled


# -- strategies: meshes of any rank, rules that really split, widths, models -------------
RANKS = [("data",), ("data", "model"), ("data", "fsdp", "model")]
NAMES = ["embed", "mlp", "heads", "vocab"]


def draw_one(strategy: st.SearchStrategy[Any]) -> Any:
    """The simplest example of ``strategy`` (deterministic: hypothesis shrinks it)."""
    return find(strategy, lambda _: True, settings=settings(database=None, max_examples=1))


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


@given(st.data())
def test_models_come_from_the_users_builder_with_splittable_widths(data):
    mesh = data.draw(meshes(min_sizes={"model": 2}))
    rules = data.draw(axis_rules(mesh=mesh, split=["mlp"]))
    model = data.draw(models(residual_mlp, mesh, rules, fixed={"embed": EMBED}))
    assert isinstance(model, Residual)
    assert model.inner[0].in_features == model.inner[2].out_features == EMBED
    arrays = [("embed", "mlp"), ("mlp",), ("mlp", "embed"), ("embed",)]  # the residual MLP's
    hidden, unit = model.inner[0].out_features, width_units(arrays, mesh, rules)["mlp"]
    assert unit > 1 and hidden // unit in MULTIPLES and hidden % unit == 0
    assert isinstance(model.inner[0].weight, np.ndarray)  # numpy: drawing a model compiles nothing
    assert_blocks_as_planned(model, ms.shard(model, mesh, rules), mesh, rules)


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


# -- the three assertions, and the mutations each must catch ----------------------------
CAUGHT = {  # mutation -> the assertions that must fail on it
    "correct": set(),
    "correct shard_map": set(),
    "swapped halves": {"layout", "communication"},  # reduces (batch, hidden) instead of (batch, embed)
    # XLA slices the replicated second weight on each device itself: Megatron's traffic, with the
    # whole weight in every device's memory. Only the layout shows it.
    "dropped annotation": {"layout"},
    "mlp -> data rule": {"layout", "communication"},
    "extra all-gather": {"communication"},
    "pmean for psum": {"numbers"},  # a bug in the numbers, not in the layout
}


@pytest.mark.parametrize("name", MUTATIONS)
def test_each_assertion_catches_its_mutations_and_passes_the_correct_model(name):
    axes, rules, fn = MUTATIONS[name]
    model, x = model_and_batch(axes)
    checks = {
        "numbers": lambda: assert_sharded_equivalent(
            fn, model, x, mesh=MESH, rules=rules, reference=residual_forward
        ),
        "layout": lambda: assert_layout(
            ms.shard(model, MESH, rules), MESH, intended_blocks(HIDDEN, MESH.shape["model"]), rules=rules
        ),
        "communication": lambda: assert_collectives(
            ms.Sharded(MESH, rules)(fn),
            *megatron_limits((BATCH // MESH.shape["data"], EMBED)),
            args=(model, x),
            exhaustive=True,
        ),
    }
    caught = set()
    for check, run in checks.items():
        try:
            jax.block_until_ready(run())
        except AssertionError:
            caught.add(check)
    assert caught == CAUGHT[name]


def test_a_layout_failure_names_the_path_both_layouts_and_the_rules_at_work():
    model, _ = model_and_batch(SWAPPED)
    with pytest.raises(AssertionError) as failure:
        assert_layout(ms.shard(model, MESH, RULES), MESH, intended_blocks(HIDDEN, 4), rules=RULES)
    message = str(failure.value)
    assert message.startswith("assert_layout: 4 of 4 arrays are not laid out as expected")
    assert "inner.layers[0].weight: expected blocks (16, 8), got P('model', None), blocks (4, 32)" in message
    assert "the model names its axes ('mlp', 'embed'); under AxisRules(" in message
    assert "dim 0 ('mlp'): rule mlp->'model' matched" in message


def test_assert_layout_takes_specs_blocks_logical_axes_or_a_tree():
    model, _ = model_and_batch(MEGATRON)
    placed = ms.shard(model, MESH, RULES)
    expected = {
        "inner.layers[0].weight": P(None, "model"),
        "inner.layers[0].bias": ("mlp",),  # logical axes, through the rules
        "inner.layers[2].weight": (8, 16),  # a block shape
        "inner.layers[2].bias": None,  # not checked
    }
    assert_layout(placed, MESH, expected, rules=RULES)
    assert_layout(placed, MESH, partition_specs(model, RULES, MESH))  # a tree of specs
    assert_layout(placed, MESH, jax.tree.map(lambda a: a.addressable_shards[0].data.shape, placed))
    # Logical axes check the model's annotations under the given rules, so a wrong rule passes them;
    # a block shape (or a spec) checks the rules too.
    wrong = ms.shard(model, MESH, WRONG_RULES)
    assert_layout(wrong, MESH, {"inner.layers[0].weight": ("embed", "mlp")}, rules=WRONG_RULES)
    with pytest.raises(AssertionError, match=r"expected blocks \(16, 8\), got P\(None, 'data'\)"):
        assert_layout(wrong, MESH, {"inner.layers[0].weight": (16, 8)}, rules=WRONG_RULES)


def test_assert_layout_refuses_typos_and_arrays_that_are_not_on_the_mesh():
    model, _ = model_and_batch(MEGATRON)
    with pytest.raises(AssertionError, match=r"\['inner.layer\[0\].weight'\] name no array of the tree"):
        assert_layout(ms.shard(model, MESH, RULES), MESH, {"inner.layer[0].weight": (16, 8)})
    with pytest.raises(AssertionError, match=r"is not on the mesh: a numpy\.ndarray, not a jax\.Array"):
        assert_layout(model, MESH, {"inner.layers[0].bias": (8,)})
    on_one_device = jax.device_put(model, jax.devices()[0])
    with pytest.raises(AssertionError, match=r"is on 1 device\(s\), not on the mesh's 8"):
        assert_layout(on_one_device, MESH, {"inner.layers[2].bias": (16,)})


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


AXES = ms.megatron_axes(2)


def gradients(model, x, labels):
    return jax.value_and_grad(loss_fn)(model, x, labels)


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


# -- failing fast ------------------------------------------------------------------------
def test_profiles_suit_tests_that_compile():
    assert register_profiles() == ("minishard", "minishard-ci", "minishard-dev")
    profile = settings.get_profile("minishard")
    assert profile.deadline is None and not profile.report_multiple_bugs
    assert Phase.explain not in profile.phases and Phase.shrink in profile.phases
    assert settings.get_profile("minishard-ci").derandomize
    assert settings.get_profile("minishard-dev").max_examples == 50


TWO_D_RULES = ms.AxisRules(batch="data", embed=None, mlp=("data", "model"))  # not what the test intends


@pytest.mark.parametrize(
    "build, rules, where",
    [(swapped_residual_mlp, RULES, (1, 8)), (residual_mlp, TWO_D_RULES, (2, 4))],
    ids=["swapped halves fail on every mesh", "a 2-D rule fails where data > 1"],
)
def test_a_failing_property_is_shrunk_reusing_compiled_programs(build, rules, where):
    runs = []

    @settings(settings.get_profile("minishard-ci"), database=None)
    @given(st.data())
    def residual_property(data):  # the property of docs/testing.md, numbers and layout
        runs.append(data)
        mesh = data.draw(meshes(min_sizes={"model": 2}))
        model = data.draw(models(build, mesh, rules, fixed={"embed": EMBED}))
        x = data.draw(batches(mesh, rules, EMBED))
        assert_sharded_equivalent(residual_forward, model, x, mesh=mesh, rules=rules)
        blocks = intended_blocks(model.inner[0].out_features, mesh.shape["model"])
        assert_layout(ms.shard(model, mesh, rules), mesh, blocks, rules=rules)

    with compilations() as compiled, pytest.raises(AssertionError, match="assert_layout") as failure:
        residual_property()
    assert f"Mesh(axis_sizes={where}" in failure.value.__notes__[1]  # the simplest failing mesh
    # At most 3 meshes x 2 hidden widths x 2 batch sizes, a sharded and a reference program each:
    # however often hypothesis runs the test while it shrinks, candidates reuse compiled programs.
    assert len(compiled) <= 24 and len(runs) > 1, (len(runs), compiled)


def test_batches_split_over_the_batch_axis():
    x = draw_one(batches(MESH, RULES, (3, EMBED)))
    assert x.shape == (2, 3, EMBED) and x.dtype == np.float32  # the simplest: one row per data block
    assert draw_one(batch_sizes(MESH, ms.AxisRules(batch=("data", "model")))) == 8


def test_the_hand_written_shard_map_reduces_once_per_pair():
    model, x = model_and_batch(MEGATRON)
    found = assert_collectives(ms.Sharded(MESH, RULES)(forward_by_hand), args=(model, x))
    assert list(found) == ["all-reduce"] and found["all-reduce"].mesh_axes == (("model",),)


# -- hypothesis stays a development dependency -------------------------------------
def test_minishard_imports_without_hypothesis_and_testing_says_what_to_install():
    script = (
        "import sys; sys.modules['hypothesis'] = None\n"  # as if it were not installed
        "import minishard; print('minishard imported')\n"
        "import minishard.testing"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.stdout == "minishard imported\n", result.stderr
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("ImportError: minishard.testing needs hypothesis"), result.stderr
    assert "pip install hypothesis" in last_line
