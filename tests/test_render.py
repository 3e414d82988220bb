"""minishard.run.render: the pictures of the workshop (the report's tables are tested in test_report.py)."""

import pytest

from minishard.costs import HARDWARE, Comparison, Layout, Memory, StepCost
from minishard.run.render import plot_comparison

V5P = HARDWARE["v5p"]


def test_plot_comparison_draws_one_bar_pair_per_layout(tmp_path):
    pytest.importorskip("matplotlib")

    def cost(flops, seconds):
        return StepCost(V5P, flops, 0.0, (("all-reduce", 1000, seconds),), Memory(1, 1, 1))

    layouts = (Layout("tp", {"model": 8}, cost(1e9, 1e-5)), Layout("dp", {"data": 8}, cost(1e9, 2e-5)))
    comparison = Comparison(V5P, (*layouts, Layout("fsdp", {"data": 8}, None, "does not divide")))
    plot_comparison(comparison, str(tmp_path / "compare.png"))
    assert (tmp_path / "compare.png").read_bytes()[:4] == b"\x89PNG"
    assert "does not divide" in str(comparison) and str(comparison).splitlines()[1].startswith("* tp")
