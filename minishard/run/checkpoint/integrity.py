"""Checksums on any topology: a CRC32 of every block of every array, written by the process that writes it.

Each process records the blocks it writes (its shards with ``replica_id == 0``,
keyed by where they sit in the array, such as ``"0:392,0:32"``) in its own file,
``<step>/integrity/process_<i>``. A restore checks every block some process
holds whole, on any mesh and any number of processes, and the processes agree
on the outcome, so they fall back together.

>>> _block_key(_bounds((slice(None), slice(8, 16)), (4, 32)))
'0:4,8:16'
"""

from __future__ import annotations

import json
import math
import zlib
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from minishard.run.errors import CorruptCheckpointError, NonFiniteStateError

__all__ = ["INTEGRITY", "META_RECORD", "checksums", "meta_checksum", "read_records", "verify", "verify_meta"]

INTEGRITY = "integrity"
"""The item holding the checksums: one JSON file per process, ``process_<i>``."""
META_RECORD = "<meta>"
"""The record of the metadata's checksum (no array's path has a ``<``), in process 0's file."""


def checksums(named: list[tuple[str, Any]], step: int) -> dict[str, dict[str, int]]:
    """A CRC32 of every block this process writes, keyed by its place (``"0:392,0:32"``); and the
    promise that every float is finite, which all processes agree on before anyone writes.

    The blocks are this process's shards with ``replica_id == 0``: every block of an array has
    exactly one such shard in the whole run, so the processes' records together cover it once.
    """
    crcs, non_finite = {}, []
    for name, leaf in named:
        blocks = _blocks_written_here(leaf)
        crcs[name] = {key: zlib.crc32(np.ascontiguousarray(block).tobytes()) for key, block in blocks}
        non_finite.append(sum(_count_non_finite(block) for _, block in blocks))
    totals = _across_processes(np.asarray(non_finite, np.int32)).sum(axis=0)  # the same in every process
    for (name, _), bad in zip(named, totals):
        if bad:
            raise NonFiniteStateError(
                f"not saving step {step}: {name} holds {bad} non-finite values (NaN or infinity); "
                "the training diverged. Try a smaller learning rate"
            )
    return crcs


def meta_checksum(meta: dict[str, Any]) -> dict[str, dict[str, int]]:
    """The metadata's CRC32, as process 0 records it: what a run saved about itself (a vocabulary,
    its flags) is checked at restore like its arrays, so a changed character is not read as saved."""
    return {META_RECORD: {"json": _json_crc(meta)}} if jax.process_index() == 0 else {}


def verify_meta(meta: dict[str, Any], records: dict[str, Any]) -> None:
    """Raise if ``meta`` is not what was saved (older checkpoints recorded no checksum of it)."""
    if (saved := records.get(META_RECORD)) is not None and saved.get("json") != _json_crc(meta):
        raise CorruptCheckpointError("its metadata (meta/) does not match the checksum written with it")


def _json_crc(meta: dict[str, Any]) -> int:
    """The CRC32 of ``meta`` as JSON reads it back (tuples as lists), keys sorted."""
    return zlib.crc32(json.dumps(json.loads(json.dumps(meta)), sort_keys=True).encode())


def _blocks_written_here(leaf: Any) -> list[tuple[str, np.ndarray]]:
    if isinstance(leaf, jax.Array):
        shards = [shard for shard in leaf.addressable_shards if shard.replica_id == 0]
        return [(_block_key(_bounds(shard.index, leaf.shape)), np.asarray(shard.data)) for shard in shards]
    host = np.asarray(leaf)  # a numpy array or a number: every process has it, process 0 writes it
    return [(_block_key(_bounds((), host.shape)), host)] if jax.process_index() == 0 else []


def _count_non_finite(block: np.ndarray) -> int:
    return int(block.size - np.isfinite(block).sum()) if np.issubdtype(block.dtype, np.inexact) else 0


def verify(arrays: dict[str, Any], records: dict[str, Any]) -> list[str]:
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
        shard = f" (shard [{key}])" if sum(check[0] == name for check in checks) > 1 else ""
        raise CorruptCheckpointError(f"{name}{shard} does not match the checksum written with it")
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


def read_records(step_dir: Path) -> dict[str, Any]:
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


# -- Migration: the checksum records of older checkpoints -----------------------------------------
def _whole_array_checksum(blocks: dict[str, int] | int, shape: tuple[int, ...]) -> dict[str, int]:
    """Checkpoints before per-block checksums stored one CRC per whole array (``integrity/metadata``,
    one process only): that is the CRC of the one block that spans the array."""
    return {_block_key([(0, size) for size in shape]): blocks} if isinstance(blocks, int) else blocks
