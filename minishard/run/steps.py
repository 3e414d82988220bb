"""One training step and one evaluation, as pure functions a loop compiles; a ``Task`` says what they compute.

A train step is ``(model, opt_state, batch) -> (model, opt_state, loss, *metrics)``:
pure, so ``Sharded`` (or ``jax.jit``) compiles it once and the loop calls it
every step. What it computes comes from a ``Task``: the loss of a batch and the
metrics reported beside it (the MNIST models' accuracy; a language model has
none), and the sums an evaluation adds up over a split. Any optimizer with
optax's two functions works (``minishard.optim.Optimizer``): SGD, AdamW.

>>> import jax, numpy as np, minishard as ms
>>> model = ms.mlp([4, 2], key=jax.random.key(0))
>>> batch = {"image": np.ones((8, 4), np.float32), "label": np.zeros(8, np.int32)}
>>> step = jax.jit(make_train_step(ms.SGD(0.1)))
>>> model, opt_state, loss, accuracy = step(model, ms.SGD(0.1).init(model), batch)
>>> CLASSIFICATION.metrics
('acc',)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from minishard.losses import Batch, Loss, classification_loss
from minishard.optim import Optimizer
from minishard.pipeline import microbatched
from minishard.precision import LossScaled, LossScaledState, Precision, reduced_in, scaled
from minishard.run.data import to_global

__all__ = [
    "CLASSIFICATION",
    "Task",
    "classification_sums",
    "evaluate",
    "make_train_step",
    "own_step",
    "step_key",
]


@dataclasses.dataclass(frozen=True)
class Task:
    """What a model is trained to do: ``loss`` (with the ``metrics`` it reports) and the sums of ``evaluate``.

    ``evaluate(model, batch) -> {name: sum, ..., "count": n}`` adds up over the
    real rows of a (possibly padded) evaluation batch; an evaluation reports
    every ``sum / count``. Both are pure: the loop compiles them with ``Sharded``.
    """

    loss: Loss
    metrics: tuple[str, ...]
    evaluate: Callable[[Any, Batch], dict[str, jax.Array]]
    unit: str = "examples"  # what a batch is counted in, per second: "examples", or "tokens" ([B, T] arrays)


def classification_sums(model: Any, batch: Batch) -> dict[str, jax.Array]:
    """Correct predictions (``acc``) and real examples (``count``) in a padded batch (its ``mask``)."""
    logits = model(batch["image"])
    correct = (jnp.argmax(logits, axis=-1) == batch["label"]) * batch["mask"]
    return {"acc": correct.sum(), "count": batch["mask"].sum()}


CLASSIFICATION = Task(classification_loss, ("acc",), classification_sums)
"""The MNIST models' task: cross-entropy, reporting accuracy in training and in evaluation."""


def make_train_step(
    optimizer: Optimizer,
    loss: Loss = classification_loss,
    microbatches: int = 1,
    precision: Precision | None = None,
    seed: int | None = None,
) -> Callable[..., Any]:
    """One optimizer step on one batch; pure, so ``Sharded``/``jax.jit`` can compile it.

    ``microbatches`` > 1 accumulates the gradients over that many slices of the batch
    (``pipeline.microbatched``): the same step, one microbatch's activations alive at a
    time (``minishard train --microbatches M``). ``precision`` (``minishard.precision.BF16``)
    computes the loss on its copies of the model and batch (``Precision.compute``); the
    model the step is given and returns stays the float32 master (``train --precision bf16``).
    Where its gradients' dtype is not the compute dtype, the step reduces them itself, in their
    dtype (``precision.reduced_in``). A ``precision.LossScaled`` optimizer (fp16) scales the loss
    by its state's scale before ``grad``, and skips the update where the gradients overflow.
    ``seed`` (a model with dropout): the loss is given ``key=step_key(seed, opt_state)``, the step's own.
    """
    if precision is not None:
        loss = functools.partial(_computed, loss, precision)
    # gradients in another dtype than the compute's: the step reduces them (the partitioner: in the compute's)
    reduce = precision.grads if precision and precision.grads != precision.params else None
    scaling = isinstance(optimizer, LossScaled)
    if precision and precision.params == "float16" and not scaling:
        raise ValueError(FP16_UNSCALED)
    if seed is not None and microbatches > 1:  # each microbatch would draw the same masks, of its shape
        raise ValueError("make_train_step: a seed (dropout) draws one mask per batch; give microbatches=1")

    def value_and_grad(opt_state: Any) -> Callable[..., Any]:
        keyed: Callable[..., Any] = loss  # a loss that draws dropout (the GPT's) takes the step's key
        fn = keyed if seed is None else functools.partial(keyed, key=step_key(seed, opt_state))
        fn = scaled(fn, opt_state.loss_scale.scale) if scaling else fn
        grad = microbatched(fn, microbatches) if microbatches > 1 else jax.value_and_grad(fn, has_aux=True)
        return grad if reduce is None else reduced_in(reduce, grad)

    def train_step(model: Any, opt_state: Any, batch: Batch) -> tuple[Any, ...]:
        (value, metrics), grads = value_and_grad(opt_state)(model, batch)
        if scaling:
            value, metrics = metrics  # the unscaled loss, kept beside the metrics
        model, opt_state = optimizer.update(model, grads, opt_state)
        return model, opt_state, value, *metrics

    return train_step


FP16_UNSCALED = (
    "make_train_step: float16 needs a loss scale (5 exponent bits: small gradients flush to 0); "
    "pass minishard.precision.LossScaled(optimizer), and init its state with it"
)


def loss_scaled_for(precision: Precision | None, optimizer: Optimizer) -> Optimizer:
    """``optimizer`` as a step in ``precision`` needs it: behind a ``LossScaled`` where it computes in
    float16 (``train --precision fp16``; ``explain --memory`` prices that step), else as it is."""
    return LossScaled(optimizer) if precision and precision.params == "float16" else optimizer


def step_key(seed: int, opt_state: Any) -> jax.Array:
    """The step's key, ``fold_in(key(seed), step)``: the step number read from the optimizer's state.

    Why there, not in the batch: a batch's arrays split over "data" (a key is one scalar) and into
    microbatches, and the state's step is already replicated, saved and restored: a resumed run draws
    the keys a straight one does, and nothing random is stored. (fp16's ``LossScaled``: its inner
    optimizer's step, which a skipped update does not advance: the retry draws the same masks.)
    """
    counted = opt_state.inner if isinstance(opt_state, LossScaledState) else opt_state
    return jax.random.fold_in(jax.random.key(seed), counted.step)


def _computed(
    loss: Loss, precision: Precision, model: Any, batch: Batch, **options: Any
) -> tuple[jax.Array, Any]:
    """``loss`` on the precision's copies: differentiated, the gradients return in the master's dtype."""
    return loss(precision.compute(model), precision.compute(batch), **options)


def evaluate(
    step: Callable[..., Mapping[str, jax.Array]],
    model: Any,
    batches: Iterable[Batch],
    sharding: NamedSharding,
) -> dict[str, float]:
    """Every ``sum / count`` of ``step`` (a compiled ``Task.evaluate``) over ``batches``, each row once."""
    totals: dict[str, float] = {}
    for batch in batches:
        for name, value in step(model, to_global(batch, sharding)).items():
            totals[name] = totals.get(name, 0.0) + float(value)  # float() waits for the step
    count = max(totals.pop("count", 0.0), 1.0)
    return {name: total / count for name, total in totals.items()}


def own_step(make_step: Callable[[Any], Any], optimizer: Optimizer, seed: int | None) -> Any:
    """``make_step(optimizer)``: a style's own step for ``fit`` (``minishard.zero``'s). It draws no
    dropout, so a seed for one is refused."""
    if seed is not None:
        raise ValueError("fit: a seed draws dropout in fit's own step; make_step's draws none")
    return make_step(optimizer)
