"""Compare two runs of a step in a precision policy: a tolerance from its compute dtype.

A bfloat16 step sharded over replicas does not round where the unsharded one does: each
replica's gradient is rounded to bfloat16 before the sum, XLA fuses other operations, and
the sums that cancel (a bias's gradient, softmax minus one-hot summed over the batch) keep
only the rounding of their terms. So the default ``rtol`` (1e-5) fails, and a tolerance
picked until it passes cannot tell a float32 policy from a bfloat16 one.

``step_tolerance(dtype, replicas)`` says how far, in units of ``dtype``'s epsilon: ``ROUNDINGS``
epsilons of each leaf's largest value (measured: a sum that cancels keeps its terms' roundings),
plus one per halving of the replicas' sum.
``assert_close_in(dtype, got, want, replicas)`` holds each leaf to it, relative to the leaf's
own largest value (a leaf of gradients of 6e-7 is not compared with its neighbours' 3e-3).

What it tells: a step in ``dtype`` from the same step sharded (passes), a step that is
broken (a replica that forgot the others, a gradient not unscaled: fails), and a step that
computes in a *lower* precision than ``dtype`` (bfloat16 where the policy says float32:
fails). A step in a *higher* precision is as close as the roundings allow, and passes: that
it computes in ``dtype`` is read from its program (the dtypes of its ``dot_general``\\ s).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from minishard.tree import path_str

ROUNDINGS = 32
"""Epsilons of a leaf's largest value two runs of one step may differ by, measured (issue 59): the small
GPT's step in bfloat16 sharded over 8 replicas (dp, fsdp) against unsharded, over 5 draws of weights and
batch: the median leaf 1.0 to 1.3 epsilons, the worst 14 to 25, each time a bias whose gradient is a
sum over the 512 tokens that cancels (the output bias, softmax minus one-hot); 32 leaves room."""


def step_tolerance(dtype: Any, replicas: int = 1) -> float:
    """How far, relative to a leaf's largest value, two runs of one step computing in ``dtype`` may differ
    when one sums its gradients over ``replicas`` (each rounded before the sum).

    >>> step_tolerance("bfloat16", replicas=8), step_tolerance("float32")
    (0.2734375, 3.814697265625e-06)
    """
    if not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"step_tolerance: replicas must be a positive int, got {replicas!r}")
    return float(jnp.finfo(dtype).eps) * (ROUNDINGS + math.ceil(math.log2(replicas)))


def assert_close_in(dtype: Any, got: Any, want: Any, replicas: int = 1) -> None:
    """Every leaf of ``got`` within ``step_tolerance(dtype, replicas)`` of ``want``'s, relative to the
    largest value of ``want``'s leaf; the message names the first leaf that is not, and by how much."""
    tolerance = step_tolerance(dtype, replicas)
    leaves = jax.tree_util.tree_leaves_with_path(want)
    for (path, expected), actual in zip(leaves, jax.tree.leaves(got), strict=True):
        scale = float(np.abs(np.float64(expected)).max(initial=0.0))
        worst = float(np.abs(np.float64(actual) - np.float64(expected)).max(initial=0.0))
        if worst > tolerance * scale:
            raise AssertionError(
                f"assert_close_in: {path_str(path)} differs by {worst:.3g}, {worst / (scale or 1):.3g} of "
                f"its largest value {scale:.3g}; {dtype} over {replicas} replicas allows {tolerance:.3g}"
            )


__all__ = ["ROUNDINGS", "assert_close_in", "step_tolerance"]
