"""How long a run trains, and when it stops to record: a ``Horizon`` of steps, in periods.

By epochs (MNIST), a period is an epoch: a record is numbered by its epoch,
and a checkpoint says which epoch and batch come next. By steps (a language
model's random windows, which have no epochs), a period is ``eval_every``
steps and a record is numbered by its last step. Either way the position in
training is one number, the step, because every step's batch is a pure
function of it (``minishard.run.data.TrainingData``).

>>> Horizon.of(epochs=2, steps=None, eval_every=None, data=type("Data", (), {"steps_per_epoch": 4}))
ByEpochs(total=8, period=4)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import Any

__all__ = ["BySteps", "ByEpochs", "Horizon", "check_counts"]


def check_counts(**settings: int | None) -> None:
    """Each setting an int >= 1 (``checkpoint_every`` may be None: only at the periods' ends)."""
    for name, value in settings.items():
        if value is None and name == "checkpoint_every":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"fit: {name} must be an int >= 1, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Horizon:
    """How long ``fit`` trains: ``total`` steps, recorded every ``period`` (an epoch, or ``eval_every``).

    ``ByEpochs`` and ``BySteps`` say the rest: what a record is numbered by,
    and what a checkpoint keeps of the position besides its step.

    >>> list(BySteps(total=10, period=4).periods(step=5, since=4))   # resumed at step 5
    [(4, 8), (8, 10)]
    """

    total: int
    period: int

    @staticmethod
    def of(epochs: int | None, steps: int | None, eval_every: int | None, data: Any) -> Horizon:
        """``fit``'s ``epochs`` (of ``data``) or ``steps`` (and ``eval_every``), checked."""
        if (epochs is None) == (steps is None):
            raise ValueError(f"fit: give epochs or steps, one of them; got epochs={epochs}, steps={steps}")
        given = {"epochs": epochs, "steps": steps, "eval_every": eval_every}
        check_counts(**{name: value for name, value in given.items() if value is not None})
        if steps is not None:
            return BySteps(steps, eval_every or steps)
        if eval_every is not None:
            raise ValueError("fit: eval_every is for training by steps; by epochs, each epoch is evaluated")
        if data.steps_per_epoch is None:
            raise ValueError("fit: this data has no epochs (each step draws its own batch); give steps")
        return ByEpochs(epochs * data.steps_per_epoch, data.steps_per_epoch)

    def periods(self, step: int, since: int) -> Iterator[tuple[int, int]]:
        """``(start, stop)`` of the period begun at ``since`` that holds ``step``, then of each later one."""
        start, stop = since, min((step // self.period + 1) * self.period, self.total)
        while start < self.total:
            yield start, stop
            start, stop = stop, min(stop + self.period, self.total)

    def label(self, stop: int) -> dict[str, int]:
        """What the record of the period that ends at ``stop`` is numbered by."""
        raise NotImplementedError

    def epoch_of(self, step: int) -> dict[str, int]:
        """``{"epoch": 2}``: the epoch of the ``step``-th step, where there are epochs."""
        return {}

    def position(self, step: int, since: int) -> dict[str, int]:
        """What a checkpoint of ``step`` keeps to go on from: its periods' sums began at ``since``."""
        raise NotImplementedError

    def since(self, meta: dict[str, Any], step: int) -> int:
        """Where the sums of ``meta``, a checkpoint of ``step``, began; ValueError if that cannot be right."""
        raise NotImplementedError

    def where(self, step: int) -> str:
        """Where the ``step``-th step's batch was, for a message (nothing by steps)."""
        return ""

    def title(self, start: int, stop: int) -> str:
        """The progress bar's name for the period ``start .. stop - 1``."""
        return f"steps {start + 1}-{stop}"

    def resumed(self, step: int) -> str:
        return f"Resumed from step {step}"

    def finished(self, step: int) -> str:
        return (
            f"Nothing to do: the checkpoint of step {step} has trained {step} steps, and "
            f"steps={self.total}. Ask for more steps to train on."
        )


class ByEpochs(Horizon):
    """A period is an epoch of ``period`` steps; a checkpoint says which epoch and batch come next."""

    def label(self, stop: int) -> dict[str, int]:
        return self.epoch_of(stop)

    def epoch_of(self, step: int) -> dict[str, int]:
        return {"epoch": math.ceil(step / self.period)}

    def position(self, step: int, since: int) -> dict[str, int]:
        epoch, batch = divmod(step, self.period)
        return {"epoch": epoch, "batch": batch}

    def since(self, meta: dict[str, Any], step: int) -> int:
        for name in ("epoch", "batch"):
            if not isinstance(meta.get(name), int):
                raise ValueError(f"field {name!r} is {meta.get(name)!r}, not a int")
        if meta["epoch"] < 0 or not 0 <= meta["batch"] < self.period:
            raise ValueError(f"position epoch {meta['epoch']}, batch {meta['batch']} of {self.period}")
        return step - step % self.period

    def where(self, step: int) -> str:
        epoch, batch = divmod(step - 1, self.period)
        return f" (epoch {epoch + 1}, batch {batch})"

    def title(self, start: int, stop: int) -> str:
        return f"epoch {start // self.period + 1}"

    def resumed(self, step: int) -> str:
        epoch, batch = divmod(step, self.period)
        return f"Resumed from step {step}: epoch {epoch + 1}, batch {batch}"

    def finished(self, step: int) -> str:
        return (
            f"Nothing to do: the checkpoint of step {step} has finished epoch {step // self.period}, "
            f"and epochs={self.total // self.period}. Ask for more epochs to train on."
        )


class BySteps(Horizon):
    """A period is ``eval_every`` steps (the last may be shorter); a record is numbered by its last step.

    A checkpoint keeps the step its sums began at (``since``): a run that ended at
    step 6 and resumes to 10 with ``eval_every=4`` measures steps 7-8, then 9-10.
    """

    def label(self, stop: int) -> dict[str, int]:
        return {"step": stop}

    def position(self, step: int, since: int) -> dict[str, int]:
        return {"since": since}

    def since(self, meta: dict[str, Any], step: int) -> int:
        if not isinstance(since := meta.get("since"), int) or not 0 <= since <= step:
            raise ValueError(f"field 'since' is {since!r}, not a step from 0 to {step}")
        return since
