"""Assertions on placement: ``assert_placement``, every array split the way *you* state.

``assert_sharded_equivalent`` cannot see a wrong annotation (sharding never
changes the numbers); this can, because it reads each array's sharding and the
shard every device holds and compares them with what you intended, not with
what minishard derived from the same annotations.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from minishard.rules import IDENTITY_RULES, AxisRules, LogicalAxes, ShardingError, as_mesh_axes, split_count
from minishard.sharding import plan
from minishard.testing.assertions import _check_mesh_axes, _padded
from minishard.tree import path_str

ExpectedPlacement = PartitionSpec | tuple[int, ...] | LogicalAxes
"""What an array's placement must be: a spec, each device's shard shape, or logical axes (through
the rules)."""


def assert_placement(tree: Any, mesh: Mesh, expected: Any, *, rules: AxisRules | None = None) -> None:
    """Every array of ``tree`` must be laid out on ``mesh`` as ``expected`` says.

    The placement is read from the arrays themselves (``.sharding`` and the
    ``addressable_shards`` each device holds), not from minishard's plan: put
    in ``tree`` what ``shard`` placed or a ``Sharded`` function returned.
    ``expected`` maps a leaf's path, as ``minishard.tree.path_str`` writes it
    (``"inner.layers[0].weight"``), to one of

    * a ``PartitionSpec``: the array's sharding must be equivalent to it;
    * a shard shape, a tuple of ints: the shard every device of the mesh holds;
    * logical axes, a tuple of names or None: the spec ``rules`` give them.
      This checks the model's annotations against your intention under these
      rules; state a spec or a shard shape to check the rules too.

    ``expected`` may instead be a pytree shaped like ``tree`` holding those (a
    ``None`` there is not checked). Arrays not listed are not checked; a path
    that names no array fails, since a typo would otherwise check nothing, and
    so does a spec naming a mesh axis the mesh lacks, or longer than the
    array's rank (``ValueError``, before anything is compared). All
    mismatches are reported together: the path, the expected and actual
    placements, and, with ``rules``, the logical axes the model gave the array and
    what each rule did with them (``AxisRules.explain``).

    >>> import jax
    >>> from minishard import AxisRules, make_mesh, mlp, shard
    >>> n = jax.device_count()
    >>> mesh, rules = make_mesh({"model": n}), AxisRules(embed=None, mlp="model")
    >>> model = shard(mlp([4, 8 * n, 4], key=jax.random.key(0), axes=[("embed", "mlp"), ("mlp", "embed")]),
    ...               mesh, rules)
    >>> assert_placement(model, mesh, {"layers[0].weight": (4, 8), "layers[2].weight": ("mlp", "embed"),
    ...                             "layers[2].bias": PartitionSpec()}, rules=rules)
    """
    arrays = {path_str(path): array for path, array in jax.tree_util.tree_leaves_with_path(tree)}
    wanted = {path: want for path, want in _expected_by_path(tree, expected).items() if want is not None}
    if unknown := sorted(set(wanted) - set(arrays)):
        raise AssertionError(
            f"assert_placement: {unknown} name no array of the tree; its arrays are {list(arrays)}"
        )
    given_rules, rules = rules, rules or IDENTITY_RULES
    specs = {
        path: _wanted_spec(path, want, np.shape(arrays[path]), mesh, rules) for path, want in wanted.items()
    }
    problems = {
        path: p
        for path, want in wanted.items()
        if (p := _placement_problem(arrays[path], mesh, want, specs[path]))
    }
    if problems:
        why = _why(tree, mesh, given_rules) if given_rules else lambda path: ""
        raise AssertionError(
            f"assert_placement: {len(problems)} of {len(wanted)} arrays are not laid out as expected on mesh "
            f"{dict(mesh.shape)}:\n" + "\n".join(f"{path}: {p}{why(path)}" for path, p in problems.items())
        )


def _expected_by_path(tree: Any, expected: Any) -> dict[str, Any]:
    """``{path: placement}`` from either form of ``expected``."""
    if isinstance(expected, Mapping) and all(  # paths to placements; a bad placement is named by its path
        isinstance(key, str) and not isinstance(value, Mapping | list) for key, value in expected.items()
    ):
        return dict(expected)
    treedef: Any = jax.tree_util.tree_structure(tree)
    try:  # the placements sit where tree has arrays: tuples there are taken whole, not as subtrees
        flat = treedef.flatten_up_to(expected)
    except (ValueError, TypeError) as e:
        raise TypeError(
            f"assert_placement: expected is neither {{path: placement}} nor shaped like the tree: {e}"
        ) from None
    return {path_str(path): want for (path, _), want in zip(jax.tree_util.tree_leaves_with_path(tree), flat)}


def _wanted_spec(
    path: str, want: ExpectedPlacement, shape: tuple[int, ...], mesh: Mesh, rules: AxisRules
) -> PartitionSpec | None:
    """The spec ``want`` stands for (None for a shard shape), checked against the mesh and the array."""
    if isinstance(want, tuple) and all(isinstance(d, int) and not isinstance(d, bool) for d in want):
        return None
    if isinstance(want, PartitionSpec):
        spec = want
    elif isinstance(want, tuple) and all(a is None or isinstance(a, str) for a in want):
        spec = rules.spec(want, mesh)  # type: ignore[arg-type]  # tuple[str | None, ...] by the test above
    else:
        raise TypeError(
            f"assert_placement: {path}: expected a PartitionSpec, a shard shape (ints) or logical axes "
            f"(names), got {want!r}"
        )
    _check_mesh_axes(f"assert_placement: {path}: {spec}", [a for e in spec for a in as_mesh_axes(e)], mesh)
    if len(spec) > len(shape):
        raise ValueError(
            f"assert_placement: {path}: {want} has {len(spec)} entries, but the array has shape {shape} "
            f"(rank {len(shape)}); give one entry per dimension, or fewer"
        )
    return spec


def _placement_problem(
    array: Any, mesh: Mesh, want: ExpectedPlacement, spec: PartitionSpec | None
) -> str | None:
    """What is wrong with ``array``'s placement, or None if it is the one wanted."""
    if not isinstance(array, jax.Array):
        kind = f"{type(array).__module__}.{type(array).__name__}"
        return f"is not on the mesh: a {kind}, not a jax.Array (place it with minishard.shard)"
    # addressable_shards: one per device of this process, each holding that device's shard
    shards = sorted({shard.data.shape for shard in array.addressable_shards})
    got = array.sharding.spec if isinstance(array.sharding, NamedSharding) else array.sharding
    actual = f"got {got}, shards {', '.join(map(str, shards))}"
    if array.sharding.device_set != set(mesh.devices.flat):
        return f"is on {len(array.sharding.device_set)} device(s), not on the mesh's {mesh.size}; {actual}"
    if spec is None:
        return None if shards == [want] else f"expected shards {want}, {actual}"
    if NamedSharding(mesh, spec).is_equivalent_to(array.sharding, array.ndim):
        return None
    stated = f"{spec}" if isinstance(want, PartitionSpec) else f"{want} -> {spec}"
    shard = tuple(
        size // split_count(mesh, entry) for size, entry in zip(array.shape, _padded(spec, array.ndim))
    )
    return f"expected {stated}, shards {shard}; {actual}"


def _why(tree: Any, mesh: Mesh, rules: AxisRules) -> Callable[[str], str]:
    """For a Layer parameter's path: the logical axes the model gave it, and ``AxisRules.explain``."""
    try:
        leaves = {leaf.path: leaf.logical_axes for leaf in plan(tree, mesh, rules).leaves}
    except ShardingError:
        leaves = {}

    def why(path: str) -> str:
        axes = leaves.get(path)
        if axes is None:
            return ""
        if all(axis is None for axis in axes):
            return f"\n  the model does not annotate it: logical axes {axes}"
        trace = str(rules.explain(axes, mesh)).replace("\n", "\n    ")
        return f"\n  the model names its axes {axes}; under {rules}:\n    {trace}"

    return why


__all__ = ["ExpectedPlacement", "assert_placement"]
