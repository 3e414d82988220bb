"""Section 8: the GPT's AdamW step under ``Sharded`` dp vs the same step written in plain JAX.

The hand-written step is what JAX's SPMD MNIST example
(``examples/spmd_mnist_classifier_fromscratch.py``) would write for a GPT:
parameters as a dict of arrays, a mesh, ``P()`` for the parameters and the
optimizer state, ``P("data")`` for the batch, one ``jax.jit`` with
``in_shardings`` / ``out_shardings`` and donated state. Same math: the same
einsums (q, k and v stacked into one), the same causal mask by positions,
LayerNorm, Swish MLP, cross-entropy and AdamW (clipping, bias corrections,
decay on arrays of two or more dimensions), from the same numbers, so the
losses must agree before anything is timed. Contenders, interleaved and
paired as ``harness.py`` does, blocking after every step (programs with
collectives on simulated devices):

* ``minishard``: ``ms.Sharded(mesh, style_rules("dp"))(make_train_step(AdamW(...), next_token_loss))``;
* ``handwritten``: the plain-JAX step, the reference;
* ``handwritten_copy``: the same jit again, the A/A control.

Reported: the paired ratio to the hand-written step, and tokens per second.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from harness import compare_blocked
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import minishard as ms
from minishard.models import gpt
from minishard.optim import AdamW
from minishard.run.next_token import next_token_loss
from minishard.run.steps import make_train_step
from minishard.styles import mesh_rules

LR, B1, B2, EPS, DECAY, CLIP = 1e-3, 0.9, 0.99, 1e-8, 0.1, 1.0


# --- the GPT in plain JAX --------------------------------------------------------------------


def params_of(model: gpt.GPT) -> dict[str, Any]:
    """The minishard GPT's arrays as plain dicts: the hand-written step starts from the same numbers."""

    def block(b: Any) -> dict[str, Any]:
        a, (w1, _, w2) = b.attention, b.mlp.layers
        return {
            "ln1": (b.norm1.scale, b.norm1.bias), "ln2": (b.norm2.scale, b.norm2.bias),
            "q": a.query, "k": a.key, "v": a.value, "out": a.out,
            "w1": w1.weight, "b1": w1.bias, "w2": w2.weight, "b2": w2.bias,
        }  # fmt: skip

    return {
        "tokens": model.embedding.tokens, "position_table": model.embedding.position_table,
        "blocks": [block(b) for b in model.blocks],
        "ln": (model.norm.scale, model.norm.bias), "head": (model.head.weight, model.head.bias),
    }  # fmt: skip


def layer_norm(x: jax.Array, scale_bias: tuple[jax.Array, jax.Array]) -> jax.Array:
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-6) * scale_bias[0] + scale_bias[1]


def attention(p: dict[str, Any], x: jax.Array) -> jax.Array:
    q, k, v = jnp.einsum("bte,cehk->cbthk", x, jnp.stack([p["q"], p["k"], p["v"]]))
    logits = jnp.einsum("bthk,bshk->bhts", q, k) / math.sqrt(q.shape[-1])
    positions = jnp.arange(x.shape[1])
    logits = jnp.where(positions[None, :] <= positions[:, None], logits, jnp.finfo(logits.dtype).min)
    mixed = jnp.einsum("bhts,bshk->bthk", jax.nn.softmax(logits, axis=-1), v)
    return jnp.einsum("bthk,hke->bte", mixed, p["out"])


def forward(params: dict[str, Any], ids: jax.Array) -> jax.Array:
    x = params["tokens"][ids] + params["position_table"][jnp.arange(ids.shape[1])]
    for p in params["blocks"]:
        x = x + attention(p, layer_norm(x, p["ln1"]))
        h = jax.nn.swish(layer_norm(x, p["ln2"]) @ p["w1"] + p["b1"])
        x = x + h @ p["w2"] + p["b2"]
    w, b = params["head"]
    return layer_norm(x, params["ln"]) @ w + b


def loss_fn(params: dict[str, Any], batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """Cross-entropy per character, and the accuracy (minishard's step reports it too)."""
    logits = forward(params, batch["inputs"])
    log_probs = logits - jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    targets = jax.nn.one_hot(batch["targets"], logits.shape[-1])
    accuracy = jnp.mean(jnp.argmax(logits, axis=-1) == batch["targets"])
    return -jnp.mean(jnp.sum(targets * log_probs, axis=-1)), accuracy


def adamw(params: Any, grads: Any, state: tuple[jax.Array, Any, Any]) -> tuple[Any, Any]:
    """optax's clip_by_global_norm then adamw, a constant rate, decay on arrays of rank >= 2."""
    step, mu, nu = state
    norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))
    grads = jax.tree.map(lambda g: jnp.where(norm < CLIP, g, g / norm * CLIP), grads)
    mu = jax.tree.map(lambda m, g: (1 - B1) * g + B1 * m, mu, grads)
    nu = jax.tree.map(lambda v, g: (1 - B2) * jnp.square(g) + B2 * v, nu, grads)
    mu_fix, nu_fix = 1 - B1 ** (step + 1), 1 - B2 ** (step + 1)

    def update(p: jax.Array, m: jax.Array, v: jax.Array) -> jax.Array:
        direction = (m / mu_fix) / (jnp.sqrt(v / nu_fix) + EPS)
        return p - LR * (direction + DECAY * p if p.ndim >= 2 else direction)

    return jax.tree.map(update, params, mu, nu), (step + 1, mu, nu)


def train_step(params: Any, state: Any, batch: dict[str, jax.Array]) -> tuple[Any, Any, jax.Array, jax.Array]:
    (loss, accuracy), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
    params, state = adamw(params, grads, state)
    return params, state, loss, accuracy


def handwritten(mesh: jax.sharding.Mesh) -> Callable[..., Any]:
    """``train_step`` jitted as the SPMD MNIST example does: replicated state, the batch over "data"."""
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    return jax.jit(
        train_step,
        in_shardings=(replicated, replicated, split),
        out_shardings=(replicated, replicated, replicated, replicated),
        donate_argnums=(0, 1),
    )


# --- the comparison ------------------------------------------------------------------------------


def bench_gpt(sizes: dict[str, int], batch: int, rounds: int, iters: int, warmup: int) -> dict[str, Any]:
    model = gpt.GPT(**sizes, key=jax.random.key(0))
    shape, rules = mesh_rules("dp", jax.device_count())
    mesh = ms.make_mesh(shape)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, sizes["vocab"], (batch, sizes["context"] + 1)).astype(np.int32)
    data = jax.device_put({"inputs": ids[:, :-1], "targets": ids[:, 1:]}, NamedSharding(mesh, P("data")))
    optimizer = AdamW(LR, B1, B2, EPS, DECAY, CLIP)
    ours = ms.Sharded(mesh, rules, donate_argnums=(0, 1))(make_train_step(optimizer, next_token_loss))
    theirs = {name: handwritten(mesh) for name in ("handwritten", "handwritten_copy")}

    # Every contender its own copy, made by a jit: device_put may share buffers, and each step donates.
    copy = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree), out_shardings=NamedSharding(mesh, P()))

    def placed_handwritten() -> Any:
        params = params_of(model)
        mu, nu = (jax.tree.map(jnp.zeros_like, params) for _ in range(2))
        return copy((params, (jnp.zeros((), jnp.int32), mu, nu)))

    states: dict[str, Any] = {name: placed_handwritten() for name in theirs}
    states["minishard"] = copy((model, optimizer.init(model)))

    def stepper(name: str) -> Callable[[], jax.Array]:
        fn = ours if name == "minishard" else theirs[name]

        def step() -> jax.Array:
            *state, loss = fn(*states[name], data)[:3]
            states[name] = tuple(state)
            return loss

        return step

    steps = {name: stepper(name) for name in ("minishard", *theirs)}
    losses = {name: [float(jax.block_until_ready(step())) for _ in range(3)] for name, step in steps.items()}
    if not np.allclose(losses["minishard"], losses["handwritten"], rtol=1e-5):
        raise AssertionError(f"minishard and the hand-written GPT step compute different losses {losses}")
    _, blocked = compare_blocked(steps, "handwritten", rounds, iters, warmup)
    tokens = batch * sizes["context"]
    return {
        "sizes": sizes, "batch": batch, "mesh": dict(shape),
        "parameters": ms.tree.count_params(model), "losses_first_three_steps": losses,
        "ratio": blocked.as_json("ratio"),
        "step_ms": {name: round(stat.median / 1e3, 2) for name, stat in blocked.us.items()},
        "tokens_per_s": {name: round(tokens / (stat.median / 1e6)) for name, stat in blocked.us.items()},
    }  # fmt: skip
