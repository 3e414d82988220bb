"""What ``minishard.pipeline`` leans on, kept out of the chapter: a reader may skip this file.

* ``staged``: how ``Stacked`` makes every Layer of a stacked block name its
  leading axis ``"stage"`` (a subclass per Layer class, same name and call);
* ``compiled_ticks``: the ticks, read back from the compiled program;
* ``draw``: a schedule as a text grid, for docs/pipeline.md.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np

from minishard._hlo import collective_instructions
from minishard.census import collectives
from minishard.layers import Layer
from minishard.rules import LogicalAxes


def staged(tree: Any) -> Any:
    """``tree`` with each Layer re-typed so that its parameters' logical axes lead with "stage"."""

    def retype(node: Any) -> Any:
        if not isinstance(node, Layer):
            return node
        children, aux_data = node.tree_flatten()
        kind: Any = type(node)  # (a Layer class is hashable, whatever mypy reads into __hash__)
        return staged_class(kind).tree_unflatten(aux_data, [staged(c) for c in children])

    return jax.tree.map(retype, tree, is_leaf=lambda node: isinstance(node, Layer))


@functools.cache
def staged_class(cls: Any) -> type[Layer]:
    """A subclass of ``cls`` (same name, same call) whose ``param_logical_axes`` prepend "stage"."""

    def param_logical_axes(self: Layer) -> dict[str, LogicalAxes]:
        axes = cls.param_logical_axes(self)
        return {name: ("stage", *a)[: np.ndim(self.__dict__[name])] for name, a in axes.items()}

    return type(cls.__name__, (cls,), {"param_logical_axes": param_logical_axes, "__doc__": cls.__doc__})


def compiled_ticks(compiled: jax.stages.Compiled) -> int:
    """The ticks the program runs: how often each of its ``collective-permute``\\ s runs (the census).

    Each tick loop (forward, and its transpose in a gradient) holds one
    ``ppermute``; the census counts it once per trip of the loop.
    """
    text = compiled.as_text() or ""
    permutes = [c for c in collective_instructions(text) if c["kind"] == "collective-permute"]
    written = [c for c in permutes if c["phase"] != "-done"]  # an async pair is one permute
    return collectives(compiled)["collective-permute"].count // len(written)


def draw(grid: list[list[Any]]) -> str:
    """``schedule(p, m, r)`` as text: a row per stage, a column per tick, ``.`` for a bubble.

    A cell is the microbatch; with repeats, a ``'`` per repeat after the first.

    >>> print(draw([[0, 1, None], [None, 0, 1]]))
    stage 0 | 0 1 .
    stage 1 | . 0 1
    """
    text = [[_cell(c) for c in row] for row in grid]
    width = max(len(c) for row in text for c in row)
    return "\n".join(
        f"stage {d} | " + " ".join(c.ljust(width) for c in row).rstrip() for d, row in enumerate(text)
    )


def _cell(work: Any) -> str:
    if work is None:
        return "."
    return f"{work[0]}" + "'" * work[1] if isinstance(work, tuple) else str(work)
