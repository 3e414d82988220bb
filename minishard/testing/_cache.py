"""One memo for the work a shrinking failure would otherwise repeat hundreds of times."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from minishard.rules import AxisRules

F = TypeVar("F", bound=Callable[..., Any])


def cached(fn: F, maxsize: int = 256) -> F:
    """``fn`` remembered per arguments, ``AxisRules`` compared by value; forgets all at ``maxsize``.

    Rules drawn in two examples are two objects; by value they share one entry.

    >>> calls = []
    >>> spec = cached(lambda rules: calls.append(rules) or rules.spec(("mlp",)))
    >>> spec(AxisRules(mlp="model")), spec(AxisRules(mlp="model")), len(calls)
    (P('model',), P('model',), 1)
    """
    table: dict[tuple[Any, ...], Any] = {}

    @functools.wraps(fn)
    def remembered(*args: Any) -> Any:
        key = tuple((a.pairs, a.ordered) if isinstance(a, AxisRules) else a for a in args)
        if key not in table:
            if len(table) >= maxsize:
                table.clear()
            table[key] = fn(*args)
        return table[key]

    return remembered  # type: ignore[return-value]


__all__ = ["cached"]
