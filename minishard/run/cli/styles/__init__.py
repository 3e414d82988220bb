"""The styles of ``--parallel``: one ``Style`` each, in ``STYLES``.

Most styles are only a mesh shape and rules (``minishard.styles``), and
the model's own ``Sharded`` step. A style that needs a step of its
own is one entry too, a ``Style`` that overrides what it changes: the
flags it refuses or fills in, the model it builds, the step it trains with,
and what ``explain`` shows for it. Four do today: a pipeline (``pp``,
``dp+pp``: the blocks stacked on "stage", the batch in microbatches), ZeRO
(``zero``: dp's mesh and rules, ``minishard.zero``'s step), context
parallelism (``cp``, ``dp+cp``: the GPT with ring attention, and the ring shown)
and the experts (``ep``, ``dp+ep``: their checks, and what ``explain`` shows of
the all-to-alls). ``tp+sp`` is only its mesh and rules: the GPT's residual stream
follows its "seq" rule.

The package: ``style`` (``Style``, the hooks), and a module for each style
with a step of its own, named for it: ``pipeline``, ``zero``, ``context``,
``experts``. This module holds what the command line asks of them all:
``STYLES``, the one place that lists them, and ``--parallel``'s flags and rules.

>>> STYLES["zero"].mesh(8), STYLES["dp+pp"].mesh(8)
({'data': 8}, {'data': 2, 'stage': 4})
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence

from minishard.rules import AxisRules
from minishard.run.cli.flags import at_least
from minishard.run.cli.styles.context import ContextStyle
from minishard.run.cli.styles.experts import ExpertStyle
from minishard.run.cli.styles.pipeline import PipelineStyle
from minishard.run.cli.styles.style import Args, Style
from minishard.run.cli.styles.zero import ZeroStyle
from minishard.styles import EXPERT, PIPELINED, SPLITS, rules_for_mesh

__all__ = [
    "NO_STYLE",
    "STYLES",
    "add_arguments",
    "cli_rules",
    "style_of",
    "unused_mesh_axes",
    "warn_unused",
]


def add_arguments(parser: argparse.ArgumentParser, help: str) -> None:
    """``--parallel`` and ``--microbatches``: what train and explain share of the styles."""
    parser.set_defaults(**{name: value for style in STYLES.values() for name, value in style.parsed.items()})
    parser.add_argument("--parallel", choices=list(STYLES), help=help)
    parser.add_argument(
        "--microbatches",
        type=at_least(1),
        help="split each batch into M: gradient accumulation, or under pp and dp+pp the pipeline's "
        "microbatches (default: 1; under pp and dp+pp 2 per stage)",
    )


def cli_rules(args: Args, mesh_axes: Sequence[str]) -> AxisRules:
    """``--parallel``'s ordered rules (``--rules`` first, so they win), or the rules for this mesh."""
    return (
        rules_for_mesh(mesh_axes, args.rules)
        if args.parallel is None
        else STYLES[args.parallel].rules(args.rules)
    )


def unused_mesh_axes(mesh: Mapping[str, int], rules: AxisRules) -> list[str]:
    """The mesh axes (of more than one device) that no rule names: every array is whole on each.

    >>> unused_mesh_axes({"data": 2, "model": 4}, AxisRules(batch="data", mlp=None))
    ['model']
    """
    named = {
        axis for _, target in rules.pairs for axis in ((target,) if isinstance(target, str) else target or ())
    }
    return [axis for axis, size in mesh.items() if size > 1 and axis not in named]


def warn_unused(mesh: Mapping[str, int], rules: AxisRules) -> None:
    """One ``warning:`` line per mesh axis no rule uses: it only makes copies."""
    for axis in unused_mesh_axes(mesh, rules):
        print(
            f"warning: no rule uses mesh axis {axis!r}: every array is replicated over its {mesh[axis]} "
            f"devices (they all compute the same); add a rule (--rules NAME={axis}) or drop it from --mesh",
            file=sys.stderr,
        )


STYLES: dict[str, Style] = {
    **{name: PipelineStyle(name) if name in PIPELINED else Style(name) for name in SPLITS},
    **{name: ExpertStyle(name) for name in EXPERT},
    "zero": ZeroStyle("zero", like="dp"),
    **{name: ContextStyle(name) for name in ("cp", "dp+cp")},
}
"""``--parallel``'s choices: each of ``minishard.styles``, ZeRO by hand, the ring, the experts."""
NO_STYLE = Style("2d")
"""Without --parallel: the mesh data=2,model=4 (or --mesh), with the rules for its axes (``cli_rules``)."""


def style_of(name: str | None) -> Style:
    """The entry of ``--parallel NAME``, or ``NO_STYLE`` when none was named."""
    return STYLES[name] if name else NO_STYLE
