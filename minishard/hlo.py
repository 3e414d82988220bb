"""Reading XLA's HLO text: instructions, result shapes and replica groups.

``jax.jit(f).lower(*args).compile().as_text()`` is the program each device runs
after XLA's SPMD partitioner split it. A collective in it reads like::

    %all-reduce = f32[2000]{0} all-reduce(%fusion), channel_id=1,
                  replica_groups=[2,4]<=[8], use_global_device_ids=true, to_apply=%add

* ``f32[2000]{0}``: the result *on one device* (``{0}`` is its memory layout);
  long tuples of results are numbered with comments, ``/*index=5*/``;
* ``replica_groups``: which devices combine their values, written in one of
  three notations: explicit lists ``{{0,1,2,3},{4,5,6,7}}``, an iota
  ``[2,4]<=[8]`` (the numbers 0..7 reshaped to 2 groups of 4, optionally
  transposed: ``[4,2]<=[2,4]T(1,0)``), or XLA's own mesh,
  ``mesh['axis_0'=2,'axis_1'=4] {'axis_1'}`` (groups span the listed axes);
* ``source_target_pairs`` (collective-permute): who sends to whom.

Device numbers are positions in the flattened mesh, ``mesh.devices.flat``, so
a group translates back to mesh axis names: the axes along which its devices'
coordinates vary.

>>> mesh = jax.sharding.AbstractMesh((2, 4), ("x", "y"))
>>> line = "%ar = f32[2000]{0} all-reduce(%p), replica_groups=[2,4]<=[8], to_apply=%add"
>>> [(m["kind"], shape_bytes(m["shape"])) for m in collective_instructions(line)]
[('all-reduce', 8000)]
>>> instruction_axes(line, mesh)
{('y',)}
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator

import jax
import numpy as np

AnyMesh = jax.sharding.Mesh | jax.sharding.AbstractMesh
KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

_COMMENT = re.compile(r"/\*.*?\*/")  # long tuples are numbered: (a, b, c, d, e, /*index=5*/f, ...)
# An instruction whose opcode is a collective: `[ROOT] %name = SHAPE KIND[-start|-done](...)`.
# SHAPE may hold spaces, "(f32[2]{0}, f32[8]{0})", but no "=" (once comments are removed)
# except in dynamic sizes, "f32[<=8]"; that keeps the match from running into attributes.
_KIND = "(?P<kind>" + "|".join(KINDS) + ")(?P<phase>-start|-done)?"
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<shape>(?:<=|[^=])+?)\s+" + _KIND + r"\(")
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")  # "bf16[8,128]", "pred[]", "f32[<=10]"
# replica_groups={{0,1,2,3},{4,5,6,7}}: explicit lists; "{}" means one group of all devices.
_EXPLICIT = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")
# replica_groups=[2,4]<=[8] or [4,2]<=[2,4]T(1,0): iota(8), reshaped to [2,4] and
# transposed by (1,0) if given, then read row by row as [groups, devices per group].
_IOTA = re.compile(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
# replica_groups=mesh['axis_0'=2,'axis_1'=4], device_ids=([2,4]T(1,0)) {'axis_1'}: XLA's own
# mesh (names, sizes, and device order when not 0..n-1), then the axes a group spans.
_MESH = re.compile(
    r"replica_groups=mesh\[(?P<axes>[^\]]*)\]"
    r"(?:,\s*device_ids=\((?P<ids>[^()]*(?:\([^()]*\))?)\))?\s*\{(?P<grouped>[^}]*)\}"
)
_MESH_AXIS = re.compile(r"'([^']+)'=(\d+)")  # 'axis_0'=2
_GROUPED_AXIS = re.compile(r"'([^']+)'(?::\((\d+)\)(\d+))?")  # 'axis_1', or sub-axis 'axis_1':(2)2
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")  # {{0,1},{1,2},...}
_INTS = re.compile(r"\d+")
_SPECIAL_BITS = {"pred": 8, "token": 0, "opaque": 0}


def collective_instructions(text: str) -> Iterator[re.Match[str]]:
    """Each collective instruction in ``text``, as a match with ``kind``, ``phase`` and ``shape``.

    ``phase`` is ``-start`` or ``-done`` for the two halves of an async collective, else None.
    """
    for line in text.splitlines():
        if match := _INSTRUCTION.match(_COMMENT.sub("", line)):
            yield match


def shape_bytes(shape: str) -> int:
    """``"(f32[512]{0}, bf16[2,3]{1,0})"`` -> 512*4 + 6*2 bytes."""
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        elements = math.prod(int(d.strip().lstrip("<=")) for d in dims.split(",") if d.strip())
        total += -(-elements * _bits(dtype) // 8)  # ceil: sub-byte types (s4) are packed
    return total


def _bits(dtype: str) -> int:
    """Bits per element: the first number in the type's name (f32, bf16, f8e4m3fn, c64, s4)."""
    if dtype in _SPECIAL_BITS:
        return _SPECIAL_BITS[dtype]
    if not (digits := _INTS.search(dtype)):
        raise ValueError(f"unknown HLO element type {dtype!r}")
    return int(digits.group())


def instruction_axes(line: str, mesh: AnyMesh) -> set[tuple[str, ...]]:
    """The mesh axes one instruction runs over: one tuple per distinct group shape."""
    sizes, names = tuple(mesh.axis_sizes), tuple(mesh.axis_names)
    if pairs := _PAIRS.search(line):
        src, dst = np.array(_ints(pairs[1])).reshape(-1, 2).T
        moved = np.stack(_coords(src, sizes)) != np.stack(_coords(dst, sizes))
        return {tuple(name for name, m in zip(names, moved.any(axis=1)) if m)}
    return {_group_axes(group, sizes, names) for group in _replica_groups(line, math.prod(sizes))}


def _replica_groups(line: str, n_devices: int) -> list[np.ndarray]:
    """Device ids of each group, whichever of XLA's three notations the line uses."""
    if match := _EXPLICIT.search(line):
        groups = [np.array(_ints(group)) for group in re.findall(r"\{([\d,]*)\}", match[1])]
        return groups or [np.arange(n_devices)]
    if match := _IOTA.search(line):
        shape, reshape, perm = (_ints(g) for g in match.groups())
        return list(_iota(reshape, perm).reshape(shape))
    if match := _MESH.search(line):
        return _mesh_groups(match)
    raise ValueError(f"no replica groups found in: {line.strip()[:200]}")


def _mesh_groups(match: re.Match[str]) -> list[np.ndarray]:
    """Groups of XLA's mesh notation: devices that agree on every axis not listed."""
    axes = [(name, int(size)) for name, size in _MESH_AXIS.findall(match["axes"])]
    sizes = [size for _, size in axes]
    ids, index = match["ids"], {name: i for i, (name, _) in enumerate(axes)}
    if ids is None:  # devices in order 0..n-1
        devices = _iota(sizes, None)
    elif ids.startswith("["):  # "[2,4]T(1,0)": iota reshaped and transposed, as above
        reshape, _, perm = ids[1:].partition("]")
        devices = _iota(_ints(reshape), _ints(perm))
    else:  # an explicit list of device ids
        devices = np.array(_ints(ids))
    coords = np.indices(sizes).reshape(len(sizes), -1)  # mesh coordinates of each position
    key = coords.copy()  # the coordinates a group's members share: grouped ones erased
    for name, pre_size, size in _GROUPED_AXIS.findall(match["grouped"]):
        d = index[name]
        if not size:  # the whole axis
            key[d] = 0
        else:  # sub-axis (p)s: axis d viewed as [p, s, rest]; the group spans the s
            stride = sizes[d] // (int(pre_size) * int(size))
            key[d] -= (coords[d] // stride) % int(size) * stride
    _, group_of = np.unique(key.T, axis=0, return_inverse=True)
    flat = devices.reshape(-1)
    return [flat[group_of.reshape(-1) == g] for g in range(group_of.max() + 1)]


def _group_axes(group: np.ndarray, sizes: tuple[int, ...], names: tuple[str, ...]) -> tuple[str, ...]:
    """Mesh axes along which the devices of ``group`` vary, checked to form a sub-grid."""
    coords = _coords(group, sizes)
    spans = [len(np.unique(c)) for c in coords]
    if math.prod(spans) != len(np.unique(group)):  # not every combination present: no sub-grid
        return ("?",)
    return tuple(
        name if span == size else f"{name}({span} of {size})"
        for name, size, span in zip(names, sizes, spans)
        if span > 1
    )


def _coords(devices: np.ndarray, sizes: tuple[int, ...]) -> tuple[np.ndarray, ...]:
    if devices.size and devices.max() >= math.prod(sizes):
        raise ValueError(f"device {devices.max()} is outside the mesh {sizes}; pass the program's mesh")
    return np.unravel_index(devices, sizes)


def _iota(reshape: list[int], perm: list[int] | None) -> np.ndarray:
    devices = np.arange(math.prod(reshape)).reshape(reshape)
    return devices.transpose(perm) if perm else devices


def _ints(text: str | None) -> list[int]:
    return [int(i) for i in _INTS.findall(text or "")]
