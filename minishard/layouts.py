"""Which layout, at what size: every way to split a transformer's training over N chips, ranked.

This is minishard's one ranking; ``costs.compare``, which prices the programs XLA compiled for a
model small enough to compile here, is its check (``explain --compare --size gpt --check``).

``minishard.costs`` prices a step that XLA compiled. A LLaMA-3 run on thousands of chips cannot
be compiled here, but its step is simple enough to price from the model's shapes alone, as
the scaling book does (``training.md``, and its walk-through, ``applied-training.md``).
A layout splits the N devices five ways, ``dp x fsdp x tp x pp x cp = N``, each a mesh axis:

* **dp**: replicas, each holding every weight of its share, all-reduce the gradients;
* **fsdp**: splits the weights and the optimizer state too (ZeRO-3, the parameters flattened,
  so any count divides), gathers the weights for each pass and reduce-scatters the gradients:
  bytes that do not grow with the batch;
* **tp**: splits each matmul (Megatron, with the sequence split between blocks): each block
  gathers its input's tokens and reduce-scatters its output: bytes that grow with the batch;
* **pp**: splits the layers into stages (``minishard.pipeline``): each device gathers, holds and
  updates only its stage's weights, and sends one residual stream a step to the next stage, but
  idles in the pipeline's bubble, ``pipeline.bubble_fraction``: fewest where the microbatches are
  many, and each must keep enough tokens for its matmuls to outrun HBM (``microbatches``). Its
  stage may hold ``repeats`` chunks of layers, the interleaved schedule's r (Narayanan et al. 2021,
  §2.2.2): a bubble r times shorter, for r times the sends between stages; not a split of the
  devices, so not ranked: ``rank(..., repeats=r)`` prices every pipeline so. The ranking splits
  the layers evenly; ``price`` takes uneven stages too (LLaMA-3 405B's 126 layers over Meta's 16),
  at the pace of the fullest (``uneven``);
* **cp**: splits each sequence (Llama 3's context parallelism): each layer gathers the keys and
  values of the whole sequence, and reduce-scatters their gradients: bytes that grow with the
  batch but not with the heads (grouped-query attention's few K/V heads make them small); its
  devices hold the same weights, so they all-reduce the gradients as dp's replicas do.

Per device, with b = B / N tokens and P parameters, a forward pass does F = 2Pb FLOPs and the
backward pass 2F (the book's 6P per token), and attention's ``12 L T N H`` a token in sequences of T
(``train_flops``; the book leaves it out: ``context=0``). Those are the model's FLOPs, MFU's
numerator (PaLM's); the backward pass also runs again the R FLOPs of the forward that its remat
policy did not keep (``recomputed_flops``; MFU leaves them out, HFU counts them). The scaling
book's transformers chapter ("Gradient checkpointing"): block remat repeats "essentially all
forward pass FLOPs", 6ND to "roughly 8ND"; saving the big matmuls' outputs (``dots``), none of
them. Under ``full`` Megatron runs the layers' whole forward again: Korthikanti et al. 2022
("Reducing Activation Recomputation in Large Transformer Models") count
``72·B·s·l·h²·(1 + s/6h + V/12hl)`` FLOPs a step without it, ``96·B·s·l·h²·(1 + s/6h + V/16hl)``
with it (Narayanan et al. 2021's count), four passes where the model's are three. JAX's is less
by each layer's last matmul, about a quarter of a pass: R is 0.72 F for LLaMA-3 70B at 4,096.
(PaLM, trained in JAX, reports 57.8% hardware and 46.2% model FLOPs utilisation, 1.25 times: this
count gives 1.23, the whole pass 1.33.) Each pass
hides its own collectives behind its own matmuls, so
``step = max(F, sent forward) + max(2F + R, sent backward)``: the forward pass sends
the FSDP gathers and the tensor collectives, the backward pass the gathers again, the
reduce-scatters, the all-reduce and the tensor collectives transposed (twice the forward's, as the
book counts them). (``costs.StepCost`` reads a compiled program and cannot tell the passes apart: it
hides every collective behind the backward pass.) A pipeline's step is that busy time over
``1 - bubble``. On a torus each split dimension but pp takes one of the chip's axes
(``Hardware.axes``), the largest dimension those left; a stage sends to its neighbour. Each
collective is a ``census.Send`` record (``sends``), the census's own: priced in seconds, or counted
in bytes per dimension (``bytes_sent``, a pipeline's loop sending its stages' ``every_tick``), which
``explain --check`` sets beside a compiled step's census. Memory per device:
the memory chapter's 16 bytes per parameter (mixed precision, AdamW) over fsdp x tp x pp, one
layer's weights gathered whole (a pipeline's stage: all of its layers, kept through its
microbatches, as torchtitan does: else FSDP gathers each microbatch again), and the activations the
backward pass needs: the residual stream, ``CHECKPOINTS`` times per layer (``memory.korthikanti``
fully recomputed), of the whole batch, or of the ``p`` microbatches a pipeline's first stage holds
at once when it runs 1F1B (``pipeline_1f1b``; GPipe's bubble; ``held_microbatches`` when it
interleaves), and the one layer recomputed from
them, whose T x T scores grow with the sequence unless a fused kernel keeps none (``layer_bytes``).
On a two-level network (NVLink and InfiniBand, ICI and DCN) each dimension runs on the level
``PLACEMENT`` puts it (``Layout.inner``).

The functions and records, by name. ``train_flops`` and ``train_seconds`` are a whole run's
FLOPs and seconds (sequences of ``CONTEXT`` tokens unless told), ``recomputed_flops`` what its
backward passes run again, ``checkpoint_bytes`` the residual
streams a step keeps, ``kept_by_remat`` what its layers keep under each remat policy of a
``Kept`` step (``KEPT``, the ranking's), ``optimal_fsdp`` the book's X_opt. ``layouts`` lists
every layout of N chips, ``price`` prices one as a ``LayoutCost`` (its collectives' seconds a
``CommSeconds`` per pass, from ``pass_collectives``), and ``rank`` sorts them all into a
``Ranking``, whose report writes times with ``human_seconds``.

>>> from minishard.serving import LLAMA3_70B as llama
>>> round(optimal_fsdp(4 * 2**20, 8960, llama.hidden))  # the book's X_opt: 1,618 (4.19e6 tokens)
1619
>>> best = rank(llama, 4 * 2**20, 8960, "v5p").costs[0]   # sequences of 4,096
>>> str(best.layout), best.verdict
('fsdp 2240 x tp 4', 'compute-bound')
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

from minishard import _checks, _checks_costs
from minishard.census import Send, human_bytes
from minishard.costs import collective_time, hbm_critical_batch, sent_bytes
from minishard.hardware import Hardware, hardware_named
from minishard.memory import Budget, bytes_per_parameter, itemsize, korthikanti
from minishard.pipeline import bubble_fraction
from minishard.precision import MIXED, Precision
from minishard.remat import POLICIES
from minishard.serving import Decoder
from minishard.styles import DIMENSIONS, MESH_AXES

CHECKPOINTS = 4
"""Residual streams each layer keeps for the backward pass: the book's "checkpoint 4 times per
layer"."""
CONTEXT = 4096
"""Tokens a sequence, which a pipeline's microbatch keeps whole: LLaMA-3's first 4M-token
batches'."""

# --- 1. a run's size, and the book's rules --------------------------------------------------------


def train_flops(model: Decoder, tokens: float, context: int = 0) -> float:
    """``6 P tokens``, per parameter and token 2 FLOPs forward and 4 backward, plus attention's
    ``12 L T N H`` a token in sequences of ``context`` = T (0: attention left out, as the book's
    6P).

    Attention's two matmuls, q·kᵀ and the scores times v, take ``2 T N H`` FLOPs each a token
    and layer forward, three times that with the backward: PaLM's count (Chowdhery et al. 2022,
    Appendix B: "6N + 12LHQT"), with no halving for the causal mask, as MFU is reported.

    >>> from minishard.serving import LLAMA3_70B
    >>> f"{train_flops(LLAMA3_70B, 1):.3g}", f"{train_flops(LLAMA3_70B, 1, context=4096):.3g}"
    ('4.23e+11', '4.56e+11')
    """
    attention = 12 * model.layers * context * model.heads * model.head_dim
    return (6 * model.active_params + attention) * tokens


def recomputed_flops(
    model: Decoder,
    tokens: float,
    context: int = 0,
    remat: str = "full",
    capacity_factor: float = 1.0,
) -> float:
    """The FLOPs the backward pass runs again under ``remat`` (``remat.POLICIES``), not the model's
    (``train_flops``, MFU's), for ``tokens`` in sequences of ``context``; a token and layer:

    * ``"none"``, ``"dots"``: no matmul (dots runs only norms, softmax and Swish again);
    * ``"names"``: attention's ``core`` (q·kᵀ, the scores times v) and the MLP's first matrices
      (two, gated; a mixture's router, its experts' at ``top_k · capacity_factor`` slots a token,
      empty ones too: ``experts.capacity``; 1: dropless), which ``remat.SAVED`` does not name;
    * ``"full"``: those and the ``projections`` (q, k, v and the output): all but the MLP's second
      matrix, whose output only the residual sum reads (JAX drops it: ``minishard.remat``).

    >>> from minishard.serving import LLAMA3_70B as llama
    >>> [f"{recomputed_flops(llama, 1, 4096, remat) / 1e11:.3g}" for remat in POLICIES]
    ['0', '1.1', '0', '0.859']
    """
    _checks.one_of("recomputed_flops: remat", remat, tuple(POLICIES))
    projections = 2 * model.width * model.head_dim * (2 * model.heads + 2 * model.kv_heads)
    core = 4 * context * model.heads * model.head_dim
    slots = model.top_k * capacity_factor if model.experts else 1  # a token's, in the experts
    mlp_in = 2 * model.width * model.hidden * (1 + model.gated) * slots
    router = 2 * model.width * model.experts  # a mixture's (a dense MLP: 0)
    again = {"none": 0, "dots": 0, "names": core + mlp_in + router}
    again["full"] = again["names"] + projections
    return model.layers * tokens * again[remat]


def train_seconds(
    model: Decoder,
    tokens: float,
    chips: int,
    hardware: Hardware | str,
    mfu: float,
    context: int = 0,
) -> float:
    """Seconds to train on ``tokens`` with ``chips`` at ``mfu`` of their peak FLOP/s."""
    return train_flops(model, tokens, context) / (chips * hardware_named(hardware).flops * mfu)


def optimal_fsdp(
    tokens: float,
    devices: int,
    hidden: int,
    fsdp_axes: int = 2,
    tensor_axes: int = 1,
) -> float:
    """The FSDP ways that send the least beside TP: ``X_opt = sqrt(B/F · M_X/M_Y · N)``.

    FSDP's gathers shrink as TP grows (each device gathers its tensor shard only) and TP's grow
    as FSDP does (each tensor group holds more tokens): the sum is least here.
    """
    return math.sqrt(tokens / hidden * fsdp_axes / tensor_axes * devices)


def checkpoint_bytes(
    model: Decoder,
    tokens: float,
    per_layer: int = CHECKPOINTS,
    tp: int = 1,
) -> float:
    """Bytes of the residual streams kept for the backward pass:
    ``2 · width · tokens · per_layer · layers``.

    Korthikanti's full recomputation keeps one bf16 stream per layer (split over ``tp`` with the
    sequence); the book keeps ``per_layer`` of them.
    """
    one_token = korthikanti(1, 1, model.width, model.heads, t=tp, sp=True, recompute="full")
    return per_layer * model.layers * tokens * one_token


def layer_bytes(model: Decoder, tokens: float, context: int, fused: bool = True) -> float:
    """Bytes of one layer's activations, recomputed in the backward pass from its checkpoint, for
    ``tokens`` in sequences of ``context``: Korthikanti's ``sbh(34 + 5as/h)`` (Table 2), whose
    ``5as/h`` are the T x T scores (softmax, its dropout mask and output) of every head. A fused
    attention kernel (FlashAttention) keeps none of them: ``34sbh`` alone, whatever the sequence.

    >>> from minishard.serving import LLAMA3_8B
    >>> [round(layer_bytes(LLAMA3_8B, 8192, t, fused=False) / 2**30, 2) for t in (4096, 8192)]
    [6.06, 11.06]
    >>> round(layer_bytes(LLAMA3_8B, 8192, 8192) / 2**30, 2)
    1.06
    """
    scores = 0 if fused else 5 * model.heads * context
    return tokens * (34 * model.width + scores)


class Kept(NamedTuple):
    """What a step keeps for its backward pass, and of its weights, as ``train`` runs it: under
    ``remat`` (``remat.POLICIES``: ``--remat``'s) ``"full"``, ``checkpoints`` residual streams a
    layer (the book's 4; Korthikanti's 1); its numbers in ``precision`` (``precision.PRECISIONS``:
    ``--precision``'s, or mixed precision, bf16 beside a float32 master, the ranking's)."""

    checkpoints: int = CHECKPOINTS
    precision: Precision = MIXED
    remat: str = "full"


KEPT = Kept()
"""The ranking's step: the book's 4 checkpoints a layer, mixed precision, each block recomputed."""


def kept_by_remat(
    model: Decoder,
    tokens: float,
    context: int,
    kept: Kept = KEPT,
    fused: bool = True,
) -> float:
    """Bytes in 16 bits all layers keep for the backward pass of ``tokens`` in sequences of
    ``context``, under ``kept.remat``'s policy:

    * ``"full"``: ``kept.checkpoints`` residual streams a layer (``checkpoint_bytes``);
    * ``"none"``: everything, Korthikanti's ``sbh(34 + 5as/h)`` (``layer_bytes``);
    * ``"names"``: its input, q, k and v, and attention's output (``remat.SAVED``);
    * ``"dots"``: every matmul's output too: the scores (none in a fused kernel), their sum over
      the values, and the MLP's first (two, gated).

    >>> from minishard.serving import LLAMA3_8B
    >>> [kept_by_remat(LLAMA3_8B, 1, 8192, Kept(remat=remat)) / 4096 / 32 for remat in POLICIES]
    [34.0, 8.0, 23.0, 7.0]
    """
    _checks.one_of("kept_by_remat: remat", kept.remat, tuple(POLICIES))
    if kept.remat == "full":
        return checkpoint_bytes(model, tokens, kept.checkpoints)
    if kept.remat == "none":
        return model.layers * layer_bytes(model, tokens, context, fused)
    qkv = (model.heads + 2 * model.kv_heads) * model.head_dim
    names = 2 * model.width + qkv  # the input and attention's output, as wide, and q, k, v
    scores = 0 if fused else model.heads * context
    dots = names + scores + model.heads * model.head_dim + model.hidden * (1 + model.gated)
    return model.layers * 2 * tokens * (names if kept.remat == "names" else dots)


# --- 2. one layout, priced ------------------------------------------------------------------------


RANKED = tuple(name for name, rule in DIMENSIONS.items() if rule.needs is None)
"""The dimensions a layout splits chips over: every rule of ``styles.DIMENSIONS`` but those that
ride on another's axis (sp on tp's: the ranking's tp is Megatron's with the sequence split between
blocks)."""
PLACEMENT = ("tp", "cp", "ep", "pp", "fsdp", "dp")
"""The dimensions from the innermost (nearest devices) out: Llama 3's "[TP, CP, PP, DP]" (Dubey
et al. 2024, §3.3.2), fsdp inside dp as HSDP shards inside a node's replica, ep inside pp as
Megatron-Core's default order puts it ("tp-cp-ep-dp-pp"). tp's collectives, the most and largest,
stay inside a node; dp's, once a step, cross the slow level."""


class Layout:
    """How N devices split over the dimensions, each a rule of ``styles.DIMENSIONS``: a mapping
    dimension -> devices, ``dp x fsdp x tp x pp x cp x ep``; a dimension it does not name is 1. The
    ranking prices it; ``mesh`` and ``style`` are the same split as ``train --parallel`` runs it.

    >>> layout = Layout(fsdp=4, tp=2)
    >>> layout["tp"], layout["pp"], layout.devices, layout.mesh()
    (2, 1, 8, {'data': 4, 'model': 2})
    """

    def __init__(self, **sizes: int) -> None:
        _checks_costs.layout_sizes(sizes, RANKED)
        # the rules' order
        self.sizes = {name: sizes[name] for name in RANKED if sizes.get(name, 1) > 1}

    def __getitem__(self, dimension: str) -> int:
        return self.sizes.get(dimension, 1)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Layout) and self.sizes == other.sizes

    def __hash__(self) -> int:
        return hash(tuple(self.sizes.items()))

    def __repr__(self) -> str:
        return f"Layout({', '.join(f'{name}={size}' for name, size in self.sizes.items())})"

    @property
    def devices(self) -> int:
        return math.prod(self.sizes.values())

    def ways(self) -> dict[str, int]:
        """The split dimensions and their sizes."""
        return dict(self.sizes)

    def mesh(self) -> dict[str, int]:
        """The mesh this split trains on: each dimension's devices on its rule's axis (dp and fsdp
        share "data"), in ``styles.MESH_AXES``' order."""
        found: dict[str, int] = {}
        for name, size in self.sizes.items():
            axis = DIMENSIONS[name].axis
            found[axis] = found.get(axis, 1) * size
        return {axis: found[axis] for axis in MESH_AXES if axis in found}

    def inner(self, dimension: str) -> int:
        """The devices between two neighbours of ``dimension``: the dimensions ``PLACEMENT`` puts
        inside it. On a two-level network it decides the level each runs on
        (``Hardware.bandwidth``).

        >>> Layout(dp=4, fsdp=256, tp=8).inner("tp"), Layout(dp=4, fsdp=256, tp=8).inner("dp")
        (1, 2048)
        """
        inside = PLACEMENT[: PLACEMENT.index(dimension)]
        return math.prod(self[name] for name in inside)

    def axes(self, hardware: Hardware) -> dict[str, float]:
        """The torus axes each dimension's collectives run over: one each, the largest takes those
        left; more dimensions than axes share them. A switch has one (``Hardware.bandwidth``).
        pp takes none: a stage sends one residual stream a step, to its neighbour, over one link.

        >>> v5p = hardware_named("v5p")
        >>> Layout(fsdp=2240, tp=4).axes(v5p), Layout(fsdp=560, tp=4, pp=4).axes(v5p)
        ({'fsdp': 2, 'tp': 1}, {'fsdp': 2, 'tp': 1})
        """
        ways = {name: size for name, size in self.ways().items() if name != "pp"}
        share = min(1.0, hardware.axes / len(ways)) if ways else 1.0
        axes = {name: share for name in ways}
        if ways and hardware.axes > len(ways):
            axes[max(ways, key=ways.__getitem__)] += hardware.axes - len(ways)
        return {name: int(n) if n == int(n) else n for name, n in axes.items()}

    def __str__(self) -> str:
        return " x ".join(f"{name} {size}" for name, size in self.ways().items()) or "one device"


class CommSeconds(NamedTuple):
    """Seconds of one pass's collectives: of the weights (whatever the batch), of the
    activations."""

    weights: float
    activations: float

    @property
    def total(self) -> float:
        return self.weights + self.activations


@dataclasses.dataclass(frozen=True)
class LayoutCost:
    """One layout's predicted step, per device: ``compute_s`` of the forward pass (the backward's
    is twice it), ``recomputed_s`` of the forward's matmuls the backward pass runs again
    (``recomputed_flops``), each pass's collectives, ``tokens`` per device, the memory by term, and
    the pipeline's ``microbatches``, ``repeats`` (chunks of layers a stage holds, the circular or
    interleaved schedule's ``r``), ``bubble`` and ``uneven`` (1, 1, 0 and 1 without pp)."""

    layout: Layout
    hardware: Hardware
    tokens: float
    compute_s: float
    recomputed_s: float
    forward: CommSeconds
    backward: CommSeconds
    memory: Budget
    microbatches: int = 1
    sequences: float = 0.0  # the batch's: each data shard's share of them, ``shard_sequences``
    repeats: int = 1
    uneven: float = 1.0  # the fullest stage's layers over a stage's average share (``uneven``)

    @property
    def bubble(self) -> float:
        """The share of the step a pipeline's stages idle (``pipeline.bubble_fraction``): r chunks
        a stage each take 1/r of its ticks, so its p - 1 ticks of bubble are r times shorter."""
        return bubble_fraction(self.layout["pp"], self.microbatches, self.repeats)

    @property
    def shard_sequences(self) -> float:
        """Sequences each data shard (dp x fsdp x ep) computes on: below 1, the shards split
        sequences."""
        return self.sequences / data_shards(self.layout)

    @property
    def backward_s(self) -> float:
        """The backward pass's matmuls: twice the forward's, and the forward's it recomputes."""
        return 2 * self.compute_s + self.recomputed_s

    @property
    def busy_s(self) -> float:
        """Each pass's matmuls, or its collectives where they take longer."""
        forward = max(self.compute_s, self.forward.total)
        backward = max(self.backward_s, self.backward.total)
        return forward + backward

    @property
    def step_s(self) -> float:
        """The busy time of the fullest stage, which the others wait on, over the bubble's share."""
        return self.busy_s * self.uneven / (1 - self.bubble)

    @property
    def waiting_s(self) -> float:
        """Of the busy time, what the matmuls do not hide: the collectives' exposed seconds."""
        return self.busy_s - self.compute_s - self.backward_s

    @property
    def idle_s(self) -> float:
        """The pipeline's idle seconds: its bubble, its lighter stages waiting on the fullest."""
        return self.step_s - self.busy_s

    @property
    def mfu(self) -> float:
        """The share of the chips' peak the step would use: the model's matmuls (``train_flops``)
        over its whole time; the recomputed pass is not the model's."""
        return 3 * self.compute_s / self.step_s

    @property
    def hfu(self) -> float:
        """The hardware FLOPs' share, the recomputed pass included (PaLM's "HFU")."""
        return (self.compute_s + self.backward_s) / self.step_s

    @property
    def bound(self) -> float:
        """k = sends over the compute they hide behind, in the pass where it is largest: > 1
        waits."""
        return max(self.forward.total / self.compute_s, self.backward.total / self.backward_s)

    @property
    def verdict(self) -> str:
        return "compute-bound" if self.bound <= 1 else f"communication-bound by x{self.bound:.1f}"

    @property
    def flips_at(self) -> float:
        """Tokens per device above which this layout is compute-bound: the weights' bytes stay,
        the compute and the activations' bytes grow with the batch. ``inf``: TP alone waits."""
        flips = []
        for compute, sent in ((self.compute_s, self.forward), (self.backward_s, self.backward)):
            left = compute - sent.activations  # per b tokens: what hides the weights
            flips.append(self.tokens * sent.weights / left if left > 0 else math.inf)
        return max(flips)

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.hardware.hbm_bytes


def data_shards(layout: Layout) -> int:
    """The devices that split the batch: the dimensions whose rules split "batch" (dp, fsdp, ep).

    >>> data_shards(Layout(dp=2, fsdp=4, tp=8, ep=2))
    16
    """
    return math.prod(layout[name] for name in RANKED if "batch" in DIMENSIONS[name].splits)


def microbatches(
    layout: Layout,
    tokens: float,
    hardware: Hardware | str,
    context: int = CONTEXT,
) -> int:
    """The most microbatches a pipeline's tokens split into (1 without pp): each whole sequences
    of ``context``, and at least ``costs.hbm_critical_batch`` tokens, below which a matmul
    reads its weights from HBM for fewer FLOPs than the reading takes (164 on a v5p).

    >>> microbatches(Layout(fsdp=56, tp=8, pp=20), 4 * 2**20, "v5p")   # 18 sequences a pipeline
    18
    """
    # the tokens one pipeline of tensor-parallel stages computes
    group = tokens / data_shards(layout)
    smallest = max(context, hbm_critical_batch(hardware))  # bf16 weights read for so many tokens
    return max(1, int(group // smallest)) if layout["pp"] > 1 else 1


def price(
    model: Decoder,
    layout: Layout,
    tokens: int,
    hardware: Hardware | str,
    kept: Kept = KEPT,
    context: int = CONTEXT,
    itemsize: int = 2,
    fused: bool = True,
    repeats: int = 1,
) -> LayoutCost:
    """One step of ``tokens`` in sequences of ``context`` on ``layout`` from the model's shapes,
    compiling nothing: ``itemsize`` bytes a number sent (4: float32); the rest as ``rank`` takes.

    >>> from minishard.serving import LLAMA3_70B
    >>> cost = price(LLAMA3_70B, Layout(fsdp=8960), 4 * 2**20, "v5p", context=0)  # over 3 axes
    >>> round(cost.tokens), round(cost.flips_at)   # the book (6P a token): 468 per chip, 850 needed
    (468, 850)
    """
    hardware = hardware_named(hardware)
    m = microbatches(layout, tokens, hardware, context)
    _checks_costs.repeats(model.layers, layout["pp"], m, repeats)
    passes = pass_collectives(model, layout, tokens, hardware, itemsize, context, m, repeats)
    per_device = tokens / layout.devices
    compute = train_flops(model, per_device, context) / 3 / hardware.flops  # the forward's third
    again = recomputed_flops(model, per_device, context, kept.remat) / hardware.flops  # backward
    memory = _memory(model, layout, tokens, (m, repeats), kept, (context, fused))
    sequences = tokens / context if context else 0.0
    cost = (layout, hardware, per_device, compute, again, *passes, memory, m, sequences, repeats)
    return LayoutCost(*cost, uneven=uneven(model.layers, layout["pp"], repeats))


def uneven(layers: int, stages: int, repeats: int = 1) -> float:
    """The fullest stage's layers over a stage's average share, ``layers / stages``: each of its
    ``repeats`` chunks holds ``ceil(layers / (stages · repeats))`` layers, and the pipeline ticks
    at its pace. Meta's LLaMA-3 405B drops a layer from its first and last stage (Dubey et al. 2024,
    "Parallelism for Model Scaling"): 126 layers in 16 stages of 8 places.

    >>> uneven(126, 16), uneven(126, 16, repeats=8), uneven(128, 64, repeats=2)
    (1.0158730158730158, 1.0158730158730158, 1.0)
    """
    return math.ceil(layers / (stages * repeats)) * repeats * stages / layers


def held_microbatches(p: int, m: int, r: int = 1) -> float:
    """The microbatches whose activations, through all of its layers, a 1F1B pipeline's first stage
    holds at once: ``p`` (``pipeline_1f1b``), and under the interleaved schedule (``r`` > 1 chunks
    a stage) ``p + (p-1)/r``: its warm-up runs ``2(p-1) + (r-1)p + 1`` forward chunks, each 1/r of
    the stage, before the first backward. Megatron-LM counts the same ("Memory penalty from
    interleaved schedule", ``1 + (p-1)/(p·v)`` times p: ``megatron/training/
    theoretical_memory_usage.py``); no more than the ``m`` microbatches there are.

    >>> held_microbatches(4, 8), held_microbatches(4, 8, r=2), held_microbatches(4, 8, r=3)
    (4, 5.5, 5.0)
    """
    return min(m, p if r == 1 else p + (p - 1) / r)


class Step(NamedTuple):
    """One training step as the ranking sizes its collectives: ``tokens`` in sequences of
    ``context`` (0: none) on ``layout``, numbers of ``itemsize`` bytes (bf16), a pipeline's
    ``microbatches`` and ``repeats``."""

    model: Decoder
    layout: Layout
    tokens: float
    itemsize: int = 2
    context: int = 0
    microbatches: int = 1
    repeats: int = 1

    @property
    def group(self) -> float:
        """The tokens one tensor-parallel group computes on: a data shard's, a cp shard of them."""
        return self.tokens / (data_shards(self.layout) * self.layout["cp"])

    @property
    def weights(self) -> float:
        """Bytes of a stage's tensor shard of the weights, its experts' ep shard: what FSDP
        gathers."""
        model = self.model
        layout = self.layout
        held = model.params - model.expert_params + model.expert_params / layout["ep"]
        return self.itemsize * held / layout["tp"] / layout["pp"]

    @property
    def dense_weights(self) -> float:
        """Of ``weights``, those outside the experts: what every ep shard holds whole."""
        dense = self.model.params - self.model.expert_params
        return self.itemsize * dense / self.layout["tp"] / self.layout["pp"]


def _among(send: Send[float], layout: Layout) -> int:
    """The devices ``send`` runs among: its own ``devices``, else all of its dimension's."""
    return send.devices or layout[send.dimension]


def _fsdp_sends(step: Step) -> list[Send[float]]:
    """FSDP gathers a stage's weights each pass (a pipeline's stage keeps its own through the
    backward pass) and reduce-scatters their gradients."""
    weights = step.weights
    shard = weights / step.layout["fsdp"]
    whole = int(step.layout["pp"] == 1)
    return [
        Send("all-gather", weights, dimension="fsdp", backward=False, of_weights=True),
        Send("all-gather", weights, dimension="fsdp", backward=True, times=whole, of_weights=True),
        Send("reduce-scatter", shard, dimension="fsdp", backward=True, of_weights=True),
    ]


def _dp_sends(step: Step) -> list[Send[float]]:
    """Each replica's gradients all-reduced, once FSDP scattered them."""
    shard = step.weights / step.layout["fsdp"]
    return [Send("all-reduce", shard, dimension="dp", backward=True, of_weights=True)]


def _tp_sends(step: Step) -> list[Send[float]]:
    """Megatron's with the sequence split between blocks: each block gathers its input's tokens and
    reduce-scatters its output; the backward pass the forward's transposed, twice."""
    streams = step.itemsize * step.group * step.model.width * 2 * step.model.layers  # two a layer
    stream = streams / step.layout["pp"]  # a stage's layers
    found = []
    for backward in (False, True):
        found += [
            Send("all-gather", stream, dimension="tp", backward=backward, times=1 + backward),
            Send(
                "reduce-scatter",
                stream / step.layout["tp"],
                dimension="tp",
                backward=backward,
                times=1 + backward,
            ),
        ]
    return found


def _pp_sends(step: Step) -> list[Send[float]]:
    """As ``minishard.pipeline`` compiles: a microbatch every tick (``bytes_sent`` counts the
    bubble's ticks, ``every_tick``), ``repeats`` times round the stages (Narayanan et al. 2021,
    §2.2.2: interleaving v chunks a stage multiplies these sends by v), and an all-reduce over
    the stages that hands the last stage's output to every stage, each pass."""
    # a stage's output, split by sp
    hop = step.itemsize * step.group * step.model.width / step.layout["tp"]
    found = []
    for backward in (False, True):
        found += [
            Send("collective-permute", hop, dimension="pp", backward=backward, times=step.repeats),
            # the last stage's output, to every stage
            Send("all-reduce", hop, dimension="pp", backward=backward),
        ]
    return found


def _cp_sends(step: Step) -> list[Send[float]]:
    """The keys and values a split sequence gathers, each layer (Llama 3's all-gather context
    parallelism): over cp, and over the data shards that share a sequence where they exceed the
    sequences (the book's "sequence parallelism" under FSDP). Each device gathers them whole
    in the forward pass; the backward pass reduce-scatters their gradients, a 1/n each. The
    weights are the same on each of cp's devices, which saw other tokens: their gradients are
    all-reduced over cp, as over dp (XLA runs the two one after the other)."""
    model = step.model
    layout = step.layout
    tokens = step.tokens
    context = step.context
    kv = 2 * step.itemsize * model.kv_heads * model.head_dim / min(layout["tp"], model.kv_heads)
    layers = model.layers / layout["pp"]
    shards = data_shards(layout)
    found = _gather_scatter("cp", kv * tokens / shards * layers, layout["cp"])  # a shard's tokens
    shard = step.weights / layout["fsdp"]  # what dp all-reduces
    found.append(Send("all-reduce", shard, dimension="cp", backward=True, of_weights=True))
    if context and shards * context > tokens:  # fewer sequences than data shards: they split them
        sharing = math.ceil(shards * context / tokens)
        # PLACEMENT's outermost
        outer = next(name for name in ("dp", "fsdp", "ep") if layout[name] > 1)
        found += _gather_scatter(outer, kv * context * layers, sharing, devices=sharing)
    return found


def _gather_scatter(
    dimension: str,
    gathered: float,
    ways: int,
    devices: int = 0,
) -> list[Send[float]]:
    scattered = gathered / ways
    return [
        Send("all-gather", gathered, dimension=dimension, backward=False, devices=devices),
        Send("reduce-scatter", scattered, dimension=dimension, backward=True, devices=devices),
    ]


def _ep_sends(step: Step) -> list[Send[float]]:
    """Each MoE layer sends every token to its ``top_k`` experts and the results home (two
    all-to-alls a layer forward, their transposes backward: ``minishard.experts``), a token split by
    sp between blocks; the weights outside the experts, whole on each ep shard, all-reduce their
    gradients."""
    model = step.model
    layout = step.layout
    routed = step.itemsize * step.group / layout["tp"] * model.top_k * model.width
    layers = 2 * model.layers // layout["pp"]
    shard = step.dense_weights / layout["fsdp"]
    return [
        Send("all-to-all", routed, dimension="ep", backward=False, times=layers),
        Send("all-to-all", routed, dimension="ep", backward=True, times=layers),
        Send("all-reduce", shard, dimension="ep", backward=True, of_weights=True),
    ]


SENDS = {
    "fsdp": _fsdp_sends,
    "dp": _dp_sends,
    "tp": _tp_sends,
    "pp": _pp_sends,
    "cp": _cp_sends,
    "ep": _ep_sends,
}
"""Each dimension's collectives and their bytes, from one ``Step``: the weights' first, then the
activations'. A new dimension adds its own here (its rule, ``styles.Dimension``, names their
kinds)."""


def sends(
    model: Decoder,
    layout: Layout,
    tokens: float,
    itemsize: int = 2,
    context: int = 0,
    microbatches: int = 1,
    repeats: int = 1,
) -> list[Send[float]]:
    """The collectives of one step of ``tokens`` in sequences of ``context``, by dimension
    (``SENDS``), numbers of ``itemsize`` bytes (bf16), a pipeline of ``microbatches`` and
    ``repeats``; those among more than one device.

    >>> from minishard.serving import MINISHARD_GPT
    >>> [send.kind for send in sends(MINISHARD_GPT, Layout(fsdp=8), 1024)]
    ['all-gather', 'all-gather', 'reduce-scatter']
    """
    step = Step(model, layout, tokens, itemsize, context, microbatches, repeats)
    found = [send for sends_of in SENDS.values() for send in sends_of(step)]
    return [send for send in found if _among(send, layout) > 1 and send.times]


def bytes_sent(
    model: Decoder,
    layout: Layout,
    tokens: float,
    itemsize: int = 2,
    context: int = 0,
    microbatches: int = 1,
    repeats: int = 1,
) -> dict[str, float]:
    """Bytes each device sends in one step, by dimension: ``sends`` on rings (``costs.sent_bytes``),
    as a compiled step's census sums them (float32: dp's all-reduce of the GPT's 3.3 MB of
    gradients).

    >>> from minishard.serving import MINISHARD_GPT
    >>> bytes_sent(MINISHARD_GPT, Layout(dp=8), 1024, itemsize=4)   # 2 x 7/8 x 4 x 816,193
    {'dp': 5713351.0}
    """
    found: dict[str, float] = {}
    work = repeats * microbatches  # a stage's work items: r chunks of each microbatch
    ticks = (work + layout["pp"] - 1) / work  # a pipeline's ticks a work item
    for send in sends(model, layout, tokens, itemsize, context, microbatches, repeats):
        sent = send.times * sent_bytes(send.kind, send.result_bytes, _among(send, layout))
        sent *= ticks if every_tick(send, layout) else 1
        found[send.dimension] = found.get(send.dimension, 0.0) + sent
    return found


def every_tick(send: Send, layout: Layout) -> bool:
    """Whether a pipeline's loop runs ``send`` every one of its m + p - 1 ticks, the bubble's too
    (``minishard.pipeline``): a stage's activations' collectives (tp's, cp's, ep's, the hop to the
    next stage), not the weights' nor the all-reduce that hands the output out after the loop.
    Its seconds need no such count: ``LayoutCost.step_s`` prices the bubble's ticks as busy ones.

    >>> every_tick(Send("all-gather", 1.0, dimension="tp"), Layout(tp=2, pp=4))
    True
    """
    handed_out = send.dimension == "pp" and send.kind == "all-reduce"
    return layout["pp"] > 1 and not send.of_weights and not handed_out


def pass_collectives(
    model: Decoder,
    layout: Layout,
    tokens: int,
    hardware: Hardware,
    itemsize: int = 2,
    context: int = 0,
    microbatches: int = 1,
    repeats: int = 1,
) -> tuple[CommSeconds, CommSeconds]:
    """The seconds of the forward pass's ``sends`` and of the backward pass's, each over its torus
    axes and its network level (``Layout.inner``), split into the weights' and the activations'."""
    axes = layout.axes(hardware)
    seconds = dict.fromkeys([(0, 0), (0, 1), (1, 0), (1, 1)], 0.0)
    for send in sends(model, layout, tokens, itemsize, context, microbatches, repeats):
        n_axes = axes.get(send.dimension, 1)
        inner = layout.inner(send.dimension)
        devices = _among(send, layout)
        one = collective_time(send.kind, send.result_bytes, devices, hardware, n_axes, inner)
        seconds[int(send.backward), int(send.of_weights)] += send.times * one
    forward = CommSeconds(weights=seconds[0, 1], activations=seconds[0, 0])
    backward = CommSeconds(weights=seconds[1, 1], activations=seconds[1, 0])
    return forward, backward


def _memory(
    model: Decoder,
    layout: Layout,
    tokens: float,
    schedule: tuple[int, int],
    kept: Kept,
    attention: tuple[int, bool],
) -> Budget:
    """Per device of the fullest stage (``uneven``): its weights (``_weights``), what its layers
    keep (``kept_by_remat``) for the ``held_microbatches`` of ``schedule`` (microbatches, repeats),
    and the layer the backward pass recomputes (``layer_bytes`` of ``attention``'s context and
    kernel; none without remat), over tp and cp, in Korthikanti's 16-bit bytes scaled to dtype."""
    context, fused = attention
    microbatch = tokens / data_shards(layout) / schedule[0]  # a pipeline's, or a shard's tokens
    fullest = uneven(model.layers, layout["pp"], schedule[1])  # the fullest stage holds the most
    held = held_microbatches(layout["pp"], *schedule)
    shards = layout["fsdp"] * layout["tp"] * layout["pp"]
    terms = _weights(model, layout, kept.precision, fullest)
    weight = itemsize(kept.precision.params)  # the dtype the step computes in
    layers = kept_by_remat(model, microbatch * held, context, kept, fused)
    stage = layers / layout["pp"] * fullest  # the fullest stage's layers' share
    terms["activations"] = weight / 2 * stage / layout["tp"] / layout["cp"]
    if context and kept.remat != "none":
        recomputed = weight / 2 * layer_bytes(model, microbatch, context, fused)
        terms["recomputed layer"] = recomputed / layout["tp"] / layout["cp"]
    return Budget(terms, shards * layout["ep"] if model.experts else shards)


def _weights(
    model: Decoder,
    layout: Layout,
    precision: Precision,
    fullest: float,
) -> dict[str, float]:
    """The fullest stage's weights, per device: each per-parameter term over the dimensions that
    split them (fsdp, tp, pp; ep a mixture's experts), and the layer FSDP gathers (a stage's
    layers, under pp), ``fullest`` (``uneven``) times an even stage's."""
    shards = layout["fsdp"] * layout["tp"] * layout["pp"]
    params = model.params - model.expert_params + model.expert_params / layout["ep"]
    per_parameter = bytes_per_parameter(precision, "adamw")
    terms = {name: size * params / shards * fullest for name, size in per_parameter.items() if size}
    if layout["fsdp"] > 1:
        gathered = model.layers / layout["pp"] * fullest if layout["pp"] > 1 else 1
        layer = itemsize(precision.params) * params / model.layers  # one layer's weights, whole
        terms["gathered"] = layer * gathered / layout["tp"]
    return terms


# --- 3. every layout, ranked ----------------------------------------------------------------------


def layouts(model: Decoder, devices: int, context: int = 0, repeats: int = 1) -> list[Layout]:
    """Every ``dp x fsdp x tp x pp x cp x ep = devices`` whose tp divides the heads and the MLP's
    width, whose pp the layers (in ``repeats`` chunks a stage), whose cp the ``context`` (0: no cp)
    and whose ep a mixture's experts (a dense model: no ep).

    >>> from minishard.serving import LLAMA3_70B as llama
    >>> len(layouts(llama, 8)), [str(layout) for layout in layouts(llama, 2, context=4096)]
    (20, ['fsdp 2', 'dp 2', 'cp 2', 'pp 2', 'tp 2'])
    """
    _checks.count("layouts: devices", devices)
    found = []
    for tp in _divisors(devices):
        if model.heads % tp or model.hidden % tp:
            continue
        splits = _divisors(devices // tp)  # pp 1: no pipeline, nothing to repeat
        for pp in (pp for pp in splits if pp == 1 or model.layers % (pp * repeats) == 0):
            # cp divides the sequence
            for cp in _divisors(math.gcd(devices // tp // pp, context or 1)):
                for ep in _divisors(math.gcd(devices // tp // pp // cp, model.experts or 1)):
                    rest = devices // tp // pp // cp // ep
                    for dp in _divisors(rest):
                        found.append(Layout(dp=dp, fsdp=rest // dp, tp=tp, pp=pp, cp=cp, ep=ep))
    return found


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


_COLUMNS = f"{'step':>9} {'bubble':>6} {'flips at':>9} {'memory':>9}"
"""The heads of ``Ranking.table``'s columns after the layout's."""


@dataclasses.dataclass(frozen=True)
class Ranking:
    """Every layout's cost, those that fit first, fastest first; ``rule``: the book's pick."""

    model: Decoder
    tokens: int
    costs: tuple[LayoutCost, ...]
    rule: Layout | None

    def table(self, top: int = 5) -> str:
        """The ``top`` fastest that fit, then the best of each other set of dimensions, with or
        without cp (and the book's pick) wherever they rank, and a line for the rest."""
        fit = [cost for cost in self.costs if cost.fits]
        shown = fit[:top]
        kinds = {_kind(cost.layout) for cost in fit[:top]}
        for cost in fit[top:]:
            kind = _kind(cost.layout)
            if kind not in kinds or cost.layout == self.rule:
                shown.append(cost)
                kinds.add(kind)
        width = max([34, *(len(_with_axes(cost)) for cost in shown)])  # 34 but for a longer layout
        lines = [f"  {'layout':{width}} {_COLUMNS}  verdict"]
        for cost in shown:
            flips = "never" if cost.flips_at == math.inf else f"{cost.flips_at:,.0f}"
            mark = "*" if cost is fit[0] else " "
            rule = "  <- the book's X_opt" if cost.layout == self.rule else ""
            bubble = f"{cost.bubble:.1%}" if cost.layout["pp"] > 1 else "-"
            step = human_seconds(cost.step_s)
            memory = human_bytes(int(cost.memory.total))
            cells = f"{step:>9} {bubble:>6} {flips:>9} {memory:>9}  {cost.verdict}"
            lines.append(f"{mark} {_with_axes(cost):{width}} {cells}{rule}{_shares(cost)}")
        out = [cost for cost in self.costs if not cost.fits]
        rest = [f"{len(fit) - len(shown)} more fit, slower"] if len(fit) > len(shown) else []
        if out:
            small = min(out, key=lambda c: c.memory.total)
            needs = human_bytes(int(small.memory.total))
            rest.append(f"{len(out)} do not fit, the smallest {small.layout}: {needs}")
        return "\n".join([*lines, f"  ({'; '.join(rest)})"] if rest else lines)


def rank(
    model: Decoder,
    tokens: int,
    devices: int,
    hardware: Hardware | str,
    context: int = CONTEXT,
    fused: bool = True,
    kept: Kept = KEPT,
    repeats: int = 1,
) -> Ranking:
    """``price`` every layout of ``devices``, of ``tokens`` in sequences of ``context`` (``fused``:
    attention keeps no scores; ``kept``: what the step keeps; ``repeats``: a pipeline stage's
    chunks); those that fit first, fastest first (then the one waiting least, then the smaller).

    ``rule``: on a torus, the FSDP x TP layout nearest the book's ``optimal_fsdp`` (TP on one axis).
    """
    _checks.count("rank: tokens", tokens, minimum=devices)
    _checks.one_of("rank: remat", kept.remat, tuple(POLICIES))
    hardware = hardware_named(hardware)
    costs = [
        price(model, layout, tokens, hardware, kept, context, fused=fused, repeats=r)
        for layout, r in _schedules(model, devices, tokens, hardware, context, repeats)
    ]
    costs.sort(key=lambda c: (not c.fits, c.step_s, c.bound, c.memory.total))
    fsdp_and_tp = [c.layout for c in costs if set(c.layout.sizes) <= {"fsdp", "tp"}]
    mixed = [layout for layout in fsdp_and_tp if "tp" in layout.sizes]
    best = optimal_fsdp(tokens, devices, model.hidden, fsdp_axes=max(1, hardware.axes - 1))
    nearest = min(mixed, key=lambda layout: abs(math.log(layout["fsdp"] / best)), default=None)
    rule = nearest if hardware.topology == "torus" else None
    return Ranking(model, tokens, tuple(costs), rule)


def _schedules(
    model: Decoder, devices: int, tokens: int, hardware: Hardware, context: int, repeats: int
) -> list[tuple[Layout, int]]:
    """Each of the ``layouts`` and its stage's chunks: ``repeats``, 1 without a pipeline; a pipeline
    of fewer microbatches than stages left out (the circular schedule cannot run it:
    ``pipeline.schedule``)."""
    found = []
    for layout in layouts(model, devices, context, repeats):
        r = repeats if layout["pp"] > 1 else 1
        if r == 1 or microbatches(layout, tokens, hardware, context) >= layout["pp"]:
            found.append((layout, r))
    return found


def _kind(layout: Layout) -> tuple[str, ...]:
    """The dimensions a table shows the best of, cp aside: a sequence's split rides on any of
    them."""
    return tuple(name for name in layout.ways() if name != "cp")


def _shares(cost: LayoutCost) -> str:
    """What a data shard holds where it is not whole sequences: part of one (priced: their keys and
    values gathered, ``sends``), or an uneven share (priced at the average, which the largest
    exceeds)."""
    share = cost.shard_sequences
    if not share or share == int(share):
        return ""
    if share < 1:
        return f"  [a sequence over {1 / share:.3g} shards]"
    return f"  [uneven: {share:,.4g} sequences a shard]"


def _with_axes(cost: LayoutCost) -> str:
    """The layout, with the torus axes of a dimension that takes more than one."""
    axes = cost.layout.axes(cost.hardware) if cost.hardware.topology == "torus" else {}
    many = {name: n for name, n in axes.items() if n > 1}
    return " x ".join(
        f"{name} {size}" + (f" ({many[name]:g} axes)" if name in many else "")
        for name, size in cost.layout.ways().items()
    ) or str(cost.layout)


def human_seconds(seconds: float) -> str:
    """``human_bytes``'s twin for a step's time: milliseconds under a second.

    >>> human_seconds(0.4576), human_seconds(60.6)
    ('458 ms', '60.6 s')
    """
    return f"{seconds * 1e3:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"


__all__ = [
    "CHECKPOINTS",
    "Layout",
    "LayoutCost",
    "Ranking",
    "CommSeconds",
    "bytes_sent",
    "every_tick",
    "sends",
    "checkpoint_bytes",
    "layouts",
    "held_microbatches",
    "optimal_fsdp",
    "pass_collectives",
    "price",
    "rank",
    "human_seconds",
    "KEPT",
    "Kept",
    "kept_by_remat",
    "microbatches",
    "CONTEXT",
    "recomputed_flops",
    "train_flops",
    "train_seconds",
]
