"""The guards of a mixture of experts (experts.py).

What each checks, and the words it says. A reader may skip this file, as ``minishard._checks``,
whose shared checks it uses; it imports nothing else of minishard.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from minishard._checks import check_input, count, is_finite, positive


def moe(n_experts: Any, k: Any, capacity_factor: Any, balance_weight: Any, z_weight: Any) -> None:
    """``MoE``'s routing arguments, before any weight is drawn."""
    count("MoE: n_experts", n_experts)
    if isinstance(k, bool) or not isinstance(k, int | np.integer) or not 1 <= k <= n_experts:
        raise ValueError(
            f"MoE: k={k!r} with n_experts={n_experts}; each token picks k distinct experts, "
            f"so k must be an int from 1 to {n_experts} (1: Switch, 2: GShard)"
        )
    if not is_finite(capacity_factor) or capacity_factor <= 0:
        raise ValueError(
            f"MoE: capacity_factor={capacity_factor!r}; it must be a number > 0 (1.25 is usual; "
            f"n_experts / k = {n_experts / k:g} never drops a token)"
        )
    for name, weight in (("balance_weight", balance_weight), ("z_weight", z_weight)):
        if not is_finite(weight) or weight < 0:
            raise ValueError(f"MoE: {name}={weight!r}; a loss weight must be a number >= 0")


def experts(n: Any, features: Any, hidden: Any, activation: Any, activations: Sequence[str]) -> None:
    """``Experts``' sizes and activation, before any weight is drawn."""
    for name, size in (("n", n), ("features", features), ("hidden", hidden)):
        count(f"Experts: {name}", size)
    if activation not in activations:
        raise ValueError(f"Experts: unknown activation {activation!r}; choose from {', '.join(activations)}")


def capacity(tokens: Any, n_experts: Any, k: Any, capacity_factor: Any) -> None:
    """``capacity``'s counts and factor: each a positive number, as ``MoE`` takes them."""
    for name, value in (("tokens", tokens), ("n_experts", n_experts), ("k", k)):
        count(f"capacity: {name}", value)
    positive("capacity: capacity_factor", capacity_factor)


def moe_input(x: Any, features: int) -> None:
    """An array ``[..., tokens, features]``: at least a group of tokens, each of the router's width."""
    check_input("MoE", x)
    if len(shape := np.shape(x)) < 2 or shape[-1] != features:
        raise ValueError(
            f"MoE: input of shape {shape}; it takes [..., tokens, {features}] (each leading index a group "
            f"of tokens, routed together), with {features} features, the router's in_features"
        )


def expert_parallel(mesh_shape: dict[str, int], expert_axis: Any, data_axis: Any) -> None:
    """The named mesh axes exist and differ; no other mesh axis splits anything."""
    for name, axis in (("expert_axis", expert_axis), ("data_axis", data_axis)):
        if axis is not None and axis not in mesh_shape:
            raise ValueError(f"ExpertParallel: {name}={axis!r} is not an axis of the mesh {mesh_shape}")
    if expert_axis is None or expert_axis == data_axis:
        raise ValueError(
            f"ExpertParallel: expert_axis={expert_axis!r}, data_axis={data_axis!r}; the experts need a mesh "
            "axis of their own (the batch is split over it too), and data_axis another one or None"
        )
    if others := {a: n for a, n in mesh_shape.items() if a not in (expert_axis, data_axis) and n > 1}:
        raise ValueError(
            f"ExpertParallel: mesh axes {others} are neither the expert axis {expert_axis!r} nor the data "
            f"axis {data_axis!r}; the all-to-all MoE composes with data parallelism only (place tensor-"
            "parallel experts with rules and Sharded instead)"
        )


def experts_split(
    n_experts: int, groups: int, mesh_shape: dict[str, int], batch_axes: tuple[str, ...]
) -> None:
    """Every device holds as many whole experts (``batch_axes[-1]``), and routes as many groups."""
    expert_axis, devices = batch_axes[-1], math.prod(mesh_shape[a] for a in batch_axes)
    if n_experts % mesh_shape[expert_axis]:
        raise ValueError(
            f"all_to_all_moe: {n_experts} experts do not split over mesh axis {expert_axis!r} of "
            f"{mesh_shape[expert_axis]} devices; n_experts must be a multiple of {mesh_shape[expert_axis]}"
        )
    if groups % devices:
        sizes = " x ".join(f"{a!r}={mesh_shape[a]}" for a in batch_axes)
        raise ValueError(
            f"all_to_all_moe: {groups} groups (the input's leading dimensions) do not split over mesh "
            f"axes {sizes}; each device routes its own groups, so their number must divide by {devices}"
        )
