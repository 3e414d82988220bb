"""Small pytree helpers for looking inside a model.

A model is just a pytree, so "how many parameters?" and "how many bytes?" are
folds over its leaves, and every leaf has a *key path* that names it.

>>> import jax
>>> from minishard import mlp
>>> model = mlp([3, 4, 2], key=jax.random.key(0))
>>> count_params(model), tree_bytes(model)
(26, 104)
>>> [path for path, _ in named_leaves(model)][:2]
['layers[0].weight', 'layers[0].bias']
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def path_str(path: tuple[Any, ...]) -> str:
    """``(GetAttrKey('layers'), SequenceKey(0), ...)`` -> ``'layers[0].weight'``.

    ``jax.tree_util.keystr`` writes attributes with a leading dot
    (``.layers[0].weight``); error messages read better without it.
    """
    return jax.tree_util.keystr(path).removeprefix(".") or "<root>"


def named_leaves(tree: Any) -> list[tuple[str, Any]]:
    """Every leaf of ``tree`` with its readable path, in flattening order."""
    return [(path_str(path), leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(tree)]


def count_params(tree: Any) -> int:
    """Total number of array elements in ``tree``."""
    return sum(int(np.prod(np.shape(leaf))) for leaf in jax.tree_util.tree_leaves(tree))


def tree_bytes(tree: Any) -> int:
    """Total bytes of the arrays in ``tree`` (unsharded: the whole arrays)."""
    return sum(
        int(np.prod(np.shape(leaf))) * np.dtype(jax.numpy.result_type(leaf)).itemsize
        for leaf in jax.tree_util.tree_leaves(tree)
    )
