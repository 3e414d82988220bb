"""Property-test a mixture of experts: the loop it must equal, and expert parallelism by hand.

An MoE makes two promises, and each has its oracle:

* **routing**, ``moe_reference``: what the layer computes is what a plain loop over tokens
  computes, in float64: each token through its ``k`` most probable experts, weighted by their
  probabilities, token after token, an expert taking at most ``capacity`` tokens of a group;
* **expert parallelism**, ``assert_moe_equivalent``: the layer run by hand over a mesh
  (``all_to_all_moe``) equals the same layer on one device, forward, gradients and statistics;
  it checks the loop too.

``moes`` draws layers (experts, ``k``, capacity factors, random parameters) and
``expert_parallels`` the meshes and axes that can split them, from small fixed sets, so that
hypothesis's examples reuse compiled programs. Drawing a layer compiles nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

from minishard.experts import ExpertParallel, MoE, MoEStats, capacity
from minishard.layers import collect
from minishard.sharding import make_mesh
from minishard.testing.assertions import _check_tolerances
from minishard.tree import path_str

ACTIVATIONS = {"swish": lambda h: h / (1 + np.exp(-h)), "relu": lambda h: np.maximum(h, 0)}
"""The experts' activations, in numpy: the oracle shares no code with the layer."""


def moe_reference(moe: MoE, x: Any) -> tuple[np.ndarray, int]:
    """``moe(x)`` as a loop over tokens, in numpy float64: ``(output, routings dropped)``.

    Group by group (the leading dimensions of ``x``), token after token: the router's softmax,
    the ``k`` most probable experts (ties to the lower index, as ``argmax``), and for each one
    that has not yet taken ``capacity`` tokens of the group, its MLP's output weighted by its
    probability. A full expert adds nothing: the routing is dropped.

    >>> moe = MoE(4, k=2, capacity_factor=2.0, features=8, hidden=16, key=jax.random.key(0))
    >>> x = np.random.default_rng(0).normal(size=(2, 5, 8))
    >>> y, dropped = moe_reference(moe, x)
    >>> bool(np.allclose(y, jax.jit(moe)(jnp.asarray(x, jnp.float32)), atol=1e-5)), dropped
    (True, 0)
    """
    weights = (moe.router.weight, moe.experts.w_in, moe.experts.w_out)
    router, w_in, w_out = (np.asarray(a, np.float64) for a in weights)
    bias = 0.0 if moe.router.bias is None else np.asarray(moe.router.bias, np.float64)
    activation = ACTIVATIONS[moe.experts.activation]
    groups = np.asarray(x, np.float64).reshape(-1, *np.shape(x)[-2:])
    slots = capacity(groups.shape[1], moe.n_experts, moe.k, moe.capacity_factor)
    y, dropped = np.zeros_like(groups), 0
    for g, tokens in enumerate(groups):
        taken = np.zeros(moe.n_experts, int)
        for s, token in enumerate(tokens):
            logits = token @ router + bias
            probs = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
            for e in np.argsort(-probs, kind="stable")[: moe.k]:
                if taken[e] < slots:
                    y[g, s] += probs[e] * (activation(token @ w_in[e]) @ w_out[e])
                else:
                    dropped += 1
                taken[e] += 1
    return y.reshape(np.shape(x)), dropped


@st.composite
def moes(
    draw: st.DrawFn,
    features: int = 8,
    hidden: int = 16,
    *,
    n_experts: Sequence[int] = (2, 4, 8),
    k: Sequence[int] = (1, 2),
    capacity_factors: Sequence[float | None] = (None, 1.0, 1.25, 2.0),
    scale: float = 1.0,
) -> MoE:
    """``MoE`` layers with random parameters: experts, ``k`` (at most the experts) and capacity drawn.

    A capacity factor of None is ``n_experts / k``, the factor that can drop nothing. The router's
    weights are ``scale / sqrt(features)`` normals (a scale near 1 routes decisively, with no near
    ties), the experts' ``1 / sqrt(fan-in)``. Built as shapes (``jax.eval_shape``) and filled with
    numpy: drawing a layer compiles nothing.
    """
    experts = draw(st.sampled_from(n_experts))
    choices = draw(st.sampled_from([c for c in k if c <= experts]))
    factor = draw(st.sampled_from(capacity_factors))
    factor = experts / choices if factor is None else factor
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    moe = jax.tree.map(
        lambda leaf: _normal(rng, leaf), _abstract_moe(experts, choices, factor, features, hidden)
    )
    return moe.replace(router=moe.router.replace(weight=scale * moe.router.weight))


@functools.cache
def _abstract_moe(n_experts: int, k: int, factor: float, features: int, hidden: int) -> Any:
    return jax.eval_shape(
        lambda: MoE(n_experts, k, factor, features=features, hidden=hidden, key=jax.random.key(0))
    )


def _normal(rng: np.random.Generator, leaf: Any) -> np.ndarray:
    """Normals of standard deviation ``1 / sqrt(fan-in)``: the fan-in is the next-to-last dimension."""
    return (rng.standard_normal(leaf.shape) / np.sqrt(leaf.shape[-2])).astype(leaf.dtype)


def expert_parallels(
    n_experts: int,
    groups: int,
    *,
    expert_sizes: Sequence[int] = (2, 4, 8),
    data_sizes: Sequence[int] = (1, 2),
    expert_axis: str = "expert",
    data_axis: str = "data",
) -> st.SearchStrategy[ExpertParallel]:
    """``ExpertParallel``\\ s that split ``n_experts`` experts and ``groups`` groups over the devices.

    An expert axis of size ``e`` divides the experts, ``e · d`` (with a data axis of size
    ``d`` > 1) divides the groups and fits the device count; an expert axis of 1 splits nothing,
    so none is drawn. When nothing fits, ``ValueError`` at once, before any example is drawn:

    >>> expert_parallels(3, 8)
    Traceback (most recent call last):
    ValueError: expert_parallels: no expert axis of (2, 4, 8) devices splits 3 experts and 8 groups
    """
    fits = [
        (e, d)
        for e in expert_sizes
        for d in data_sizes
        if e > 1 and e * d <= jax.device_count() and n_experts % e == 0 and groups % (e * d) == 0
    ]
    if not fits:
        raise ValueError(
            f"expert_parallels: no expert axis of {tuple(expert_sizes)} devices splits {n_experts} experts "
            f"and {groups} groups"
            + (f" on {jax.device_count()} devices" if max(expert_sizes) > jax.device_count() else "")
        )
    return st.sampled_from(fits).map(lambda f: _expert_parallel(*f, expert_axis, data_axis))


@functools.cache
def _expert_parallel(experts: int, data: int, expert_axis: str, data_axis: str) -> ExpertParallel:
    """One mesh per shape: a mesh is part of what jit compiles for."""
    if data == 1:
        return ExpertParallel(make_mesh({expert_axis: experts}, devices=jax.devices()[:experts]), expert_axis)
    mesh = make_mesh({data_axis: data, expert_axis: experts}, devices=jax.devices()[: data * experts])
    return ExpertParallel(mesh, expert_axis, data_axis)


def assert_moe_equivalent(
    moe: MoE,
    x: Any,
    parallel: ExpertParallel,
    *,
    rtol: float = 1e-5,
    atol: float = 1e-5,
    reference: bool = True,
) -> Any:
    """``moe`` by hand over ``parallel`` equals ``moe`` on one device; returns the parallel ``(y, stats)``.

    Compares the output, the ``MoEStats`` and the gradients of ``sum(sin(y)) + stats.aux_loss``
    with respect to every parameter and to ``x``, and the loss; each difference names its leaf
    (``output``, ``stats.dropped``, ``grad moe.experts.w_in``, ``grad x``). With ``reference``, the
    single-device output and dropped routings must also equal ``moe_reference``'s loop. An expert
    axis of size 1 splits nothing, and is refused: the test would pass whatever the layer did.
    """
    _check_tolerances("assert_moe_equivalent", rtol, atol)
    if parallel.mesh.shape[parallel.expert_axis] < 2:
        raise ValueError(
            f"assert_moe_equivalent: expert axis {parallel.expert_axis!r} of size 1 splits nothing"
        )
    x = jnp.asarray(x)
    want = jax.block_until_ready(_results(moe.replace(parallel=None), x))
    got = jax.block_until_ready(_results(moe.replace(parallel=parallel), x))  # wait: XLA's rendezvous
    for name in _RESULTS:  # the output first: where a slip shows most plainly
        for (path, a), b in zip(
            jax.tree_util.tree_leaves_with_path(got[name]), jax.tree_util.tree_leaves(want[name]), strict=True
        ):
            where = path_str(path, root=name)
            np.testing.assert_allclose(
                a, b, rtol, atol, err_msg=f"{where}: by hand over {dict(parallel.mesh.shape)} != one device"
            )
    if reference:
        y, dropped = moe_reference(moe, x)
        np.testing.assert_allclose(
            want["output"], y, rtol, atol, err_msg="output: the layer != the loop over tokens"
        )
        assert int(want["stats"].dropped) == dropped, (
            f"stats.dropped: the layer drops {int(want['stats'].dropped)}, the loop {dropped}"
        )
    return got["output"], got["stats"]


def _loss(moe: MoE, x: jax.Array) -> tuple[jax.Array, Any]:
    y, stats = collect(MoEStats, moe)(x)
    assert stats is not None  # an MoE ran: it always reports
    return jnp.sum(jnp.sin(y)) + stats.aux_loss, (y, stats)


_RESULTS = ("output", "stats", "grad moe", "grad x", "loss")
"""What ``assert_moe_equivalent`` compares, in this order (a jitted dict comes back sorted)."""


@jax.jit
def _results(moe: MoE, x: jax.Array) -> dict[str, Any]:
    """The output, the statistics, the gradients (named as a message names them) and the loss."""
    (loss, (y, stats)), (grad_moe, grad_x) = jax.value_and_grad(_loss, argnums=(0, 1), has_aux=True)(moe, x)
    return {"output": y, "stats": stats, "grad moe": grad_moe, "grad x": grad_x, "loss": loss}


__all__ = ["ACTIVATIONS", "assert_moe_equivalent", "expert_parallels", "moe_reference", "moes"]
