"""What a training run says: a line per record (``format_epoch``), JSON lines, and a progress bar."""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable, Iterator
from typing import IO, Any

from minishard.losses import Batch
from minishard.run.profiling import format_speed

__all__ = ["BOOKKEEPING", "Say", "format_epoch"]


@dataclasses.dataclass
class Say:
    """What a run says: lines through ``log``, JSON lines into ``metrics`` (every ``every`` steps and
    per record), and a progress bar in a terminal (``progress`` None: when stdout is one)."""

    log: Callable[[str], None]
    metrics: IO[str] | None
    every: int
    progress: bool | None

    def json(self, record: dict[str, Any]) -> None:
        if self.metrics:
            self.metrics.write(json.dumps(record) + "\n")

    def bar(self, batches: Iterator[Batch], title: str, total: int, done: int) -> Iterator[Batch]:
        """The batches; with a progress bar when attached to a terminal (rich, if installed)."""
        if not (sys.stdout.isatty() if self.progress is None else self.progress):
            yield from batches
            return
        try:
            from rich.progress import Progress
        except ImportError:
            yield from batches
            return
        with Progress(transient=True) as bar:
            task = bar.add_task(title, total=total, completed=done)
            for batch in batches:
                yield batch
                bar.advance(task)


BOOKKEEPING = ("epoch", "step", "seconds", "trace_seconds", "steps", "loss_curve", "speed")
"""The fields of a ``fit`` record that are not metrics (``trace_seconds``: --profile's, apart)."""


def format_epoch(record: dict[str, Any]) -> str:
    """``Epoch 1 in 2.31 s (20,563 examples/s, MFU 3.1%) · loss 0.412 · train acc 0.951 · test acc 0.948``;
    by steps ``Step 500 in ...``. The speed is the period's steps but a compiling one (``fit``)."""
    line = f"Epoch {record['epoch']}" if "epoch" in record else f"Step {record['step']}"
    line += f" in {record['seconds']:.2f} s" + (
        f" ({format_speed(record['speed'])})" if "speed" in record else ""
    )
    if "trace_seconds" in record:  # --profile's start and flush, not the steps'
        line += f" (+{record['trace_seconds']:.2f} s writing the --profile trace)"
    for name, value in record.items():
        if name not in BOOKKEEPING:
            line += f" · {name.replace('_', ' ')} {value:.3f}"
    return line
