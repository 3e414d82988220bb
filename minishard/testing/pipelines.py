"""Property-test your own pipelined model: ``schedules`` that fit it, ``assert_pipeline_equivalent``.

A pipeline is written by hand (``minishard.pipeline``): a ``shard_map`` with a
loop of ``ppermute``\\ s, where an off-by-one tick or a bubble read as data
computes something else without any error. The oracle is the same model run
sequentially (``schedule=None``): the pipelined forward pass and its gradients
must equal it, for every schedule the model can take. Bubbles hold NaN
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

from minishard.pipeline import Schedule, Stacked, StackedModel, run_pipeline
from minishard.sharding import make_mesh
from minishard.tree import path_str


def schedules(
    blocks: int,
    batch: int,
    *,
    stages: Sequence[int] = (2, 4, 8),
    repeats: Sequence[int] = (1, 2),
    stage_axis: str = "stage",
) -> st.SearchStrategy[Schedule]:
    """Schedules a model of ``blocks`` stacked blocks and a batch of ``batch`` can run.

    ``stages`` (each at most the device count) times the repeats divide
    ``blocks``; the microbatches divide ``batch``, and a circular schedule
    (repeats > 1) has at least as many microbatches as stages. When nothing
    fits, ``ValueError`` at once, before any example is drawn:

    >>> schedules(3, 8)
    Traceback (most recent call last):
    ValueError: schedules: no schedule of stages (2, 4, 8) and repeats (1, 2) fits 3 blocks and a batch of 8
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
            f"schedules: no schedule of stages {tuple(stages)} and repeats {tuple(repeats)} fits {blocks} "
            f"blocks and a batch of {batch}"
            + (f" on {jax.device_count()} devices" if max(stages) > jax.device_count() else "")
        )
    return st.sampled_from(fits).map(
        lambda f: Schedule(
            _stage_mesh(f[0], stage_axis), microbatches=f[2], repeats=f[1], stage_axis=stage_axis
        )
    )


@functools.cache
def _stage_mesh(p: int, stage_axis: str) -> Any:
    """One mesh per stage count: a schedule's mesh is part of what jit compiles for."""
    return make_mesh({stage_axis: p}, devices=jax.devices()[:p])


def assert_pipeline_equivalent(
    model: StackedModel | Stacked, x: Any, schedule: Schedule, *, rtol: float = 1e-5, atol: float = 1e-6
) -> Any:
    """The pipelined ``model(x)`` and its gradients equal the sequential ones; returns the pipelined output.

    ``model``: a ``StackedModel`` (run with ``schedule``, and with none) or bare
    ``Stacked`` blocks (``run_pipeline(blocks, x, schedule)`` against ``blocks(x)``).
    The gradients are those of ``sum(sin(output))`` with respect to every
    parameter and to ``x``. A NaN where the sequential run has a number is a
    bubble leaking into the result, and the message says so; any other
    difference names the leaf (``output``, ``grad model.blocks.block...``).

    >>> import minishard as ms
    >>> block = lambda key: ms.Sequential([ms.Linear(4, 4, key=key), ms.Swish()])
    >>> blocks = Stacked(block, 4, key=jax.random.key(0))
    >>> mesh = ms.make_mesh({"stage": 2}, devices=jax.devices()[:2])
    >>> assert_pipeline_equivalent(blocks, jnp.ones((4, 4)), Schedule(mesh, microbatches=2)).shape
    (4, 4)
    """
    piped, plain = _runs(model, schedule)
    got, want = _value_and_grads(piped, model, x), _value_and_grads(plain, model, x)
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(got), jax.tree_util.tree_leaves(want), strict=True
    ):
        where = _named(path_str(path))
        leaked = np.isnan(np.asarray(a)) & ~np.isnan(np.asarray(b))
        if leaked.any():
            raise AssertionError(
                f"{where}: {int(leaked.sum())} NaN where the sequential run has numbers: a bubble leaked "
                f"(stages {schedule.stages}, microbatches {schedule.microbatches}, "
                f"repeats {schedule.repeats})"
            )
        np.testing.assert_allclose(a, b, rtol, atol, err_msg=f"{where}: pipelined != sequential")
    return got[0]


def _named(path: str) -> str:
    """``output``, ``grad x`` or ``grad model.blocks.block...``, from a path into ``(y, (grads, x_grad))``."""
    for prefix, name in (("[0]", "output"), ("[1][0]", "grad model"), ("[1][1]", "grad x")):
        if path.startswith(prefix):
            return name + path[len(prefix) :]
    return path


def _runs(model: StackedModel | Stacked, schedule: Schedule) -> tuple[Any, Any]:
    """``(pipelined, sequential)``, each a function of ``(model, x)``."""
    if isinstance(model, Stacked):
        return (lambda m, x: run_pipeline(m, x, schedule)), (lambda m, x: m(x))
    return (lambda m, x: m.replace(schedule=schedule)(x)), (lambda m, x: m.replace(schedule=None)(x))


def _value_and_grads(run: Any, model: Any, x: Any) -> Any:
    def loss(m: Any, x: Any) -> Any:
        y = run(m, x)
        return jnp.sum(jnp.sin(y)), y

    (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(model, x)
    return jax.block_until_ready((y, grads))


__all__ = ["assert_pipeline_equivalent", "schedules"]
