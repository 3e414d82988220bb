"""minishard.testing as a whole: minishard's own sharding checked with it, and the mutation matrix.

The first properties use the strategies to check minishard itself: on meshes
(1x8, 2x4, 4x2 or 8x1 on the 8 simulated devices), rules and MLPs drawn at
random, sharded forward passes and training steps equal the unsharded ones,
every device holds the shard ``plan`` predicts, spec trees have the model's
structure, and an impossible request fails with a ``ShardingError`` naming the
leaf before anything is compiled.

Then the *mutation matrix*: the residual MLP of docs/testing.md
(``testing_fixtures``), broken in the ways real models break, must pass all
three assertions when correct, and each break must be caught by the assertion
meant for it; and a failing property is shrunk reusing compiled programs.
The tests of each module of minishard.testing are in test_testing_<module>.py.

Compiling is what costs time here, so the functions under test live at module
level (jit caches compiled code per function) and widths stay small.
"""

import re
import subprocess
import sys
from typing import Any

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P
from strategies import random_like, seeds
from testing_fixtures import (
    BATCH,
    EMBED,
    HIDDEN,
    MESH,
    MUTATIONS,
    RULES,
    assert_shards_as_planned,
    compilations,
    intended_shards,
    model_and_batch,
    residual_mlp,
    swapped_residual_mlp,
)
from testing_fixtures import forward as residual_forward

import minishard as ms
from minishard.rules import ShardingError
from minishard.sharding import partition_specs
from minishard.testing import (
    assert_collectives,
    assert_placement,
    assert_sharded_equivalent,
    axis_rules,
    batch_sizes,
    batches,
    megatron_limits,
    meshes,
    mlps,
    models,
)

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


# -- equal results ---------------------------------------------------------------
@given(setups())
def test_forward_pass_is_sharding_invariant(setup):
    mesh, rules, model, x = setup
    assert_sharded_equivalent(forward, model, x, mesh=mesh, rules=rules)


@pytest.mark.slow  # a training step compiles per example: 5 to 20 s
@given(setups(), seeds)
def test_sgd_step_is_sharding_invariant_and_keeps_the_planned_shards(setup, seed):
    mesh, rules, model, x = setup
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, model[-1].out_features, len(x))
    # A nonzero velocity and step, so the momentum term and the schedule count.
    opt_state = ms.SGDState(np.int32(rng.integers(0, 20)), random_like(model, rng))
    new_model, new_state, _ = assert_sharded_equivalent(
        train_step, model, opt_state, x, labels, mesh=mesh, rules=rules, rtol=1e-4, atol=1e-5
    )
    assert_shards_as_planned(model, new_model, mesh, rules)
    assert_shards_as_planned(model, new_state.velocity, mesh, rules)  # velocities are laid out like params


# -- placement ---------------------------------------------------------------------
@given(setups())
def test_shard_places_the_shards_plan_computes(setup):
    mesh, rules, model, _ = setup
    assert_shards_as_planned(model, jax.block_until_ready(ms.shard(model, mesh, rules)), mesh, rules)


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
        assert_shards_as_planned(model, ms.shard(model, mesh, rules), mesh, rules)
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


# -- the three assertions, and the mutations each must catch ----------------------------
CAUGHT = {  # mutation -> the assertions that must fail on it
    "correct": set(),
    "correct shard_map": set(),
    "swapped halves": {"placement", "communication"},  # reduces (batch, hidden) instead of (batch, embed)
    # XLA slices the replicated second weight on each device itself: Megatron's traffic, with the
    # whole weight in every device's memory. Only the placement shows it.
    "dropped annotation": {"placement"},
    "mlp -> data rule": {"placement", "communication"},
    "extra all-gather": {"communication"},
    "pmean for psum": {"numbers"},  # a bug in the numbers, not in the placement
}


@pytest.mark.parametrize("name", MUTATIONS)
def test_each_assertion_catches_its_mutations_and_passes_the_correct_model(name):
    axes, rules, fn = MUTATIONS[name]
    model, x = model_and_batch(axes)
    checks = {
        "numbers": lambda: assert_sharded_equivalent(
            fn, model, x, mesh=MESH, rules=rules, reference=residual_forward
        ),
        "placement": lambda: assert_placement(
            ms.shard(model, MESH, rules), MESH, intended_shards(HIDDEN, MESH.shape["model"]), rules=rules
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
    def residual_property(data):  # the property of docs/testing.md, numbers and placement
        runs.append(data)
        mesh = data.draw(meshes(min_sizes={"model": 2}))
        model = data.draw(models(build, mesh, rules, fixed={"embed": EMBED}))
        x = data.draw(batches(mesh, rules, EMBED))
        assert_sharded_equivalent(residual_forward, model, x, mesh=mesh, rules=rules)
        blocks = intended_shards(model.inner[0].out_features, mesh.shape["model"])
        assert_placement(ms.shard(model, mesh, rules), mesh, blocks, rules=rules)

    with compilations() as compiled, pytest.raises(AssertionError, match="assert_placement") as failure:
        residual_property()
    assert f"Mesh(axis_sizes={where}" in failure.value.__notes__[1]  # the simplest failing mesh
    # At most 3 meshes x 2 hidden widths x 2 batch sizes, a sharded and a reference program each:
    # however often hypothesis runs the test while it shrinks, candidates reuse compiled programs.
    assert len(compiled) <= 24 and len(runs) > 1, (len(runs), compiled)


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
