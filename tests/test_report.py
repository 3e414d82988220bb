"""minishard.report (``minishard.explain``): what each device holds, and what a step sends, in one report.

The same plan ``Sharded`` uses, read back as rows; the numbers are checked
against the shapes. The last tests plan the source material's second model,
cats vs dogs [200*200*3, 2048, 1024, 2], out of ``jax.eval_shape``
ShapeDtypeStructs: ~248 M parameters (0.99 GB) reported without allocating a
byte.
"""

from __future__ import annotations

from dataclasses import fields

import jax
import pytest
from jax.sharding import PartitionSpec as P
from models import F32, MEGATRON, SIZES, example, train_step

import minishard as ms
from minishard.census import collectives, summary
from minishard.costs import cost_report
from minishard.report import Report, Row, explain
from minishard.rules import AxisRules
from minishard.run.data import DATASET_INFO
from minishard.run.render import report_html, rich_table
from minishard.sharding import LeafPlan, Sharded, make_mesh
from minishard.tree import tree_bytes

RULES_2D = AxisRules(batch="data", embed=None, mlp="model")


def test_explain_counts_each_devices_share():
    mesh = make_mesh({"data": 2, "model": 4})
    model = ms.mlp(SIZES, key=jax.random.key(0), axes=MEGATRON)
    report = explain(model, mesh, RULES_2D)
    assert isinstance(report, Report) and report.collectives is None
    assert report.mesh == {"data": 2, "model": 4}
    w1, _, w2, b2 = report.rows
    assert (w1.leaf.path, w1.leaf.shape, w1.leaf.logical_axes) == (
        "layers[0].weight",
        (784, 512),
        ("embed", "mlp"),
    )
    assert w1.leaf.spec == P(None, "model")
    assert w1.leaf.shard_shape == (784, 128) and w1.dtype == "float32"
    # Split 4 ways over "model", replicated over "data": a quarter per device.
    assert w1.bytes == 784 * 512 * F32 and w1.device_bytes == w1.bytes // 4
    assert (w2.leaf.spec, w2.leaf.shard_shape, w2.device_bytes) == (
        P("model", None),
        (128, 10),
        w2.bytes // 4,
    )
    assert b2.leaf.spec == P(None) and b2.device_bytes == b2.bytes == 10 * F32  # replicated: whole
    assert report.total_bytes == tree_bytes(model) == 1_628_200
    assert report.device_bytes == sum(row.device_bytes for row in report.rows) == 407_080

    text = str(report)
    for row in report.rows:
        assert row.leaf.path in text and str(row.leaf.spec) in text
    assert "P(None, 'model')" in text and "(784, 128)" in text
    assert "1.6 MB unsharded, 407.1 kB per device" in text
    assert "collectives" not in text


def test_explain_with_a_step_lists_its_collectives():
    mesh = make_mesh({"data": 2, "model": 4})
    args = model, *_ = example(axes=MEGATRON)
    report = explain(model, mesh, RULES_2D, step=train_step, args=args)
    expected = collectives(Sharded(mesh, RULES_2D)(train_step).lower(*args))
    assert report.collectives == expected
    assert report.collectives["all-reduce"].bytes == 32 * 10 * F32 + report.device_bytes + F32
    assert "collectives of train_step:" in str(report)
    assert summary(expected).splitlines()[0] in str(report)
    # An already-Sharded function is lowered as it is.
    sharded = Sharded(mesh, RULES_2D)(train_step)
    assert explain(model, mesh, RULES_2D, step=sharded, args=args).collectives == expected
    with pytest.raises(TypeError, match="args"):
        explain(model, mesh, RULES_2D, step=train_step)


def test_explain_with_hardware_prices_the_step():
    mesh = make_mesh({"data": 2, "model": 4})
    args = model, *_ = example(axes=MEGATRON)
    sharded = Sharded(mesh, RULES_2D)(train_step)
    report = explain(model, mesh, RULES_2D, step=sharded, args=args, hardware="v5p")
    expected = cost_report(sharded, args, mesh, RULES_2D, "v5p")
    assert report.cost is not None and report.cost.batch == 64 / 2  # the batch rule: "data", 2 ways
    assert (report.cost.flops, report.cost.communication) == (expected.flops, expected.communication)
    text = str(report)
    assert text.endswith(str(expected)) and "predicted step on TPU v5p, 32 examples per device" in text
    assert report.cost.verdict in text and "collectives of train_step:" in text
    with pytest.raises(TypeError, match="hardware= prices a step; give the step and its args too"):
        explain(model, mesh, RULES_2D, hardware="v5p")
    with pytest.raises(ValueError, match="unknown hardware 'v9': one of v4p, v5e, v5p, v6e, a100, h100"):
        explain(model, mesh, RULES_2D, step=sharded, args=args, hardware="v9")


def test_explain_covers_every_leaf_of_any_tree():
    # An optimizer state with momentum: the velocities are shaped like the
    # model and sharded like it; the step counter is a replicated scalar.
    mesh = make_mesh({"data": 2, "model": 4})
    model = ms.mlp(SIZES, key=jax.random.key(0), axes=MEGATRON)
    state = ms.SGD(ms.exponential_decay(0.1, 0.5, 100), momentum=0.9).init(model)
    report = explain(state, mesh, RULES_2D)
    assert [row.leaf.path for row in report.rows] == [
        "step",
        "velocity.layers[0].weight",
        "velocity.layers[0].bias",
        "velocity.layers[2].weight",
        "velocity.layers[2].bias",
    ]
    step = report.rows[0]
    assert step.leaf.shape == () and step.dtype == "int32" and step.device_bytes == 4
    assert report.rows[1].leaf.spec == P(None, "model")


def test_explain_renders_with_rich():
    pytest.importorskip("rich")
    from rich.console import Console

    mesh = make_mesh({"data": 2, "model": 4})
    args = model, *_ = example(axes=MEGATRON)
    report = explain(model, mesh, RULES_2D, step=train_step, args=args)
    console = Console(record=True, width=200)
    console.print(rich_table(report))
    text = console.export_text()
    assert "layers[0].weight" in text and "P(None, 'model')" in text and "(784, 128)" in text
    assert "all-reduce" in text and "per device" in text
    assert "<table" in report_html(report) or "<pre" in report_html(report)


# -- cats vs dogs: planned, never allocated ------------------------------------------
CATS_VS_DOGS = [DATASET_INFO["cats_vs_dogs"].num_features, 2048, 1024, 2]


@pytest.fixture(scope="module")
def abstract_model():
    return jax.eval_shape(lambda: ms.mlp(CATS_VS_DOGS, key=jax.random.key(0), axes=ms.megatron_axes(3)))


def test_the_model_has_248m_parameters_and_allocates_nothing(abstract_model):
    assert CATS_VS_DOGS[0] == 120_000
    leaves = jax.tree_util.tree_leaves(abstract_model)
    assert all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in leaves)
    n = ms.tree.count_params(abstract_model)
    assert n == 120_000 * 2048 + 2048 + 2048 * 1024 + 1024 + 1024 * 2 + 2
    assert 247e6 < n < 249e6 and round(ms.tree.tree_bytes(abstract_model) / 1e9, 2) == 0.99


def test_sharding_the_hidden_dims_on_model_leaves_a_quarter_per_device(abstract_model):
    mesh = ms.make_mesh({"data": 2, "model": 4})
    rules = ms.AxisRules(batch="data", embed=None, mlp="model", classes=None)
    report = ms.explain(abstract_model, mesh, rules)
    assert report.total_bytes == ms.tree.tree_bytes(abstract_model)
    # Only the 2048-wide hidden dimension ("mlp") is split; the replicated rest is ~0.1% of the bytes.
    expected = sum(row.bytes // 4 if "model" in str(row.leaf.spec) else row.bytes for row in report.rows)
    assert report.device_bytes == expected
    assert 0.25 <= report.device_bytes / report.total_bytes < 0.26
    first = report.rows[0]
    assert (first.leaf.path, first.leaf.shard_shape) == ("layers[0].weight", (120_000, 512))
    assert "layers[0].weight" in str(report)


def test_a_row_adds_bytes_to_the_plans_record_and_repeats_none_of_it():
    # issue 62: a Row holds the LeafPlan sharding made (path, shape, logical axes, spec, shard), and
    # only what the report adds: the dtype and the bytes, whole and per device
    assert [field.name for field in fields(Row)] == ["leaf", "dtype", "bytes", "device_bytes"]
    assert not {field.name for field in fields(Row)} & {field.name for field in fields(LeafPlan)}
