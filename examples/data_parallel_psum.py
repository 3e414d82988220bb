"""Data parallelism written out by hand: ``jax.shard_map`` and ``lax.psum``.

``Sharded`` lets XLA insert the gradient all-reduce. Here the same step is
written explicitly, the way ``pmap`` programs used to be: each device sees only
its slice of the batch (and a full copy of the model), computes local gradients,
and ``lax.pmean`` averages them over the "data" axis. Both versions give the same
new model. Run: ``python examples/data_parallel_psum.py``.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # before JAX starts

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import minishard as ms

LR = 0.1


def loss_fn(model, x, y):
    return ms.cross_entropy(model(x), ms.one_hot(y, 10))


def main() -> None:
    mesh = ms.make_mesh({"data": 8})
    model = ms.mlp([784, 64, 10], key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (64, 784))
    y = jax.random.randint(jax.random.key(2), (64,), 0, 10)

    # Explicit: the body runs per device on its 8 examples; P() = a full copy of the model.
    # check_vma=False: by default shard_map tracks which values vary across devices, and
    # autodiff then sums the gradient of the replicated model by itself. Turning that off
    # leaves each device with its local gradient, so the all-reduce is ours to write.
    @jax.jit
    @partial(
        jax.shard_map, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=(P(), P()), check_vma=False
    )
    def explicit_step(model, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(model, x, y)
        grads = jax.lax.pmean(grads, "data")  # the all-reduce, written by hand
        model = jax.tree_util.tree_map(lambda p, g: p - LR * g, model, grads)
        return model, jax.lax.pmean(loss, "data")

    # Automatic: the same math on the whole batch; XLA inserts the all-reduce.
    @ms.Sharded(mesh, ms.AxisRules(batch="data"))
    def automatic_step(model, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(model, x, y)
        return jax.tree_util.tree_map(lambda p, g: p - LR * g, model, grads), loss

    (by_hand, loss_a), (by_xla, loss_b) = explicit_step(model, x, y), automatic_step(model, x, y)
    jax.block_until_ready((by_hand, by_xla))
    for a, b in zip(jax.tree_util.tree_leaves(by_hand), jax.tree_util.tree_leaves(by_xla)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    print(f"loss {float(loss_a):.4f} (explicit) vs {float(loss_b):.4f} (automatic): same new model")
    print("explicit:", ms.report.summary(ms.collectives(explicit_step.lower(model, x, y), mesh)))
    print("automatic:", ms.report.summary(ms.collectives(automatic_step.lower(model, x, y))))
    assert jnp.isfinite(loss_a)


if __name__ == "__main__":
    main()
