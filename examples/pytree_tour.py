"""A tour of pytrees: the containers jax.jit, jax.grad and jax.vmap understand.

Run: ``python examples/pytree_tour.py``. Each section prints what it shows;
docs/pytrees.md tells the same story at more length.
"""

from collections import OrderedDict, namedtuple

import jax
import jax.numpy as jnp

import minishard as ms

Point = namedtuple("Point", ["x", "y"])


@jax.tree_util.register_pytree_node_class
class Pair:
    """A user container: two children, no static data."""

    def __init__(self, left, right):
        self.left, self.right = left, right

    def tree_flatten(self):
        return (self.left, self.right), None

    @classmethod
    def tree_unflatten(cls, aux_data, children):
        return cls(*children)


def main() -> None:
    mixed = {"a": [1, None, (2, 3)], "point": Point(640, 480), "od": OrderedDict(b=4), "name": "leaf too"}
    leaves, treedef = jax.tree_util.tree_flatten(mixed)
    print("leaves:", leaves)  # None is an empty subtree, a string is a leaf
    print("treedef:", treedef)
    print("round trip equal:", jax.tree_util.tree_unflatten(treedef, leaves) == mixed)

    pair = Pair(jnp.ones(2), {"w": jnp.zeros(3)})
    print("a user container doubled:", jax.tree_util.tree_map(lambda a: 2 * a + 1, pair).right)

    model = ms.mlp([3, 4, 2], key=jax.random.key(0))
    for path, leaf in ms.tree.named_leaves(model):
        print(f"  {path:18} {leaf.shape}")
    print("static data lives in the treedef:", jax.tree_util.tree_structure(model))

    grads = jax.grad(lambda m: m(jnp.ones(3)).sum())(model)
    print("grad of a model is a model:", type(grads).__name__, grads[0].weight.shape)
    batched = jax.vmap(model)(jnp.ones((5, 3)))
    print("vmap over examples:", batched.shape)


if __name__ == "__main__":
    main()
