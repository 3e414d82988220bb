"""The anatomy of a step's memory: the default GPT's bytes per device, term by term, under each style.

What ``minishard explain --model gpt --memory --parallel STYLE --devices 4 --batch-size 12
[--precision bf16]`` predicts (its ``predict``: ``memory.step_budget`` of the step's plan), for every style
``--memory`` takes, on 4 devices (the GPT's 4 heads split at most 4 ways), in fp32 and bf16.
Printed: per precision, a row per term and a column per style, MB per device; ``--plot`` draws
one stacked bar per style (docs/memory.md). Nothing is compiled: it runs in seconds.

    python benchmarks/memory_styles.py --plot docs/memory_styles.png
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from minishard.memory import Budget
from minishard.run.cli import parse_args
from minishard.run.cli.memory import predict
from minishard.run.render import plot_budgets, terms_of
from minishard.styles import ANY_MODEL

PRECISIONS = ("fp32", "bf16")


def budgets(precision: str, devices: int = 4) -> dict[str, Budget]:
    """Each style's predicted budget of the default GPT's AdamW step, as ``explain --memory`` makes it."""
    flags = [
        "--model",
        "gpt",
        "--memory",
        "--devices",
        str(devices),
        "--batch-size",
        "12",
        "--precision",
        precision,
    ]
    return {style: predict(parse_args(["explain", *flags, "--parallel", style]))[0] for style in ANY_MODEL}


def table(precision: str, styles: dict[str, Budget]) -> str:
    """A row per term, a column per style: MB per device; then the total."""
    terms = terms_of(styles.values())
    lines = [f"{precision:18}" + "".join(f"{style:>9}" for style in styles)]
    for term in terms:
        lines.append(f"{term:18}" + "".join(f"{b.terms.get(term, 0) / 1e6:9.2f}" for b in styles.values()))
    return "\n".join([*lines, f"{'total':18}" + "".join(f"{b.total / 1e6:9.2f}" for b in styles.values())])


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plot", help="draw the stacked bars here (.png, .svg)")
    args = parser.parse_args(argv)
    panels = {precision: budgets(precision) for precision in PRECISIONS}
    print("\n\n".join(table(precision, styles) for precision, styles in panels.items()))
    if args.plot:
        title = "the default GPT's AdamW step, batch 12 on 4 devices: bytes per device by term"
        plot_budgets(panels, args.plot, title)
        print(f"Wrote {args.plot}")


if __name__ == "__main__":
    main()
