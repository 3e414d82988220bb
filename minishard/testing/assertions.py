"""Assertions on numbers: ``assert_sharded_equivalent``, and ``assert_split`` that keeps it honest.

The first cannot see a wrong annotation: sharding never changes the numbers, so
a model with its two Megatron halves swapped computes exactly the same thing,
only slower. ``assert_placement`` (``placement.py``) can, because it compares with the placement *you*
state; ``assert_split`` states less, only that something really is split over
a mesh axis, which is what keeps an equivalence test from passing vacuously.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import hypothesis
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from minishard.rules import (
    AnyMesh,
    AxisRules,
    LogicalAxes,
    MeshAxes,
    as_mesh_axes,
    split_count,
)
from minishard.sharding import LeafPlan, Sharded, plan
from minishard.testing._cache import cached
from minishard.tree import path_str

# --- numbers --------------------------------------------------------------------


def assert_sharded_equivalent(
    fn: Callable[..., Any],
    *args: Any,
    mesh: Mesh,
    rules: AxisRules | None = None,
    batch_axis: str | None = None,
    reference: Callable[..., Any] | None = None,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    require_split: bool | str | Sequence[str] | Mapping[str, int] = True,
) -> Any:
    """Run ``fn`` unsharded and sharded; outputs must agree and be laid out as declared.

    The reference is ``jax.jit(fn)`` on one device (``reference`` instead of
    ``fn`` there, e.g. the plain model for a hand-written ``shard_map``, which
    cannot run on one device); the other run is
    ``Sharded(mesh, rules, batch_axis)(fn)``. Every output leaf must match
    (``numpy.testing.assert_allclose``, the message names the leaf's path) and
    every leaf whose spec ``ShardedFunction.specs`` declares (Layer parameters,
    scalars) must carry that sharding; leaves it leaves to XLA are not checked.
    Returns the sharded outputs. Define ``fn`` once, at module level: jit
    caches compiled code per function, so a new lambda per call recompiles.

    This catches a program that computes something else when sharded (a
    ``shard_map`` that forgets its ``psum``, a host callback). It cannot catch a
    wrong annotation, which changes where arrays live but not the numbers:
    that is ``assert_placement``'s job.

    Both runs compute at JAX's default matmul precision on the backend that
    runs them: float32 on a CPU; on a TPU one bf16 pass for a float32 dot, the
    same pass in both runs, so the default tolerance holds on a chip too
    (tests/test_accelerators.py). A reference at ``precision="highest"`` differs
    from that pass by about 1e-3 of the largest value (docs/tpu.md).

    With nothing split, both runs are the same program and the test passes
    vacuously. So first the split the test is about must happen, as
    ``require_split`` says:

    * ``True`` (the default): the model's. At least one *parameter* (an array
      inside a Layer) is split over a mesh axis wider than 1; a split batch
      does not count, so a tensor-parallel test of a model that the rules
      leave whole fails, even on a mesh whose "data" axis splits the batch;
    * logical axes, ``"mlp"`` or ``("batch", "mlp")``: *every* input array
      that carries each splits it into more than one piece. The batch's
      leading dimension carries the batch axis (``"batch"``, or
      ``batch_axis``), so ``require_split="batch"`` is a data-parallel test;
    * counts, ``{"mlp": 3}``: at least that many input arrays split the
      dimension the name labels. An array that lost its annotation carries no
      name, so only a count sees it: a Megatron pair splits 3 (the first
      weight and its bias, the second weight), a pair whose second half lost
      its axes 2;
    * ``False``: nothing is asked.

    Inside a hypothesis test an example that fails this is rejected instead
    (``hypothesis.reject``): hypothesis draws another, and says so if it finds
    none. A logical axis that no input carries is a typo: ``ValueError``.

    >>> import jax, jax.numpy as jnp
    >>> from minishard import AxisRules, make_mesh, mlp
    >>> n = jax.device_count()
    >>> model = mlp([8, 2 * n, 4], key=jax.random.key(0), axes=[("embed", "mlp"), ("mlp", "embed")])
    >>> mesh, rules = make_mesh({"model": n}), AxisRules(embed=None, mlp="model")
    >>> def forward(model, x):
    ...     return model(x)
    >>> assert_sharded_equivalent(forward, model, jnp.ones((4, 8)), mesh=mesh, rules=rules).shape
    (4, 4)
    >>> y = assert_sharded_equivalent(
    ...     forward, model, jnp.ones((4, 8)), mesh=mesh, rules=rules, require_split="mlp")
    """
    _check_tolerances("assert_sharded_equivalent", rtol, atol)
    sharded = _sharded(fn, mesh, rules, batch_axis)
    specs = sharded.specs(*args)
    if require_split is not False and (vacuous := _not_split(fn, args, sharded.config, require_split)):
        if hypothesis.currently_in_test_context():
            hypothesis.event("assert_sharded_equivalent: not split as require_split asks, example rejected")
            hypothesis.reject()
        raise AssertionError(f"assert_sharded_equivalent: {vacuous}\n(require_split=False to run it anyway)")
    # jax.block_until_ready after each run: dispatching sharded programs back to
    # back can deadlock the collectives of simulated CPU devices.
    # Through the host: an array typed for an Explicit mesh keeps that type on one device.
    on_one_device = jax.device_put(jax.device_get(args), mesh.devices.flat[0])
    expected = jax.block_until_ready(jax.jit(reference or fn)(*on_one_device))
    actual = jax.block_until_ready(sharded(*args))
    treedef: Any = jax.tree_util.tree_structure(actual)  # Any: PyTreeDef comes without type stubs
    declared = treedef.flatten_up_to(specs.outputs)  # None where Sharded left the sharding to XLA
    leaves = zip(jax.tree_util.tree_leaves_with_path(actual), jax.tree_util.tree_leaves(expected), declared)
    for (path, got), want, spec in leaves:
        where = f"output {path_str(path)}"
        if leaked := _nan_where_numbers(got, want):
            raise AssertionError(f"{where}: sharded != unsharded: {leaked}")
        np.testing.assert_allclose(got, want, rtol, atol, err_msg=f"{where}: sharded != unsharded")
        if spec is not None and not NamedSharding(mesh, spec).is_equivalent_to(got.sharding, got.ndim):
            raise AssertionError(f"{where}: has sharding {got.sharding}, but Sharded declared {spec}")
    return actual


def _nan_where_numbers(got: Any, want: Any) -> str | None:
    """Where the sharded run has NaN and the reference numbers, what that usually is (or None).
    numpy would say only "nan location mismatch"; a pipeline fills its bubbles with NaN."""
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape or not np.issubdtype(got.dtype, np.inexact):
        return None  # assert_allclose says what differs
    if not (leaked := int((np.isnan(got) & ~np.isnan(want)).sum())):
        return None
    return (
        f"{leaked} NaN where the unsharded run has numbers: a pipeline's bubble leaked into the "
        "result? (minishard.pipeline fills bubbles with NaN; assert_pipeline_equivalent(..., "
        "rules=) names the pipeline)"
    )


@cached
def _sharded(fn: Callable[..., Any], mesh: Mesh, rules: AxisRules | None, batch_axis: str | None) -> Any:
    """``Sharded(mesh, rules, batch_axis)(fn)``, kept across examples: its plans and jit are reused.

    Each new ``ShardedFunction`` jits a new function, so without this every
    example, and every rerun of a shrinking failure, would trace and compile again.
    """
    return Sharded(mesh, rules, batch_axis)(fn)


def _not_split(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    config: Sharded,
    required: bool | str | Sequence[str] | Mapping[str, int],
) -> str | None:
    """Why the inputs are not split as ``required`` says (``require_split``), or None if they are."""
    named = dict(zip(_argument_names(fn, len(args)), args))  # paths read "model.layers[0].weight", "x"

    def batch_placement(leaf: Any) -> tuple[LogicalAxes, PartitionSpec]:  # Sharded's, the batch axis named
        axes, spec = config.batch_placement(leaf)
        return ((config.batch_axis, *axes[1:]) if axes else axes), spec

    inputs = plan(named, config.mesh, config.rules, batch_placement).leaves
    if not isinstance(required, bool):  # logical axes (False never gets here)
        return _axes_not_split(inputs, _required_counts(required), config.mesh)
    parameters = {leaf.path for leaf in plan(named, config.mesh, config.rules, lambda leaf: None).leaves}
    if not parameters:
        raise ValueError(
            "assert_sharded_equivalent: require_split=True asks that a parameter be split, but no "
            "argument holds a Layer; name the logical axes that must be split, e.g. "
            f"require_split={config.batch_axis!r}"
        )
    specs = {leaf.path: leaf.spec for leaf in inputs if leaf.path in parameters}
    if (failure := _split_failure(specs, config.mesh, (), 1, "parameters")) is None:
        return None
    others = {leaf.path: leaf.spec for leaf in inputs if leaf.path not in parameters}
    if _split_failure(others, config.mesh, (), 1) is None:  # only the batch is split
        failure += (
            "\n  only inputs outside Layers (the batch) are split: for a data-parallel test, "
            f"require_split={config.batch_axis!r}"
        )
    return failure


def _required_counts(required: str | Sequence[str] | Mapping[str, int]) -> dict[str, int | None]:
    """``require_split``'s names, each with the count of arrays that must split it (None: every one)."""
    if isinstance(required, Mapping):
        for name, count in required.items():
            if (
                not isinstance(name, str)
                or isinstance(count, bool)
                or not isinstance(count, int)
                or count < 1
            ):
                raise ValueError(
                    f"assert_sharded_equivalent: require_split={dict(required)!r}: each entry must map a "
                    f"logical axis (str) to a count of arrays >= 1, got {name!r}: {count!r}"
                )
        return dict(required)
    names = (required,) if isinstance(required, str) else tuple(required)
    if not names or not all(isinstance(name, str) for name in names):
        raise ValueError(
            f"assert_sharded_equivalent: require_split={required!r}: name logical axes (str), give counts "
            "({'mlp': 3}), or pass True (a parameter split) or False (nothing asked)"
        )
    return dict.fromkeys(names)


def _axes_not_split(
    leaves: Sequence[LeafPlan], required: Mapping[str, int | None], mesh: AnyMesh
) -> str | None:
    """Why fewer arrays than ``required`` split each logical axis; one no array carries is refused."""
    carried = sorted({axis for leaf in leaves for axis in leaf.logical_axes if axis is not None})
    if unknown := [name for name in required if name not in carried]:
        raise ValueError(
            f"assert_sharded_equivalent: require_split names logical axis {unknown[0]!r}, which no input "
            f"carries; the inputs' logical axes are {carried}"
        )
    failures = []
    for name, count in required.items():
        carriers = [leaf for leaf in leaves if name in leaf.logical_axes]
        whole = [
            f"{leaf.path} {leaf.logical_axes} -> {leaf.spec}"
            for leaf in carriers
            if split_count(mesh, _padded(leaf.spec, len(leaf.shape))[leaf.logical_axes.index(name)]) == 1
        ]
        split = len(carriers) - len(whole)
        if split < (len(carriers) if count is None else count):
            asked = "every one must be" if count is None else f"require_split asks for {count}"
            failures.append(
                f"logical axis {name!r} is split in {split} of the {len(carriers)} arrays that carry it, "
                f"on mesh {dict(mesh.shape)}; {asked}\n  not split: {_listed(whole)}"
            )
    return "\n".join(failures) or None


def _argument_names(fn: Callable[..., Any], count: int) -> list[str]:
    """``fn``'s positional parameter names for ``count`` arguments; ``args[i]`` past what it names."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        params = []
    names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][:count]
    return names + [f"args[{i}]" for i in range(len(names), count)]


# --- at least something split ----------------------------------------------------


def assert_split(
    tree: Any,
    mesh: Mesh,
    over: str | Sequence[str] | None = None,
    *,
    rules: AxisRules | None = None,
    at_least: int = 1,
) -> None:
    """At least ``at_least`` arrays of ``tree`` must be split over the mesh axis ``over``.

    Not a whole intended placement (that is ``assert_placement``), only the least a
    test needs to test anything: on a mesh whose "model" axis is 1 wide, or
    under rules that replicate ``mlp``, a tensor-parallel test splits nothing
    and passes. ``over`` is a mesh axis, several (each must split the array),
    or None: any mesh axis wider than 1. An array's spec is read from the
    array when it is placed (``shard`` or a ``Sharded`` function returned it),
    else from ``plan(tree, mesh, rules)``: where ``shard`` would put it.
    The failure lists the arrays that are split and those that are not.

    >>> import jax
    >>> from minishard import AxisRules, make_mesh, mlp
    >>> n = jax.device_count()
    >>> model = mlp([4, 8 * n, 4], key=jax.random.key(0), axes=[("embed", "mlp"), ("mlp", "embed")])
    >>> mesh = make_mesh({"data": 1, "model": n})
    >>> assert_split(model, mesh, over="model", rules=AxisRules(embed=None, mlp="model"), at_least=3)
    >>> assert_split(model, mesh, over="model", rules=AxisRules(embed=None, mlp=None))
    Traceback (most recent call last):
    AssertionError: assert_split: 0 of 4 arrays are split over 'model' on mesh ...; at least 1 must be
      split: none
      not split: layers[0].weight P(None, None), layers[0].bias P(None,), ...
    """
    if isinstance(at_least, bool) or not isinstance(at_least, int) or at_least < 1:
        raise ValueError(f"assert_split: at_least must be an int >= 1 (a count of arrays), got {at_least!r}")
    wanted = () if over is None else (over,) if isinstance(over, str) else tuple(over)
    _check_mesh_axes("assert_split: over", wanted, mesh)
    if failure := _split_failure(_specs(tree, mesh, rules), mesh, wanted, at_least):
        raise AssertionError(f"assert_split: {failure}")


def _specs(tree: Any, mesh: Mesh, rules: AxisRules | None) -> dict[str, PartitionSpec]:
    """Each leaf's spec: a placed array's own, otherwise the one ``plan`` gives it."""
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    placed = {
        path_str(p): a.sharding.spec
        for p, a in leaves
        if isinstance(getattr(a, "sharding", None), NamedSharding)
    }
    if len(placed) == len(leaves):
        return placed
    return {leaf.path: placed.get(leaf.path, leaf.spec) for leaf in plan(tree, mesh, rules).leaves}


def _split_failure(
    specs: Mapping[str, PartitionSpec],
    mesh: AnyMesh,
    over: tuple[str, ...],
    at_least: int,
    what: str = "arrays",
) -> str | None:
    """Why fewer than ``at_least`` of these specs split over ``over`` (``()``: any axis), or None."""
    wide = {axis for axis, size in mesh.shape.items() if size > 1}
    split: list[str] = []
    whole: list[str] = []
    for path, spec in specs.items():
        axes = {axis for entry in spec for axis in as_mesh_axes(entry)} & wide
        (split if axes and set(over) <= axes else whole).append(f"{path} {spec}")
    if len(split) >= at_least:
        return None
    where = (
        f"over {over[0]!r}" if len(over) == 1 else f"over each of {over}" if over else "over any mesh axis"
    )
    narrow = [axis for axis in over if axis not in wide]
    why = f" (mesh axis {narrow[0]!r} is 1 wide: nothing can be split over it)" if narrow else ""
    return (
        f"{len(split)} of {len(specs)} {what} are split {where} on mesh {dict(mesh.shape)}{why}; "
        f"at least {at_least} must be\n  split: {_listed(split)}\n  not split: {_listed(whole)}"
    )


def _listed(items: list[str], most: int = 8) -> str:
    return ", ".join(items[:most]) + (", ..." if len(items) > most else "") if items else "none"


def _check_mesh_axes(where: str, mesh_axes: Iterable[str], mesh: AnyMesh) -> None:
    """A mistyped mesh axis would select nothing and check nothing: refuse it, naming the valid ones."""
    if unknown := [axis for axis in mesh_axes if axis not in mesh.axis_names]:
        raise ValueError(f"{where} names mesh axis {unknown[0]!r}, but the mesh's axes are {mesh.axis_names}")


def _check_tolerances(where: str, rtol: Any, atol: Any) -> None:
    """Tolerances are numbers >= 0: a negative one makes every comparison fail, or some pass unseen."""
    for name, value in (("rtol", rtol), ("atol", atol)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < float("inf"):
            raise ValueError(f"{where}: {name} must be a finite number >= 0, got {value!r}")


def _padded(spec: PartitionSpec, ndim: int) -> tuple[MeshAxes, ...]:
    return tuple(spec) + (None,) * (ndim - len(spec))


__all__ = ["assert_sharded_equivalent", "assert_split"]
