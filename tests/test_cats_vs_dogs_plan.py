"""The source material's second model, cats vs dogs, [200*200*3, 2048, 1024, 2]: planned, never allocated.

``jax.eval_shape`` builds the model out of ShapeDtypeStructs, so ``explain``
can report the sharding plan of ~248 M parameters (0.99 GB) without a byte
of memory; on the 2 x 4 mesh each device holds about a quarter.
"""

import jax
import pytest

import minishard as ms
from minishard.data import DATASET_INFO

SIZES = [DATASET_INFO["cats_vs_dogs"].num_features, 2048, 1024, 2]


@pytest.fixture(scope="module")
def abstract_model():
    return jax.eval_shape(lambda: ms.mlp(SIZES, key=jax.random.key(0), axes=ms.megatron_axes(3)))


def test_the_model_has_248m_parameters_and_allocates_nothing(abstract_model):
    assert SIZES[0] == 120_000
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
    expected = sum(row.bytes // 4 if "model" in str(row.spec) else row.bytes for row in report.rows)
    assert report.device_bytes == expected
    assert 0.25 <= report.device_bytes / report.total_bytes < 0.26
    first = report.rows[0]
    assert (first.path, first.block_shape) == ("layers[0].weight", (120_000, 512))
    assert "layers[0].weight" in str(report)
