"""What stops a training run or its checkpoints: each error's message says why, and what was kept.

They are plain classes (nothing optional imported), so the command line can
name all of them, with or without orbax installed. A run stopped from outside,
by Ctrl-C or by a scheduler's SIGTERM (``Terminated``, within ``sigterm_as_interrupt``),
says in one line where it can be resumed from (``stopped``).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

__all__ = [
    "CheckpointDirError",
    "CheckpointError",
    "CheckpointMismatchError",
    "CorruptCheckpointError",
    "NonFiniteLossError",
    "NonFiniteStateError",
    "ResumeError",
    "Terminated",
    "TrainingError",
    "exit_status",
    "sigterm_as_interrupt",
    "stopped",
]


class TrainingError(RuntimeError):
    """Training cannot go on; the message says why and what was kept."""


class NonFiniteLossError(TrainingError):
    """The loss became NaN or infinite; training stopped before saving the bad state."""


class ResumeError(TrainingError):
    """The checkpoint's data position does not fit this run's data (another seed or batch size)."""


class CheckpointDirError(TrainingError):
    """The checkpoint directory cannot serve this run as asked: another run's checkpoints, no such step."""


class CheckpointError(RuntimeError):
    """No checkpoint could be saved or loaded; the message names the path(s) and why."""


class NonFiniteStateError(CheckpointError):
    """The state to save holds NaN or infinite values; nothing was written."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint holds other arrays than the state to restore into: another model, not corruption."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint was read, but its contents are not what was saved (checksum, metadata)."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, what a scheduler sends to preempt a job, raised where Ctrl-C raises
    ``KeyboardInterrupt``: the run stops as Ctrl-C stops it, saying where to resume from, and
    exits 143 (128 + 15), not 130."""


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within it, SIGTERM raises ``Terminated`` in the main thread; the previous handler after.

    Installed before JAX starts its backend, it also keeps XLA's own handler (a C++ stack dump of
    8-21 lines, then death) from being installed. Off the main thread (no handler can be set)
    it does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum: int, frame: FrameType | None) -> None:
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def exit_status(stop: KeyboardInterrupt) -> int:
    """128 + the signal: 143 for SIGTERM (``Terminated``), 130 for Ctrl-C."""
    return 128 + (signal.SIGTERM if isinstance(stop, Terminated) else signal.SIGINT)


def stopped(stop: KeyboardInterrupt, directory: str | None) -> str:
    """``"terminated (SIGTERM); the latest checkpoint is step 300 in runs/x: continue with
    --resume"``.

    Read from the directory listing: the stop may come before it exists (the data load, the
    compile).
    """
    said = "terminated (SIGTERM)" if isinstance(stop, Terminated) else "interrupted"
    if not directory:
        return said
    try:
        steps = sorted(int(p.name) for p in Path(directory).iterdir() if p.name.isdigit())
    except OSError:  # not created yet (or unreadable): nothing was written there
        steps = []
    if not steps:
        return f"{said}: no checkpoint was written in {directory}"
    latest = f"the latest checkpoint is step {steps[-1]} in {directory}"
    return f"{said}; {latest}: continue with --resume"
