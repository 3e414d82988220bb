"""The bookkeeping behind ``Sharded``'s flat calls, which a reader may skip.

``Sharded`` calls its ``jax.jit`` over the flat leaves of the arguments; these
helpers find positions among those leaves, and on Explicit meshes give unplaced
inputs the sharded types ``in_shardings`` implies.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from minishard.layers import Layer


def typed(leaves: tuple[Any, ...], shardings: tuple[NamedSharding, ...]) -> list[Any]:
    """Explicit meshes: trace with the types the shardings imply, however the inputs were placed.

    An unplaced input (a numpy array, a fresh model) has an unsharded type; ``reshard``
    gives it the type ``in_shardings`` already placed it with: a trace-time relabel, free per call.
    """
    return [
        jax.sharding.reshard(x, s) if jax.typeof(x).sharding.mesh.empty else x
        for x, s in zip(leaves, shardings)
    ]


def as_given(leaves: tuple[Any, ...], shardings: tuple[NamedSharding, ...]) -> tuple[Any, ...]:
    return leaves  # Auto meshes: types carry no sharding


def leaf_positions(args: tuple[Any, ...], argnums: tuple[int, ...]) -> tuple[int, ...]:
    """The positions, among the flattened ``args``, of the leaves of the arguments ``argnums``."""
    starts = np.cumsum([0] + [len(jax.tree_util.tree_leaves(arg)) for arg in args])
    return tuple(i for a in argnums for i in range(starts[a], starts[a + 1]))


def positions_outside_layers(tree: Any) -> tuple[int, ...]:
    """Indices, in ``tree_leaves(tree)``, of the leaves that do not belong to a Layer."""
    positions, index = [], 0
    for node in jax.tree_util.tree_leaves(tree, is_leaf=lambda node: isinstance(node, Layer)):
        if isinstance(node, Layer):
            index += len(jax.tree_util.tree_leaves(node))
        else:
            positions.append(index)
            index += 1
    return tuple(positions)
