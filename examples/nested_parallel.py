"""2-D parallelism, then and now: nested ``pmap`` versus one ``shard_map`` over a 2-D mesh.

Older code (JAX 0.2/0.3 era) built a 2-D device grid by nesting ``pmap``: an
outer ``pmap`` over axis "outer" mapped an inner ``pmap`` over axis "inner", and
``lax.psum(v, "inner")`` inside summed along one direction of the grid. Since
JAX 0.8 ``pmap`` is itself built on ``shard_map``: each ``pmap`` makes its own
one-axis mesh, the inner one clashes with the outer one, and the nesting fails.
Below we show the error, then write the same computation the current way.

The replacement is ONE ``jax.shard_map`` over a 2-D mesh with named axes
("outer": 2, "inner": 4). The body runs once per device on its block, and a
collective names the mesh axes it runs over: ``psum(v, "inner")`` adds within a
row of the grid, ``psum(v, "outer")`` within a column, ``psum(v, ("outer",
"inner"))`` over all 8 devices. Each result is the same on every device along
the summed axes, so ``out_specs`` leaves those axes out (the result is not split
over them), and the global results come out as row sums, column sums, and the
total. docs/then-and-now.md (section 5) has the short version.
Run: ``python examples/nested_parallel.py``.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # before JAX starts

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

import minishard as ms


def nested_pmap(x: jax.Array) -> tuple[jax.Array, ...]:
    """The old way: pmap over "outer" of pmap over "inner"; x has shape (2, 4), one value per device."""

    def per_device(v: jax.Array) -> tuple[jax.Array, ...]:
        # Both enclosing pmaps' axis names are in scope here.
        return lax.psum(v, "inner"), lax.psum(v, "outer"), lax.psum(v, ("outer", "inner"))

    return jax.pmap(jax.pmap(per_device, axis_name="inner"), axis_name="outer")(x)


def main() -> None:
    x = jnp.arange(8.0).reshape(2, 4)  # device (i, j) will hold x[i, j]
    print("x =", x.tolist())

    # 1. Then: nested pmap. On current JAX it raises before running anything.
    try:
        nested_pmap(x)
        print("nested pmap ran (older JAX)")
    except Exception as error:  # whatever this JAX version raises
        print(f"nested pmap fails: {type(error).__name__}: {str(error).splitlines()[0]}")

    # 2. Now: one shard_map over a 2-D mesh. Each device gets a (1, 1) block of x.
    mesh = ms.make_mesh({"outer": 2, "inner": 4})

    @jax.jit
    @partial(
        jax.shard_map,
        mesh=mesh,
        in_specs=P("outer", "inner"),  # dim 0 split over "outer", dim 1 over "inner"
        # A psum's result is the same on every device along the summed axes, so each
        # out_spec names only the axes the result still varies over:
        out_specs=(P("outer", None), P(None, "inner"), P()),
    )
    def sums(block: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        return (
            lax.psum(block, "inner"),  # within each row of the grid: 2 groups of 4
            lax.psum(block, "outer"),  # within each column: 4 groups of 2
            lax.psum(block, ("outer", "inner")),  # all 8 devices
        )

    rows, cols, total = jax.block_until_ready(sums(x))
    print("psum over 'inner' (row sums):   ", rows.tolist())
    print("psum over 'outer' (column sums):", cols.tolist())
    print("psum over both (total):         ", total.tolist())
    expected = np.arange(8.0).reshape(2, 4)
    np.testing.assert_allclose(rows, expected.sum(1, keepdims=True))
    np.testing.assert_allclose(cols, expected.sum(0, keepdims=True))
    np.testing.assert_allclose(total, expected.sum(keepdims=True))

    # Each psum is one all-reduce in the compiled program, over the axes it names.
    found = ms.collectives(sums.lower(x), mesh)
    print("\n".join(str(c) for c in found.values()))
    assert found["all-reduce"].count == 3


if __name__ == "__main__":
    main()
