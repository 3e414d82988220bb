"""The classic 2-D sharded dot product on a 2 x 4 mesh: 400 pairs of 1,000-element vectors.

The scaling book's example is ten times larger each way, 4,000 pairs of 10,000 elements:
``main(4000, 10_000)`` runs it (seconds more; tests/test_census.py counts its all-reduce, 8 kB,
from the shapes alone). Nothing below depends on the size.

Each input is split over both mesh axes, P("x", "y"): device (i, j) holds a
(200, 250) block. ``vmap(vdot)`` contracts the second dimension, which is split
over "y", so every device computes a partial dot product of its 250 elements
and XLA inserts one all-reduce over "y" to add them up. The result, P("x"), is
split only over "x". Run: ``python examples/dot_product_2d.py``.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # before JAX starts

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import minishard as ms
from minishard.census import summary


def main(pairs: int = 400, length: int = 1000) -> None:
    mesh = ms.make_mesh({"x": 2, "y": 4})
    blocks = NamedSharding(mesh, P("x", "y"))

    # Create the inputs already sharded: each device draws only its own block.
    @jax.jit
    def make_inputs(key):
        a, b = jax.random.normal(key, (2, pairs, length))
        return jax.lax.with_sharding_constraint(a, blocks), jax.lax.with_sharding_constraint(b, blocks)

    a, b = make_inputs(jax.random.key(0))
    print("each device holds", a.addressable_shards[0].data.shape)

    rows = NamedSharding(mesh, P("x"))
    dot = jax.jit(jax.vmap(jnp.vdot), in_shardings=(blocks, blocks), out_shardings=rows)
    result = dot(a, b)
    print("result", result.shape, result.sharding.spec)
    print(summary(ms.collectives(dot.lower(a, b))))

    expected = np.einsum("ij,ij->i", np.asarray(a, np.float64), np.asarray(b, np.float64))
    np.testing.assert_allclose(np.asarray(result), expected, rtol=1e-4, atol=1e-2)
    print("equal to the unsharded dot products")


if __name__ == "__main__":
    main()
