"""A small Vision Transformer, written as user-defined Layers, trained on a 2-D mesh.

minishard ships only MLP building blocks; this example writes the rest of a
ViT as ordinary ``minishard.Layer`` subclasses (declare ``param_fields`` /
``static_fields``, name the logical axes in ``param_axes``) and shards it the
Megatron way on a data=2 x model=4 mesh:

* attention heads are split over "model" (``heads -> model``): each device
  computes 1/4 of the heads, and one all-reduce joins the output projection;
* the MLP hidden units are split over "model" (``mlp -> model``), as before;
* the batch is split over "data".

The task is synthetic so the example runs anywhere in seconds: 16x16 images
whose label is the brightest quadrant. Run: ``python examples/vit_2d_mesh.py``.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # before JAX starts

import jax
import jax.numpy as jnp
import numpy as np

import minishard as ms

IMAGE, PATCH, EMBED, HEADS, CLASSES = 16, 4, 32, 4, 4
TOKENS = (IMAGE // PATCH) ** 2


class LayerNorm(ms.Layer):
    """Normalise each token's features, then scale and shift them (per feature)."""

    param_fields = ("scale", "bias")

    def __init__(self, features: int) -> None:
        self.scale, self.bias = jnp.ones(features), jnp.zeros(features)

    def __call__(self, x: jax.Array) -> jax.Array:
        mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
        return (x - mean) * jax.lax.rsqrt(var + 1e-6) * self.scale + self.bias

    def param_logical_axes(self) -> dict[str, ms.LogicalAxes]:
        return {"scale": ("embed",), "bias": ("embed",)}


class Attention(ms.Layer):
    """Multi-head self-attention. Heads are a dimension of their own, so rules can split them."""

    param_fields = ("qkv", "out")
    static_fields = ("heads",)

    def __init__(self, features: int, heads: int, *, key: jax.Array) -> None:
        k1, k2 = jax.random.split(key)
        head_dim = features // heads
        self.heads = heads
        self.qkv = jax.random.normal(k1, (features, 3, heads, head_dim)) / np.sqrt(features)
        self.out = jax.random.normal(k2, (heads, head_dim, features)) / np.sqrt(features)

    def __call__(self, x: jax.Array) -> jax.Array:  # x: [tokens, features]
        q, k, v = jnp.einsum("tf,fchd->cthd", x, self.qkv)  # each [tokens, heads, head_dim]
        weights = jax.nn.softmax(jnp.einsum("thd,shd->hts", q, k) / np.sqrt(q.shape[-1]), axis=-1)
        mixed = jnp.einsum("hts,shd->thd", weights, v)
        return jnp.einsum("thd,hdf->tf", mixed, self.out)  # sums over heads: the all-reduce

    def param_logical_axes(self) -> dict[str, ms.LogicalAxes]:
        return {"qkv": ("embed", None, "heads", None), "out": ("heads", None, "embed")}


class Block(ms.Layer):
    """Pre-norm transformer block: x + attention(norm(x)), then x + mlp(norm(x))."""

    param_fields = ("norm1", "attention", "norm2", "mlp")

    def __init__(self, features: int, heads: int, *, key: jax.Array) -> None:
        k1, k2 = jax.random.split(key)
        self.norm1, self.norm2 = LayerNorm(features), LayerNorm(features)
        self.attention = Attention(features, heads, key=k1)
        megatron = [("embed", "mlp"), ("mlp", "embed")]
        self.mlp = ms.mlp([features, 4 * features, features], key=k2, scale=0.05, axes=megatron)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViT(ms.Layer):
    """Patches -> linear embedding + positions -> blocks -> mean over tokens -> classes."""

    param_fields = ("embed", "positions", "blocks", "norm", "head")

    def __init__(self, depth: int, *, key: jax.Array) -> None:
        keys = jax.random.split(key, depth + 3)
        self.embed = ms.Linear(PATCH * PATCH, EMBED, key=keys[0], scale=0.1, axes=(None, "embed"))
        self.positions = jax.random.normal(keys[1], (TOKENS, EMBED))
        self.blocks = tuple(Block(EMBED, HEADS, key=k) for k in keys[3:])
        self.norm = LayerNorm(EMBED)
        self.head = ms.Linear(EMBED, CLASSES, key=keys[2], scale=0.1, axes=("embed", "classes"))

    def __call__(self, image: jax.Array) -> jax.Array:  # one image [IMAGE, IMAGE]; vmap for a batch
        grid = IMAGE // PATCH
        patches = image.reshape(grid, PATCH, grid, PATCH).transpose(0, 2, 1, 3).reshape(TOKENS, -1)
        x = self.embed(patches) + self.positions
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(axis=0))

    def param_logical_axes(self) -> dict[str, ms.LogicalAxes]:
        return {"positions": (None, "embed")}  # the sub-layers answer for themselves


def brightest_quadrant(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, CLASSES, n)
    images = rng.uniform(0, 0.5, (n, IMAGE, IMAGE)).astype(np.float32)
    half = IMAGE // 2
    for image, label in zip(images, labels):
        row, col = divmod(int(label), 2)
        image[row * half : (row + 1) * half, col * half : (col + 1) * half] += 0.5
    return images, labels.astype(np.int32)


def main(steps: int = 100) -> None:
    mesh = ms.make_mesh({"data": 2, "model": 4})
    rules = ms.AxisRules(batch="data", embed=None, heads="model", mlp="model", classes=None)
    model = ViT(depth=2, key=jax.random.key(0))
    optimizer = ms.SGD(0.05, momentum=0.9)

    def train_step(model, opt_state, images, labels):
        def loss_fn(model):
            logits = jax.vmap(model)(images)
            return ms.cross_entropy(logits, ms.one_hot(labels, CLASSES)), logits

        (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(model)
        model, opt_state = optimizer.update(model, grads, opt_state)
        return model, opt_state, loss, ms.accuracy(logits, labels)

    step = ms.Sharded(mesh, rules)(train_step)
    images, labels = brightest_quadrant(64, seed=0)
    opt_state = optimizer.init(model)
    print(ms.explain(model, mesh, rules, step=step, args=(model, opt_state, images, labels)))

    # One step sharded equals one step on a single device.
    single = jax.jit(train_step)(model, opt_state, images, labels)
    sharded = jax.block_until_ready(step(model, opt_state, images, labels))
    np.testing.assert_allclose(float(sharded[2]), float(single[2]), rtol=1e-5)
    print(f"first-step loss {float(sharded[2]):.4f}, sharded == single device")

    model, opt_state = ms.shard(model, mesh, rules), ms.shard(opt_state, mesh, rules)
    for i in range(steps):
        images, labels = brightest_quadrant(64, seed=i)
        model, opt_state, loss, acc = step(model, opt_state, images, labels)
        loss = float(loss)  # wait for each step: XLA:CPU must not queue collectives unboundedly
        if i % 25 == 24:
            print(f"step {i + 1}: loss {loss:.3f}, batch accuracy {float(acc):.2f}")
    assert float(acc) > 0.9, "the ViT should learn which quadrant is brightest"
    print("attention heads live on:", model.blocks[0].attention.qkv.sharding.spec)


if __name__ == "__main__":
    main()
