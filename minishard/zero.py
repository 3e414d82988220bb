"""ZeRO by hand: data parallelism that sends only the bytes it must, written with ``jax.shard_map``.

``Sharded`` data parallelism lets XLA's partitioner insert the communication:
one all-reduce of the whole gradient (2V / W in the scaling book's terms), and
every device then applies the *same* update to the *same* parameters and keeps
the *same* optimizer state, N copies of it. ZeRO (Rajbhandari et al., 2020)
removes the copies. Here it is written out, every collective on the screen,
inside ``jax.shard_map``: the function below runs once *per device*, on that
device's block, and talks to the others only through ``jax.lax`` collectives
over the mesh axis "data".

* **ZeRO-1/2** (``stage=2``; ``stage=1`` runs the same code): each device takes the gradient of its own
  examples, then ``psum_scatter`` (a reduce-scatter, V / W) hands it the sum of
  its 1/N of every gradient; it updates only that 1/N of the parameters and of
  the optimizer state (the state lives split: ZeRO-1; the summed gradient too:
  ZeRO-2), and ``all_gather`` (V / W) rebuilds the parameters. Same bytes as the
  all-reduce, which *is* a reduce-scatter then an all-gather, but the update
  and the state are no longer repeated N times.
* **ZeRO-3 / FSDP** (``stage=3``): the parameters stay split between steps too.
  Each layer ``all_gather``\\ s its weights just before it runs; ``jax.grad``
  transposes that all-gather into a ``psum_scatter``, so the gradients arrive
  already reduced and split, ready for the split update. No all-reduce at all.

Every array is split as a flat vector: ``(784, 512)`` becomes 401,408 numbers,
padded to a multiple of N, one contiguous 1/N per device. The SGD of
``minishard.optim`` updates these blocks unchanged: it maps over any pytree.

>>> import jax, numpy as np, minishard as ms
>>> mesh = ms.make_mesh({"data": 8})
>>> step = zero_train_step(ms.SGD(0.1, momentum=0.9), mesh, stage=3)
>>> model = step.shard(ms.mlp([4, 8, 2], key=jax.random.key(0)))
>>> batch = {"image": np.ones((16, 4), np.float32), "label": np.zeros(16, np.int32)}
>>> model, opt_state, loss, accuracy = step(model, step.init(model), batch)
>>> model[0].weight.shape, model[0].weight.sharding.spec  # 32 numbers, 4 on each device
((32,), P('data',))
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from minishard.layers import Sequential
from minishard.losses import accuracy, cross_entropy, one_hot
from minishard.optim import SGD, SGDState

Batch = dict[str, jax.Array]


def flat_padded(leaf: jax.Array, n: int) -> jax.Array:
    """``leaf`` as one vector, zero-padded to a multiple of ``n`` so it splits evenly.

    >>> flat_padded(jnp.ones((2, 5)), 4).shape  # 10 numbers -> 12, 3 per device
    (12,)
    """
    flat = leaf.reshape(-1)
    return jnp.pad(flat, (0, -flat.size % n))


def unpadded(flat: jax.Array, like: Any) -> jax.Array:
    """The inverse: drop the padding and restore ``like``'s shape."""
    return flat[: math.prod(like.shape)].reshape(like.shape)


class ZeroStep:
    """A training step ``(model, opt_state, batch) -> (model, opt_state, loss, accuracy)``, as
    ``Sharded(mesh, rules)(make_train_step(optimizer))`` is, with ZeRO's communication.

    ``init(model)`` makes the optimizer state, split 1/N per device. At stage 3
    the model is split too: ``shard(model)`` splits it, ``gather(model)`` puts it
    back together (to evaluate or save it). At stage 2 both only place it, whole.
    """

    def __init__(self, optimizer: SGD, mesh: Mesh, stage: int = 2, axis: str = "data") -> None:
        if stage not in (1, 2, 3):
            raise ValueError(f"zero_train_step: stage must be 1, 2 or 3, got {stage!r}")
        if axis not in mesh.shape:
            raise ValueError(f"zero_train_step: the mesh {dict(mesh.shape)} has no axis {axis!r}")
        self.optimizer, self.mesh, self.stage, self.axis = optimizer, mesh, stage, axis
        self.n = mesh.shape[axis]
        self.shapes: Any = None  # the whole model's shapes, set by shard()
        self._step = jax.jit(self._shard_mapped, donate_argnums=(0, 1))

    def __repr__(self) -> str:  # what a checkpoint's signature records: it resumes only under the same step
        return f"ZeroStep(stage={self.stage}, axis={self.axis!r})"

    # -- where the arrays live, outside the step --------------------------------
    def _split(self) -> NamedSharding:
        return NamedSharding(self.mesh, P(self.axis))

    def _blocks(self, tree: Any) -> Any:
        return jax.tree.map(lambda leaf: flat_padded(leaf, self.n), tree)

    def shard(self, model: Any) -> Any:
        """A copy of ``model`` placed for the step (the step donates it): whole on every device
        (stages 1, 2), or each array as a flat vector split over the devices (stage 3)."""
        self.shapes = jax.eval_shape(lambda: model)
        if self.stage < 3:
            whole = NamedSharding(self.mesh, P())
            return jax.jit(lambda m: jax.tree.map(jnp.copy, m), out_shardings=whole)(model)
        return jax.jit(self._blocks, out_shardings=self._split())(model)

    def gather(self, model: Any) -> Any:
        """The whole model again, on every device (stage 3); the model itself at stage 2."""
        if self.stage < 3:
            return model
        whole = NamedSharding(self.mesh, P())  # every device holds all of it
        return jax.jit(lambda m: jax.tree.map(unpadded, m, self.shapes), out_shardings=whole)(model)

    def init(self, model: Any) -> SGDState:
        """The optimizer's state for the *blocks*: each device holds 1/N of the velocity."""
        layout = SGDState(NamedSharding(self.mesh, P()), self._split())  # type: ignore[arg-type]
        return jax.jit(self.optimizer.init, out_shardings=layout)(jax.eval_shape(self._blocks, model))

    # -- the step -----------------------------------------------------------------
    def __call__(
        self, model: Any, opt_state: SGDState, batch: Batch
    ) -> tuple[Any, SGDState, jax.Array, jax.Array]:
        return self._step(model, opt_state, batch)

    def lower(self, model: Any, opt_state: SGDState, batch: Batch) -> jax.stages.Lowered:
        """For ``minishard.collectives``: what the step sends."""
        return self._step.lower(model, opt_state, batch)

    def _shard_mapped(self, model: Any, opt_state: SGDState, batch: Batch) -> Any:
        if self.stage == 3 and self.shapes is None:
            raise ValueError("ZeroStep: place the model with step.shard(model) first (stage 3 splits it)")
        body = self._zero3 if self.stage == 3 else self._zero2
        model_spec = P(self.axis) if self.stage == 3 else P()
        state_spec = SGDState(P(), P(self.axis))  # type: ignore[arg-type]  # step whole, velocity split
        return jax.shard_map(
            body,
            mesh=self.mesh,
            in_specs=(model_spec, state_spec, P(self.axis)),  # the batch: each device its own examples
            out_specs=(model_spec, state_spec, P(), P()),
        )(model, opt_state, batch)

    def _zero2(self, model: Any, opt_state: SGDState, batch: Batch) -> Any:
        """Runs on one device: its own examples, the whole model, 1/N of the velocity."""
        own = jax.lax.pcast(model, self.axis, to="varying")  # my copy: its gradient stays mine, no psum
        (loss, logits), grads = jax.value_and_grad(_loss, has_aux=True)(own, batch)
        me = jax.lax.axis_index(self.axis)

        def reduce_scatter(grad: jax.Array) -> jax.Array:  # the sum of my 1/N, from every device
            return jax.lax.psum_scatter(flat_padded(grad, self.n), self.axis, tiled=True) / self.n

        def my_part(param: jax.Array, grad: jax.Array) -> jax.Array:  # the same 1/N of the parameter
            return jax.lax.dynamic_slice_in_dim(flat_padded(param, self.n), me * grad.size, grad.size)

        def all_gather(part: jax.Array, like: jax.Array) -> jax.Array:  # everyone's parts, whole again
            return unpadded(jax.lax.all_gather(part, self.axis, tiled=True, to="invarying"), like)

        grads = jax.tree.map(reduce_scatter, grads)
        params, opt_state = self.optimizer.update(jax.tree.map(my_part, model, grads), grads, opt_state)
        return jax.tree.map(all_gather, params, model), opt_state, *self._mean(loss, logits, batch)

    def _zero3(self, blocks: Any, opt_state: SGDState, batch: Batch) -> Any:
        """Runs on one device: its own examples, 1/N of every parameter and of the velocity."""

        def all_gather(block: jax.Array, like: jax.Array) -> jax.Array:  # its transpose: psum_scatter
            return unpadded(jax.lax.all_gather(block, self.axis, tiled=True), like)

        def gathered(layer_blocks: Any, like: Any) -> Any:  # one layer, whole, on every device
            return jax.tree.map(all_gather, layer_blocks, like)

        def forward(blocks: Any, x: jax.Array) -> jax.Array:
            if not isinstance(blocks, Sequential):  # any other model: gather it all at once
                return gathered(blocks, self.shapes)(x)
            for layer, like in zip(blocks, self.shapes):  # one layer's weights whole at a time
                x = gathered(layer, like)(x)
            return x

        (loss, logits), grads = jax.value_and_grad(lambda b: _loss(b, batch, forward), has_aux=True)(blocks)
        grads = jax.tree.map(lambda g: g / self.n, grads)  # the sum of N means -> the mean
        blocks, opt_state = self.optimizer.update(blocks, grads, opt_state)
        return blocks, opt_state, *self._mean(loss, logits, batch)

    def _mean(self, loss: jax.Array, logits: jax.Array, batch: Batch) -> tuple[jax.Array, jax.Array]:
        """This device's loss and accuracy, averaged over the devices (equal examples each)."""
        return jax.lax.pmean(loss, self.axis), jax.lax.pmean(accuracy(logits, batch["label"]), self.axis)


def _loss(model: Any, batch: Batch, forward: Callable[..., jax.Array] | None = None) -> Any:
    """Cross-entropy of this device's examples, and the logits for the accuracy."""
    logits = forward(model, batch["image"]) if forward else model(batch["image"])
    return cross_entropy(logits, one_hot(batch["label"], logits.shape[-1])), logits


def zero_train_step(optimizer: SGD, mesh: Mesh, *, stage: int = 2, axis: str = "data") -> ZeroStep:
    """A ZeRO training step over ``mesh``'s ``axis``; see ``ZeroStep`` and the module docstring."""
    return ZeroStep(optimizer, mesh, stage, axis)


__all__ = ["ZeroStep", "flat_padded", "unpadded", "zero_train_step"]
