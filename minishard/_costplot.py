"""The picture of ``minishard.costs.compare``: compute against communication, one bar pair per layout.

Kept apart from ``costs`` (a chapter of at most 300 lines) because drawing is not
the lesson; matplotlib is an optional extra, imported only to draw.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from minishard.costs import Comparison


def plot_comparison(comparison: Comparison, path: str) -> None:
    """Save a horizontal bar chart: per layout, the compute the communication can hide behind
    (2/3 of the step's FLOPs) and the communication, on a log scale; the fastest on top."""
    import matplotlib  # an optional extra: imported only to draw

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layouts = [layout for layout in comparison.layouts if layout.cost is not None][::-1]
    names = [f"{layout.style} {'x'.join(map(str, layout.mesh.values()))}" for layout in layouts]
    hidden = [layout.cost.overlap * layout.cost.compute_s * 1e6 for layout in layouts if layout.cost]
    comms = [layout.cost.comm_s * 1e6 for layout in layouts if layout.cost]
    fig, ax = plt.subplots(figsize=(6.4, 0.32 * len(layouts) + 1.6))
    rows = range(len(layouts))
    ax.barh([r + 0.2 for r in rows], hidden, height=0.4, label="backward-pass compute (µs)", color="tab:blue")
    ax.barh([r - 0.2 for r in rows], comms, height=0.4, label="communication (µs)", color="tab:orange")
    ax.set(yticks=list(rows), yticklabels=names, xscale="log", xlabel="µs per step, predicted")
    ax.set_title(f"compute vs communication on {comparison.hardware.name} (fastest on top)", fontsize=9)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=2, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
