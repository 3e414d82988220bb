"""Property-test your own pipelined model: ``pipelines`` that fit it, ``assert_pipeline_equivalent``.

A pipeline is written by hand (``minishard.pipeline``): a ``shard_map`` with a
loop of ``ppermute``\\ s, where an off-by-one tick or a bubble read as data
computes something else without any error. The oracle is the same model run
sequentially (``pipeline=None``): the pipelined forward pass and its gradients
must equal it, for every pipeline the model can take. Bubbles hold NaN
(``minishard.pipeline`` fills them so), so a bubble that leaks into a result
shows as NaN, which ``assert_pipeline_equivalent`` names as a leak.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

from minishard.pipeline import Pipeline, Stacked, StackedModel, run_pipeline
from minishard.rules import AxisRules
from minishard.sharding import Sharded, make_mesh
from minishard.testing._cache import cached
from minishard.testing.assertions import _check_tolerances
from minishard.tree import path_str


def pipelines(
    blocks: int,
    batch: int,
    *,
    stages: Sequence[int] = (2, 4, 8),
    repeats: Sequence[int] = (1, 2),
    stage_axis: str = "stage",
) -> st.SearchStrategy[Pipeline]:
    """The pipelines a model of ``blocks`` stacked blocks and a batch of ``batch`` can run.

    ``stages`` (each at most the device count) times the repeats divide
    ``blocks``; the microbatches divide ``batch``, and a circular pipeline
    (repeats > 1) has at least as many microbatches as stages. When nothing
    fits, ``ValueError`` at once, before any example is drawn:

    >>> pipelines(3, 8)
    Traceback (most recent call last):
    ValueError: pipelines: no pipeline of stages (2, 4, 8) and repeats (1, 2) fits 3 blocks and a batch of 8
    """
    fits = [
        (p, r, m)
        for p in stages
        if p <= jax.device_count()
        for r in repeats
        if blocks % (p * r) == 0
        for m in range(1, batch + 1)
        if batch % m == 0 and (r == 1 or m >= p)
    ]
    if not fits:
        raise ValueError(
            f"pipelines: no pipeline of stages {tuple(stages)} and repeats {tuple(repeats)} fits {blocks} "
            f"blocks and a batch of {batch}"
            + (f" on {jax.device_count()} devices" if max(stages) > jax.device_count() else "")
        )
    # builds, not map(lambda): hypothesis prints a failing example as this call, its numbers named.
    return st.sampled_from(fits).flatmap(
        lambda f: st.builds(
            _drawn_pipeline,
            stages=st.just(f[0]),
            microbatches=st.just(f[2]),
            repeats=st.just(f[1]),
            stage_axis=st.just(stage_axis),
        )
    )


def _drawn_pipeline(*, stages: int, microbatches: int, repeats: int, stage_axis: str) -> Pipeline:
    """What a failing example prints: ``_drawn_pipeline(stages=2, microbatches=4, repeats=1, ...)``."""
    return Pipeline(
        _stage_mesh(stages, stage_axis), microbatches=microbatches, repeats=repeats, stage_axis=stage_axis
    )


@functools.cache
def _stage_mesh(p: int, stage_axis: str) -> Any:
    """One mesh per stage count: a pipeline's mesh is part of what jit compiles for."""
    return make_mesh({stage_axis: p}, devices=jax.devices()[:p])


def assert_pipeline_equivalent(
    model: StackedModel | Stacked,
    x: Any,
    pipeline: Pipeline,
    *,
    rules: AxisRules | None = None,
    rtol: float = 1e-5,
    atol: float = 0.0,
) -> Any:
    """The pipelined ``model(x)`` and its gradients equal the sequential ones; returns the pipelined output.

    ``model``: a ``StackedModel`` (run with ``pipeline``, and with none) or bare
    ``Stacked`` blocks (``run_pipeline(blocks, x, pipeline)`` against ``blocks(x)``).
    With ``rules``, the pipelined run is ``Sharded(pipeline.mesh, rules)``'s, every array
    laid out by them: tensor parallelism inside the pipeline, say, on a mesh
    ``{"stage": 2, "model": 2}`` with ``mlp="model"``. The sequential run stays on one
    device. Without rules only the pipeline splits anything.

    The gradients are those of the loss ``mean(sin(output))``, with respect to
    every parameter and to ``x``: averaged, as a training loss is, and through
    ``sin`` so that each output element gets its own cotangent (a microbatch
    that comes back in the wrong rows changes the gradients).

    Each leaf must agree to within ``rtol`` of its own largest value (plus
    ``atol``): ``|pipelined - sequential| <= atol + rtol * max|sequential|``.
    A pipeline adds up the same terms in another order (microbatch by
    microbatch), so float32 rounding differs by a few 1e-7 of the *terms*;
    where gradients cancel to near zero that is far more than 1e-5 of the
    element itself, and an elementwise tolerance fails a correct pipeline. A
    NaN where the sequential run has a number is a bubble leaking into the
    result, and the message says so; any other difference names the leaf
    (``output``, ``grad model.blocks.block...``).

    Both runs are compiled once per pipeline and shapes (one ``jax.jit`` with
    the pipeline static), so the examples of a property test reuse them.

    >>> import minishard as ms
    >>> block = lambda key: ms.Sequential([ms.Linear(4, 4, key=key), ms.Swish()])
    >>> blocks = Stacked(block, 4, key=jax.random.key(0))
    >>> mesh = ms.make_mesh({"stage": 2}, devices=jax.devices()[:2])
    >>> assert_pipeline_equivalent(blocks, jnp.ones((4, 4)), Pipeline(mesh, microbatches=2)).shape
    (4, 4)
    """
    if not isinstance(model, StackedModel | Stacked):
        raise TypeError(
            f"assert_pipeline_equivalent: model must be a StackedModel or Stacked blocks, got a "
            f"{type(model).__name__}; stack its blocks (minishard.pipeline.Stacked, stacked_mlp)"
        )
    _check_tolerances("assert_pipeline_equivalent", rtol, atol)
    alone = functools.partial(_value_and_grads, pipeline=pipeline)
    pipelined = alone if rules is None else _sharded(pipeline, rules)
    got = jax.block_until_ready(pipelined(model, x))
    want = jax.block_until_ready(_value_and_grads(model, x, None))
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(got), jax.tree_util.tree_leaves(want), strict=True
    ):
        where, a, b = _named(path_str(path)), np.asarray(a), np.asarray(b)
        leaked = np.isnan(a) & ~np.isnan(b)
        if leaked.any():
            on = "" if rules is None else f", on mesh {dict(pipeline.mesh.shape)} under the rules"
            raise AssertionError(
                f"{where}: {int(leaked.sum())} NaN where the sequential run has numbers: a bubble leaked "
                f"(stages {pipeline.stages}, microbatches {pipeline.microbatches}, "
                f"repeats {pipeline.repeats}{on})"
            )
        largest = float(np.nanmax(np.abs(b), initial=0.0))
        np.testing.assert_allclose(
            a,
            b,
            rtol=0.0,
            atol=atol + rtol * largest,
            err_msg=f"{where}: pipelined != sequential (to {rtol:g} of its largest value, {largest:.3g})",
        )
    return got[0]


def _named(path: str) -> str:
    """``output``, ``grad x`` or ``grad model.blocks.block...``, from a path into ``(y, (grads, x_grad))``."""
    for prefix, name in (("[0]", "output"), ("[1][0]", "grad model"), ("[1][1]", "grad x")):
        if path.startswith(prefix):
            return name + path[len(prefix) :]
    return path


@functools.partial(jax.jit, static_argnames="pipeline")
def _value_and_grads(model: Any, x: Any, pipeline: Pipeline | None) -> Any:
    """``(output, (model grads, x grad))`` of ``mean(sin(output))``; pipelined, or sequential for None.

    Module level, the pipeline static: jit keeps one program per pipeline and
    shapes. A new ``jax.jit`` of a new closure per call compiled both runs
    again for every example (3 to 9 s each).
    """

    def loss(model: Any, x: Any) -> Any:
        y = _run(model, x, pipeline)
        return jnp.mean(jnp.sin(y)), y

    (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(model, x)
    return y, grads


@cached
def _sharded(pipeline: Pipeline, rules: AxisRules) -> Any:
    """``_value_and_grads`` with ``pipeline`` under ``Sharded(pipeline.mesh, rules)``, one per pair:
    a new ``Sharded(...)(fn)`` jits a new function, which compiles again for every example."""

    def value_and_grads(model: Any, x: Any) -> Any:
        return _value_and_grads(model, x, pipeline)

    return Sharded(pipeline.mesh, rules)(value_and_grads)


def _run(model: Any, x: Any, pipeline: Pipeline | None) -> Any:
    """``model(x)``, pipelined with ``pipeline`` or sequential with None (Any: a Layer's call is its own)."""
    if isinstance(model, Stacked):
        return model(x) if pipeline is None else run_pipeline(model, x, pipeline)
    return model.replace(pipeline=pipeline)(x)


__all__ = ["assert_pipeline_equivalent", "pipelines"]
