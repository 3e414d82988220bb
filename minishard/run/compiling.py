"""Compiling: how long the first step took to compile (and its memory), and JAX's persistent cache.

The first call of a jitted step traces, lowers and compiles it; JAX reports
each phase through ``jax.monitoring``, and ``compile_summary`` says them in one
line with the compiled program's temporary memory per device. With
``enable_compilation_cache``, a second run reads the program from disk.

>>> compiled = jax.jit(lambda x: 2 * x).lower(1.0).compile()
>>> print(compile_summary([("trace", 0.05), ("lower", 0.1), ("XLA", 1.05)], compiled))  # doctest: +ELLIPSIS
Compiled train_step in 1.20 s (trace 0.05 s, lower 0.10 s, XLA 1.05 s); temporary memory ... per device
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from typing import Any

import jax

__all__ = ["CACHE_HIT", "COMPILE_PHASES", "compile_events", "compile_summary", "enable_compilation_cache"]

COMPILE_PHASES = {
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
    "/jax/core/compile/backend_compile_duration": "XLA",
}
"""JAX's monitoring events for the three phases of compiling a jitted function."""
CACHE_HIT = "/jax/compilation_cache/cache_hits"
_recording: list[tuple[str, float]] | None = None  # the events of the block being watched, if any


@contextlib.contextmanager
def compile_events() -> Iterator[list[tuple[str, float]]]:
    """Collect JAX's compile events (``jax.monitoring``) while the block runs: (phase, seconds)."""
    global _recording
    _listen_once()
    events: list[tuple[str, float]] = []
    _recording = events
    try:
        yield events
    finally:
        _recording = None


@functools.cache
def _listen_once() -> None:
    """jax.monitoring has no way to remove a listener: register ours once per process."""

    def on_duration(event: str, duration_secs: float, **kwargs: str | int) -> None:
        if _recording is not None and event in COMPILE_PHASES:
            _recording.append((COMPILE_PHASES[event], duration_secs))

    def on_event(event: str, **kwargs: str | int) -> None:
        if _recording is not None and event == CACHE_HIT:
            _recording.append(("cache hit", 0.0))

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    jax.monitoring.register_event_listener(on_event)


def compile_summary(events: list[tuple[str, float]], compiled: Any) -> str:
    """``Compiled train_step in 1.20 s (trace 0.05 s, lower 0.10 s, XLA 1.05 s); temporary memory ...``."""
    phases = {phase: sum(s for p, s in events if p == phase) for phase in COMPILE_PHASES.values()}
    line = f"Compiled train_step in {sum(phases.values()):.2f} s ("
    line += ", ".join(f"{phase} {seconds:.2f} s" for phase, seconds in phases.items()) + ")"
    if hits := sum(1 for phase, _ in events if phase == "cache hit"):
        line += f", {hits} program(s) read from the persistent compilation cache"
    memory = compiled.memory_analysis()
    if memory is not None:
        line += f"; temporary memory {memory.temp_size_in_bytes / 1e6:.2f} MB per device"
    return line


def enable_compilation_cache(directory: str | os.PathLike[str], log: Callable[[str], None] = print) -> bool:
    """Turn on JAX's persistent compilation cache in ``directory``; False (and a warning) if unusable.

    Compiled programs are written there, keyed by the program and the
    compiler's version and flags, so a second run with the same model and mesh
    reads them instead of compiling. A directory that cannot be written is
    reported and skipped: the run compiles as usual.
    """
    path = os.fspath(directory)
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".probe-{os.getpid()}")
        with open(probe, "w") as file:
            file.write("ok")
        os.remove(probe)
    except OSError as e:
        log(f"warning: the compilation cache {path} is not usable ({e}); compiling without it")
        return False
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # cache even small programs
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return True
