"""``minishard explain --compare --size NAME``: every layout of a named size, ranked (``minishard.layouts``).

Nothing is built or compiled: the ranking takes the size's shapes (``--size``), the chip's
numbers (``--hardware``), the chips (``--devices``) and the batch in tokens (``--batch-size``,
``4M`` being 4 x 1024 x 1024 as the scaling book writes it). It prints the run's size and the
book's rules, then the fastest layouts that fit, the best of every other kind, and why the
runner-up loses.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable

from minishard import layouts, serving
from minishard.census import human_bytes
from minishard.costs import critical_batch
from minishard.hardware import hardware_named
from minishard.run.cli.ignored import STEP_WORK, refuse_ignored

__all__ = ["BINARY", "TOP", "check", "count", "print_ranking"]

BINARY = {"K": 2**10, "M": 2**20, "G": 2**30}
"""What a count's K, M and G multiply it by: binary, as the scaling book's "4M tokens" are 4 x 1024 x 1024."""
TOP = 5
"""The fastest layouts that fit, shown before the best of each other kind."""


def count(text: str) -> int:
    """An argparse type for ``--batch-size``: an int >= 1, with K, M or G for ``BINARY``'s multiples.

    >>> count("4M"), count("512k"), count("96")
    (4194304, 524288, 96)
    """
    digits, scale = (text[:-1], BINARY[text[-1].upper()]) if text[-1:].upper() in BINARY else (text, 1)
    try:
        value = int(digits) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer (or 512K, 4M), got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


def check(args: argparse.Namespace, model_flags: Iterable[str], error: Callable[[str], object]) -> None:
    """A chip, a batch in tokens, at least a token per device, whole sequences of ``--context``; none
    of the flags it would ignore. Before any work."""
    why = "--compare --size ranks layouts from a size's shapes"
    # --quantize: decode.check refused it already
    refuse_ignored(args, (*STEP_WORK, "parallel"), model_flags, why, error)
    if args.precision != "fp32":
        error("argument --precision: --compare --size prices mixed precision (bf16, float32 master)")
    if args.hardware is None:
        error("argument --hardware: --compare --size ranks layouts on a chip; add one (e.g. --hardware v5p)")
    if args.batch_size is None:
        error("argument --batch-size: --compare --size needs the batch in tokens (e.g. 4M)")
    tokens, devices, context = args.batch_size, args.devices, args.context
    if tokens < devices:
        error(f"argument --batch-size: {tokens:,} tokens leave some of {devices:,} devices none")
    if context and tokens % context:
        error(f"argument --batch-size: {tokens:,} tokens are not whole --context {context} sequences")


def print_ranking(args: argparse.Namespace) -> int:
    """The size, the book's rules on this chip, the ranked table, and why the runner-up loses."""
    model, chip = serving.SIZES[args.size], hardware_named(args.hardware)
    devices, tokens, context = args.devices, args.batch_size, args.context
    flops = layouts.train_flops(model, 1)
    print(f"{args.size}: {model.params / 1e9:.2f}e9 parameters, {flops:.3g} FLOPs a token", end="")
    print(f"; {devices:,} {chip.name}")
    sequences = f" ({tokens // context:,} sequences of {context:,})" if context else ""
    print(f"batch {tokens:,} tokens{sequences}: {tokens / devices:,.0f} per device")
    if chip.topology == "torus":
        fsdp_axes = max(1, chip.axes - 1)  # FSDP + TP: TP on one axis, FSDP on the others
        pure = critical_batch(chip, n_axes=chip.axes)
        mixed = layouts.mixed_critical_batch(chip, model.hidden, fsdp_axes)
        optimal = layouts.optimal_fsdp(tokens, devices, model.hidden, fsdp_axes)
        print(f"the book's rules: pure FSDP needs {pure:,.0f} tokens per device (C/W over {chip.axes} axes);")
        print(
            f"  FSDP + TP {mixed:,.0f} (4 a^2 / M_X M_Y F), at X_opt = {optimal:,.0f} (sqrt(B/F M_X/M_Y N))"
        )
    ranking = layouts.rank(model, tokens, devices, chip)
    print(ranking.table(TOP))
    print("(* the fastest that fits; flips at: the tokens per device above which it is compute-bound)")
    fit = [cost for cost in ranking.costs if cost.fits]
    if len(fit) > 1:
        print(_runner_up(fit[0], fit[1]))
    return 0


def _runner_up(best: layouts.LayoutCost, second: layouts.LayoutCost) -> str:
    """Why the second loses: what each sends in a forward pass (weights, activations) beside its
    matmuls; when both are as fast, how much of the time their collectives fill, or the memory."""

    def sent(cost: layouts.LayoutCost) -> str:
        weights, activations = cost.forward.weights * 1e3, cost.forward.activations * 1e3
        return f"{weights:.3g} + {activations:.3g} = {weights + activations:.3g} ms"

    if second.step_s == best.step_s and round(second.bound, 3) > round(best.bound, 3):
        return (
            f"runner-up {second.layout}: as fast, {best.verdict}; its collectives fill {second.bound:.1%} "
            f"of the time its matmuls hide them, against {best.bound:.1%}"
        )
    if second.step_s == best.step_s:
        held = [human_bytes(int(cost.memory.total)) for cost in (second, best)]
        return f"runner-up {second.layout}: as fast, as busy; it holds {held[0]} a device, against {held[1]}"
    return (
        f"runner-up {second.layout}: a forward pass of {best.compute_s * 1e3:.3g} ms of matmuls sends "
        f"{sent(second)} (weights + activations), against {sent(best)}"
    )
