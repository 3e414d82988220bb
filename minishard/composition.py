"""Composition: how one dimension runs inside another.

Each chapter before this one teaches its dimension alone: the pipeline's tick loop knows only its
stage axis, the ring only its sequence axis, an MoE only its experts. This chapter teaches what
lets one of them run inside another, each in a section of its own:

* **The pipeline with other dimensions inside its stages.** ``ComposedPipeline``, a ``Pipeline``
  whose microbatches' rows are split over a data axis (dp+pp) and their tokens over a sequence
  axis (pp+cp: ring attention inside the stages), and whose blocks' statistics (an MoE's, pp+ep)
  leave the tick loop; ``run_composed`` runs it, ``over_the_batch`` adds a tick's statistics up.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from minishard import _checks
from minishard.layers import lifted, sow
from minishard.pipeline import (
    Pipeline,
    Stacked,
    gpipe,
    join_microbatches,
    run_blocks,
    split_microbatches,
    stage_layers,
)

# === The pipeline with other dimensions inside its stages (dp+pp, pp+cp, pp+ep) ===================
# ``Pipeline.run`` runs by hand over the stage axis alone. Three things let another dimension run
# inside the stages, each a few lines around the same ``gpipe`` loop:
#
# 1. dp+pp: the microbatches' rows split over a data axis, which ``shard_map`` also runs by hand;
#    the layers are the same on every replica (cast to "varying" once, so that their gradient's
#    psum over the replicas runs once, not per tick).
# 2. pp+cp: the tokens split over a sequence axis, and the blocks' ``args`` (a GPT's positions)
#    with them: each device holds its share of the tokens, and ring attention runs on it.
# 3. pp+ep: what the blocks sow (an MoE's ``MoEStats``) leaves each tick as its report, a
#    bubble's zeroed, and is added up over the stages, the microbatches and the replicas.


@dataclasses.dataclass(frozen=True)
class ComposedPipeline(Pipeline):
    """A ``Pipeline`` whose microbatches' rows are over ``data_axis`` and their tokens over
    ``sequence_axis`` (cp's "context"), if given; its blocks may sow statistics (an MoE's).

    >>> import minishard as ms
    >>> mesh = ms.make_mesh({"data": 2, "stage": 4})
    >>> ComposedPipeline(mesh, microbatches=4, data_axis="data").ticks   # 4 + 4 - 1, as a Pipeline
    7
    """

    data_axis: str | None = None
    sequence_axis: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        _checks.composed_pipeline(self)

    def run(self, blocks: Stacked, x: jax.Array, *args: Any) -> jax.Array:
        return run_composed(blocks, x, self, *args)


def run_composed(
    blocks: Stacked,
    x: jax.Array,
    pipeline: ComposedPipeline,
    *args: Any,
) -> jax.Array:
    """``blocks(x, *args)`` pipelined, the stages running the pipeline's other axes inside them.

    ``args`` (a GPT's ``[T]`` positions) are the same for every microbatch: each device gets those
    of the tokens it holds. What the blocks sow, added up over the batch, is sown again outside.
    """
    _checks.pipeline_batch("run_pipeline", x, pipeline, pipeline.data_axis)
    layers = stage_layers(blocks, pipeline)
    data = pipeline.data_axis
    tokens = pipeline.sequence_axis
    rows = P(None, data, tokens)  # [m, B/m, T, ...]: rows over "data", tokens over "context"
    held = (P(tokens),) * len(args)  # each device's tokens' positions
    in_specs = (P(pipeline.stage_axis), rows, *held)
    out_specs = (rows, P())  # the blocks' statistics: the whole batch's, on every device
    # by hand over its own axes only: another ("model": tp) stays the annotations' inside a stage
    own = {pipeline.stage_axis} | {axis for axis in (data, tokens) if axis}
    loop = functools.partial(_composed_gpipe, pipeline=pipeline)
    mesh = pipeline.mesh
    run = jax.shard_map(loop, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names=own)
    y, stats = run(layers, split_microbatches(x, pipeline.microbatches), *args)
    sow(stats)
    return join_microbatches(y)


def _replicas(pipeline: ComposedPipeline) -> tuple[str, ...]:
    """The axes over which every stage's layers are the same: other examples, other tokens."""
    return tuple(axis for axis in (pipeline.data_axis, pipeline.sequence_axis) if axis)


def _composed_gpipe(layers: Any, xs: jax.Array, *args: Any, pipeline: ComposedPipeline) -> Any:
    """One device's program: ``gpipe``, each tick reporting what its blocks sowed."""
    replicas = _replicas(pipeline)
    if replicas:  # cast once, so that the gradient's psum over them (its transpose) runs once
        layers = jax.lax.pcast(layers, replicas, to="varying")

    def stage_work(here: Any, x: jax.Array, busy: jax.Array) -> tuple[jax.Array, Any]:
        y, stats = lifted(run_blocks)(here, x, *args)
        return y, jax.tree.map(lambda s: jnp.where(busy, s, 0), stats)  # a bubble's: 0

    outputs, stats = gpipe(layers, xs, pipeline, stage_work)
    return outputs, jax.tree.map(lambda s: over_the_batch(s, pipeline), stats)


def over_the_batch(stat: jax.Array, pipeline: ComposedPipeline) -> jax.Array:
    """A statistic of each tick, ``[ticks, ...]``, for the batch.

    Each stage's blocks' and each microbatch's are added up; over the replicas, counts add up
    and losses (a microbatch's mean each) average, as ``experts.all_to_all_moe``'s do.
    """
    replicas = _replicas(pipeline)
    total = jax.lax.psum(stat.sum(0), pipeline.stage_axis)
    if jnp.issubdtype(total.dtype, jnp.integer):
        return jax.lax.psum(total, replicas)
    return jax.lax.pmean(total / pipeline.microbatches, replicas)


__all__ = ["ComposedPipeline", "over_the_batch", "run_composed"]
