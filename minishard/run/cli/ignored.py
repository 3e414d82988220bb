"""The flags a mode of ``explain`` would ignore, refused before any work.

``--decode`` (``decode``) and ``--compare --size`` (``layouts``) price a named size from its
shapes: nothing is built or compiled, so a flag that asks for a train step's work, or a model's
flag, would be read by nothing. Each mode names what it does instead; the message is one line.

>>> import argparse
>>> refuse_ignored(argparse.Namespace(plot="a.png"), STEP_WORK, (), "prices a size", print)
argument --plot: prices a size; drop --plot
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable

__all__ = ["STEP_WORK", "refuse_ignored"]

STEP_WORK = ("memory", "topology", "plot", "microbatches")
"""Flags asking for a compiled train step's work, by their names in ``args`` (``--decode`` reads
``--parallel`` for the census of a decode step; ``--compare --size`` refuses it too)."""


def refuse_ignored(
    args: argparse.Namespace,
    names: Iterable[str],
    model_flags: Iterable[str],
    why: str,
    error: Callable[[str], object],
) -> None:
    """The first of ``names`` and ``model_flags`` given (but ``--context``, which every mode reads) is
    ``error``'s ``argument --flag: <why>; drop --flag``."""
    ignored = [name for name in (*names, *model_flags) if name != "context"]
    if given := [name for name in ignored if getattr(args, name, None) not in (None, False)]:
        flag = "--" + given[0].replace("_", "-")
        error(f"argument {flag}: {why}; drop {flag}")
