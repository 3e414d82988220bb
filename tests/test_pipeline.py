"""minishard.pipeline: microbatches, stacked blocks and the GPipe / circular schedules.

The oracle is always the model run plainly: a full batch for microbatches, the
blocks one after another for a pipeline. Sizes are drawn from small fixed sets,
so that hypothesis's examples reuse compiled programs (each new shape compiles).
Every sharded call is waited for before the next: on simulated CPU devices,
overlapping collectives can deadlock XLA's rendezvous.
"""

import dataclasses
import functools
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.experimental import checkify

import minishard as ms
from minishard import pipeline as pp
from minishard.composition import ComposedPipeline
from minishard.experts import MoE, MoEStats
from minishard.layers import collect
from minishard.models.vit import Attention, stacked_vit
from minishard.pipeline_1f1b import one_f_one_b
from minishard.run.data import mnist
from minishard.run.steps import make_train_step
from minishard.run.train import FitSettings, fit
from minishard.styles import mesh_rules, style_rules

WIDTH = 8


def make_block(key):
    return ms.Sequential([ms.Linear(WIDTH, WIDTH, key=key, scale=0.5), ms.Swish()])


@functools.partial(jax.jit, static_argnums=(0, 1))  # built by one compiled program, not op by op
def blocks_and_oracle(n, seed=0):
    """``Stacked`` blocks, and the same blocks built one by one with the same keys."""
    key = jax.random.key(seed)
    return pp.Stacked(make_block, n, key=key), [make_block(k) for k in jax.random.split(key, n)]


def sequential(blocks, x):
    for block in blocks:
        x = block(x)
    return x


def close(a, b, rtol=1e-5, atol=1e-6):
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol, err_msg=jax.tree_util.keystr(path))


# -- 1. microbatches ------------------------------------------------------------
def mlp_loss(model, batch):
    logits = model(batch["image"])
    labels = batch["label"]
    return ms.cross_entropy(logits, ms.one_hot(labels, 4)), {"accuracy": ms.accuracy(logits, labels)}


full_batch = jax.jit(jax.value_and_grad(mlp_loss, has_aux=True))
microbatched = functools.cache(lambda m: jax.jit(pp.microbatched(mlp_loss, m)))  # one compile per m


@settings(max_examples=6)
@given(m=st.sampled_from([1, 2, 4, 8]), batch=st.sampled_from([8, 16]), seed=st.integers(0, 3))
def test_microbatched_equals_the_full_batch(m, batch, seed):
    model = ms.mlp([6, 16, 4], key=jax.random.key(seed), scale=0.5)
    rng = np.random.default_rng(seed)
    data = {"image": rng.normal(size=(batch, 6)).astype(np.float32), "label": rng.integers(0, 4, batch)}
    close(microbatched(m)(model, data), full_batch(model, data))


def test_a_batch_that_does_not_split_evenly_is_refused():
    with pytest.raises(ValueError, match="10 does not split into 4"):
        pp.split_microbatches(jnp.ones((10, 2)), 4)


# -- 2. stacked blocks ----------------------------------------------------------
def test_stacked_blocks_are_the_blocks_built_one_by_one():
    blocks, oracle = blocks_and_oracle(3)
    close(jax.tree.map(lambda a: a[1], blocks.block), oracle[1])
    x = jnp.ones((2, WIDTH))
    close(blocks(x), sequential(oracle, x))


def test_stack_makes_a_built_model_the_same_function_of_the_same_numbers():
    layers = ms.mlp([4, 8, 8, 8, 3], key=jax.random.key(0), scale=0.5)  # Linear, act, ..., Linear
    hidden = [ms.Sequential(list(layers.layers[i : i + 2])) for i in (2, 4)]  # (Linear, act) x 2
    model = pp.stack(ms.Sequential(list(layers.layers[:2])), hidden, layers.layers[-1])
    assert model.blocks.n == 2 and model.blocks.block.layers[0].weight.shape == (2, 8, 8)
    np.testing.assert_array_equal(model.blocks.block.layers[0].weight[1], layers.layers[4].weight)
    x = jax.random.normal(jax.random.key(1), (5, 4))
    close(model(x), layers(x))


def test_stacked_mlp_names_an_unknown_activation():
    message = r"stacked_mlp: activation='gelu'; choose one of \['relu', 'swish'\]"
    with pytest.raises(ValueError, match=message):
        pp.stacked_mlp([4, 8, 8, 8, 4], key=jax.random.key(0), activation="gelu")


def test_plan_rows_lead_with_the_stage_axis():
    sizes = [12, WIDTH, WIDTH, WIDTH, WIDTH, WIDTH, 3]  # 4 square hidden Linears: 4 stacked blocks
    model = jax.eval_shape(lambda: pp.stacked_mlp(sizes, key=jax.random.key(0)))
    mesh = ms.make_mesh({"data": 2, "stage": 4}, devices=jax.devices()[:8])
    rows = {leaf.path: leaf for leaf in ms.plan(model, mesh, style_rules("dp+pp")).leaves}
    weight = rows["blocks.block.layers[0].weight"]
    assert (weight.shape, weight.logical_axes) == ((4, WIDTH, WIDTH), ("stage", None, None))
    assert rows["before.layers[0].weight"].logical_axes == (None, None)


def test_stacked_vit_blocks_carry_the_stage_axis():
    model = jax.eval_shape(lambda: stacked_vit(key=jax.random.key(0), depth=2, width=16, heads=2))
    attention = model.blocks.block.attention
    assert type(attention) is Attention and attention.query.shape == (2, 16, 2, 8)  # no stacked subclass
    assert attention.param_logical_axes()["query"] == ("embed", "heads", "kv")  # as unstacked
    rows = {leaf.path: leaf.logical_axes for leaf in ms.plan(model, None, style_rules("pp")).leaves}
    assert rows["blocks.block.attention.query"] == ("stage", "embed", "heads", "kv")  # Stacked adds it
    assert rows["blocks.block.norm1.scale"] == ("stage", "embed")


# -- 3. the schedule and the pipeline ------------------------------------------
@given(p=st.sampled_from([2, 4, 8]), m=st.integers(1, 12), r=st.sampled_from([1, 2, 3]))
def test_the_schedule_visits_every_chunk_once_in_order(p, m, r):
    if r > 1 and m < p:
        with pytest.raises(ValueError, match="needs m >= p microbatches"):
            pp.schedule(p, m, r)
        return
    grid = pp.schedule(p, m, r)
    done = {}  # (microbatch, repeat, stage) -> tick
    for stage, row in enumerate(grid):
        for tick, cell in enumerate(row):
            if cell is not None:
                i, j = (cell, 0) if r == 1 else cell
                assert (i, j, stage) not in done
                done[i, j, stage] = tick
    assert len(done) == m * r * p and len(grid[0]) == r * m + p - 1
    for (i, j, stage), tick in done.items():  # each chunk runs after the one before it
        before = (i, j, stage - 1) if stage else (i, j - 1, p - 1)
        assert before not in done or done[before] < tick


def mesh_for(p):
    return ms.make_mesh({"data": 8 // p, "stage": p})


@functools.partial(jax.jit, static_argnums=2)
def value_and_grads(blocks, x, pipeline):
    """The loss, and its gradients for the blocks and the input: pipelined if ``pipeline``, else in order."""

    def loss(blocks, x):
        y = pp.run_pipeline(blocks, x, pipeline) if pipeline else sequential(blocks, x)
        return jnp.sum(jnp.sin(y))  # not linear in y: every output's gradient differs

    return jax.value_and_grad(loss, argnums=(0, 1))(blocks, x)


@pytest.mark.slow  # over 5 s
def test_one_circular_pipeline_on_data_x_stage_equals_sequential_and_runs_its_ticks():
    # The quick loop's case; the property below sweeps p, m, layers per stage and r (slow).
    blocks, oracle = blocks_and_oracle(8, 0)
    x = jax.random.normal(jax.random.key(1), (16, WIDTH))
    pipeline = ComposedPipeline(mesh_for(4), microbatches=4, repeats=2, data_axis="data")
    value, (grads, x_grad) = jax.block_until_ready(value_and_grads(blocks, x, pipeline))
    expected, (expected_grads, expected_x_grad) = value_and_grads(oracle, x, None)
    close((value, x_grad), (expected, expected_x_grad), rtol=1e-4, atol=1e-5)
    close(grads.block, jax.tree.map(lambda *a: jnp.stack(a), *expected_grads), rtol=1e-4, atol=1e-5)
    compiled = value_and_grads.lower(blocks, x, pipeline).compile()
    assert pp.compiled_ticks(compiled) == pipeline.ticks == 2 * 4 + 4 - 1


@pytest.mark.slow
# 3 examples, each compiling a pipelined and a sequential gradient: the schedule itself is swept for
# every p, m and r without compiling (test_the_schedule_visits_every_chunk_once_in_order), and the
# circular case on data x stage is the fixed test above; these draws add the compiled loop's shapes.
@settings(max_examples=3)
@given(
    p=st.sampled_from([2, 4, 8]),
    m_per_p=st.sampled_from([1, 2]),
    per_stage=st.sampled_from([1, 2]),
    r=st.sampled_from([1, 2]),
    seed=st.integers(0, 3),
)
def test_pipelined_equals_sequential_forward_and_gradients(p, m_per_p, per_stage, r, seed):
    m, mesh = m_per_p * p, mesh_for(p)
    blocks, oracle = blocks_and_oracle(p * r * per_stage, seed)
    x = jax.random.normal(jax.random.key(seed + 1), (m * (8 // p), WIDTH))
    pipeline = ComposedPipeline(mesh, microbatches=m, repeats=r, data_axis="data")
    value, (grads, x_grad) = jax.block_until_ready(value_and_grads(blocks, x, pipeline))
    expected, (expected_grads, expected_x_grad) = value_and_grads(oracle, x, None)
    close(value, expected)
    close(x_grad, expected_x_grad, rtol=1e-4, atol=1e-5)
    stacked_expected = jax.tree.map(lambda *a: jnp.stack(a), *expected_grads)
    close(grads.block, stacked_expected, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_a_pipelined_model_trains_like_the_sequential_one():
    mesh = ms.make_mesh({"data": 2, "stage": 4})
    model = pp.stacked_mlp([12, WIDTH, WIDTH, WIDTH, WIDTH, WIDTH, 3], key=jax.random.key(0))
    piped = model.replace(pipeline=ComposedPipeline(mesh, microbatches=4, data_axis="data"))
    rng = np.random.default_rng(0)
    batch = {"image": rng.normal(size=(16, 12)).astype(np.float32), "label": rng.integers(0, 3, 16)}
    step = ms.Sharded(mesh, style_rules("dp+pp"))(make_train_step(ms.SGD(0.1)))
    model_step = ms.Sharded(mesh, style_rules("dp+pp"))(make_train_step(ms.SGD(0.1), microbatches=2))
    opt_state = ms.SGD(0.1).init(model)
    report = pp.pipeline_report(step, (piped, opt_state, batch))  # what `explain` shows
    assert (report.stages, report.ticks, report.bubble) == (4, 7, 3 / 7)
    assert report.permute_bytes == 2 * 7 * (16 // 4 // 2) * WIDTH * 4  # 2 rows of 8 floats per shift
    for _ in range(3):
        piped, _, loss, _ = jax.block_until_ready(step(piped, opt_state, batch))
        model, opt_state, expected, _ = jax.block_until_ready(model_step(model, opt_state, batch))
        close(loss, expected, rtol=1e-5)


# -- NaN in the bubbles: a leak fails instead of hiding in a zero ----------------
def test_a_tick_too_few_leaves_nan_in_the_output():
    @dataclasses.dataclass(frozen=True)
    class OneTickShort(pp.Pipeline):
        @property
        def ticks(self):
            return super().ticks - 1

    blocks, _ = blocks_and_oracle(4)
    run = jax.jit(pp.run_pipeline, static_argnums=2)
    good = jax.block_until_ready(run(blocks, jnp.ones((8, WIDTH)), pp.Pipeline(mesh_for(4), microbatches=4)))
    short = jax.block_until_ready(
        run(blocks, jnp.ones((8, WIDTH)), OneTickShort(mesh_for(4), microbatches=4))
    )
    assert np.isfinite(good).all()
    last = short[3::4]  # microbatch 3 (examples 3 and 7) never reached the output
    assert np.isnan(last).all() and np.isfinite(short[0::4]).all()


def test_a_bubble_computed_on_as_real_work_poisons_the_gradients(monkeypatch):
    blocks, _ = blocks_and_oracle(4)
    pipeline = pp.Pipeline(mesh_for(4), microbatches=4)
    always_busy = lambda tick, stage, m, r=1: (tick >= 0, (tick - stage) % m, (tick - stage) // m)  # noqa: E731
    monkeypatch.setattr(pp, "work", always_busy)
    loss = jax.jit(lambda b: pp.run_pipeline(b, jnp.ones((8, WIDTH)), pipeline).sum())
    grads = jax.block_until_ready(jax.grad(loss)(blocks))
    assert np.isnan(grads.block.layers[0].weight).any()


# -- 4. the bubble, read from the compiled program -----------------------------
@pytest.mark.slow
@settings(max_examples=4)
@given(p=st.sampled_from([2, 4]), m=st.sampled_from([4, 8]), r=st.sampled_from([1, 2]))
def test_the_compiled_bubble_is_the_formula(p, m, r):
    blocks, _ = blocks_and_oracle(p * r)
    pipeline = pp.Pipeline(ms.make_mesh({"stage": p}, devices=jax.devices()[:p]), microbatches=m, repeats=r)
    step = jax.jit(jax.grad(lambda b, x: pp.run_pipeline(b, x, pipeline).sum()))
    report = pp.pipeline_report(step, (blocks, jnp.ones((m, WIDTH))), pipeline)
    assert report.ticks == r * m + p - 1
    assert report.bubble == pytest.approx(pp.bubble_fraction(p, m, r))
    assert report.permute_bytes == 2 * report.ticks * WIDTH * 4  # a shift each way per tick


def test_the_two_bubble_formulas():
    assert [round(pp.bubble_fraction(4, m), 3) for m in (4, 8, 16, 32)] == [0.429, 0.273, 0.158, 0.086]
    assert pp.megatron_bubble(4, 4) == 0.75 and pp.bubble_fraction(4, 4, r=2) == 3 / 11


# -- 1F1B: one forward and one backward per tick --------------------------------
def sin_loss(y, t):
    return jnp.mean(jnp.sin(y) * t)


@pytest.mark.slow
@settings(max_examples=3)
@given(p=st.sampled_from([2, 4]), m_per_p=st.sampled_from([1, 2]), seed=st.integers(0, 3))
def test_one_f_one_b_equals_sequential(p, m_per_p, seed):
    m = p * m_per_p
    blocks, oracle = blocks_and_oracle(2 * p, seed)
    x, t = jax.random.normal(jax.random.key(seed), (2, 2 * m, WIDTH))
    pipeline = pp.Pipeline(ms.make_mesh({"stage": p}, devices=jax.devices()[:p]), microbatches=m)
    loss, grads, x_grad = jax.block_until_ready(
        jax.jit(lambda b, x, t: one_f_one_b(b, x, t, sin_loss, pipeline))(blocks, x, t)
    )
    expected, (expected_grads, expected_x_grad) = jax.jit(
        jax.value_and_grad(lambda bs, x: sin_loss(sequential(bs, x), t), argnums=(0, 1))
    )(oracle, x)
    close(loss, expected)
    close(x_grad, expected_x_grad, rtol=1e-4, atol=1e-6)
    close(grads.block, jax.tree.map(lambda *a: jnp.stack(a), *expected_grads), rtol=1e-4, atol=1e-6)


def temp_bytes(m, p=4):
    """Temporary bytes of a GPipe and of a 1F1B step, and 1F1B's ticks read from its program."""
    pipeline = pp.Pipeline(ms.make_mesh({"stage": p}, devices=jax.devices()[:p]), microbatches=m)
    blocks, x = (
        jax.eval_shape(lambda: blocks_and_oracle(2 * p)[0]),
        jax.ShapeDtypeStruct((4 * m, WIDTH), jnp.float32),
    )
    gpipe = jax.value_and_grad(lambda b, x, t: sin_loss(pp.run_pipeline(b, x, pipeline), t), argnums=(0, 1))
    ofob = jax.jit(lambda b, x, t: one_f_one_b(b, x, t, sin_loss, pipeline)).lower(blocks, x, x).compile()
    gpipe_temp = jax.jit(gpipe).lower(blocks, x, x).compile().memory_analysis().temp_size_in_bytes
    return gpipe_temp, ofob.memory_analysis().temp_size_in_bytes, pp.compiled_ticks(ofob)


@pytest.mark.slow
def test_one_f_one_b_memory_stays_flat_where_gpipe_grows():
    (gpipe_4, ofob_4, ticks_4), (gpipe_16, ofob_16, ticks_16) = temp_bytes(4), temp_bytes(16)
    assert (ticks_4, ticks_16) == (4 + 2 * 4 - 2, 16 + 2 * 4 - 2)
    batch_io = 2 * 12 * 4 * WIDTH * 4  # 12 more microbatches of 4: their input copy and its gradient
    assert ofob_16 - ofob_4 < 1.1 * batch_io  # no more activations: only the batch itself grew
    assert gpipe_16 - gpipe_4 > 5 * (ofob_16 - ofob_4)


# -- the real MNIST: a pipeline trains like data parallelism -------------------------
needs_mnist = pytest.mark.skipif(
    not os.path.isdir(os.path.join(os.environ.get("TFDS_DATA_DIR", "/nonexistent"), "mnist")),
    reason="needs MNIST prepared by tfds: set TFDS_DATA_DIR (make test does)",
)
MNIST_MLP = [784, 256, 256, 256, 256, 256, 10]  # 4 stacked 256 x 256 blocks: one per stage


def losses_per_step(model, style, data, log):
    """Every step's loss of one epoch of ``data``, trained as ``minishard train`` does (its SGD)."""
    shape, rules = mesh_rules(style, 8)
    mesh = ms.make_mesh(shape)
    if "stage" in shape:
        model = model.replace(pipeline=ComposedPipeline(mesh, microbatches=8, data_axis="data"))
    sgd = ms.SGD(ms.exponential_decay(0.2, 0.7, 1000), momentum=0.9)
    fit(
        model,
        sgd,
        data,
        FitSettings(
            mesh=mesh,
            rules=rules,
            epochs=1,
            metrics_log=log,
            log_every=1,
            progress=False,
            log=lambda line: None,
        ),
    )
    return [r["loss"] for r in map(json.loads, log.read_text().splitlines()) if "step" in r]


@needs_mnist
@pytest.mark.slow  # about 15 s: two runs of 50 steps
def test_dp_pp_after_50_mnist_steps_has_the_loss_of_dp(tmp_path):
    model = pp.stacked_mlp(MNIST_MLP, key=jax.random.key(0))
    data = mnist("train[:6400]", 128)  # 50 batches
    piped = losses_per_step(model, "dp+pp", data, tmp_path / "dp+pp.jsonl")
    plain = losses_per_step(model, "dp", data, tmp_path / "dp.jsonl")
    assert len(piped) == len(plain) == 50 and plain[-1] < plain[0] / 2  # it learnt (2.31 to 0.79)
    np.testing.assert_allclose(piped, plain, rtol=1e-4)


@needs_mnist
@pytest.mark.slow  # 36-109 s in the suite (by machine and load): two epochs of MNIST through the command line
def test_minishard_train_parallel_dp_pp_reaches_97_percent_in_two_epochs(tmp_path):
    """Run as a user runs it, in its own process under XLA's default optimisation: the suite's
    fast-compiling flags (conftest) make this loop run 2.8x slower (an epoch 39 s against 14)."""
    log = tmp_path / "metrics.jsonl"
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    command = [sys.executable, "-m", "minishard", "train", "--parallel", "dp+pp", "--epochs", "2"]
    run = subprocess.run([*command, "--log", str(log)], env=env, capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Pipeline: 4 blocks over 4 stages, 8 microbatches of 16 examples, 11 ticks" in run.stdout
    stacked = "blocks.block.layers[0].weight  (4, 256, 256)  ('stage', None, None)  P('stage', None, None)"
    assert stacked in run.stdout  # the blocks stacked over "stage": the plan, printed before training
    epochs = [r for r in map(json.loads, log.read_text().splitlines()) if "test_acc" in r]
    assert [r["epoch"] for r in epochs] == [1, 2] and epochs[-1]["test_acc"] >= 0.97, (
        epochs
    )  # measured 0.9701


# -- the chapter checks its own arguments (issue 27 §2) --------------------------
MESH4 = ms.make_mesh({"stage": 4}, devices=jax.devices()[:4])
MESH_DATA_STAGE = ms.make_mesh({"data": 2, "stage": 4})


def sum_loss(model, batch):
    logits = model(batch["image"])
    return jnp.sum(logits**2), {"total": jnp.sum(logits)}


def test_microbatched_of_a_summed_loss_states_its_reduction():
    model = ms.mlp([4, 8, 4], key=jax.random.key(0))
    batch = {"image": jnp.asarray(np.random.default_rng(0).normal(size=(8, 4)), jnp.float32)}
    want = jax.value_and_grad(sum_loss, has_aux=True)(model, batch)
    close(jax.jit(pp.microbatched(sum_loss, 4, reduction="sum"))(model, batch), want)
    with pytest.raises(
        ValueError, match=r"^microbatched: reduction must be one of 'mean', 'sum', got 'max'$"
    ):
        pp.microbatched(sum_loss, 4, reduction="max")


@pytest.mark.parametrize("m", [0, -2, 2.0])
def test_microbatched_refuses_a_count_that_is_not_one(m):
    with pytest.raises(ValueError, match=rf"^microbatched: m must be a positive int, got {m!r}$"):
        pp.microbatched(mlp_loss, m)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"microbatches": 0}, "Pipeline: microbatches must be a positive int, got 0"),
        ({"microbatches": 2.0}, "Pipeline: microbatches must be a positive int, got 2.0"),
        ({"microbatches": 4, "repeats": 0}, "Pipeline: repeats must be a positive int, got 0"),
        ({"microbatches": 4, "stage_axis": "pipe"}, "Pipeline: stage_axis='pipe' is not an axis of the mesh"),
    ],
)
def test_a_pipeline_names_a_bad_field(fields, message):
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        pp.Pipeline(MESH4, **fields)


@pytest.mark.parametrize("axis", ["data_axis", "sequence_axis"])
@pytest.mark.parametrize("name", ["data", "stage"])
def test_a_composed_pipeline_names_an_axis_it_cannot_run_inside_its_stages(axis, name):
    message = f"ComposedPipeline: {axis}={name!r} is not an axis of the mesh {{'stage': 4}} other than"
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        ComposedPipeline(MESH4, 4, **{axis: name})
    assert pp.Pipeline(MESH4, 4).ticks == ComposedPipeline(MESH4, 4).ticks == 7  # the same schedule


def test_a_plain_pipeline_refuses_blocks_that_sow_into_an_open_collection():
    # built and run as jitted programs: op by op, the MoE's shapes compiled ~90 programs of one op
    moe = lambda k: MoE(4, features=WIDTH, hidden=WIDTH, key=k)  # noqa: E731
    blocks = jax.jit(lambda: pp.Stacked(moe, 4, key=jax.random.key(0)))()
    x = jnp.ones((8, 2, WIDTH))  # 8 rows of 2 tokens
    run = jax.jit(collect(MoEStats, lambda b, x: pp.run_pipeline(b, x, pp.Pipeline(MESH4, 4))))
    with pytest.raises(
        ValueError,
        match=r"^run_pipeline: the blocks sow a MoEStats .* use minishard.composition.ComposedPipeline",
    ):
        run(blocks, x)
    composed = collect(MoEStats, lambda b, x: pp.run_pipeline(b, x, ComposedPipeline(MESH4, 4)))
    y, stats = jax.jit(composed)(blocks, x)
    assert y.shape == x.shape and int(stats.routed) == 4 * 8 * 2 * 2  # 4 blocks' k = 2 of 16 tokens


def test_a_batch_that_does_not_split_into_the_pipelines_microbatches_is_named():
    blocks, _ = blocks_and_oracle(4)
    with pytest.raises(
        ValueError,
        match=r"^run_pipeline: a batch of 12 does not split into m=4 microbatches x data=2 devices; "
        "use a batch that is a multiple of 8",
    ):
        pp.run_pipeline(blocks, jnp.ones((12, WIDTH)), ComposedPipeline(MESH_DATA_STAGE, 4, data_axis="data"))


def test_run_pipeline_refuses_blocks_that_are_not_stacked():
    plain = ms.Sequential([make_block(jax.random.key(0))])
    with pytest.raises(
        TypeError, match=r"^run_pipeline: blocks must be a Stacked, got a Sequential; stack them"
    ):
        pp.run_pipeline(plain, jnp.ones((8, WIDTH)), pp.Pipeline(MESH4, 4))


@pytest.mark.parametrize("n, key, message", [
    (-1, jax.random.key(0), "Stacked: n must be a positive int, got -1"),
    (2.5, jax.random.key(0), "Stacked: n must be a positive int, got 2.5"),
    (2, 0, "Stacked: key must be a PRNG key such as jax.random.key(0), got 0"),
])  # fmt: skip
def test_stacked_names_a_bad_count_or_key(n, key, message):
    with pytest.raises((ValueError, TypeError), match="^" + re.escape(message) + "$"):
        pp.Stacked(make_block, n, key=key)


def test_stacked_blocks_that_change_width_are_named():
    blocks = pp.Stacked(lambda k: ms.Linear(WIDTH, 2, key=k), 3, key=jax.random.key(0))
    with pytest.raises(
        ValueError, match=r"^Stacked: a block maps float32\[8, 8\] to float32\[8, 2\]; stacked"
    ):
        blocks(jnp.ones((8, WIDTH)))


@pytest.mark.parametrize("formula", [pp.bubble_fraction, pp.megatron_bubble, pp.schedule])
def test_the_bubble_formulas_and_the_schedule_refuse_zero_microbatches(formula):
    with pytest.raises(ValueError, match=rf"^{formula.__name__}: m must be a positive int, got 0$"):
        formula(4, 0)


def test_pipeline_report_of_a_step_without_a_pipeline_says_so():
    model = pp.stacked_mlp([4, 8, 8, 8, 4], key=jax.random.key(0))
    with pytest.raises(
        ValueError, match=r"^pipeline_report: no argument is a model with a pipeline \(a StackedModel"
    ):
        pp.pipeline_report(jax.jit(lambda m, x: m(x)), (model, jnp.ones((8, 4))))


def test_one_f_one_b_refuses_blocks_that_are_not_stacked():
    plain = ms.Sequential([make_block(jax.random.key(0))])
    with pytest.raises(TypeError, match=r"^one_f_one_b: blocks must be a Stacked, got a Sequential"):
        one_f_one_b(plain, jnp.ones((8, WIDTH)), jnp.ones((8, WIDTH)), sin_loss, pp.Pipeline(MESH4, 4))


X8 = jnp.ones((8, 4))


def test_a_pipelined_step_is_checked_for_nan_by_debug_nans_not_checkify():
    """docs/pipeline.md says so: checkify's flags cannot ride the tick loop; jax_debug_nans works."""
    model = pp.stacked_mlp([4, 8, 8, 8, 8, 8, 4], key=jax.random.key(0))
    model = model.replace(pipeline=pp.Pipeline(MESH4, 4))
    loss = jax.jit(jax.grad(lambda m, x: jnp.mean(m(x))))
    with pytest.raises(ValueError, match="Scan carry input and output got mismatched varying manual axes"):
        jax.jit(checkify.checkify(lambda m, x: jnp.mean(m(x)), errors=checkify.float_checks))(model, X8)
    with jax.debug_nans(True):
        jax.block_until_ready(loss(model, X8))  # healthy: the bubbles' NaN never reach an output
        with pytest.raises(FloatingPointError):
            jax.block_until_ready(loss(model, X8.at[0, 0].set(jnp.nan)))
