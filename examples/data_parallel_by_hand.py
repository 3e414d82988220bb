"""Data parallelism three ways: ``jax.pmap``, ``jax.shard_map``, and ``ms.Sharded``.

In data parallelism every device holds a full copy of the model and a slice of
the batch, computes gradients on its slice, and the devices average their
gradients (an **all-reduce**) before each takes the same SGD step. Three
spellings of that give the same parameters after a few steps:

1. ``jax.pmap`` (the older API): arrays carry a leading *device* axis, so the
   model is stacked 8 times by hand and the batch reshaped to (8, 8, ...); the
   all-reduce is written out, ``lax.pmean(grads, "data")``.
2. ``jax.shard_map`` (today's per-device API): the same per-device body, over a
   named mesh; ``in_specs`` say which arrays are split (the batch, ``P("data")``)
   and which are copies (the model, ``P()``), so nothing is reshaped by hand.
3. ``ms.Sharded`` (automatic): the step is written for the whole batch, and
   XLA's partitioner inserts the all-reduce itself.

Why ``pmean`` and not ``psum``: the loss is a *mean* over the batch. Each
device's loss is the mean over its equal-sized slice, so the whole-batch
gradient is the mean of the 8 local gradients. ``pmean`` is ``psum`` then a
division by the axis size: one all-reduce either way, as the printed
collectives show. ``check_vma=False`` is explained where it is used, and in
docs/then-and-now.md (section 4). Run: ``python examples/data_parallel_by_hand.py``.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # before JAX starts

from typing import Any

import jax
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

import minishard as ms

STEPS, DEVICES, BATCH, FEATURES = 3, 8, 64, 32
opt = ms.SGD(0.5)


def loss_fn(model: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    return ms.cross_entropy(model(x), ms.one_hot(y, 10))


def local_step(model: Any, state: Any, x: jax.Array, y: jax.Array) -> tuple[Any, Any]:
    """One device's SGD step on its slice of the batch; pmap and shard_map both run this."""
    grads = jax.grad(loss_fn)(model, x, y)  # this device's gradient
    grads = lax.pmean(grads, "data")  # the all-reduce, written by hand
    return opt.update(model, grads, state)


def main() -> None:
    mesh = ms.make_mesh({"data": DEVICES})

    # 1. pmap maps over a leading device axis of every argument, named "data" for collectives.
    pmap_step = jax.pmap(local_step, axis_name="data")

    # 2. shard_map maps over the mesh. check_vma=False: by default shard_map tracks which values
    # vary across devices; the model (P()) does not, so autodiff would sum its gradient over
    # "data" by itself and our pmean would average 8 equal sums (8x too large). Off, each device
    # keeps its local gradient, as under pmap, and the all-reduce is ours to write.
    shard_map_step = jax.jit(
        jax.shard_map(
            local_step,
            mesh=mesh,
            in_specs=(P(), P(), P("data"), P("data")),  # model and optimizer state copied, batch split
            out_specs=(P(), P()),
            check_vma=False,
        )
    )

    # 3. Sharded: the step on the whole batch, no collective in sight; XLA inserts the all-reduce.
    @ms.Sharded(mesh, ms.AxisRules(batch="data"))
    def automatic_step(model: Any, state: Any, x: jax.Array, y: jax.Array) -> tuple[Any, Any]:
        return opt.update(model, jax.grad(loss_fn)(model, x, y), state)

    model = ms.mlp([FEATURES, 64, 10], key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (BATCH, FEATURES))
    y = jax.random.randint(jax.random.key(2), (BATCH,), 0, 10)

    # pmap wants the leading device axis: 8 stacked copies of model and state, the batch as (8, 8, ...).
    stacked = jax.tree.map(lambda a: np.broadcast_to(a, (DEVICES, *np.shape(a))), (model, opt.init(model)))
    per_device = (x.reshape(DEVICES, -1, FEATURES), y.reshape(DEVICES, -1))

    trained = {"pmap": stacked, "shard_map": (model, opt.init(model)), "Sharded": (model, opt.init(model))}
    for _ in range(STEPS):  # block on every step: simulated CPU devices can deadlock otherwise
        trained["pmap"] = jax.block_until_ready(pmap_step(*trained["pmap"], *per_device))
        trained["shard_map"] = jax.block_until_ready(shard_map_step(*trained["shard_map"], x, y))
        trained["Sharded"] = jax.block_until_ready(automatic_step(*trained["Sharded"], x, y))

    reference = jax.tree.leaves(trained["Sharded"][0])
    by_pmap = jax.tree.map(lambda a: a[0], trained["pmap"][0])  # device 0's copy
    for name, params in [("pmap", by_pmap), ("shard_map", trained["shard_map"][0])]:
        for a, b in zip(jax.tree.leaves(params), reference):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
        print(f"{name:>9} after {STEPS} SGD steps: same parameters as Sharded")
    losses = [jax.jit(loss_fn)(m, x, y) for m in (model, trained["Sharded"][0])]
    print(f"loss {float(losses[0]):.4f} -> {float(losses[1]):.4f}")
    assert losses[1] < losses[0]

    # The same all-reduce, whether written by hand or inserted by XLA.
    args = (model, opt.init(model), x, y)
    for name, step in [("shard_map", shard_map_step), ("Sharded", automatic_step)]:
        found = ms.collectives(step.lower(*args), mesh)
        print(f"{name:>9}:", "\n".join(str(c) for c in found.values()))


if __name__ == "__main__":
    main()
