"""minishard.testing.compositions: composed meshes for a model, and the GPT equal to itself on each.

* **The strategy**: it draws only what ``minishard.styles.dimensions`` takes (never a composition
  the library refuses), two and three dimensions among them, on meshes of every axis at least 2
  wide whose sizes multiply to the devices and divide the model's widths; bad arguments are one
  line each, before any example.
* **The GPT** (issue 46 §2): on every drawn composition, its logits, its loss and every gradient
  equal the dense model's on one device (``assert_sharded_equivalent``), with the pipeline and the
  ring attached where pp and cp are drawn, and its MLPs mixtures of experts where ep is; a pipeline
  one tick short inside a composition fails the property.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from minishard import context
from minishard.composition import ComposedPipeline
from minishard.losses import cross_entropy, one_hot
from minishard.models import gpt
from minishard.models.attention import CHUNK_ORDER, sequence_axis
from minishard.models.transformer import moe_mlp
from minishard.run.next_token import in_chunk_order
from minishard.styles import CONFLICTS, DIMENSIONS, compose, dimensions
from minishard.testing import Composition, assert_sharded_equivalent, compositions, seeds, split_counts

SMALL = dict(vocab=11, context=16, width=32, depth=4, heads=8, mlp_ratio=4)  # test_compose's GPT
BATCH = 8
WIDTHS = {
    "batch": BATCH,
    "seq": SMALL["context"],
    "embed": SMALL["width"],
    "heads": SMALL["heads"],
    "kv": SMALL["width"] // SMALL["heads"],
    "mlp": SMALL["mlp_ratio"] * SMALL["width"],
    "vocab": SMALL["vocab"],
    "stage": SMALL["depth"],  # the blocks, stacked for a pipeline
}
"""The GPT's width per logical axis, the batch's included: what ``compositions`` divides."""
GPT_DIMENSIONS = ("dp", "fsdp", "tp", "sp", "pp", "cp")
"""What the dense GPT takes: the annotated four, a pipeline of its stacked blocks, ring attention."""
EXPERTS = moe_mlp(8, k=2, capacity_factor=4.0)  # test_compose's: 8 experts, 2 per token, none dropped
MOE_WIDTHS = {**WIDTHS, "expert": 8, "mlp": WIDTHS["mlp"] // 2}  # each expert half the dense MLP
"""The MoE GPT's widths: its MLPs are mixtures of ``EXPERTS``."""


# --- the strategy ---------------------------------------------------------------------------------


def test_the_strategy_draws_only_what_the_library_composes_two_and_three_dimensions_among_them():
    counts = set()  # how many dimensions each draw has

    @settings(max_examples=200, derandomize=True, database=None)  # drawing compiles nothing: cheap
    @given(compositions({**WIDTHS, "expert": 8}, tuple(DIMENSIONS), max_dimensions=3))  # all seven
    def draw(composition):
        name, dims, mesh = composition.name, composition.dimensions, composition.mesh
        assert dimensions(name) == dims and compose(name)  # the library takes it: no exception
        assert not any(pair <= set(dims) for pair in CONFLICTS), name
        axes = list(dict.fromkeys(DIMENSIONS[dim].axis for dim in dims))  # an axis each, sp on tp's
        assert list(mesh.shape) == axes and math.prod(mesh.shape.values()) == 8, (name, mesh.shape)
        assert min(mesh.shape.values()) >= 2, (name, mesh.shape)  # a 1-wide axis splits nothing
        for logical, width in WIDTHS.items():
            assert width % split_counts((logical,), mesh, composition.rules)[0] == 0, (name, logical)
        counts.add(len(dims))

    draw()
    assert counts == {1, 2, 3}


def test_by_default_the_strategy_draws_the_annotated_dimensions_the_widths_name():
    seen: set[str] = set()

    @settings(max_examples=100, derandomize=True, database=None)
    @given(compositions({"batch": 8, "embed": 16, "mlp": 64}, min_dimensions=2))  # an MLP: no seq, no sp
    def draw(composition):
        seen.add(composition.name)

    draw()
    assert seen == {"dp+tp", "fsdp+tp"}


def test_a_mesh_that_does_not_divide_a_width_is_never_drawn():
    shapes = set()

    @settings(max_examples=50, derandomize=True, database=None)
    @given(compositions({**WIDTHS, "heads": 2}, ("dp", "tp"), min_dimensions=2))  # 2 heads: "model" 2 wide
    def draw(composition):
        shapes.add(tuple(composition.mesh.shape.values()))

    draw()
    assert shapes == {(4, 2)}


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: compositions(WIDTHS, ("dp", "zero")), "unknown dimension 'zero'; the dimensions are dp, "),
        (lambda: compositions(WIDTHS, ("dp", "ep")), "ep splits expert, and widths names none of them"),
        (lambda: compositions({**WIDTHS, "hidden": 4}), "widths names ['hidden'], which the styles' rules"),
        (
            lambda: compositions({**WIDTHS, "batch": 3}, ("dp", "tp"), min_dimensions=2),
            "compositions: no composition of 2 to 3 of dp, tp splits the widths",
        ),
        (lambda: compositions(WIDTHS, devices=16), "devices=16, but this process has only 8"),
        (lambda: Composition("dp+sp", {"data": 2, "model": 4}), "dp+sp: sp splits the sequence over tp's"),
        (
            lambda: Composition("tp+dp", {"model": 4, "data": 2}),
            "Composition: tp+dp has the mesh axes ('data', 'model') in this order, not ('model', 'data')",
        ),
    ],
)
def test_arguments_the_strategy_cannot_draw_from_are_one_line_each(call, message):
    with pytest.raises(ValueError) as refused:
        call()
    assert message in str(refused.value) and "\n" not in str(refused.value), refused.value


# --- the GPT: forward and gradients on every composition ------------------------------------------


def in_order(logits: jax.Array) -> jax.Array:
    """The logits of the tokens in order: under cp the ring's come back dealt out zig-zag."""
    _, p = sequence_axis()
    if p == 1:
        return logits
    held = context.held_order(logits.shape[1], p, CHUNK_ORDER)  # the token at each place
    return jnp.take(logits, jnp.argsort(held), axis=1)


def logits_loss_and_gradients(model, batch):
    """The forward pass (the logits, in order, and the next-token loss) and every parameter's gradient."""

    def loss(model):
        held, dealt = in_chunk_order(model, batch)  # cp: the batch zig-zag, the positions read
        logits = held(dealt["inputs"])
        return cross_entropy(logits, one_hot(dealt["targets"], SMALL["vocab"])), in_order(logits)

    (value, logits), grads = jax.value_and_grad(loss, has_aux=True)(model)
    return logits, value, grads


def sequential(model, batch):
    """The reference on one device: a pipelined model run without its pipeline."""
    return logits_loss_and_gradients(model.replace(pipeline=None), batch)


@functools.cache
def small_gpt(experts: bool, depth: int) -> gpt.GPT:
    """The GPT of seed 0, built once; ring attention, which is the dense core where "seq" is whole."""
    mlp = {"mlp": EXPERTS} if experts else {}
    return gpt.GPT(**{**SMALL, "depth": depth}, core="ring", key=jax.random.key(0), **mlp)


def model_for(composition: Composition, pipeline: type[ComposedPipeline] = ComposedPipeline):
    """The GPT as ``composition`` runs it: under pp its blocks stacked and pipelined over "stage" (a
    microbatch per stage; its rows over "data", its tokens over "context", where the mesh has them),
    under ep its MLPs mixtures of experts. One block, or one per stage: a block holds every array a
    dimension splits (attention, MLP or experts, norms), and the sharded and the reference programs
    compile fewer blocks than 4 (test_compose.py's depth() says the same; several blocks to a stage:
    tests/test_pipeline.py's per_stage)."""
    mesh = composition.mesh
    if "pp" not in composition.dimensions:
        return small_gpt("ep" in composition.dimensions, 1)
    model = small_gpt("ep" in composition.dimensions, mesh.shape["stage"])
    data, tokens = (axis if axis in mesh.shape else None for axis in ("data", "context"))
    piped = pipeline(mesh, mesh.shape["stage"], data_axis=data, sequence_axis=tokens)
    return gpt.as_stacked(model).replace(pipeline=piped)


def check_gpt(
    composition: Composition, seed: int, pipeline: type[ComposedPipeline] = ComposedPipeline
) -> None:
    ids = np.random.default_rng(seed).integers(0, SMALL["vocab"], (BATCH, SMALL["context"] + 1))
    batch = {"inputs": ids[:, :-1].astype(np.int32), "targets": ids[:, 1:].astype(np.int32)}
    model = model_for(composition, pipeline)
    reference = sequential if "pp" in composition.dimensions else None
    assert_sharded_equivalent(
        logits_loss_and_gradients,
        model,
        batch,
        mesh=composition.mesh,
        rules=composition.rules,
        reference=reference,
        rtol=1e-4,
        atol=1e-5,
    )


@settings(max_examples=2)  # the loaded profile's settings (tests/conftest.py), two examples
@given(compositions(WIDTHS, GPT_DIMENSIONS, min_dimensions=2), seeds)
def test_the_gpt_computes_the_dense_models_logits_and_gradients_on_composed_meshes(composition, seed):
    check_gpt(composition, seed)


@pytest.mark.slow  # each composition compiles the GPT's forward and backward twice; test_compose runs all
@settings(max_examples=6)
@given(compositions(WIDTHS, GPT_DIMENSIONS, min_dimensions=2), seeds)
def test_the_gpt_with_its_pipeline_and_ring_is_the_dense_model_on_composed_meshes(composition, seed):
    check_gpt(composition, seed)


@pytest.mark.slow  # each composition compiles the GPT's forward and backward twice
@settings(max_examples=4)
@given(
    compositions(MOE_WIDTHS, ("dp", "fsdp", "tp", "sp", "pp", "cp", "ep"), min_dimensions=2).filter(
        lambda composition: "ep" in composition.dimensions
    ),
    seeds,
)
def test_the_moe_gpt_is_the_dense_model_on_composed_meshes_with_its_experts_split(composition, seed):
    check_gpt(composition, seed)


@dataclasses.dataclass(frozen=True)
class OneTickShort(ComposedPipeline):
    """A broken pipeline: the last microbatch never leaves the last stage (docs/testing.md's)."""

    @property
    def ticks(self) -> int:
        return super().ticks - 1


@pytest.mark.slow  # one composition, compiled twice
def test_the_property_fails_on_a_pipeline_one_tick_short_inside_a_composition():
    @settings(max_examples=2, database=None)
    @given(compositions(WIDTHS, ("dp", "tp", "pp"), min_dimensions=3), seeds)
    def broken(composition, seed):
        check_gpt(composition, seed, pipeline=OneTickShort)

    with pytest.raises(AssertionError, match=r"output \[0\]: sharded != unsharded") as failed:
        broken()
    drawn = "Composition('dp+tp+pp', {'data': 2, 'model': 2, 'stage': 2})"  # the call that makes it
    assert f"composition={drawn}" in "\n".join(failed.value.__notes__), failed.value.__notes__
