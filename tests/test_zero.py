"""minishard.zero: ZeRO written by hand computes what Sharded data parallelism computes,
and sends the analytic minimum: an all-gather and a reduce-scatter of the parameters."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import minishard as ms
from minishard.census import collectives
from minishard.precision import BF16
from minishard.run.steps import make_train_step
from minishard.zero import Mastered, flat_padded, unpadded, zero_train_step

MESH_SHAPE = {"data": 8}


def random_batch(seed, examples, features, classes):
    rng = np.random.default_rng(seed)
    images = rng.standard_normal((examples, features)).astype(np.float32)
    return {"image": images, "label": rng.integers(0, classes, examples).astype(np.int32)}


def run_both(model, optimizer, batches, level):
    """Train the same model with Sharded data parallelism and with ZeRO; return both."""
    mesh = ms.make_mesh(MESH_SHAPE)
    dp = ms.Sharded(mesh, ms.AxisRules(batch="data"))(make_train_step(optimizer))
    zero = zero_train_step(optimizer, mesh, level=level)
    expected, expected_state = model, optimizer.init(model)
    got = zero.shard(model)
    state = zero.init(got)
    for batch in batches:  # wait for each step: simulated devices share two cores
        expected, expected_state, expected_loss, _ = jax.block_until_ready(
            dp(expected, expected_state, batch)
        )
        got, state, loss, _ = jax.block_until_ready(zero(got, state, batch))
        assert float(loss) == pytest.approx(float(expected_loss), rel=1e-5, abs=1e-6)
    return expected, zero.gather(got), state


@pytest.mark.slow  # 3 examples x 2 compiled steps
@settings(max_examples=3)
@given(
    hidden=st.sampled_from([3, 8, 13]),
    level=st.sampled_from([2, 3]),
    momentum=st.sampled_from([0.0, 0.9]),
    seed=st.integers(0, 2**16),
)
def test_zero_equals_sharded_data_parallelism_after_several_steps(hidden, level, momentum, seed):
    model = ms.mlp([5, hidden, 4], key=jax.random.key(seed))
    batches = [random_batch(seed + i, 16, 5, 4) for i in range(3)]
    expected, got, _ = run_both(model, ms.SGD(0.1, momentum=momentum), batches, level)
    assert jax.tree.structure(got) == jax.tree.structure(expected)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # two trainings of two steps, each compiled: ~7 s each here
@pytest.mark.parametrize("level", [2, 3])
def test_zero_with_a_decaying_rate_matches_and_keeps_the_velocity_split(level):
    optimizer = ms.SGD(ms.exponential_decay(0.2, 0.5, 1), momentum=0.9)
    model = ms.mlp([6, 11, 3], key=jax.random.key(1))
    expected, got, state = run_both(model, optimizer, [random_batch(i, 8, 6, 3) for i in range(2)], level)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert int(state.step) == 2
    velocity = state.velocity[0].weight  # (6, 11): 66 numbers, padded to 72, 9 on each device
    assert velocity.shape == (72,) and velocity.addressable_shards[0].data.shape == (9,)


@pytest.mark.parametrize("level", [pytest.param(2, marks=pytest.mark.slow), 3])  # level 2: ~9 s here
def test_zero_sends_the_analytic_minimum(level):
    # The default MNIST MLP: 407,050 float32 parameters. Padded so each splits in 8:
    # (784, 512) 401,408 and (512,) and (512, 10) divide already; (10,) becomes 16.
    model = ms.mlp([784, 512, 10], key=jax.random.key(0))
    padded_bytes = (401_408 + 512 + 5_120 + 16) * 4
    assert padded_bytes == ms.tree.tree_bytes(model) + 6 * 4 == 1_628_224
    optimizer = ms.SGD(0.1, momentum=0.9)
    step = zero_train_step(optimizer, ms.make_mesh(MESH_SHAPE), level=level)
    placed = step.shard(model)
    found = collectives(step.lower(placed, step.init(placed), random_batch(0, 128, 784, 10)))
    # All-gather: every device ends with every parameter (its result: the whole).
    assert found["all-gather"].bytes == padded_bytes
    # Reduce-scatter: every device ends with its 1/8 of the summed gradient.
    assert found["reduce-scatter"].bytes == padded_bytes // 8 == 203_528
    # No all-reduce of the gradient (Sharded data parallelism all-reduces all 1,628,200 B):
    # only the loss and the accuracy, 4 bytes each.
    assert found["all-reduce"].bytes == 8


def test_zero3_trains_a_model_that_is_not_a_sequential():
    # Level 3 gathers a Sequential layer by layer, any other model at once. (The default
    # ViT was checked the same way by hand: equal after a step at both levels, to 7e-9;
    # as a test it compiles for ~50 s here.)
    model = ms.Linear(6, 3, key=jax.random.key(2))
    expected, got, _ = run_both(model, ms.SGD(0.1, momentum=0.9), [random_batch(0, 8, 6, 3)] * 2, 3)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_flat_padded_round_trips_and_bad_arguments_are_refused():
    x = jnp.arange(10.0).reshape(2, 5)
    assert flat_padded(x, 4).shape == (12,) and jnp.array_equal(unpadded(flat_padded(x, 4), x), x)
    mesh = ms.make_mesh(MESH_SHAPE)
    with pytest.raises(ValueError, match="level must be 1, 2 or 3"):
        zero_train_step(ms.SGD(0.1), mesh, level=4)
    with pytest.raises(ValueError, match="no axis 'model'"):
        zero_train_step(ms.SGD(0.1), mesh, axis="model")
    with pytest.raises(ValueError, match="zero_train_step: compute must be one of"):
        zero_train_step(ms.SGD(0.1), mesh, compute="float16")
    with pytest.raises(ValueError, match="compute='bfloat16' keeps the weights whole: level 1 or 2"):
        zero_train_step(ms.SGD(0.1), mesh, level=3, compute="bfloat16")


@pytest.mark.slow  # four short trainings: ~5 s here
def test_fit_trains_with_a_zero_step_and_resumes_it(tmp_path):
    # FitSettings(make_step=...): ZeRO places the state, fit evaluates and saves the gathered model.
    from minishard.run.data import Dataset
    from minishard.run.train import FitSettings, fit

    rng = np.random.default_rng(0)
    data = Dataset(rng.integers(0, 255, (128, 2, 2, 1)).astype(np.uint8), rng.integers(0, 2, 128), 32)
    mesh, model = ms.make_mesh(MESH_SHAPE), ms.mlp([4, 6, 2], key=jax.random.key(0))
    common = dict(mesh=mesh, rules=ms.AxisRules(batch="data"), eval_data=data, log=lambda line: None)
    expected, _, history = fit(model, ms.SGD(0.1, momentum=0.9), data, FitSettings(epochs=2, **common))
    zero = dict(make_step=lambda opt: zero_train_step(opt, mesh, level=3), checkpoint_dir=tmp_path)
    fit(model, ms.SGD(0.1, momentum=0.9), data, FitSettings(epochs=1, **common, **zero))
    got, state, resumed = fit(
        model, ms.SGD(0.1, momentum=0.9), data, FitSettings(epochs=2, resume=True, **common, **zero)
    )
    assert [r["test_acc"] for r in resumed] == [r["test_acc"] for r in history]
    assert state.velocity[0].weight.shape == (24,)  # ZeRO's flat shards: 4 x 6, 3 per device
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):  # whole again, as fit returns it
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_batch_that_does_not_split_over_the_devices_is_named():
    step = zero_train_step(ms.SGD(0.1), ms.make_mesh(MESH_SHAPE), level=2)
    model = step.shard(ms.mlp([4, 8, 2], key=jax.random.key(0)))
    with pytest.raises(
        ValueError,
        match=r"^ZeroStep: a batch of 12 examples does not split over the 8 devices of axis 'data'",
    ):
        step(model, step.init(model), random_batch(0, 12, 4, 2))


@pytest.mark.slow  # two trainings of two steps, each compiled: ~8 s here
def test_zero1_in_bfloat16_updates_a_float32_master_as_sharded_bf16_does():
    """compute="bfloat16": the weights whole in bfloat16, each device's 1/8 of a float32 master beside
    AdamW's moments. Sharded's BF16 step, given the same weights as its float32 master, computes the same
    bfloat16 forward and float32 gradients: after two steps its model is the gathered master, and the
    ZeRO step's weights are that master cast to bfloat16."""
    mesh, optimizer = ms.make_mesh(MESH_SHAPE), ms.AdamW(1e-2)
    zero = zero_train_step(optimizer, mesh, level=1, compute="bfloat16")
    got = zero.shard(ms.mlp([5, 8, 4], key=jax.random.key(0)))
    state = zero.init(got)
    expected = jax.tree.map(lambda w: w.astype(jnp.float32), got)  # the same weights, as a float32 master
    dp = ms.Sharded(mesh, ms.AxisRules(batch="data"))(make_train_step(optimizer, precision=BF16))
    expected_state = optimizer.init(expected)
    for batch in [random_batch(i, 16, 5, 4) for i in range(2)]:
        expected, expected_state, expected_loss, _ = jax.block_until_ready(
            dp(expected, expected_state, batch)
        )
        got, state, loss, _ = jax.block_until_ready(zero(got, state, batch))
        assert float(loss) == pytest.approx(float(expected_loss), rel=1e-5)
    assert isinstance(state, Mastered) and state.master[0].weight.shape == (40,)  # 5 x 8, 5 a device
    master = jax.tree.map(unpadded, state.master, expected)
    for weights, ours, theirs in zip(*(jax.tree.leaves(tree) for tree in (got, master, expected))):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
        assert weights.dtype == jnp.bfloat16 and jnp.array_equal(weights, ours.astype(jnp.bfloat16))
