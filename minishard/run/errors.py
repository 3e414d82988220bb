"""What stops a training run or its checkpoints: each error's message says why, and what was kept.

They are plain classes (nothing optional imported), so the command line can
name all of them, with or without orbax installed.
"""

from __future__ import annotations

__all__ = [
    "CheckpointDirError",
    "CheckpointError",
    "CheckpointMismatchError",
    "CorruptCheckpointError",
    "NonFiniteLossError",
    "NonFiniteStateError",
    "ResumeError",
    "TrainingError",
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
