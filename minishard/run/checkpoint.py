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
``integrity``, one file per process with a CRC32 of every block of every array
that process wrote (its shards, keyed by where they sit in the array), so that
a flipped bit on disk is caught at restore, on any mesh and any number of
processes. The pytree structure (Layer classes, a ``None`` velocity or step)
is not stored: it comes from the target.

Three more promises, each checked by a test:

* **Only finite state is saved.** A NaN or an infinity in any array refuses the
  save (``NonFiniteStateError``), so every checkpoint holds finite numbers. (Finite
  is not good: a diverging run's newest ones may already be climbing, which is why
  the error names every kept step and ``restore(step=...)`` can go back to any.)
* **Restoring falls back.** If the latest checkpoint is unreadable (a truncated
  file, a bad checksum, impossible metadata), the ``Checkpointer`` logs why and
  tries the one before. That is why it keeps several (``keep``), not one.
* **One writer per directory.** A ``Checkpointer`` holds an exclusive lock
  (``flock``) on ``<directory>/.minishard.lock`` until it is closed; a second one
  is refused with the holder's pid and host. The kernel drops the lock of a
  killed process, so a stale lock file is simply taken over (and logged).
  Reading needs no lock: ``Checkpointer(directory, read_only=True)`` restores
  from read-only storage, and never writes or deletes anything.

Checkpoints of older minishard versions still load: the section *Migrations*
lists every rename, dropped array and older checksum record, one function each.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import json
import logging
import math
import os
import re
import socket
import sys
import tempfile
import time
import warnings
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from minishard.optim import SGDState
from minishard.tree import named_leaves, path_str

__all__ = [
    "LOCK_FILE",
    "CheckpointError",
    "Checkpointer",
    "CorruptCheckpointError",
    "NonFiniteStateError",
    "check_writable",
    "quiet_storage_noise",
    "saved_steps",
]


class CheckpointError(RuntimeError):
    """No checkpoint could be saved or loaded; the message names the path(s) and why."""


class NonFiniteStateError(CheckpointError):
    """The state to save holds NaN or infinite values; nothing was written."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint was read, but its contents are not what was saved (checksum, metadata)."""


LOCK_FILE = ".minishard.lock"
INTEGRITY = "integrity"
"""The item holding the checksums: one JSON file per process, ``process_<i>``."""


class Checkpointer:
    """Save and restore ``(step, state, meta)`` under ``directory/<step>/``, keeping the last ``keep``.

    Retention is simply the newest ``keep`` steps. When a run diverges, the
    newest finite steps may already be on their way up; rather than guess which
    ones are "good" from the loss (a loss also rises at a warmup's end or after
    a learning-rate restart), the ``keep`` steps are kept and named in the
    error, and ``restore(step=...)`` (``--resume-from``) goes back to any of them.

    ``read_only=True`` opens an existing directory to restore from, without a
    lock and without writing anything: read-only storage, or a run still going.

    >>> import tempfile, jax.numpy as jnp
    >>> with tempfile.TemporaryDirectory() as directory, Checkpointer(directory) as ckpt:
    ...     ckpt.save(10, {"w": jnp.ones(3)}, {"epoch": 1})
    ...     step, state, meta = ckpt.restore({"w": jnp.zeros(3)})
    >>> step, state["w"].tolist(), meta
    (10, [1.0, 1.0, 1.0], {'epoch': 1})
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        keep: int = 3,
        log: Callable[[str], None] = print,
        read_only: bool = False,
    ) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"Checkpointer: keep must be an int >= 1, got {keep!r}")
        self.directory, self.log, self.read_only = Path(directory).absolute(), log, read_only
        self._said: set[str] = set()
        if self.directory.exists() and not self.directory.is_dir():
            raise CheckpointError(f"checkpoint directory {self.directory} is a file; choose a directory")
        if read_only and not self.directory.is_dir():
            raise CheckpointError(f"checkpoint directory {self.directory} does not exist")
        if not read_only:
            check_writable(self.directory)
        self._lock = _lock(self.directory, log) if jax.process_index() == 0 and not read_only else None
        options = ocp.CheckpointManagerOptions(
            enable_async_checkpointing=False,  # save() returns only once the rename is done
            preservation_policy=ocp.checkpoint_managers.LatestN(keep),
            cleanup_tmp_directories=not read_only,  # remove what a killed save left behind
            read_only=read_only,
            create=not read_only,
        )
        every_process = ocp.options.MultiprocessingOptions(primary_host=None)  # not only process 0
        handlers = {
            "state": ocp.StandardCheckpointHandler(),
            "meta": ocp.JsonCheckpointHandler(),
            INTEGRITY: ocp.JsonCheckpointHandler(
                f"process_{jax.process_index()}", multiprocessing_options=every_process
            ),
        }
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

    def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
        """Write ``state`` (a pytree of arrays, sharded as they are) and ``meta`` (JSON) as ``step``."""
        if self.read_only:
            raise CheckpointError(f"{self.directory} is open read-only: step {step} cannot be saved")
        try:
            json.dumps(meta)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"checkpoint meta must be JSON-serializable: {e}") from None
        named = _named(state)
        integrity = _integrity(named, step)  # refuses non-finite state before anything is written
        # Checkpoints at or after `step` are from a future the run abandoned when it resumed from
        # an earlier step (orbax would not save behind them). A fresh run never gets here with
        # another run's checkpoints: train.check_checkpoint_dir refuses those first.
        if stale := [s for s in self.steps() if s >= step]:
            self.delete(stale, f"this run resumed before them and now saves step {step}")
        items = {
            "state": ocp.args.StandardSave(dict(named)),
            "meta": ocp.args.JsonSave(meta),
            INTEGRITY: ocp.args.JsonSave(integrity),
        }
        try:
            with quiet_storage_noise(self._once):
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

    def delete(self, steps: list[int], why: str) -> None:
        """Delete the checkpoints of ``steps``, saying so in one line that ends with ``why``."""
        if self.read_only:
            raise CheckpointError(f"{self.directory} is open read-only: steps {steps} cannot be deleted")
        self.log(f"discarding checkpoints {steps} in {self.directory}: {why}")
        for step in steps:
            self._manager.delete(step)

    def steps(self) -> list[int]:
        """Steps of the finalized checkpoints, ascending (unfinished tmp dirs never count)."""
        with quiet_storage_noise(self._once):
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
                with quiet_storage_noise(self._once):
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
        restored = self._manager.restore(step, args=ocp.args.Composite(**items))
        if unchecked := _verify(restored["state"], _read_integrity(self.directory / str(step))):
            self.log(f"checkpoint {step}: no process holds a whole saved block of {', '.join(unchecked)}, "
                     "so their checksums were not checked")  # fmt: skip
        arrays = [restored["state"][stored_as[name]] for name, _ in named]
        # The structure comes from the target, not from the disk.
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(target), arrays), restored["meta"]

    def _check_fits(
        self, step: int, named: list[tuple[str, Any]], droppable: set[str]
    ) -> tuple[dict[str, str], list[str]]:
        """Compare the target's arrays with the stored ones, by name and shape, before reading data.

        A different model (other ``--layers``, momentum on or off) is the user's mistake, not
        corruption: say which arrays differ instead of falling back through every checkpoint.
        Returns, per target name, the name it is stored under (see *Migrations*), and the stored
        step counters this run's optimizer does not keep (``droppable``).
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

    def _once(self, line: str) -> None:
        """Log ``line`` unless it was said before (orbax reads a damaged file at every listing)."""
        if line not in self._said:
            self._said.add(line)
            self.log(line)

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


def _shape_dtype(leaf: Any) -> str:
    """``"(16, 32) float32"``: what must match between a stored array and its target."""
    return f"{tuple(leaf.shape)} {np.dtype(leaf.dtype).name}"


# -- integrity: a CRC32 per block, written by the process that writes the block ----------------------
def _integrity(named: list[tuple[str, Any]], step: int) -> dict[str, dict[str, int]]:
    """A CRC32 of every block this process writes, keyed by its place (``"0:392,0:32"``); and the
    promise that every float is finite, which all processes agree on before anyone writes.

    The blocks are this process's shards with ``replica_id == 0``: every block of an array has
    exactly one such shard in the whole run, so the processes' records together cover it once.
    """
    checksums, non_finite = {}, []
    for name, leaf in named:
        blocks = _blocks_written_here(leaf)
        checksums[name] = {key: zlib.crc32(np.ascontiguousarray(block).tobytes()) for key, block in blocks}
        non_finite.append(sum(_count_non_finite(block) for _, block in blocks))
    totals = _across_processes(np.asarray(non_finite, np.int32)).sum(axis=0)  # the same in every process
    for (name, _), bad in zip(named, totals):
        if bad:
            raise NonFiniteStateError(
                f"not saving step {step}: {name} holds {bad} non-finite values (NaN or infinity); "
                "the training diverged. Try a smaller learning rate"
            )
    return checksums


def _blocks_written_here(leaf: Any) -> list[tuple[str, np.ndarray]]:
    if isinstance(leaf, jax.Array):
        shards = [shard for shard in leaf.addressable_shards if shard.replica_id == 0]
        return [(_block_key(_bounds(shard.index, leaf.shape)), np.asarray(shard.data)) for shard in shards]
    host = np.asarray(leaf)  # a numpy array or a number: every process has it, process 0 writes it
    return [(_block_key(_bounds((), host.shape)), host)] if jax.process_index() == 0 else []


def _count_non_finite(block: np.ndarray) -> int:
    return int(block.size - np.isfinite(block).sum()) if np.issubdtype(block.dtype, np.inexact) else 0


def _verify(arrays: dict[str, Any], records: dict[str, Any]) -> list[str]:
    """Check every recorded block that some process holds whole; raise on a mismatch.

    Each process checks the blocks it can assemble from its own shards of the
    restored arrays (all of them, with one process); the processes then agree
    on the outcome, so they fall back together. Returns the arrays of blocks
    that no process could check (possible only on unusual meshes).
    """
    if records and all(isinstance(blocks, dict) for blocks in records.values()):
        _check_coverage(arrays, records)  # (the older one-CRC-per-array records skipped some arrays)
    records = {
        name: _whole_array_checksum(records[name], arrays[name].shape)
        for name in records.keys() & arrays.keys()
    }
    checks = [(name, key, crc) for name in sorted(records) for key, crc in sorted(records[name].items())]
    outcome = np.asarray([_check_block(arrays[name], key, crc) for name, key, crc in checks], np.int8)
    outcome = _across_processes(outcome).max(axis=0) if checks else outcome
    if bad := [(name, key) for (name, key, _), result in zip(checks, outcome) if result == _MISMATCH]:
        name, key = bad[0]
        block = f" (block [{key}])" if sum(check[0] == name for check in checks) > 1 else ""
        raise CorruptCheckpointError(f"{name}{block} does not match the checksum written with it")
    return sorted({name for (name, _, _), result in zip(checks, outcome) if result == _NOT_HERE})


_NOT_HERE, _MATCH, _MISMATCH = 0, 1, 2


def _check_coverage(arrays: dict[str, Any], records: dict[str, dict[str, int]]) -> None:
    """The blocks recorded for each array add up to the whole array: no process's record is missing."""
    for name in sorted(arrays):
        blocks = [_parse_block_key(key) for key in records.get(name, {})]
        covered = sum(math.prod(stop - start for start, stop in bounds) for bounds in blocks)
        if covered != math.prod(arrays[name].shape):
            raise CorruptCheckpointError(
                f"the checksums of {name} cover {covered} of its {math.prod(arrays[name].shape)} values "
                "(a process's record is missing or cut)"
            )


def _check_block(array: Any, key: str, crc: int) -> int:
    block = _read_block(array, _parse_block_key(key))
    if block is None:
        return _NOT_HERE
    return _MATCH if zlib.crc32(np.ascontiguousarray(block).tobytes()) == crc else _MISMATCH


def _read_block(array: Any, bounds: list[tuple[int, int]]) -> np.ndarray | None:
    """The block ``bounds`` of ``array``, pieced together from this process's shards; None if some
    of it lives only on other processes."""
    region = tuple(slice(start, stop) for start, stop in bounds)
    if not isinstance(array, jax.Array) or array.is_fully_addressable:
        return np.asarray(array)[region]  # jax caches the host copy: one transfer per array
    block = np.empty([stop - start for start, stop in bounds], array.dtype)
    covered = np.zeros(block.shape, bool)
    for shard in array.addressable_shards:
        have = _bounds(shard.index, array.shape)
        overlap = [(max(a, c), min(b, d)) for (a, b), (c, d) in zip(bounds, have)]
        if any(lo >= hi for lo, hi in overlap):
            continue
        into = tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(overlap, bounds))
        block[into] = np.asarray(shard.data)[
            tuple(slice(lo - c, hi - c) for (lo, hi), (c, _) in zip(overlap, have))
        ]
        covered[into] = True
    return block if covered.all() else None


def _bounds(index: tuple[slice, ...], shape: tuple[int, ...]) -> list[tuple[int, int]]:
    """``(slice(None), slice(8, 16))`` of a ``(4, 32)`` array -> ``[(0, 4), (8, 16)]``."""
    return [part.indices(size)[:2] for part, size in zip(index, shape)] + [
        (0, size) for size in shape[len(index) :]
    ]


def _block_key(bounds: list[tuple[int, int]]) -> str:
    return ",".join(f"{start}:{stop}" for start, stop in bounds)


def _parse_block_key(key: str) -> list[tuple[int, int]]:
    return (
        [(int(start), int(stop)) for start, stop in (part.split(":") for part in key.split(","))]
        if key
        else []
    )


def _across_processes(values: np.ndarray) -> np.ndarray:
    """``values`` of every process, stacked (a collective: every process must call it alike)."""
    if jax.process_count() == 1:
        return values[None]
    return np.asarray(multihost_utils.process_allgather(values))


def _read_integrity(step_dir: Path) -> dict[str, Any]:
    """The checksums of every process's record, merged: ``{name: {block: crc}}``."""
    folder = step_dir / INTEGRITY
    records: dict[str, Any] = {}
    files = sorted(folder.glob("process_*")) + [folder / "metadata"] * (folder / "metadata").exists()
    if folder.is_dir() and not files:  # (checkpoints older than checksums have no folder at all)
        raise CorruptCheckpointError(f"its checksum records are missing from {INTEGRITY}/")
    for file in files:
        try:
            record = json.loads(file.read_text())
        except (OSError, ValueError) as e:
            raise CorruptCheckpointError(
                f"its checksum record {INTEGRITY}/{file.name} is unreadable: {e}"
            ) from None
        for name, blocks in record.items():
            records[name] = {**records.get(name, {}), **blocks} if isinstance(blocks, dict) else blocks
    return records


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


# -- Migrations: what checkpoints of older minishard versions stored differently -------------------
# Each function below maps one old layout onto the current one; restore applies all of them.


def _older_name(name: str) -> str:
    """minishard 0.1 stored ``SGDState.velocity`` as ``momentum``: the name to look for instead."""
    return re.sub(r"(^|\.)velocity(?=\.|\[|$)", r"\1momentum", name)


def _steps_not_kept(target: Any) -> set[str]:
    """``X.step`` for every ``SGDState`` ``X`` in the target that keeps no step counter.

    A stored counter there is dropped (with a log line), not refused: earlier minishard versions
    kept a counter even for a constant learning rate, and a schedule's run may resume at a
    constant rate.
    """
    states, _ = jax.tree_util.tree_flatten_with_path(target, is_leaf=lambda node: isinstance(node, SGDState))
    return {
        path_str((*path, jax.tree_util.GetAttrKey("step")))
        for path, node in states
        if isinstance(node, SGDState) and node.step is None
    }


def _whole_array_checksum(blocks: dict[str, int] | int, shape: tuple[int, ...]) -> dict[str, int]:
    """Checkpoints before per-block checksums stored one CRC per whole array (``integrity/metadata``,
    one process only): that is the CRC of the one block that spans the array."""
    return {_block_key([(0, size) for size in shape]): blocks} if isinstance(blocks, int) else blocks


def _reason(error: BaseException, checkpoint: Path) -> str:
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
    line through ``log``. Only those messages are dropped, only inside this
    block; the previous hook, filters and warning settings are restored on the way out.
    """
    previous_hook = sys.unraisablehook
    asyncio_log, absl_log = logging.getLogger("asyncio"), logging.getLogger("absl")
    damaged: dict[str, str] = {}  # file -> why, said once each

    def quiet_hook(unraisable: Any) -> None:
        if not _an_echo(unraisable):
            previous_hook(unraisable)

    def not_an_echo(record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if found := re.match(r"Failed to json parse \w+ file: (\S+?), file content", message):
            damaged.setdefault(found[1], message.rsplit("error: ", 1)[-1])
            return False
        return "_SignalingThread.run() raised an exception" not in message

    sys.unraisablehook = quiet_hook
    asyncio_log.addFilter(_not_an_unawaited_read)
    absl_log.addFilter(not_an_echo)
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
        absl_log.removeFilter(not_an_echo)
        for file, why in damaged.items():
            log(f"{file} is damaged (not JSON: {why}); orbax only describes the checkpoint with it")


def _an_echo(unraisable: Any) -> bool:
    """An event loop closed under a pending read, or a read of orbax's that failed unawaited."""
    if isinstance(unraisable.exc_value, RuntimeError) and "loop is closed" in str(unraisable.exc_value):
        return True
    code = getattr(unraisable.object, "cr_code", None)  # a coroutine that raised with nobody awaiting
    return code is not None and "orbax" in code.co_filename


def _not_an_unawaited_read(record: logging.LogRecord) -> bool:
    message = record.getMessage()
    return not ("never retrieved" in message and ("orbax" in message or "tensorstore" in message))
