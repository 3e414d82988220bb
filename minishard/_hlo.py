"""Reading XLA's HLO text: collective instructions, result shapes, replica groups, loop trips.

The machinery behind ``minishard.census``, which a reader may skip: regular
expressions for the three notations XLA writes replica groups in, the bytes of
a result shape, which computation runs how often, and the float type a program
asked to communicate (XLA:CPU widens bf16 collectives to f32).
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterator, Mapping
from types import MappingProxyType

import numpy as np

from minishard.rules import AnyMesh

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
        if _may_be_collective(line) and (match := _INSTRUCTION.match(_COMMENT.sub("", line))):
            yield match


def _may_be_collective(line: str) -> bool:
    """A quick test before the regular expression, which most lines of a program would fail slowly:
    the line names a collective somewhere."""
    return any(kind in line for kind in KINDS)


# A computation starts at column 0: `%body.3 (p: (s32[], f32[8])) -> (s32[], f32[8]) {`.
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*\(.*\{\s*$")
# Where an instruction names the computations it runs: `condition=%c, body=%b`, `calls=%f`, ...
_CALLS = re.compile(
    r"\b(?P<attr>body|condition|calls|to_apply|branch_computations)=\{?(?P<names>%?[\w.\-]+(?:,\s*%[\w.\-]+)*)"
)
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')  # in a while's backend_config
_CONDITION = re.compile(r"\bcondition=%?(?P<name>[\w.\-]+)")
_CONSTANT = re.compile(r"^\s*%(?P<name>[\w.\-]+)\s*=\s*s32\[\]\S*\s+constant\((?P<value>\d+)\)")
_BELOW = re.compile(  # a loop condition: `ROOT %lt = pred[] compare(%i, %n), direction=LT`
    r"^\s*ROOT\s+%[\w.\-]+\s*=\s*pred\[\]\S*\s+compare\(%[\w.\-]+,\s*%(?P<bound>[\w.\-]+)\),\s*direction=LT"
)


# What names a called computation, tested as text before the regular expressions run (a program's
# lines are mostly instructions that call nothing)
_CALLING = ("body=", "calls=", "to_apply=", "branch_computations=")


@functools.lru_cache(maxsize=4)  # a program is priced and censused from one text: read it once
def runs_per_call(text: str) -> Mapping[str, int]:
    r"""How many times each computation of an HLO module runs when the program is called once.

    A ``lax.scan`` or ``fori_loop`` becomes a ``while`` whose body XLA proves runs a
    fixed number of times and writes into the instruction,
    ``backend_config={..."known_trip_count":{"n":"7"}}``: its body runs 7 times per
    run of the computation holding the while; nested loops multiply. XLA:TPU writes
    no trip count: its condition, ``counter < constant(7)``, gives it (``_counted``;
    jax's loops count from 0 by 1). Anything else called (fusions, reducers,
    branches) runs once per run of its caller.

    >>> loop = '%w = f32[] while(%p), condition=%c, body=%body, backend_config={"known_trip_count":{"n":"7"}}'
    >>> hlo = "\n".join(["%body (p: f32[]) -> f32[] {", "}", "ENTRY %main (p: f32[]) -> f32[] {", loop])
    >>> runs_per_call(hlo)["body"]
    7
    """
    caller: dict[str, tuple[str, int]] = {}  # computation -> (who calls it, how often per run)
    computation, counted = "", _counted(text)
    for line in text.splitlines():
        if header := _COMPUTATION.match(line):
            computation = header["name"]
            continue
        if not any(attribute in line for attribute in _CALLING):
            continue
        trips = _TRIP_COUNT.search(line)
        bound = counted.get(condition["name"], 1) if (condition := _CONDITION.search(line)) else 1
        for called in _CALLS.finditer(line):
            times = (int(trips[1]) if trips else bound) if called["attr"] == "body" else 1
            for name in called["names"].split(","):
                caller[name.strip().lstrip("%")] = (computation, times)

    def runs(name: str) -> int:
        parent, times = caller.get(name, ("", 1))
        return times * runs(parent) if parent else times

    return MappingProxyType({name: runs(name) for name in caller})  # shared by every caller: read-only


def _counted(text: str) -> dict[str, int]:
    """Loop conditions of the form ``ROOT compare(%i, %n), direction=LT`` with ``%n = s32[] constant(7)``
    in the same computation: each condition's name, and its bound."""
    bounds: dict[str, int] = {}
    constants: dict[str, int] = {}
    computation = ""
    for line in text.splitlines():
        if header := _COMPUTATION.match(line):
            computation, constants = header["name"], {}
        elif "constant(" in line and (constant := _CONSTANT.match(line)):  # the text test: quick
            constants[constant["name"]] = int(constant["value"])
        elif "direction=LT" in line and (below := _BELOW.match(line)) and below["bound"] in constants:
            bounds[computation] = constants[below["bound"]]
    return bounds


_DEFINED = re.compile(
    r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+)\s*=\s*(?P<shape>\w+\[[^\]]*\])\S*\s+(?P<op>[\w\-]+)\("
)
_DOT = re.compile(r"dot\(%(?P<lhs>[\w.\-]+),.*lhs_contracting_dims=\{(?P<dims>[\d,]*)\}")


def repeated_dot_flops(text: str) -> float:
    """The matmul FLOPs XLA's ``cost_analysis`` misses: it counts a loop's body once, however often it runs.

    Each ``dot`` of a computation that runs ``n`` times per call (``runs_per_call``) adds
    ``(n - 1) · 2 · out elements · contracted size``; other instructions are left out (small beside them).
    """
    runs, missed, computation = runs_per_call(text), 0.0, ""
    shapes: dict[str, list[int]] = {}  # each instruction's dimensions, in the computation being read
    for line in text.splitlines():
        if header := _COMPUTATION.match(line):
            computation, shapes = header["name"], {}
        elif runs.get(computation, 1) > 1 and (defined := _DEFINED.match(line)):  # others miss nothing
            shapes[defined["name"]] = dims = _ints(_ARRAY.match(defined["shape"])[2])  # type: ignore[index]
            dot = _DOT.search(line) if defined["op"] == "dot" else None
            if dot:
                lhs = shapes[dot["lhs"]]
                contracted = math.prod(lhs[int(i)] for i in dot["dims"].split(",") if i)
                missed += (runs[computation] - 1) * 2 * math.prod(dims) * contracted
    return missed


def located(text: str) -> Iterator[tuple[str, re.Match[str]]]:
    """``collective_instructions``, each with the name of the computation it is in."""
    computation = ""
    for line in text.splitlines():
        if header := _COMPUTATION.match(line):
            computation = header["name"]
        elif _may_be_collective(line) and (match := _INSTRUCTION.match(_COMMENT.sub("", line))):
            yield computation, match


# XLA:TPU fuses an all-reduce and the slice each device keeps into one reduce-scatter, a custom
# fusion: `%fusion = f32[128,512]{...} fusion(%g), kind=kCustom, calls=%all-reduce-scatter`, whose
# computation holds the all-reduce (of the whole array) and the dynamic-slice. Its header gives the slice.
_FUSED = re.compile(r"^%?(?P<name>all-reduce-scatter[\w.\-]*)\s*\(.*\)\s*->\s*(?P<shape>.+?)\s*\{\s*$")


def fused_reduce_scatters(text: str) -> dict[str, str]:
    """XLA:TPU's ``all-reduce-scatter`` fusions: each computation's name, and the slice it returns.

    >>> fused_reduce_scatters("%all-reduce-scatter.2 (input: f32[1024,512]) -> f32[128,512] {")
    {'all-reduce-scatter.2': 'f32[128,512]'}
    """
    return {found["name"]: found["shape"] for line in text.splitlines() if (found := _FUSED.match(line))}


def sent_as(match: re.Match[str], fused_slice: str | None) -> tuple[str, str | None, int]:
    """``(kind, phase, bytes)`` of a collective instruction; inside an ``all-reduce-scatter``
    fusion (``fused_slice`` its result), the reduce-scatter of that slice."""
    if fused_slice is not None:
        return "reduce-scatter", match["phase"], shape_bytes(fused_slice)
    return match["kind"], match["phase"], shape_bytes(match["shape"])


def shape_bytes(shape: str) -> int:
    """``"(f32[512]{0}, bf16[2,3]{1,0})"`` -> 512*4 + 6*2 bytes."""
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        elements = math.prod(int(d.strip().lstrip("<=")) for d in dims.split(",") if d.strip())
        total += -(-elements * bits(dtype) // 8)  # ceil: sub-byte types (s4) are packed
    return total


def bits(dtype: str) -> int:
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


def group_size(line: str, mesh: AnyMesh) -> int:
    """Devices in one group of an instruction (its first); a collective-permute's: along the axes it moves."""
    if _PAIRS.search(line):
        sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
        return math.prod(sizes[axis] for axes in instruction_axes(line, mesh) for axis in axes)
    return len(np.unique(_replica_groups(line, math.prod(mesh.axis_sizes))[0]))


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


class PartOfAxis(str):
    """A group's label for part of a mesh axis, ``"y(2 of 4)"``, that keeps the axis's name in
    ``axis``: a reader asks it, never parses the label back."""

    axis: str

    def __new__(cls, axis: str, span: int, size: int) -> PartOfAxis:
        label = super().__new__(cls, f"{axis}({span} of {size})")
        label.axis = axis
        return label


def _group_axes(group: np.ndarray, sizes: tuple[int, ...], names: tuple[str, ...]) -> tuple[str, ...]:
    """Mesh axes along which the devices of ``group`` vary, checked to form a sub-grid."""
    coords = _coords(group, sizes)
    spans = [len(np.unique(c)) for c in coords]
    if math.prod(spans) != len(np.unique(group)):  # not every combination present: no sub-grid
        return ("?",)
    return tuple(
        name if span == size else PartOfAxis(name, span, size)
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


# Bytes in the dtypes the program sends. XLA:CPU widens bf16 collectives to f32 (a
# bf16 psum compiles to an f32 all-reduce between two converts); the SPMD partitioner,
# which inserted them, wrote each in the dtype the program sends.


# A float narrower than f32 in a program's text ("tensor<8xbf16>", "f8E4M3FN"): without one,
# nothing was widened, and the compiled program's collectives are already as the partitioner wrote.
_NARROW = re.compile(r"f16|f8E|f6E|f4E")


def names_a_narrow_float(program: str) -> bool:
    """Whether ``program`` (a lowered or compiled program's text) has a float narrower than f32."""
    return _NARROW.search(program) is not None


def narrowed(text: str, partitioned: str) -> str:
    """``text`` (a compiled program) with each collective's f32 arrays written in the dtype the SPMD
    partitioner gave the collective of that kind and shape (``partitioned``, its output), in order:
    XLA may have combined several into one tuple since, but keeps their shapes."""
    asked: dict[tuple[str, str], list[str]] = {}
    for _, inserted in located(partitioned):
        for dtype, dims in _ARRAY.findall(inserted["shape"]):
            asked.setdefault((inserted["kind"], dims), []).append(dtype)

    lines = text.splitlines()
    for i, line in enumerate(lines):
        if not _may_be_collective(line):
            continue
        if compiled := _INSTRUCTION.match(stripped := _COMMENT.sub("", line)):
            shape = _ARRAY.sub(functools.partial(_written, asked, compiled["kind"]), compiled["shape"])
            lines[i] = stripped.replace(compiled["shape"], shape, 1)
    return "\n".join(lines)


def _written(asked: dict[tuple[str, str], list[str]], kind: str, array: re.Match[str]) -> str:
    """One f32 array of a ``kind`` collective, in the next dtype the partitioner asked for its shape."""
    dtype, dims = array.groups()
    pending = asked.get((kind, dims))
    return f"{pending.pop(0)}[{dims}]" if dtype == "f32" and pending else array[0]
