"""The same MLP training step written in each library: the contenders of sections 1 to 3.

Every contender trains the same ReLU MLP (``Linear, relu, Linear, ...``) with
mean cross-entropy and plain SGD (learning rate ``LR``, no momentum), starting
from *the same* parameter values (``Problem.params``), written the way that
library's documentation writes a training step:

=====================  ======================================================
``raw``                ``jax.jit`` over a list of ``(W, b)`` tuples: the reference
``raw_copy``           the same again: the A/A control (noise floor)
``minimal_pytree``     ``jax.jit`` over the smallest hand-written pytree classes of
                       minishard's shape: what any Python pytree node costs (the floor)
``minishard_jit``      plain ``jax.jit`` over a minishard ``mlp`` and ``ms.SGD``
``minishard_sharded``  ``ms.Sharded`` on a 1-device mesh
``nnx_jit``            ``nnx.jit`` + ``nnx.Optimizer`` (Flax NNX's default style)
``nnx_fast``           NNX's documented fast path: ``nnx.split`` once, ``jax.jit``
                       over ``(graphdef, state)``, ``nnx.merge`` inside
``linen``              Flax linen: ``module.apply`` inside ``jax.jit``, optax SGD
``eqx_filter_jit``     Equinox: ``eqx.filter_jit`` over the module, optax SGD
``eqx_partition_jit``  Equinox: ``eqx.partition`` once, ``jax.jit`` over the arrays
=====================  ======================================================

Each ``Contender.step()`` takes one step, keeps the new state, and returns the
loss (what a training loop waits on). ``check_same_losses`` runs every
contender twice before anything is timed and insists on equal losses: equal
programs, so a time difference is the library's overhead and nothing else.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import minishard as ms

LR = 0.01
NUM_CLASSES = 10


@dataclass(frozen=True)
class Problem:
    """Layer sizes, a batch, and initial parameters as numpy arrays (``W`` of shape (in, out))."""

    sizes: tuple[int, ...]
    batch: int
    params: tuple[tuple[np.ndarray, np.ndarray], ...]
    x: np.ndarray
    y: np.ndarray

    @classmethod
    def make(cls, sizes: Sequence[int], batch: int, seed: int = 0) -> Problem:
        rng = np.random.default_rng(seed)
        params = tuple(
            (
                (rng.standard_normal((n_in, n_out)) / np.sqrt(n_in)).astype(np.float32),
                (0.01 * rng.standard_normal(n_out)).astype(np.float32),
            )
            for n_in, n_out in itertools.pairwise(sizes)
        )
        x = rng.random((batch, sizes[0]), dtype=np.float32)  # in [0, 1), like pixels
        y = rng.integers(0, sizes[-1], batch).astype(np.int32)
        return cls(tuple(sizes), batch, params, x, y)

    @property
    def gemm_flops(self) -> int:
        """Exact GEMM FLOPs of one training step: forward, and backward without the input's gradient.

        Per Linear (in -> out) and batch B: forward ``x @ W`` is 2·B·in·out;
        backward ``dW = xᵀ @ dy`` is another 2·B·in·out, and ``dx = dy @ Wᵀ``
        2·B·in·out more for every Linear except the first (nobody needs the
        gradient of the input). Element-wise work (bias, ReLU, softmax) is not counted.
        """
        flops = 0
        for i, (n_in, n_out) in enumerate(itertools.pairwise(self.sizes)):
            flops += (2 if i == 0 else 3) * 2 * self.batch * n_in * n_out
        return flops


def loss_from_logits(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean cross-entropy, written exactly as ``ms.cross_entropy(logits, ms.one_hot(labels))`` is."""
    log_probs = logits - jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    onehot = (labels[..., None] == jnp.arange(logits.shape[-1])).astype(jnp.float32)
    return -jnp.mean(jnp.sum(onehot * log_probs, axis=-1))


@dataclass
class Contender:
    """One library's training step with its state.

    ``step()``: one step, keeps the new state, returns the loss.
    ``model()``: the library's model object as it is now (for the flatten section).
    ``lower()``: ``.lower(...)`` of the step on the current state (for the compile section).
    """

    step: Callable[[], jax.Array]
    model: Callable[[], Any]
    lower: Callable[[], Any]


# --- raw JAX: the reference ---------------------------------------------------


def raw_forward(params: Sequence[tuple[jax.Array, jax.Array]], x: jax.Array) -> jax.Array:
    *hidden, (w_out, b_out) = params
    for w, b in hidden:
        x = jax.nn.relu(x @ w + b)
    return x @ w_out + b_out


def raw_train_step(params: Any, x: jax.Array, y: jax.Array) -> tuple[Any, jax.Array]:
    loss, grads = jax.value_and_grad(lambda p: loss_from_logits(raw_forward(p, x), y))(params)
    return jax.tree.map(lambda p, g: p - LR * g, params, grads), loss


def make_raw(problem: Problem) -> Contender:
    step_fn = jax.jit(raw_train_step)  # a new jit object per contender: the A/A copy has its own
    x, y = jnp.asarray(problem.x), jnp.asarray(problem.y)
    state = {"params": [(jnp.asarray(w), jnp.asarray(b)) for w, b in problem.params]}

    def step() -> jax.Array:
        state["params"], loss = step_fn(state["params"], x, y)
        return loss

    return Contender(step, lambda: state["params"], lambda: step_fn.lower(state["params"], x, y))


# --- the floor: the smallest Python pytree classes of minishard's shape ---------------------


class MinimalLinear:  # the classes hold arrays only: no logical axes, no checks, mutable
    def __init__(self, weight: Any, bias: Any) -> None:
        self.weight, self.bias = weight, bias


class MinimalReLU:
    pass


class MinimalSequential:
    def __init__(self, layers: tuple[Any, ...]) -> None:
        self.layers = layers


def _register(cls: type, fields: tuple[str, ...]) -> None:
    """As a user writes a pytree class in a hurry: no keys, no static data, no checks."""

    def flatten(node: Any) -> tuple[tuple[Any, ...], None]:
        return tuple(getattr(node, name) for name in fields), None

    def unflatten(_: None, children: Any) -> Any:
        node = object.__new__(cls)
        for name, child in zip(fields, children):
            setattr(node, name, child)
        return node

    jax.tree_util.register_pytree_node(cls, flatten, unflatten)


_register(MinimalLinear, ("weight", "bias"))
_register(MinimalReLU, ())
_register(MinimalSequential, ("layers",))


def minimal_model(params: Sequence[tuple[Any, Any]]) -> MinimalSequential:
    """``Linear, ReLU, Linear, ...`` as the minimal classes, holding ``params``."""
    layers: list[Any] = []
    for i, (w, b) in enumerate(params):
        layers += [MinimalReLU()] if i else []
        layers.append(MinimalLinear(w, b))
    return MinimalSequential(tuple(layers))


def minimal_train_step(model: MinimalSequential, x: jax.Array, y: jax.Array) -> tuple[Any, jax.Array]:
    params = [(layer.weight, layer.bias) for layer in model.layers[::2]]
    new, loss = raw_train_step(params, x, y)
    return minimal_model(new), loss


def make_minimal_pytree(problem: Problem) -> Contender:
    step_fn = jax.jit(minimal_train_step)
    x, y = jnp.asarray(problem.x), jnp.asarray(problem.y)
    state = {"model": minimal_model([(jnp.asarray(w), jnp.asarray(b)) for w, b in problem.params])}

    def step() -> jax.Array:
        state["model"], loss = step_fn(state["model"], x, y)
        return loss

    return Contender(step, lambda: state["model"], lambda: step_fn.lower(state["model"], x, y))


# --- minishard -----------------------------------------------------------------

MS_OPTIMIZER = ms.SGD(LR)


def minishard_train_step(
    model: Any, opt_state: Any, x: jax.Array, y: jax.Array
) -> tuple[Any, Any, jax.Array]:
    def loss_fn(m: Any) -> jax.Array:
        return ms.cross_entropy(m(x), ms.one_hot(y, NUM_CLASSES))

    loss, grads = jax.value_and_grad(loss_fn)(model)
    model, opt_state = MS_OPTIMIZER.update(model, grads, opt_state)
    return model, opt_state, loss


def minishard_model(problem: Problem) -> Any:
    """``ms.mlp`` with ReLU, its parameters replaced by the problem's."""
    # eval_shape: the structure without running the random initialisation (no small compiles).
    model = jax.eval_shape(lambda: ms.mlp(list(problem.sizes), key=jax.random.key(0), activation="relu"))
    leaves, treedef = jax.tree_util.tree_flatten(model)
    ours = [jnp.asarray(a) for pair in problem.params for a in pair]
    assert [leaf.shape for leaf in leaves] == [a.shape for a in ours], "unexpected minishard mlp shapes"
    return jax.tree_util.tree_unflatten(treedef, ours)


def make_minishard(problem: Problem, wrap: Callable[[Any], Any], place: Callable[[Any], Any]) -> Contender:
    step_fn = wrap(minishard_train_step)
    x, y = place(jnp.asarray(problem.x)), place(jnp.asarray(problem.y))
    model = place(minishard_model(problem))
    state = {"model": model, "opt": place(MS_OPTIMIZER.init(model))}

    def step() -> jax.Array:
        state["model"], state["opt"], loss = step_fn(state["model"], state["opt"], x, y)
        return loss

    return Contender(step, lambda: state["model"], lambda: step_fn.lower(state["model"], state["opt"], x, y))


def make_minishard_jit(problem: Problem) -> Contender:
    return make_minishard(problem, jax.jit, lambda tree: tree)


def one_device_mesh() -> tuple[Any, Any]:
    """A 1-device mesh (device 0, where plain ``jax.jit`` runs too) and rules that split the batch on it."""
    mesh = ms.make_mesh({"data": 1}, devices=jax.devices()[:1])
    return mesh, ms.AxisRules(batch="data")


def make_minishard_sharded(problem: Problem) -> Contender:
    mesh, rules = one_device_mesh()
    return make_minishard(problem, ms.Sharded(mesh, rules), lambda tree: ms.shard(tree, mesh, rules))


# --- Flax NNX --------------------------------------------------------------------


def nnx_model(problem: Problem) -> Any:
    from flax import nnx

    def build() -> Any:
        layers: list[Any] = []
        for i, (w, _) in enumerate(problem.params):
            layers += [nnx.relu] if i else []
            layers.append(nnx.Linear(*w.shape, rngs=nnx.Rngs(i)))
        return nnx.Sequential(*layers)

    model = nnx.eval_shape(build)  # the structure without running the random initialisation
    for linear, (w, b) in zip(model.layers[::2], problem.params):
        linear.kernel.set_value(jnp.asarray(w))  # flax's setter (``.value =`` is deprecated)
        linear.bias.set_value(jnp.asarray(b))
    return model


def nnx_step_body(model: Any, optimizer: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    """The NNX step as its docs write it: stateful, ``optimizer.update`` mutates the model."""
    from flax import nnx

    loss, grads = nnx.value_and_grad(lambda m: loss_from_logits(m(x), y))(model)
    optimizer.update(model, grads)
    return loss


def make_nnx_jit(problem: Problem) -> Contender:
    import optax
    from flax import nnx

    model = nnx_model(problem)
    optimizer = nnx.Optimizer(model, optax.sgd(LR), wrt=nnx.Param)
    step_fn = nnx.jit(nnx_step_body)
    x, y = jnp.asarray(problem.x), jnp.asarray(problem.y)
    return Contender(
        lambda: step_fn(model, optimizer, x, y), lambda: model, lambda: step_fn.lower(model, optimizer, x, y)
    )


def nnx_fast_step(graphdef: Any, state: Any, x: jax.Array, y: jax.Array) -> tuple[Any, jax.Array]:
    """NNX's "functional training loop" (Flax's performance guide): merge, step, split again."""
    from flax import nnx

    model, optimizer = nnx.merge(graphdef, state)
    loss = nnx_step_body(model, optimizer, x, y)
    return nnx.state((model, optimizer)), loss


def make_nnx_fast(problem: Problem) -> Contender:
    import optax
    from flax import nnx

    model = nnx_model(problem)
    optimizer = nnx.Optimizer(model, optax.sgd(LR), wrt=nnx.Param)
    graphdef, state0 = nnx.split((model, optimizer))
    step_fn = jax.jit(nnx_fast_step)
    x, y = jnp.asarray(problem.x), jnp.asarray(problem.y)
    state = {"state": state0}

    def step() -> jax.Array:
        state["state"], loss = step_fn(graphdef, state["state"], x, y)
        return loss

    return Contender(step, lambda: state["state"], lambda: step_fn.lower(graphdef, state["state"], x, y))


# --- Flax linen ----------------------------------------------------------------------


def linen_module_and_params(problem: Problem) -> tuple[Any, Any]:
    import flax.linen as nn

    class LinenMLP(nn.Module):
        sizes: tuple[int, ...]

        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            outs = self.sizes[1:]
            for i, size in enumerate(outs):
                x = nn.Dense(size, name=f"dense_{i}")(x)
                if i < len(outs) - 1:
                    x = nn.relu(x)
            return x

    params = {
        "params": {
            f"dense_{i}": {"kernel": jnp.asarray(w), "bias": jnp.asarray(b)}
            for i, (w, b) in enumerate(problem.params)
        }
    }
    return LinenMLP(problem.sizes), params


def _optax_jit(loss_of_params: Any) -> tuple[Any, Any]:
    """A ``jax.jit`` step over a params pytree with optax SGD: shared by linen and eqx's partition path."""
    import optax

    tx = optax.sgd(LR)

    @jax.jit
    def step_fn(params: Any, opt_state: Any, x: jax.Array, y: jax.Array) -> tuple[Any, Any, jax.Array]:
        loss, grads = jax.value_and_grad(loss_of_params)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step_fn, tx


def _jit_contender(params: Any, loss_of_params: Any, problem: Problem) -> Contender:
    step_fn, tx = _optax_jit(loss_of_params)
    x, y = jnp.asarray(problem.x), jnp.asarray(problem.y)
    state = {"params": params, "opt": tx.init(params)}

    def step() -> jax.Array:
        state["params"], state["opt"], loss = step_fn(state["params"], state["opt"], x, y)
        return loss

    return Contender(
        step, lambda: state["params"], lambda: step_fn.lower(state["params"], state["opt"], x, y)
    )


def make_linen(problem: Problem) -> Contender:
    module, params = linen_module_and_params(problem)
    return _jit_contender(params, lambda p, x, y: loss_from_logits(module.apply(p, x), y), problem)


def eqx_model(problem: Problem) -> Any:
    """``eqx.nn.MLP`` (equal hidden widths) with the problem's parameters; Equinox stores W as (out, in)."""
    import equinox as eqx

    sizes = problem.sizes
    if len(set(sizes[1:-1])) > 1:
        raise ValueError(f"eqx.nn.MLP needs equal hidden widths, got {sizes}")
    model = eqx.filter_eval_shape(  # the structure without running the random initialisation
        eqx.nn.MLP, sizes[0], sizes[-1], sizes[1] if len(sizes) > 2 else 0, len(sizes) - 2,
        activation=jax.nn.relu, key=jax.random.key(0),
    )  # fmt: skip
    where = lambda m: [leaf for layer in m.layers for leaf in (layer.weight, layer.bias)]  # noqa: E731
    values = [jnp.asarray(a) for w, b in problem.params for a in (w.T, b)]
    return eqx.tree_at(where, model, values)


def eqx_loss(model: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    return loss_from_logits(jax.vmap(model)(x), y)  # Equinox layers act on one example: vmap the batch


def make_eqx_filter_jit(problem: Problem) -> Contender:
    import equinox as eqx
    import optax

    tx = optax.sgd(LR)

    @eqx.filter_jit
    def step_fn(model: Any, opt_state: Any, x: jax.Array, y: jax.Array) -> tuple[Any, Any, jax.Array]:
        loss, grads = eqx.filter_value_and_grad(eqx_loss)(model, x, y)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    model = eqx_model(problem)
    x, y = jnp.asarray(problem.x), jnp.asarray(problem.y)
    state = {"model": model, "opt": tx.init(eqx.filter(model, eqx.is_array))}

    def step() -> jax.Array:
        state["model"], state["opt"], loss = step_fn(state["model"], state["opt"], x, y)
        return loss

    return Contender(step, lambda: state["model"], lambda: step_fn.lower(state["model"], state["opt"], x, y))


def make_eqx_partition_jit(problem: Problem) -> Contender:
    import equinox as eqx

    params, static = eqx.partition(eqx_model(problem), eqx.is_array)
    return _jit_contender(params, lambda p, x, y: eqx_loss(eqx.combine(p, static), x, y), problem)


# --- the registry --------------------------------------------------------------

REFERENCE, CONTROL, FLOOR = "raw", "raw_copy", "minimal_pytree"
FACTORIES: dict[str, Callable[[Problem], Contender]] = {
    REFERENCE: make_raw,
    CONTROL: make_raw,
    FLOOR: make_minimal_pytree,
    "minishard_jit": make_minishard_jit,
    "minishard_sharded": make_minishard_sharded,
    "nnx_jit": make_nnx_jit,
    "nnx_fast": make_nnx_fast,
    "linen": make_linen,
    "eqx_filter_jit": make_eqx_filter_jit,
    "eqx_partition_jit": make_eqx_partition_jit,
}
LIBRARY_MODULES = {"nnx": "flax.nnx", "linen": "flax.linen", "eqx": "equinox"}
"""A contender whose name starts with one of these keys needs that module (and optax)."""


def available(names: Sequence[str]) -> tuple[list[str], list[str]]:
    """(names whose library imports, messages about the ones skipped)."""
    import importlib

    ok, skipped = [], []
    for name in names:
        module = next((m for prefix, m in LIBRARY_MODULES.items() if name.startswith(prefix)), None)
        try:
            if module is not None:
                importlib.import_module(module)
                importlib.import_module("optax")
            ok.append(name)
        except ImportError as err:
            skipped.append(f"{name}: skipped ({err.name} is not installed; pip install -e '.[bench]')")
    return ok, skipped


def build(problem: Problem, names: Sequence[str]) -> dict[str, Contender]:
    return {name: FACTORIES[name](problem) for name in names}


def check_same_losses(
    contenders: dict[str, Contender], steps: int = 2, rtol: float = 1e-4
) -> list[list[float]]:
    """Take ``steps`` steps with every contender; every loss must match the reference's.

    All start from the same parameters, so the first losses agree if the
    forward passes agree, and the second ones if the updates agree too.
    Returns the losses, one list per step. (Equinox multiplies by Wᵀ in
    another order, so float32 results differ in the last bits: hence ``rtol``.)
    """
    losses = [{name: float(c.step()) for name, c in contenders.items()} for _ in range(steps)]
    for k, by_name in enumerate(losses):
        want = by_name[REFERENCE]
        wrong = {n: v for n, v in by_name.items() if not np.isclose(v, want, rtol=rtol, atol=1e-6)}
        if wrong:
            raise AssertionError(f"step {k + 1}: losses differ from {REFERENCE}'s {want:.6f}: {wrong}")
    return [list(by_name.values()) for by_name in losses]
