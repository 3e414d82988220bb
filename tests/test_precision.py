"""minishard.precision: fp16's loss scale against jmp's, step by step; the skip; the cast and the
reduction's dtype read from compiled programs."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import pytest

from minishard import SGD, AdamW, Sharded, make_mesh, megatron_axes, mlp
from minishard import memory as mm
from minishard import precision as mp
from minishard.census import collectives
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
    step = jax.jit(make_train_step(optimizer, _poisoned, precision=mm.FP16))
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


def test_an_fp16_step_matches_the_fp32_step_on_the_unscaled_gradients():
    model, _, batch = _fp16_case()
    sgd = SGD(1.0)  # the update is the gradient itself: unscaled, it is fp32's to fp16's precision
    fp16 = jax.jit(make_train_step(mp.LossScaled(sgd), _poisoned, precision=mm.FP16))
    fp32 = jax.jit(make_train_step(sgd, _poisoned))
    (new, _, loss, _), (reference, _, reference_loss, _) = (
        fp16(model, mp.LossScaled(sgd).init(model), batch),
        fp32(model, sgd.init(model), batch),
    )
    assert abs(float(loss) - float(reference_loss)) < 1e-2  # the unscaled loss is reported
    for ours, theirs, before in zip(*map(jax.tree.leaves, (new, reference, model))):
        np.testing.assert_allclose(ours - before, theirs - before, rtol=0.02, atol=1e-4)


def test_float16_without_a_loss_scale_is_refused_in_one_line():
    with pytest.raises(ValueError, match="make_train_step: float16 needs a loss scale") as caught:
        make_train_step(SGD(0.1), precision=mm.FP16)
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


# --- 2. where the cast sits under FSDP, and 3. the gradients' reduction ----------------------------


def _compiled_collectives(style: str, loss, precision=None):
    """The collectives of the default MLP's SGD step under ``style`` on 4 devices, as partitioned."""
    shape, rules = mesh_rules(style, 4)
    mesh = make_mesh(shape, devices=jax.devices()[:4])
    model, optimizer = mlp([784, 512, 10], key=jax.random.key(0), axes=megatron_axes(2)), SGD(0.1)
    batch = {"image": jnp.zeros((32, 784)), "label": jnp.zeros(32, jnp.int32)}
    step = make_train_step(optimizer, loss, precision=precision)
    lowered = Sharded(mesh, rules)(step).lower(model, optimizer.init(model), batch)
    return collectives(mp.partitioned(lowered), mesh)


WEIGHTS = 784 * 512 + 512 + 512 * 10 + 10  # the MLP's numbers
SPLIT = WEIGHTS - 10  # those fsdp splits over 4 devices, and gathers whole: all but the last bias (10)


def test_under_fsdp_the_cast_before_the_gather_sends_half_the_bytes():
    def cast_after(model, batch):
        return classification_loss(mm.BF16.compute(mp.gathered(model)), mm.BF16.compute(batch))

    after = _compiled_collectives("fsdp", cast_after)["all-gather"]
    before = _compiled_collectives("fsdp", classification_loss, mm.BF16)["all-gather"]  # --precision bf16
    assert after.bytes == 4 * SPLIT  # float32, gathered whole, then cast
    assert before.bytes == 2 * SPLIT + 32 * 10 * 2  # bfloat16 shards gathered; and the logits, for the loss
    assert (before.bytes - 32 * 10 * 2) / after.bytes == 0.5


@pytest.mark.parametrize(
    ("compute", "grads", "itemsize"),
    [("bfloat16", "float32", 4), ("bfloat16", "bfloat16", 2), ("float32", "bfloat16", 2)],
)
def test_the_gradients_are_all_reduced_in_the_dtype_the_precision_names(compute, grads, itemsize):
    precision = mm.Precision(compute, grads, master="float32")
    reduced = _compiled_collectives("dp", classification_loss, precision)["all-reduce"]
    assert reduced.bytes == WEIGHTS * itemsize + 2 * 4  # and two float32 scalars: the loss, the accuracy
