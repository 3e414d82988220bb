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

__all__ = ["older_name", "sgd_steps"]


def older_name(name: str) -> str:
    """minishard 0.1 stored ``SGDState.velocity`` as ``momentum``: the name to look for instead."""
    return re.sub(r"(^|\.)velocity(?=\.|\[|$)", r"\1momentum", name)


def sgd_steps(target: Any) -> set[str]:
    """``X.step`` for every ``SGDState`` ``X`` in the target: a counter an older checkpoint may lack.

    Before issue 44, an SGD at a constant learning rate kept no step counter, so its checkpoints
    hold none; restored, the counter starts at the checkpoint's step (with a log line): the updates
    a run that saves every step has taken, and a constant rate never reads it.
    """
    states, _ = jax.tree_util.tree_flatten_with_path(target, is_leaf=lambda node: isinstance(node, SGDState))
    step = jax.tree_util.GetAttrKey("step")
    return {path_str((*path, step)) for path, node in states if isinstance(node, SGDState)}
