"""Pipeline parallelism, written by hand: microbatches, stacked blocks, GPipe and circular schedules.

Data, tensor and fully-sharded parallelism are annotations: ``Sharded`` hands
shardings to ``jax.jit`` and XLA inserts the collectives. A pipeline cannot be
had that way. Its stages are *different layers* on different devices, and what
moves between them is a microbatch's activations, stage ``d`` to stage ``d + 1``,
tick after tick: a loop, with one ``jax.lax.ppermute`` per tick, inside
``jax.shard_map``, where each device runs its own part of the program. This
module writes that loop in four steps:

1. **Microbatches.** Split a batch into ``m``, add up their gradients in a ``lax.scan``: the
   same gradients, ``m`` times less activation memory; the first half of a pipeline.
2. **Stacked blocks.** ``n`` identical blocks, their parameters on a leading ``"stage"``
   axis: the rule ``stage -> "stage"`` (the ``pp`` preset) gives each device its layers.
3. **The schedule.** ``slot(tick, stage)`` says what a stage does at a tick; ``pipeline`` runs it.
4. **Costs.** ``bubble_fraction``; ``pipeline_report`` reads ticks, bytes and memory from the program.

>>> schedule(p=2, m=3)      # stage 1 starts a tick late and finishes a tick late: the bubble
[[0, 1, 2, None], [None, 0, 1, 2]]
>>> round(bubble_fraction(p=4, m=8), 3)
0.273
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from minishard._pipeline import compiled_ticks, draw, staged
from minishard.census import bytes_by_mesh_axes
from minishard.layers import Layer, Linear, Sequential, Swish

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


def microbatched(loss_fn: Callable[..., Any], m: int) -> Callable[..., Any]:
    """``jax.value_and_grad(loss_fn, has_aux=True)``, computed ``m`` microbatches at a time.

    ``loss_fn(model, batch) -> (loss, aux)`` must *average* over the batch (so
    must ``aux``, a pytree of scalars such as an accuracy): the mean of ``m``
    equal microbatches' means is the batch mean, and so are the gradients. Only
    one microbatch's activations are alive at a time.
    """
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def value_and_grad(model: Any, batch: Any) -> Any:
        def add_one(total: Any, microbatch: Any) -> tuple[Any, None]:
            return jax.tree.map(jnp.add, total, grad_fn(model, microbatch)), None

        microbatches = split_microbatches(batch, m)
        first = jax.tree.map(lambda a: a[0], microbatches)
        zeros = jax.tree.map(jnp.zeros_like, jax.eval_shape(grad_fn, model, first))  # the sums start at 0
        total, _ = jax.lax.scan(add_one, zeros, microbatches)
        return jax.tree.map(lambda t: t / m, total)

    return value_and_grad


# --- 2. blocks stacked on a "stage" axis ---------------------------------------


class Stacked(Layer):
    """``n`` identical blocks as one: every parameter gains a leading ``"stage"`` axis.

    Built with ``jax.vmap`` over one key per block, so block ``k`` is what
    ``make_block(keys[k])`` alone would build; applied with ``lax.scan``, one
    compiled block for all ``n``. Each Layer inside ``block`` answers
    ``param_logical_axes`` with ``"stage"`` in front (Flax's ``nn.scan`` adds the
    same name with ``metadata_params``), so ``plan`` and ``explain`` read
    ``blocks.block.layers[0].weight  ('stage', None, None)``.

    >>> from minishard import Linear
    >>> blocks = Stacked(lambda k: Linear(4, 4, key=k), 3, key=jax.random.key(0))
    >>> blocks.block.weight.shape, blocks.block.param_logical_axes()["weight"]
    ((3, 4, 4), ('stage', None, None))
    """

    param_fields = ("block",)
    static_fields = ("n",)

    def __init__(self, make_block: Callable[[jax.Array], Layer], n: int, *, key: jax.Array) -> None:
        self.block = staged(jax.vmap(make_block)(jax.random.split(key, n)))
        self.n = int(n)

    def __call__(self, x: jax.Array) -> jax.Array:
        return run_blocks(self.block, x)


def run_blocks(block: Any, x: jax.Array) -> jax.Array:
    """Apply stacked blocks in order: a ``lax.scan`` over their leading axis."""
    return jax.lax.scan(lambda h, one: (one(h), None), x, block)[0]


class StackedModel(Layer):
    """``after(blocks(before(x)))``, the blocks run sequentially or, with a ``schedule``, pipelined.

    ``before`` and ``after`` (an embedding, a head) run outside the pipeline on
    every stage; the rules lay them out as for any model.
    """

    param_fields = ("before", "blocks", "after")
    static_fields = ("schedule",)

    def __init__(self, before: Any, blocks: Stacked, after: Any, schedule: Schedule | None = None) -> None:
        self.before, self.blocks, self.after, self.schedule = before, blocks, after, schedule

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.before(x)
        h = self.blocks(h) if self.schedule is None else run_pipeline(self.blocks, h, self.schedule)
        return self.after(h)


def stacked_mlp(sizes: list[int], *, key: jax.Array) -> StackedModel:
    """``mlp(sizes)`` with its equal hidden Linears stacked: ``[784, 256, 256, 256, 10]`` stacks 2.

    Weights have standard deviation ``1/sqrt(inputs)``: ``mlp``'s 0.01 fades to nothing in a deep stack.

    >>> jax.eval_shape(lambda: stacked_mlp([784, 256, 256, 256, 10], key=jax.random.key(0))).blocks.n
    2
    """
    width, k_in, k_blocks, k_out = sizes[1], *jax.random.split(key, 3)
    if len(sizes) < 4 or set(sizes[1:-1]) != {width}:
        raise ValueError(f"stacked_mlp: sizes need >= 2 equal hidden widths, got {sizes}")
    linear = lambda n_in, n_out, k: Linear(n_in, n_out, key=k, scale=n_in**-0.5)  # noqa: E731
    before = Sequential([linear(sizes[0], width, k_in), Swish()])
    blocks = Stacked(lambda k: Sequential([linear(width, width, k), Swish()]), len(sizes) - 3, key=k_blocks)
    return StackedModel(before, blocks, linear(width, sizes[-1], k_out))


# --- 3. the schedule, and the loop that runs it ---------------------------------


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Where and how to pipeline: ``p`` stages on ``mesh[stage_axis]``, ``m`` microbatches, ``r`` repeats."""

    mesh: Mesh
    microbatches: int
    repeats: int = 1
    stage_axis: str = "stage"
    data_axis: str | None = None

    @property
    def stages(self) -> int:
        return int(self.mesh.shape[self.stage_axis])

    @property
    def ticks(self) -> int:
        return self.repeats * self.microbatches + self.stages - 1


def slot(tick: Any, stage: Any, m: int, r: int = 1) -> tuple[Any, Any, Any]:
    """What ``stage`` works on at ``tick``: ``(busy, microbatch, repeat)``, for ints or traced arrays.

    Work item ``k = tick - stage``: microbatch ``k % m`` enters stage 0 at tick
    ``k`` and moves one stage per tick; after the last stage it comes back round
    to stage 0 for its next repeat ``k // m`` (the circular schedule).

    >>> slot(tick=5, stage=1, m=4, r=2)   # microbatch 0, on its second round
    (True, 0, 1)
    """
    k = tick - stage
    return (k >= 0) & (k < m * r), k % m, k // m


def schedule(p: int, m: int, r: int = 1) -> list[list[Any]]:
    """Per stage, per tick: the microbatch worked on (``(microbatch, repeat)`` if ``r > 1``), or None."""
    if r > 1 and m < p:  # microbatch 0 would come back round to stage 0 before the last one started
        raise ValueError(f"a circular schedule needs m >= p microbatches, got m={m} < p={p}")

    def cell(t: int, d: int) -> Any:
        busy, i, j = slot(t, d, m, r)
        return None if not busy else i if r == 1 else (i, j)

    return [[cell(t, d) for t in range(r * m + p - 1)] for d in range(p)]


def run_pipeline(blocks: Stacked, x: jax.Array, plan: Schedule) -> jax.Array:
    """``blocks(x)``, as a pipeline: ``p`` stages, each holding ``r`` chunks of ``n / (p·r)`` layers.

    Device ``d`` holds chunks ``d, d + p, d + 2p, ...``: a microbatch visits every
    device ``r`` times, round a ring. The layers are reordered ``[n] -> [p, r, L]``
    here; with ``r = 1`` that is free, with ``r > 1`` XLA moves them each step.
    """
    p, m, r = plan.stages, plan.microbatches, plan.repeats
    if blocks.n % (p * r):
        raise ValueError(f"pipeline: {blocks.n} blocks do not split into {p} stages x {r} repeats")
    schedule(p, m, r)  # checks m >= p for a circular schedule
    chunks = jax.tree.map(lambda a: a.reshape(r, p, -1, *a.shape[1:]).swapaxes(0, 1), blocks.block)
    loop = functools.partial(_gpipe, plan=plan)
    x_spec = P(None, plan.data_axis)  # [m, B/m, ...]: microbatch rows split over "data", if any
    run = jax.shard_map(loop, mesh=plan.mesh, in_specs=(P(plan.stage_axis), x_spec), out_specs=x_spec)
    y = run(chunks, split_microbatches(x, m))
    return y.swapaxes(0, 1).reshape(x.shape[0], *y.shape[2:])  # undo the strided split


def _gpipe(chunks: Any, xs: jax.Array, *, plan: Schedule) -> jax.Array:
    """One device's program: ``plan.ticks`` times, run one chunk and pass the result on (``ppermute``)."""
    p, m, r, axis, data = plan.stages, plan.microbatches, plan.repeats, plan.stage_axis, plan.data_axis
    stage, chunks = jax.lax.axis_index(axis), jax.tree.map(lambda a: a[0], chunks)  # [r, L, ...]
    if data:  # cast once, so that the gradient's psum over "data" (its transpose) runs once, not per tick
        chunks = jax.lax.pcast(chunks, data, to="varying")
    varying = functools.partial(jax.lax.pcast, axis_name=axis, to="varying")  # differs per stage
    # The shift register, the inputs (where stage 0 also parks microbatches coming back round for
    # their next repeat) and the outputs. Bubbles hold NaN, so one that leaks fails the tests; a
    # NaN from full_like, not xs * NaN, whose gradient would be 0 * NaN = NaN.
    carry = varying(jnp.full_like(xs[0], jnp.nan)), varying(xs), varying(jnp.full_like(xs, jnp.nan))

    def tick(carry: Any, t: jax.Array) -> tuple[Any, None]:
        state, inputs, outputs = carry
        busy, i, j = slot(t, stage, m, r)
        x = jnp.where(stage == 0, inputs[i], state)  # stage 0 starts microbatch i (repeat j)
        x = jnp.where(busy, x, 0.0)  # a bubble computes on zeros: NaN * 0 would be NaN in the gradient
        y = run_blocks(jax.tree.map(lambda a: a[jnp.clip(j, 0, r - 1)], chunks), x)
        outputs = outputs.at[i].set(jnp.where(busy & (stage == p - 1) & (j == r - 1), y, outputs[i]))
        state = jax.lax.ppermute(y, axis, [(d, (d + 1) % p) for d in range(p)])  # the shift
        sent, i_back, j_back = slot(t, p - 1, m, r)  # what the last stage sent round to stage 0
        back = (stage == 0) & sent & (j_back < r - 1)
        inputs = inputs.at[i_back].set(jnp.where(back, state, inputs[i_back]))
        return (state, inputs, outputs), None

    (_, _, outputs), _ = jax.lax.scan(tick, carry, jnp.arange(plan.ticks))
    return jax.lax.psum(jnp.where(stage == p - 1, outputs, 0.0), axis)  # the last stage's, to all


# --- 4. what it costs -----------------------------------------------------------


def bubble_fraction(p: int, m: int, r: int = 1) -> float:
    """The share of a step a stage idles, over the *total* time (GPipe, MaxText): ``(p-1)/(r·m+p-1)``."""
    return (p - 1) / (r * m + p - 1)


def megatron_bubble(p: int, m: int, r: int = 1) -> float:
    """The bubble over the *ideal* time, as Megatron-LM writes it: ``(p-1)/(r·m)``. Grows past 1."""
    return (p - 1) / (r * m)


def pipeline_report(step: Any, args: tuple[Any, ...], plan: Schedule | None = None) -> dict[str, Any]:
    """What ``explain`` prints for a pipelined step: stages, ticks, bubble, bytes sent, temp memory.

    ``plan``: by default the schedule of the first ``StackedModel`` in ``args``."""
    plan = plan or next(a.schedule for a in args if isinstance(a, StackedModel) and a.schedule)
    compiled = step.lower(*args).compile()
    ticks, work = compiled_ticks(compiled), plan.repeats * plan.microbatches
    return {
        "stages": plan.stages,
        "microbatches": plan.microbatches,
        "repeats": plan.repeats,
        "ticks": ticks,  # read from the program: how often each collective-permute runs
        "bubble": (ticks - work) / ticks,
        "bubble_formula": bubble_fraction(plan.stages, plan.microbatches, plan.repeats),
        "permute_bytes": bytes_by_mesh_axes(compiled).get(("collective-permute", (plan.stage_axis,)), 0),
        "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
    }


__all__ = [
    "Schedule",
    "Stacked",
    "StackedModel",
    "bubble_fraction",
    "compiled_ticks",
    "draw",
    "megatron_bubble",
    "microbatched",
    "run_pipeline",
    "pipeline_report",
    "run_blocks",
    "schedule",
    "slot",
    "split_microbatches",
    "stacked_mlp",
]
