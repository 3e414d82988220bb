"""``fit``'s settings, one object: where a run trains, how long, what it measures, keeps and says.

``fit(model, optimizer, train_data, settings)``: the model, the optimizer and the data are
what is trained; ``FitSettings`` is how, and prints only what a run changed from the defaults,
one setting a line, so a learner reads a run's settings as a list.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from collections.abc import Callable, Mapping
from typing import Any

from jax.sharding import AxisType, Mesh

from minishard.precision import Precision
from minishard.rules import AxisRules
from minishard.run.data import EvalData
from minishard.run.profiling import Profile
from minishard.run.steps import CLASSIFICATION, Task

__all__ = ["EvalSets", "FitSettings"]

EvalSets = EvalData | Mapping[str, EvalData] | None
"""One set to evaluate (its metrics named ``test_*``), or several by name: ``{"val": windows}``."""


@dataclasses.dataclass(frozen=True)
class FitSettings:
    """How ``fit`` trains, one object: print it to see what a run was asked to do.

    Where: ``mesh`` and ``rules``. How long: ``epochs`` (or ``steps`` in all), recorded and
    evaluated every epoch (or ``eval_every`` steps). What it measures: ``task`` (its loss and
    metrics), on each set of ``eval_data`` every period and of ``test_data`` at the end. What it
    keeps: with ``checkpoint_dir``, a checkpoint (and ``info``, JSON) every ``checkpoint_every``
    steps and at each period's end, the last ``keep`` kept; ``resume`` continues from the latest
    good one, ``resume_from`` from that step; another run's checkpoints are refused unless
    ``overwrite``. What it says: ``log`` each line, ``metrics_log`` (JSON lines) every
    ``log_every`` steps, ``progress`` a bar. The step: ``microbatches > 1`` accumulates gradients,
    ``precision`` casts each step (``precision.BF16``); ``make_step(optimizer)`` builds another step
    (``minishard.zero``'s); ``profile`` traces steps; ``seed`` (a model with dropout): each
    step's loss gets the key ``steps.step_key(seed, opt_state)``.

    >>> from minishard import make_mesh
    >>> FitSettings(make_mesh({"data": 8}), epochs=2, log=lambda line: None, keep=3)
    FitSettings(
        mesh=make_mesh({'data': 8}),
        epochs=2,
        log=<lambda>,
    )
    """

    mesh: Mesh
    rules: AxisRules | None = None
    epochs: int | None = None
    steps: int | None = None
    eval_every: int | None = None
    eval_data: EvalSets = None
    test_data: EvalSets = None
    task: Task = CLASSIFICATION
    checkpoint_dir: str | os.PathLike[str] | None = None
    checkpoint_every: int | None = None
    keep: int = 3
    resume: bool = False
    resume_from: int | None = None
    overwrite: bool = False
    info: Mapping[str, Any] | None = None
    log: Callable[[str], None] = print
    metrics_log: str | os.PathLike[str] | None = None
    log_every: int = 100
    progress: bool | None = None
    microbatches: int = 1
    make_step: Callable[[Any], Any] | None = None
    precision: Precision | None = None
    profile: Profile | None = None
    seed: int | None = None

    def __repr__(self) -> str:
        """The settings that differ from the defaults (``keep=3`` is not said), one a line."""
        fields = dataclasses.fields(self)
        changed = [f for f in fields if getattr(self, f.name) != f.default]
        lines = [f"    {f.name}={_said(getattr(self, f.name))}," for f in changed]
        return "\n".join(["FitSettings(", *lines, ")"])


def _said(value: Any) -> str:
    """A setting as a reader wants it: a mesh as ``make_mesh`` of its shape (with
    ``explicit=True`` for an Explicit one), a function by its name, a task by its parts, an object
    that does not print itself (a data set) by its type, a mapping entry by entry; the rest as
    it prints itself."""
    if isinstance(value, Mesh):
        explicit = ", explicit=True" if AxisType.Explicit in value.axis_types else ""
        return f"make_mesh({dict(value.shape)}{explicit})"
    if inspect.isroutine(value):
        return value.__qualname__
    if isinstance(value, Task):
        parts = ", ".join(f"{f.name}={_said(getattr(value, f.name))}" for f in dataclasses.fields(value))
        return f"Task({parts})"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{name!r}: {_said(each)}" for name, each in value.items()) + "}"
    if type(value).__repr__ is object.__repr__:
        return f"<{type(value).__name__}>"
    return repr(value)
