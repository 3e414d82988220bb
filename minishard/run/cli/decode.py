"""``minishard explain --decode``: serving a named model size, priced on a chip (``minishard.serving``).

Nothing is built or compiled: the roofline takes the size's shapes (``--size``, its key and
value heads ``--kv-heads`` if given: grouped-query attention), the
chip's numbers (``--hardware``), the chips (``--devices``), the context (``--context``)
and the largest batch (``--batch-size``), and prints prefill, a decode step, the cache
that fits beside the weights, and latency against throughput for batch 1 ... B.
``--parallel tp | dp | 2d | cp | dp+cp`` then compiles one decode step of a ``MINIATURE`` of the size
on ``--devices`` simulated devices and prints what it sends (``sample.explained``).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterable

import jax

from minishard import serving
from minishard.census import human_bytes
from minishard.hardware import hardware_named
from minishard.models.gpt import GPT
from minishard.run.cli.accelerators import first_devices
from minishard.run.cli.ignored import STEP_WORK, refuse_ignored
from minishard.run.cli.sample import DECODE_STYLES, decoder, explained
from minishard.styles import mesh_rules

__all__ = [
    "BAR",
    "DECODE_FLAGS",
    "DEFAULT_CONTEXT",
    "MINIATURE",
    "add_arguments",
    "batches",
    "check",
    "print_census",
    "print_decode",
]

DEFAULT_CONTEXT = 8192
"""Tokens of context without ``--context`` (the scaling book's tables')."""
BAR = 30
"""Characters of the largest throughput's bar: latency (the rows) against throughput, as a picture."""
DECODE_FLAGS = {"size": "--size", "serve_format": "--quantize"}
"""The flags only ``--decode`` takes, by their names in ``args``."""


def add_arguments(add: Callable[..., object]) -> None:
    """``--decode`` and its own flags, added by ``explain`` beside its others."""
    add("--decode", action="store_true", help="price serving --size on --hardware: prefill, decode, KV cache")
    add(
        "--size",
        choices=list(serving.SIZES),
        help="with --decode or --compare: the model, its shapes from its paper",
    )
    formats = [name for name in serving.FORMATS if serving.number_bytes(name) < 2]
    add(
        "--quantize",
        dest="serve_format",
        choices=formats,
        help="with --decode: weights and KV cache (default bf16)",
    )


def check(args: argparse.Namespace, model_flags: Iterable[str], error: Callable[[str], object]) -> None:
    """Every flag --decode reads, and none it would ignore, before any work; fills the defaults."""
    if not args.decode:
        for name, flag in DECODE_FLAGS.items():
            takers = "--decode or --compare" if name == "size" else "--decode"  # --compare ranks its layouts
            if getattr(args, name) is not None and not (name == "size" and args.compare):
                error(f"argument {flag}: only {takers} takes it")
        return
    why = "--decode prices serving a --size, not a train step"
    model_flags = [name for name in model_flags if name != "kv_heads"]  # grouped: priced
    refuse_ignored(args, ("compare", *STEP_WORK), model_flags, why, error)
    if args.hardware is None:
        error("argument --hardware: --decode prices serving on a chip; add one (e.g. --hardware v5e)")
    args.size = args.size or next(iter(serving.SIZES))
    args.decoder = _grouped(args, error)
    args.serve_format = args.serve_format or "bfloat16"
    args.context = args.context or DEFAULT_CONTEXT
    largest = int(serving.decode_critical_batch(args.hardware, args.serve_format) // 8 * 8)
    args.batch_size = args.batch_size or max(1, largest)
    if args.parallel is not None:
        _check_census(args, error)


def _grouped(args: argparse.Namespace, error: Callable[[str], object]) -> serving.Decoder:
    """--size's shapes, its key and value heads --kv-heads if given: grouped-query serving, priced
    (``dataclasses.replace(serving.LLAMA2_13B, kv_heads=8)`` from Python)."""
    size, kv_heads = serving.SIZES[args.size], getattr(args, "kv_heads", None)
    if kv_heads is None:
        return size
    if size.heads % kv_heads:
        error(
            f"argument --kv-heads: {kv_heads} must divide {args.size}'s {size.heads} heads "
            "(each group of heads / kv-heads query heads shares one key and value head)"
        )
    return dataclasses.replace(size, kv_heads=kv_heads)


def _check_census(args: argparse.Namespace, error: Callable[[str], object]) -> None:
    """--parallel with --decode: a style decoding is sharded under, its "model" axis splitting the heads."""
    if args.parallel not in DECODE_STYLES:
        styles = ", ".join(DECODE_STYLES)
        error(f"argument --parallel: --decode compiles a decode step under {styles}, not {args.parallel}")
    shape = mesh_rules(args.parallel, args.devices)[0]
    size, ways, context = args.decoder, shape.get("model", 1), MINIATURE["context"]
    if context % shape.get("context", 1):
        error(
            f"argument --devices: {args.parallel} splits the miniature's {context} cached positions over "
            f"context={shape['context']} devices: uneven"
        )
    for count, what in ((size.heads, "heads"), (size.kv_heads, "KV heads")):
        if count % ways:
            error(
                f"argument --parallel: {args.parallel} splits {args.size}'s {count} {what} over model={ways} "
                "devices: uneven; give fewer --devices"
            )


def batches(largest: int) -> tuple[int, ...]:
    """1, the powers of two from 8 below ``largest``, and ``largest``: the book's rows.

    >>> batches(240), batches(4)
    ((1, 8, 16, 32, 64, 128, 240), (1, 4))
    """
    powers = [2**k for k in range(3, largest.bit_length()) if 2**k < largest]
    return tuple(dict.fromkeys((1, *powers, largest)))


def print_decode(args: argparse.Namespace) -> int:
    """The size's prefill, decode steps, cache and latency-throughput table on ``--devices`` chips."""
    model, chips, chip = args.decoder, args.devices, hardware_named(args.hardware)
    weights = model.params * serving.number_bytes(args.serve_format)
    per_token = model.kv_bytes_per_token(args.serve_format)
    cache = per_token * args.context
    fits = serving.cache_fits(model.params, cache, chips, chip, args.serve_format)
    grouped = f" with {model.kv_heads} KV heads" if model != serving.SIZES[args.size] else ""
    print(
        f"{args.size}{grouped} ({model.params / 1e9:.2f}e9 parameters) on {chips} {chip.name}, "
        f"{args.serve_format}"
    )
    print(
        f"weights {human_bytes(int(weights))}; KV cache {per_token:,.0f} B per token, "
        f"{human_bytes(int(cache))} per {args.context:,}-token sequence; "
        f"{fits} sequences fit beside the weights in {human_bytes(int(chips * chip.hbm_bytes))}"
    )
    prefill = serving.prefill_time(model.params, args.context, chips, chip)
    print(f"prefill of {args.context:,} tokens: {prefill * 1e3:.1f} ms (a forward pass, compute-bound)")
    critical = serving.decode_critical_batch(chip, args.serve_format)
    print(f"critical batch: {critical:.0f} sequences (above it a decode step's matmuls are compute-bound)")
    tp = serving.tensor_parallel_time(model, 1, chips, chip)
    print(f"tensor parallelism's all-reduces: {tp * 1e3:.2f} ms per step at batch 1 (not in the steps below)")
    points = serving.latency_throughput(
        model.params, cache, batches(args.batch_size), chips, chip, args.serve_format
    )
    print(f"{'batch':>6} {'step ms':>9} {'tokens/s':>10} {'per chip':>9}  fits  tokens/s, as a bar")
    most = max(p.tokens_per_second for p in points)
    for p in points:
        fit, bar = "yes" if p.batch <= fits else "no ", "#" * round(BAR * p.tokens_per_second / most)
        print(f"{p.batch:6} {p.step * 1e3:9.2f} {p.tokens_per_second:10.2f} {p.per_chip:9.2f}  {fit}   {bar}")
    return print_census(args) if args.parallel else 0


MINIATURE = {"head_dim": 8, "depth": 2, "context": 64}
"""The GPT whose decode step ``--parallel`` compiles: the size's heads and KV heads, these shapes."""


def print_census(args: argparse.Namespace) -> int:
    """One decode step of batch ``--devices`` of a ``MINIATURE`` of ``--size``, compiled under
    ``--parallel``: what each token sends, beside the roofline (bytes scale with width and batch)."""
    if (devices := first_devices(args)) is None:
        return 2
    size, (head_dim, depth, context) = args.decoder, MINIATURE.values()
    width, key = size.heads * head_dim, jax.random.key(0)
    model = jax.eval_shape(
        lambda: GPT(
            context=context, width=width, depth=depth, heads=size.heads, kv_heads=size.kv_heads, key=key
        )
    )
    print(
        f"compiled on {args.devices} simulated devices: a GPT of {args.size}'s {size.heads} heads and "
        f"{size.kv_heads} KV heads, head_dim {head_dim}, {depth} blocks, a context of {context}, float32"
    )
    print(explained(model, decoder(args.parallel, devices), args.devices, args.parallel))
    return 0
