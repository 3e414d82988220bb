"""minishard.testing.assertions: numbers, at least something split, and placement."""

import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis.errors import Unsatisfiable
from jax.sharding import PartitionSpec as P
from testing_fixtures import (
    DROPPED,
    HIDDEN,
    MEGATRON,
    MESH,
    RULES,
    SWAPPED,
    WRONG_RULES,
    compilations,
    intended_shards,
    model_and_batch,
)

import minishard as ms
from minishard.sharding import partition_specs
from minishard.testing import (
    assert_placement,
    assert_sharded_equivalent,
    assert_split,
    meshes,
)


def test_a_difference_is_reported_with_the_output_path():
    runs = itertools.count()

    def drifts(x):  # the host callback answers something new on every run
        run = jax.pure_callback(lambda: np.float32(next(runs)), jax.ShapeDtypeStruct((), np.float32))
        return {"sum": jnp.sum(x), "run": run}

    mesh, rules = ms.make_mesh({"data": 8, "model": 1}), ms.AxisRules(batch="data")
    with pytest.raises(AssertionError, match=re.escape("output run: sharded != unsharded")):
        assert_sharded_equivalent(
            drifts, np.ones((8, 2), np.float32), mesh=mesh, rules=rules, require_split="batch"
        )


def test_a_placement_failure_names_the_path_both_placements_and_the_rules_at_work():
    model, _ = model_and_batch(SWAPPED)
    with pytest.raises(AssertionError) as failure:
        assert_placement(ms.shard(model, MESH, RULES), MESH, intended_shards(HIDDEN, 4), rules=RULES)
    message = str(failure.value)
    assert message.startswith("assert_placement: 4 of 4 arrays are not laid out as expected")
    assert "inner.layers[0].weight: expected shards (16, 8), got P('model', None), shards (4, 32)" in message
    assert "the model names its axes ('mlp', 'embed'); under AxisRules(" in message
    assert "dim 0 ('mlp'): rule mlp->'model' matched" in message


def test_assert_placement_takes_specs_blocks_logical_axes_or_a_tree():
    model, _ = model_and_batch(MEGATRON)
    placed = ms.shard(model, MESH, RULES)
    expected = {
        "inner.layers[0].weight": P(None, "model"),
        "inner.layers[0].bias": ("mlp",),  # logical axes, through the rules
        "inner.layers[2].weight": (8, 16),  # a shard shape
        "inner.layers[2].bias": None,  # not checked
    }
    assert_placement(placed, MESH, expected, rules=RULES)
    assert_placement(placed, MESH, partition_specs(model, RULES, MESH))  # a tree of specs
    assert_placement(placed, MESH, jax.tree.map(lambda a: a.addressable_shards[0].data.shape, placed))
    # Logical axes check the model's annotations under the given rules, so a wrong rule passes them;
    # a shard shape (or a spec) checks the rules too.
    wrong = ms.shard(model, MESH, WRONG_RULES)
    assert_placement(wrong, MESH, {"inner.layers[0].weight": ("embed", "mlp")}, rules=WRONG_RULES)
    with pytest.raises(AssertionError, match=r"expected shards \(16, 8\), got P\(None, 'data'\)"):
        assert_placement(wrong, MESH, {"inner.layers[0].weight": (16, 8)}, rules=WRONG_RULES)


def test_assert_placement_refuses_typos_and_arrays_that_are_not_on_the_mesh():
    model, _ = model_and_batch(MEGATRON)
    with pytest.raises(AssertionError, match=r"\['inner.layer\[0\].weight'\] name no array of the tree"):
        assert_placement(ms.shard(model, MESH, RULES), MESH, {"inner.layer[0].weight": (16, 8)})
    with pytest.raises(AssertionError, match=r"is not on the mesh: a numpy\.ndarray, not a jax\.Array"):
        assert_placement(model, MESH, {"inner.layers[0].bias": (8,)})
    with pytest.raises(
        TypeError, match=r"^assert_placement: inner.layers\[0\].bias: expected a PartitionSpec, a shard"
    ):
        assert_placement(ms.shard(model, MESH, RULES), MESH, {"inner.layers[0].bias": 3})
    on_one_device = jax.device_put(model, jax.devices()[0])
    with pytest.raises(AssertionError, match=r"is on 1 device\(s\), not on the mesh's 8"):
        assert_placement(on_one_device, MESH, {"inner.layers[2].bias": (16,)})


# -- at least something split ------------------------------------------------------------
WHOLE_BATCH = ms.AxisRules(batch=None, embed=None, mlp="model")


def test_assert_split_counts_the_arrays_split_over_a_mesh_axis():
    model, _ = model_and_batch(MEGATRON)
    assert_split(model, MESH, over="model", rules=RULES, at_least=3)  # both weights and the first bias
    assert_split(ms.shard(model, MESH, RULES), MESH, over="model", at_least=3)  # read from placed arrays
    with pytest.raises(
        AssertionError, match=r"^assert_split: 3 of 4 arrays are split over 'model' .*; at least 4 must be"
    ):
        assert_split(model, MESH, over="model", rules=RULES, at_least=4)
    assert_split(model, MESH, rules=RULES)  # over=None: any mesh axis
    with pytest.raises(AssertionError, match=r"0 of 4 arrays are split over each of \('data', 'model'\)"):
        assert_split(model, MESH, over=("data", "model"), rules=RULES)


@pytest.mark.parametrize("at_least", [0, -3, 1.5])
def test_assert_split_refuses_a_count_that_asks_nothing(at_least):
    model, _ = model_and_batch(MEGATRON)
    with pytest.raises(ValueError) as error:
        assert_split(model, MESH, over="model", rules=RULES, at_least=at_least)
    words = f"assert_split: at_least must be an int >= 1 (a count of arrays), got {at_least}"
    assert str(error.value) == words


def test_assert_split_names_what_is_and_is_not_split():
    model, _ = model_and_batch(MEGATRON)
    wrong = ms.shard(model, MESH, WRONG_RULES)  # mlp went to "data": split, but not over "model"
    with pytest.raises(AssertionError) as failure:
        assert_split(wrong, MESH, over="model")
    assert str(failure.value) == (
        "assert_split: 0 of 4 arrays are split over 'model' on mesh {'data': 2, 'model': 4}; "
        "at least 1 must be\n"
        "  split: none\n"
        "  not split: inner.layers[0].weight P(None, 'data'), inner.layers[0].bias P('data',), "
        "inner.layers[2].weight P('data', None), inner.layers[2].bias P(None,)"
    )
    assert_split(wrong, MESH, over="data", at_least=3)


def test_assert_split_says_when_the_mesh_axis_is_1_wide_and_refuses_a_typo():
    model, _ = model_and_batch(MEGATRON)
    narrow = ms.make_mesh({"data": 8, "model": 1})
    with pytest.raises(
        AssertionError, match=r"\(mesh axis 'model' is 1 wide: nothing can be split over it\)"
    ):
        assert_split(model, narrow, over="model", rules=RULES)
    with pytest.raises(
        ValueError, match=r"names mesh axis 'modle', but the mesh's axes are \('data', 'model'\)"
    ):
        assert_split(model, MESH, over="modle", rules=RULES)


def forward(model, x):
    return model(x)


def test_an_equivalence_test_where_nothing_is_split_fails_unless_told():
    model, x = model_and_batch(MEGATRON)
    with compilations() as compiled, pytest.raises(AssertionError) as failure:
        assert_sharded_equivalent(forward, model, x, mesh=MESH, rules=ms.AxisRules(embed=None, mlp=None))
    message = str(failure.value)
    assert message.startswith("assert_sharded_equivalent: 0 of 4 parameters are split over any mesh axis")
    assert "not split: model.inner.layers[0].weight P(None, None)" in message and "x P()" not in message
    assert message.endswith("(require_split=False to run it anyway)")
    assert compiled == []  # refused before anything ran
    no_rules = ms.AxisRules(embed=None, mlp=None)
    assert_sharded_equivalent(forward, model, x, mesh=MESH, rules=no_rules, require_split=False)


UNANNOTATED = [(None, None), (None, None)]  # a model with no tensor parallelism in it


def test_a_split_batch_does_not_make_a_tensor_parallel_test_of_a_model_without_tensor_parallelism():
    model, x = model_and_batch(UNANNOTATED)
    with pytest.raises(AssertionError) as failure:  # RULES split the batch over "data": not the point
        assert_sharded_equivalent(forward, model, x, mesh=MESH, rules=RULES)
    message = str(failure.value)
    assert message.startswith("assert_sharded_equivalent: 0 of 4 parameters are split over any mesh axis")
    assert (
        "only inputs outside Layers (the batch) are split: for a data-parallel test, require_split='batch'"
        in (message)
    )
    with pytest.raises(ValueError, match=r"require_split names logical axis 'mlp', which no input carries"):
        assert_sharded_equivalent(forward, model, x, mesh=MESH, rules=RULES, require_split="mlp")
    assert_sharded_equivalent(
        forward, model, x, mesh=MESH, rules=RULES, require_split="batch"
    )  # data parallel


def test_require_split_names_the_logical_axes_that_must_be_split():
    model, x = model_and_batch(MEGATRON)
    assert_sharded_equivalent(forward, model, x, mesh=MESH, rules=RULES, require_split=("batch", "mlp"))
    narrow = ms.make_mesh({"data": 8, "model": 1})  # "mlp" -> "model", 1 wide: the batch alone is split
    with pytest.raises(AssertionError) as failure:
        assert_sharded_equivalent(forward, model, x, mesh=narrow, rules=RULES, require_split=["batch", "mlp"])
    assert str(failure.value).splitlines()[:2] == [
        "assert_sharded_equivalent: logical axis 'mlp' is split in 0 of the 3 arrays that carry it, "
        "on mesh {'data': 8, 'model': 1}; every one must be",
        "  not split: model.inner.layers[0].weight ('embed', 'mlp') -> P(None, 'model'), "
        "model.inner.layers[0].bias ('mlp',) -> P('model',), "
        "model.inner.layers[2].weight ('mlp', 'embed') -> P('model', None)",
    ]
    with pytest.raises(AssertionError, match=r"logical axis 'batch' is split in 0 of the 1 arrays"):
        assert_sharded_equivalent(forward, model, x, mesh=MESH, rules=WHOLE_BATCH, require_split="batch")


def test_require_split_checks_every_array_that_carries_the_name():
    model, x = model_and_batch(MEGATRON)
    # "embed" takes "model" first, so each weight falls back to a whole "mlp": only the bias splits it
    embed_first = ms.AxisRules.from_pairs(
        [("batch", "data"), ("embed", "model"), ("mlp", "model"), ("mlp", None)]
    )
    with pytest.raises(AssertionError) as failure:
        assert_sharded_equivalent(forward, model, x, mesh=MESH, rules=embed_first, require_split="mlp")
    assert str(failure.value).splitlines()[:2] == [
        "assert_sharded_equivalent: logical axis 'mlp' is split in 1 of the 3 arrays that carry it, "
        "on mesh {'data': 2, 'model': 4}; every one must be",
        "  not split: model.inner.layers[0].weight ('embed', 'mlp') -> P('model', None), "
        "model.inner.layers[2].weight ('mlp', 'embed') -> P(None, 'model')",
    ]
    assert_sharded_equivalent(forward, model, x, mesh=MESH, rules=embed_first, require_split={"mlp": 1})


def test_a_megatron_pair_whose_second_half_lost_its_axes_fails_the_count_it_falls_short_of():
    model, x = model_and_batch(DROPPED)  # layers[2].weight (None, None): replicated, the numbers unchanged
    # every array that carries "mlp" splits it: the weight that lost its axes carries none
    assert_sharded_equivalent(forward, model, x, mesh=MESH, rules=RULES, require_split="mlp")
    with pytest.raises(AssertionError) as failure:
        assert_sharded_equivalent(forward, model, x, mesh=MESH, rules=RULES, require_split={"mlp": 3})
    assert str(failure.value).splitlines()[0] == (
        "assert_sharded_equivalent: logical axis 'mlp' is split in 2 of the 2 arrays that carry it, "
        "on mesh {'data': 2, 'model': 4}; require_split asks for 3"
    )
    whole, _ = model_and_batch(MEGATRON)
    assert_sharded_equivalent(forward, whole, x, mesh=MESH, rules=RULES, require_split={"mlp": 3})


@pytest.mark.parametrize(
    ("require_split", "words"),
    [({"mlp": 0}, "each entry must map a logical axis (str) to a count of arrays >= 1, got 'mlp': 0"),
     ((), "require_split=(): name logical axes (str), give counts")],
)  # fmt: skip
def test_require_split_refuses_counts_below_1_and_no_names(require_split, words):
    model, x = model_and_batch(MEGATRON)
    with pytest.raises(ValueError) as error:
        assert_sharded_equivalent(forward, model, x, mesh=MESH, rules=RULES, require_split=require_split)
    assert words in str(error.value)


@pytest.mark.parametrize(("rtol", "atol", "bad"), [(-1e-5, 0.0, "rtol"), (1e-5, float("nan"), "atol")])
def test_a_negative_or_nan_tolerance_is_refused(rtol, atol, bad):
    model, x = model_and_batch(MEGATRON)
    with pytest.raises(ValueError, match=rf"^assert_sharded_equivalent: {bad} must be a finite number >= 0"):
        assert_sharded_equivalent(forward, model, x, mesh=MESH, rules=RULES, rtol=rtol, atol=atol)


def test_a_function_of_plain_arrays_names_what_must_be_split():
    def total(x):
        return jnp.sum(x)

    with pytest.raises(ValueError, match=r"no argument holds a Layer; .* e\.g\. require_split='batch'"):
        assert_sharded_equivalent(total, np.ones((8, 2), np.float32), mesh=MESH, rules=RULES)


def test_inside_hypothesis_an_example_where_nothing_is_split_is_rejected():
    ran_on = []

    @settings(settings.get_profile("minishard-ci"), database=None, max_examples=6)
    @given(meshes(shapes=[(1, 8), (8, 1)]))
    def tensor_parallel(mesh):  # on 8x1, "model" is 1 wide and no batch rule: nothing is split
        model, x = model_and_batch(MEGATRON)
        assert_sharded_equivalent(forward, model, x, mesh=mesh, rules=ms.AxisRules(embed=None, mlp="model"))
        ran_on.append(dict(mesh.shape))

    tensor_parallel()
    assert ran_on and all(shape == {"data": 1, "model": 8} for shape in ran_on)

    @settings(settings.get_profile("minishard-ci"), database=None, max_examples=2)
    @given(meshes(shapes=[(8, 1)]))
    def never_split(mesh):
        model, x = model_and_batch(MEGATRON)
        assert_sharded_equivalent(forward, model, x, mesh=mesh, rules=ms.AxisRules(embed=None, mlp="model"))

    with pytest.raises(Unsatisfiable):
        never_split()


# -- placement: bad expectations are refused before comparing ---------------------------------
def test_assert_placement_refuses_a_spec_longer_than_the_array_or_naming_no_mesh_axis():
    placed = ms.shard(model_and_batch(MEGATRON)[0], MESH, RULES)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "assert_placement: inner.layers[0].weight: P(None, 'model', None) has 3 entries, but the array "
            "has shape (16, 32) (rank 2)"
        ),
    ):
        assert_placement(placed, MESH, {"inner.layers[0].weight": P(None, "model", None)})
    with pytest.raises(ValueError, match=r"inner.layers\[0\].bias: \('mlp', None\) has 2 entries.*\(32,\)"):
        assert_placement(placed, MESH, {"inner.layers[0].bias": ("mlp", None)}, rules=RULES)
    with pytest.raises(
        ValueError,
        match=r"inner.layers\[0\].bias: P\('modle',\) names mesh axis 'modle', but the mesh's axes are "
        r"\('data', 'model'\)",
    ):
        assert_placement(placed, MESH, {"inner.layers[0].bias": P("modle")})
