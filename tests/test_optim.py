"""Optimizers: minishard's schedules, SGD and AdamW against optax, and SGD training an MLP.

``optax`` is the oracle: ``exponential_decay`` and ``warmup_cosine_decay``
must give optax's learning rates, ``SGD`` optax's steps and ``AdamW`` those of
``optax.chain(optax.clip_by_global_norm, optax.adamw)``, one by one, on random
trees of arrays and on minishard models. Then a small MLP trained with ``SGD``
must actually learn a linearly separable problem.
"""

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from named import assert_named
from strategies import array_trees, assert_trees_close, mlp_sizes, random_like, seeds

import minishard
from minishard import SGD, accuracy, cross_entropy, exponential_decay, mlp, one_hot
from minishard.optim import AdamW, AdamWState, global_norm, warmup_cosine_decay, weight_decay_mask


@dataclass(frozen=True)
class Decay:
    init_value: float
    decay_rate: float
    decay_steps: int
    staircase: bool

    def minishard(self):
        return exponential_decay(self.init_value, self.decay_rate, self.decay_steps, self.staircase)

    def optax(self):
        return optax.exponential_decay(
            self.init_value,
            transition_steps=self.decay_steps,
            decay_rate=self.decay_rate,
            staircase=self.staircase,
        )


decays = st.builds(
    Decay,
    init_value=st.floats(1e-3, 1.0),
    decay_rate=st.floats(0.1, 1.5),
    decay_steps=st.integers(1, 50),
    staircase=st.booleans(),
)
learning_rates = st.floats(1e-3, 0.5) | decays
momenta = st.just(0.0) | st.floats(0.1, 0.95)


def both_learning_rates(lr):
    """The same learning rate (a float or a ``Decay``) for minishard and for optax."""
    return (lr, lr) if isinstance(lr, float) else (lr.minishard(), lr.optax())


def optax_step_of(transform, jitted):
    """optax's update and apply: one program under jit, as ours runs there (each op its own compile,
    eagerly: most of a model's example), else op by op as ours runs outside jit."""

    def step(params, grads, state):
        updates, state = transform.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return jax.jit(step) if jitted else step


def assert_sgd_matches_optax(lr, momentum, params, grad_fn, steps, update=None):
    """Run minishard's SGD and optax.sgd side by side; compare params after every step.

    ``grad_fn(params, step)`` gives the gradients; ``update`` replaces
    minishard's ``opt.update`` (to run it under ``jax.jit``).
    """
    ours_lr, optax_lr = both_learning_rates(lr)
    ours = SGD(ours_lr, momentum)
    theirs = optax.sgd(optax_lr, momentum=momentum or None)
    optax_step = optax_step_of(theirs, jitted=update is not None)
    update = update or ours.update
    ours_params, ours_state = params, ours.init(params)
    optax_params, optax_state = params, theirs.init(params)
    for step in range(steps):
        ours_params, ours_state = update(ours_params, grad_fn(ours_params, step), ours_state)
        optax_params, optax_state = optax_step(optax_params, grad_fn(optax_params, step), optax_state)
        assert_trees_close(ours_params, optax_params, rtol=1e-6, atol=1e-6)  # a few float32 ulps at O(1)
    assert int(ours_state.step) == steps  # a constant rate counts its steps too


# -- the schedule -------------------------------------------------------------
@given(decay=decays, steps=st.lists(st.integers(0, 500), min_size=1, max_size=8))
def test_exponential_decay_matches_optax(decay, steps):
    steps = jnp.asarray(steps, jnp.int32)
    np.testing.assert_allclose(decay.minishard()(steps), decay.optax()(steps), rtol=1e-6)


def test_exponential_decay_starts_at_init_value_and_staircase_holds_steady():
    smooth = exponential_decay(0.1, decay_rate=0.5, decay_steps=4)
    stairs = exponential_decay(0.1, decay_rate=0.5, decay_steps=4, staircase=True)
    np.testing.assert_allclose(smooth(jnp.arange(0, 9, 2)), 0.1 * 0.5 ** np.arange(0, 2.5, 0.5), rtol=1e-6)
    np.testing.assert_allclose(stairs(jnp.arange(9)), 0.1 * 0.5 ** (np.arange(9) // 4), rtol=1e-6)


@pytest.mark.parametrize("decay_steps", [0, -3])
def test_exponential_decay_needs_positive_decay_steps(decay_steps):
    with pytest.raises(ValueError, match=f"decay_steps must be a positive int, got {decay_steps}"):
        exponential_decay(0.1, 0.5, decay_steps)


# -- SGD against optax ----------------------------------------------------------
@given(params=array_trees(), lr=learning_rates, momentum=momenta, seed=seeds)
def test_sgd_matches_optax_on_trees_of_arrays(params, lr, momentum, seed):
    rng = np.random.default_rng(seed)
    grads = [random_like(params, rng) for _ in range(4)]
    assert_sgd_matches_optax(lr, momentum, params, lambda _, step: grads[step], steps=4)


@pytest.mark.slow  # over 5 s
@settings(max_examples=4)  # as AdamW's below: test_sgd_matches_optax_on_trees_of_arrays sweeps 10 trees
@given(sizes=mlp_sizes(), lr=learning_rates, momentum=momenta, seed=seeds)
def test_sgd_matches_optax_on_models_under_jit(sizes, lr, momentum, seed):
    model = mlp(sizes, key=jax.random.key(seed), scale=1.0)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((8, sizes[0]), np.float32)
    targets = np.eye(sizes[-1], dtype=np.float32)[rng.integers(0, sizes[-1], 8)]
    grad_fn = jax.jit(jax.grad(lambda m: cross_entropy(m(x), targets)))
    update = jax.jit(SGD(both_learning_rates(lr)[0], momentum).update)
    assert_sgd_matches_optax(lr, momentum, model, lambda m, _: grad_fn(m), steps=3, update=update)


def test_sgd_state_is_a_pytree_shaped_like_the_params():
    params = {"w": jnp.ones((2, 3)), "b": [jnp.zeros(3)]}
    with_momentum = SGD(exponential_decay(0.1, 0.5, 10), momentum=0.9).init(params)
    assert isinstance(with_momentum, minishard.SGDState) and int(with_momentum.step) == 0
    assert jax.tree_util.tree_structure(with_momentum.velocity) == jax.tree_util.tree_structure(params)
    plain = SGD(0.1).init(params)  # the step starts at 0 for a constant rate too
    assert plain.velocity is None and plain.step.dtype == jnp.int32 and int(plain.step) == 0


def test_every_sgd_counts_its_steps_so_a_constant_and_a_changing_rate_share_one_state():
    params = {"w": jnp.ones(2)}
    decaying, constant = SGD(exponential_decay(0.1, 0.5, 10)), SGD(0.1)
    _, state = constant.update(params, params, decaying.init(params))
    _, state = decaying.update(params, params, state)
    assert state.step.dtype == jnp.int32 and int(state.step) == 2


def test_sgd_refuses_adamws_state_naming_it():
    params = {"w": jnp.ones(2)}
    with pytest.raises(ValueError) as error:
        SGD(0.1).update(params, params, AdamW(0.1).init(params))
    assert str(error.value) == (
        "SGD.update: the state is a AdamWState, not SGD's (step, velocity); make the state with the same "
        "SGD's init"
    )


def test_sgd_refuses_a_state_without_a_step():
    params = {"w": jnp.ones(2)}
    with pytest.raises(ValueError, match=r"^SGD.update: the state has no step \(every SGD counts"):
        SGD(0.1).update(params, params, minishard.SGDState(step=None, velocity=None))


def test_momentum_refuses_a_state_without_velocity_and_plain_sgd_one_with():
    params = {"w": jnp.ones(2)}
    with pytest.raises(ValueError) as error:
        SGD(0.1, momentum=0.9).update(params, params, SGD(0.1).init(params))
    assert str(error.value) == (
        "SGD.update: this SGD has momentum 0.9, but the state has no velocity; "
        "make the state with the same SGD's init"
    )
    with pytest.raises(ValueError) as error:
        SGD(0.1).update(params, params, SGD(0.1, momentum=0.9).init(params))
    assert str(error.value) == (
        "SGD.update: this SGD has no momentum, but the state has a velocity; "
        "make the state with the same SGD's init"
    )


@pytest.mark.parametrize(
    ("rate", "signature"), [(lambda: 0.1, "()"), (lambda step, total: 0.1, "(step, total)")]
)
def test_a_learning_rate_must_take_the_step_and_is_refused_when_built(rate, signature):
    with pytest.raises(TypeError) as error:
        SGD(rate)
    assert str(error.value) == (
        f"SGD: learning_rate is a callable of {signature}, but a learning rate is called with one argument, "
        "the step; write lambda step: ..., or use exponential_decay"
    )
    assert SGD(lambda step, total=10: 0.1 * (1 - step / total)).init({}).step == 0  # one argument will do


@pytest.mark.parametrize("momentum", [-0.1, 1.0])
def test_sgd_rejects_momentum_outside_0_1(momentum):
    with pytest.raises(ValueError, match=r"momentum must be a number in \[0, 1\)"):
        SGD(0.1, momentum)


# -- AdamW against optax.chain(clip_by_global_norm, adamw) ----------------------------------
def assert_adamw_matches_optax(params, grad_fn, steps, *, lr, warmup=None, update=None, **hyper):
    """minishard's AdamW and optax's clip + adamw side by side; params compared after every step.

    ``warmup``: ``(warmup_steps, decay_steps)`` of a warmup-cosine schedule peaking at ``lr``.
    """
    if warmup:
        ours_lr = warmup_cosine_decay(lr, *warmup, end_value=lr / 10)
        optax_lr = optax.warmup_cosine_decay_schedule(0.0, lr, *warmup, end_value=lr / 10)
    else:
        ours_lr = optax_lr = lr
    ours = AdamW(ours_lr, **hyper)  # its defaults, read back for optax: b2 0.99 is not optax's
    theirs = optax.chain(
        optax.clip_by_global_norm(ours.clip_norm) if ours.clip_norm else optax.identity(),
        optax.adamw(
            optax_lr,
            b1=ours.b1,
            b2=ours.b2,
            eps=ours.eps,
            weight_decay=ours.weight_decay,
            mask=weight_decay_mask(params),
        ),
    )
    optax_step = optax_step_of(theirs, jitted=update is not None)
    update = update or ours.update
    ours_params, ours_state = params, ours.init(params)
    optax_params, optax_state = params, theirs.init(params)
    for step in range(steps):
        # The same gradients for both: Adam divides by sqrt(nu), so a gradient near 0 turns a
        # last-ulp difference in the params into a visible one in the next step's direction.
        grads = grad_fn(optax_params, step)
        ours_params, ours_state = update(ours_params, grads, ours_state)
        optax_params, optax_state = optax_step(optax_params, grads, optax_state)
        assert_trees_close(ours_params, optax_params, rtol=1e-5, atol=1e-6)
    assert int(ours_state.step) == steps


adam_hyper = st.fixed_dictionaries(
    {"b1": st.floats(0.0, 0.95), "b2": st.floats(0.5, 0.999), "weight_decay": st.floats(0.0, 0.5)},
    optional={"eps": st.floats(1e-8, 1e-3), "clip_norm": st.none() | st.floats(0.1, 10.0)},
)


@given(
    params=array_trees(), lr=st.floats(1e-3, 0.1), hyper=adam_hyper, scale=st.floats(0.01, 10.0), seed=seeds
)
def test_adamw_matches_optax_clip_and_adamw_on_trees_of_arrays(params, lr, hyper, scale, seed):
    rng = np.random.default_rng(seed)
    grads = [jax.tree.map(lambda g: scale * g, random_like(params, rng)) for _ in range(3)]  # clipped or not
    assert_adamw_matches_optax(params, lambda _, step: grads[step], steps=3, lr=lr, **hyper)


@pytest.mark.slow  # over 5 s: jitted steps for every example
# 4 examples, not the profile's 10: each compiles its own gradient and update (its sizes, its lr); the
# update is the same code leaf by leaf for any tree, which the 10 trees of
# test_adamw_matches_optax_clip_and_adamw_on_trees_of_arrays sweep.
@settings(max_examples=4)  # the loaded profile's settings (tests/conftest.py), four examples
@given(sizes=mlp_sizes(), lr=st.floats(1e-3, 0.1), seed=seeds)
def test_adamw_matches_optax_on_models_under_jit_with_nanogpts_schedule(sizes, lr, seed):
    model = mlp(sizes, key=jax.random.key(seed), scale=1.0)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((8, sizes[0]), np.float32)
    targets = np.eye(sizes[-1], dtype=np.float32)[rng.integers(0, sizes[-1], 8)]
    grad_fn = jax.jit(jax.grad(lambda m: cross_entropy(m(x), targets)))
    update = jax.jit(AdamW(warmup_cosine_decay(lr, 2, 6, end_value=lr / 10)).update)
    assert_adamw_matches_optax(model, lambda m, _: grad_fn(m), steps=8, lr=lr, warmup=(2, 6), update=update)


@given(peak=st.floats(1e-4, 1.0), warmup=st.integers(0, 20), extra=st.integers(1, 100))
def test_warmup_cosine_decay_matches_optax_down_to_a_tenth(peak, warmup, extra):
    ours = warmup_cosine_decay(peak, warmup, warmup + extra, end_value=peak / 10)
    theirs = optax.warmup_cosine_decay_schedule(0.0, peak, warmup, warmup + extra, end_value=peak / 10)
    steps = jnp.arange(130)  # past the end of every schedule drawn; one shape, so one compile
    np.testing.assert_allclose(ours(steps), theirs(steps), rtol=1e-5, atol=1e-9)


def test_adamw_clips_the_global_norm_of_all_gradients_together():
    params = {"a": jnp.zeros(3), "b": jnp.zeros((2, 2))}
    grads = {"a": jnp.full(3, 3.0), "b": jnp.full((2, 2), 4.0)}  # norm sqrt(27 + 64)
    assert float(global_norm(grads)) == pytest.approx(np.sqrt(91.0))
    opt = AdamW(1.0, b1=0.0, b2=0.0, eps=1.0, weight_decay=0.0, clip_norm=1.0)
    params, _ = opt.update(params, grads, opt.init(params))
    # b1 = b2 = 0: the step is g / (|g| + eps) of the clipped gradient g = 3 / sqrt(91), 4 / sqrt(91)
    clipped = {name: g / np.sqrt(91.0) for name, g in grads.items()}
    for name, g in clipped.items():
        np.testing.assert_allclose(params[name], -g / (np.abs(g) + 1.0), rtol=1e-6)


def test_adamw_decays_matrices_only_and_its_moments_are_shaped_like_the_params():
    model = mlp([3, 4, 2], key=jax.random.key(0))
    mask = weight_decay_mask(model)
    assert [leaf for leaf in jax.tree.leaves(mask)] == [True, False, True, False]  # weights, not biases
    opt = AdamW(0.1, weight_decay=0.5)
    state = opt.init(model)
    assert isinstance(state, AdamWState) and int(state.step) == 0
    assert jax.tree.structure(state.mu) == jax.tree.structure(state.nu) == jax.tree.structure(model)
    assert state.mu[0].weight is not state.nu[0].weight  # two buffers: a donated state is no trouble
    zero = jax.tree.map(jnp.zeros_like, model)
    decayed, _ = opt.update(model, zero, state)  # no gradient: only the decay moves anything
    np.testing.assert_allclose(decayed[0].weight, model[0].weight * (1 - 0.1 * 0.5), rtol=1e-6)
    np.testing.assert_array_equal(decayed[0].bias, model[0].bias)


# -- training ----------------------------------------------------------------
def test_sgd_trains_an_mlp_on_linearly_separable_data():
    x_key, model_key = jax.random.split(jax.random.key(0))
    x = jax.random.normal(x_key, (256, 2))
    labels = (x @ jnp.array([1.5, -1.0]) > 0.25).astype(jnp.int32)  # a linear teacher
    model = mlp([2, 16, 2], key=model_key, scale=0.5)
    opt = SGD(exponential_decay(0.5, decay_rate=0.5, decay_steps=200), momentum=0.9)

    def loss(model):
        return cross_entropy(model(x), one_hot(labels, 2))

    @jax.jit
    def train(model, state):
        def step(carry, _):
            model, state = carry
            loss_value, grads = jax.value_and_grad(loss)(model)
            return opt.update(model, grads, state), loss_value

        return jax.lax.scan(step, (model, state), length=200)

    (trained, state), losses = train(model, opt.init(model))
    assert int(state.step) == 200
    assert losses[-1] < 0.2 * losses[0]
    assert float(accuracy(trained(x), labels)) > 0.95


# -- bad inputs: each named before any work starts (the call, the exception, words its message holds)
TWO = {"w": jnp.ones(2)}
BAD_INPUTS = [
    (lambda: SGD(-0.1), ValueError, ["learning_rate", "-0.1"]),
    (lambda: SGD(0.0), ValueError, ["learning_rate", "> 0"]),
    (lambda: SGD(float("nan")), ValueError, ["learning_rate", "nan"]),
    (lambda: SGD("0.1"), ValueError, ["learning_rate", "'0.1'"]),
    (lambda: SGD(0.1, momentum=1.5), ValueError, ["momentum must be a number in [0, 1)", "1.5"]),
    (lambda: exponential_decay(0.1, -0.5, 100), ValueError, ["decay_rate", "-0.5"]),
    (lambda: exponential_decay(0.1, 0.5, 0), ValueError, ["decay_steps must be a positive int", "0"]),
    # a negative schedule is refused where it is built, before any optimizer evaluates it at step 0
    (
        lambda: exponential_decay(-0.1, 0.5, 100),
        ValueError,
        ["exponential_decay: init_value must be a finite number > 0, got -0.1"],
    ),
    (
        lambda: warmup_cosine_decay(-1.0, 1, 10),
        ValueError,
        ["warmup_cosine_decay: peak_value must be a finite number > 0, got -1.0"],
    ),
    (
        lambda: warmup_cosine_decay(1.0, 1, 10, end_value=-1),
        ValueError,
        ["warmup_cosine_decay: end_value must be a number from 0 to peak_value 1.0, got -1"],
    ),
    (
        lambda: SGD(lambda step: -0.1 * (step + 1)),
        ValueError,
        ["SGD: learning_rate(0) is -0.1; a schedule must give a finite number >= 0"],
    ),
    (lambda: AdamW(lambda step: jnp.inf), ValueError, ["AdamW: learning_rate(0) is inf"]),
    (lambda: AdamW(-1e-3), ValueError, ["AdamW: learning_rate", "-0.001"]),
    (lambda: AdamW(1e-3, b2=1.0), ValueError, ["AdamW: b2 must be a number in [0, 1)", "1.0"]),
    (lambda: AdamW(1e-3, weight_decay=-0.1), ValueError, ["AdamW: weight_decay must be a number >= 0"]),
    (lambda: AdamW(1e-3, clip_norm=0.0), ValueError, ["AdamW: clip_norm", "None: no clipping", "0.0"]),
    (
        lambda: AdamW(1e-3).update(TWO, TWO, SGD(0.1).init(TWO)),
        ValueError,
        ["AdamW.update: the state is a SGDState", "same AdamW's init"],
    ),
    (
        lambda: AdamW(1e-3).update(TWO, {"w": jnp.ones(3)}, AdamW(1e-3).init(TWO)),
        ValueError,
        ["AdamW.update: grads do not match params at params.w", "(3,)"],
    ),
    (
        lambda: SGD(0.1).update({"w": jnp.ones(2)}, {"w": jnp.ones(3)}, SGD(0.1).init({"w": jnp.ones(2)})),
        ValueError,
        ["grads do not match params at params.w", "(2,)", "(3,)"],
    ),
]


@pytest.mark.parametrize(("call", "kind", "words"), BAD_INPUTS)
def test_bad_input_is_named(call, kind, words):
    assert_named(call, kind, words)
