"""The checkpoint directory: which steps it holds, whether it can be written, and its one writer.

All three work without orbax's manager: ``saved_steps`` is a plain listing that
never raises (an interrupt handler may call it), ``check_writable`` tries a
probe rather than reading permission bits, and ``hold_lock`` takes the
``flock`` that makes a ``Checkpointer`` the directory's only writer.

>>> saved_steps("/no/such/directory")
[]
"""

from __future__ import annotations

import fcntl
import os
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from minishard.run.errors import CheckpointError

__all__ = ["LOCK_FILE", "check_writable", "hold_lock", "saved_steps"]

LOCK_FILE = ".minishard.lock"


def saved_steps(directory: str | os.PathLike[str] | None) -> list[int]:
    """The finalized steps in ``directory``, ascending; ``[]`` if it is missing or unreadable.

    A plain listing of the ``<step>/`` folders: no orbax, no lock, never an
    exception, so an interrupt handler may call it at any moment.

    >>> saved_steps("/no/such/directory")
    []
    """
    if directory is None:
        return []
    try:
        return sorted(int(p.name) for p in Path(directory).iterdir() if p.name.isdigit() and p.is_dir())
    except OSError:
        return []


def check_writable(directory: str | os.PathLike[str]) -> None:
    """Raise ``CheckpointError`` unless checkpoints can be written in ``directory`` (made if missing).

    Tried, not read off the permission bits (root ignores them; a read-only
    mount does not): a probe folder is made in the directory, or in its nearest
    existing parent, and removed again. Nothing else is created.
    """
    path = Path(directory).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        where = "is a file" if existing == path else f"is inside {existing}, which is a file"
        raise CheckpointError(f"checkpoint directory {path} {where}; choose a directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".minishard-probe-", dir=existing))
        if (path / LOCK_FILE).exists():
            open(path / LOCK_FILE, "a").close()  # opened only to see that it can be
    except OSError as e:
        raise CheckpointError(
            f"checkpoint directory {path} is not writable ({e.strerror or type(e).__name__}); "
            "choose another --checkpoint-dir (a read-only one can still be restored from)"
        ) from None


def hold_lock(directory: Path, log: Callable[[str], None]) -> Any:
    """Hold ``directory/.minishard.lock`` exclusively until closed; say who holds it if we cannot."""
    directory.mkdir(parents=True, exist_ok=True)
    handle = open(directory / LOCK_FILE, "a+")  # noqa: SIM115 -- held until Checkpointer.close
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise CheckpointError(
            f"{directory} is in use by another trainer ({holder}); wait for it to finish, "
            "or give this run its own --checkpoint-dir"
        ) from None
    handle.seek(0)
    if previous := handle.read().strip():  # the kernel dropped a dead holder's lock; its note remains
        log(f"taking over the lock of {directory} left by a trainer that is gone ({previous})")
    handle.seek(0)
    handle.truncate()
    handle.write(
        f"pid {os.getpid()} on host {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}"
    )
    handle.flush()
    return handle
