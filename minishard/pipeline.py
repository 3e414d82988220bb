"""Pipeline parallelism by hand: microbatches, stacked blocks, GPipe, the circular schedule.

Data, tensor and fully-sharded parallelism are annotations: ``Sharded`` hands
shardings to ``jax.jit`` and XLA inserts the collectives. A pipeline cannot be
had that way. Its stages are *different layers* on different devices, and what
moves between them is a microbatch's activations, stage ``d`` to stage ``d + 1``,
tick after tick: a loop, with one ``jax.lax.ppermute`` per tick, inside
``jax.shard_map``, where each device runs its own part of the program. This
module writes that loop in five steps:

1. **Microbatches.** ``split_microbatches`` splits a batch into ``m`` (``join_microbatches``
   puts it back); ``microbatched`` adds up their gradients in a ``lax.scan``: the same
   gradients, ``m`` times less activation memory; the first half of a pipeline.
2. **Stacked blocks.** ``Stacked``: ``n`` identical blocks, their parameters on a leading
   ``"stage"`` axis, run in order by ``run_blocks``; the rule ``stage -> "stage"`` (the ``pp``
   style) gives each device its layers. ``stack`` turns a built model's blocks into a
   ``StackedModel`` (``unstack`` undoes it; ``stacked_mlp`` builds one; ``stack_blocks`` and
   ``unstack_blocks`` do it to the blocks alone): the same function of the same numbers.
3. **GPipe.** ``work(tick, stage)`` says what a stage does at a tick (``schedule`` lists it,
   ``draw`` draws it); ``gpipe`` is one device's tick loop, each tick its layers
   (``stage_layers``) on a microbatch and one ``ppermute`` round the ``ring_pairs``;
   ``run_pipeline`` runs it as a ``Pipeline`` (the mesh, the microbatches) says.
4. **The circular schedule.** ``r`` repeats: each device holds ``r`` sets of layers and a
   microbatch goes round the ring ``r`` times (``repeat_layers``, ``circled_back``).
5. **Costs.** ``bubble_fraction`` (``megatron_bubble``, as Megatron writes it); ``in_flight``,
   the microbatches whose activations a stage keeps; ``pipeline_report`` reads ticks
   (``compiled_ticks``), bytes and memory from the program, a ``PipelineReport``.

Only the stage axis runs by hand here; a pipeline with other dimensions inside its stages (rows
over "data", tokens over "context", an MoE's statistics) is ``minishard.composition``'s.

>>> schedule(p=2, m=3)      # stage 1 starts a tick late and finishes a tick late: the bubble
[[0, 1, 2, None], [None, 0, 1, 2]]
>>> round(bubble_fraction(p=4, m=8), 3)
0.273
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from minishard import _checks, _checks_pipeline
from minishard._hlo import collective_instructions
from minishard.census import bytes_by_mesh_axes, collectives
from minishard.layers import ACTIVATIONS, Layer, Linear, Sequential, lifted, sow
from minishard.rules import LogicalAxes

# --- 1. microbatches: gradient accumulation ------------------------------------


def split_microbatches(batch: Any, m: int) -> Any:
    """``[B, ...]`` -> ``[m, B/m, ...]``, microbatch ``i`` = examples ``i, i+m, i+2m, ...``.

    Strided, not contiguous: a batch split over "data" keeps every device's
    examples on that device, one ``B/(m·data)`` slice of each microbatch.

    >>> split_microbatches(jnp.arange(6), 3).tolist()
    [[0, 3], [1, 4], [2, 5]]
    """

    def split(a: jax.Array) -> jax.Array:
        if a.shape[0] % m:
            raise ValueError(f"a batch of {a.shape[0]} does not split into {m} equal microbatches")
        return a.reshape(a.shape[0] // m, m, *a.shape[1:]).swapaxes(0, 1)

    return jax.tree.map(split, batch)


def join_microbatches(ys: jax.Array) -> jax.Array:
    """``split_microbatches``' inverse: ``[m, B/m, ...]`` -> ``[B, ...]``.

    >>> join_microbatches(split_microbatches(jnp.arange(6), 3)).tolist()
    [0, 1, 2, 3, 4, 5]
    """
    return ys.swapaxes(0, 1).reshape(ys.shape[0] * ys.shape[1], *ys.shape[2:])


def microbatched(
    loss_fn: Callable[..., Any],
    m: int,
    reduction: str = "mean",
) -> Callable[..., Any]:
    """``jax.value_and_grad(loss_fn, has_aux=True)``, computed ``m`` microbatches at a time.

    ``loss_fn(model, batch) -> (loss, aux)`` reduces over the batch (so does ``aux``, a pytree of
    scalars such as an accuracy) as ``reduction`` says: ``"mean"``, and the mean of ``m`` equal
    microbatches' means is the batch mean, and so are the gradients; ``"sum"``, the sum of their
    sums. Only one microbatch's activations are alive at a time.
    """
    _checks.count("microbatched: m", m)
    _checks.one_of("microbatched: reduction", reduction, ("mean", "sum"))
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def value_and_grad(model: Any, batch: Any) -> Any:
        def add_one(total: Any, microbatch: Any) -> tuple[Any, None]:
            return jax.tree.map(jnp.add, total, grad_fn(model, microbatch)), None

        microbatches = split_microbatches(batch, m)
        first = jax.tree.map(lambda a: a[0], microbatches)
        shapes = jax.eval_shape(grad_fn, model, first)
        zeros = jax.tree.map(jnp.zeros_like, shapes)  # the sums start at 0
        total, _ = jax.lax.scan(add_one, zeros, microbatches)
        return jax.tree.map(lambda t: t / m, total) if reduction == "mean" else total

    return value_and_grad


# --- 2. blocks stacked on a "stage" axis ---------------------------------------


class Stacked(Layer):
    """``n`` identical blocks as one: every parameter gains a leading ``"stage"`` axis.

    Built with ``jax.vmap`` over one key per block, so block ``k`` is what
    ``make_block(keys[k])`` alone would build; applied with ``lax.scan``, one
    compiled block for all ``n``. ``Stacked`` answers ``param_logical_axes`` for its
    block: every array in it leads with ``"stage"`` (Flax's ``nn.scan`` adds the same
    name with ``metadata_params``), and each Layer inside names the rest as it would
    unstacked. So ``plan`` and ``explain`` read
    ``blocks.block.layers[0].weight  ('stage', None, None)``.

    >>> from minishard import Linear, plan
    >>> blocks = Stacked(lambda k: Linear(4, 4, key=k), 3, key=jax.random.key(0))
    >>> type(blocks.block).__name__, blocks.block.weight.shape, blocks.param_logical_axes()
    ('Linear', (3, 4, 4), {'block': ('stage',)})
    >>> plan(blocks, jax.sharding.AbstractMesh((3,), ("stage",))).leaves[0].spec
    P('stage', None, None)
    """

    param_fields = ("block",)
    static_fields = ("n",)

    def __init__(self, make_block: Callable[[jax.Array], Layer], n: int, *, key: jax.Array) -> None:
        _checks_pipeline.stacked(n, key)
        self.block = jax.vmap(make_block)(jax.random.split(key, n))
        self.n = int(n)

    def __call__(self, x: jax.Array, *args: Any) -> jax.Array:
        return run_blocks(self.block, x, *args)

    def param_logical_axes(self) -> dict[str, LogicalAxes]:
        return {"block": ("stage",)}  # the leading axis of every array in the block: which block


def run_blocks(block: Any, x: jax.Array, *args: Any) -> jax.Array:
    """Apply stacked blocks in order: a ``lax.scan`` over their leading axis.

    ``args`` go to every block as they are (a GPT's: the tokens' ``positions``, which ring attention
    reads). What the blocks sow (an MoE's statistics, ``layers.sow``) leaves the scan as its
    output (``layers.lifted``), is added up over the blocks and sown again outside.
    """
    body = lambda h, one: lifted(one)(h, *args)  # noqa: E731
    # the scan's carry: each output is the next's input
    _checks_pipeline.blocks_keep_shape(body, block, x)
    y, sown = jax.lax.scan(body, x, block)
    sow(jax.tree.map(lambda s: s.sum(0), sown))
    return y


class StackedModel(Layer):
    """``after(blocks(before(x)))``, the blocks run sequentially or, with a ``pipeline``, pipelined.

    ``before`` and ``after`` (an embedding, a head) run outside the pipeline on
    every stage; the rules lay them out as for any model. ``positions``, where given (a GPT's
    tokens' under cp, dealt out zig-zag), go to ``before`` and to every block, pipelined or not:
    ``pipeline.run`` runs the blocks as the pipeline says.
    """

    param_fields = ("before", "blocks", "after")
    static_fields = ("pipeline",)

    def __init__(
        self,
        before: Any,
        blocks: Stacked,
        after: Any,
        pipeline: Pipeline | None = None,
    ) -> None:
        self.before = before
        self.blocks = blocks
        self.after = after
        self.pipeline = pipeline

    def __call__(self, x: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        args = () if positions is None else (positions,)
        h = self.before(x, *args)
        if self.pipeline is None:
            return self.after(self.blocks(h, *args))
        return self.after(self.pipeline.run(self.blocks, h, *args))


def stack(before: Any, blocks: Sequence[Layer], after: Any) -> StackedModel:
    """A built model, ``after(blocks[-1](... blocks[0](before(x))))``, its equal ``blocks``
    stacked: the same function of the same numbers, for a pipeline (each model says where its
    blocks are).

    >>> stacked = stack(None, [Linear(4, 4, key=jax.random.key(k)) for k in range(3)], None)
    >>> stacked.blocks.n, stacked.blocks.block.weight.shape
    (3, (3, 4, 4))
    """
    return StackedModel(before, stack_blocks(blocks), after)


def stack_blocks(blocks: Sequence[Layer]) -> Stacked:
    """Equal built ``blocks`` as one ``Stacked``: each parameter's ``n`` copies in one array, block
    ``i`` its slice ``i`` (a scanned GPT's blocks, ``minishard.models.gpt``; a pipeline's)."""
    like = jax.eval_shape(lambda: Stacked(lambda _: blocks[0], len(blocks), key=jax.random.key(0)))
    leaves = [jnp.stack(same) for same in zip(*map(jax.tree.leaves, blocks), strict=True)]
    return jax.tree.unflatten(jax.tree.structure(like), leaves)


def unstack_blocks(blocks: Stacked) -> list[Any]:
    """``stack_blocks``' inverse: block ``i`` of the stack, each parameter's slice ``i``."""

    def block(i: int) -> Any:
        return jax.tree.map(lambda leaf: leaf[i], blocks.block)

    return [block(i) for i in range(blocks.n)]


def unstack(model: StackedModel, like: Any) -> Any:
    """``stack``'s inverse: a model shaped as ``like`` (``jax.eval_shape`` is enough) holding
    ``model``'s parameters, block ``i`` the stack's slice ``i``: its leaves are before's, the
    blocks', after's."""
    blocks = [leaf for block in unstack_blocks(model.blocks) for leaf in jax.tree.leaves(block)]
    leaves = [*jax.tree.leaves(model.before), *blocks, *jax.tree.leaves(model.after)]
    return jax.tree.unflatten(jax.tree.structure(like), leaves)


def stacked_mlp(sizes: list[int], *, key: jax.Array, activation: str = "swish") -> StackedModel:
    """An MLP of ``sizes`` with its equal hidden Linears stacked: ``[784, 256, 256, 10]`` stacks 1.

    Weights have standard deviation ``1/sqrt(inputs)``: ``mlp``'s 0.01 fades to nothing in a
    deep stack.

    >>> build = lambda: stacked_mlp([784, 256, 256, 256, 10], key=jax.random.key(0))
    >>> jax.eval_shape(build).blocks.n
    2
    """
    width = sizes[1]
    k_in, k_blocks, k_out = jax.random.split(key, 3)
    if len(sizes) < 4 or set(sizes[1:-1]) != {width}:
        raise ValueError(f"stacked_mlp: sizes need >= 2 equal hidden widths, got {sizes}")
    if activation not in ACTIVATIONS:
        choices = sorted(ACTIVATIONS)
        raise ValueError(f"stacked_mlp: activation={activation!r}; choose one of {choices}")
    linear = lambda n_in, n_out, k: Linear(n_in, n_out, key=k, scale=n_in**-0.5)  # noqa: E731
    act = ACTIVATIONS[activation]
    first = Sequential([linear(sizes[0], width, k_in), act()])
    hidden_keys = jax.random.split(k_blocks, len(sizes) - 3)
    hidden = [Sequential([linear(width, width, k), act()]) for k in hidden_keys]
    last = linear(width, sizes[-1], k_out)
    return stack(first, hidden, last)


# --- 3. GPipe: the schedule, and the loop that runs it -------------------------


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """Where and how to pipeline: ``p`` stages on ``mesh[stage_axis]``, ``m`` microbatches.

    ``repeats``, ``r``: 1 is GPipe; more, the circular schedule. ``run`` runs stacked blocks so.
    A pipeline whose stages run other dimensions inside them (the rows over "data", the tokens
    over "context", an MoE's statistics) is ``minishard.composition.ComposedPipeline``.
    """

    mesh: Mesh
    microbatches: int
    repeats: int = 1
    stage_axis: str = "stage"

    def __post_init__(self) -> None:
        _checks_pipeline.pipeline(self)

    @property
    def stages(self) -> int:
        return int(self.mesh.shape[self.stage_axis])

    @property
    def ticks(self) -> int:
        return self.repeats * self.microbatches + self.stages - 1

    def run(self, blocks: Stacked, x: jax.Array, *args: Any) -> jax.Array:
        """``blocks(x, *args)``, pipelined: ``gpipe`` on every device of the stage axis, the only
        axis it runs by hand (another, "model" for tp, stays the annotations' inside a stage).
        ``args`` (a GPT's ``[T]`` positions) are the same for every microbatch and device."""
        _checks_pipeline.pipeline_batch("run_pipeline", x, self)
        layers = stage_layers(blocks, self)
        loop = functools.partial(_blocks_alone, pipeline=self)
        in_specs = (P(self.stage_axis), P(), *(P(),) * len(args))
        axes = {self.stage_axis}
        run = jax.shard_map(loop, mesh=self.mesh, in_specs=in_specs, out_specs=P(), axis_names=axes)
        return join_microbatches(run(layers, split_microbatches(x, self.microbatches), *args))


def work(tick: Any, stage: Any, m: int, r: int = 1) -> tuple[Any, Any, Any]:
    """What ``stage`` works on at ``tick``: ``(busy, microbatch, repeat)``, ints or traced arrays.

    Work item ``k = tick - stage``: microbatch ``k % m`` enters stage 0 at tick
    ``k`` and moves one stage per tick; after the last stage it comes back round
    to stage 0 for its next repeat ``k // m`` (the circular schedule).

    >>> work(tick=5, stage=1, m=4, r=2)   # microbatch 0, on its second round
    (True, 0, 1)
    """
    k = tick - stage
    busy = (k >= 0) & (k < m * r)
    return busy, k % m, k // m


def schedule(p: int, m: int, r: int = 1) -> list[list[Any]]:
    """Per stage, per tick: the microbatch worked on, or None (a bubble).

    With ``r > 1``, a cell is ``(microbatch, repeat)``.
    """
    _checks_pipeline.pipeline_sizes("schedule", p, m, r)
    if r > 1 and m < p:  # microbatch 0 would come back round to stage 0 before the last one started
        raise ValueError(f"a circular schedule needs m >= p microbatches, got m={m} < p={p}")

    def cell(t: int, d: int) -> Any:
        busy, i, j = work(t, d, m, r)
        return None if not busy else i if r == 1 else (i, j)

    return [[cell(t, d) for t in range(r * m + p - 1)] for d in range(p)]


def draw(grid: list[list[Any]]) -> str:
    """``schedule(p, m, r)`` as text: a row per stage, a column per tick, ``.`` for a bubble.

    A cell is the microbatch; with repeats, a ``'`` per repeat after the first.

    >>> print(draw(schedule(p=2, m=2)))
    stage 0 | 0 1 .
    stage 1 | . 0 1
    """
    text = [[_cell(work) for work in row] for row in grid]
    width = max(len(cell) for row in text for cell in row)
    rows = [" ".join(cell.ljust(width) for cell in row).rstrip() for row in text]
    return "\n".join(f"stage {d} | {row}" for d, row in enumerate(rows))


def _cell(work: Any) -> str:
    if work is None:
        return "."
    return f"{work[0]}" + "'" * work[1] if isinstance(work, tuple) else str(work)


def ring_pairs(p: int, shift: int = 1) -> list[tuple[int, int]]:
    """The ``ppermute`` pairs (source, target) of a ring of ``p`` devices: each sends ``shift`` on.

    >>> ring_pairs(3), ring_pairs(3, shift=-1)   # forward round the ring; and back (1F1B's)
    ([(0, 1), (1, 2), (2, 0)], [(0, 2), (1, 0), (2, 1)])
    """
    return [(d, (d + shift) % p) for d in range(p)]


def run_pipeline(blocks: Stacked, x: jax.Array, pipeline: Pipeline, *args: Any) -> jax.Array:
    """``blocks(x, *args)``, as a pipeline: ``p`` stages, each ``r`` sets of ``n / (p·r)`` layers.

    ``pipeline.run`` runs it: ``Pipeline``'s is the loop below (``gpipe``); a ``ComposedPipeline``
    (``minishard.composition``) runs other dimensions inside the stages.
    """
    return pipeline.run(blocks, x, *args)


def stage_layers(blocks: Stacked, pipeline: Pipeline) -> Any:
    """The stacked layers reordered ``[n] -> [p, r, L]``: device ``d`` holds sets ``d, d + p, ...``.

    A microbatch visits every device ``r`` times, round a ring. With ``r = 1`` the reorder is free,
    with ``r > 1`` XLA moves the layers each step.
    """
    hint = "stack them: Stacked(make_block, n, key=key)"
    _checks_pipeline.instance("run_pipeline: blocks", blocks, Stacked, hint)
    p = pipeline.stages
    r = pipeline.repeats
    if blocks.n % (p * r):
        raise ValueError(f"pipeline: {blocks.n} blocks do not split into {p} stages x {r} repeats")
    schedule(p, pipeline.microbatches, r)  # checks m >= p for a circular schedule
    return jax.tree.map(lambda a: a.reshape(r, p, -1, *a.shape[1:]).swapaxes(0, 1), blocks.block)


def gpipe(layers: Any, xs: jax.Array, pipeline: Pipeline, stage_work: Callable[..., Any]) -> Any:
    """One device's program: ``pipeline.ticks`` times, run its layers, pass the result on.

    ``stage_work(layers, x, busy) -> (y, report)``: a tick's work, this device's layers on ``x``;
    each tick's report (``None``: nothing to report) comes back stacked, beside the outputs."""
    p = pipeline.stages
    m = pipeline.microbatches
    r = pipeline.repeats
    axis = pipeline.stage_axis
    stage = jax.lax.axis_index(axis)
    layers = jax.tree.map(lambda a: a[0], layers)  # [r, L, ...]: this stage's sets of layers
    varying = functools.partial(jax.lax.pcast, axis_name=axis, to="varying")  # differs per stage
    # The shift register, the inputs, the outputs. A bubble holds NaN: a leak fails the tests
    carry = varying(jnp.full_like(xs[0], jnp.nan)), varying(xs), varying(jnp.full_like(xs, jnp.nan))

    def tick(carry: Any, t: jax.Array) -> tuple[Any, Any]:
        state, inputs, outputs = carry
        busy, i, j = work(t, stage, m, r)
        x = jnp.where(stage == 0, inputs[i], state)  # stage 0 starts microbatch i
        x = jnp.where(busy, x, 0.0)  # a bubble computes on zeros: NaN * 0 is NaN in the gradient
        y, report = stage_work(repeat_layers(layers, j, r), x, busy)
        done = busy & (stage == p - 1) & (j == r - 1)  # the last stage, on the last repeat
        outputs = outputs.at[i].set(jnp.where(done, y, outputs[i]))
        state = jax.lax.ppermute(y, axis, ring_pairs(p))  # the shift
        inputs = circled_back(inputs, state, t, stage, pipeline)
        return (state, inputs, outputs), report

    (_, _, outputs), reports = jax.lax.scan(tick, carry, jnp.arange(pipeline.ticks))
    outputs = jax.lax.psum(jnp.where(stage == p - 1, outputs, 0.0), axis)  # the last's, to all
    return outputs, reports


def _blocks_alone(layers: Any, xs: jax.Array, *args: Any, pipeline: Pipeline) -> jax.Array:
    """``gpipe`` with ``run_blocks`` as each stage's work: blocks that sow nothing collected."""

    def stage_work(here: Any, x: jax.Array, busy: jax.Array) -> tuple[jax.Array, None]:
        y, sown = lifted(run_blocks)(here, x, *args)
        # an MoE's statistics: a ComposedPipeline's
        _checks_pipeline.nothing_sown("run_pipeline", sown)
        return y, None

    outputs, _ = gpipe(layers, xs, pipeline, stage_work)
    return outputs


# --- 4. the circular schedule: r sets of layers per stage -----------------------
# Two steps in the loop above: a stage runs the set of layers of the microbatch's repeat, and
# stage 0 parks what the last stage sent round until its next repeat. With r = 1 the first is the
# one set, and nothing is ever parked: the loop is GPipe's.


def repeat_layers(layers: Any, j: jax.Array, r: int) -> Any:
    """A stage's set of layers for repeat ``j``: slice 0 if ``r = 1`` (at a traced ``j``, a new
    array each tick, kept per tick by ``jax.grad``)."""
    return jax.tree.map(lambda a: a[0] if r == 1 else a[jnp.clip(j, 0, r - 1)], layers)


def circled_back(
    inputs: jax.Array, sent: jax.Array, t: jax.Array, stage: jax.Array, pipeline: Pipeline
) -> jax.Array:
    """Stage 0's inputs, with what the last stage ``sent`` round at tick ``t`` parked for its next
    repeat (never with ``r = 1``: every microbatch's repeat is its last)."""
    m = pipeline.microbatches
    r = pipeline.repeats
    last_busy, i, j = work(t, pipeline.stages - 1, m, r)  # what the last stage worked on
    back = (stage == 0) & last_busy & (j < r - 1)
    return inputs.at[i].set(jnp.where(back, sent, inputs[i]))


# --- 5. what it costs -----------------------------------------------------------


def bubble_fraction(p: int, m: int, r: int = 1) -> float:
    """The share of a step a stage idles, over the *total* time (GPipe, MaxText).

    ``(p-1) / (r·m + p-1)``: ``p - 1`` ticks of bubble in ``r·m + p - 1``.
    """
    _checks_pipeline.pipeline_sizes("bubble_fraction", p, m, r)
    return (p - 1) / (r * m + p - 1)


def megatron_bubble(p: int, m: int, r: int = 1) -> float:
    """The bubble over the *ideal* time, as Megatron-LM writes it: ``(p-1)/(r·m)``. Grows past 1."""
    _checks_pipeline.pipeline_sizes("megatron_bubble", p, m, r)
    return (p - 1) / (r * m)


def in_flight(p: int, m: int, r: int = 1) -> float:
    """Microbatches whose activations, through all of a stage's layers, GPipe keeps for backward.

    ``jax.grad`` of ``run_pipeline``'s loop keeps what every tick computed until the transposed loop
    runs back over it: ``r·m + p - 1`` ticks, the bubbles' too (they compute on zeros), each through
    ``1/r`` of a stage's layers. So ``m + (p-1)/r``, and a stage keeps its layers' activations of
    every microbatch of the batch (``m`` of them) and more: the circular schedule (``r > 1``) keeps
    less of the bubble. 1F1B (``minishard.pipeline_1f1b``) keeps at most ``2p``, whatever ``m``.

    >>> in_flight(p=4, m=8), in_flight(p=4, m=8, r=2)
    (11.0, 9.5)
    """
    _checks_pipeline.pipeline_sizes("in_flight", p, m, r)
    return (r * m + p - 1) / r


@dataclasses.dataclass(frozen=True)
class PipelineReport:
    """What ``pipeline_report`` read from a compiled pipelined step; ``print`` shows it, drawn.

    >>> print(PipelineReport(2, 2, 1, 3, 1 / 3, 1 / 3, 96, 4_000_000))
    stages 2, microbatches 2, ticks 3 (read from the compiled loop)
    bubble 0.333 from the program, 0.333 = (p-1)/(m+p-1)
    collective-permute over 'stage': 96 bytes per step
    temporary memory: 4.00 MB per device
    stage 0 | 0 1 .
    stage 1 | . 0 1
    """

    stages: int
    microbatches: int
    repeats: int
    ticks: int  # read from the program: how often each collective-permute runs
    bubble: float  # (ticks - work) / ticks, from the program
    bubble_formula: float  # bubble_fraction(p, m, r)
    permute_bytes: int  # sent over the stage axis in one step
    temp_bytes: int  # temporary memory per device
    stage_axis: str = "stage"

    def __str__(self) -> str:
        p = self.stages
        m = self.microbatches
        r = self.repeats
        repeats = f", repeats {r}" if r > 1 else ""
        rm = "r·m" if r > 1 else "m"  # the work items, in the formula
        ticks = f"ticks {self.ticks} (read from the compiled loop)"
        formula = f"{self.bubble_formula:.3f} = (p-1)/({rm}+p-1)"
        lines = [
            f"stages {p}, microbatches {m}{repeats}, {ticks}",
            f"bubble {self.bubble:.3f} from the program, {formula}",
            f"collective-permute over {self.stage_axis!r}: {self.permute_bytes} bytes per step",
            f"temporary memory: {self.temp_bytes / 1e6:.2f} MB per device",
        ]
        return "\n".join([*lines, draw(schedule(p, m, r))])


def pipeline_report(
    step: Any,
    args: tuple[Any, ...],
    pipeline: Pipeline | None = None,
) -> PipelineReport:
    """What ``explain`` prints for a pipelined step: stages, ticks, bubble, bytes sent, temp memory.

    ``pipeline``: by default that of the first ``StackedModel`` in ``args``."""
    _checks_pipeline.pipelined("pipeline_report", pipeline, args)
    models = [a for a in args if isinstance(a, StackedModel)]
    pipeline = pipeline or next(model.pipeline for model in models if model.pipeline)
    p = pipeline.stages
    m = pipeline.microbatches
    r = pipeline.repeats
    compiled = step.lower(*args).compile()
    ticks = compiled_ticks(compiled)
    shift = ("collective-permute", (pipeline.stage_axis,))
    sent = bytes_by_mesh_axes(compiled).get(shift, 0)
    temp = compiled.memory_analysis().temp_size_in_bytes
    bubble = (ticks - r * m) / ticks
    formula = bubble_fraction(p, m, r)
    return PipelineReport(p, m, r, ticks, bubble, formula, sent, temp, pipeline.stage_axis)


def compiled_ticks(compiled: jax.stages.Compiled) -> int:
    """The ticks a program runs: how often each of its ``collective-permute``\\ s runs (the census).

    Each tick loop (forward, and its transpose in a gradient) holds one ``ppermute``,
    which the census counts once per trip of its loop.
    """
    found = collective_instructions(compiled.as_text() or "")
    permutes = [c for c in found if c["kind"] == "collective-permute"]
    written = [c for c in permutes if c["phase"] != "-done"]  # an async one: its start alone
    return collectives(compiled)["collective-permute"].count // len(written)


__all__ = [
    "Pipeline",
    "PipelineReport",
    "Stacked",
    "StackedModel",
    "bubble_fraction",
    "circled_back",
    "compiled_ticks",
    "draw",
    "gpipe",
    "in_flight",
    "join_microbatches",
    "megatron_bubble",
    "microbatched",
    "pipeline_report",
    "repeat_layers",
    "ring_pairs",
    "run_blocks",
    "run_pipeline",
    "schedule",
    "split_microbatches",
    "stack",
    "stack_blocks",
    "stacked_mlp",
    "stage_layers",
    "unstack",
    "unstack_blocks",
    "work",
]
