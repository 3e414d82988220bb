"""The guards of prices and layouts (hardware.py, costs.py, zero.py, layouts.py).

What each checks, and the words it says. A reader may skip this file, as ``minishard._checks``,
whose shared checks it uses; it imports nothing else of minishard.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from minishard._checks import count, is_finite, one_of, positive


def collective(kind: Any, nbytes: Any, devices: Any, kinds: Sequence[str]) -> None:
    """``collective_time``'s arguments: a known kind, bytes >= 0, a device count >= 1."""
    one_of("collective_time: kind", kind, kinds)
    if not is_finite(nbytes) or nbytes < 0:
        raise ValueError(f"collective_time: nbytes must be a number of bytes >= 0, got {nbytes!r}")
    count("collective_time: devices", devices)


def layout_sizes(sizes: Mapping[str, Any], dimensions: Sequence[str]) -> None:
    """A layout's sizes: each a dimension it splits (``layouts.RANKED``), each a positive int."""
    for name, size in sizes.items():
        if name not in dimensions:
            raise ValueError(f"Layout: unknown dimension {name!r}; a layout splits {', '.join(dimensions)}")
        count(f"Layout: {name}", size)


def repeats(layers: int, stages: int, microbatches: int, r: Any) -> None:
    """A pipeline's stages and chunks a stage: a layer at least a stage, and no more chunks than the
    fullest stage's layers; r > 1 runs at least as many microbatches as stages
    (``pipeline.schedule``'s circular schedule)."""
    count("price: repeats", r)
    if stages > layers:
        raise ValueError(f"price: pp {stages} is more stages than the {layers} layers")
    fullest = -(-layers // stages)  # the ceiling of layers / stages
    if r > fullest:
        raise ValueError(f"price: repeats {r} is more chunks than a stage's layers ({fullest} at most)")
    if r > 1 and (stages == 1 or microbatches < stages):
        raise ValueError(
            f"price: repeats {r} needs a pipeline of at least as many microbatches as stages; "
            f"got pp {stages}, {microbatches} microbatches"
        )


def optional_count(where: str, value: Any) -> None:
    """None, or a positive int."""
    if value is not None:
        count(where, value)


def optional_positive(where: str, value: Any) -> None:
    """None, or a finite number > 0."""
    if value is not None:
        positive(where, value)


def program_mesh(where: str, given: Any, program: Any) -> None:
    """A mesh passed for a program is the one it was compiled for: the same axes, sizes and devices."""
    if given is None or program is None:
        return
    same = dict(given.shape) == dict(program.shape)
    if same and all(isinstance(m, jax.sharding.Mesh) for m in (given, program)):
        same = np.array_equal(given.device_ids, program.device_ids)
    if not same:
        raise ValueError(
            f"{where}: mesh={dict(given.shape)} is not the mesh the program was compiled for, "
            f"{dict(program.shape)}; omit mesh= (it is read from the program) or pass that mesh"
        )


def batch_splits(where: str, batch: Any, n: int, axis: str) -> None:
    """Every array of the batch splits evenly over the ``n`` devices of ``axis``: each its own examples."""
    for leaf in jax.tree.leaves(batch):
        rows = np.shape(leaf)[0] if np.ndim(leaf) else None
        if rows is None or rows % n:
            raise ValueError(
                f"{where}: a batch of {rows} examples does not split over the {n} devices of axis {axis!r}; "
                f"each device takes its own examples, so the batch must be a multiple of {n}"
            )


def scale_out(name: str, bandwidth: Any, devices: int, node: int) -> None:
    """A group wider than the fast level needs the slow level's figure: no silent NVLink or ICI speed."""
    if bandwidth is None:
        raise ValueError(
            f"{name}: {devices:,} devices span more than a node of {node}, and it has no scale_out "
            f"bandwidth beyond one; give Hardware(scale_out=bytes/s per device)"
        )
