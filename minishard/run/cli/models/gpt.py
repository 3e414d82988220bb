"""The GPT's entry (``--model gpt``): characters of tiny_shakespeare, by steps, AdamW (docs/gpt.md).

nanoGPT's CPU configuration, its loss and evaluation (``NEXT_CHARACTER``), its
data (``minishard.run.text_data``), and its mixture-of-experts flags
(``--experts``, ``--top-k``, ``--capacity-factor``, docs/experts.md), which
``explain`` takes too.

>>> GPT_ENTRY.defaults["steps"], GPT_ENTRY.style
(2000, 'dp')
"""

from __future__ import annotations

import functools
import math
import sys
from typing import Any

import jax
import jax.numpy as jnp

from minishard import flash
from minishard.context import CHUNKS
from minishard.experts import moe_layers
from minishard.models.attention import CHUNK_ORDER
from minishard.models.gpt import GPT, stacked_gpt, stream
from minishard.models.transformer import dense_mlp, moe_mlp
from minishard.optim import AdamW, warmup_cosine_decay
from minishard.run import text_data
from minishard.run.cli.flags import Error, Flag, at_least, positive, unit_interval
from minishard.run.cli.models.entry import Args, ExpertSplit, ModelEntry, SequenceSplit, Splits, Stacking
from minishard.run.cli.models.transformer import (
    TRANSFORMER_FLAGS,
    attention_shape,
    check_depth_stages,
    check_heads,
    depth_over_stages,
    ring_cores,
)
from minishard.run.errors import TrainingError
from minishard.run.next_token import next_token_loss, next_token_sums
from minishard.run.steps import Task

__all__ = [
    "DERIVED_BATCH_LIMIT",
    "EVAL_WINDOWS",
    "FLASH_FROM",
    "GPT_BATCH",
    "GPT_ENTRY",
    "MOE_DEFAULTS",
    "MOE_FLAGS",
    "NEXT_CHARACTER",
    "TEXT_EXPERTS",
    "TEXT_SEQUENCE",
    "adamw",
    "check_derived_batch",
    "check_moe",
    "default_batch",
    "gpt_splits",
    "random_windows",
]


NEXT_CHARACTER = Task(next_token_loss, ("acc",), next_token_sums, unit="tokens")
"""The GPT's task: the cross-entropy of every next character (nats per character), and its accuracy;
an evaluation reports the mean loss over the split's fixed windows (``val loss``, ``test loss``),
and with ``--experts`` the share of routings the experts' capacity dropped (``val dropped``)."""
MOE_DEFAULTS = {"top_k": 2, "capacity_factor": 1.25}
"""With ``--experts``: GShard's two experts per token, Switch's 25% slack."""
GPT_BATCH = 16
"""nanoGPT's CPU batch, 12, rounded up to a multiple of 8 devices: the default is the multiple of the
devices (and of what splits the batch) nearest it, 16 on 1, 2, 4 or 8 devices."""
FLASH_FROM = 1024
"""``--attention auto``'s threshold: on a TPU, the Pallas kernel (``minishard.flash``) from this
context on, XLA's attention below it, where issue 61's table has XLA's faster (at 256)."""
EVAL_WINDOWS = 64
"""Windows per evaluation batch (rounded to a multiple of the training batch, which splits over "data")."""


def default_batch(args: Args) -> None:
    """--batch-size, if not given: the multiple of the devices nearest 16, and of what splits the
    batch ("data" x "expert" x microbatches) where that is not a divisor of them.

    Every layout of the same devices then trains on the same tokens a step, the protocol of
    docs/compose.md's convergence table: ``--parallel dp+tp+cp`` prints ``--parallel dp``'s losses.
    """
    if args.batch_size is None:
        args.batch_size = _nearest_default(args, args.microbatches)
        args.batch_derived = args.batch_size  # check_derived_batch: a far larger one is refused


def _nearest_default(args: Args, microbatches: int) -> int:
    split = args.mesh.get("data", 1) * args.mesh.get("expert", 1) * microbatches
    unit = math.lcm(math.prod(args.mesh.values()), split)
    return unit * max(1, math.floor(GPT_BATCH / unit + 0.5))


DERIVED_BATCH_LIMIT = 8
"""A batch not given may be at most this many times the devices' own default (``--microbatches 1``):
``--microbatches 1000000`` would otherwise train on 2,000,000 windows a step, unasked."""


def check_derived_batch(args: Args, error: Error) -> None:
    """A default batch that --microbatches made far larger is refused, naming both flags."""
    if getattr(args, "batch_derived", None) is None:
        return
    plain = _nearest_default(args, 1)
    if args.batch_derived > DERIVED_BATCH_LIMIT * plain:
        error(
            f"argument --microbatches: {args.microbatches} microbatches make the default batch "
            f"{args.batch_derived:,} windows, {args.batch_derived / plain:,.0f}x the {plain} "
            f"without them (at most {DERIVED_BATCH_LIMIT}x); give fewer --microbatches, or "
            "--batch-size"
        )


def adamw(args: Args, total_steps: int) -> AdamW:
    """nanoGPT's optimizer: AdamW, a linear warmup of --warmup-steps, then a cosine to lr / 10."""
    warmup = min(args.warmup_steps, total_steps - 1)
    rate = warmup_cosine_decay(args.lr, warmup, total_steps, end_value=args.lr / 10)
    return AdamW(rate, weight_decay=args.weight_decay)


def gpt_splits(args: Args) -> Splits:
    """Random windows of the train split; the validation split's fixed windows every period, the test's last.

    The vocabulary (the train split's characters) is saved with every checkpoint: ``sample`` needs no data.
    """
    load = functools.partial(
        text_data.text_dataset,
        args.dataset,
        context=args.context,
        data_dir=args.data_dir,
        download=args.download,
        seed=args.seed,
    )
    train = load("train", batch_size=args.batch_size)
    windows = args.batch_size * max(1, EVAL_WINDOWS // args.batch_size)
    val, test = (load(split, batch_size=windows) for split in ("validation", "test"))
    assert train.vocabulary is not None  # text_dataset's: the train split's
    return Splits(train, {"val": val}, {"test": test}, info={"vocabulary": train.vocabulary.characters})


def _gpt(args: Args, key: jax.Array, stacked: bool = False) -> Any:
    """``GPT`` (with --scan its blocks stacked; a pipeline's ``stacked_gpt``) over --dataset's characters."""
    vocab = text_data.TEXT_DATASET_INFO[args.dataset].vocabulary_size
    shape = (vocab, args.context, args.width, args.depth, args.heads, args.mlp_ratio)
    kv_heads = args.kv_heads  # None (a checkpoint saved before --kv-heads): the heads
    # with --experts each expert mlp_ratio x width / k hidden units: the dense GPT's active parameters
    mlp = moe_mlp(args.experts, args.top_k, args.capacity_factor) if args.experts else dense_mlp
    core = _attention_core(args)
    if stacked:  # a pipeline's: no remat, no dropout (both refused with pp)
        return stacked_gpt(*shape, key=key, kv_heads=kv_heads, mlp=mlp, core=core)
    dropout = getattr(args, "dropout", None) or 0.0  # a checkpoint saved before --dropout: none
    scan = getattr(args, "scan", False)  # a checkpoint saved before --scan: a loop
    return GPT(
        *shape, key=key, remat=args.remat, kv_heads=kv_heads, mlp=mlp, core=core, dropout=dropout, scan=scan
    )


def _fill_gpt(args: Args) -> None:
    """The batch near 16 (``default_batch``), and with --experts the MoE's defaults (``MOE_DEFAULTS``),
    each capped where the experts are too few for it (a note says so): k at most the experts, the
    capacity factor at most experts / k, where no routing is dropped."""
    default_batch(args)
    args.kv_heads = args.kv_heads or args.heads  # multi-head attention unless --kv-heads groups them
    if not args.experts:
        return
    if args.top_k is None:
        args.top_k = _capped("top-k", MOE_DEFAULTS["top_k"], args.experts, args)
    if args.capacity_factor is None and args.top_k <= args.experts:  # else check_moe refuses --top-k
        args.capacity_factor = _capped(
            "capacity-factor", MOE_DEFAULTS["capacity_factor"], args.experts / args.top_k, args
        )


def _attention_core(args: Args) -> str:
    """--attention, decided where the devices are known (the model's build): ``auto`` picks the
    Pallas kernel on a TPU from ``FLASH_FROM`` tokens on, else dense; a note says which, once."""
    asked = getattr(args, "attention", "dense")  # absent: a checkpoint saved before --attention
    backend = jax.default_backend()
    if asked == "flash" and backend != "tpu":
        raise TrainingError(
            "argument --attention: flash runs its Pallas kernel on a TPU, and this backend is "
            f"{backend}; use dense here (auto picks it)"
        )
    if asked == "auto":
        dropout = getattr(args, "dropout", None)  # the kernel never forms the weights dropout drops
        args.attention = (
            "flash" if backend == "tpu" and args.context >= FLASH_FROM and not dropout else "dense"
        )
        print(
            f"note: --attention auto: {args.attention} (a context of {args.context} on {backend}; "
            f"the kernel from {FLASH_FROM} tokens on a TPU{', without --dropout' if dropout else ''})",
            file=sys.stderr,
        )
    return str(args.attention) if asked == "auto" else asked


def _capped(flag: str, default: float, most: float, args: Args) -> float:
    """``default``, or ``most`` if it is less, said in one note line (never silently)."""
    if default <= most:
        return default
    print(f"note: the default --{flag} {default:g} is more than --experts {args.experts} allows: {most:g}")
    return most


def check_moe(args: Args, error: Error) -> None:
    """--top-k and --capacity-factor only with --experts, k at most the experts, an Auto mesh."""
    for name in MOE_DEFAULTS:
        if not args.experts and getattr(args, name, None) is not None:
            error(
                f"argument --{name.replace('_', '-')}: only with --experts N (the MLPs are dense without it)"
            )
    if args.experts and getattr(args, "explicit", False):
        error("argument --explicit: not with --experts (the MoE's einsums name no out_sharding: Auto only)")
    if args.experts and args.top_k > args.experts:
        error(
            f"argument --top-k: {args.top_k} with --experts {args.experts}; each token picks k distinct "
            f"experts, so k must be from 1 to {args.experts} (1: Switch, 2: GShard)"
        )
    if args.experts and args.capacity_factor > (most := args.experts / args.top_k):
        error(
            f"argument --capacity-factor: {args.capacity_factor:g} is more than {most:g} (--experts / "
            "--top-k), where each expert already has a slot for every token and none is dropped; "
            "give at most that"
        )


def _check_gpt_shape(args: Args, error: Error) -> None:
    """--heads divide --width, --kv-heads --heads, and both split over "model"; the MoE flags."""
    check_heads(args, error)
    if args.heads % (ways := args.mesh.get("model", 1)):  # every style with a "model" axis splits heads
        error(
            f"argument --heads: {args.heads} heads cannot split over model={ways} devices; "
            f"give a multiple of {ways}, or fewer --devices"
        )
    _check_kv_heads(args.heads, args.kv_heads, ways, error)
    check_moe(args, error)
    check_derived_batch(args, error)


def _check_kv_heads(heads: int, kv_heads: int, ways: int, error: Error) -> None:
    """Grouped queries: --kv-heads divide --heads, and split over "model" as the heads do (tp keeps each
    device's query heads beside the key and value heads they read)."""
    if heads % kv_heads:
        error(
            f"argument --kv-heads: {kv_heads} must divide --heads {heads} (each group of heads / kv-heads "
            "query heads shares one key and value head)"
        )
    if kv_heads % ways:
        error(
            f"argument --kv-heads: {kv_heads} key and value heads cannot split over model={ways} devices "
            f"(they split as the heads do); give a multiple of {ways}, or fewer --devices"
        )


def _check_gpt(args: Args, error: Error) -> None:
    _check_gpt_shape(args, error)
    if args.context >= (held_out := text_data.TEXT_DATASET_INFO[args.dataset].held_out_characters):
        error(
            f"argument --context: {args.context} characters and the next one do not fit {args.dataset}'s "
            f"validation split of {held_out:,}; give at most {held_out - 1:,}"
        )
    if getattr(args, "attention", "dense") == "flash":
        _check_flash_blocks(args.context, args.mesh.get("context", 1), error)
        if args.dropout:
            error(
                f"argument --dropout: {args.dropout:g} with --attention flash, whose kernel never forms "
                "the attention weights to drop; give --attention dense (auto picks it with --dropout)"
            )
    if args.schedule != "cosine":
        error(
            f"argument --schedule: the GPT's AdamW warms up, then follows a cosine to lr/10; "
            f"{args.schedule} is the SGD models' schedule"
        )


def _check_flash_blocks(context: int, ring: int, error: Error) -> None:
    """The kernel's blocks, of up to ``flash.BLOCK`` tokens, tile the context (the TPU: built), or
    under cp each of the ring's chunks (``ring`` devices on "context", two chunks each)."""
    chunks = CHUNKS[CHUNK_ORDER] * ring if ring > 1 else 1
    tokens = context // chunks  # what one call of the kernel attends
    block = min(flash.BLOCK, tokens)
    if tokens % block or (block % 8 and block != tokens):
        what = "--context" if chunks == 1 else f"each of the ring's {chunks} chunks ({tokens} tokens)"
        error(
            f"argument --attention: flash tiles {what} into blocks of {flash.BLOCK} tokens (a "
            f"shorter one whole); {tokens} is not a multiple of {flash.BLOCK}: give a --context "
            f"that is a multiple of {chunks * flash.BLOCK}, or at most {chunks * flash.BLOCK}"
        )


def _windows(args: Args, batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
    window = jax.ShapeDtypeStruct((batch_size, args.context), jnp.int32)
    return {"inputs": window, "targets": window}


def random_windows(args: Args, model: Any) -> jax.Array:
    """``--batch-size`` windows of ``--context`` random characters of ``model``'s vocabulary."""
    vocab = model.embedding.tokens.shape[0]
    return jax.random.randint(jax.random.key(0), (args.batch_size, args.context), 0, vocab)


TEXT_SEQUENCE = SequenceSplit("context", ring=ring_cores, attention=attention_shape)
"""A text model's windows of ``--context`` characters over "context" (cp, dp+cp): its attention a ring."""
TEXT_EXPERTS = ExpertSplit("experts", layers=moe_layers, inputs=random_windows)
"""A text model's ``--experts`` over "expert" (ep, dp+ep): its blocks' MoE MLPs."""


MOE_FLAGS = {
    "experts": Flag(
        "replace every MLP by a mixture of this many experts, each a k-th of the MLP's hidden units "
        "(minishard.experts; 0: dense)",
        type=at_least(0),
    ),
    "top_k": Flag("with --experts: experts per token, 1 to --experts (default 2)", type=at_least(1)),
    "capacity_factor": Flag(
        "with --experts: each expert's slots over an even share of the routings, > 0 (default 1.25)",
        type=positive,
    ),
}
"""The GPT's mixture-of-experts flags; ``explain`` takes them too."""


GPT_ENTRY = ModelEntry(
    name="gpt",
    label="GPT",
    help="a character-level GPT (nanoGPT's shape), its attention heads and MLPs split Megatron-style",
    flags={
        **TRANSFORMER_FLAGS,
        "context": Flag("characters each prediction sees (its learned positions)", type=at_least(1)),
        "kv_heads": Flag(
            "key and value heads, each shared by --heads / --kv-heads query heads: grouped-query attention "
            "(default: --heads; 1: multi-query)",
            type=at_least(1),
        ),
        "weight_decay": Flag("AdamW's decoupled weight decay of the matrices, in [0, 1)", type=unit_interval),
        "attention": Flag(
            "the attention core: dense (XLA's), flash (minishard.flash's Pallas kernel, on a TPU), "
            f"or auto (flash on a TPU from a context of {FLASH_FROM}, else dense; said)",
            choices=("dense", "flash", "auto"),
        ),
        "scan": Flag(
            "stack the blocks and run them as one jax.lax.scan: a deep GPT compiles in about the time "
            "of one block (pipelines stack theirs anyway)",
            action="store_true",
        ),
        "dropout": Flag(
            "in training, the share of the embeddings, attention weights and residual branches zeroed "
            "(nanoGPT's places; a mask per step, layer and place), in [0, 1)",
            type=unit_interval,
        ),
        **MOE_FLAGS,
    },
    # nanoGPT's CPU configuration (its README): val loss 1.88 after 2,000 steps, at lr 1e-3 for its 10.7 M
    # parameters. This 0.8 M GPT learns faster at 3e-3 (val 1.88 near step 760, not 1,200; after 2,000 steps
    # val 1.605 and test 1.710, not 1.786 and 1.853; 4e-3 gains no more): docs/gpt.md, docs/benchmarks.md.
    defaults={
        "width": 128,
        "depth": 4,
        "heads": 4,
        "mlp_ratio": 4,
        "remat": "none",
        "context": 64,
        "kv_heads": None,  # _fill_gpt: --heads
        "weight_decay": 0.1,
        "attention": "dense",
        "dropout": 0.0,  # nanoGPT's CPU run has none; its shakespeare-char recipe 0.2
        "scan": False,  # the blocks a Python loop: the one a learner reads first
        "experts": 0,  # dense MLPs
        "steps": 2000,
        "eval_every": 250,
        "batch_size": None,  # default_batch: a multiple of the devices near 16
        "lr": 3e-3,
        "schedule": "cosine",
        "warmup_steps": 100,
    },
    datasets=("tiny_shakespeare",),
    style="dp",
    task=NEXT_CHARACTER,
    build=_gpt,
    data=gpt_splits,
    optimizer=adamw,
    example=_windows,
    fill=_fill_gpt,
    check=_check_gpt,
    # a longer window, experts, another shape (a 7B on paper: explain --memory): another step to price
    explain_flags=("context", "width", "depth", "heads", "kv_heads", "mlp_ratio", "remat", *MOE_FLAGS),
    check_explain=_check_gpt_shape,
    stack=Stacking(lambda args, key: _gpt(args, key, stacked=True), depth_over_stages(4), check_depth_stages),
    sequence=TEXT_SEQUENCE,
    experts=TEXT_EXPERTS,
    stream=stream,
    # 8 simulated devices share 2 cores' threads: a step of 85-90 ms there, 57-73 ms on 2 (docs/benchmarks.md)
    devices=(
        2,
        "the GPT's default run: 2 split the batch (an all-reduce a step), 8 on 2 cores step 1.5x slower",
    ),
)
