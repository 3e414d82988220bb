"""Migrations: what checkpoints of older minishard versions stored differently, one function each.

``Checkpointer.restore`` applies all of them; the older checksum records are
read in ``integrity``. A migration maps an old format onto the current one and
never changes what a current checkpoint means.

>>> older_name("opt_state.velocity.layers[0].weight")
'opt_state.momentum.layers[0].weight'
>>> for old in older_names("opt_state.velocity.embedding.position_table"):   # each rename undone
...     print(old)
opt_state.momentum.embedding.position_table
opt_state.velocity.embedding.positions
opt_state.momentum.embedding.positions
"""

from __future__ import annotations

import re
from typing import Any

import jax

from minishard.optim import SGDState
from minishard.tree import path_str

__all__ = ["before_dropout", "before_position_table", "older_name", "older_names", "sgd_steps"]


def older_name(name: str) -> str:
    """minishard 0.1 stored ``SGDState.velocity`` as ``momentum``: the name to look for instead."""
    return re.sub(r"(^|\.)velocity(?=\.|\[|$)", r"\1momentum", name)


def before_position_table(name: str) -> str:
    """Before issue 62 a learned position table (``Embedding``'s, ``PatchEmbedding``'s) was named
    ``positions``, the word the tokens' places keep: the name to look for instead."""
    return re.sub(r"(^|\.)position_table(?=\.|\[|$)", r"\1positions", name)


def older_names(name: str) -> list[str]:
    """The names an older minishard may have stored ``name``'s array under, newest rename first."""
    candidates = [older_name(name), before_position_table(name), before_position_table(older_name(name))]
    return [old for old in dict.fromkeys(candidates) if old != name]


def before_dropout(signature: str) -> str:
    """Before issue 61 a GPT kept no dropout rate (a static field since): the structure its checkpoints
    saved, for this run's at rate 0 (another rate never matches: that run drops, theirs did not).

    >>> before_dropout("PyTreeDef(CustomNode(GPT[('none', 0.0)], [*]))")
    "PyTreeDef(CustomNode(GPT[('none',)], [*]))"
    """
    return re.sub(r"GPT\[\('(\w+)', 0\.0\)\]", r"GPT[('\1',)]", signature)


def sgd_steps(target: Any) -> set[str]:
    """``X.step`` for every ``SGDState`` ``X`` in the target: a counter an older checkpoint may lack.

    Before issue 44, an SGD at a constant learning rate kept no step counter, so its checkpoints
    hold none; restored, the counter starts at the checkpoint's step (with a log line): the updates
    a run that saves every step has taken, and a constant rate never reads it.
    """
    states, _ = jax.tree_util.tree_flatten_with_path(target, is_leaf=lambda node: isinstance(node, SGDState))
    step = jax.tree_util.GetAttrKey("step")
    return {path_str((*path, step)) for path, node in states if isinstance(node, SGDState)}
