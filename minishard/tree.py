"""Small pytree helpers for looking inside a model.

A model is just a pytree, so "how many parameters?" and "how many bytes?" are
folds over its leaves (``count_params``, ``tree_bytes``), and every leaf has a *key
path* that names it (``path_str``, ``named_leaves``). ``cast_floating`` casts a tree's
floating leaves and leaves its integers be, the cast a mixed-precision step makes.

>>> import jax
>>> from minishard import mlp
>>> model = mlp([3, 4, 2], key=jax.random.key(0))
>>> count_params(model), tree_bytes(model)
(26, 104)
>>> [path for path, _ in named_leaves(model)][:2]
['layers[0].weight', 'layers[0].bias']
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np

from minishard import _checks

__all__ = ["cast_floating", "count_params", "named_leaves", "path_str", "tree_bytes"]


def path_str(path: tuple[Any, ...], root: str = "") -> str:
    """``(DictKey('model'), GetAttrKey('layers'), SequenceKey(0))`` -> ``'model.layers[0]'``.

    The one way minishard names a leaf: its errors, reports and checkpoints all
    write paths with it. ``jax.tree_util.keystr`` would write ``['model'].layers[0]``;
    a dict key that is a Python name reads better as an attribute. Other keys keep
    their brackets (``['a b']``, ``[3]``), so two different leaves never share a name.
    ``root`` names the tree itself, for a path inside one argument or field.

    >>> from jax.tree_util import DictKey, SequenceKey
    >>> path_str((DictKey("w"), SequenceKey(0))), path_str((DictKey("w"),), root="params")
    ('w[0]', 'params.w')
    """
    return (root + "".join(map(_key_str, path))).removeprefix(".") or "<root>"


def _key_str(key: Any) -> str:
    name = key.key if isinstance(key, jax.tree_util.DictKey) else None
    if isinstance(name, str) and name.isidentifier():
        return f".{name}"
    return str(key)  # GetAttrKey: ".name"; SequenceKey: "[0]"; other DictKeys: "['a b']"


def named_leaves(tree: Any) -> list[tuple[str, Any]]:
    """Every leaf of ``tree`` with its readable path, in flattening order."""
    return [(path_str(path), leaf) for path, leaf in _leaves_with_path("named_leaves", tree)]


def count_params(tree: Any) -> int:
    """Total number of array elements in ``tree``."""
    return sum(math.prod(leaf.shape) for leaf in _arrays("count_params", tree))


def tree_bytes(tree: Any) -> int:
    """Total bytes of the arrays in ``tree`` (unsharded: the whole arrays)."""
    leaves = _arrays("tree_bytes", tree)
    return sum(math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize for leaf in leaves)


def cast_floating(tree: Any, dtype: Any) -> Any:
    """Every floating array of ``tree`` in ``dtype`` (jmp's cast to compute); integers (token ids,
    labels) as they are."""
    floating = lambda x: jax.numpy.issubdtype(x.dtype, jax.numpy.floating)  # noqa: E731
    return jax.tree.map(lambda x: x.astype(dtype) if floating(x) else x, tree)


def _leaves_with_path(where: str, tree: Any) -> list[tuple[Any, Any]]:
    """``jax.tree_util.tree_leaves_with_path``; a dict whose keys cannot be sorted is named."""
    try:
        return jax.tree_util.tree_leaves_with_path(tree)
    except ValueError:
        # JAX visits a dict in sorted key order, and says only "Comparator raised ..."
        _checks.sortable_dicts(where, tree, path_str)
        raise


def _arrays(where: str, tree: Any) -> list[Any]:
    """The leaves, each checked to be an array (or an abstract one, from ``jax.eval_shape``)."""
    leaves = _leaves_with_path(where, tree)
    _checks.arrays(where, leaves, path_str)
    return [leaf for _, leaf in leaves]
