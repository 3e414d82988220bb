"""1F1B, one forward and one backward per tick, by hand: an appendix to ``minishard.pipeline``.

GPipe (``jax.grad`` of ``run_pipeline``) keeps every microbatch's activations until
its backward loop starts; 1F1B starts a microbatch's backward pass as soon as it
leaves the last stage, so a stage holds at most ``2p`` of them, however many
microbatches there are. Read it after the chapter: it builds on its ``work``,
``run_blocks`` and ``split_microbatches``, and nothing in the package imports it
(tests/test_pipeline.py checks its memory; docs/pipeline.md measures it). Its one public name:
``one_f_one_b``.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from minishard import _checks_pipeline
from minishard.pipeline import (
    Pipeline,
    Stacked,
    join_microbatches,
    ring_pairs,
    run_blocks,
    split_microbatches,
    work,
)


def one_f_one_b(
    blocks: Stacked,
    x: jax.Array,
    targets: jax.Array,
    loss_fn: Any,
    pipeline: Pipeline,
) -> Any:
    """``(loss, grads of blocks, grad of x)`` of ``mean(loss_fn(blocks(x), targets))``, as 1F1B.

    ``jax.grad`` of ``run_pipeline`` is GPipe: the backward loop is the transpose of the forward
    one and starts after it, so every microbatch's activations wait. Here one loop of
    ``m + 2p - 2`` ticks does, per stage and tick, a forward pass of its layers and a backward one
    (``jax.vjp``, recomputing the forward from its saved input): a stage saves the inputs of at
    most ``2p`` microbatches, however large ``m``. A plain ``Pipeline``, no repeats: the least."""
    hint = "stack them: Stacked(make_block, n, key=key)"
    _checks_pipeline.instance("one_f_one_b: blocks", blocks, Stacked, hint)
    p = pipeline.stages
    m = pipeline.microbatches
    axis = pipeline.stage_axis
    _checks_pipeline.pipeline_batch("one_f_one_b", x, pipeline)
    if type(pipeline).run is not Pipeline.run or pipeline.repeats != 1 or blocks.n % p:
        raise ValueError("one_f_one_b: one data replica, no repeats, blocks divisible by stages")
    loop = functools.partial(_one_f_one_b_loop, loss_fn=loss_fn, p=p, m=m, axis=axis)
    in_specs = (P(axis), P(), P())  # the layers by stage; the inputs and targets on every stage
    out_specs = (P(), P(axis), P())  # the loss, the layers' gradients by stage, the inputs'
    run = jax.shard_map(loop, mesh=pipeline.mesh, in_specs=in_specs, out_specs=out_specs)
    xs = split_microbatches(x, m)
    ts = split_microbatches(targets, m)
    loss, grads, x_grads = run(blocks.block, xs, ts)
    return loss, blocks.replace(block=grads), join_microbatches(x_grads)


def _one_f_one_b_loop(
    layers: Any, xs: jax.Array, ts: jax.Array, *, loss_fn: Any, p: int, m: int, axis: str
) -> Any:
    stage = jax.lax.axis_index(axis)
    carry = _first_carry(layers, xs, p, axis)

    def tick(carry: Any, t: jax.Array) -> tuple[Any, None]:
        fwd, bwd, saved, grads, x_grads, loss = carry
        f_busy, i_f, _ = work(t, stage, m)  # forward: as GPipe
        b_busy, i_b, _ = work(t, 2 * p - 2 - stage, m)  # backward: from the last stage back
        x = jnp.where(f_busy, jnp.where(stage == 0, xs[i_f], fwd), 0.0)
        saved = saved.at[i_f % (2 * p)].set(jnp.where(f_busy, x, saved[i_f % (2 * p)]))
        y = run_blocks(layers, x)
        value, y_grad = jax.value_and_grad(loss_fn)(y, ts[i_f])  # used on the last stage only
        g = jnp.where(b_busy, jnp.where(stage == p - 1, y_grad / m, bwd), 0.0)
        _, vjp = jax.vjp(run_blocks, layers, jnp.where(b_busy, saved[i_b % (2 * p)], 0.0))
        layers_grad, x_grad = vjp(g)
        grads = jax.tree.map(jnp.add, grads, layers_grad)
        x_grads = x_grads.at[i_b].set(jnp.where(b_busy & (stage == 0), x_grad, x_grads[i_b]))
        loss = loss + jnp.where(f_busy & (stage == p - 1), value / m, 0.0)
        fwd = jax.lax.ppermute(y, axis, ring_pairs(p))
        bwd = jax.lax.ppermute(x_grad, axis, ring_pairs(p, shift=-1))
        return (fwd, bwd, saved, grads, x_grads, loss), None

    (_, _, _, grads, x_grads, loss), _ = jax.lax.scan(tick, carry, jnp.arange(m + 2 * p - 2))
    return jax.lax.psum(loss, axis), grads, jax.lax.psum(jnp.where(stage == 0, x_grads, 0.0), axis)


def _first_carry(layers: Any, xs: jax.Array, p: int, axis: str) -> tuple[Any, ...]:
    """The loop's carry before its first tick: the forward and backward shift registers, the saved
    inputs (a ring of ``2p``), the sums (of the layers' gradients: they vary, as the layers do)."""
    varying = functools.partial(jax.lax.pcast, axis_name=axis, to="varying")
    zeros = jnp.zeros_like(xs[0])
    grads = jax.tree.map(jnp.zeros_like, layers)
    saved = jnp.zeros((2 * p, *zeros.shape))
    registers = varying(zeros), varying(zeros), varying(saved)
    return *registers, grads, varying(jnp.zeros_like(xs)), varying(0.0)


__all__ = ["one_f_one_b"]
