"""minishard.precision: fp16's loss scale against jmp's, step by step; the skip; the cast and the
reduction's dtype read from compiled programs."""

from __future__ import annotations

import functools
import json
import os
import re

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import pytest

from minishard import SGD, AdamW, Sharded, make_mesh, megatron_axes, mlp
from minishard import precision as mp
from minishard.census import as_asked, collectives
from minishard.losses import classification_loss
from minishard.run.cli import main
from minishard.run.steps import make_train_step
from minishard.styles import mesh_rules

# --- 1. the dynamic loss scale, against jmp ------------------------------------------------------

PERIOD = 2000  # jmp's default, and minishard's
# 3 overflows; a run of `period` finite steps (the scale doubles at its end); an overflow after 1,999
# finite steps (the count starts again, no doubling); 20 overflows in a row (the floor at 1); more finite.
FINITE = [False] * 3 + [True] * PERIOD + [True] * (PERIOD - 1) + [False] + [False] * 20 + [True] * 5


def _grads(finite: list[bool]) -> dict[str, jax.Array]:
    """A gradient pytree per step, stacked: an inf, a NaN or nothing in one of its leaves."""
    n = len(finite)
    bad = np.array([np.inf if i % 2 else np.nan for i in range(n)], np.float32)
    w = np.ones((n, 3, 2), np.float32)
    w[:, 1, 0] = np.where(finite, 1.0, bad)
    return {"w": jnp.asarray(w), "b": jnp.ones((n, 2), jnp.float32)}


def test_the_loss_scale_follows_jmps_step_by_step():
    def both(carry, grads):
        ours, theirs = carry
        finite, their_finite = mp.all_finite(grads), jmp.all_finite(grads)
        ours, theirs = mp.adjust(ours, finite), theirs.adjust(their_finite)
        return (ours, theirs), (
            ours.scale,
            ours.good,
            ~finite,
            theirs.loss_scale,
            theirs.counter,
            ~their_finite,
        )

    start = (mp.LossScale.start(), jmp.DynamicLossScale(jnp.float32(2.0**15)))
    _, (scale, good, skip, their_scale, counter, their_skip) = jax.lax.scan(both, start, _grads(FINITE))
    np.testing.assert_array_equal(scale, their_scale)
    np.testing.assert_array_equal(good, counter)
    np.testing.assert_array_equal(skip, their_skip)
    np.testing.assert_array_equal(skip, ~np.array(FINITE))
    assert float(scale[2]) == 2.0**12  # three halvings
    assert float(scale[2 + PERIOD - 1]) == 2.0**12 and float(scale[2 + PERIOD]) == 2.0**13  # one doubling
    assert float(scale[-6]) == 1.0 and float(scale[-1]) == 1.0  # the floor, then finite steps stay there


def _fp16_case():
    model = mlp([8, 16, 4], key=jax.random.key(0))
    optimizer = mp.LossScaled(AdamW(1e-2))
    images = jax.random.normal(jax.random.key(1), (16, 8))
    batch = {"image": images, "label": jnp.arange(16) % 4, "poison": jnp.zeros(16)}
    return model, optimizer, batch


def _poisoned(model, batch):
    """The classification loss plus ``poison``'s mean times the first weight's sum: an inf gradient."""
    value, aux = classification_loss(model, {k: v for k, v in batch.items() if k != "poison"})
    return value + batch["poison"].mean() * jnp.sum(model.layers[0].weight), aux


def test_an_fp16_step_with_an_inf_gradient_changes_nothing_and_halves_the_scale():
    model, optimizer, batch = _fp16_case()
    step = jax.jit(make_train_step(optimizer, _poisoned, precision=mp.FP16))
    state = optimizer.init(model)
    new, new_state, *_ = step(model, state, {**batch, "poison": jnp.full(16, jnp.inf)})
    for before, after in zip(jax.tree.leaves((model, state.inner)), jax.tree.leaves((new, new_state.inner))):
        assert before.dtype == after.dtype and np.array_equal(before, after)  # bit for bit
    assert float(new_state.loss_scale.scale) == 2.0**14 and int(new_state.loss_scale.good) == 0
    stepped, stepped_state, *_ = step(new, new_state, batch)  # a finite step moves, counts, keeps the scale
    assert int(stepped_state.inner.step) == 1 and int(stepped_state.loss_scale.good) == 1
    assert float(stepped_state.loss_scale.scale) == 2.0**14
    assert not np.array_equal(stepped.layers[0].weight, new.layers[0].weight)
    assert {leaf.dtype for leaf in jax.tree.leaves(stepped)} == {jnp.dtype("float32")}  # the master stays


class Gradients:
    """An optimizer whose step returns the gradients it is given as the new parameters: what the train
    step hands its optimizer, read whole (a step ``w - g`` would lose a gradient of 1e-9 in w's 0.3)."""

    learning_rate = 1.0

    def init(self, params):
        return ()

    def update(self, params, grads, state, *, axis_name=None):
        return grads, state


def _worst_per_leaf(ours, theirs) -> float:
    """The largest ``max|ours - theirs|`` of any leaf, over that leaf's own largest ``|theirs|``: a leaf of
    gradients of 6e-7 is held to its own size, not to its neighbours' 3e-3."""
    return max(
        float(np.abs(np.float64(a) - np.float64(b)).max() / np.abs(np.float64(b)).max())
        for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True)
    )


TINY = 2.0**-16  # the loss times this: gradients of 1e-9 to 5e-8, below float16's smallest normal 6e-5
FP16_LEAF_ERROR = 0.1
"""fp16's gradients against fp32's, per leaf: float16 rounds to 2^-11 (5e-4) relative, and the biases'
gradients, sums over the batch that cancel (softmax - one-hot), lose more of their size: 4% for the last
bias, measured; 2e-4 to 1.5e-2 for the others. Without the scale every gradient underflows (1.0); with
the loss scaled and the gradients not unscaled, each is 2^15 times too large."""


def _gradients(initial: float | None, small: float = TINY):
    """The gradients the step hands its optimizer, the loss times ``small``: in fp16 behind a loss scale
    starting at ``initial`` (1.0: no scale), or in fp32 (None)."""
    model, _, batch = _fp16_case()

    def loss(model, batch):
        value, aux = _poisoned(model, batch)
        return value * small, aux

    optimizer = Gradients() if initial is None else mp.LossScaled(Gradients(), initial=initial)
    step = make_train_step(optimizer, loss, precision=None if initial is None else mp.FP16)
    return jax.jit(step)(model, optimizer.init(model), batch)[0]


def test_the_scaled_loss_is_the_loss_times_the_scale_and_so_are_its_gradients():
    model, _, batch = _fp16_case()
    scale = jnp.float32(2.0**10)  # a power of 2: multiplying by it rounds nothing in float32
    scaled = jax.value_and_grad(mp.scaled(_poisoned, scale), has_aux=True)
    (value, (unscaled, _)), grads = scaled(model, batch)
    (reference, _), plain = jax.value_and_grad(_poisoned, has_aux=True)(model, batch)
    assert float(value) == float(reference) * 2.0**10 and float(unscaled) == float(reference)
    for ours, theirs in zip(jax.tree.leaves(grads), jax.tree.leaves(plain), strict=True):
        np.testing.assert_array_equal(ours, theirs * 2.0**10)  # every leaf, every number


def test_the_loss_scaled_update_divides_the_gradients_by_the_scale():
    optimizer = mp.LossScaled(SGD(1.0), initial=2.0**12)
    params = {"small": jnp.zeros(3), "large": jnp.zeros(2)}
    grads = {"small": jnp.array([6e-7, -1e-8, 3e-9]), "large": jnp.array([3e-3, 250.0])}
    scaled_grads = jax.tree.map(lambda g: g * 2.0**12, grads)  # what grad of the scaled loss gives
    new, state = optimizer.update(params, scaled_grads, optimizer.init(params))
    for leaf in grads:  # SGD(1.0) steps by minus the gradient: each one unscaled, whatever its size
        np.testing.assert_array_equal(new[leaf], -grads[leaf])
    assert int(state.inner.step) == 1 and float(state.loss_scale.scale) == 2.0**12


def test_an_fp16_step_matches_the_fp32_step_on_the_unscaled_gradients():
    model, _, batch = _fp16_case()
    sgd = SGD(1.0)
    fp16 = jax.jit(make_train_step(mp.LossScaled(sgd), _poisoned, precision=mp.FP16))
    fp32 = jax.jit(make_train_step(sgd, _poisoned))
    (_, _, loss, _), (_, _, reference_loss, _) = (
        fp16(model, mp.LossScaled(sgd).init(model), batch),
        fp32(model, sgd.init(model), batch),
    )
    assert abs(float(loss) - float(reference_loss)) < 1e-2  # the unscaled loss is reported
    assert _worst_per_leaf(_gradients(mp.INITIAL, small=1.0), _gradients(None, small=1.0)) < FP16_LEAF_ERROR


def test_gradients_that_underflow_in_fp16_survive_behind_the_loss_scale():
    reference = _gradients(None)
    assert max(float(np.abs(leaf).max()) for leaf in jax.tree.leaves(reference)) < 6e-5  # all subnormal
    unscaled = _gradients(1.0)  # a scale of 1: float16 alone
    assert np.mean([float((leaf == 0).mean()) for leaf in jax.tree.leaves(unscaled)]) > 0.9  # flushed to 0
    assert _worst_per_leaf(unscaled, reference) > 0.5
    assert _worst_per_leaf(_gradients(mp.INITIAL), reference) < FP16_LEAF_ERROR  # 2^15: each one kept


def test_float16_without_a_loss_scale_is_refused_in_one_line():
    with pytest.raises(ValueError, match="make_train_step: float16 needs a loss scale") as caught:
        make_train_step(SGD(0.1), precision=mp.FP16)
    assert "\n" not in str(caught.value)


needs_mnist = pytest.mark.skipif(
    not os.path.isdir(os.path.join(os.environ.get("TFDS_DATA_DIR", "/nonexistent"), "mnist")),
    reason="needs MNIST prepared by tfds: set TFDS_DATA_DIR (make test does)",
)


@needs_mnist
@pytest.mark.slow  # about 10 s: 40 steps of the default MLP
def test_the_cli_trains_the_mlp_in_fp16_and_its_loss_falls(tmp_path, capsys):
    log = tmp_path / "log.jsonl"
    argv = ["train", "--model", "mlp", "--precision", "fp16", "--steps", "40", "--eval-every", "20"]
    assert main([*argv, "--log", str(log)]) == 0
    records = [record for line in log.read_text().splitlines() if "loss" in (record := json.loads(line))]
    assert records[-1]["loss"] < 0.5 * np.log(10), records  # from chance, ln 10 = 2.30, to 0.66 here


@needs_mnist
@pytest.mark.slow  # about 8 s: two runs of 2 steps
def test_an_fp32_checkpoint_resumed_in_fp16_names_the_precision_in_one_line(tmp_path, capsys):
    argv = ["train", "--model", "mlp", "--steps", "2", "--checkpoint-dir", str(tmp_path)]
    assert main(argv) == 0
    capsys.readouterr()
    assert main([*argv, "--resume", "--precision", "fp16"]) == 1
    err = capsys.readouterr().err
    assert err == (
        f"error: the checkpoint in {tmp_path} was saved with --precision fp32; this run asks for fp16, and "
        "only fp16's optimizer state carries a loss scale: resume with --precision fp32, or start afresh\n"
    )


@pytest.mark.skipif(
    not os.path.isdir(os.path.join(os.environ.get("TFDS_DATA_DIR", "/nonexistent"), "tiny_shakespeare")),
    reason="needs tiny_shakespeare prepared by tfds: set TFDS_DATA_DIR (make test does)",
)
@pytest.mark.slow  # a GPT step in fp16, its checkpoint, decoding: about 20 s
def test_a_gpt_trained_in_fp16_samples_from_its_checkpoint(tmp_path, capsys):
    """The checkpoint's optimizer state carries the loss scale: sample rebuilds it (it was refused:
    "checkpoint has none" of opt_state.inner)."""
    tiny = ["--model", "gpt", "--width", "16", "--depth", "1", "--heads", "2", "--context", "16"]
    directory = str(tmp_path / "run")
    assert main(["train", *tiny, "--steps", "1", "--precision", "fp16", "--checkpoint-dir", directory]) == 0
    capsys.readouterr()
    assert main(["sample", "--checkpoint-dir", directory, "--prompt", "RO", "--tokens", "5"]) == 0
    assert len(capsys.readouterr().out.rstrip("\n")) == len("RO") + 5


# --- 2. where the cast sits under FSDP, and 3. the gradients' reduction ----------------------------


def _compiled_collectives(style: str, loss, precision=None):
    """The collectives of the default MLP's SGD step under ``style`` on 4 devices, in the dtypes sent."""
    shape, rules = mesh_rules(style, 4)
    mesh = make_mesh(shape, devices=jax.devices()[:4])
    model, optimizer = mlp([784, 512, 10], key=jax.random.key(0), axes=megatron_axes(2)), SGD(0.1)
    batch = {"image": jnp.zeros((32, 784)), "label": jnp.zeros(32, jnp.int32)}
    step = make_train_step(optimizer, loss, precision=precision)
    lowered = Sharded(mesh, rules)(step).lower(model, optimizer.init(model), batch)
    return collectives(as_asked(lowered), mesh)


WEIGHTS = 784 * 512 + 512 + 512 * 10 + 10  # the MLP's numbers
SPLIT = WEIGHTS - 10  # those fsdp splits over 4 devices, and gathers whole: all but the last bias (10)


def test_under_fsdp_the_cast_before_the_gather_sends_half_the_bytes():
    def cast_after(model, batch):
        return classification_loss(mp.BF16.compute(mp.gathered(model)), mp.BF16.compute(batch))

    after = _compiled_collectives("fsdp", cast_after)["all-gather"]
    before = _compiled_collectives("fsdp", classification_loss, mp.BF16)["all-gather"]  # --precision bf16
    assert after.bytes == 4 * SPLIT  # float32, gathered whole, then cast
    assert before.bytes == 2 * SPLIT + 32 * 10 * 2  # bfloat16 shards gathered; and the logits, for the loss
    assert (before.bytes - 32 * 10 * 2) / after.bytes == 0.5


@pytest.mark.parametrize(
    ("compute", "grads", "itemsize"),
    [("bfloat16", "float32", 4), ("bfloat16", "bfloat16", 2), ("float32", "bfloat16", 2)],
)
def test_the_gradients_are_all_reduced_in_the_dtype_the_precision_names(compute, grads, itemsize):
    precision = mp.Precision(compute, grads, master="float32")
    reduced = _compiled_collectives("dp", classification_loss, precision)["all-reduce"]
    assert reduced.bytes == WEIGHTS * itemsize + 2 * 4  # and two float32 scalars: the loss, the accuracy


# --- bad settings: one line each, before any step --------------------------------------------------

NOT_A_SCALE = "LossScale.start: scale must be a finite number > 0"
FACTOR_ABOVE_1 = "factor must be a finite number > 1"


@pytest.mark.parametrize(
    ("make", "error", "says"),
    [
        (lambda: mp.LossScaled(SGD(0.1), factor=0.5), ValueError, f"LossScaled: {FACTOR_ABOVE_1}"),
        (lambda: mp.LossScaled(SGD(0.1), factor=1), ValueError, f"LossScaled: {FACTOR_ABOVE_1}"),
        (lambda: mp.LossScaled(SGD(0.1), period=0), ValueError, "LossScaled: period must be a positive int"),
        (lambda: mp.LossScaled(SGD(0.1), initial=float("nan")), ValueError, "LossScaled: initial must be"),
        (lambda: mp.LossScaled("sgd"), TypeError, "LossScaled: optimizer must be an Optimizer"),
        (lambda: mp.LossScale.start(0), ValueError, NOT_A_SCALE),
        (lambda: mp.LossScale.start(-1), ValueError, NOT_A_SCALE),
        (lambda: mp.LossScale.start(float("inf")), ValueError, NOT_A_SCALE),
        (lambda: mp.LossScale.start(float("nan")), ValueError, NOT_A_SCALE),
        (lambda: mp.LossScale.start("big"), ValueError, NOT_A_SCALE),
        (lambda: mp.adjust(mp.LossScale.start(), True, period=0), ValueError, "adjust: period must be"),
        (lambda: mp.adjust(mp.LossScale.start(), True, period=2.5), ValueError, "adjust: period must be"),
        (lambda: mp.adjust(mp.LossScale.start(), True, factor=-2), ValueError, f"adjust: {FACTOR_ABOVE_1}"),
        (lambda: mp.adjust(mp.LossScale.start(), True, floor=-1), ValueError, "adjust: floor must be"),
        (lambda: mp.adjust(mp.LossScale.start(), True, floor=float("inf")), ValueError, "adjust: floor"),
        (
            lambda: mp.adjust(mp.LossScale.start(), jnp.array([True, False])),
            ValueError,
            "adjust: finite must be one boolean (shape (), dtype bool), got dtype bool shape (2,)",
        ),
        (lambda: mp.adjust(mp.LossScale.start(), jnp.float32(1)), ValueError, "adjust: finite must be"),
        (
            lambda: mp.LossScaled(SGD(0.1)).update({"w": jnp.ones(2)}, {"w": jnp.ones(2)}, SGD(0.1).init({})),
            TypeError,
            "LossScaled.update: state must be a LossScaledState",
        ),
        (
            lambda: mp.Precision(master="bfloat16"),
            ValueError,
            "Precision: master='bfloat16' is narrower than params='float32'",
        ),
        (
            lambda: mp.Precision("bfloat16", "float32", master="float32", accumulated="bfloat16"),
            ValueError,
            "Precision: accumulated='bfloat16' is narrower than grads='float32'",
        ),
    ],
)
def test_a_loss_scale_or_precision_that_cannot_work_is_refused_in_one_line(make, error, says):
    with pytest.raises(error) as caught:
        make()
    assert str(caught.value).startswith(says) and "\n" not in str(caught.value), str(caught.value)


def test_all_finite_of_no_arrays_is_true_as_in_jmp():
    assert bool(mp.all_finite({})) is bool(jmp.all_finite({})) is True
    assert not bool(mp.all_finite({"w": jnp.array([1.0, jnp.nan])}))


def test_explain_memory_prices_the_fp16_step_train_runs(capsys):
    """The step behind a LossScaled, as train builds it: it compiles (it raised "float16 needs a loss
    scale"), and each total has its compiled column."""
    argv = ["explain", "--memory", "--model", "mlp", "--parallel", "dp", "--devices", "8", "--precision"]
    assert main([*argv, "fp16"]) == 0
    out = capsys.readouterr().out
    assert "batch 128, fp16: bytes per device" in out, out
    for term in ("arguments", "temporaries", "total"):
        (row,) = [line for line in out.splitlines() if line.startswith(term)]
        assert re.fullmatch(rf"{term} +[\d.]+ [kM]?B +[\d.]+ [kM]?B \(\d\.\d\dx\)", row), row


# --- comparing steps in a precision policy (minishard.testing.precision) ----------------------------


@functools.cache  # drawn by jax.random op by op: once, not for each of the four steps
def _small_gpt_and_windows():
    from minishard.models.gpt import GPT

    model = GPT(vocab=65, context=16, width=64, depth=2, heads=4, key=jax.random.key(0))
    return model, jax.random.randint(jax.random.key(1), (32, 16), 0, 65)


def _gpt_step_gradients(precision, style=None, rows=32):
    """The small GPT's SGD(1.0) step, what it moved each weight by: unsharded, or ``style`` on 8
    devices; on the first ``rows`` of the batch (fewer: a replica that forgot the others')."""
    from minishard.run.next_token import next_token_loss

    model, windows = _small_gpt_and_windows()
    windows = windows[:rows]
    sgd = SGD(1.0)
    step = make_train_step(sgd, next_token_loss, precision=precision)
    if style is not None:
        shape, rules = mesh_rules(style, 8)
        step = Sharded(make_mesh(shape, devices=jax.devices()[:8]), rules)(step)
    new = (step if style else jax.jit(step))(model, sgd.init(model), {"inputs": windows, "targets": windows})[
        0
    ]
    return jax.tree.map(lambda after, before: np.float64(before) - np.float64(after), new, model)


@pytest.mark.slow  # 4 compiles of a small GPT: about 15 s
def test_a_bf16_step_sharded_is_within_its_tolerance_and_fp32_or_broken_steps_are_not():
    from minishard.testing.precision import assert_close_in

    unsharded = _gpt_step_gradients(mp.BF16)
    assert_close_in("bfloat16", _gpt_step_gradients(mp.BF16, "dp"), unsharded, replicas=8)
    with pytest.raises(AssertionError, match=r"assert_close_in: .* float32 over 1 replicas allows 3\.81e-06"):
        assert_close_in("float32", unsharded, _gpt_step_gradients(None))  # bfloat16 where fp32 was asked
    with pytest.raises(AssertionError, match=r"assert_close_in: .* bfloat16 over 8 replicas allows 0\.273"):
        assert_close_in("bfloat16", _gpt_step_gradients(mp.BF16, rows=4), unsharded, replicas=8)  # 1 of 8


def test_the_step_tolerance_is_epsilons_of_the_compute_dtype():
    from minishard.testing.precision import ROUNDINGS, step_tolerance

    assert step_tolerance("bfloat16") == 2.0**-7 * ROUNDINGS
    assert step_tolerance("float16", replicas=4) == 2.0**-10 * (ROUNDINGS + 2)  # one rounding per halving
    assert step_tolerance("float32", replicas=3) == 2.0**-23 * (ROUNDINGS + 2)
    with pytest.raises(ValueError, match="step_tolerance: replicas must be a positive int, got 0"):
        step_tolerance("bfloat16", replicas=0)
