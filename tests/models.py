"""Models and steps shared by the rules, sharding and explain tests.

The MNIST MLP 784 -> 512 -> 10 (1,628,200 bytes of float32) with its SGD train
step and a batch of 64; ``numpy_mlp`` builds any MLP with numpy parameters,
which compiles nothing.
"""

import jax
import numpy as np

import minishard as ms

SIZES = [784, 512, 10]
BATCH = 64
F32 = 4  # bytes
MEGATRON = [("embed", "mlp"), ("mlp", "embed")]  # split the hidden dimension
OPT = ms.SGD(0.1)


def train_step(model, opt_state, images, labels):
    def loss_fn(model):
        return ms.cross_entropy(model(images), ms.one_hot(labels, SIZES[-1]))

    loss, grads = jax.value_and_grad(loss_fn)(model)
    model, opt_state = OPT.update(model, grads, opt_state)
    return model, opt_state, loss


def example(axes=None):
    """(model, opt_state, images, labels); the batch comes from NumPy, which compiles nothing."""
    model = ms.mlp(SIZES, key=jax.random.key(0), axes=axes)
    rng = np.random.default_rng(0)
    images = rng.standard_normal((BATCH, SIZES[0]), dtype=np.float32)
    labels = rng.integers(0, SIZES[-1], BATCH, dtype=np.int32)
    return model, OPT.init(model), images, labels


def numpy_mlp(sizes: list[int], axes: list[tuple[str | None, str | None]]) -> ms.Sequential:
    """``minishard.mlp`` with numpy parameters: built without compiling anything."""
    shapes = jax.eval_shape(lambda: ms.mlp(sizes, key=jax.random.key(0), axes=axes))
    return jax.tree.map(lambda leaf: np.ones(leaf.shape, leaf.dtype), shapes)


def forward(model, x):
    return model(x)
