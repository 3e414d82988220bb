"""Section 5: an MNIST epoch of minishard vs a hand-written plain-JAX loop, and the input pipeline.

Both loops train the CLI's default model and run on the CLI's default set-up:
``[784, 512, 10]`` with swish, Megatron axes, mesh ``data=2, model=4``,
batch 128, SGD with momentum 0.9 and ``lr = 0.2 * 0.7 ** (step / 1000)``,
from the same initial parameters, over the same in-memory batches
(``Dataset.epoch``: numpy gather, float32 / 255).

* ``minishard``: the loop ``fit`` runs (``minishard.run.steps.make_train_step``
  under ``Sharded(mesh, rules, donate_argnums=(0, 1))``, ``to_global`` of the
  fields the step reads per batch, ``float(loss)`` and ``float(acc)`` per step). We run *the same loop*
  rather than ``fit`` itself because each ``fit`` call builds and compiles a
  new step; a warm loop measures the epoch, not the compiler. ``fit`` runs once
  on the same data to check that it gives the same loss (and its wall time,
  compile included, is reported for information).
* ``handwritten``: the classic ``spmd_mnist_classifier_fromscratch`` style,
  written fresh: a list of ``(W, b)``, ``jax.jit`` with hand-written
  ``NamedSharding``s, ``jax.device_put`` of each batch.
* ``pipeline`` / ``pipeline_handwritten``: each loop's input path alone
  (gather + placing the arrays + wait): is data the limit, and how much of the
  difference between the loops is the data path?

A round is one epoch of each, run in turns of ``CHUNK`` batches (the order
rotating), so a burst of load from elsewhere hits all of them alike; a round's
ratio is minishard's epoch time over the hand-written loop's in that round.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from harness import Stat, no_gc, order
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import minishard as ms
from minishard.run.data import Dataset, mnist, to_global
from minishard.run.steps import make_train_step
from minishard.run.train import FitSettings, fit

SIZES = [784, 512, 10]
BATCH = 128
LR, DECAY_RATE, DECAY_STEPS, MOMENTUM = 0.2, 0.7, 1000, 0.9
MESH = {"data": 2, "model": 4}
RULES = {"batch": "data", "embed": None, "mlp": "model", "classes": None}  # the CLI's defaults
TRAIN_FIELDS = ("image", "label")  # what fit places: the training step never reads "mask"
CHUNK = 20  # batches per turn: the loops take turns every CHUNK steps, so load hits both alike


def load_train(examples: int | None) -> Dataset:
    """MNIST train in memory; ``examples`` keeps only the first ones (a slice of the epoch)."""
    full = mnist("train", BATCH, download=False)
    if examples is None or examples >= full.num_examples:
        return full
    return Dataset(full.images[:examples], full.labels[:examples], BATCH)


# --- minishard: the loop fit runs ------------------------------------------------


def minishard_loop(mesh: Any, rules: Any, model: Any) -> Callable[[Iterator[Any]], float]:
    """A function running fit's inner loop over some batches; returns the summed loss."""
    optimizer = ms.SGD(ms.exponential_decay(LR, DECAY_RATE, DECAY_STEPS), momentum=MOMENTUM)
    sharded = ms.Sharded(mesh, rules, donate_argnums=(0, 1))
    step = sharded(make_train_step(optimizer))
    model = jax.tree_util.tree_map(jnp.copy, ms.shard(model, mesh, rules))
    state = {"model": model, "opt": ms.shard(optimizer.init(model), mesh, rules)}

    def run(batches: Iterator[Any]) -> float:
        sums = [0.0, 0.0]
        for batch in batches:
            global_batch = to_global(batch, sharded.batch_sharding, TRAIN_FIELDS)
            state["model"], state["opt"], loss, acc = step(state["model"], state["opt"], global_batch)
            loss_value = float(loss)  # waits for the step
            if not math.isfinite(loss_value):
                raise FloatingPointError("minishard loop: non-finite loss")
            sums = [sums[0] + loss_value, sums[1] + float(acc)]
        return sums[0]

    return run


# --- hand-written plain JAX ------------------------------------------------------------


def hand_loop(mesh: Any, params: list[tuple[jax.Array, jax.Array]]) -> Callable[[Iterator[Any]], float]:
    """The plain-JAX loop: the shardings are written out by hand for the Megatron MLP."""
    param_sharding = [
        (NamedSharding(mesh, P(None, "model")), NamedSharding(mesh, P("model"))),
        (NamedSharding(mesh, P("model", None)), NamedSharding(mesh, P(None))),
    ]
    replicated, batch_sharding = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))

    def forward(params: Any, x: jax.Array) -> jax.Array:
        (w1, b1), (w2, b2) = params
        return jax.nn.swish(x @ w1 + b1) @ w2 + b2

    def train_step(params: Any, velocity: Any, count: jax.Array, image: jax.Array, label: jax.Array) -> Any:
        def loss_fn(p: Any) -> tuple[jax.Array, jax.Array]:
            logits = forward(p, image)
            log_probs = logits - jax.nn.logsumexp(logits, axis=-1, keepdims=True)
            onehot = (label[:, None] == jnp.arange(logits.shape[-1])).astype(jnp.float32)
            return -jnp.mean(jnp.sum(onehot * log_probs, axis=-1)), logits

        (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        lr = LR * jnp.power(DECAY_RATE, jnp.asarray(count, jnp.float32) / DECAY_STEPS)
        velocity = jax.tree.map(lambda g, v: g + MOMENTUM * v, grads, velocity)
        params = jax.tree.map(lambda p, v: p - lr * v, params, velocity)
        accuracy = jnp.mean((jnp.argmax(logits, axis=-1) == label).astype(jnp.float32))
        return params, velocity, count + 1, loss, accuracy

    step = jax.jit(
        train_step,
        in_shardings=(param_sharding, param_sharding, replicated, batch_sharding, batch_sharding),
        out_shardings=(param_sharding, param_sharding, replicated, replicated, replicated),
        donate_argnums=(0, 1),
    )
    placed = jax.device_put([tuple(jnp.copy(a) for a in pair) for pair in params], param_sharding)
    state = {
        "params": placed,
        "velocity": jax.device_put(jax.tree.map(jnp.zeros_like, params), param_sharding),
        "count": jax.device_put(jnp.zeros((), jnp.int32), replicated),
    }

    def run(batches: Iterator[Any]) -> float:
        sums = [0.0, 0.0]
        for batch in batches:
            image = jax.device_put(batch["image"], batch_sharding)
            label = jax.device_put(batch["label"], batch_sharding)
            state["params"], state["velocity"], state["count"], loss, acc = step(
                state["params"], state["velocity"], state["count"], image, label
            )
            loss_value = float(loss)
            if not math.isfinite(loss_value):
                raise FloatingPointError("hand-written loop: non-finite loss")
            sums = [sums[0] + loss_value, sums[1] + float(acc)]
        return sums[0]

    return run


def pipeline_loop(sharding: NamedSharding, handwritten: bool = False) -> Callable[[Iterator[Any]], float]:
    """The input pipeline alone: gather each batch and place it, as one of the loops does."""

    def run(batches: Iterator[Any]) -> float:
        for batch in batches:
            if handwritten:
                placed = jax.device_put([batch["image"], batch["label"]], sharding)
            else:
                placed = to_global(batch, sharding, TRAIN_FIELDS)
            jax.block_until_ready(placed)
        return 0.0

    return run


# --- the comparison ---------------------------------------------------------------


def initial_model() -> tuple[Any, list[tuple[jax.Array, jax.Array]]]:
    """The CLI's model (swish, Megatron axes) and the same parameters as a list of (W, b)."""
    model = ms.mlp(SIZES, key=jax.random.key(0), activation="swish", axes=ms.megatron_axes(len(SIZES) - 1))
    linears = [layer for layer in model if isinstance(layer, ms.Linear)]
    return model, [(layer.weight, layer.bias) for layer in linears]


def bench_epoch(examples: int | None, rounds: int, run_fit: bool = True) -> dict[str, Any]:
    data = load_train(examples)
    mesh = ms.make_mesh(MESH)
    rules = ms.AxisRules(**RULES)
    model, params = initial_model()
    loops = {
        "minishard": minishard_loop(mesh, rules, model),
        "handwritten": hand_loop(mesh, params),
        "pipeline": pipeline_loop(NamedSharding(mesh, P("data"))),
        "pipeline_handwritten": pipeline_loop(NamedSharding(mesh, P("data")), handwritten=True),
    }
    # Same start, same batches: the first steps' losses must agree (and this compiles both).
    start = max(data.steps_per_epoch - 3, 0)
    first = {name: loops[name](data.epoch(0, start_batch=start)) for name in loops}
    if not np.isclose(first["minishard"], first["handwritten"], rtol=1e-4):
        raise AssertionError(f"the two loops compute different losses: {first}")

    seconds: dict[str, list[float]] = {name: [] for name in loops}
    losses: dict[str, list[float]] = {name: [] for name in loops}
    chunks = math.ceil(data.steps_per_epoch / CHUNK)
    for r in range(rounds):
        batches = {name: data.epoch(r + 1) for name in loops}  # every loop sees the same epoch
        spent, loss = dict.fromkeys(loops, 0.0), dict.fromkeys(loops, 0.0)
        with no_gc():
            for c in range(chunks):
                for name in order(list(loops), r * chunks + c):
                    t0 = time.perf_counter()
                    loss[name] += loops[name](itertools.islice(batches[name], CHUNK))
                    spent[name] += time.perf_counter() - t0
        for name in loops:
            seconds[name].append(spent[name])
            losses[name].append(loss[name])

    images = data.steps_per_epoch * BATCH

    ratio = Stat.of([m / h for m, h in zip(seconds["minishard"], seconds["handwritten"])])
    pipeline_rate = Stat.of([images / s for s in seconds["pipeline"]])
    step_rate = Stat.of([images / (m - p) for m, p in zip(seconds["minishard"], seconds["pipeline"])])
    fraction = Stat.of([p / m for m, p in zip(seconds["minishard"], seconds["pipeline"])])
    out: dict[str, Any] = {
        "steps_per_epoch": data.steps_per_epoch,
        "examples": data.num_examples,
        "epoch_ratio": ratio.as_json(),
        "data_path_diff_s": Stat.of(
            [a - b for a, b in zip(seconds["pipeline"], seconds["pipeline_handwritten"])]
        ).as_json(3),
        "diff_s": Stat.of([m - h for m, h in zip(seconds["minishard"], seconds["handwritten"])]).as_json(),
        "epoch_s": {name: Stat.of(s).as_json(3) for name, s in seconds.items()},
        "mean_loss": {
            name: round(sum(v) / len(v) / data.steps_per_epoch, 4) for name, v in losses.items() if any(v)
        },
        "input_pipeline": {
            "images_per_s": pipeline_rate.as_json(0),
            "step_images_per_s": step_rate.as_json(0),
            "data_fraction_of_epoch": fraction.as_json(),
            "data_is_limit": pipeline_rate.median < step_rate.median,
        },
    }
    if run_fit:
        out["fit"] = check_fit(model, mesh, rules, data, out)
    return out


def check_fit(model: Any, mesh: Any, rules: Any, data: Dataset, out: dict[str, Any]) -> dict[str, Any]:
    """``fit`` itself, one epoch from the same start: same losses as our loop's first epoch?"""
    optimizer = ms.SGD(ms.exponential_decay(LR, DECAY_RATE, DECAY_STEPS), momentum=MOMENTUM)
    fresh = minishard_loop(mesh, rules, model)
    loop_loss = fresh(data.epoch(0)) / data.steps_per_epoch
    t0 = time.perf_counter()
    _, _, history = fit(
        model, optimizer, data, FitSettings(mesh=mesh, rules=rules, epochs=1, log=lambda line: None)
    )
    wall = time.perf_counter() - t0
    return {
        "loss": round(history[0]["loss"], 6),
        "same_loop_loss": round(loop_loss, 6),
        "same_loss": bool(np.isclose(history[0]["loss"], loop_loss, rtol=1e-5)),
        "wall_s_incl_compile": round(wall, 3),
    }
