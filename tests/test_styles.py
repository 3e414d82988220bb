"""minishard.styles, and Explicit meshes: the named styles, what each one splits, and sharding in types.

* **The styles' table**: ``mesh_rules`` gives each style its mesh shape (2 devices on
  "data", the rest on "model" or "stage") and its ordered rules, overrides first;
  unknown styles and device counts are refused; the pipeline styles split only
  "stage"; ``rules_for_mesh`` keeps the 2-D splits a mesh can take; the CLI takes a
  style and lets ``--mesh`` and ``--rules`` override it. Every style trains the
  MLP exactly as ``dp`` does.
* **FSDP by rules alone**: it stores an eighth of every divisible parameter and of
  its velocity, and its step (activations pinned with ``constrain``) all-gathers
  each split weight (forward) while XLA:CPU all-reduces the whole gradient and
  keeps each device's slice (where a reduce-scatter would move an eighth: the CPU
  backend does not rewrite all-reduce + slice into one; see docs/sharding.md).
* **Explicit meshes**: every style trains as on an Auto mesh, the sharding shows
  in the arrays' types, an ambiguous contraction names the layer and the fix, and
  on random meshes, rules and models sharding changes no number.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P
from models import SIZES, example, train_step

import minishard as ms
from minishard.census import bytes_by_mesh_axes
from minishard.constraints import constrain
from minishard.rules import ShardingError
from minishard.styles import (
    ANY_MODEL,
    EXPERT,
    LOGICAL_AXES,
    PIPELINED,
    SEQUENCE,
    SPLITS,
    mesh_rules,
    rules_for_mesh,
    style_rules,
)
from minishard.testing import assert_sharded_equivalent, axis_rules, batch_sizes, meshes, mlps
from minishard.tree import tree_bytes


def sharded(name):
    shape, rules = mesh_rules(name, 8)
    return ms.make_mesh(shape), rules


@pytest.mark.parametrize("name", ANY_MODEL)
def test_every_preset_trains_like_data_parallelism(name):
    args = example(axes=ms.megatron_axes(2))
    expected = jax.block_until_ready(ms.Sharded(*sharded("dp"))(train_step)(*args))
    got = jax.block_until_ready(ms.Sharded(*sharded(name))(train_step)(*args))
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6)


def test_a_preset_puts_two_devices_on_data_and_the_rest_on_model():
    assert mesh_rules("2d", 8)[0] == mesh_rules("fsdp+tp", 8)[0] == {"data": 2, "model": 4}
    assert mesh_rules("2d", 7)[0] == {"data": 1, "model": 7}  # odd: nothing to pair on "data"
    assert mesh_rules("dp", 8)[0] == mesh_rules("fsdp", 8)[0] == {"data": 8}
    assert mesh_rules("tp", 1)[0] == {"model": 1}
    replicated = [(axis, None) for axis in LOGICAL_AXES]  # the fallback, last
    assert list(style_rules("2d").pairs) == [
        ("batch", "data"),
        ("mlp", "model"),
        ("heads", "model"),
        *replicated,
    ]
    for name in ANY_MODEL:  # the style's row of the table, then the fallback
        assert mesh_rules(name, 8)[1].pairs == style_rules(name).pairs == (*SPLITS[name], *replicated)


def test_the_pipeline_styles_split_only_the_stage_axis():
    assert PIPELINED == ("pp", "dp+pp") and not set(PIPELINED) & set(ANY_MODEL)  # ANY_MODEL: any model
    assert mesh_rules("pp", 8)[0] == {"stage": 8} and mesh_rules("dp+pp", 8)[0] == {"data": 2, "stage": 4}
    rules = style_rules("dp+pp")
    assert rules.spec(("stage", "embed", "mlp")) == P("stage", None, None)
    assert rules.spec(("batch", "embed")) == P("data", None)
    assert style_rules("dp").spec(("stage", "embed")) == P(None, None)  # a stacked model under dp


def test_the_sequence_styles_split_seq_over_context_or_after_the_heads_over_model():
    assert SEQUENCE == ("cp", "dp+cp", "tp+sp") and not set(SEQUENCE) & set(ANY_MODEL)
    assert mesh_rules("cp", 8)[0] == {"context": 8} and mesh_rules("dp+cp", 8)[0] == {"data": 2, "context": 4}
    rules = style_rules("dp+cp")
    assert rules.spec(("batch", "seq", "heads", "kv")) == P("data", "context", None, None)
    sp = style_rules("tp+sp")  # heads claim "model" first: attention's sequence stays whole
    assert sp.spec(("batch", "seq", "heads", "kv")) == P(None, None, "model", None)
    assert sp.spec(("batch", "seq", "embed")) == P(None, "model", None)  # the residual stream: split
    assert sp.spec(("batch", "seq", "mlp")) == P(None, None, "model")


def test_the_expert_styles_split_the_experts_first_and_the_batch_over_the_same_axis():
    assert EXPERT == ("ep", "dp+ep") and not set(EXPERT) & set(ANY_MODEL)
    assert mesh_rules("ep", 8)[0] == {"expert": 8} and mesh_rules("dp+ep", 8)[0] == {"data": 2, "expert": 4}
    for name, batch in (("ep", "expert"), ("dp+ep", ("data", "expert"))):
        rules = style_rules(name)
        assert rules.spec(("expert", "embed", "mlp")) == P("expert", None, None)
        assert rules.spec(("batch", "embed")) == P(batch, None)  # dense layers: data parallel over all
    # An MoE's slots [E, G, C, M]: the experts claim "expert" first, the groups fall back to "data".
    assert style_rules("dp+ep").spec(("expert", "batch", None, "embed")) == P("expert", "data", None, None)


def test_a_preset_refuses_an_unknown_style_or_device_count():
    with pytest.raises(ValueError, match=r"unknown parallel style 'gpipe'; choose from dp, .*, pp, dp\+pp"):
        mesh_rules("gpipe", 8)
    with pytest.raises(ValueError, match=r"style_rules: unknown parallel style 'gpipe'"):
        style_rules("gpipe")
    for devices in (0, 2.0, True):
        with pytest.raises(ValueError, match=r"mesh_rules: devices must be a positive int, got"):
            mesh_rules("dp", devices)


def test_style_rules_put_overrides_first_so_they_win():
    rules = style_rules("2d", {"embed": "model", "batch": None})
    assert rules.pairs[:2] == (("embed", "model"), ("batch", None))
    assert rules.spec(("batch", "embed")) == P(None, "model")
    assert rules.spec(("embed", "mlp")) == P("model", None)  # "model" is taken: mlp falls back


# What the CLI's default_rules gave (minishard/run/cli.py, before the styles held them), by hand:
# the batch over "data", MLP hidden units and heads over "model" when the mesh has them.
EVERY_AXIS_REPLICATED = dict.fromkeys(LOGICAL_AXES)


@pytest.mark.parametrize(
    ("mesh_axes", "overrides", "splits"),
    [
        (["data", "model"], {}, {"batch": "data", "mlp": "model", "heads": "model"}),
        (["data"], {}, {"batch": "data"}),
        (["model"], {}, {"mlp": "model", "heads": "model"}),
        (
            ["model", "data"],
            {"embed": "model", "mlp": None},
            {"batch": "data", "heads": "model", "embed": "model"},
        ),
        (["x"], {"rows": "x"}, {"rows": "x"}),  # an axis of the user's own: added, last
    ],
)
def test_rules_for_a_mesh_are_the_2d_splits_the_mesh_can_take(mesh_axes, overrides, splits):
    rules = rules_for_mesh(mesh_axes, overrides)
    assert not rules.ordered  # one rule per logical axis, as AxisRules(**...) has
    assert dict(rules.pairs) == {**EVERY_AXIS_REPLICATED, **splits}
    assert [name for name, _ in rules.pairs][: len(LOGICAL_AXES)] == list(LOGICAL_AXES)


def test_rules_for_a_mesh_plan_the_mlp_and_the_vit():
    from minishard.models.vit import ViT

    mesh = ms.make_mesh({"data": 2, "model": 4})
    rules = rules_for_mesh(mesh.axis_names)
    mlp = ms.mlp(SIZES, key=jax.random.key(0), axes=ms.megatron_axes(2))
    assert ms.Sharded(mesh, rules).batch_sharding.spec == P("data")
    assert rules.spec(mlp[0].param_logical_axes()["weight"]) == P(None, "model")
    vit = jax.eval_shape(lambda: ViT(key=jax.random.key(0)))
    specs = {leaf.path: leaf.spec for leaf in ms.plan(vit, mesh, rules).leaves}
    assert specs["blocks[0].attention.query"] == P(None, "model", None)
    assert specs["embedding.position_table"] == P(None, None)


def test_fsdp_stores_an_eighth_of_every_divisible_parameter_and_its_velocity():
    mesh, rules = sharded("fsdp")
    model = ms.mlp(SIZES, key=jax.random.key(0), axes=ms.megatron_axes(2))
    state = ms.SGD(0.1, momentum=0.9).init(model)
    report = ms.explain({"model": model, "velocity": state.velocity}, mesh, rules)
    split = [row for row in report.rows if row.leaf.spec != P(*[None] * len(row.leaf.shape))]
    assert [row.leaf.path for row in split] == [
        "model.layers[0].weight",  # (embed, mlp): embed takes "data"
        "model.layers[0].bias",  # (mlp,): mlp takes "data"
        "model.layers[2].weight",  # (mlp, classes)
        "velocity.layers[0].weight",
        "velocity.layers[0].bias",
        "velocity.layers[2].weight",
    ]
    assert all(row.device_bytes * 8 == row.bytes for row in split)
    assert report.total_bytes - report.device_bytes * 8 == -7 * 2 * 10 * 4  # only the (10,) biases stay whole


class PinnedLinear(ms.Linear):
    """A Linear whose output lives as (batch, its output axis): what the model intends."""

    def __call__(self, x):
        return constrain(super().__call__(x), ("batch", self.logical_axes[1]))


def test_fsdp_gathers_each_weight_and_reduces_the_whole_gradient():
    mesh, rules = sharded("fsdp")
    model, opt_state, images, labels = example(axes=ms.megatron_axes(2))
    pinned = ms.Sequential([PinnedLinear.tree_unflatten(*reversed(layer.tree_flatten())) if isinstance(
        layer, ms.Linear) else layer for layer in model])  # fmt: skip
    found = bytes_by_mesh_axes(ms.Sharded(mesh, rules)(train_step).lower(pinned, opt_state, images, labels))
    split = [model[0].weight, model[0].bias, model[2].weight]
    assert found == {
        ("all-gather", ("data",)): tree_bytes(split),  # forward: each split weight, whole
        ("all-reduce", ("data",)): tree_bytes(model) + 4,  # backward: every gradient, whole, and the loss
    }


def test_the_cli_takes_a_preset_and_lets_mesh_and_rules_override():
    from minishard.run.cli import parse_args
    from minishard.run.cli.styles import cli_rules

    args = parse_args(["train", "--parallel", "fsdp"])
    assert args.mesh == {"data": 8} and cli_rules(args, ["data"]).spec(("embed", "mlp")) == P("data", None)
    args = parse_args(["train", "--parallel", "fsdp+tp", "--mesh", "data=4,model=2", "--rules", "embed=none"])
    assert args.mesh == {"data": 4, "model": 2}
    assert cli_rules(args, ["data", "model"]).spec(("embed", "mlp")) == P(None, "model")


# -- Explicit axes: sharding in types ------------------------------------------------------
@pytest.mark.parametrize("name", ANY_MODEL)
def test_explicit_meshes_train_like_auto_ones(name):
    shape, rules = mesh_rules(name, 8)
    args = example(axes=ms.megatron_axes(2))
    results = {}
    for explicit in (False, True):
        mesh = ms.make_mesh(shape, explicit=explicit)
        step = ms.Sharded(mesh, rules)(train_step)
        model, opt_state = ms.shard(args[0], mesh, rules), ms.shard(args[1], mesh, rules)
        for _ in range(3):
            model, opt_state, loss = jax.block_until_ready(step(model, opt_state, *args[2:]))
        results[explicit] = (model, loss)
        declared = jax.tree_util.tree_leaves(step.specs(model, opt_state, *args[2:]).outputs[0])
        assert [leaf.sharding.spec for leaf in jax.tree_util.tree_leaves(model)] == declared
    for a, b in zip(
        jax.tree_util.tree_leaves(results[True]), jax.tree_util.tree_leaves(results[False]), strict=True
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6)


def test_an_explicit_mesh_shows_the_sharding_in_the_type():
    mesh = ms.make_mesh({"data": 2, "model": 4}, explicit=True)
    layer = ms.shard(
        ms.Linear(8, 16, key=jax.random.key(0), axes=("embed", "mlp")),
        mesh,
        ms.AxisRules(embed=None, mlp="model"),
    )
    assert str(jax.typeof(layer.weight)) == "float32[8,16@model]"


class Bilinear(ms.Layer):
    """A user layer that contracts a split dimension without saying where its output goes."""

    param_fields = ("weight",)

    def __init__(self):
        self.weight = jnp.ones((16, 4))

    def __call__(self, x):
        return x @ self.weight  # x: (batch, mlp@model) @ (mlp@model, classes): ambiguous

    def param_logical_axes(self):
        return {"weight": ("mlp", "classes")}


def test_an_ambiguous_contraction_names_the_layer_and_the_fix():
    mesh = ms.make_mesh({"data": 2, "model": 4}, explicit=True)
    rules = ms.AxisRules(batch="data", embed=None, mlp="model", classes=None)
    model = ms.Sequential([ms.Linear(8, 16, key=jax.random.key(0), axes=("embed", "mlp")), Bilinear()])
    forward = ms.Sharded(mesh, rules)(lambda model, x: model(x))
    with pytest.raises(ShardingError, match=r"in model\.layers\[1\] \(Bilinear\): .*out_sharding=minishard"):
        forward(ms.shard(model, mesh, rules), np.ones((4, 8), np.float32))


def explicit_forward(model, x):  # module level: Sharded and jit reuse their compiled programs
    return model(x)


@settings(max_examples=6)
@given(st.data())
def test_on_random_explicit_meshes_rules_and_models_sharding_changes_no_number(data):
    auto = data.draw(meshes())
    rules = data.draw(axis_rules())
    mesh = ms.make_mesh(dict(auto.shape), explicit=True)
    model = data.draw(mlps(mesh, rules))
    x = np.ones((data.draw(batch_sizes(mesh, rules)), model[0].in_features), np.float32)
    assert_sharded_equivalent(explicit_forward, model, x, mesh=mesh, rules=rules)
