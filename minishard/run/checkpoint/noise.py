"""Storage noise: orbax's and tensorstore's echoes of one failure, kept out of the terminal.

A failed read or write is reported once, by the ``Checkpointer``, in one line
(``reason``); what the libraries print about it besides is dropped here, and
only that, only inside ``quiet_storage_noise``.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import re
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

__all__ = ["quiet_orphaned_echoes", "quiet_storage_noise", "reason"]


def reason(error: BaseException, checkpoint: Path) -> str:
    """Type and first line of ``error``; of tensorstore's "CODE: Error ...: Error ...: cause"
    chains, the code, the first read and the cause, without the spec dumps."""
    line = (str(error).strip().splitlines() or [""])[0].split(" [tensorstore_spec")[0]
    line = line.split(" See full TensorStore details")[0]  # then a spec dump, over many lines
    parts = [part for part in line.split(": ") if not part.startswith("Error opening ")]
    line = ": ".join(parts[:2] + parts[-1:] if len(parts) > 3 else parts).replace(f"{checkpoint}/", "")
    return f"{type(error).__name__}: {line[:240]}" if line else type(error).__name__


_ECHO_GRACE_SECONDS = 0.25


@contextlib.contextmanager
def quiet_storage_noise(log: Callable[[str], None] = print) -> Iterator[None]:
    """Keep orbax's and tensorstore's echoes of a failure out of the terminal, for one save or restore.

    orbax stops at the first failed read and closes its event loop; tensorstore's
    other reads then report to the closed loop ("Exception ignored ... Event loop
    is closed", a TensorStore spec dump) or leave failed tasks unawaited; a failed
    write is logged by each of orbax's writer threads. They repeat a failure the
    caller reports in one line. A damaged JSON file orbax only describes the
    checkpoint with (``Failed to json parse``, logged at every read) becomes one
    line through ``log``. Opening a directory read-only, orbax warns that it is.
    Only those messages are dropped, only inside this
    block; the previous hook, filters and warning settings are restored on the way out.
    """
    asyncio_log, absl_log = logging.getLogger("asyncio"), logging.getLogger("absl")
    absl_echoes = _AbslEchoes()
    asyncio_log.addFilter(_not_an_unawaited_read)
    absl_log.addFilter(absl_echoes)
    try:
        with _quiet_unraisable(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", "coroutine '.*' was never awaited", RuntimeWarning)
            try:
                yield
            except BaseException:
                time.sleep(_ECHO_GRACE_SECONDS)  # a failed read's siblings finish on tensorstore's threads
                # Its unawaited reads are collected (and silenced) here, not later. Only on a failure:
                # a full collection of a trainer's heap took about 1 s per save (measured, issue 28).
                gc.collect()
                raise
    finally:
        asyncio_log.removeFilter(_not_an_unawaited_read)
        absl_log.removeFilter(absl_echoes)
        for file, why in absl_echoes.damaged.items():
            log(f"{file} is damaged (not JSON: {why}); orbax only describes the checkpoint with it")


class _AbslEchoes(logging.Filter):
    """Drops absl's echoes of a failure; a damaged JSON file (``Failed to json parse``) is kept, once."""

    def __init__(self) -> None:
        super().__init__()
        self.damaged: dict[str, str] = {}  # file -> why

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if found := re.match(r"Failed to json parse \w+ file: (\S+?), file content", message):
            self.damaged.setdefault(found[1], message.rsplit("error: ", 1)[-1])
            return False
        if any(echo in message for echo in _READ_ONLY_ECHOES):  # what read_only=True asked for
            return False
        if "Metadata file does not exist" in message:  # an empty step: the restore says so, in one line
            return False
        return "_SignalingThread.run() raised an exception" not in message


_READ_ONLY_ECHOES = ("read_only=True, setting save_interval_steps=0", "Given directory is read only")


@contextlib.contextmanager
def _quiet_unraisable() -> Iterator[None]:
    """Inside the block, the unraisable exceptions that are echoes (``_an_echo``) are dropped."""
    previous = sys.unraisablehook

    def quiet_hook(unraisable: Any) -> None:
        if not _an_echo(unraisable):
            previous(unraisable)

    sys.unraisablehook = quiet_hook
    try:
        yield
    finally:
        sys.unraisablehook = previous


def _an_echo(unraisable: Any) -> bool:
    """An event loop closed under a pending read, or a read of orbax's that failed unawaited."""
    if isinstance(unraisable.exc_value, RuntimeError) and "loop is closed" in str(unraisable.exc_value):
        return True
    code = getattr(unraisable.object, "cr_code", None)  # a coroutine that raised with nobody awaiting
    return code is not None and "orbax" in code.co_filename


def _not_an_unawaited_read(record: logging.LogRecord) -> bool:
    """Not a read or write of orbax's (or tensorstore's) that failed with nobody awaiting it."""
    message = record.getMessage()
    return not ("never retrieved" in message and _from_storage(message, record.exc_info))


def _from_storage(message: str, exc_info: Any) -> bool:
    """The message names orbax or tensorstore, or its exception was raised inside them (a full disk:
    ``OSError(28)`` from orbax's ``async_path``)."""
    frames = traceback.extract_tb(exc_info[2]) if exc_info and exc_info[2] is not None else []
    texts = [message, *(frame.filename for frame in frames)]
    return any(name in text for name in ("orbax", "tensorstore") for text in texts)


def quiet_orphaned_echoes() -> None:
    """For the rest of the process: after a command has said in one line what failed, orbax's futures
    that failed unawaited with it are reported by asyncio only when collected, at exit (``Future
    exception was never retrieved`` and a traceback, on a full disk): drop those, and only those."""
    log = logging.getLogger("asyncio")
    if _orphaned_echo not in log.filters:
        log.addFilter(_orphaned_echo)


def _orphaned_echo(record: logging.LogRecord) -> bool:
    """``_not_an_unawaited_read``, as the filter ``quiet_orphaned_echoes`` leaves in place."""
    return _not_an_unawaited_read(record)
