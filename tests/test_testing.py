"""Sharding changes where a program runs, never what it computes.

Each property draws a mesh (1x8, 2x4, 4x2 or 8x1 on the 8 simulated devices),
rules and an MLP with the strategies of ``minishard.testing`` and checks one
promise of ``minishard.sharding``: sharded forward passes and training steps
equal the unsharded ones, every device holds the block ``plan`` predicts,
spec trees have the model's structure, and an impossible request fails with a
``ShardingError`` naming the leaf before anything is compiled.

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
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P
from strategies import random_like, seeds

import minishard as ms
from minishard.rules import ShardingError
from minishard.sharding import partition_specs, plan
from minishard.testing import assert_sharded_equivalent, axis_rules, batch_sizes, meshes, mlps
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
