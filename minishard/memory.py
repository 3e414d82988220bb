"""Will it fit? Every byte of one training step, per device, term by term.

Before "how fast" comes "will it fit". A training step holds, on each device:

* **parameters**, in the dtype the step computes with;
* **gradients**, one per parameter, in the dtype they are reduced in;
* **optimizer state**: SGD's momentum (one tensor per parameter), AdamW's two moments;
* a **master copy** in float32, under mixed precision, which the optimizer updates;
* **activations** the forward pass keeps for the backward pass (section 3);
* what a style adds: weights FSDP gathers whole, a pipeline's microbatches in flight,
  the ring's K/V chunks, an MoE's slots (section 4).

Section 1 counts bytes per parameter, and reproduces the published tables (the
Ultra-Scale Playbook's, Megatron-LM's distributed optimizer's, ZeRO's). Section 2
says which terms ZeRO's stages split. Section 3 is the activation formula of a
transformer block, in the form of Korthikanti et al. 2022. Section 4 adds a
step's terms from its plan (``minishard.sharding.plan``: each array's shard on one
device) and sets them against the compiler's ``memory_analysis()`` and an
accelerator's HBM. Nothing here compiles: an ``AbstractMesh`` and ``jax.eval_shape``
are enough to ask about a model far bigger than this machine.

The names, by section. 1: a step's dtypes are a ``Precision`` (the previous chapter's); each
number's ``itemsize``, and ``bytes_per_parameter`` from them and the optimizer's ``MOMENTS``. 2:
``ZERO_SPLITS`` says which terms each ZeRO stage splits (``OPTIMIZER_STATE`` the optimizer's own),
``zero_bytes`` what remains on a device. 3: ``korthikanti`` is the paper's formula for its ``PAPER``
policies, ``block_activations`` the same block's bytes under each of ``RECOMPUTE``,
``kept_by_policy`` what a ``jax.checkpoint`` policy keeps (``grouped_kv`` the k and v it keeps
fewer under grouped-query attention), ``head_activations`` and
``mlp_activations`` the rest of a model; ``kept_on_tpu`` is what XLA:TPU keeps instead
(``TPU_KEEPS``, per policy: its ``MXU`` copies in bf16, the softmax in the step's dtype;
``grouped_kv_on_tpu`` what it keeps fewer of k and v under grouped-query attention), one of the
``COMPILERS`` a prediction is for. 4: a ``Budget`` is a step's terms against the compiler's and the
chip's bytes: ``step_budget`` for a ``Sharded`` step, ``zero_budget`` for ZeRO's own.

>>> from minishard.precision import MIXED
>>> terms = bytes_per_parameter(MIXED, "adamw")
>>> terms, sum(terms.values())   # the Playbook's 16 bytes per parameter
({'parameters': 2, 'gradients': 2, 'master': 4, 'accumulated': 0, 'moments': 8}, 16)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, cast

import jax
import numpy as np
from jax.sharding import Mesh

from minishard import _checks
from minishard.census import human_bytes
from minishard.costs import Memory
from minishard.hardware import Hardware
from minishard.precision import FP32, Precision
from minishard.remat import POLICIES
from minishard.rules import AnyMesh, AxisRules
from minishard.sharding import Plan, Sharded
from minishard.zero import Mastered, ZeroStep, held_bytes

# --- 1. bytes per parameter --------------------------------------------------------------------


MOMENTS = {"sgd": 0, "momentum": 1, "adamw": 2}
"""float32 tensors per parameter each optimizer keeps: plain SGD none, its momentum one, AdamW
two."""


def itemsize(dtype: str | None) -> int:
    """Bytes of one number of ``dtype``; 0 for None (no such copy)."""
    return 0 if dtype is None else int(np.dtype(jax.numpy.dtype(dtype)).itemsize)


def bytes_per_parameter(precision: Precision = FP32, optimizer: str = "adamw") -> dict[str, int]:
    """Each term's bytes for one parameter: the Playbook's anatomy of a step's memory.

    >>> [sum(bytes_per_parameter(FP32, optimizer).values()) for optimizer in ("adamw", "momentum")]
    [16, 12]
    """
    _checks.one_of("bytes_per_parameter: optimizer", optimizer, tuple(MOMENTS))
    return {
        "parameters": itemsize(precision.params),
        "gradients": itemsize(precision.grads),
        "master": itemsize(precision.master),
        "accumulated": itemsize(precision.accumulated),
        "moments": MOMENTS[optimizer] * 4,
    }


# --- 2. what ZeRO splits ----------------------------------------------------------------------

OPTIMIZER_STATE = ("master", "accumulated", "moments")
"""What only the optimizer reads: ZeRO-1 (and Megatron's distributed optimizer) splits these."""
ZERO_SPLITS = {
    0: (),
    1: OPTIMIZER_STATE,
    2: (*OPTIMIZER_STATE, "gradients"),
    3: (*OPTIMIZER_STATE, "gradients", "parameters"),
}
"""The terms ZeRO's stage splits over the N data-parallel devices (Rajbhandari et al. 2020)."""
ZERO_STATE = ("parameters", "gradients", "optimizer state", "master")
"""A step's terms (section 4) that ZeRO-3 splits: everything per parameter."""


def zero_bytes(terms: dict[str, float], stage: int, devices: int) -> float:
    """Bytes per device when ZeRO's ``stage`` splits its terms over ``devices``.

    ZeRO's paper, mixed precision with K = 12 (master and two moments), Ψ parameters:
    stage 1 is 2Ψ + 2Ψ + KΨ/N, stage 2 2Ψ + (2Ψ + KΨ)/N, stage 3 (2Ψ + 2Ψ + KΨ)/N.
    Megatron-LM's distributed optimizer is stage 1: 8 + 8/N bytes per parameter in float32,
    6 + 12/N with bfloat16 weights (a float32 master split beside the moments), and so is
    ``minishard.zero``'s level 1 compiled (``compute="bfloat16"``): the weights whole and the rest
    split are its arguments, to the byte, and each device reduce-scatters its whole float32
    gradient.

    >>> from minishard.precision import MIXED
    >>> [zero_bytes(bytes_per_parameter(MIXED), stage, 8) for stage in (0, 1, 2, 3)]
    [16.0, 5.5, 3.75, 2.0]
    """
    _checks.one_of("zero_bytes: stage", stage, tuple(ZERO_SPLITS))
    _checks.count("zero_bytes: devices", devices)
    split = ZERO_SPLITS[stage]
    return float(sum(size / devices if name in split else size for name, size in terms.items()))


# --- 3. activations: what a transformer block keeps for its backward pass -------------------

PAPER = ("none", "selective", "full")
"""Korthikanti et al.'s: keep everything; recompute attention's core (the softmax) from q, k, v;
or the block from its input."""
RECOMPUTE = (*POLICIES, "selective")
"""What ``block_activations`` counts: each policy of ``minishard.remat``, and the paper's
selective."""


def korthikanti(
    s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False, recompute: str = "none"
) -> float:
    """Bytes per layer of Korthikanti et al. 2022, Table 2 (16-bit activations, with dropout).

    ``sbh(34 + 5as/h)``; tensor parallel over t: ``sbh(10 + 24/t + 5as/(ht))``;
    with sequence parallelism ``sbh(34 + 5as/h)/t``; selective recomputation drops the
    ``5as/h`` term (the softmax, its dropout mask and output); full keeps the input, ``2sbh``.

    minishard's block (``block_activations``) keeps, with ``heads head_dim = h`` and r = hidden / h,
    ``sbh(8 + 2r + as/h)`` numbers, for r = 4 in 16-bit bytes ``sbh(32 + 2as/h)`` against the
    paper's ``sbh(34 + 5as/h)``: no dropout by default (``--dropout 0``), so no mask after attention
    and after the MLP (``2sbh``), nor on the softmax's output (``3as²b`` less). Split over t, its
    norms stay whole without ``sp`` (the paper's 10 is 4 + 4 + its 2 masks).

    >>> korthikanti(2048, 1, 12288, 96) / 2**20   # GPT-3's 175B layer, one sequence: MiB
    2736.0
    """
    _checks.one_of("korthikanti: recompute", recompute, PAPER)
    attention = 0 if recompute == "selective" else 5 * a * s / h
    if recompute == "full":
        return 2 * s * b * h / (t if sp else 1)
    if sp or t == 1:
        return s * b * h * (34 + attention) / t
    return s * b * h * (10 + 24 / t + attention / t)


def block_activations(
    b: int,
    s: int,
    width: int,
    heads: int,
    head_dim: int,
    hidden: int,
    sp: int = 1,
    recompute: str = "none",
) -> int:
    """Numbers one of minishard's blocks keeps for its backward pass, per device (not bytes), as
    XLA:CPU keeps them: each unfused intermediate the backward pass reads (below, one a line).

    All sizes are one device's: ``b`` examples of ``s`` tokens, ``heads`` of its heads,
    ``hidden`` of its MLP's units; ``sp`` splits the residual stream's tokens (``tp+sp``).
    ``"selective"`` drops the softmax; remat's policies: ``kept_by_policy``; set against the
    paper's count: ``korthikanti``.

    >>> s, b, h, a = 64, 2, 128, 4
    >>> block_activations(b, s, h, a, h // a, 4 * h) == s * b * h * (16 + a * s / h)
    True
    """
    _checks.one_of("block_activations: recompute", recompute, RECOMPUTE)
    if recompute not in ("none", "selective"):
        return kept_by_policy(b, s, width, heads, head_dim, hidden, sp, recompute)
    norms = 4 * b * s * width // sp  # the two LayerNorms' inputs and outputs
    projected = 4 * b * s * heads * head_dim  # q, k, v and attention's output
    softmax = 0 if recompute == "selective" else b * heads * s * s  # its output
    swish = 2 * b * s * hidden  # the MLP's Swish, its input and output
    return norms + projected + softmax + swish


def kept_by_policy(
    b: int, s: int, width: int, heads: int, head_dim: int, hidden: int, sp: int, policy: str
) -> int:
    """Numbers a block keeps under a ``jax.checkpoint`` ``policy``: its input, ``sbh``, and what it
    saves.

    * ``"full"``: nothing more: ``sbh``;
    * ``"names"``: q, k, v and attention's output: ``sbh(2 + 3)`` = ``5sbh``;
    * ``"dots"``: every matmul's output: q, k, v, the scores, the sum over values, the out
      projection's and the MLP's first: ``sbh(2 + 4 + r + as/h)``.

    >>> s, b, h, a = 64, 2, 128, 4
    >>> policies = ("full", "names", "dots")
    >>> [kept_by_policy(b, s, h, a, h // a, 4 * h, 1, p) // (s * b * h) for p in policies]
    [1, 5, 12]
    """
    stream = b * s * width // sp  # the block's input (and attention's output: as wide)
    qkv = 3 * b * s * heads * head_dim
    scores = b * heads * s * s
    summed = b * s * heads * head_dim  # the softmax's weights times the values
    mlp_in = b * s * hidden
    kept = {
        "full": stream,  # the block's input alone; the backward pass runs the block again
        "names": 2 * stream + qkv,  # its input, q, k, v, and attention's output
        "dots": 2 * stream + qkv + scores + summed + mlp_in,
    }
    return kept[policy]


def grouped_kv(b: int, s: int, heads: int, kv_heads: int, head_dim: int) -> int:
    """Numbers a block keeps fewer under grouped-query attention than ``block_activations`` and
    ``kept_by_policy`` count at ``heads``: k and v have ``kv_heads`` heads, each
    ``b·s·(heads - kv_heads)·head_dim`` numbers fewer, wherever the policy keeps them (all but
    ``"full"``). The ring sends them so too (``minishard.composition.ring_in_flight``).

    >>> grouped_kv(b=2, s=16, heads=4, kv_heads=1, head_dim=8)   # k and v: 1 head of 8, not 4
    1536
    """
    return 2 * b * s * (heads - kv_heads) * head_dim


COMPILERS = ("xla:cpu", "xla:tpu")
"""Whose program a prediction is of. The two keep different things for the backward pass."""
MXU = "bfloat16"
"""The dtype a TPU's matrix unit reads at JAX's default precision: a float32 matmul's operands
too."""


TPU_KEEPS = {
    "none": ("stream", "q, k, v, out", "softmax", "mlp hidden"),
    "full": ("input",),  # the block's input alone
    "names": ("stream", "q, k, v"),  # its input, q, k, v as named, and the out projection's output
    "dots": ("stream", "q, k, v", "scores", "summed", "mlp hidden"),  # every matmul's but the last
}
"""The terms of ``kept_on_tpu`` each ``--remat`` policy keeps, read from XLA:TPU's programs."""


def kept_on_tpu(
    b: int, s: int, width: int, heads: int, head_dim: int, hidden: int, compute: str, policy: str
) -> dict[str, int]:
    """Bytes one of minishard's blocks keeps for its backward pass in XLA:TPU's program, by term,
    for one device's sizes computed in ``compute`` under remat ``policy`` (``TPU_KEEPS``).

    Read from XLA:TPU's buffers live at the step's peak (``benchmarks/memory_aot.py``), fewer than
    XLA:CPU's (``block_activations``): each LayerNorm's input; q, k, v and attention's output in
    the MXU's bfloat16 (``MXU``) even in float32; the softmax's weights in ``compute``
    (``context.narrow_attend``), the scores too under ``dots``; the MLP's hidden units once.

    >>> kept = kept_on_tpu(16, 1024, 768, 12, 64, 3072, "bfloat16", "none")   # GPT-2 small's block
    >>> {term: n // 2**20 for term, n in kept.items()}   # MiB
    {'stream': 48, 'q, k, v, out': 96, 'softmax': 384, 'mlp hidden': 96}
    """
    _checks.one_of("kept_on_tpu: policy", policy, tuple(TPU_KEEPS))
    c = itemsize(compute)
    stream = b * s * width * c
    projected = b * s * heads * head_dim  # numbers in each of q, k, v and attention's output
    terms = {
        "input": stream,
        "stream": 2 * stream,  # the block's input and attention's (the second norm's input)
        "q, k, v, out": 4 * projected * itemsize(MXU),
        "q, k, v": 3 * projected * c,  # as the names policy saves them: the projections' outputs
        "softmax": b * heads * s * s * c,  # the weights, as attention keeps them
        "scores": b * heads * s * s * c,  # q·kᵀ, out of the matrix unit in compute (context.scores)
        "summed": projected * 4,  # the weights times the values, in float32
        "mlp hidden": b * s * hidden * c,
    }
    return {name: terms[name] for name in TPU_KEEPS[policy]}


def grouped_kv_on_tpu(
    b: int, s: int, heads: int, kv_heads: int, head_dim: int, compute: str, policy: str
) -> int:
    """``grouped_kv``'s numbers in bytes as ``kept_on_tpu`` keeps k and v: the ``MXU``'s copies
    under ``"none"``, ``compute`` under ``"names"`` and ``"dots"``, none under ``"full"``. What its
    terms count too many under grouped-query attention: XLA:TPU's 6 x 384 bf16 step with 2 K/V
    heads of 6 keeps 98.6 MB fewer than with 6, and this counts 100.7 MB.

    >>> grouped_kv_on_tpu(2, 16, 4, 1, 8, "float32", "dots")   # grouped_kv's 1,536, of 4 bytes
    6144
    """
    kept_as = {"none": MXU, "names": compute, "dots": compute}
    if policy not in kept_as:  # "full" keeps the block's input alone
        return 0
    return grouped_kv(b, s, heads, kv_heads, head_dim) * itemsize(kept_as[policy])


def head_activations(b: int, s: int, width: int, logits: int, sp: int = 1) -> int:
    """What the last LayerNorm and the head keep: the norm's input and output, and the logits'
    softmax (``logits`` per example: the GPT's s·vocab, the ViT's classes)."""
    return 2 * b * s * width // sp + b * logits


def mlp_activations(b: int, widths: tuple[int, ...]) -> int:
    """Numbers an MLP of layer sizes ``widths`` (one device's) keeps for ``b`` examples: each
    Linear's input, each activation's input, and the logits' softmax.

    >>> mlp_activations(8, (784, 512, 10))   # 8 x (784 + 512, the Linears; 512, the Swish; 10)
    14544
    """
    hidden = sum(widths[1:-1])
    return b * (widths[0] + 2 * hidden + widths[-1])


# --- 4. one step, from its plan ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Budget:
    """One step's bytes per device, term by term: ``terms`` maps a name to its bytes.

    ``arguments`` are what the step is called with (parameters, optimizer state and
    master copy, the batch): ``memory_analysis().argument_size_in_bytes`` exactly.
    ``temporaries`` (gradients, activations, gathered weights) are what it makes and
    frees: compare them with ``temp_size_in_bytes`` of a step that donates its arguments.
    """

    terms: dict[str, float]
    # the state (``split_terms``) in all over that on one device: the ways it is split
    split: float = 1.0
    # the terms split so: ZeRO-1/2 split only the optimizer's
    split_terms: tuple[str, ...] = ZERO_STATE
    # with a master: the weights computed with are cast from it each step
    cast_each_step: bool = True

    ARGUMENTS = ("parameters", "optimizer state", "master", "batch")

    @property
    def held(self) -> tuple[str, ...]:
        """The terms a step is called with; with a master copy, the compute copy is made each step
        (but ZeRO's bfloat16 step holds it whole, gathered from the master's shards:
        ``cast_each_step`` False)."""
        cast = "master" in self.terms and self.cast_each_step
        return tuple(name for name in self.ARGUMENTS if name != "parameters" or not cast)

    @property
    def arguments(self) -> float:
        return sum(size for name, size in self.terms.items() if name in self.held)

    @property
    def temporaries(self) -> float:
        return sum(size for name, size in self.terms.items() if name not in self.held)

    @property
    def total(self) -> float:
        return self.arguments + self.temporaries

    def table(self, compiled: Memory | None = None) -> str:
        """A row per term, then arguments, temporaries and the total; beside them the compiler's."""
        rows = [(name, human_bytes(int(size)), "") for name, size in self.terms.items()]
        sums = {"arguments": self.arguments, "temporaries": self.temporaries, "total": self.total}
        seen = None if compiled is None else _seen(compiled)
        for name, size in sums.items():
            beside = "" if seen is None else _versus(size, seen[name])
            rows.append((name, human_bytes(int(size)), beside))
        width = max(len(row[0]) for row in rows)
        header = f"{'term'.ljust(width)}  predicted  {'' if compiled is None else 'compiled'}"
        lines = [f"{n.ljust(width)}  {p.rjust(9)}  {c}".rstrip() for n, p, c in rows]
        return "\n".join([header.rstrip(), *lines])

    def verdict(self, hardware: Hardware, devices: int) -> str:
        """Does it fit on one ``hardware``'s HBM? If not, its largest term, and what ZeRO-3 over all
        ``devices`` would need (parameters, gradients and optimizer state split as far as they go).

        >>> from minishard.hardware import HARDWARE
        >>> Budget({"parameters": 2e9, "activations": 1e9}).verdict(HARDWARE["h100"], 8)
        'fits on one H100: 3.0 GB of 80.0 GB'
        >>> Budget({"parameters": 112e9}).verdict(HARDWARE["h100"], 8)
        'does not fit: 112.0 GB > 80.0 GB (parameters 112.0 GB); ZeRO-3 over 8 would need 14.0 GB'
        """
        total = human_bytes(int(self.total))
        hbm = human_bytes(int(hardware.hbm_bytes))
        if self.total <= hardware.hbm_bytes:
            return f"fits on one {hardware.name}: {total} of {hbm}"
        largest = max(self.terms, key=self.terms.__getitem__)
        line = f"does not fit: {total} > {hbm} ({largest} {human_bytes(int(self.terms[largest]))})"
        ways = {name: self.split if name in self.split_terms else 1 for name in ZERO_STATE}  # now
        state = {name: size for name, size in self.terms.items() if name in ways}
        saved = sum(size * (1 - ways[name] / devices) for name, size in state.items())
        zero3 = self.total - saved  # the whole state split over every device
        if zero3 > 0.99 * self.total:
            return f"{line}; its state is already split over the {devices} devices"
        return f"{line}; ZeRO-3 over {devices} would need {human_bytes(int(zero3))}"


def _seen(compiled: Memory) -> dict[str, float]:
    return {
        "arguments": compiled.arguments,
        "temporaries": compiled.temporaries,
        "total": compiled.arguments + compiled.temporaries,
    }


def _versus(predicted: float, seen: float) -> str:
    return f"{human_bytes(int(seen))} ({predicted / seen:.2f}x)" if seen else human_bytes(int(seen))


def step_budget(
    args: tuple[Any, Any, Any],
    mesh: AnyMesh,
    rules: AxisRules | None = None,
    precision: Precision = FP32,
    kept: Mapping[str, float] | None = None,
) -> Budget:
    """Per device: each term of a step on ``args``, ``(model, opt_state, batch)``, from
    ``Sharded``'s plan; ``kept``: the activations and a style's own terms, by name.

    >>> from minishard import mlp
    >>> args = (mlp([8, 16, 4], key=jax.random.key(0)), (), np.zeros((64, 8), np.float32))  # SGD's
    >>> mesh = jax.sharding.AbstractMesh((8,), ("data",))
    >>> step_budget(args, mesh, AxisRules(batch="data")).terms
    {'parameters': 848, 'batch': 256, 'gradients': 848, 'reduced gradients': 848}
    """
    shards = _shard_bytes(planned := Sharded(cast(Mesh, mesh), rules).plan_inputs(args), args)
    numbers, _, whole = shards["model"]  # the parameters' numbers on one device, and in all
    gathered, reduced = _replicas_and_gathers(planned, mesh, rules)
    terms = {
        "parameters": numbers * itemsize(precision.params),
        "optimizer state": shards["state"][1],
        "master": numbers * itemsize(precision.master),
        "batch": shards["batch"][1],
        "gradients": numbers * (itemsize(precision.grads) + itemsize(precision.accumulated)),
        **(kept or {}),
        "reduced gradients": reduced * itemsize(precision.grads),  # where replicas all-reduce
        "gathered": gathered * itemsize(precision.params),  # the most one weight FSDP gathers
    }
    return Budget({name: size for name, size in terms.items() if size}, whole / numbers)


def zero_budget(step: ZeroStep, args: tuple[Any, Any, Any], kept: Mapping[str, float]) -> Budget:
    """Per device: each term of ``minishard.zero``'s ``step`` on ``(model, opt_state, batch)``,
    placed by ``step.placed_shapes``; ``kept``: the activations. Held: the weights whole in
    ``step.compute`` (levels 1, 2) or 1/N (3), the state, float32 master and batch 1/N. The float32
    gradients: levels 1, 2 the whole model's, each whole until its reduce-scatter; level 3 one
    piece's (``ZeroStep.pieces``), the pieces' weights gathered, but the first's of several.

    >>> from minishard import SGD, mlp
    >>> model = jax.eval_shape(lambda: mlp([8, 16, 4], key=jax.random.key(0)))  # 212 numbers
    >>> step = ZeroStep(SGD(0.1, momentum=0.9), jax.sharding.AbstractMesh((8,), ("data",)), level=3)
    >>> terms = zero_budget(step, (*step.placed_shapes(model), np.zeros((64, 8))), {}).terms
    >>> terms["parameters"], terms["gradients"], terms["gathered"]  # 27 floats; the Linears' pieces
    (108, 576, 272)
    """
    model, state, batch = args
    master, inner = state if isinstance(state, Mastered) else (None, state)
    pieces = [4 * _numbers(piece) for piece in step.pieces(step.shapes)]  # float32 gradients
    terms = {
        "parameters": held_bytes(model),
        "optimizer state": held_bytes(inner),
        "master": held_bytes(master),
        "batch": sum(np.dtype(leaf.dtype).itemsize * leaf.size for leaf in jax.tree.leaves(batch)),
        "gradients": max(pieces) if step.level == 3 else sum(pieces),
        **kept,
        "reduced gradients": 4 * _numbers(step.shapes, step.n),
        "gathered": (sum(pieces[1:]) or pieces[0]) if step.level == 3 else 0,  # one piece: all
    }
    terms["batch"] //= step.n
    split = ZERO_STATE if step.level == 3 else ("optimizer state", "master")  # what n splits
    return Budget({name: n for name, n in terms.items() if n}, step.n, split, cast_each_step=False)


def _numbers(tree: Any, ways: int = 1) -> int:
    """The numbers of ``tree``'s leaves, each split ``ways`` ways (rounded up)."""
    return sum(-(-leaf.size // ways) for leaf in jax.tree.leaves(tree))


def _shard_bytes(plan: Plan, args: tuple[Any, ...]) -> dict[str, tuple[int, int, int]]:
    """Per argument of ``(model, opt_state, batch)``: numbers per device, their bytes, numbers in
    all.

    A plan's path starts with the argument's position ("[1].mu.layers[0].weight"); its
    leaves come in the order of the arguments' leaves, whose dtypes give the bytes.
    """
    found = {kind: [0, 0, 0] for kind in ("model", "state", "batch")}
    for leaf, array in zip(plan.leaves, jax.tree.leaves(args), strict=True):
        kind = ("model", "state", "batch")[int(leaf.path[1])]
        numbers = math.prod(leaf.shard_shape)
        found[kind][0] += numbers
        found[kind][1] += numbers * np.dtype(array.dtype).itemsize
        found[kind][2] += math.prod(leaf.shape)
    return {kind: (n, size, whole) for kind, (n, size, whole) in found.items()}


def _replicas_and_gathers(plan: Plan, mesh: AnyMesh, rules: AxisRules | None) -> tuple[int, int]:
    """Numbers FSDP gathers whole (the most one weight gains), and the parameters' numbers
    all-reduced.

    A parameter whole over a mesh axis that splits the tokens (the batch's axes, and under context
    parallelism the sequence's) is a data-parallel replica: its gradient is all-reduced, the sum
    written beside its summands. One split by its own axes over an axis that splits the batch is
    gathered whole (FSDP), but for a stack of experts split by ``"expert"``: the tokens go to their
    experts instead (two all-to-alls, ``minishard.experts``).
    """
    batch = {axis for leaf in plan.leaves if leaf.path[1] == "2" for axis in _mesh_axes(leaf.spec)}
    tokens = set(batch)
    if rules is not None and "seq" in dict(rules.pairs):  # a rule may split the sequence's too
        tokens |= _mesh_axes(rules.spec(("batch", "seq"), mesh))
    tokens = {axis for axis in tokens if dict(mesh.shape)[axis] > 1}  # one device sums nothing
    gathered = reduced = 0
    for leaf in plan.leaves:
        if leaf.path[1] != "0":
            continue
        numbers = math.prod(leaf.shard_shape)
        by_own_axes = zip(leaf.logical_axes, leaf.spec)
        own = _mesh_axes([entry for axis, entry in by_own_axes if axis != "expert"])
        if batch & own:
            gathered = max(gathered, math.prod(leaf.shape) - numbers)
        if tokens - _mesh_axes(leaf.spec):
            reduced += numbers
    return gathered, reduced


def _mesh_axes(spec: Any) -> set[str]:
    entries = [(entry,) if isinstance(entry, str) else entry for entry in spec if entry]
    return {axis for entry in entries for axis in entry}


__all__ = [
    "MOMENTS",
    "OPTIMIZER_STATE",
    "PAPER",
    "RECOMPUTE",
    "TPU_KEEPS",
    "ZERO_SPLITS",
    "COMPILERS",
    "MXU",
    "Budget",
    "block_activations",
    "bytes_per_parameter",
    "head_activations",
    "kept_by_policy",
    "grouped_kv",
    "grouped_kv_on_tpu",
    "kept_on_tpu",
    "itemsize",
    "korthikanti",
    "mlp_activations",
    "step_budget",
    "zero_budget",
    "zero_bytes",
]
