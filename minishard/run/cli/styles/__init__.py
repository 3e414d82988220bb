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
``STYLES``, the one place that lists them, ``--parallel``'s flags and rules, and a style's
train step as ``explain`` compiles it (``style_args``, ``train_step``, ``zero_batch``: ``explain
--hardware``, ``--compare`` and ``rank_check`` share them).

Every ``+``-joined set of dimensions (``minishard.styles.compose``: ``dp+tp+pp``) is a style
too (``style_of``), derived from the dimensions' rules (``minishard.styles.DIMENSIONS``), never
written per pair: a dimension whose rule names a ``step`` (pp: the pipeline's, cp: the ring's,
ep: the experts') brings that chapter's entry (``STEPS``); the outermost (``styles.steps``) is the
style, on the composed mesh and rules, and carries the others inside it (``Style.inner``: their
checks and build). The annotated dimensions (dp, fsdp, tp, sp) need nothing more.

>>> STYLES["zero"].mesh(8), STYLES["dp+pp"].mesh(8), style_of("fsdp+tp+pp").mesh(8)
({'data': 8}, {'data': 2, 'stage': 4}, {'data': 2, 'model': 2, 'stage': 2})
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

import jax
import jax.numpy as jnp

from minishard.precision import PRECISIONS
from minishard.rules import AxisRules
from minishard.run.cli.flags import at_least, fill_defaults
from minishard.run.cli.styles.context import ContextStyle
from minishard.run.cli.styles.experts import ExpertStyle
from minishard.run.cli.styles.pipeline import PipelineStyle
from minishard.run.cli.styles.style import Args, Style
from minishard.run.cli.styles.zero import ZeroStyle
from minishard.run.steps import make_train_step
from minishard.styles import DIMENSIONS, SPLITS, rules_for_mesh, steps

__all__ = [
    "NO_STYLE",
    "STYLES",
    "add_arguments",
    "cli_rules",
    "parallel",
    "style_args",
    "style_of",
    "train_step",
    "unused_mesh_axes",
    "warn_unused",
    "zero_batch",
]


def add_arguments(parser: argparse.ArgumentParser, help: str) -> None:
    """``--parallel`` and ``--microbatches``: what train and explain share of the styles."""
    parser.set_defaults(**{name: value for style in STYLES.values() for name, value in style.parsed.items()})
    parser.add_argument(
        "--parallel",
        type=parallel,
        help=f"{help}: {', '.join(STYLES)}, or dimensions "
        f"joined by + from {', '.join(DIMENSIONS)} (e.g. dp+tp+pp)",
    )
    parser.add_argument(
        "--microbatches",
        type=at_least(1),
        help="split each batch into M: gradient accumulation, or under pp and dp+pp the pipeline's "
        "microbatches (default: 1; under pp and dp+pp 2 per stage)",
    )


def cli_rules(args: Args, mesh_axes: Sequence[str]) -> AxisRules:
    """``--parallel``'s ordered rules (``--rules`` first, so they win), or the rules for this
    mesh."""
    return (
        rules_for_mesh(mesh_axes, args.rules)
        if args.parallel is None
        else style_of(args.parallel).rules(args.rules)
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


STEPS: dict[str, type[Style]] = {"pipeline": PipelineStyle, "context": ContextStyle, "experts": ExpertStyle}
"""The entry of each chapter whose step a dimension needs (``styles.Dimension.step``)."""


def parallel(text: str) -> str:
    """``--parallel``: a style of ``STYLES``, or dimensions joined by + that compose: their rules
    (``minishard.styles.DIMENSIONS``) nest their steps (``styles.steps``).

    >>> parallel("tp+dp+pp")
    'tp+dp+pp'
    """
    if text in STYLES:
        return text
    if "+" not in text and text not in DIMENSIONS:  # ZeRO by hand is one of the choices too
        raise argparse.ArgumentTypeError(
            f"unknown parallel style {text!r}; choose from {', '.join(STYLES)}, or dimensions joined by + "
            f"from {', '.join(DIMENSIONS)}"
        )
    try:
        steps(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


@functools.cache
def _composed(name: str) -> Style:
    """The style of dimensions joined by +, derived from their rules: the entry of the outermost
    step (if any) on its mesh and rules, carrying the entries of the steps inside it."""
    nested = steps(name)
    if not nested:
        return Style(name)
    outer, *inner = (STEPS[str(DIMENSIONS[dim].step)] for dim in nested)  # each has a step
    return outer(name, inner=tuple(entry(name) for entry in inner))


STYLES: dict[str, Style] = {
    **{name: _composed(name) for name in SPLITS},
    "zero": ZeroStyle("zero", like="dp"),
}
"""``--parallel``'s choices: each of ``minishard.styles``, ZeRO by hand, the ring, the experts."""
NO_STYLE = Style("2d")
"""Without --parallel: the mesh data=2,model=4 (or --mesh), with the rules for its axes
(``cli_rules``)."""


def style_of(name: str | None) -> Style:
    """The entry of ``--parallel NAME`` (a named style, or dimensions joined by +), or
    ``NO_STYLE``."""
    return (STYLES.get(name) or _composed(name)) if name else NO_STYLE


def train_step(
    args: Args, model: Any, style: Style, mesh: Any, shapes: bool = False
) -> tuple[Any, Any, tuple[Any, ...]]:
    """The default model's train step under ``style`` on ``mesh``, its optimizer, and its arguments
    (the model built, the optimizer's state, a batch of zeros): what ``--hardware`` compiles and
    prices, in ``--precision``'s policy where the command has one (a bf16 step priced as it
    trains). ``shapes``: the model and its state as ``jax.eval_shape`` gives them, enough to
    compile, no weight drawn (``--check``'s scaled Megatron-LM: 31 M of them, half its time)."""
    optimizer = model.compiled_optimizer(args)
    draw = jax.eval_shape if shapes else (lambda make: make())
    # a pipeline: its schedule
    built = style.prepare(draw(lambda: style.build(model, args, jax.random.key(0))), args, mesh)
    precision = PRECISIONS[getattr(args, "precision", None) or "fp32"]
    step = make_train_step(optimizer, model.task.loss, style.microbatches(args), precision)
    return step, optimizer, (built, draw(lambda: optimizer.init(built)), zero_batch(args, model))


def zero_batch(args: Args, model: Any) -> dict[str, jax.Array]:
    """A batch of ``--batch-size`` zeros, the model's example's shapes: what a compiled step is
    priced on."""
    example = model.example(args, args.batch_size)
    return {name: jnp.zeros(like.shape, like.dtype) for name, like in example.items()}


def style_args(args: Args, model: Any, style: Style, shape: dict[str, int]) -> Args:
    """``args`` for ``style`` on mesh ``shape``, its defaults filled as ``train`` would run it; a
    flag it refuses raises ``ValueError`` (the one-line message)."""
    resets = model.stack.resets if model.stack else ()  # the style's defaults: a pipeline's blocks
    unset = {**dict.fromkeys(resets), "microbatches": None}
    own = Args(**{**vars(args), **unset, "parallel": style.name, "mesh": shape})

    def refuse(message: str) -> NoReturn:
        raise ValueError(message)

    style.check_explain(own, model, refuse)
    fill_defaults(own, model, style)
    style.check(own, model, refuse)  # with the defaults filled: a pipeline's blocks over its stages
    return own
