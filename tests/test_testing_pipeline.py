"""minishard.testing.pipelines: pipelines that fit a model, and pipelined == sequential, bubbles included.

Each assertion is tested both ways: it passes on the chapter's correct pipeline,
and it fails, naming the leaf, on a pipeline broken the way hand-written ones
break (a tick too few lets a bubble's NaN out; a pipeline cut off from the
gradient computes the right forward pass and wrong gradients).
"""

import dataclasses

import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from testing_fixtures import compilations

import minishard as ms
from minishard import pipeline as pp
from minishard.models.vit import stacked_vit
from minishard.testing import assert_sharded_equivalent, assert_split
from minishard.testing.pipelines import assert_pipeline_equivalent, pipelines

WIDTH = 4
X = jnp.asarray(np.random.default_rng(0).normal(size=(8, WIDTH)), jnp.float32)
MESH2 = ms.make_mesh({"stage": 2}, devices=jax.devices()[:2])


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
    plan = data.draw(pipelines(blocks, batch), "pipeline")
    assert blocks % (plan.stages * plan.repeats) == 0 and batch % plan.microbatches == 0
    assert plan.stages in (2, 4, 8) and (plan.repeats == 1 or plan.microbatches >= plan.stages)
    pp.schedule(plan.stages, plan.microbatches, plan.repeats)  # the chapter takes it


def test_pipelines_refuse_a_model_that_no_pipeline_fits():
    with pytest.raises(
        ValueError,
        match=r"no pipeline of stages \(2, 4, 8\) and repeats \(1, 2\) fits 3 blocks and a batch of 8",
    ):
        pipelines(3, 8)


def test_a_negative_tolerance_is_refused_before_anything_runs():
    model, pipeline = stacked_model(), pp.Pipeline(MESH2, microbatches=2)
    with compilations() as compiled, pytest.raises(ValueError) as error:
        assert_pipeline_equivalent(model, X, pipeline, rtol=-1e-5)
    assert str(error.value) == "assert_pipeline_equivalent: rtol must be a finite number >= 0, got -1e-05"
    assert compiled == []


def test_a_drawn_pipeline_prints_its_stages_microbatches_and_repeats():
    @settings(database=None, max_examples=20, phases=[hypothesis.Phase.generate, hypothesis.Phase.shrink])
    @given(pipelines(8, 8, stages=(2,), repeats=(1,)))
    def fails_on_any(pipeline):
        raise ValueError("every pipeline")

    with pytest.raises(ValueError) as failure:
        fails_on_any()
    printed = " ".join(" ".join(failure.value.__notes__).split())  # one line, however hypothesis wraps it
    assert "pipeline=_drawn_pipeline( stages=2, microbatches=1, repeats=1, stage_axis='stage', )" in printed
    assert "lambda" not in printed


@pytest.mark.slow  # each drawn schedule compiles 2 programs
@settings(max_examples=4, deadline=None)
@given(st.data())
def test_the_chapters_pipeline_passes_for_drawn_schedules(data):
    plan = data.draw(pipelines(8, 8, stages=(2, 4)), "pipeline")
    blocks = pp.Stacked(block, 8, key=jax.random.key(1))
    np.testing.assert_allclose(assert_pipeline_equivalent(blocks, X, plan), blocks(X), rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # about 5 s: 2 compiles of a model with a pipeline inside
def test_a_stacked_model_passes_and_its_pipelined_output_comes_back():
    model, plan = (
        stacked_model(),
        pp.Pipeline(ms.make_mesh({"stage": 2}, devices=jax.devices()[:2]), microbatches=2),
    )
    out = assert_pipeline_equivalent(model, X, plan)
    np.testing.assert_allclose(out, model(X), rtol=1e-5, atol=1e-6)


def test_the_same_schedule_and_shapes_compile_once():
    blocks, plan = pp.Stacked(block, 4, key=jax.random.key(2)), pp.Pipeline(MESH2, microbatches=4)
    assert_pipeline_equivalent(blocks, X, plan)
    another = X + 1  # another example, the same programs
    with compilations() as compiled:
        assert_pipeline_equivalent(blocks, another, plan)
    assert compiled == []


@pytest.mark.slow  # about 20 s: a pipelined transformer and its sequential twin compile
def test_a_correct_pipelined_transformer_passes_whatever_float32_rounding_does():
    # Attention's key and value gradients cancel to near zero in places: there an elementwise
    # tolerance meets float32 rounding of the large terms that cancelled (the old atol=1e-6 on a
    # summed loss failed this model by x3), while the rounding stays a few 1e-7 of the leaf's values.
    model = stacked_vit(image_size=8, patch_size=2, width=32, depth=4, heads=2, key=jax.random.key(0))
    images = jnp.asarray(np.random.default_rng(0).random((128, 8, 8, 1)), jnp.float32)
    assert_pipeline_equivalent(model, images, pp.Pipeline(MESH2, microbatches=4))


@dataclasses.dataclass(frozen=True)
class OneTickShort(pp.Pipeline):  # the last microbatch never reaches the end
    @property
    def ticks(self):
        return super().ticks - 1


def test_a_bubble_that_leaks_is_named_as_a_leak():
    plan = OneTickShort(ms.make_mesh({"stage": 2}, devices=jax.devices()[:2]), microbatches=2)
    with pytest.raises(
        AssertionError, match=r"^output: \d+ NaN where the sequential run has numbers: a bubble leaked"
    ):
        assert_pipeline_equivalent(stacked_model(), X, plan)


class CutOffFromTheGradient(pp.StackedModel):
    """The right forward pass; its blocks get no gradient when pipelined."""

    def __call__(self, x):
        if self.pipeline is None:
            return super().__call__(x)
        return self.after(pp.run_pipeline(jax.lax.stop_gradient(self.blocks), self.before(x), self.pipeline))


def test_wrong_gradients_name_the_parameter():
    model = stacked_model()
    broken = CutOffFromTheGradient(model.before, model.blocks, model.after)
    plan = pp.Pipeline(ms.make_mesh({"stage": 2}, devices=jax.devices()[:2]), microbatches=2)
    with pytest.raises(
        AssertionError, match=r"grad model\.blocks\.block\.layers\[0\]\.weight: pipelined != sequential"
    ):
        assert_pipeline_equivalent(broken, X, plan)


def test_assert_pipeline_equivalent_refuses_a_model_that_is_not_stacked():
    plain = ms.Sequential([block(jax.random.key(0))])
    with pytest.raises(
        TypeError, match=r"^assert_pipeline_equivalent: model must be a StackedModel or Stacked"
    ):
        assert_pipeline_equivalent(plain, X, pp.Pipeline(MESH2, microbatches=2))


# Tensor parallelism inside the pipeline: Megatron MLP blocks, "mlp" over "model", the blocks over "stage".
TP_IN_PP = ms.AxisRules(batch=None, stage="stage", embed=None, mlp="model")
STAGE_AND_MODEL = ms.make_mesh({"stage": 2, "model": 2}, devices=jax.devices()[:4])


def megatron_blocks():
    axes = [("embed", "mlp"), ("mlp", "embed")]
    return pp.Stacked(
        lambda key: ms.mlp([WIDTH, 4 * WIDTH, WIDTH], key=key, axes=axes), 4, key=jax.random.key(3)
    )


def test_tp_inside_pp_takes_the_rules_and_a_leaked_bubble_names_the_pipeline_on_its_mesh():
    blocks = megatron_blocks()
    assert_split(blocks, STAGE_AND_MODEL, over="model", rules=TP_IN_PP, at_least=3)  # tp splits
    plan = pp.Pipeline(STAGE_AND_MODEL, microbatches=2)
    out = assert_pipeline_equivalent(blocks, X, plan, rules=TP_IN_PP)
    np.testing.assert_allclose(out, blocks(X), rtol=1e-5, atol=1e-6)
    with pytest.raises(
        AssertionError,
        match=r"^output: \d+ NaN where the sequential run has numbers: a bubble leaked \(stages 2, "
        r"microbatches 2, repeats 1, on mesh \{'stage': 2, 'model': 2\} under the rules\)",
    ):
        assert_pipeline_equivalent(blocks, X, OneTickShort(STAGE_AND_MODEL, microbatches=2), rules=TP_IN_PP)


def test_the_rules_lay_out_the_pipelined_run():
    """A rule naming a mesh axis the pipeline's mesh lacks is refused: the rules are used, not ignored."""
    plan, nowhere = pp.Pipeline(STAGE_AND_MODEL, microbatches=2), ms.AxisRules(mlp="expert")
    with pytest.raises(ValueError, match="expert"):
        assert_pipeline_equivalent(megatron_blocks(), X, plan, rules=nowhere)


def test_a_bubble_leaked_through_assert_sharded_equivalent_is_named_not_a_nan_location_mismatch():
    short = OneTickShort(STAGE_AND_MODEL, microbatches=2)

    def pipelined(blocks, x):
        return pp.run_pipeline(blocks, x, short)

    def sequential(blocks, x):
        return blocks(x)

    with pytest.raises(
        AssertionError,
        match=r"sharded != unsharded: \d+ NaN where the unsharded run has numbers: a pipeline's bubble",
    ):
        assert_sharded_equivalent(
            pipelined, megatron_blocks(), X, mesh=STAGE_AND_MODEL, rules=TP_IN_PP, reference=sequential
        )
