"""Assertions on communication: a compiled program sends no more than a budget of ``Limit``\\ s.

Collectives exist only in the compiled program: XLA's SPMD partitioner inserts
them there, so a budget is checked against the HLO (``minishard.census``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from minishard.census import (
    KINDS,
    Collective,
    Program,
    collectives,
    human_bytes,
    instructions,
    mesh_of,
    summary,
)
from minishard.rules import AnyMesh, AxisRules, as_mesh_axes
from minishard.sharding import Sharded
from minishard.testing.assertions import _check_mesh_axes, _sharded
from minishard.tree import tree_bytes


@dataclasses.dataclass(frozen=True)
class Limit:
    """At most ``count`` collective instructions, and ``bytes`` bytes per device, of those selected.

    ``kind`` selects one kind (``"all-gather"``, see ``minishard.census.KINDS``),
    ``None`` every kind; ``over`` the ones whose device groups span this mesh
    axis (or all of these axes, perhaps more), ``None`` any. ``assert_collectives``
    checks ``over`` against the program's mesh: a mistyped axis would select nothing.

    >>> print(Limit("all-gather", count=0), Limit("all-reduce", over="data", count=1), sep="; ")
    no all-gather; all-reduce over 'data': at most 1
    >>> print(Limit(over="model", bytes=4096))
    any collective over 'model': at most 4,096 B (4.1 kB) per device
    """

    kind: str | None = None
    over: str | tuple[str, ...] | None = None
    count: int | None = None
    bytes: int | None = None

    def __post_init__(self) -> None:
        if self.kind is not None and self.kind not in KINDS:
            raise ValueError(f"Limit: kind {self.kind!r} is none of {KINDS}")
        if self.count is None and self.bytes is None:
            raise ValueError(f"Limit({self.kind!r}): give a count, bytes or both")
        for name, bound in (("count", self.count), ("bytes", self.bytes)):
            if bound is not None and (isinstance(bound, bool) or not isinstance(bound, int) or bound < 0):
                raise ValueError(f"Limit({self.kind!r}): {name} must be an int >= 0 (or None), got {bound!r}")

    def selects(self, kind: str, groups: tuple[tuple[str, ...], ...]) -> bool:
        """Does this limit count an instruction of ``kind`` over these device groups?"""
        spans = [{axis.partition("(")[0] for axis in group} for group in groups]  # "y(2 of 4)" spans y
        wanted = set(as_mesh_axes(self.over))
        return (self.kind is None or kind == self.kind) and any(wanted <= axes for axes in spans)

    def __str__(self) -> str:
        what = (self.kind or "any collective") + (f" over {self.over!r}" if self.over is not None else "")
        if self.count == 0:
            return f"no {what}"
        bounds = [str(self.count)] if self.count is not None else []
        bounds += [f"{_exact_bytes(self.bytes)} per device"] if self.bytes is not None else []
        return f"{what}: at most {', '.join(bounds)}"


def _exact_bytes(nbytes: int) -> str:
    """``nbytes`` to the byte, then rounded where that reads easier: a budget derived to the byte
    is checked from the message.

    >>> _exact_bytes(1126), _exact_bytes(236)
    ('1,126 B (1.1 kB)', '236 B')
    """
    exact = f"{nbytes:,} B"
    return exact if human_bytes(nbytes) == exact else f"{exact} ({human_bytes(nbytes)})"


def assert_collectives(
    program: Program | Callable[..., Any],
    *limits: Limit,
    args: Sequence[Any] = (),
    mesh: Mesh | None = None,
    rules: AxisRules | None = None,
    exhaustive: bool = False,
) -> dict[str, Collective]:
    """The compiled ``program`` must stay within every ``Limit``; returns its collectives.

    ``program`` is a ``jit(f).lower(...)``, its ``.compile()``, HLO text (pass
    ``mesh``), or a function to compile with ``args``: a ``Sharded`` (or
    ``jax.jit``) function, or a plain one, then wrapped in ``Sharded(mesh, rules)``.
    With ``exhaustive=True`` the limits list *all* the program may send: a
    collective that no limit selects fails too. The failure names every broken
    limit with what was found, then prints the program's collectives. A mesh
    axis a limit names that the program's mesh lacks is refused (``ValueError``).

    Budgets to start from: ``data_parallel_limits`` and ``megatron_limits``.
    """
    name = getattr(getattr(program, "fn", program), "__name__", "the program")
    if not limits and not exhaustive:
        raise ValueError(
            f"assert_collectives({name}): no limits, so nothing would be checked; give Limits "
            "(data_parallel_limits, megatron_limits), or exhaustive=True for a program that sends nothing"
        )
    known = mesh or _mesh_of(program)  # checked before compiling where the mesh is known already
    if known is not None:
        _check_limits(limits, known)
    compiled = _compiled(program, args, mesh, rules)
    if known is None:
        _check_limits(limits, _mesh_of(compiled))
    found = list(instructions(compiled, mesh))
    broken = []
    for limit in limits:
        selected = [send.result_bytes for send in found if limit.selects(send.kind, send.groups)]
        if (limit.count is not None and len(selected) > limit.count) or (
            limit.bytes is not None and sum(selected) > limit.bytes
        ):
            broken.append(f"  {limit}; found {len(selected)}, {_exact_bytes(sum(selected))}")
    if exhaustive:
        for send in found:
            if not any(limit.selects(send.kind, send.groups) for limit in limits):
                over = ", ".join(map(str, send.groups))
                nbytes = _exact_bytes(send.result_bytes)
                broken.append(f"  {send.kind} over {over} ({nbytes}): no limit allows it")
    table = collectives(compiled, mesh)
    if broken:
        raise AssertionError(
            f"assert_collectives: {name} breaks its communication budget:\n"
            + "\n".join(broken)
            + "\nits collectives:\n  "
            + summary(table).replace("\n", "\n  ")
        )
    return table


def _compiled(
    program: Program | Callable[..., Any], args: Sequence[Any], mesh: Mesh | None, rules: AxisRules | None
) -> jax.stages.Compiled | str:
    if isinstance(program, jax.stages.Compiled | str):
        return program
    if isinstance(program, jax.stages.Lowered):
        return program.compile()  # once, for both readings in assert_collectives
    step: Any = program
    if not hasattr(step, "lower"):
        if mesh is None:
            raise TypeError("assert_collectives: a plain function needs mesh= (and rules=) to compile it")
        step = _sharded(step, mesh, rules, None)
    return step.lower(*args).compile()


def _mesh_of(program: Any) -> AnyMesh | None:
    """The mesh a ``Sharded`` function runs on, or the one a compiled program's shardings name."""
    if isinstance(getattr(program, "config", None), Sharded):
        return program.config.mesh
    return mesh_of(program) if isinstance(program, jax.stages.Compiled) else None


def _check_limits(limits: Sequence[Limit], mesh: AnyMesh | None) -> None:
    """Every mesh axis a limit names must be one of the mesh's, before anything is counted."""
    for limit in limits:
        if limit.over is None:
            continue
        if mesh is None:
            raise TypeError(f"assert_collectives: {limit!r} names mesh axes; pass mesh= to check them")
        _check_mesh_axes(f"assert_collectives: {limit!r}", as_mesh_axes(limit.over), mesh)


def data_parallel_limits(params: Any, *, over: str = "data", scalars: int = 1) -> list[Limit]:
    """The least a data-parallel training step sends: the gradients once, and its scalar outputs.

    Every device holds all of ``params`` and computes gradients on its slice of
    the batch, so one all-reduce over ``over`` must sum ``tree_bytes(params)``
    (XLA may split or fuse it into several instructions, so only bytes are
    bounded), plus 4 bytes for each of ``scalars`` float32 means (a loss).
    Use with ``exhaustive=True``: nothing else is needed.

    >>> import jax
    >>> from minishard import mlp
    >>> print(*data_parallel_limits(mlp([4, 8, 2], key=jax.random.key(0))))
    all-reduce over 'data': at most 236 B per device
    """
    return [Limit("all-reduce", over=over, bytes=tree_bytes(params) + 4 * scalars)]


def megatron_limits(
    activations: Sequence[int], *, pairs: int = 1, over: str = "model", dtype: Any = np.float32
) -> list[Limit]:
    """The least a Megatron MLP's forward pass sends: one all-reduce of its output per pair of Linears.

    In a ``("embed", "mlp")`` then ``("mlp", "embed")`` pair with ``mlp``
    split over ``over``, each device computes a partial sum of the pair's
    output from its slice of the hidden units; one all-reduce over ``over``
    adds them up. ``activations`` is that output's block on one device,
    e.g. ``(batch // mesh.shape["data"], embed)``. Use with ``exhaustive=True``.

    >>> print(*megatron_limits((4, 16)))
    all-reduce over 'model': at most 1, 256 B per device
    """
    nbytes = math.prod(activations) * np.dtype(dtype).itemsize
    return [Limit("all-reduce", over=over, count=pairs, bytes=pairs * nbytes)]


__all__ = ["Limit", "assert_collectives", "data_parallel_limits", "megatron_limits"]
