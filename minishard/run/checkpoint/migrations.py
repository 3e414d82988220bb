"""Migrations: what checkpoints of older minishard versions stored differently, one function each.

``Checkpointer.restore`` applies all of them; the older checksum records are
read in ``integrity``. A migration maps an old layout onto the current one and
never changes what a current checkpoint means.

>>> older_name("opt_state.velocity.layers[0].weight")
'opt_state.momentum.layers[0].weight'
"""

from __future__ import annotations

import re
from typing import Any

import jax

from minishard.optim import SGDState
from minishard.tree import path_str

__all__ = ["older_name", "steps_not_kept"]


def older_name(name: str) -> str:
    """minishard 0.1 stored ``SGDState.velocity`` as ``momentum``: the name to look for instead."""
    return re.sub(r"(^|\.)velocity(?=\.|\[|$)", r"\1momentum", name)


def steps_not_kept(target: Any) -> set[str]:
    """``X.step`` for every ``SGDState`` ``X`` in the target that keeps no step counter.

    A stored counter there is dropped (with a log line), not refused: earlier minishard versions
    kept a counter even for a constant learning rate, and a schedule's run may resume at a
    constant rate.
    """
    states, _ = jax.tree_util.tree_flatten_with_path(target, is_leaf=lambda node: isinstance(node, SGDState))
    return {
        path_str((*path, jax.tree_util.GetAttrKey("step")))
        for path, node in states
        if isinstance(node, SGDState) and node.step is None
    }
