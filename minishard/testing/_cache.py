"""One memo for the work a shrinking failure would otherwise repeat hundreds of times.

Three kinds of work are remembered, each because it was measured to matter
(8 simulated CPU devices, 2 busy cores, the residual MLP of docs/testing.md):

* ``assertions._sharded``: a new ``Sharded(...)(fn)`` jits a new function, so
  every example traced and compiled again: 214 ms per call, 1 ms remembered;
  6 more compiles in test_testing's properties.
* ``builders._builder_arrays`` and ``_abstract_model``: ``jax.eval_shape`` of a
  builder costs 3.5 to 4.5 ms, and a failure shrunk under hypothesis's default
  settings runs the test about 300 times: 29 to 44 s without them, 7 to 23 s with.
* ``builders._abstract_mlp``, the same for ``mlps``: a failing MLP property
  rerun once compiled (21 runs) takes 1.6 s without it, 0.5 s with it.

Remembered by JAX itself: ``pipelines._value_and_grads`` is one module-level
``jax.jit`` with the schedule static, so jit's own cache keeps one program per
schedule and shapes. A new ``jax.jit`` of a fresh closure per call compiled
the pipelined and sequential runs for every example: 2.7 to 3.5 s each on the
8-block stack of tests/test_testing_pipeline.py, 0.01 s once compiled.

Not remembered, measured not to matter: ``jax.jit(fn)`` for the reference run
(JAX keeps the trace and the program per function; a fresh wrapper costs
0.04 ms), and meshes (``meshes`` makes its few once).
"""

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
