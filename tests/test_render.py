"""minishard.run.render: the pictures of the workshop (the report's tables are tested in test_report.py)."""

import pytest

from minishard.costs import HARDWARE, Candidate, Comparison, Memory, StepCost
from minishard.memory import Budget
from minishard.run.render import plot_budgets, plot_comparison, plot_history, plot_trace, terms_of
from minishard.run.trace_reading import Span, TracedStep

V5P = HARDWARE["v5p"]


def test_plot_comparison_draws_one_bar_pair_per_layout(tmp_path):
    pytest.importorskip("matplotlib")

    def cost(flops, seconds):
        return StepCost(V5P, flops, 0.0, (("all-reduce", 1000, seconds),), Memory(1, 1, 1))

    tp, dp = Candidate("tp", {"model": 8}, cost(1e9, 1e-5)), Candidate("dp", {"data": 8}, cost(1e9, 2e-5))
    candidates = (tp, dp)
    comparison = Comparison(V5P, (*candidates, Candidate("fsdp", {"data": 8}, None, "does not divide")))
    plot_comparison(comparison, str(tmp_path / "compare.png"))
    assert (tmp_path / "compare.png").read_bytes()[:4] == b"\x89PNG"
    assert "does not divide" in str(comparison) and str(comparison).splitlines()[1].startswith("* tp")


def test_plot_history_draws_any_metrics_by_epochs_or_by_steps(tmp_path):
    pytest.importorskip("matplotlib")
    curve = {"seconds": 1.0, "loss_curve": [[2, 2.5]]}  # fit's records
    by_epoch = [
        {"epoch": e, **curve, "loss": 1 / e, "train_acc": 0.8, "steps": 4, "test_acc": 0.9} for e in (1, 2)
    ]
    by_step = [  # a language model's: a val loss every 4 steps, and the test loss after the last
        {"step": 4, **curve, "loss": 2.0, "steps": 4, "val_loss": 2.1},
        {"step": 6, **curve, "loss": 1.5, "steps": 2, "val_loss": 1.9, "test_loss": 1.8},
    ]
    for name, history in (("epochs.svg", by_epoch), ("steps.svg", by_step)):
        plot_history(history, str(tmp_path / name), learning_rate=lambda step: 0.1 / (1 + step))
    epochs, steps = ((tmp_path / name).read_text() for name in ("epochs.svg", "steps.svg"))
    assert all(f"<!-- {title} -->" in epochs for title in ("loss", "accuracy", "learning rate", "epoch"))
    assert all(f"<!-- {label} -->" in steps for label in ("val", "test", "train, per step", "learning rate"))
    assert "accuracy" not in steps  # no metric it does not have


def test_plot_budgets_stacks_every_term_of_every_style(tmp_path):
    pytest.importorskip("matplotlib")
    dp = Budget({"parameters": 4e6, "gradients": 4e6, "reduced gradients": 4e6})
    fsdp = Budget({"parameters": 1e6, "gradients": 1e6, "gathered": 2e5})
    assert terms_of([fsdp, dp]) == ["parameters", "gradients", "reduced gradients", "gathered"]
    plot_budgets({"fp32": {"dp": dp, "fsdp": fsdp}, "bf16": {"dp": dp}}, str(tmp_path / "bars.svg"), "a step")
    drawn = (tmp_path / "bars.svg").read_text()
    assert all(f"<!-- {text} -->" in drawn for text in ("fp32", "bf16", "reduced gradients", "gathered"))


def test_plot_trace_draws_the_host_and_a_lane_per_device_with_the_gaps_between_steps(tmp_path):
    pytest.importorskip("matplotlib")

    def step(number, start, gap):  # µs, as a trace's clock: 100 ms steps, the all-reduce in the middle
        ops = (Span("fusion.1", start + 5e3, start + 40e3), Span("all-reduce.2", start + 40e3, start + 90e3))
        calls = (Span("PjitFunction(f)", start, start + 5e3),)
        return TracedStep(number, Span("train", start, start + 100e3), calls, {0: ops, 1: ops}, gap)

    steps = [step(2, 0, 20e3), step(3, 120e3, 30e3), step(4, 250e3, None)]
    plot_trace(steps, 3, str(tmp_path / "trace.svg"), "a step")
    drawn = (tmp_path / "trace.svg").read_text()
    labels = (
        "a step",
        "host (Python)",
        "device 0",
        "device 1",
        "gap",
        "device: a collective",
        "ms from step 3",
    )
    assert all(f"<!-- {label}" in drawn for label in labels), [
        label for label in labels if label not in drawn
    ]
    assert "20.0 ms" in drawn and "30.0 ms" in drawn  # the host gaps before and after step 3
    assert "device 2" not in drawn
