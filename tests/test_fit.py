"""``fit`` on a tiny synthetic dataset: what it promises beyond accuracy (no MNIST needed).

It never deletes the caller's arrays, saves each step once, and refuses to resume
a checkpoint into a run that deals the data out differently.
"""

import jax
import numpy as np
import pytest

import minishard as ms
from minishard.data import Dataset
from minishard.train import ResumeError, fit

MESH_RULES = {"mesh": ms.make_mesh({"data": 8}), "rules": ms.AxisRules(batch="data"), "progress": False}


def tiny_data(seed: int = 0, batch_size: int = 16) -> Dataset:
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (64, 2, 2, 1), dtype=np.uint8)
    return Dataset(images, images.reshape(64, -1).argmax(axis=1), batch_size=batch_size, shuffle_seed=seed)


def tiny_model():
    return ms.mlp([4, 8, 4], key=jax.random.key(0))


def test_fit_leaves_the_callers_model_alive():
    model = tiny_model()
    trained, _, _ = fit(model, ms.SGD(0.1), tiny_data(), epochs=1, log=lambda line: None, **MESH_RULES)
    assert not any(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(model))
    assert not np.array_equal(model[0].weight, trained[0].weight)


def test_each_step_is_saved_once_even_when_checkpoint_every_meets_an_epoch_end(tmp_path):
    lines = []
    fit(tiny_model(), ms.SGD(0.1), tiny_data(), epochs=2, checkpoint_dir=tmp_path, checkpoint_every=2,
        log=lines.append, **MESH_RULES)  # fmt: skip
    assert not [line for line in lines if "discarding" in line], lines
    assert sorted(int(p.name) for p in tmp_path.iterdir()) == [4, 6, 8]  # keep=3: the last three


@pytest.mark.parametrize("changed", [{"seed": 1}, {"batch_size": 32}], ids=["seed", "batch_size"])
def test_resume_refuses_a_run_that_deals_the_data_out_differently(tmp_path, changed):
    fit(tiny_model(), ms.SGD(0.1), tiny_data(), epochs=1, checkpoint_dir=tmp_path, log=lambda line: None,
        **MESH_RULES)  # fmt: skip
    with pytest.raises(ResumeError, match="resume with the same --seed and --batch-size"):
        fit(tiny_model(), ms.SGD(0.1), tiny_data(**changed), epochs=2, checkpoint_dir=tmp_path, resume=True,
            log=lambda line: None, **MESH_RULES)  # fmt: skip
