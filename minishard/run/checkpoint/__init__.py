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
and optimizer state (velocities, a step counter) under its
readable path such as ``model.layers[0].weight``; ``meta``, a JSON dict with
the position in the data (epoch, batch, shuffle seed) and the history; and
``integrity``, one file per process with a CRC32 of every block of every array
that process wrote (its shards, keyed by where they sit in the array), and in
process 0's a CRC32 of ``meta``, so that a flipped bit on disk (in an array or in
the metadata) is caught at restore, on any mesh and any number of processes.
The pytree structure (Layer classes, a ``None`` velocity or step) is not
stored: it comes from the target.

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

Checkpoints of older minishard versions still load: ``migrations`` lists every
rename and dropped array, ``integrity`` the older checksum records, one function each.

The package's modules, each one seam: ``directory`` (the listing, the probe
for writability, the lock), ``integrity`` (the checksums), ``migrations``, and
``noise`` (orbax's and tensorstore's echoes of a failure, kept out of sight).
"""

from __future__ import annotations

import ast
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from minishard.run.checkpoint.directory import LOCK_FILE, check_writable, hold_lock, saved_steps
from minishard.run.checkpoint.integrity import (
    INTEGRITY,
    checksums,
    meta_checksum,
    read_records,
    verify,
    verify_meta,
)
from minishard.run.checkpoint.migrations import older_names, sgd_steps
from minishard.run.checkpoint.noise import quiet_orphaned_echoes, quiet_storage_noise, reason
from minishard.run.errors import CheckpointError, CheckpointMismatchError, CorruptCheckpointError
from minishard.tree import named_leaves

__all__ = ["LOCK_FILE", "Checkpointer", "check_writable", "saved_steps"]


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
        self._lock = hold_lock(self.directory, log) if jax.process_index() == 0 and not read_only else None
        every_process = ocp.options.MultiprocessingOptions(primary_host=None)  # not only process 0
        handlers = {
            "state": ocp.StandardCheckpointHandler(),
            "meta": ocp.JsonCheckpointHandler(),
            INTEGRITY: ocp.JsonCheckpointHandler(
                f"process_{jax.process_index()}", multiprocessing_options=every_process
            ),
        }
        # orbax warns (twice) when read-only, and reads every step's metadata: a damaged one is one line
        with quiet_storage_noise(self._once):
            options = ocp.CheckpointManagerOptions(
                enable_async_checkpointing=False,  # save() returns only once the rename is done
                preservation_policy=ocp.checkpoint_managers.LatestN(keep),
                cleanup_tmp_directories=not read_only,  # remove what a killed save left behind
                read_only=read_only,
                create=not read_only,
            )
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
        integrity = checksums(named, step) | meta_checksum(meta)  # non-finite state: refused, nothing written
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
            quiet_orphaned_echoes()  # this error says it: not orbax's orphaned futures again, at exit
            previous = [s for s in self.steps() if s < step]
            kept = (
                f"the previous checkpoint (step {previous[-1]}) is intact"
                if previous
                else "no older one exists"
            )
            raise CheckpointError(
                f"could not write the checkpoint of step {step} in {self.directory} "
                f"({reason(e, self.directory / str(step))}); {kept}"
            ) from None

    def delete(self, steps: list[int], why: str) -> None:
        """Delete the checkpoints of ``steps``, saying so in one line that ends with ``why``."""
        if self.read_only:
            raise CheckpointError(f"{self.directory} is open read-only: steps {steps} cannot be deleted")
        self.log(f"discarding checkpoints {steps} in {self.directory}: {why}")
        # Every process lists the steps before process 0 (orbax's primary host) removes one: a
        # process still listing would read a half-deleted step. One process: no barrier.
        ocp.multihost.sync_global_processes(f"minishard: delete {steps} in {self.directory}")
        for step in steps:
            self._manager.delete(step)

    def steps(self) -> list[int]:
        """Steps of the finalized checkpoints, ascending (unfinished tmp dirs never count)."""
        with quiet_storage_noise(self._once):
            self._manager.reload()  # another process may have written since
            return sorted(self._manager.all_steps())

    def restore(
        self,
        target: Any,
        step: int | None = None,
        check_meta: Callable[[int, dict[str, Any]], None] | None = None,
    ) -> tuple[int, Any, dict[str, Any]]:
        """Load ``(step, state, meta)``; ``state`` takes ``target``'s structure and shardings.

        ``target``'s leaves: arrays or ``jax.ShapeDtypeStruct(..., sharding=...)``.
        ``step=None``: the latest readable checkpoint; an explicit step loads or raises.
        ``check_meta(step, meta)`` may raise ``ValueError`` for metadata that cannot be right
        (a position past the end of an epoch): that checkpoint counts as corrupt.
        """
        candidates = self._candidates(step)
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
                failures.append(f"checkpoint {path} is unreadable ({reason(e, path)})")
            else:
                try:
                    if check_meta is not None:
                        check_meta(
                            candidate, meta
                        )  # other errors (this is another run's checkpoint) propagate
                    return candidate, state, meta
                except (ValueError, KeyError, TypeError) as e:
                    failures.append(f"checkpoint {path} is corrupt (its metadata cannot be right: {e})")
            if i + 1 < len(candidates):
                self.log(f"{failures[-1]}; falling back to step {candidates[i + 1]}")
        header = [f"no checkpoint in {self.directory} could be loaded:"] if len(failures) > 1 else []
        quiet_orphaned_echoes()  # this error says it: not orbax's orphaned reads again, at exit
        raise CheckpointError("\n  ".join(header + failures)) from None

    def read_meta(self, step: int | None = None) -> tuple[int, dict[str, Any]]:
        """``(step, meta)`` of the latest checkpoint (or of ``step``), without reading its arrays.

        What a run saved about itself (``FitSettings(info=...)``: the model's flags, a
        vocabulary) is enough to build the target that ``restore`` reads into. Its
        checksum is checked; a broken latest step falls back to the one before, as ``restore`` does.
        """
        candidates, failures = self._candidates(step), []
        for i, candidate in enumerate(candidates):
            path = self.directory / str(candidate)
            try:
                with quiet_storage_noise(self._once):
                    read = ocp.args.Composite(meta=ocp.args.JsonRestore())
                    meta = self._manager.restore(candidate, args=read)["meta"]
                    verify_meta(meta, read_records(path))
                if isinstance(meta, dict):
                    return candidate, meta
                failures.append(f"checkpoint {path} is corrupt (its metadata is {meta!r}, not a dict)")
            except CorruptCheckpointError as e:
                failures.append(f"checkpoint {path} is corrupt ({e})")
            except Exception as e:
                failures.append(f"checkpoint {path} is unreadable ({reason(e, path)})")
            if i + 1 < len(candidates):
                self.log(f"{failures[-1]}; falling back to step {candidates[i + 1]}")
        header = [f"no checkpoint in {self.directory} could be read:"] if len(failures) > 1 else []
        raise CheckpointError("\n  ".join(header + failures)) from None

    def _candidates(self, step: int | None) -> list[int]:
        """The steps to try, latest first: ``step`` alone if given (it must be kept), else every kept one."""
        steps = self.steps()
        if not steps:
            raise CheckpointError(f"{self.directory} holds no checkpoint")
        if step is not None and step not in steps:
            raise CheckpointError(f"{self.directory} has no checkpoint for step {step}; it has {steps}")
        return [step] if step is not None else steps[::-1]

    def _load(self, step: int, target: Any) -> tuple[Any, dict[str, Any]]:
        named = _named(target)
        # target name -> the name it was saved under; SGD step counters an older checkpoint lacks
        stored_as, missing = self._check_fits(step, named, sgd_steps(target))
        abstract = {
            stored_as[name]: jax.ShapeDtypeStruct(
                leaf.shape, leaf.dtype, sharding=getattr(leaf, "sharding", None)
            )
            for name, leaf in named
            if name not in missing
        }
        items = {"state": ocp.args.StandardRestore(abstract), "meta": ocp.args.JsonRestore()}
        restored = self._manager.restore(step, args=ocp.args.Composite(**items))
        records = read_records(self.directory / str(step))
        verify_meta(restored["meta"], records)
        if unchecked := verify(restored["state"], records):
            self.log(
                f"checkpoint {step}: no process holds a whole saved shard of {', '.join(unchecked)}, "
                "so their checksums were not checked"
            )
        arrays = [
            jax.device_put(np.int32(step), getattr(leaf, "sharding", None))  # a counter the checkpoint lacks
            if name in missing
            else restored["state"][stored_as[name]]
            for name, leaf in named
        ]
        # The structure comes from the target, not from the disk.
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(target), arrays), restored["meta"]

    def _check_fits(
        self, step: int, named: list[tuple[str, Any]], counters: set[str]
    ) -> tuple[dict[str, str], list[str]]:
        """Compare the target's arrays with the stored ones, by name and shape, before reading data.

        A different model (other ``--layers``, momentum on or off) is the user's mistake, not
        corruption: say which arrays differ instead of falling back through every checkpoint.
        Returns, per target name, the name it is stored under (see *Migrations*), and the SGD
        step ``counters`` the checkpoint lacks (saved when a constant rate kept none).
        """
        try:
            stored = dict(self._manager.item_metadata(step)["state"])
        except Exception:
            stored = None
        if stored is None:  # unreadable metadata: the restore itself reports it, and falls back
            return {name: name for name, _ in named}, []
        found = {name: [old for old in older_names(name) if old in stored] for name, _ in named}
        stored_as = {name: (olds or [name])[0] for name, olds in found.items()}
        wanted = {stored_as[name]: _shape_dtype(leaf) for name, leaf in named}
        have = {name: _shape_dtype(meta) for name, meta in stored.items()}
        missing = sorted(name for name in counters - have.keys() if wanted.get(name) == "() int32")
        wanted = {name: meta for name, meta in wanted.items() if name not in missing}
        differences = [
            f"{name}: checkpoint {have.get(name, 'has none')}, target {wanted.get(name, 'has none')}"
            for name in sorted(wanted.keys() | have.keys())
            if have.get(name) != wanted.get(name)
        ]
        if differences:
            why = "another model, momentum switched on or off, or another optimizer?"
            if _flat_against_whole(have, wanted):
                why = (
                    "one side holds every array as ZeRO's flat shards: saved under --parallel zero, "
                    "resumed under another style, or the reverse; resume under the --parallel it was saved"
                )
            raise CheckpointMismatchError(
                f"checkpoint {self.directory / str(step)} holds other arrays than the state to restore "
                f"into ({why}):\n  " + "\n  ".join(differences[:10])
            )
        if missing:
            self.log(
                f"checkpoint {step} holds no {', '.join(missing)} (a constant-rate SGD kept no step counter "
                f"before minishard's issue 44): counting from {step}"
            )
        return stored_as, missing

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


def _flat_against_whole(have: dict[str, str], wanted: dict[str, str]) -> bool:
    """Every array that differs is flat on one side (as ZeRO's shards are), some only on one."""

    def flat(shape_dtype: str) -> bool:  # "(25088,) float32"
        return len(ast.literal_eval(shape_dtype.rsplit(" ", 1)[0])) == 1

    differing = [
        (flat(have[name]), flat(wanted[name]))
        for name in have.keys() & wanted.keys()
        if have[name] != wanted[name]
    ]
    return all(a or b for a, b in differing) and any(a != b for a, b in differing)  # a padded bias: both


def _shape_dtype(leaf: Any) -> str:
    """``"(16, 32) float32"``: what must match between a stored array and its target."""
    return f"{tuple(leaf.shape)} {np.dtype(leaf.dtype).name}"


def _named(tree: Any) -> list[tuple[str, Any]]:
    """``[("model.layers[0].weight", leaf), ...]``: each leaf with the name it is stored under."""
    named = named_leaves(tree)
    if len({name for name, _ in named}) < len(named):  # cannot happen with minishard's paths; checked anyway
        raise CheckpointError(f"two leaves of the state share a name: {sorted(n for n, _ in named)}")
    return named
