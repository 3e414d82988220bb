"""The guards of the pipeline (pipeline.py, pipeline_1f1b.py; composition.py's composed one).

What each checks, and the words it says. A reader may skip this file, as ``minishard._checks``,
whose shared checks it uses; it imports nothing else of minishard.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from minishard._checks import check_key, count


def pipeline(pipe: Any) -> None:
    """``Pipeline``'s fields: counts, and a stage axis the mesh has."""
    count("Pipeline: microbatches", pipe.microbatches)
    count("Pipeline: repeats", pipe.repeats)
    mesh_shape, stage_axis = dict(pipe.mesh.shape), pipe.stage_axis
    if stage_axis not in mesh_shape:
        raise ValueError(
            f"Pipeline: stage_axis={stage_axis!r} is not an axis of the mesh {mesh_shape}; make the mesh "
            f"with it (make_mesh({{{stage_axis!r}: 4}})) or name the mesh's stage axis"
        )


def composed_pipeline(pipe: Any) -> None:
    """``ComposedPipeline``'s axes besides the stage axis: the mesh's, none of them the stage axis."""
    mesh_shape, stage_axis = dict(pipe.mesh.shape), pipe.stage_axis
    for name, axis in (("data_axis", pipe.data_axis), ("sequence_axis", pipe.sequence_axis)):
        if axis is not None and (axis not in mesh_shape or axis == stage_axis):
            raise ValueError(
                f"ComposedPipeline: {name}={axis!r} is not an axis of the mesh {mesh_shape} other than "
                f"the stage axis {stage_axis!r}; name one, or None"
            )


def nothing_sown(where: str, sown: Any) -> None:
    """A plain pipeline's blocks sowed nothing a collection asked for: its loop hands nothing out."""
    if sown is not None:
        raise ValueError(
            f"{where}: the blocks sow a {type(sown).__name__} (an MoE's statistics) that a plain "
            "Pipeline's ticks cannot hand out; use minishard.composition.ComposedPipeline"
        )


def pipeline_sizes(where: str, p: Any, m: Any, r: Any) -> None:
    """Stages, microbatches and repeats of a schedule or a bubble: each a positive int."""
    for name, value in (("p", p), ("m", m), ("r", r)):
        count(f"{where}: {name}", value)


def pipeline_batch(where: str, x: Any, pipe: Any, data_axis: Any = None) -> None:
    """The batch splits into the pipeline's microbatches, each split over ``data_axis``, if any."""
    rows, m = np.shape(x)[0], pipe.microbatches
    data = int(pipe.mesh.shape[data_axis]) if data_axis else 1
    if rows % (m * data):
        over = f" x {data_axis}={data} devices" if data_axis else ""
        raise ValueError(
            f"{where}: a batch of {rows} does not split into m={m} microbatches{over}; "
            f"use a batch that is a multiple of {m * data}, or other microbatches"
        )


def instance(where: str, value: Any, cls: type, hint: str) -> None:
    """``value`` is a ``cls``, or an error naming what it is instead and what to pass."""
    if not isinstance(value, cls):
        raise TypeError(f"{where} must be a {cls.__name__}, got a {type(value).__name__}; {hint}")


def stacked(n: Any, key: Any) -> None:
    """``Stacked``'s count of blocks and key, before any block is built."""
    count("Stacked: n", n)
    check_key("Stacked", key)


def blocks_keep_shape(body: Any, block: Any, x: Any) -> None:
    """Stacked blocks run one after another (a ``lax.scan`` of ``body``): each must keep its input's shape."""
    first = jax.tree.map(lambda a: a[0], block)
    out = jax.eval_shape(lambda h, b: body(h, b)[0], jax.ShapeDtypeStruct(np.shape(x), x.dtype), first)
    if (out.shape, out.dtype) != (np.shape(x), x.dtype):
        raise ValueError(
            f"Stacked: a block maps {x.dtype}{list(np.shape(x))} to {out.dtype}{list(out.shape)}; stacked "
            "blocks run one after another, each on the previous one's output, so each must keep its "
            "input's shape and dtype"
        )


def pipelined(where: str, pipeline: Any, args: Sequence[Any]) -> None:
    """A pipeline is given, or one of ``args`` is a model with one (a ``StackedModel``)."""
    if pipeline is None and not any(getattr(a, "pipeline", None) for a in args):
        raise ValueError(
            f"{where}: no argument is a model with a pipeline (a StackedModel with pipeline=...); "
            "give the model its Pipeline, or pass pipeline="
        )
