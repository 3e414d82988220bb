"""Drawing an ``explain`` report: a rich table, HTML for notebooks, a picture of the shards;
the picture of ``minishard.costs.compare``: compute against communication per layout;
a training run's history (``plot_history``): its loss, its metrics and its learning rate; and
one traced step (``plot_trace``): the host and every device's ops on one time line.

``minishard.explain`` builds the report and prints it as text; how it looks
anywhere else is the workshop's business, kept here so the textbook stays about
the plan. Each renderer imports its optional dependency (rich, matplotlib) only
when called.

>>> import jax
>>> device_shards({"data": 2, "model": 2}, jax.sharding.PartitionSpec(None, "model"), 2)
{(0, 0): [0, 2], (0, 1): [1, 3]}
"""

from __future__ import annotations

import html
import io
import math
import sys
from collections.abc import Iterable
from typing import Any

import jax
import numpy as np

from minishard import Report
from minishard.costs import Comparison
from minishard.memory import Budget
from minishard.run.saying import BOOKKEEPING
from minishard.run.trace_reading import Span, TracedStep


def rich_table(report: Report) -> Any:
    """The report as a ``rich.table.Table`` (``rich.print(rich_table(report))``)."""
    from rich.table import Table  # optional dependency: imported only when rich renders

    table = Table(title=f"mesh {report.mesh}", caption="\n".join(report.footer()), caption_justify="left")
    for header in report.HEADER:
        numeric = header in ("bytes", "bytes/device")
        table.add_column(header, justify="right" if numeric else "left", no_wrap=header == "path")
    for cells in report.cells():
        table.add_row(*cells)
    return table


def report_html(report: Report) -> str:
    """Notebooks: the rich table as HTML if rich is installed, else the text table."""
    try:
        from rich.console import Console
    except ImportError:
        return f"<pre>{html.escape(str(report))}</pre>"
    console = Console(record=True, width=160, file=io.StringIO())
    console.print(rich_table(report))
    return console.export_html(inline_styles=True, code_format="<pre>{code}</pre>")


def show(report: Report) -> None:
    """A rich table in a terminal (when rich is installed), plain text in logs and pipes."""
    if sys.stdout.isatty():
        try:
            import rich

            rich.print(rich_table(report))
            return
        except ImportError:
            pass
    print(report)


def device_shards(
    mesh: dict[str, int], spec: jax.sharding.PartitionSpec, ndim: int
) -> dict[tuple[int, ...], list[int]]:
    """Which devices hold which shard of an array: ``{shard index: [device ids]}``.

    Device ids are positions in the mesh (row-major over its axes). A dimension
    split over mesh axes ``(a, b)`` is cut into ``|a| x |b|`` shards, ``a``
    major; a device holds the shard its coordinates on those axes select.
    """
    names, sizes = list(mesh), list(mesh.values())
    entries = (*spec, *[None] * (ndim - len(spec)))
    shards: dict[tuple[int, ...], list[int]] = {}
    for device, coords in enumerate(np.ndindex(*sizes)):  # device ids: row-major positions
        index = []
        for entry in entries:
            axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
            shard = 0
            for axis in axes:  # mixed radix over the dimension's mesh axes, the first one major
                shard = shard * mesh[axis] + coords[names.index(axis)]
            index.append(shard)
        shards.setdefault(tuple(index), []).append(device)
    return dict(sorted(shards.items()))


def plot_report(report: Report, path: str, max_panels: int = 8) -> None:
    """Draw, per parameter, the array cut into the shards devices hold, each shard labelled with them.

    In the spirit of ``jax.debug.visualize_array_sharding``, for a whole model
    at once (the first ``max_panels`` arrays). 1-D arrays are drawn as one row.
    """
    import matplotlib  # an optional extra: imported only to draw

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report.rows[:max_panels]
    fig, axes = plt.subplots(1, len(rows), figsize=(2.6 * len(rows), 2.8), squeeze=False)
    colors = plt.get_cmap("tab20")
    for ax, row in zip(axes[0], rows):
        leaf = row.leaf
        shape = leaf.shape if len(leaf.shape) == 2 else (1, math.prod(leaf.shape))
        shards = device_shards(report.mesh, leaf.spec if len(leaf.shape) == 2 else _flat_spec(leaf.spec), 2)
        counts = [max(index[d] for index in shards) + 1 for d in range(2)]
        for (i, j), devices in shards.items():
            corner, size = (j / counts[1], 1 - (i + 1) / counts[0]), (1 / counts[1], 1 / counts[0])
            ax.add_patch(plt.Rectangle(corner, *size, facecolor=colors(devices[0] % 20), edgecolor="white"))
            label = ",".join(map(str, devices)) if len(devices) <= 4 else f"{devices[0]}..{devices[-1]}"
            ax.text(
                (j + 0.5) / counts[1], 1 - (i + 0.5) / counts[0], label, ha="center", va="center", fontsize=7
            )
        ax.set(xticks=[], yticks=[], title=f"{leaf.path}\n{shape} {leaf.spec}")
        ax.title.set_fontsize(7)
    fig.suptitle(f"mesh {report.mesh}: which devices hold each shard", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _flat_spec(spec: jax.sharding.PartitionSpec) -> jax.sharding.PartitionSpec:
    """A 1-D array drawn as one row: its only dimension becomes the columns."""
    return jax.sharding.PartitionSpec(None, *tuple(spec)[:1])


def plot_comparison(comparison: Comparison, path: str) -> None:
    """Save a horizontal bar chart: per candidate, the compute the communication can hide behind
    (2/3 of the step's FLOPs) and the communication, on a log scale; the fastest on top."""
    import matplotlib  # an optional extra: imported only to draw

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    candidates = [c for c in comparison.candidates if c.cost is not None][::-1]
    names = [f"{c.style} {'x'.join(map(str, c.mesh.values()))}" for c in candidates]
    hidden = [c.cost.overlap * c.cost.compute_s * 1e6 for c in candidates if c.cost]
    comms = [c.cost.comm_s * 1e6 for c in candidates if c.cost]
    fig, ax = plt.subplots(figsize=(6.4, 0.32 * len(candidates) + 1.6))
    rows = range(len(candidates))
    ax.barh([r + 0.2 for r in rows], hidden, height=0.4, label="backward-pass compute (µs)", color="tab:blue")
    ax.barh([r - 0.2 for r in rows], comms, height=0.4, label="communication (µs)", color="tab:orange")
    ax.set(yticks=list(rows), yticklabels=names, xscale="log", xlabel="µs per step, predicted")
    ax.set_title(f"compute vs communication on {comparison.hardware.name} (fastest on top)", fontsize=9)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=2, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def terms_of(budgets: Iterable[Budget]) -> list[str]:
    """Every term of ``budgets``, in the order they name them: each new one after the term before it."""
    order: list[str] = []
    for b in budgets:
        names = list(b.terms)
        for i, name in enumerate(names):
            if name not in order:
                before = [known for known in names[:i] if known in order]
                order.insert(order.index(before[-1]) + 1 if before else 0, name)
    return order


def plot_budgets(panels: dict[str, dict[str, Budget]], path: str, title: str) -> None:
    """The anatomy of a step's memory: per panel (a precision, say), one stacked bar per style of its
    ``memory.Budget``'s terms, bytes per device; the terms in the order the budgets name them."""
    import matplotlib  # an optional extra: imported only to draw

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    terms = terms_of([b for budgets in panels.values() for b in budgets.values()])
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.2), sharey=True, squeeze=False)
    for ax, (panel, budgets) in zip(axes[0], panels.items()):
        bottom = np.zeros(len(budgets))
        for i, term in enumerate(terms):
            sizes = np.array([b.terms.get(term, 0.0) / 1e6 for b in budgets.values()])
            ax.bar(list(budgets), sizes, bottom=bottom, label=term, color=plt.get_cmap("tab10")(i))
            bottom += sizes
        ax.set(title=panel, ylabel="MB per device, predicted" if ax is axes[0][0] else None)
    axes[0][-1].legend(fontsize=7, loc="upper right")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


TITLES = {"loss": "loss", "acc": "accuracy"}


def plot_history(history: list[dict[str, Any]], path: str, learning_rate: Any = None) -> None:
    """One panel per measure (the loss first: every logged step and each record's values; then each
    metric, in training and in evaluation), and the learning rate, against epochs or steps (matplotlib)."""
    import matplotlib  # an optional extra: imported only to draw

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    unit = "epoch" if "epoch" in history[-1] else "step"
    per_epoch = history[-1]["steps"] if unit == "epoch" else 1  # the curve and the rate are per step
    names = list(dict.fromkeys(name for record in history for name in record if name not in BOOKKEEPING))
    measures = sorted({_measure(name) for name in names}, key="loss".__ne__)
    fig, axes = plt.subplots(1, len(measures) + 1, figsize=(4.3 * (len(measures) + 1), 3.5))
    curve = [point for record in history for point in record.get("loss_curve", [])]
    axes[0].plot([step / per_epoch for step, _ in curve], [value for _, value in curve], lw=1)
    for ax, measure in zip(axes, measures):
        for name in (name for name in names if _measure(name) == measure):
            records = [record for record in history if name in record]
            label = f"train, per {unit}" if name == "loss" else name.split("_")[0]
            ax.plot([r[unit] for r in records], [r[name] for r in records], marker="o", label=label)
        ax.set(title=TITLES.get(measure, measure), xlabel=unit)
        ax.legend()
    axes[0].set(yscale="log")
    if callable(learning_rate):
        end = history[-1][unit] * per_epoch
        steps = list(range(0, end + 1, max(1, end // 100)))
        axes[-1].plot(
            [step / per_epoch for step in steps], [float(learning_rate(np.asarray(step))) for step in steps]
        )
    axes[-1].set(title="learning rate", xlabel=unit)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _measure(name: str) -> str:
    """``"val_loss"`` -> ``"loss"``, ``"train_acc"`` -> ``"acc"``, ``"loss"`` -> ``"loss"``."""
    return name.split("_", 1)[-1]


TRACE_LEGEND = {
    "host": ("0.82", "host: the step's `train` span (dispatch, then the wait for its loss)"),
    "dispatch": ("tab:green", "host: dispatching the compiled step (PjitFunction)"),
    "op": ("tab:blue", "device: an XLA op (a fusion, a matmul)"),
    "collective": ("tab:red", "device: a collective (the all-reduce: mostly waiting for the others)"),
}
"""``plot_trace``'s colours, and what each means in its legend."""


def plot_trace(steps: list[TracedStep], number: int, path: str, title: str) -> None:
    """Step ``number`` of a ``--profile`` trace (``trace_reading.read_trace``) as a time line: the host's
    lane (each ``train`` span, its dispatch, the gaps between steps) over one lane per device of XLA's
    ops, collectives in red; the steps before and after it faded, the gaps on either side in view."""
    import matplotlib  # an optional extra: imported only to draw

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    at = [step.number for step in steps].index(number)
    step, devices = steps[at], sorted({device for s in steps for device in s.ops}, reverse=True)
    pad = 0.04 * step.host.length
    begin = (steps[at - 1].host.end if at else step.host.start) - pad
    end = (steps[at + 1].host.start if at + 1 < len(steps) else step.host.end) + pad

    def ms(time: float) -> float:  # from the step's start
        return (time - step.host.start) / 1e3

    def bars(spans: Iterable[Span], lane: float, kind: str, alpha: float, height: float = 0.7) -> None:
        shown = [(ms(s.start), s.length / 1e3) for s in spans if s.end > begin and s.start < end]
        ax.broken_barh(shown, (lane - height / 2, height), color=TRACE_LEGEND[kind][0], alpha=alpha, lw=0)

    fig, ax = plt.subplots(figsize=(10, 0.42 * len(devices) + 2.2))
    host = len(devices)  # the top lane
    for other in steps:
        alpha = 1.0 if other is step else 0.25
        bars([other.host], host, "host", alpha, 0.8)
        bars(other.calls, host, "dispatch", alpha, 0.8)
        for lane, device in enumerate(devices):
            ops = other.ops.get(device, ())
            bars([op for op in ops if not op.collective], lane, "op", alpha)
            bars([op for op in ops if op.collective], lane, "collective", alpha)
        if other.gap is not None and begin < other.host.end < end:  # say how long the host gap is
            middle = ms(other.host.end + other.gap / 2)
            ax.annotate(f"gap\n{other.gap / 1e3:.1f} ms", (middle, host + 0.45), ha="center", fontsize=7)
    ax.set(yticks=range(host + 1), yticklabels=[*(f"device {d}" for d in devices), "host (Python)"])
    ax.set(xlim=(ms(begin), ms(end)), ylim=(-0.6, host + 1.1), xlabel=f"ms from step {number}'s start")
    handles = [Patch(color=color, label=label) for color, label in TRACE_LEGEND.values()]
    handles.append(Patch(color=TRACE_LEGEND["op"][0], alpha=0.25, label="the steps before and after"))
    ax.legend(
        handles=handles, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, frameon=False
    )
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


__all__ = [
    "device_shards",
    "plot_budgets",
    "plot_comparison",
    "plot_history",
    "plot_report",
    "plot_trace",
    "report_html",
    "rich_table",
    "show",
    "terms_of",
]
