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

A checkpoint ``<step>/`` holds two items: ``state``, every array of the model
and optimizer state (its step counter, its velocities) under its readable path
such as ``model.layers[0].weight``, and ``meta``, a JSON dict with the position
in the data (epoch, batch, shuffle seed) and the history. The pytree structure
(Layer classes, a ``None`` velocity) is not stored: it comes from the target.

Restoring the latest checkpoint falls back: if it is unreadable (a truncated
file, a bad disk), the ``Checkpointer`` logs why and tries the one before.
That is why it keeps several (``keep``), not one.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import re
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from minishard.tree import named_leaves


class CheckpointError(RuntimeError):
    """No checkpoint could be saved or loaded; the message names the path(s) and why."""


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
        if keep < 1:
            raise ValueError(f"Checkpointer: keep must be at least 1, got {keep}")
        self.directory, self.log = Path(directory).absolute(), log
        options = ocp.CheckpointManagerOptions(
            enable_async_checkpointing=False,  # save() returns only once the rename is done
            preservation_policy=ocp.checkpoint_managers.LatestN(keep),
            cleanup_tmp_directories=True,  # remove what a killed save left behind
        )
        handlers = {"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

    def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
        """Write ``state`` (a pytree of arrays, sharded as they are) and ``meta`` (JSON) as ``step``."""
        try:
            json.dumps(meta)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"checkpoint meta must be JSON-serializable: {e}") from None
        # Checkpoints at or after `step` are from a future the run abandoned when
        # it resumed from an earlier step; orbax would not save behind them.
        if stale := [s for s in self.steps() if s >= step]:
            self.log(f"discarding checkpoints {stale} in {self.directory}: training resumed before them")
            for s in stale:
                self._manager.delete(s)
        items = {"state": ocp.args.StandardSave(dict(_named(state))), "meta": ocp.args.JsonSave(meta)}
        with quiet_storage_noise():
            # force: the caller decides when to save, not orbax's save-interval policy.
            self._manager.save(int(step), args=ocp.args.Composite(**items), force=True)
            self._manager.wait_until_finished()

    def steps(self) -> list[int]:
        """Steps of the finalized checkpoints, ascending (unfinished tmp dirs never count)."""
        self._manager.reload()  # another process may have written since
        return sorted(self._manager.all_steps())

    def restore(self, target: Any, step: int | None = None) -> tuple[int, Any, dict[str, Any]]:
        """Load ``(step, state, meta)``; ``state`` takes ``target``'s structure and shardings.

        ``target``'s leaves: arrays or ``jax.ShapeDtypeStruct(..., sharding=...)``.
        ``step=None``: the latest readable checkpoint; an explicit step loads or raises.
        """
        steps = self.steps()
        if not steps:
            raise CheckpointError(f"{self.directory} holds no checkpoint")
        if step is not None and step not in steps:
            raise CheckpointError(f"{self.directory} has no checkpoint for step {step}; it has {steps}")
        candidates = [step] if step is not None else steps[::-1]
        failures = []
        for i, candidate in enumerate(candidates):
            try:
                with quiet_storage_noise():
                    return candidate, *self._load(candidate, target)
            except CheckpointError:
                raise  # the target does not fit: an older checkpoint would not fit either
            except Exception as e:
                path = self.directory / str(candidate)
                failures.append(f"checkpoint {path} is unreadable ({_reason(e, path)})")
                if i + 1 < len(candidates):
                    self.log(f"{failures[-1]}; falling back to step {candidates[i + 1]}")
        header = [f"no checkpoint in {self.directory} could be loaded:"] if len(failures) > 1 else []
        raise CheckpointError("\n  ".join(header + failures)) from None

    def _load(self, step: int, target: Any) -> tuple[Any, dict[str, Any]]:
        named = _named(target)
        stored_as = self._check_fits(step, named)  # target name -> the name it was saved under
        abstract = {
            stored_as[name]: jax.ShapeDtypeStruct(
                leaf.shape, leaf.dtype, sharding=getattr(leaf, "sharding", None)
            )
            for name, leaf in named
        }
        items = {"state": ocp.args.StandardRestore(abstract), "meta": ocp.args.JsonRestore()}
        restored = self._manager.restore(step, args=ocp.args.Composite(**items))
        arrays = [restored["state"][stored_as[name]] for name, _ in named]
        # The structure comes from the target, not from the disk.
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(target), arrays), restored["meta"]

    def _check_fits(self, step: int, named: list[tuple[str, Any]]) -> dict[str, str]:
        """Compare the target's arrays with the stored ones, by name and shape, before reading data.

        A different model (other ``--layers``, momentum on or off) is the user's mistake, not
        corruption: say which arrays differ instead of falling back through every checkpoint.
        Returns, per target name, the name it is stored under (older names are accepted).
        """
        try:
            stored = dict(self._manager.item_metadata(step)["state"])
        except Exception:
            stored = None
        if stored is None:  # unreadable metadata: the restore itself reports it, and falls back
            return {name: name for name, _ in named}
        stored_as = {name: _older_name(name) if _older_name(name) in stored else name for name, _ in named}
        wanted = {stored_as[name]: tuple(leaf.shape) for name, leaf in named}
        have = {name: tuple(meta.shape) for name, meta in stored.items()}
        differences = [
            f"{name}: checkpoint {have.get(name, 'has none')}, target {wanted.get(name, 'has none')}"
            for name in sorted(wanted.keys() | have.keys())
            if have.get(name) != wanted.get(name)
        ]
        if differences:
            raise CheckpointError(
                f"checkpoint {self.directory / str(step)} holds other arrays than the state to restore "
                "into (another model or optimizer?):\n  " + "\n  ".join(differences[:10])
            )
        return stored_as

    def close(self) -> None:
        """Release orbax's resources (also done by ``with Checkpointer(...)``)."""
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _named(tree: Any) -> list[tuple[str, Any]]:
    """``[("model.layers[0].weight", leaf), ...]``: each leaf with the name it is stored under."""
    named = named_leaves(tree)
    if len({name for name, _ in named}) < len(named):  # cannot happen with minishard's paths; checked anyway
        raise CheckpointError(f"two leaves of the state share a name: {sorted(n for n, _ in named)}")
    return named


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
    is closed") or leave failed tasks unawaited. They repeat a failure already
    reported. Only those messages are dropped, only inside this block, and the
    previous hook, filters and warning settings are restored on the way out.
    """
    previous_hook = sys.unraisablehook
    asyncio_log = logging.getLogger("asyncio")

    def quiet_hook(unraisable: Any) -> None:
        closed = isinstance(unraisable.exc_value, RuntimeError) and "loop is closed" in str(
            unraisable.exc_value
        )
        if not closed:
            previous_hook(unraisable)

    sys.unraisablehook = quiet_hook
    asyncio_log.addFilter(_not_an_unawaited_read)
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


def _not_an_unawaited_read(record: logging.LogRecord) -> bool:
    message = record.getMessage()
    return not ("never retrieved" in message and ("orbax" in message or "tensorstore" in message))
