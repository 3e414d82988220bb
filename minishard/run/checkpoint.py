"""Checkpoints: save a sharded training run and resume it, even on another mesh.

minishard lets orbax-checkpoint do the writing; a hand-rolled ``np.save``
gets three things wrong at scale:

* **Sharded writes.** Each device writes its own shards of every ``jax.Array``;
  nothing is gathered onto one host (a large model would not fit there).
* **Atomic finalize.** A checkpoint is written into ``<step>.orbax-checkpoint-tmp/``
  and renamed to ``<step>/`` only when complete. A save killed midway leaves a
  tmp directory that is never listed (and is removed when a ``Checkpointer``
  next opens the directory), so the previous checkpoint stays the latest.
* **Restore onto another mesh.** Arrays are stored whole, not per device; the
  *target* gives each array its sharding, so a run saved on ``data=2 x model=4``
  resumes on ``data=8`` or on one device.

A checkpoint ``<step>/`` holds three items: ``state``, every array of the model
and optimizer state (velocities; a step counter, with a schedule) under its
readable path such as ``model.layers[0].weight``; ``meta``, a JSON dict with
the position in the data (epoch, batch, shuffle seed) and the history; and
``integrity``, a CRC32 of every array, so that a flipped bit on disk is caught
at restore. The pytree structure (Layer classes, a ``None`` velocity or step)
is not stored: it comes from the target.

Three more promises, each checked by a test:

* **Only finite state is saved.** A NaN or an infinity in any array refuses the
  save (``NonFiniteStateError``), so "the last checkpoint" is always a good one.
* **Restoring falls back.** If the latest checkpoint is unreadable (a truncated
  file, a bad checksum, impossible metadata), the ``Checkpointer`` logs why and
  tries the one before. That is why it keeps several (``keep``), not one.
* **One writer per directory.** A ``Checkpointer`` holds an exclusive lock
  (``flock``) on ``<directory>/.minishard.lock`` until it is closed; a second one
  is refused with the holder's pid and host. The kernel drops the lock of a
  killed process, so a stale lock file is simply taken over (and logged).
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import json
import logging
import os
import re
import socket
import sys
import time
import warnings
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from minishard.optim import SGDState
from minishard.tree import named_leaves, path_str


class CheckpointError(RuntimeError):
    """No checkpoint could be saved or loaded; the message names the path(s) and why."""


class NonFiniteStateError(CheckpointError):
    """The state to save holds NaN or infinite values; nothing was written."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint was read, but its contents are not what was saved (checksum, metadata)."""


LOCK_FILE = ".minishard.lock"


class Checkpointer:
    """Save and restore ``(step, state, meta)`` under ``directory/<step>/``, keeping the last ``keep``.

    >>> import tempfile, jax.numpy as jnp
    >>> with tempfile.TemporaryDirectory() as directory, Checkpointer(directory) as ckpt:
    ...     ckpt.save(10, {"w": jnp.ones(3)}, {"epoch": 1})
    ...     step, state, meta = ckpt.restore({"w": jnp.zeros(3)})
    >>> step, state["w"].tolist(), meta
    (10, [1.0, 1.0, 1.0], {'epoch': 1})
    """

    def __init__(
        self, directory: str | os.PathLike[str], *, keep: int = 3, log: Callable[[str], None] = print
    ) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"Checkpointer: keep must be an int >= 1, got {keep!r}")
        self.directory, self.log = Path(directory).absolute(), log
        if self.directory.exists() and not self.directory.is_dir():
            raise CheckpointError(f"checkpoint directory {self.directory} is a file; choose a directory")
        self._lock = _lock(self.directory, log) if jax.process_index() == 0 else None
        options = ocp.CheckpointManagerOptions(
            enable_async_checkpointing=False,  # save() returns only once the rename is done
            preservation_policy=ocp.checkpoint_managers.LatestN(keep),
            cleanup_tmp_directories=True,  # remove what a killed save left behind
        )
        handlers = {
            "state": ocp.StandardCheckpointHandler(),
            "meta": ocp.JsonCheckpointHandler(),
            "integrity": ocp.JsonCheckpointHandler(),
        }
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

    def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
        """Write ``state`` (a pytree of arrays, sharded as they are) and ``meta`` (JSON) as ``step``."""
        try:
            json.dumps(meta)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"checkpoint meta must be JSON-serializable: {e}") from None
        named = _named(state)
        integrity = _integrity(named, step)  # refuses non-finite state before anything is written
        # Checkpoints at or after `step` are from a future the run abandoned when
        # it resumed from an earlier step; orbax would not save behind them.
        if stale := [s for s in self.steps() if s >= step]:
            self.log(f"discarding checkpoints {stale} in {self.directory}: training resumed before them")
            for s in stale:
                self._manager.delete(s)
        items = {
            "state": ocp.args.StandardSave(dict(named)),
            "meta": ocp.args.JsonSave(meta),
            "integrity": ocp.args.JsonSave(integrity),
        }
        try:
            with quiet_storage_noise():
                # force: the caller decides when to save, not orbax's save-interval policy.
                self._manager.save(int(step), args=ocp.args.Composite(**items), force=True)
                self._manager.wait_until_finished()
        except Exception as e:
            previous = [s for s in self.steps() if s < step]
            kept = (
                f"the previous checkpoint (step {previous[-1]}) is intact"
                if previous
                else "no older one exists"
            )
            raise CheckpointError(
                f"could not write the checkpoint of step {step} in {self.directory} "
                f"({_reason(e, self.directory / str(step))}); {kept}"
            ) from None

    def steps(self) -> list[int]:
        """Steps of the finalized checkpoints, ascending (unfinished tmp dirs never count)."""
        self._manager.reload()  # another process may have written since
        return sorted(self._manager.all_steps())

    def restore(
        self, target: Any, step: int | None = None, check_meta: Callable[[dict[str, Any]], None] | None = None
    ) -> tuple[int, Any, dict[str, Any]]:
        """Load ``(step, state, meta)``; ``state`` takes ``target``'s structure and shardings.

        ``target``'s leaves: arrays or ``jax.ShapeDtypeStruct(..., sharding=...)``.
        ``step=None``: the latest readable checkpoint; an explicit step loads or raises.
        ``check_meta`` may raise ``ValueError`` for metadata that cannot be right
        (a position past the end of an epoch): that checkpoint counts as corrupt.
        """
        steps = self.steps()
        if not steps:
            raise CheckpointError(f"{self.directory} holds no checkpoint")
        if step is not None and step not in steps:
            raise CheckpointError(f"{self.directory} has no checkpoint for step {step}; it has {steps}")
        candidates = [step] if step is not None else steps[::-1]
        failures = []
        for i, candidate in enumerate(candidates):
            path = self.directory / str(candidate)
            try:
                with quiet_storage_noise():
                    state, meta = self._load(candidate, target)
            except CorruptCheckpointError as e:
                failures.append(f"checkpoint {path} is corrupt ({e})")
            except CheckpointError:
                raise  # the target does not fit: an older checkpoint would not fit either
            except Exception as e:
                failures.append(f"checkpoint {path} is unreadable ({_reason(e, path)})")
            else:
                try:
                    if check_meta is not None:
                        check_meta(meta)  # other errors (this is another run's checkpoint) propagate
                    return candidate, state, meta
                except (ValueError, KeyError, TypeError) as e:
                    failures.append(f"checkpoint {path} is corrupt (its metadata cannot be right: {e})")
            if i + 1 < len(candidates):
                self.log(f"{failures[-1]}; falling back to step {candidates[i + 1]}")
        header = [f"no checkpoint in {self.directory} could be loaded:"] if len(failures) > 1 else []
        raise CheckpointError("\n  ".join(header + failures)) from None

    def _load(self, step: int, target: Any) -> tuple[Any, dict[str, Any]]:
        named = _named(target)
        # target name -> the name it was saved under; stored step counters the target does not keep
        stored_as, unread = self._check_fits(step, named, _steps_not_kept(target))
        abstract = {
            stored_as[name]: jax.ShapeDtypeStruct(
                leaf.shape, leaf.dtype, sharding=getattr(leaf, "sharding", None)
            )
            for name, leaf in named
        }
        # orbax reads every stored array or none: read the unneeded counters too, replicated.
        abstract |= {name: jax.ShapeDtypeStruct((), np.int32, sharding=_replicated(named)) for name in unread}
        items = {"state": ocp.args.StandardRestore(abstract), "meta": ocp.args.JsonRestore()}
        if (self.directory / str(step) / "integrity").exists():  # older checkpoints have none
            items["integrity"] = ocp.args.JsonRestore()
        restored = self._manager.restore(step, args=ocp.args.Composite(**items))
        if "integrity" in items:
            _verify(restored["state"], restored["integrity"])
        arrays = [restored["state"][stored_as[name]] for name, _ in named]
        # The structure comes from the target, not from the disk.
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(target), arrays), restored["meta"]

    def _check_fits(
        self, step: int, named: list[tuple[str, Any]], droppable: set[str]
    ) -> tuple[dict[str, str], list[str]]:
        """Compare the target's arrays with the stored ones, by name and shape, before reading data.

        A different model (other ``--layers``, momentum on or off) is the user's mistake, not
        corruption: say which arrays differ instead of falling back through every checkpoint.
        Returns, per target name, the name it is stored under (older names are accepted), and
        the stored step counters this run's optimizer does not keep (``droppable``: a schedule's
        run resumed at a constant learning rate, or a checkpoint of an earlier minishard, whose
        constant-rate SGD counted steps it never read).
        """
        try:
            stored = dict(self._manager.item_metadata(step)["state"])
        except Exception:
            stored = None
        if stored is None:  # unreadable metadata: the restore itself reports it, and falls back
            return {name: name for name, _ in named}, []
        stored_as = {name: _older_name(name) if _older_name(name) in stored else name for name, _ in named}
        wanted = {stored_as[name]: _shape_dtype(leaf) for name, leaf in named}
        have = {name: _shape_dtype(meta) for name, meta in stored.items()}
        unread = sorted(name for name in droppable & have.keys() if have[name] == "() int32")
        have = {name: meta for name, meta in have.items() if name not in unread}
        differences = [
            f"{name}: checkpoint {have.get(name, 'has none')}, target {wanted.get(name, 'has none')}"
            for name in sorted(wanted.keys() | have.keys())
            if have.get(name) != wanted.get(name)
        ]
        if differences:
            raise CheckpointError(
                f"checkpoint {self.directory / str(step)} holds other arrays than the state to restore "
                "into (another model, or momentum or a learning-rate schedule switched on or off?):\n  "
                + "\n  ".join(differences[:10])
            )
        if unread:
            self.log(f"not restoring {', '.join(unread)}: this run's optimizer keeps no step counter")
        return stored_as, unread

    def close(self) -> None:
        """Release orbax's resources and the directory's lock (also done by ``with Checkpointer(...)``)."""
        self._manager.close()
        if self._lock is not None:
            self._lock.truncate(0)  # a clean exit leaves no note: nobody is "gone"
            self._lock.close()  # closing the file drops the flock
            self._lock = None

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _shape_dtype(leaf: Any) -> str:
    """``"(16, 32) float32"``: what must match between a stored array and its target."""
    return f"{tuple(leaf.shape)} {np.dtype(leaf.dtype).name}"


def _integrity(named: list[tuple[str, Any]], step: int) -> dict[str, int]:
    """A CRC32 of every array's bytes; and the promise that every float is finite.

    Arrays spread over several processes are not all readable here: they get no checksum.
    """
    checksums = {}
    for name, leaf in named:
        if not getattr(leaf, "is_fully_addressable", True):
            continue
        host = np.asarray(jax.device_get(leaf))
        if np.issubdtype(host.dtype, np.inexact) and not np.isfinite(host).all():
            bad = int(host.size - np.isfinite(host).sum())
            raise NonFiniteStateError(
                f"not saving step {step}: {name} holds {bad} non-finite values (NaN or infinity); "
                "the training diverged. Try a smaller learning rate"
            )
        checksums[name] = zlib.crc32(np.ascontiguousarray(host).tobytes())
    return checksums


def _verify(arrays: dict[str, Any], checksums: dict[str, int]) -> None:
    for name, expected in checksums.items():
        if (
            name in arrays
            and zlib.crc32(np.ascontiguousarray(jax.device_get(arrays[name])).tobytes()) != expected
        ):
            raise CorruptCheckpointError(f"{name} does not match the checksum written with it")


def _lock(directory: Path, log: Callable[[str], None]) -> Any:
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


def _named(tree: Any) -> list[tuple[str, Any]]:
    """``[("model.layers[0].weight", leaf), ...]``: each leaf with the name it is stored under."""
    named = named_leaves(tree)
    if len({name for name, _ in named}) < len(named):  # cannot happen with minishard's paths; checked anyway
        raise CheckpointError(f"two leaves of the state share a name: {sorted(n for n, _ in named)}")
    return named


def _replicated(named: list[tuple[str, Any]]) -> jax.sharding.Sharding:
    """A sharding that puts a whole scalar on the devices the target uses (a mesh, or one device)."""
    for _, leaf in named:
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, jax.sharding.NamedSharding):
            return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
        if sharding is not None:
            return sharding
    return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])


def _steps_not_kept(target: Any) -> set[str]:
    """``X.step`` for every ``SGDState`` ``X`` in the target that keeps no step counter."""
    states, _ = jax.tree_util.tree_flatten_with_path(target, is_leaf=lambda node: isinstance(node, SGDState))
    return {
        path_str((*path, jax.tree_util.GetAttrKey("step")))
        for path, node in states
        if isinstance(node, SGDState) and node.step is None
    }


def _older_name(name: str) -> str:
    """The name an array had in older checkpoints: ``SGDState.velocity`` was called ``momentum``."""
    return re.sub(r"(^|\.)velocity(?=\.|\[|$)", r"\1momentum", name)


def _reason(error: BaseException, checkpoint: Path) -> str:
    """Type and first line of ``error``; of tensorstore's "CODE: Error ...: Error ...: cause"
    chains, the code, the first read and the cause, without the spec dump."""
    line = (str(error).strip().splitlines() or [""])[0].split(" [tensorstore_spec")[0]
    parts = [part for part in line.split(": ") if not part.startswith("Error opening ")]
    line = ": ".join(parts[:2] + parts[-1:] if len(parts) > 3 else parts).replace(f"{checkpoint}/", "")
    return f"{type(error).__name__}: {line[:240]}" if line else type(error).__name__


_ECHO_GRACE_SECONDS = 0.25


@contextlib.contextmanager
def quiet_storage_noise() -> Iterator[None]:
    """Keep tensorstore's echoes of a failed read out of the terminal, for one save or restore.

    orbax stops at the first failed read and closes its event loop; tensorstore's
    other reads then report to the closed loop ("Exception ignored ... Event loop
    is closed") or leave failed tasks unawaited; a failed write is logged by each
    of orbax's writer threads. They repeat a failure already reported. Only
    those messages are dropped, only inside this block, and the previous hook,
    filters and warning settings are restored on the way out.
    """
    previous_hook = sys.unraisablehook
    asyncio_log, absl_log = logging.getLogger("asyncio"), logging.getLogger("absl")

    def quiet_hook(unraisable: Any) -> None:
        closed = isinstance(unraisable.exc_value, RuntimeError) and "loop is closed" in str(
            unraisable.exc_value
        )
        if not closed:
            previous_hook(unraisable)

    sys.unraisablehook = quiet_hook
    asyncio_log.addFilter(_not_an_unawaited_read)
    absl_log.addFilter(_not_a_failed_write_echo)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "coroutine '.*' was never awaited", RuntimeWarning)
            try:
                yield
            except BaseException:
                time.sleep(_ECHO_GRACE_SECONDS)  # a failed read's siblings finish on tensorstore's threads
                raise
            finally:
                gc.collect()  # the unawaited reads are collected (and silenced) here, not later
    finally:
        sys.unraisablehook = previous_hook
        asyncio_log.removeFilter(_not_an_unawaited_read)
        absl_log.removeFilter(_not_a_failed_write_echo)


def _not_a_failed_write_echo(record: logging.LogRecord) -> bool:
    """orbax's writer threads log the failure that ``save`` then raises as a CheckpointError."""
    return "_SignalingThread.run() raised an exception" not in record.getMessage()


def _not_an_unawaited_read(record: logging.LogRecord) -> bool:
    message = record.getMessage()
    return not ("never retrieved" in message and ("orbax" in message or "tensorstore" in message))
