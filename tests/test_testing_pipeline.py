"""minishard.testing.pipelines: schedules that fit a model, and pipelined == sequential, bubbles included.

Each assertion is tested both ways: it passes on the chapter's correct pipeline,
and it fails, naming the leaf, on a pipeline broken the way hand-written ones
break (a tick too few lets a bubble's NaN out; a pipeline cut off from the
gradient computes the right forward pass and wrong gradients).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import minishard as ms
from minishard import pipeline as pp
from minishard.testing.pipelines import assert_pipeline_equivalent, schedules

WIDTH = 4
X = jnp.asarray(np.random.default_rng(0).normal(size=(8, WIDTH)), jnp.float32)


def block(key):
    return ms.Sequential([ms.Linear(WIDTH, WIDTH, key=key, scale=0.5), ms.Swish()])


def stacked_model(n=4):
    k_in, k_blocks, k_out = jax.random.split(jax.random.key(0), 3)
    return pp.StackedModel(
        ms.Linear(WIDTH, WIDTH, key=k_in), pp.Stacked(block, n, key=k_blocks), ms.Linear(WIDTH, 2, key=k_out)
    )


@settings(max_examples=40)
@given(st.data())
def test_schedules_draw_only_what_the_model_and_the_batch_can_take(data):
    blocks, batch = (
        data.draw(st.sampled_from([4, 8, 12]), "blocks"),
        data.draw(st.sampled_from([4, 8, 16]), "batch"),
    )
    plan = data.draw(schedules(blocks, batch), "schedule")
    assert blocks % (plan.stages * plan.repeats) == 0 and batch % plan.microbatches == 0
    assert plan.stages in (2, 4, 8) and (plan.repeats == 1 or plan.microbatches >= plan.stages)
    pp.schedule(plan.stages, plan.microbatches, plan.repeats)  # the chapter takes it


def test_schedules_refuse_a_model_that_no_schedule_fits():
    with pytest.raises(
        ValueError,
        match=r"no schedule of stages \(2, 4, 8\) and repeats \(1, 2\) fits 3 blocks and a batch of 8",
    ):
        schedules(3, 8)


@pytest.mark.slow  # each drawn schedule compiles 2 programs
@settings(max_examples=4, deadline=None)
@given(st.data())
def test_the_chapters_pipeline_passes_for_drawn_schedules(data):
    plan = data.draw(schedules(8, 8, stages=(2, 4)), "schedule")
    blocks = pp.Stacked(block, 8, key=jax.random.key(1))
    np.testing.assert_allclose(assert_pipeline_equivalent(blocks, X, plan), blocks(X), rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # about 5 s: 2 compiles of a model with a pipeline inside
def test_a_stacked_model_passes_and_its_pipelined_output_comes_back():
    model, plan = (
        stacked_model(),
        pp.Schedule(ms.make_mesh({"stage": 2}, devices=jax.devices()[:2]), microbatches=2),
    )
    out = assert_pipeline_equivalent(model, X, plan)
    np.testing.assert_allclose(out, model(X), rtol=1e-5, atol=1e-6)


def test_a_bubble_that_leaks_is_named_as_a_leak():
    @dataclasses.dataclass(frozen=True)
    class OneTickShort(pp.Schedule):  # the last microbatch never reaches the end
        @property
        def ticks(self):
            return super().ticks - 1

    plan = OneTickShort(ms.make_mesh({"stage": 2}, devices=jax.devices()[:2]), microbatches=2)
    with pytest.raises(
        AssertionError, match=r"^output: \d+ NaN where the sequential run has numbers: a bubble leaked"
    ):
        assert_pipeline_equivalent(stacked_model(), X, plan)


class CutOffFromTheGradient(pp.StackedModel):
    """The right forward pass; its blocks get no gradient when pipelined."""

    def __call__(self, x):
        if self.schedule is None:
            return super().__call__(x)
        return self.after(pp.run_pipeline(jax.lax.stop_gradient(self.blocks), self.before(x), self.schedule))


def test_wrong_gradients_name_the_parameter():
    model = stacked_model()
    broken = CutOffFromTheGradient(model.before, model.blocks, model.after)
    plan = pp.Schedule(ms.make_mesh({"stage": 2}, devices=jax.devices()[:2]), microbatches=2)
    with pytest.raises(
        AssertionError, match=r"grad model\.blocks\.block\.layers\[0\]\.weight: pipelined != sequential"
    ):
        assert_pipeline_equivalent(broken, X, plan)
