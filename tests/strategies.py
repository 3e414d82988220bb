"""Hypothesis strategies and tree assertions shared by the minishard tests.

The main idea: draw a *description* of a model first (small frozen dataclasses:
``LinearBlueprint``, ``ActivationBlueprint``, ``ContainerBlueprint``), then ``build`` the real
pytree from it. Because the description is ours, ``expected_leaves`` can say
what JAX ought to find in the built tree -- every leaf's path and shape --
by walking the description, without asking JAX. Tests then compare JAX's
answer with that independent one.

Containers cover every way a layer can be nested: ``Sequential``, ``list``,
``tuple``, ``dict``, a namedtuple (``Pair``) and ``Box``, a user container
registered here with ``jax.tree_util.register_pytree_with_keys_class``.

Sizes are kept small (``MAX_DIM``): every new array shape costs JAX a compile
the first time it is used, and the properties do not depend on size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import hypothesis.strategies as st
import jax
import numpy as np
from hypothesis.strategies import SearchStrategy, composite

from minishard import Linear, LogicalAxes, Sequential
from minishard.layers import ACTIVATIONS
from minishard.testing import seeds as seeds  # the one seeds strategy, re-exported for the tests

MAX_DIM = 4
dims = st.integers(1, MAX_DIM)
axis_names = st.sampled_from([None, "embed", "mlp", "vocab"])


# -- two user containers --------------------------------------------------
class Pair(NamedTuple):
    """A namedtuple: JAX flattens it like a tuple and names children by field."""

    left: Any
    right: Any


@jax.tree_util.register_pytree_with_keys_class
class Box:
    """A user container holding any number of items and a static label."""

    def __init__(self, items: Sequence[Any], label: str = "box") -> None:
        self.items = tuple(items)
        self.label = label

    def tree_flatten_with_keys(self) -> tuple[list[tuple[Any, Any]], str]:
        return [(jax.tree_util.GetAttrKey("items"), self.items)], self.label

    @classmethod
    def tree_unflatten(cls, label: str, children: Sequence[Any]) -> Box:
        (items,) = children
        return cls(items, label)


# -- model descriptions ---------------------------------------------------
@dataclass(frozen=True)
class LinearBlueprint:
    n_in: int
    n_out: int
    use_bias: bool
    axes: LogicalAxes


@dataclass(frozen=True)
class ActivationBlueprint:
    name: str  # a key of minishard.layers.ACTIVATIONS


@dataclass(frozen=True)
class ContainerBlueprint:
    kind: str  # a key of CHILD_KEY
    children: tuple[Blueprint, ...]
    keys: tuple[str, ...] = ()  # the dict keys, when kind == "dict"


Blueprint = LinearBlueprint | ActivationBlueprint | ContainerBlueprint

# How each container names its i-th child in a key path (``jax.tree_util.keystr``).
CHILD_KEY = {
    "sequential": lambda i: f".layers[{i}]",
    "list": lambda i: f"[{i}]",
    "tuple": lambda i: f"[{i}]",
    "pair": lambda i: f".{Pair._fields[i]}",
    "box": lambda i: f".items[{i}]",
    "dict": None,  # named by key: .a (path_str writes a dict key that is a name as an attribute)
}


@composite
def linear_blueprints(draw: Any) -> LinearBlueprint:
    return LinearBlueprint(draw(dims), draw(dims), draw(st.booleans()), (draw(axis_names), draw(axis_names)))


def activation_blueprints() -> SearchStrategy[ActivationBlueprint]:
    return st.builds(ActivationBlueprint, st.sampled_from(sorted(ACTIVATIONS)))


@composite
def container_blueprints(draw: Any, children: SearchStrategy[Blueprint]) -> ContainerBlueprint:
    kind = draw(st.sampled_from(sorted(CHILD_KEY)))
    if kind == "pair":
        return ContainerBlueprint(kind, (draw(children), draw(children)))
    if kind == "dict":
        keys = draw(st.lists(st.sampled_from("abcde"), max_size=3, unique=True))
        return ContainerBlueprint(kind, tuple(draw(children) for _ in keys), tuple(keys))
    return ContainerBlueprint(kind, tuple(draw(st.lists(children, max_size=3))))


# One fixed description using every container kind, for tests to always include:
# {"model": Sequential(Linear, ReLU, Linear), "extras": [(Pair(Linear, Box(Swish, Linear)),)]}
_box = ContainerBlueprint("box", (ActivationBlueprint("swish"), LinearBlueprint(2, 2, True, (None, None))))
_pair = ContainerBlueprint("pair", (LinearBlueprint(1, 2, True, (None, "mlp")), _box))
_sequential = ContainerBlueprint(
    "sequential",
    (
        LinearBlueprint(2, 3, True, ("embed", "mlp")),
        ActivationBlueprint("relu"),
        LinearBlueprint(3, 1, False, (None, None)),
    ),
)
_list = ContainerBlueprint("list", (ContainerBlueprint("tuple", (_pair,)),))
EVERY_CONTAINER = ContainerBlueprint("dict", (_sequential, _list), keys=("model", "extras"))


def blueprints(max_leaves: int = 6) -> SearchStrategy[Blueprint]:
    """Random nestings of layers and containers (possibly empty ones)."""
    return st.recursive(
        linear_blueprints() | activation_blueprints(), container_blueprints, max_leaves=max_leaves
    )


def build(blueprint: Blueprint, key: jax.Array) -> Any:
    """The pytree a description stands for, made with minishard's constructors."""
    if isinstance(blueprint, LinearBlueprint):
        return Linear(
            blueprint.n_in, blueprint.n_out, key=key, use_bias=blueprint.use_bias, axes=blueprint.axes
        )
    if isinstance(blueprint, ActivationBlueprint):
        return ACTIVATIONS[blueprint.name]()
    children = [build(child, jax.random.fold_in(key, i)) for i, child in enumerate(blueprint.children)]
    match blueprint.kind:
        case "sequential":
            return Sequential(children)
        case "list":
            return children
        case "tuple":
            return tuple(children)
        case "pair":
            return Pair(*children)
        case "box":
            return Box(children, label="box")
        case "dict":
            return dict(zip(blueprint.keys, children))
    raise ValueError(f"unknown container kind {blueprint.kind!r}")


def expected_leaves(blueprint: Blueprint, path: str = "") -> list[tuple[str, tuple[int, ...]]]:
    """(key path, shape) of every array in ``build(blueprint)``, in flattening order.

    Computed from the description alone. JAX visits dict keys in sorted order.
    """
    if isinstance(blueprint, LinearBlueprint):
        weight = (f"{path}.weight", (blueprint.n_in, blueprint.n_out))
        return [weight, (f"{path}.bias", (blueprint.n_out,))] if blueprint.use_bias else [weight]
    if isinstance(blueprint, ActivationBlueprint):
        return []
    if blueprint.kind == "dict":
        named = sorted(zip(blueprint.keys, blueprint.children))
        return [leaf for k, child in named for leaf in expected_leaves(child, f"{path}.{k}")]
    child_key = CHILD_KEY[blueprint.kind]
    return [
        leaf
        for i, child in enumerate(blueprint.children)
        for leaf in expected_leaves(child, path + child_key(i))
    ]


# -- MLPs and plain trees of arrays ----------------------------------------
def mlp_sizes(min_size: int = 2, max_size: int = 4) -> SearchStrategy[list[int]]:
    """Layer widths for ``minishard.mlp``: inputs, hidden..., outputs."""
    return st.lists(dims, min_size=min_size, max_size=max_size)


shapes = st.lists(dims, max_size=2).map(tuple)


def lists_or_dicts(children: SearchStrategy[Any]) -> SearchStrategy[Any]:
    return st.lists(children, min_size=1, max_size=3) | st.dictionaries(
        st.sampled_from("xyz"), children, min_size=1, max_size=3
    )


@composite
def array_trees(draw: Any) -> Any:
    """A random nesting of dicts and lists whose leaves are float32 arrays."""
    shape_tree = draw(st.recursive(shapes, lists_or_dicts, max_leaves=5))
    rng = np.random.default_rng(draw(seeds))
    return jax.tree_util.tree_map(
        lambda shape: rng.standard_normal(shape).astype(np.float32),
        shape_tree,
        is_leaf=lambda node: isinstance(node, tuple),
    )


def random_like(tree: Any, rng: np.random.Generator) -> Any:
    """A tree of the same structure as ``tree`` with fresh standard-normal leaves."""
    return jax.tree_util.tree_map(lambda a: rng.standard_normal(np.shape(a)).astype(np.float32), tree)


# -- assertions --------------------------------------------------------------
def _paired_leaves(actual: Any, expected: Any) -> list[tuple[str, Any, Any]]:
    actual_def = jax.tree_util.tree_structure(actual)
    expected_def = jax.tree_util.tree_structure(expected)
    assert actual_def == expected_def, f"tree structures differ:\n  {actual_def}\n  {expected_def}"
    with_paths = jax.tree_util.tree_leaves_with_path(expected)
    return [
        (jax.tree_util.keystr(path), np.asarray(a), np.asarray(e))
        for (path, e), a in zip(with_paths, jax.tree_util.tree_leaves(actual))
    ]


def assert_trees_equal(actual: Any, expected: Any) -> None:
    """Same treedef (node types and static data) and bit-identical leaves."""
    for path, a, e in _paired_leaves(actual, expected):
        np.testing.assert_array_equal(a, e, err_msg=f"leaf {path}", strict=True)
        assert a.tobytes() == e.tobytes(), f"leaf {path}: values equal but bits differ"


def assert_trees_close(actual: Any, expected: Any, rtol: float = 1e-6, atol: float = 0.0) -> None:
    """Same treedef and leaves equal up to ``rtol``/``atol``; a failure names the leaf's path."""
    for path, a, e in _paired_leaves(actual, expected):
        assert a.shape == e.shape, f"leaf {path}: shape {a.shape} != {e.shape}"
        np.testing.assert_allclose(a, e, rtol=rtol, atol=atol, err_msg=f"leaf {path}")
