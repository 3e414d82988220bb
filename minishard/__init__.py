"""minishard: a from-scratch mini-framework that teaches distributed training on JAX."""

from minishard import tree
from minishard.layers import Axes, Layer, Linear, ReLU, Sequential, Swish, megatron_axes, mlp
from minishard.losses import accuracy, cross_entropy, one_hot
from minishard.optim import SGD, SGDState, exponential_decay
from minishard.report import Collective, collectives
from minishard.sharding import (
    AxisRules,
    Sharded,
    ShardingError,
    make_mesh,
    partition_specs,
    shard,
)

__all__ = [
    "SGD",
    "AxisRules",
    "Collective",
    "Sharded",
    "ShardingError",
    "collectives",
    "make_mesh",
    "partition_specs",
    "shard",
    "Axes",
    "Layer",
    "Linear",
    "ReLU",
    "SGDState",
    "Sequential",
    "Swish",
    "accuracy",
    "cross_entropy",
    "exponential_decay",
    "megatron_axes",
    "mlp",
    "one_hot",
    "tree",
]
