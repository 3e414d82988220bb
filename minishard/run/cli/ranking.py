"""``minishard explain --compare --size NAME``: every layout of a named size, ranked (``minishard.layouts``).

Nothing is built or compiled: the ranking takes the size's shapes (``--size``), the chip's
numbers (``--hardware``), the chips (``--devices``) and the batch in tokens (``--batch-size``,
``4M`` being 4 x 1024 x 1024 as the scaling book writes it). It prints the run's size, the days
a token budget takes (``--tokens``, each size's paper's by default, at ``--mfu``) and the book's
rules, then the fastest layouts that fit, the best of every other kind, and why the runner-up
loses. Their memory is mixed precision's, each block recomputed, unless ``--remat`` names
another policy (``layouts.Kept``); their step counts the FLOPs that policy recomputes
(``layouts.recomputed_flops``), which the first line prints beside the model's, and MFU leaves out.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Iterable

from minishard import layouts, serving
from minishard.census import human_bytes
from minishard.costs import critical_batch, mixed_critical_batch
from minishard.hardware import hardware_named
from minishard.layouts import human_seconds
from minishard.run.cli.ignored import STEP_WORK, refuse_ignored

__all__ = [
    "BINARY",
    "BUDGET_FLAGS",
    "DECIMAL",
    "MFU",
    "TOP",
    "TRAINED_ON",
    "add_arguments",
    "check",
    "count",
    "fraction",
    "layout_spec",
    "print_ranking",
    "refuse_budget",
    "token_count",
]

BINARY = {"K": 2**10, "M": 2**20, "G": 2**30}
"""What a count's K, M and G multiply it by: binary, as the scaling book's "4M tokens" are 4 x 1024 x 1024."""
DECIMAL = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}
"""What a token budget's suffix multiplies it by: decimal, as the papers' "15T tokens" are 15e12."""
TRAINED_ON = {"llama2-13b": 2e12, "llama3-8b": 15e12, "llama3-70b": 15e12, "llama3-405b": 15.6e12}
TRAINED_ON["palm-540b"] = 780e9
"""Tokens each size's paper trained it on: LLaMA 2's 2T, LLaMA 3's "over 15T" (15.6T for 405B),
PaLM's 780B (Megatron's 1T was a benchmark, trained on none)."""
MFU = 0.4
"""The share of the chips' peak the token budget is priced at without ``--mfu``: the scaling book's 40%."""
BUDGET_FLAGS = {
    "budget": ("--tokens", "the days a token budget takes"),
    "mfu": ("--mfu", "the days a token budget takes"),
    "layout": ("--layout", "where a layout ranks"),
    "unfused": ("--unfused-attention", "the memory of attention's scores"),
    "repeats": ("--repeats", "a pipeline's interleaved schedule"),
}
"""The flags only ``--compare --size`` reads, by their names in ``args``: the flag, what it prices."""
TOP = 5
"""The fastest layouts that fit, shown before the best of each other kind."""


def add_arguments(add: Callable[..., object]) -> None:
    """``--tokens`` and ``--mfu``: the run's token budget, priced in days beside the ranking."""
    add("--tokens", dest="budget", type=token_count, help="with --compare --size: tokens to train on (15T)")
    add("--mfu", type=fraction, help=f"with --compare --size: the budget's share of peak (default {MFU})")
    add("--layout", type=layout_spec, help="with --compare --size: price it, say its rank (tp=8,pp=16)")
    add(
        "--unfused-attention",
        dest="unfused",
        action="store_const",
        const=True,
        help="with --compare --size: attention keeps its T x T scores (no FlashAttention)",
    )
    add("--repeats", type=int, help="with --compare --size: layer chunks a pipeline stage holds")


def token_count(text: str) -> float:
    """An argparse type for ``--tokens``: a positive number, with K, M, B (or G) or T for ``DECIMAL``'s.

    >>> token_count("15T"), token_count("1.5e12"), token_count("300B")
    (15000000000000.0, 1500000000000.0, 300000000000.0)
    """
    digits, scale = (text[:-1], DECIMAL[text[-1].upper()]) if text[-1:].upper() in DECIMAL else (text, 1)
    try:
        value = float(digits) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of tokens (15T, 1.5e12), got {text!r}") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a positive number of tokens, got {text}")
    return value


def layout_spec(text: str) -> layouts.Layout:
    """An argparse type for ``--layout``: ``name=ways`` pairs of ``layouts.PLACEMENT``'s dimensions.

    >>> str(layout_spec("dp=128,tp=8,pp=16"))
    'dp 128 x tp 8 x pp 16'
    """
    ways: dict[str, int] = {}
    for pair in text.split(","):
        name, _, size = pair.partition("=")
        if name.strip() not in layouts.PLACEMENT or not size.strip().isdigit() or int(size) < 1:
            dims = ", ".join(layouts.PLACEMENT)
            raise argparse.ArgumentTypeError(f"expected name=ways pairs of {dims} (tp=8,pp=16), got {pair!r}")
        ways[name.strip()] = int(size)
    return layouts.Layout(**ways)


def fraction(text: str) -> float:
    """An argparse type for ``--mfu``: a share of the peak, above 0 and at most 1.

    >>> fraction("0.4")
    0.4
    """
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a share of the peak (0.4), got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be above 0 and at most 1 (0.4 is 40%), got {text}")
    return value


def refuse_budget(args: argparse.Namespace, error: Callable[[str], object]) -> None:
    """``--tokens``, ``--mfu`` and ``--layout`` price a named size's run: only ``--compare --size``
    reads them."""
    if args.size and args.compare and not args.decode:
        return
    for name, (flag, what) in BUDGET_FLAGS.items():
        if getattr(args, name) is not None:
            error(f"argument {flag}: only --compare --size takes it ({what})")


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
    # --quantize: decode.check refused it already; --remat prices the memory of its policy
    priced_flags = [flag for flag in model_flags if flag != "remat"]
    refuse_ignored(args, (*STEP_WORK, "parallel"), priced_flags, why, error)
    if getattr(args, "remat", None) and getattr(args, "check", None):
        error("argument --remat: --check compiles the GPT's step without remat; drop --remat")
    if args.precision != "fp32":
        error("argument --precision: --compare --size prices mixed precision (bf16, float32 master)")
    if args.hardware is None:
        error("argument --hardware: --compare --size ranks layouts on a chip; add one (e.g. --hardware v5p)")
    if args.batch_size is None:
        error("argument --batch-size: --compare --size needs the batch in tokens (e.g. 4M)")
    try:  # devices beyond a node are priced at the chip's scale-out figure, which it must have
        hardware_named(args.hardware).bandwidth(args.devices)
    except ValueError as why:
        error(f"argument --devices: {why}")
    # a pipeline's microbatches are whole sequences: of a learned table's positions, or LLaMA's 4,096
    args.context = args.context or serving.SIZES[args.size].position_rows or layouts.CONTEXT
    tokens, devices, context = args.batch_size, args.devices, args.context
    if tokens < devices:
        error(f"argument --batch-size: {tokens:,} tokens leave some of {devices:,} devices none")
    if tokens % context:
        error(f"argument --batch-size: {tokens:,} tokens are not whole --context {context} sequences")
    if args.repeats is not None and args.repeats < 1:
        error(f"argument --repeats: must be 1 or more chunks a stage, got {args.repeats}")
    if args.layout is not None:
        _check_layout(args.layout, serving.SIZES[args.size], args, error)
    args.budget, args.mfu = args.budget or TRAINED_ON.get(args.size), args.mfu or MFU


def _check_layout(
    layout: layouts.Layout, model: serving.Decoder, args: argparse.Namespace, error: Callable[[str], object]
) -> None:
    """``--layout`` splits what the size can split: its devices, heads, layers and sequence."""
    size = args.size
    tp, pp, cp, ep = (layout[name] for name in ("tp", "pp", "cp", "ep"))
    r = (args.repeats or 1) if pp > 1 else 1  # a pipeline's chunks a stage
    chunks = f" x --repeats {r}" if r > 1 else ""
    fullest = math.ceil(model.layers / pp)  # the fullest stage's layers
    m = layouts.microbatches(layout, args.batch_size, args.hardware, args.context)
    why = {
        f"its {layout.devices:,} devices are not --devices {args.devices:,}": layout.devices != args.devices,
        f"tp {tp} does not divide {size}'s {model.heads} heads": bool(model.heads % tp),
        f"tp {tp} does not divide {size}'s MLP of {model.hidden:,}": bool(model.hidden % tp),
        f"pp {pp} is more stages than {size}'s {model.layers} layers": pp > model.layers,
        f"pp {pp}{chunks} is more chunks than a stage's layers ({fullest} at most)": r > fullest,
        f"pp {pp} at --repeats {r} runs {m} microbatches, fewer than its stages": r > 1 and m < pp,
        f"cp {cp} does not divide the --context {args.context:,} sequence": bool(args.context % cp),
        f"ep {ep} splits a mixture's experts, and {size} has none": ep > 1 and not model.experts,
        f"ep {ep} does not divide {size}'s {model.experts} experts": bool(model.experts % ep),
    }
    for reason in (reason for reason, wrong in why.items() if wrong):
        error(f"argument --layout: {layout}: {reason}")


def print_ranking(args: argparse.Namespace) -> int:
    """The size, its token budget in days, the book's rules on this chip, the ranked table, and
    why the runner-up loses."""
    model, chip = serving.SIZES[args.size], hardware_named(args.hardware)
    devices, tokens, context = args.devices, args.batch_size, args.context
    kept = layouts.Kept(remat=getattr(args, "remat", None) or "full")  # mixed precision's memory
    flops = layouts.train_flops(model, 1, context)
    again = layouts.recomputed_flops(model, 1, context, kept.remat)  # not the model's: not in MFU
    count = f"{model.params / 1e9:.2f}e9" if model.params >= 1e9 else f"{model.params:,}"
    print(f"{args.size}: {count} parameters, {flops:.3g} FLOPs a token (attention's at {context:,})", end="")
    print(f", {again:.3g} more recomputed (--remat {kept.remat}); {devices:,} {chip.name}")
    sequences = f"{tokens // context:,} sequences of {context:,}"
    print(f"batch {tokens:,} tokens ({sequences}): {tokens / devices:,.0f} per device")
    if chip.topology == "torus":
        fsdp_axes = max(1, chip.axes - 1)  # FSDP + TP: TP on one axis, FSDP on the others
        pure = critical_batch(chip, n_axes=chip.axes)
        mixed = mixed_critical_batch(chip, model.hidden, fsdp_axes)
        optimal = layouts.optimal_fsdp(tokens, devices, model.hidden, fsdp_axes)
        print(f"the book's rules: pure FSDP needs {pure:,.0f} tokens per device (C/W over {chip.axes} axes);")
        print(
            f"  FSDP + TP {mixed:,.0f} (4 a^2 / M_X M_Y F), at X_opt = {optimal:,.0f} (sqrt(B/F M_X/M_Y N))"
        )
    repeats = args.repeats or 1
    ranking = layouts.rank(model, tokens, devices, chip, context, not args.unfused, kept, repeats)
    print(ranking.table(TOP))
    print("(* the fastest that fits; flips at: the tokens per device above which it is compute-bound;")
    print(" [...]: a data shard (dp x fsdp) holds part of a sequence, its keys and values gathered as")
    print(" cp's are, or an uneven share of them, priced as the average: the largest share waits longer)")
    fit = [cost for cost in ranking.costs if cost.fits]
    if args.budget:
        print(_days(args, model, fit[0] if fit else None))
    if len(fit) > 1:
        print(_runner_up(fit[0], fit[1]))
    if args.layout is not None:
        fused = not args.unfused
        theirs = args.layout
        r = repeats if theirs["pp"] > 1 else 1
        layout = layouts.price(model, theirs, tokens, chip, kept, context, fused=fused, repeats=r)
        print(_placed(layout, fit))
    if (fastest := min(ranking.costs, key=lambda cost: cost.step_s)) not in fit[:1]:
        needs, has = human_bytes(int(fastest.memory.total)), human_bytes(int(chip.hbm_bytes))
        step = human_seconds(fastest.step_s)
        print(f"faster still, {fastest.layout} ({step}) does not fit: {needs} a device, over {has}")
    return 0


def _days(args: argparse.Namespace, model: serving.Decoder, best: layouts.LayoutCost | None) -> str:
    """The token budget: its FLOPs, its days at ``--mfu``, and at the MFU the fastest layout predicts."""
    flops, mfu, chips = layouts.train_flops(model, args.budget, args.context), args.mfu, args.devices
    days = layouts.train_seconds(model, args.budget, chips, args.hardware, mfu, args.context) / 86400
    line = f"{args.budget / 1e12:.3g}T tokens: {flops:.3g} FLOPs, {days:,.1f} days at {mfu:.0%} MFU"
    if best is None:
        return line
    seconds = layouts.train_seconds(model, args.budget, chips, args.hardware, best.mfu, args.context)
    predicted = seconds / 86400
    return f"{line}; {predicted:,.1f} at the {best.mfu:.0%} its step predicts (perfect overlap, no stalls)"


def _placed(cost: layouts.LayoutCost, fit: list[layouts.LayoutCost]) -> str:
    """Where ``--layout`` ranks among those that fit, or what it would need to."""
    step, line = human_seconds(cost.step_s), f"--layout {cost.layout}"
    if not cost.fits:
        needs, has = human_bytes(int(cost.memory.total)), human_bytes(int(cost.hardware.hbm_bytes))
        return f"{line}: {step}, {cost.verdict}, but does not fit: {needs} a device, over {has}"
    place = 1 + sum(other.step_s < cost.step_s for other in fit)
    utilization = f"{cost.mfu:.0%} MFU, {cost.hfu:.0%} HFU"  # HFU: the recomputed pass counted
    return f"{line}: {step}, {utilization}, {cost.verdict}: ranks {place:,} of the {len(fit):,} that fit"


def _runner_up(best: layouts.LayoutCost, second: layouts.LayoutCost) -> str:
    """Why the second loses, by the term that costs it most: the collectives its matmuls do not hide,
    or its pipeline's bubble (their matmuls are the same, 6PB/N FLOPs a device); when both are as
    fast, how much of the time their collectives fill, or the memory."""
    if second.step_s == best.step_s and round(second.bound, 3) > round(best.bound, 3):
        return (
            f"runner-up {second.layout}: as fast, {best.verdict}; its collectives fill {second.bound:.1%} "
            f"of the time its matmuls hide them, against {best.bound:.1%}"
        )
    if second.step_s == best.step_s:
        held = [human_bytes(int(cost.memory.total)) for cost in (second, best)]
        return f"runner-up {second.layout}: as fast, as busy; it holds {held[0]} a device, against {held[1]}"
    lost, ms = human_seconds(second.step_s - best.step_s), human_seconds
    if second.idle_s - best.idle_s > second.waiting_s - best.waiting_s:
        bubble = f"{second.bubble:.1%} of the step, {second.microbatches} microbatches"
        return (
            f"runner-up {second.layout} loses {lost} a step to its pipeline's bubble: it idles "
            f"{ms(second.idle_s)} ({bubble}), against {ms(best.idle_s)}"
        )
    return (
        f"runner-up {second.layout} loses {lost} a step to communication: it waits {ms(second.waiting_s)} "
        f"on collectives its matmuls do not hide ({_sent(second)}), against {ms(best.waiting_s)} "
        f"({_sent(best)})"
    )


def _sent(cost: layouts.LayoutCost) -> str:
    """A forward pass's collectives beside its matmuls: of the weights + of the activations."""
    weights, activations = human_seconds(cost.forward.weights), human_seconds(cost.forward.activations)
    return f"{weights} + {activations} sent beside {human_seconds(cost.compute_s)} of matmuls a forward pass"
