"""What ``minishard.pipeline`` leans on, kept out of the chapter: a reader may skip this file.

* ``staged``: how ``Stacked`` makes every Layer of a stacked block name its
  leading axis ``"stage"`` (a subclass per Layer class, same name and call);
* ``compiled_ticks``: the ticks, read back from the compiled program;
* ``pipeline_preset``, ``pipeline_rules``, ``stacked_mlp``, ``stacked_vit``,
  ``microbatched_train_step``: what ``minishard train --parallel pp`` (and
  ``--microbatches M``) uses;
* ``draw``: a schedule as a text grid, for docs/pipeline.md.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from minishard._hlo import collective_instructions
from minishard.census import collectives
from minishard.layers import Layer, Linear, Sequential, Swish
from minishard.losses import accuracy, cross_entropy, one_hot
from minishard.models.vit import Block, LayerNorm, MeanPool, PatchEmbedding
from minishard.presets import LOGICAL_AXES
from minishard.rules import AxisRules, LogicalAxes


def staged(tree: Any) -> Any:
    """``tree`` with each Layer re-typed so that its parameters' logical axes lead with "stage"."""

    def retype(node: Any) -> Any:
        if not isinstance(node, Layer):
            return node
        children, aux_data = node.tree_flatten()
        kind: Any = type(node)  # (a Layer class is hashable, whatever mypy reads into __hash__)
        return staged_class(kind).tree_unflatten(aux_data, [staged(c) for c in children])

    return jax.tree.map(retype, tree, is_leaf=lambda node: isinstance(node, Layer))


@functools.cache
def staged_class(cls: Any) -> type[Layer]:
    """A subclass of ``cls`` (same name, same call) whose ``param_logical_axes`` prepend "stage"."""

    def param_logical_axes(self: Layer) -> dict[str, LogicalAxes]:
        axes = cls.param_logical_axes(self)
        return {name: ("stage", *a)[: np.ndim(self.__dict__[name])] for name, a in axes.items()}

    return type(cls.__name__, (cls,), {"param_logical_axes": param_logical_axes, "__doc__": cls.__doc__})


def compiled_ticks(compiled: jax.stages.Compiled) -> int:
    """The ticks the program runs: how often each of its ``collective-permute``\\ s runs (the census).

    Each tick loop (forward, and its transpose in a gradient) holds one
    ``ppermute``; the census counts it once per trip of the loop.
    """
    text = compiled.as_text() or ""
    permutes = [c for c in collective_instructions(text) if c["kind"] == "collective-permute"]
    written = [c for c in permutes if c["phase"] != "-done"]  # an async pair is one permute
    return collectives(compiled)["collective-permute"].count // len(written)


def pipeline_rules(data: bool = False) -> AxisRules:
    """``stage -> "stage"``, the batch over "data" if ``data``; every other axis replicated."""
    pairs: list[tuple[str, Any]] = [("batch", "data" if data else None), ("stage", "stage")]
    return AxisRules.from_pairs(pairs + [(axis, None) for axis in LOGICAL_AXES])


def microbatched_train_step(optimizer: Any, m: int) -> Callable[..., Any]:
    """``minishard.run.train.make_train_step``, its gradients accumulated over ``m`` microbatches."""

    def loss_fn(model: Any, batch: Any) -> tuple[jax.Array, jax.Array]:
        logits = model(batch["image"])
        labels = batch["label"]
        return cross_entropy(logits, one_hot(labels, logits.shape[-1])), accuracy(logits, labels)

    from minishard.pipeline import microbatched

    def train_step(model: Any, opt_state: Any, batch: Any) -> tuple[Any, Any, jax.Array, jax.Array]:
        (loss, acc), grads = microbatched(loss_fn, m)(model, batch)
        model, opt_state = optimizer.update(model, grads, opt_state)
        return model, opt_state, loss, acc

    return train_step


def pipeline_preset(name: str, devices: int) -> tuple[dict[str, int], AxisRules]:
    """``(mesh shape, rules)`` for ``"pp"`` (every device a stage) or ``"dp+pp"`` (2 x devices/2).

    >>> pipeline_preset("dp+pp", 8)[0]
    {'data': 2, 'stage': 4}
    """
    shapes = {"pp": {"stage": devices}, "dp+pp": {"data": 2, "stage": devices // 2}}
    if name not in shapes:
        raise ValueError(f"pipeline_preset: unknown style {name!r}; choose from {sorted(shapes)}")
    return shapes[name], pipeline_rules(data=name == "dp+pp")


def stacked_mlp(sizes: list[int], *, key: jax.Array) -> Any:
    """``mlp(sizes)`` with its square hidden Linears stacked: ``[784, 256, 256, 256, 10]`` stacks 2.

    Weights are drawn with standard deviation ``1/sqrt(inputs)`` (``mlp``'s 0.01 is too
    small for a deep stack: the signal fades layer by layer and nothing trains).

    >>> model = jax.eval_shape(lambda: stacked_mlp([784, 256, 256, 256, 10], key=jax.random.key(0)))
    >>> model.blocks.n, model.blocks.block.layers[0].weight.shape
    (2, (2, 256, 256))
    """
    from minishard.pipeline import Stacked, StackedModel  # (the chapter imports this file first)

    width, k_in, k_blocks, k_out = sizes[1], *jax.random.split(key, 3)
    if len(sizes) < 4 or set(sizes[1:-1]) != {width}:
        raise ValueError(f"stacked_mlp: sizes need >= 2 equal hidden widths, got {sizes}")
    linear = lambda n_in, n_out, k: Linear(n_in, n_out, key=k, scale=n_in**-0.5)  # noqa: E731
    before = Sequential([linear(sizes[0], width, k_in), Swish()])
    blocks = Stacked(lambda k: Sequential([linear(width, width, k), Swish()]), len(sizes) - 3, key=k_blocks)
    return StackedModel(before, blocks, linear(width, sizes[-1], k_out))


def stacked_vit(*, key: jax.Array, depth: int = 4, width: int = 64, heads: int = 4, classes: int = 10) -> Any:
    """The default ViT (28x28x1 images, patches of 7) with its ``depth`` blocks stacked."""
    from minishard.pipeline import Stacked, StackedModel

    k_embed, k_blocks, k_head = jax.random.split(key, 3)
    before = PatchEmbedding(28, 7, 1, width, key=k_embed)
    blocks = Stacked(lambda k: Block(width, heads, 2 * width, key=k), depth, key=k_blocks)
    head = Linear(width, classes, key=k_head, scale=width**-0.5, axes=("embed", "classes"))
    return StackedModel(before, blocks, Sequential([LayerNorm(width), MeanPool(), head]))


def draw(grid: list[list[Any]]) -> str:
    """``schedule(p, m, r)`` as text: a row per stage, a column per tick, ``.`` for a bubble.

    A cell is the microbatch; with repeats, a ``'`` per repeat after the first.

    >>> print(draw([[0, 1, None], [None, 0, 1]]))
    stage 0 | 0 1 .
    stage 1 | . 0 1
    """
    text = [[_cell(c) for c in row] for row in grid]
    width = max(len(c) for row in text for c in row)
    return "\n".join(
        f"stage {d} | " + " ".join(c.ljust(width) for c in row).rstrip() for d, row in enumerate(text)
    )


def _cell(work: Any) -> str:
    if work is None:
        return "."
    return f"{work[0]}" + "'" * work[1] if isinstance(work, tuple) else str(work)


# --- 1F1B: one forward and one backward per tick, by hand -----------------------


def one_f_one_b(blocks: Any, x: jax.Array, targets: jax.Array, loss_fn: Any, plan: Any) -> Any:
    """``(loss, grads of blocks, grad of x)`` of ``mean(loss_fn(blocks(x), targets))``, scheduled 1F1B.

    ``jax.grad`` of ``pipeline`` is GPipe: the backward loop is the transpose of the
    forward one and starts after it, so every microbatch's activations wait. Here one
    loop of ``m + 2p - 2`` ticks does, per stage and tick, a forward chunk and a
    backward chunk (``jax.vjp``, recomputing the chunk from its saved input): a stage
    saves the inputs of at most ``2p`` microbatches, however large ``m``. No "data"
    axis, no repeats: the smallest version that shows the memory.
    """
    from minishard.pipeline import split_microbatches

    p, m, axis = plan.stages, plan.microbatches, plan.stage_axis
    if plan.data_axis or plan.repeats != 1 or blocks.n % p:
        raise ValueError("one_f_one_b: one data replica, no repeats, blocks divisible by stages")
    loop = functools.partial(_one_f_one_b_loop, loss_fn=loss_fn, p=p, m=m, axis=axis)
    run = jax.shard_map(loop, mesh=plan.mesh, in_specs=(P(axis), P(), P()), out_specs=(P(), P(axis), P()))
    loss, grads, x_grads = run(blocks.block, split_microbatches(x, m), split_microbatches(targets, m))
    return loss, blocks.replace(block=grads), x_grads.swapaxes(0, 1).reshape(x.shape)


def _one_f_one_b_loop(
    chunk: Any, xs: jax.Array, ts: jax.Array, *, loss_fn: Any, p: int, m: int, axis: str
) -> Any:
    from minishard.pipeline import run_blocks, slot

    stage, varying = jax.lax.axis_index(axis), functools.partial(jax.lax.pcast, axis_name=axis, to="varying")
    zeros, grads = jnp.zeros_like(xs[0]), jax.tree.map(jnp.zeros_like, chunk)  # (grads vary, as chunk)
    # The forward and backward shift registers, the saved inputs (a ring of 2p), the sums.
    saved = jnp.zeros((2 * p, *zeros.shape))
    carry = varying(zeros), varying(zeros), varying(saved), grads, varying(jnp.zeros_like(xs)), varying(0.0)

    def tick(carry: Any, t: jax.Array) -> tuple[Any, None]:
        fwd, bwd, saved, grads, x_grads, loss = carry
        f_busy, i_f, _ = slot(t, stage, m)  # forward: as GPipe
        b_busy, i_b, _ = slot(t, 2 * p - 2 - stage, m)  # backward: from the last stage back, one per tick
        x = jnp.where(f_busy, jnp.where(stage == 0, xs[i_f], fwd), 0.0)
        saved = saved.at[i_f % (2 * p)].set(jnp.where(f_busy, x, saved[i_f % (2 * p)]))
        y = run_blocks(chunk, x)
        value, y_grad = jax.value_and_grad(loss_fn)(y, ts[i_f])  # used on the last stage only
        g = jnp.where(b_busy, jnp.where(stage == p - 1, y_grad / m, bwd), 0.0)
        _, vjp = jax.vjp(run_blocks, chunk, jnp.where(b_busy, saved[i_b % (2 * p)], 0.0))
        chunk_grad, x_grad = vjp(g)
        grads = jax.tree.map(jnp.add, grads, chunk_grad)
        x_grads = x_grads.at[i_b].set(jnp.where(b_busy & (stage == 0), x_grad, x_grads[i_b]))
        loss = loss + jnp.where(f_busy & (stage == p - 1), value / m, 0.0)
        fwd = jax.lax.ppermute(y, axis, [(d, (d + 1) % p) for d in range(p)])
        bwd = jax.lax.ppermute(x_grad, axis, [(d, (d - 1) % p) for d in range(p)])
        return (fwd, bwd, saved, grads, x_grads, loss), None

    (_, _, _, grads, x_grads, loss), _ = jax.lax.scan(tick, carry, jnp.arange(m + 2 * p - 2))
    return jax.lax.psum(loss, axis), grads, jax.lax.psum(jnp.where(stage == 0, x_grads, 0.0), axis)
