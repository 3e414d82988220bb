"""Your own Layer in a Vision Transformer, trained on a 2-D mesh.

``minishard.models.vit`` builds a ViT from Layers: ``PatchEmbedding``,
``Block`` (``LayerNorm``, ``Attention``, ``minishard.mlp``), ``MeanPool`` and a
``Linear`` head. This example writes one more Layer, an *attention pool* (a
learned probe token that attends to all the image's tokens, the "MAP" head of
recent ViTs), drops it into the model in place of the mean, and trains the
result Megatron-style on a data=2 x model=4 mesh:

* a Layer declares its arrays (``param_fields``) and its configuration
  (``static_fields``), and names the logical axes of its own arrays
  (``param_logical_axes``); sub-layers, here an ``Attention``, name theirs;
* ``model.replace(pool=...)`` swaps a sub-layer: Layers are immutable pytrees;
* ``mesh_rules("2d", 8)``: the style table's mesh (data=2 x model=4) and rules:
  batch over "data", attention heads and MLP hidden units over "model". The
  layers never name the batch axis, so ``Sharded(mesh, rules)`` decides it.
  The pool's heads are split too, so ``explain`` counts one more forward and
  one more backward all-reduce over "model" than the blocks alone (4 per
  block: see ``minishard/models/vit.py``).

The task is synthetic so the example runs anywhere in seconds: 16x16 images
whose label is the brightest quadrant. Run: ``python examples/vit_2d_mesh.py``.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # before JAX starts

import jax
import jax.numpy as jnp
import numpy as np

import minishard as ms
from minishard.census import bytes_by_mesh_axes
from minishard.models.vit import Attention, ViT
from minishard.run.steps import make_train_step
from minishard.styles import mesh_rules

IMAGE, CLASSES, BATCH = 16, 4, 64


class AttentionPool(ms.Layer):
    """``[B, tokens, width]`` -> ``[B, width]``: a learned probe token asks every token, by attention.

    Self-attention over ``[probe, tokens]`` gives every token a mix of all the
    others; the probe's own output row is the pooled vector. (The other rows
    are computed and thrown away: simple, and cheap for 16 tokens.)
    """

    param_fields = ("probe", "attention")  # arrays and sub-layers: traced, differentiated, sharded
    static_fields = ("width",)  # hashable configuration: part of the pytree's structure

    def __init__(self, width: int, heads: int, *, key: jax.Array) -> None:
        probe_key, attention_key = jax.random.split(key)  # one key per parameter, from one
        self.width = width
        self.probe = 0.02 * jax.random.normal(probe_key, (1, width))
        self.attention = Attention(width, heads, key=attention_key)  # heads: its own logical axes

    def __call__(self, x: jax.Array) -> jax.Array:
        probe = jnp.broadcast_to(self.probe, (x.shape[0], 1, self.width))  # one probe per example
        return self.attention(jnp.concatenate([probe, x], axis=1))[:, 0]

    def param_logical_axes(self) -> dict[str, ms.LogicalAxes]:
        return {"probe": ("seq", "embed")}  # only this layer's own arrays; `attention` answers for itself


def brightest_quadrant(n: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, CLASSES, n)
    images = rng.uniform(0, 0.5, (n, IMAGE, IMAGE, 1)).astype(np.float32)
    half = IMAGE // 2
    for image, label in zip(images, labels):
        row, col = divmod(int(label), 2)
        image[row * half : (row + 1) * half, col * half : (col + 1) * half] += 0.5
    return {"image": images, "label": labels.astype(np.int32)}


def cross_entropy_loss(model: ViT, batch: dict[str, np.ndarray]) -> jax.Array:
    return ms.cross_entropy(model(batch["image"]), ms.one_hot(batch["label"], CLASSES))


def main(steps: int = 30) -> None:
    shape, rules = mesh_rules("2d", 8)  # {"data": 2, "model": 4}
    mesh = ms.make_mesh(shape)
    vit_key, pool_key = jax.random.split(jax.random.key(0))
    model = ViT(image_size=IMAGE, patch_size=4, width=32, depth=2, heads=4, classes=CLASSES, key=vit_key)
    model = model.replace(pool=AttentionPool(32, heads=4, key=pool_key))  # a changed copy
    optimizer = ms.SGD(0.05, momentum=0.9)
    step = ms.Sharded(mesh, rules)(make_train_step(optimizer))

    batch, opt_state = brightest_quadrant(BATCH, seed=0), optimizer.init(model)
    # placed before the first call: explain, the first step and the loop then share one compiled step
    model, opt_state = ms.shard(model, mesh, rules), ms.shard(opt_state, mesh, rules)
    report = ms.explain(model, mesh, rules, step=step, args=(model, opt_state, batch))
    print("\n".join(line for line in str(report).splitlines() if "blocks[1]" not in line))  # = blocks[0]
    # Over "model": per block 4 all-reduces of one [examples per device, 16 tokens, 32] activation;
    # the pool adds 2, over 17 tokens (probe + 16): it sums every row before keeping the probe's.
    by_axes = bytes_by_mesh_axes(step.lower(model, opt_state, batch))  # compiled once, by explain
    activation = (BATCH // 2) * 32 * 4  # bytes per token on one device
    assert by_axes["all-reduce", ("model",)] == (2 * 4 * 16 + 2 * 17) * activation
    print(f"bytes all-reduced over 'model': {by_axes['all-reduce', ('model',)]:,} = "
          f"(2 blocks x 4 x 16 tokens + pool 2 x 17 tokens) x {activation} bytes per token")  # fmt: skip

    # The sharded step computes the loss that one device computes for the same model and batch.
    single = jax.jit(cross_entropy_loss)(jax.device_put(model, jax.devices()[0]), batch)
    _, _, sharded, _ = jax.block_until_ready(step(model, opt_state, batch))
    np.testing.assert_allclose(float(sharded), float(single), rtol=1e-5)
    print(f"first-step loss {float(sharded):.4f}, sharded == single device")

    for i in range(steps):
        model, opt_state, loss, acc = step(model, opt_state, brightest_quadrant(BATCH, seed=i))
        loss = float(loss)  # wait for each step: XLA:CPU must not queue collectives unboundedly
        if i % 10 == 9:
            print(f"step {i + 1}: loss {loss:.3f}, batch accuracy {float(acc):.2f}")
    assert float(acc) > 0.9, "the ViT should learn which quadrant is brightest"
    print("the pool's heads live on:", model.pool.attention.query.sharding.spec)


if __name__ == "__main__":
    main()
