"""ZeRO by hand: data parallelism that sends only the bytes it must, written with
``jax.shard_map``.

``Sharded`` data parallelism lets XLA's partitioner insert the communication:
one all-reduce of the whole gradient (2V / W in the scaling book's terms), and
every device then applies the *same* update to the *same* parameters and keeps
the *same* optimizer state, N copies of it. ZeRO (Rajbhandari et al., 2020)
removes the copies. Here it is written out, every collective on the screen,
inside ``jax.shard_map``: the function below runs once *per device*, on that
device's shard, and talks to the others only through ``jax.lax`` collectives
over the mesh axis "data".

* **ZeRO-1/2** (``level=2``; ``level=1`` runs the same code): each device takes the
  gradient of its own examples, then ``psum_scatter`` (a reduce-scatter, V / W; our
  ``reduce_scatter``) hands it the sum of its 1/N of every gradient; it updates only
  that 1/N of the parameters and of the optimizer state (the state lives split: ZeRO-1;
  the summed gradient too: ZeRO-2), and ``all_gather`` (V / W) rebuilds the parameters.
  Same bytes as the all-reduce, which *is* a reduce-scatter then an all-gather, but the
  update and the state are no longer repeated N times.
* **ZeRO-3 / FSDP** (``level=3``): the parameters stay split between steps too.
  Each layer ``all_gather``\\ s its weights just before it runs; ``jax.grad``
  transposes that all-gather into a ``psum_scatter``, so the gradients arrive
  already reduced and split, ready for the split update. No all-reduce at all.
  (``all_gathered`` writes that transpose out as ``reduce_scatter``, for the one place it
  differs.)
* **Mixed precision** (``compute="bfloat16"``, levels 1 and 2): Megatron-LM's distributed
  optimizer. The weights are held whole in bfloat16; each device keeps a float32 *master* of
  its 1/N beside the moments (``Mastered``), differentiates through the cast (float32
  gradients), updates its master shard and all-gathers it cast to bfloat16: 2 + 4 bytes per
  parameter whole, (4 + 8)/N split, where float32 holds 4 + 4 and 8/N
  (``minishard.memory.zero_bytes``).

``zero_train_step`` makes the step, a ``ZeroStep``; ``zero_report`` (a ``ZeroReport``) sets
what it sends beside the minimum, and ``held_bytes`` what one device holds.

Every array is split as a flat vector (``flat_padded``; ``unpadded`` undoes it):
``(784, 512)`` becomes 401,408 numbers, padded to a multiple of N, one contiguous 1/N per
device. The SGD and AdamW of ``minishard.optim`` update these shards unchanged: they map
over any pytree (AdamW's clipping sums its norm over the devices: ``update(...,
axis_name=)``).

>>> import jax, numpy as np, minishard as ms
>>> mesh = ms.make_mesh({"data": 8})
>>> step = zero_train_step(ms.SGD(0.1, momentum=0.9), mesh, level=3)
>>> model = step.shard(ms.mlp([4, 8, 2], key=jax.random.key(0)))
>>> batch = {"image": np.ones((16, 4), np.float32), "label": np.zeros(16, np.int32)}
>>> model, opt_state, loss, accuracy = step(model, step.init(model), batch)
>>> model[0].weight.shape, model[0].weight.sharding.spec  # 32 numbers, 4 on each device
((32,), P('data',))
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from minishard import _checks, _checks_costs
from minishard.census import Collective, collectives, human_bytes, summary
from minishard.layers import Sequential
from minishard.losses import Batch, Loss, classification_loss
from minishard.optim import Optimizer
from minishard.tree import cast_floating


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


def reduce_scatter(x: jax.Array, axis: str) -> jax.Array:
    """The sum of the vector ``x`` over ``axis``, each device keeping its 1/N: ``psum_scatter``.

    Across CPU processes JAX's collectives run through gloo, whose reduce-scatter in jaxlib 0.10
    can return wrong numbers at the end of rank 0's part above 256 KiB (jax-ml/jax#40830; seen
    here under load). There the sum is an all-reduce and each device slices its part: the same
    numbers, twice the bytes.
    """
    if jax.process_count() == 1 or jax.default_backend() != "cpu":
        return jax.lax.psum_scatter(x, axis, tiled=True)
    part = x.size // jax.lax.axis_size(axis)
    start = jax.lax.axis_index(axis) * part
    return jax.lax.dynamic_slice_in_dim(jax.lax.psum(x, axis), start, part)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def all_gathered(shard: jax.Array, axis: str) -> jax.Array:
    """Every device's ``shard`` over ``axis``, end to end (``all_gather``); its gradient is
    ``reduce_scatter``, the all-gather's transpose, as ``jax.grad`` derives it."""
    return jax.lax.all_gather(shard, axis, tiled=True)


def _all_gathered_forward(shard: jax.Array, axis: str) -> tuple[jax.Array, None]:
    return all_gathered(shard, axis), None


def _all_gathered_backward(axis: str, _: None, grad: jax.Array) -> tuple[jax.Array]:
    return (reduce_scatter(grad, axis),)


all_gathered.defvjp(_all_gathered_forward, _all_gathered_backward)


class Mastered(NamedTuple):
    """The state of a step that computes in bfloat16: each device's 1/N of the float32 ``master``
    weights, which the optimizer updates, and the optimizer's ``inner`` state of them."""

    master: Any
    inner: Any


class ZeroStep:
    """A training step ``(model, opt_state, batch) -> (model, opt_state, loss, *metrics)``, as
    ``Sharded(mesh, rules)(make_train_step(optimizer, loss))`` is, with ZeRO's communication.

    ``init(model)`` makes the optimizer state, split 1/N per device. At level 3
    the model is split too: ``shard(model)`` splits it, ``gather(model)`` puts it
    back together (to evaluate or save it). At level 2 both only place it, whole.
    ``compute``: the dtype of the weights the step holds and computes with; in bfloat16 a float32
    master of each device's 1/N is its state's (``Mastered``), and ``shard`` casts the model.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        mesh: Mesh,
        level: int = 2,
        axis: str = "data",
        loss: Loss | None = None,
        compute: str = "float32",
    ) -> None:
        if level not in (1, 2, 3):
            raise ValueError(f"zero_train_step: level must be 1, 2 or 3, got {level!r}")
        if axis not in mesh.shape:
            raise ValueError(f"zero_train_step: the mesh {dict(mesh.shape)} has no axis {axis!r}")
        _checks.one_of("zero_train_step: compute", compute, ("float32", "bfloat16"))
        if compute != "float32" and level == 3:
            raise ValueError(
                "zero_train_step: compute='bfloat16' keeps the weights whole: level 1 or 2",
            )
        self.optimizer = optimizer
        self.mesh = mesh
        self.level = level
        self.axis = axis
        self.compute = compute
        self.loss: Loss = loss or classification_loss
        self.n = mesh.shape[axis]
        self.shapes: Any = None  # the whole model's shapes, set by shard()
        self._step = jax.jit(self._shard_mapped, donate_argnums=(0, 1))

    # what a checkpoint's signature records: it resumes only under the same step
    def __repr__(self) -> str:
        mixed = "" if self.compute == "float32" else f", compute={self.compute!r}"
        return f"ZeroStep(level={self.level}, axis={self.axis!r}{mixed})"

    # -- where the arrays live, outside the step --------------------------------
    def _split(self) -> NamedSharding:
        return NamedSharding(self.mesh, P(self.axis))

    def _shards(self, tree: Any) -> Any:
        return jax.tree.map(lambda leaf: flat_padded(leaf, self.n), tree)

    def shard(self, model: Any) -> Any:
        """A copy of ``model`` placed for the step (the step donates it): whole on every device
        (levels 1, 2), or each array as a flat vector split over the devices (level 3)."""
        return self._placing(model)(model)

    def _placing(self, model: Any) -> Any:
        self.shapes = jax.eval_shape(lambda: model)
        if self.level < 3:
            whole = NamedSharding(self.mesh, P())
            copied = lambda m: cast_floating(jax.tree.map(jnp.copy, m), self.compute)  # noqa: E731
            return jax.jit(copied, out_shardings=whole)
        return jax.jit(self._shards, out_shardings=self._split())

    def gather(self, model: Any) -> Any:
        """The whole model again, on every device (level 3); the model itself at level 2."""
        if self.level < 3:
            return model
        whole = NamedSharding(self.mesh, P())  # every device holds all of it
        return jax.jit(lambda m: jax.tree.map(unpadded, m, self.shapes), out_shardings=whole)(model)

    def init(self, model: Any) -> Any:
        """The optimizer's state for the *shards*: each device holds 1/N of each moment
        (velocity), and in bfloat16 1/N of the float32 master, from the placed model's weights
        (as Megatron's)."""
        return self._initialising(model)(model)

    def _initialising(self, model: Any) -> Any:
        def init(model: Any) -> Any:
            if self.compute == "float32":
                return self.optimizer.init(self._shards(model))
            master = cast_floating(self._shards(model), "float32")
            return Mastered(master, self.optimizer.init(master))

        shapes = jax.eval_shape(init, model)
        specs = self._state_specs(shapes)
        placement = jax.tree.map(lambda spec: NamedSharding(self.mesh, spec), specs)
        return jax.jit(init, out_shardings=placement)

    def placed_shapes(self, model: Any) -> tuple[Any, Any]:
        """``shard(model)`` and its ``init``, as shapes and shardings only
        (``jax.ShapeDtypeStruct``): what a compiler for chips that are not here takes
        (``minishard.run.topology``)."""
        placed = self._placing(model).eval_shape(model)
        return placed, self._initialising(model).eval_shape(model)

    def _state_specs(self, state: Any) -> Any:
        """The step whole on every device; every model-shaped moment split, as the shards are."""
        return jax.tree.map(lambda leaf: P() if leaf.ndim == 0 else P(self.axis), state)

    # -- the step -----------------------------------------------------------------
    def __call__(self, model: Any, opt_state: Any, batch: Batch) -> tuple[Any, ...]:
        model, opt_state, loss, metrics = self._step(model, opt_state, batch)
        return model, opt_state, loss, *metrics

    def lower(self, model: Any, opt_state: Any, batch: Batch) -> jax.stages.Lowered:
        """For ``minishard.collectives``: what the step sends."""
        return self._step.lower(model, opt_state, batch)

    def _shard_mapped(self, model: Any, opt_state: Any, batch: Batch) -> Any:
        if self.level == 3 and self.shapes is None:
            raise ValueError(
                "ZeroStep: place the model with step.shard(model) first (level 3 splits it)",
            )
        _checks_costs.batch_splits("ZeroStep", batch, self.n, self.axis)
        body = self._zero3 if self.level == 3 else self._zero2
        model_spec = P(self.axis) if self.level == 3 else P()
        state_spec = self._state_specs(opt_state)
        return jax.shard_map(
            body,
            mesh=self.mesh,
            # the batch: each device its own examples
            in_specs=(model_spec, state_spec, P(self.axis)),
            out_specs=(model_spec, state_spec, P(), P()),
        )(model, opt_state, batch)

    def _computed(self, weights: Any, batch: Batch) -> Any:
        """The loss on ``weights`` and ``batch`` cast to ``compute``: differentiated at float32
        ``weights``, its gradients come back in float32 (Megatron's "main grads")."""
        return self.loss(cast_floating(weights, self.compute), cast_floating(batch, self.compute))

    def _zero2(self, model: Any, opt_state: Any, batch: Batch) -> Any:
        """On one device: its examples, the whole model, 1/N of the velocity (and master)."""
        own = jax.lax.pcast(model, self.axis, to="varying")  # my copy: its gradient stays mine
        (loss, metrics), grads = jax.value_and_grad(self._computed, has_aux=True)(
            cast_floating(own, "float32"), batch
        )
        me = jax.lax.axis_index(self.axis)

        def my_sum(grad: jax.Array) -> jax.Array:  # the mean of my 1/N, from every device
            return reduce_scatter(flat_padded(grad, self.n), self.axis) / self.n

        def my_part(param: jax.Array, grad: jax.Array) -> jax.Array:  # my 1/N of the parameter
            flat = flat_padded(param, self.n)
            return jax.lax.dynamic_slice_in_dim(flat, me * grad.size, grad.size)

        def all_gather(part: jax.Array, like: jax.Array) -> jax.Array:  # everyone's, whole again
            cast = part.astype(like.dtype)  # before the gather: bfloat16 moves 2 bytes a number
            whole = jax.lax.all_gather(cast, self.axis, tiled=True, to="invarying")
            return unpadded(whole, like)

        grads = jax.tree.map(my_sum, grads)
        if isinstance(opt_state, Mastered):  # the optimizer updates my 1/N of the float32 master
            master, inner = opt_state
            params, inner = self.optimizer.update(master, grads, inner, axis_name=self.axis)
            opt_state = Mastered(params, inner)
        else:
            params = jax.tree.map(my_part, model, grads)
            params, opt_state = self.optimizer.update(params, grads, opt_state, axis_name=self.axis)
        return jax.tree.map(all_gather, params, model), opt_state, *self._mean(loss, metrics)

    def _zero3(self, shards: Any, opt_state: Any, batch: Batch) -> Any:
        """Runs on one device: its own examples, 1/N of every parameter and of the velocity."""

        # its transpose: reduce_scatter
        def all_gather(shard: jax.Array, like: jax.Array) -> jax.Array:
            return unpadded(all_gathered(shard, self.axis), like)

        def whole(layer_shards: Any, like: Any) -> Any:  # one layer, whole, on every device
            return jax.tree.map(all_gather, layer_shards, like)

        def forward(shards: Any, x: jax.Array) -> jax.Array:
            for piece, like in zip(self.pieces(shards), self.pieces(self.shapes)):
                x = whole(piece, like)(x)  # one piece's weights whole at a time
            return x

        def loss(shards: Any) -> Any:  # the model as a function: the shards, gathered as it runs
            return self.loss(functools.partial(forward, shards), batch)

        (loss_value, metrics), grads = jax.value_and_grad(loss, has_aux=True)(shards)
        grads = jax.tree.map(lambda g: g / self.n, grads)  # the sum of N means -> the mean
        shards, opt_state = self.optimizer.update(shards, grads, opt_state, axis_name=self.axis)
        return shards, opt_state, *self._mean(loss_value, metrics)

    @staticmethod
    def pieces(model: Any) -> list[Any]:
        """What level 3 gathers whole, one at a time: a ``Sequential``'s layers, else the model."""
        return list(model) if isinstance(model, Sequential) else [model]

    def _mean(
        self, loss: jax.Array, metrics: tuple[jax.Array, ...]
    ) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        """This device's loss and metrics, averaged over the devices (equal examples each)."""
        return jax.lax.pmean(loss, self.axis), jax.lax.pmean(metrics, self.axis)


def zero_train_step(
    optimizer: Optimizer,
    mesh: Mesh,
    *,
    level: int = 2,
    axis: str = "data",
    loss: Loss | None = None,
    compute: str = "float32",
) -> ZeroStep:
    """A ZeRO training step over ``mesh``'s ``axis``; see ``ZeroStep`` and the module docstring.

    ``loss``: ``minishard.losses.classification_loss`` unless given (a GPT's: ``run.next_token``'s).
    """
    return ZeroStep(optimizer, mesh, level, axis, loss, compute)


# -- what it sends, against the minimum ---------------------------------------------


@dataclasses.dataclass(frozen=True)
class ZeroReport:
    """``zero_report``: what a ZeRO step sends (the census) against the minimum, and what a
    device holds.

    The minimum: every parameter gathered once, each padded by ``flat_padded`` to split ``n`` ways,
    and 1/n of every gradient reduce-scattered to each device. No gradient is all-reduced: the one
    all-reduce is the loss and metric's mean, two float32 scalars.

    >>> import numpy as np, minishard as ms
    >>> step = zero_train_step(ms.SGD(0.1, momentum=0.9), ms.make_mesh({"data": 8}), level=3)
    >>> model = step.shard(ms.mlp([4, 8, 2], key=jax.random.key(0)))   # 58 numbers, padded 64
    >>> batch = {"image": np.ones((16, 4), np.float32), "label": np.zeros(16, np.int32)}
    >>> report = zero_report(step, (model, step.init(model), batch))
    >>> report.sent == report.minimum
    True
    >>> print(report)
    collectives of the zero step:
      all-reduce      x1  8 B  over ('data',)
      all-gather      x4  256 B  over ('data',)
      reduce-scatter  x4  32 B  over ('data',)
    full-gradient all-reduce: 0 B (8 B all-reduced, 8 B of it the loss and accuracy)
    sent: all-gather 256 B + reduce-scatter 32 B = 288 B
    the minimum: the parameters (padded to split 8 ways) 256 B + 1/8: 288 B
    per device: parameters 32 B, SGD velocity 32 B
    """

    METRIC_BYTES: ClassVar[int] = 2 * 4  # the loss and metric, two float32 scalars, all-reduced
    n: int
    found: Mapping[str, Collective]
    whole: int  # the parameters' bytes, each padded to split n ways
    held: tuple[tuple[str, int], ...]  # (what, its bytes on one device)

    def bytes(self, kind: str) -> int:
        return self.found[kind].bytes if kind in self.found else 0

    @property
    def sent(self) -> int:
        return self.bytes("all-gather") + self.bytes("reduce-scatter")

    @property
    def minimum(self) -> int:
        return self.whole + self.whole // self.n

    def __str__(self) -> str:
        reduced = self.bytes("all-reduce")
        gathered = self.bytes("all-gather")
        scattered = self.bytes("reduce-scatter")
        gradient = max(reduced - self.METRIC_BYTES, 0)
        n = self.n
        sent = f"{self.sent:,} B"
        held = ", ".join(f"{name} {human_bytes(held)}" for name, held in self.held)
        return "\n".join(
            [
                "collectives of the zero step:",
                *("  " + line for line in summary(self.found).splitlines()),
                f"full-gradient all-reduce: {gradient:,} B ({reduced:,} B "
                f"all-reduced, {self.METRIC_BYTES} B of it the loss and accuracy)",
                f"sent: all-gather {gathered:,} B + reduce-scatter {scattered:,} B = {sent}",
                f"the minimum: the parameters (padded to split {n} ways) {self.whole:,} B "
                f"+ 1/{n}: {self.minimum:,} B",
                f"per device: {held}",
            ]
        )


def zero_report(step: ZeroStep, args: tuple[Any, ...]) -> ZeroReport:
    """A ``ZeroReport`` of ``step`` on ``(model, opt_state, batch)``, as ``step.shard`` and
    ``step.init`` placed them."""
    model, opt_state, _ = args
    padded = jax.eval_shape(step._shards, step.shapes)
    whole = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(padded))
    state = opt_state._asdict() if hasattr(opt_state, "_asdict") else {"state": opt_state}
    optimizer = type(step.optimizer).__name__
    kept = {"parameters": model} | {f"{optimizer} {k}": tree for k, tree in state.items()}
    # over 4 bytes: not a step counter
    held = tuple((name, b) for name, tree in kept.items() if (b := held_bytes(tree)) > 4)
    return ZeroReport(step.n, collectives(step.lower(*args)), whole, held)


def held_bytes(tree: Any) -> int:
    """The bytes of ``tree`` that one device holds (of arrays, or of their shapes and shardings).

    >>> mesh = jax.sharding.AbstractMesh((8,), ("data",))
    >>> split = NamedSharding(mesh, P("data"))
    >>> held_bytes(jax.ShapeDtypeStruct((64,), jnp.float32, sharding=split))
    32
    """
    held = 0
    for leaf in jax.tree.leaves(tree):
        shard = leaf.sharding.shard_shape(leaf.shape)  # one device's part
        held += math.prod(shard) * leaf.dtype.itemsize
    return held


__all__ = [
    "Mastered",
    "ZeroReport",
    "ZeroStep",
    "flat_padded",
    "all_gathered",
    "held_bytes",
    "reduce_scatter",
    "unpadded",
    "zero_report",
    "zero_train_step",
]
