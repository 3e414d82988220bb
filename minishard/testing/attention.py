"""Property-test your own context-parallel attention: ``split_sequences``, ``assert_attention_equivalent``.

Context parallelism is written by hand (``minishard.context``, ``minishard.sequence``):
a ``shard_map`` where a wrong mask on the diagonal chunk, a chunk skipped that should
have run, or a position read in the wrong order computes something else without any
error. The oracle is attention on one device, on the sequence in its natural order:
the distributed output and its gradients, put back in order, must equal it, for every
mesh, chunk order and shape. A failure names the first token that differs, the device and
the chunk that hold it.

Your attention takes the signature of ``minishard.context.ring_attention``:
``attend_fn(q, k, v, *, axis, causal, order)``, run inside ``shard_map`` on this
device's ``[batch, seq / p, heads, head_dim]``, its chunks in the chunk order ``order``. Whatever else
shapes the mask (a window, say) is an argument too, ``options``, never a global: a traced
function reads a global once, at its first trace, and keeps that value.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st
from jax.sharding import Mesh

from minishard.context import CHUNKS, attention, held_order, permute
from minishard.sequence import Attend, over_sequence
from minishard.sharding import make_mesh
from minishard.testing._cache import cached
from minishard.testing.assertions import _check_tolerances


@dataclasses.dataclass(frozen=True)
class SplitSequence:
    """A sequence split over devices: its chunks on ``mesh[axis]``'s devices, in the chunk order
    ``order``,
    for arrays of ``shape`` ``[batch, seq, heads, head_dim]``."""

    mesh: Mesh
    axis: str
    order: str
    shape: tuple[int, int, int, int]

    def __post_init__(self) -> None:
        """A case that names an axis its mesh lacks, or an unknown chunk order, would fail deep in a
        trace."""
        if self.axis not in self.mesh.axis_names:
            raise ValueError(
                f"SplitSequence: axis={self.axis!r} is no axis of the mesh {dict(self.mesh.shape)}; "
                "name one of its axes, or build the mesh with it"
            )
        if self.order not in CHUNKS:
            known = ", ".join(CHUNKS)
            raise ValueError(f"SplitSequence: unknown chunk order {self.order!r}; choose from {known}")

    @property
    def devices(self) -> int:
        return int(self.mesh.shape[self.axis])

    def holder(self, position: int) -> tuple[int, int]:
        """``(device, chunk)`` holding the token at ``position``."""
        held = np.asarray(held_order(self.shape[1], self.devices, self.order))
        chunk_len = self.shape[1] // (self.devices * CHUNKS[self.order])
        return int(np.flatnonzero(held == position)[0]) // (
            self.shape[1] // self.devices
        ), position // chunk_len


def split_sequences(
    *,
    devices: Sequence[int] = (2, 4, 8),
    orders: Sequence[str] = tuple(CHUNKS),
    chunk_lengths: Sequence[int] = (1, 2),
    heads: Sequence[int] = (1, 2),
    head_dims: Sequence[int] = (4, 8),
    batch: Sequence[int] = (1,),
    heads_per_device: bool = False,
    axis: str = "seq",
    min_seq_len: int = 1,
) -> st.SearchStrategy[SplitSequence]:
    """Meshes, chunk orders and shapes to run a context-parallel attention on.

    The sequence is ``devices * chunks per device * chunk length`` tokens, so every
    chunk order splits it; ``heads_per_device``: ``heads`` counts heads per device (Ulysses
    needs heads divisible by the devices); ``min_seq_len``: only sequences at least this
    long (a window of ``w`` tokens needs more than ``w``). Sizes come from small fixed
    sets: each new shape compiles. Device counts above ``jax.device_count()`` are left
    out. A failing example prints its case by name: ``split_sequence(devices=2, order='zigzag', ...)``.

    >>> split_sequences(devices=(16,))
    Traceback (most recent call last):
    ValueError: split_sequences: no device count in (16,) fits the 8 devices of this process
    >>> split_sequences(orders=("striped",))
    Traceback (most recent call last):
    ValueError: split_sequences: orders=('striped',) names an unknown chunk order; choose from 'in-order', ...
    """
    _check_sizes(devices=devices, chunk_lengths=chunk_lengths, heads=heads, head_dims=head_dims, batch=batch)
    if not orders or not set(orders) <= set(CHUNKS):
        raise ValueError(
            f"split_sequences: orders={tuple(orders)!r} names an unknown chunk order; choose from "
            + ", ".join(map(repr, CHUNKS))
        )
    fits = [p for p in devices if p <= jax.device_count()]
    if not fits:
        raise ValueError(
            f"split_sequences: no device count in {tuple(devices)} fits the {jax.device_count()} devices "
            "of this process"
        )
    longest = max(fits) * max(CHUNKS[order] for order in orders) * max(chunk_lengths)
    if longest < min_seq_len:
        raise ValueError(
            f"split_sequences: min_seq_len={min_seq_len!r}, but the longest sequence these sizes make is "
            f"{longest} tokens; allow more devices or longer chunk_lengths"
        )

    def split_sequence(
        *, devices: int, order: str, chunk_length: int, heads: int, head_dim: int, batch: int
    ) -> SplitSequence:  # named arguments: a failing example prints them by name
        seq_len = devices * CHUNKS[order] * chunk_length
        shape = (batch, seq_len, heads * devices if heads_per_device else heads, head_dim)
        return SplitSequence(_mesh(devices, axis), axis, order, shape)

    pick = st.sampled_from
    cases = st.builds(
        split_sequence,
        devices=pick(fits),
        order=pick(orders),
        chunk_length=pick(chunk_lengths),
        heads=pick(heads),
        head_dim=pick(head_dims),
        batch=pick(batch),
    )
    return cases.filter(lambda case: case.shape[1] >= min_seq_len) if min_seq_len > 1 else cases


def _check_sizes(**sizes: Sequence[int]) -> None:
    """Each of ``split_sequences``' size choices: positive ints, at least one."""
    for name, choices in sizes.items():
        if not choices or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in choices):
            raise ValueError(
                f"split_sequences: {name}={tuple(choices)!r} must be positive ints (one at least)"
            )


@functools.cache
def _mesh(p: int, axis: str) -> Mesh:
    """One mesh per device count: a mesh is part of what jit compiles for."""
    return make_mesh({axis: p}, devices=jax.devices()[:p])


def assert_attention_equivalent(
    attend_fn: Attend,
    case: SplitSequence,
    *,
    causal: bool,
    seed: int = 0,
    reference: Callable[..., jax.Array] | None = None,
    options: Mapping[str, Any] | None = None,
    rtol: float = 1e-5,
    atol: float = 1e-5,
) -> jax.Array:
    """``attend_fn`` over ``case``'s devices equals ``reference`` (attention on one device), forward
    and gradients; returns the distributed output, in sequence order.

    Random ``q, k, v`` in sequence order are permuted into ``case.order``, attended in
    ``over_sequence``, and put back; the gradients are those of ``sum(sin(out))``.
    ``reference(q, k, v, causal=causal, **options)`` sees the sequence in order (default:
    ``attention``); ``options``, the mask's other parameters (``{"window": 4}``), go to
    ``attend_fn`` too. A case on one device splits nothing, and is refused: the test would
    compare attention with itself.

    >>> from minishard.context import ring_attention
    >>> case = SplitSequence(_mesh(2, "seq"), "seq", "zigzag", (1, 8, 2, 4))
    >>> assert_attention_equivalent(ring_attention, case, causal=True).shape
    (1, 8, 2, 4)
    """
    _check_case(case, reference, options)
    _check_tolerances("assert_attention_equivalent", rtol, atol)
    mask = tuple(sorted((options or {}).items()))  # hashable: the compiled runs are cached by it
    q, k, v = np.random.default_rng(seed).normal(size=(3, *case.shape)).astype(np.float32)
    distributed = _distributed(attend_fn, case.mesh, case.axis, case.order, causal, mask)
    got = jax.block_until_ready(distributed(q, k, v))
    want = jax.block_until_ready(_oracle(reference, causal, mask)(q, k, v))
    for name, a, b in zip(("output", "grad q", "grad k", "grad v"), got, want):
        _compare(name, np.asarray(a), np.asarray(b), case, causal, rtol, atol)
    return got[0]


def _value_and_grads(fn: Callable[..., jax.Array]) -> Callable[..., Any]:
    """``(fn(q, k, v), *grads of sum(sin(fn(q, k, v))))``, jitted."""

    def loss(q: Any, k: Any, v: Any) -> Any:
        out = fn(q, k, v)
        return jnp.sum(jnp.sin(out)), out

    def value_and_grads(q: Any, k: Any, v: Any) -> Any:
        grads, out = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
        return (out, *grads)

    return jax.jit(value_and_grads)


def _check_case(case: SplitSequence, reference: Any, options: Mapping[str, Any] | None) -> None:
    """Refuse what would pass vacuously (one device) or cannot run (options the default reference lacks)."""
    if case.devices < 2:
        raise ValueError(
            f"assert_attention_equivalent: the case's axis {case.axis!r} has {case.devices} device, which "
            "splits nothing: attention would be compared with itself; use a mesh axis of 2 or more devices"
        )
    if options and reference is None:
        raise ValueError(
            f"assert_attention_equivalent: options={dict(options)!r} need a reference= that takes them; "
            "the default, attention on one device, takes causal only"
        )


@cached
def _oracle(reference: Callable[..., jax.Array] | None, causal: bool, mask: tuple[Any, ...]) -> Any:
    """The reference run, compiled once per reference, ``causal`` and mask options."""
    return _value_and_grads(functools.partial(reference or attention, causal=causal, **dict(mask)))


@cached
def _distributed(
    attend_fn: Attend, mesh: Mesh, axis: str, order: str, causal: bool, mask: tuple[Any, ...]
) -> Any:
    """The distributed run, in sequence order, compiled once per function, mesh, chunk order and
    mask."""
    p = int(mesh.shape[axis])
    run = over_sequence(attend_fn, mesh, axis=axis, causal=causal, order=order, **dict(mask))
    return _value_and_grads(
        lambda *qkv: permute(run(*(permute(x, p, order) for x in qkv)), p, order, inverse=True)
    )


def _compare(
    name: str, got: np.ndarray, want: np.ndarray, case: SplitSequence, causal: bool, rtol: float, atol: float
) -> None:
    """Equal within tolerance, or an error naming the first token that differs and who holds it."""
    wrong = ~np.isclose(got, want, rtol=rtol, atol=atol).all(axis=(0, 2, 3))  # per position in the sequence
    if not wrong.any():
        return
    first = int(np.flatnonzero(wrong)[0])
    device, chunk = case.holder(first)
    hint = (
        " (the tokens before it agree: does a query see a future key, or miss a past chunk?)"
        if causal and first
        else ""
    )
    raise AssertionError(
        f"{name}: {int(wrong.sum())} of {wrong.size} tokens differ, the first at position {first} (device "
        f"{device}, chunk {chunk}, chunk order {case.order!r}, {case.devices} devices, "
        f"causal={causal}){hint}; "
        f"largest error {float(np.abs(got - want).max()):.2e}"
    )


__all__ = ["SplitSequence", "assert_attention_equivalent", "split_sequences"]
