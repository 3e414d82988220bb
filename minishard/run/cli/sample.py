"""``minishard sample``: continue a prompt from a GPT's checkpoint, one character at a time, with a KV cache.

    minishard sample --checkpoint-dir runs/gpt --prompt "ROMEO:" --tokens 300 --temperature 0.8 --seed 0

It needs no data: every checkpoint of ``minishard train --model gpt`` keeps the
model's flags, its style and the vocabulary (``ModelEntry.saved`` and the
``Splits``' ``info``), enough to rebuild the state's shapes and restore into
them, on one device whatever style but ``zero`` trained it. Decoding is the
model entry's ``stream`` (the GPT's: ``minishard.models.gpt.stream``): the prompt
fills a ``KVCache`` per block in one call, then each new character is one jitted
step that reads the cache and appends its own keys and values, printed as soon as
it is drawn (``--tokens 1000000000`` streams). The same seed gives the same text.

``--parallel tp`` decodes on every device: the weights and each block's cache are
placed by ``tp``'s rules (``minishard.styles.mesh_rules``, ``minishard.shard``: the
heads over "model", each device the cache of its own heads) and the prefill and
the decode step are ``Sharded`` under them; the same seed gives the same text as
on one device. ``--batch N`` decodes N continuations of the prompt together (the same
``stream``, its ``batch``), the n-th drawn with ``seed + n`` (so each is the text of that
seed alone), which dp and 2d split over "data". ``--parallel cp`` splits each cache's
positions over "context" (``dp+cp``: and the sequences over "data"): every device keeps a
contiguous share of the slots, attends the new tokens to them alone, and the partial softmaxes
merge across the devices (``minishard.models.attention.cached_attention``); the prompt is
prefilled so too, so any prompt length works. ``--explain`` prints, instead of text, the
collectives of one compiled decode step (``minishard.census.collectives``) and XLA's bytes
accessed beside the weights' and the caches' bytes on one device (``per_device``).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp

from minishard.census import collectives
from minishard.pipeline import StackedModel, unstack
from minishard.precision import PRECISIONS
from minishard.run.checkpoint import Checkpointer
from minishard.run.cli.flags import Error, at_least, positive
from minishard.run.cli.models import MODELS
from minishard.run.cli.styles import style_of
from minishard.run.errors import CheckpointError
from minishard.run.steps import loss_scaled_for
from minishard.run.text_data import Vocabulary
from minishard.sharding import Sharded, make_mesh, shard
from minishard.styles import mesh_rules

__all__ = [
    "DECODE_STYLES",
    "HELP",
    "MOST_BATCH",
    "Stream",
    "add_arguments",
    "check",
    "continuation",
    "per_device",
    "placed",
    "restore",
    "run",
    "sample",
    "decoder",
]

HELP = "continue a prompt from a GPT's checkpoint (decoding with a KV cache); needs no data"
DECODE_STYLES = ("tp", "dp", "2d", "cp", "dp+cp")
"""The styles a decode step is sharded under: the cache's heads, sequences or positions split."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``minishard sample``'s flags: where the checkpoint is, the prompt, how much and how boldly."""
    add = parser.add_argument
    add("--checkpoint-dir", required=True, help="checkpoints of minishard train --model gpt")
    add("--step", type=at_least(0), help="this checkpoint (default: the latest)")
    add("--prompt", default="\n", help="the text to continue (default: a new line)")
    add("--tokens", type=at_least(0), default=300, help="characters to add (default %(default)s)")
    add(
        "--temperature",
        type=positive,
        default=0.8,
        help="below 1: bolder choices of likely characters (default %(default)s)",
    )
    add("--seed", type=at_least(0), default=0, help="the same seed, the same text (default %(default)s)")
    add(
        "--parallel",
        choices=("none", *DECODE_STYLES),
        default="none",
        help="decode on every device, weights and KV cache split as the style says (default: one device)",
    )
    add(
        "--batch",
        type=at_least(1),
        default=1,
        help="N continuations of the prompt at once, the n-th drawn with seed + n (default %(default)s)",
    )
    add(
        "--devices",
        type=at_least(1),
        help="with --parallel: decode on the first N devices (default: all of them)",
    )
    add("--explain", action="store_true", help="print one decode step's collectives and bytes, not text")
    add("--debug", action="store_true", help="show the full traceback of an unexpected error")


def check(args: argparse.Namespace, error: Error) -> argparse.Namespace:
    """The checkpoint's metadata and the prompt, before any array is read; each refusal is one line."""
    if not os.path.isdir(args.checkpoint_dir):
        error(f"argument --checkpoint-dir: {args.checkpoint_dir} is not a directory")
    try:
        with Checkpointer(args.checkpoint_dir, read_only=True, log=_say) as checkpointer:
            args.step, meta = checkpointer.read_meta(args.step)  # a broken latest: the one before, said
    except CheckpointError as e:
        error(f"argument --checkpoint-dir: {e}")
    info: dict[str, Any] = meta.get("info") or {}
    where = f"step {args.step} in {args.checkpoint_dir}"
    entry = MODELS.get(info.get("model") or "")
    if entry is None or entry.stream is None or "vocabulary" not in info:
        error(
            f"argument --checkpoint-dir: {where} is not a language model's "
            f"(it is {info.get('model') or 'unnamed'})"
        )
    if info.get("parallel") == "zero":
        error(
            f"argument --checkpoint-dir: {where} was trained under zero, whose optimizer state is flat "
            "shards of the devices it ran on; sample reads the other styles' checkpoints"
        )
    if not args.prompt:
        error("argument --prompt: it is empty; give at least one character")
    try:
        Vocabulary(info["vocabulary"]).encode(args.prompt)
    except ValueError as e:
        error(f"argument --prompt: {e}")
    flags = {**entry.defaults, **info.get("flags", {})}
    devices = _devices(args, error)
    if args.parallel != "none" and (uneven := _uneven(args.parallel, flags, len(devices))):
        fewer = range(len(devices) - 1, 0, -1)
        fits = next(n for n in fewer if _decodes(args.parallel, flags, args.batch, n))
        error(f"argument --parallel: {uneven}; give --devices {fits} (the first {fits} decode it)")
    shape = mesh_rules(args.parallel, len(devices))[0] if args.parallel != "none" else {}
    if args.batch % shape.get("data", 1):
        error(f"argument --batch: {args.batch} sequences must split evenly over {shape['data']} data devices")
    if args.batch > MOST_BATCH and not args.explain:
        error(
            f"argument --batch: {args.batch:,} continuations print only once all are drawn, "
            f"each step {args.batch:,} characters (minutes of silence); give at most {MOST_BATCH:,}"
        )
    args.decode_devices = devices
    args.info = info
    return args


MOST_BATCH = 1024
"""``--batch``'s most: the texts print when all are drawn (100,000 printed nothing for minutes)."""


def _devices(args: argparse.Namespace, error: Error) -> list[jax.Device]:
    """``--devices N``: the first N devices (only with ``--parallel``); all of them without it."""
    there = jax.devices()
    if args.devices is not None and args.parallel == "none":
        error("argument --devices: only with --parallel (without it, one device decodes)")
    if (args.devices or 0) > len(there):
        error(f"argument --devices: {args.devices} asked, there are {len(there)}")
    return there[: args.devices or len(there)]


def _uneven(parallel: str, flags: dict[str, Any], count: int) -> str | None:
    """Why ``parallel`` on ``count`` devices cannot split the heads or the cache; None if it can."""
    try:
        shape = mesh_rules(parallel, count)[0]
    except ValueError as e:  # no mesh of the style on that many devices
        return str(e)
    heads = int(flags["heads"])
    for split, what in ((heads, "heads"), (int(flags["kv_heads"] or heads), "key and value heads")):
        if split % shape.get("model", 1):
            return f"{parallel} splits {split} {what} over {shape['model']} devices: uneven"
    if (context := int(flags["context"])) % shape.get("context", 1):
        return (
            f"{parallel} splits the cache's {context} positions over {shape['context']} context "
            "devices: uneven"
        )
    return None


def _decodes(parallel: str, flags: dict[str, Any], batch: int, count: int) -> bool:
    """Whether ``count`` devices split the model, its cache and ``batch`` sequences under
    ``parallel``."""
    data = mesh_rules(parallel, count)[0].get("data", 1)
    return not _uneven(parallel, flags, count) and batch % data == 0


def _say(line: str) -> None:
    """What the checkpointer says (a fallback) goes to stderr: stdout is the text."""
    print(line, file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    """Print the prompt and its continuation; a failure is one ``error:`` line."""
    try:
        entry, vocabulary = MODELS[args.info["model"]], Vocabulary(args.info["vocabulary"])
        assert entry.stream is not None  # checked with the flags
        model = restore(args.checkpoint_dir, args.step, args.info)
        devices = args.decode_devices  # --devices N: the first N
        if args.parallel != "none":
            model = placed(model, args.parallel, devices)
        if args.explain:
            print(explained(model, decoder(args.parallel, devices), args.batch, args.parallel))
            return 0
        if args.parallel != "none" or args.batch > 1:
            drawn_rows = entry.stream(
                model,
                vocabulary.encode(args.prompt),
                args.tokens,
                temperature=args.temperature,
                seed=args.seed,
                batch=args.batch,
                step=decoder(args.parallel, devices),
            )
            texts = [args.prompt] * args.batch
            for ids in drawn_rows:
                texts = [text + vocabulary.decode([i]) for text, i in zip(texts, ids)]
            for b, text in enumerate(texts):
                print(*([f"--- seed {args.seed + b}"] if args.batch > 1 else []), text, sep="\n")
            return 0
        stream = entry.stream
        print(args.prompt, end="", flush=True)
        drawn = continuation(
            model, vocabulary, args.prompt, args.tokens, args.temperature, args.seed, stream=stream
        )
        for text in drawn:
            print(text, end="", flush=True)  # as each is drawn: a long continuation streams
        print()
    except CheckpointError as e:
        if args.debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def restore(directory: str, step: int, info: dict[str, Any]) -> Any:
    """The model saved at ``step``: the state rebuilt from ``info`` (its shapes), restored into, one device.

    A pipeline's checkpoint holds the blocks stacked on "stage": they come back as the
    model's blocks (``minishard.pipeline.unstack``), the same function of the same numbers.
    """
    entry, style = MODELS[info["model"]], style_of(info["parallel"])
    settings = argparse.Namespace(**{**entry.defaults, **info["flags"]}, dataset=info["dataset"])
    precision = PRECISIONS[info.get("precision", "fp32")]  # fp16's state carries its loss scale
    optimizer = loss_scaled_for(precision, entry.compiled_optimizer(settings))

    def state() -> dict[str, Any]:
        built = style.build(entry, settings, jax.random.key(0))
        return {"model": built, "opt_state": optimizer.init(built)}

    here = jax.sharding.SingleDeviceSharding(jax.devices()[0])  # shapes only (no numbers drawn), one device
    shapes = jax.eval_shape(state)
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=here), shapes)
    with Checkpointer(directory, read_only=True, log=_say) as checkpointer:
        _, restored, _ = checkpointer.restore(target, step)
    model = restored["model"]
    if isinstance(model, StackedModel):  # a pipeline's: back to the blocks a loop runs (--scan's: a GPT)
        looped = argparse.Namespace(**{**vars(settings), "scan": False})
        model = unstack(model, jax.eval_shape(lambda: entry.build(looped, jax.random.key(0))))
    return model


def placed(model: Any, parallel: str, devices: list[jax.Device] | None = None) -> Any:
    """``model`` on ``devices`` (default: all), its weights placed by ``parallel``'s rules."""
    devices = devices or jax.devices()
    shape, rules = mesh_rules(parallel, len(devices))
    return shard(model, make_mesh(shape, devices=devices), rules)


def decoder(parallel: str, devices: list[jax.Device] | None = None) -> Callable[..., Any]:
    """The prefill and decode step, ``model.decode`` jitted, the caches donated: ``Sharded`` by
    ``parallel``'s rules on ``devices`` (default: all), whose caches (Layers naming "batch", "seq",
    "heads", "kv") they lay out too: under tp each device keeps the keys and values of its own heads,
    under dp its own sequences."""

    def decode(model: Any, ids: jax.Array, caches: Any, start: jax.Array) -> Any:
        return model.decode(ids, start, caches)

    if parallel == "none":
        return jax.jit(decode, donate_argnums=2)
    devices = devices or jax.devices()
    shape, rules = mesh_rules(parallel, len(devices))
    return Sharded(make_mesh(shape, devices=devices), rules, donate_argnums=2)(decode)


def explained(model: Any, step: Any, batch: int, parallel: str) -> str:
    """One decode step of ``batch`` sequences compiled: its collectives per kind (count, bytes on one
    device, mesh axes) and XLA's bytes accessed beside what a step must read at least, the weights
    and the caches one device holds (params + B·KV; docs/serving.md says what XLA counts beyond).
    ``model`` may be shapes alone (``jax.eval_shape``): nothing of it is read."""
    caches = model.init_cache(batch)
    ids, start = jnp.zeros((batch, 1), jnp.int32), jnp.asarray(1)
    lowered = step.lower(model, ids, caches, start)
    compiled = lowered.compile()
    lines = [f"one decode step, batch {batch}, {parallel}:"]
    for kind, c in collectives(compiled).items():
        lines.append(
            f"  {kind}: {c.count} x, {c.bytes:,} B per device over {', '.join(map('+'.join, c.mesh_axes))}"
        )
    if len(lines) == 1:
        lines.append("  no collectives")
    placed_as = compiled.input_shardings[0]  # (model, ids, caches, start): a sharding per leaf
    params, cached = per_device(model, placed_as[0]), per_device(caches, placed_as[2])
    accessed = int((compiled.cost_analysis() or {}).get("bytes accessed", 0))
    lines.append(
        f"  bytes accessed (XLA, one device): {accessed:,} B; params + B·KV on one device: "
        f"{params:,} + {cached:,} = {params + cached:,} B (XLA {accessed / (params + cached):.2f}x)"
    )
    return "\n".join(lines)


def per_device(tree: Any, shardings: Any) -> int:
    """The bytes of ``tree``'s arrays (or shapes) that one device holds, each split by its sharding.

    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> per_device(jnp.zeros((16, 4)), NamedSharding(make_mesh({"data": 8}), P("data")))  # 2 rows of 4
    32
    """
    pairs = zip(jax.tree.leaves(tree), jax.tree.leaves(shardings), strict=True)
    return sum(math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize for x, s in pairs)


Stream = Callable[..., Iterator[list[int]]]
"""A model entry's decoding, as ``gpt.stream``: ``(model, ids, tokens, *, temperature, seed, batch, step)``,
each step's new ids, one per row (``batch`` of them, 1 by default)."""


def sample(
    model: Any,
    vocab: Vocabulary,
    prompt: str,
    tokens: int = 300,
    temperature: float = 0.8,
    seed: int = 0,
    *,
    stream: Stream,
) -> str:
    """``prompt`` and its continuation of ``tokens`` characters, as text (``stream`` on the ids)."""
    return prompt + "".join(continuation(model, vocab, prompt, tokens, temperature, seed, stream=stream))


def continuation(
    model: Any, vocab: Vocabulary, prompt: str, tokens: int, temperature: float, seed: int, *, stream: Stream
) -> Iterator[str]:
    """The characters after ``prompt``, each as soon as it is drawn (a model entry's ``stream``)."""
    for ids in stream(model, vocab.encode(prompt), tokens, temperature=temperature, seed=seed):
        yield vocab.decode(ids)
