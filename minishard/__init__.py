"""minishard: a from-scratch mini-framework that teaches distributed training on JAX.

Read the modules in this order; each teaches one idea:

* ``layers``: models as pytrees (``Layer``, ``Linear``, ``Sequential``, ``mlp``);
* ``losses``, ``optim``: cross-entropy and a pure, functional SGD;
* ``rules``: logical axis names -> mesh axis names;
* ``sharding``: meshes, PartitionSpecs for whole models, and ``Sharded``;
* ``hlo``, ``report``: the collectives XLA inserted, and ``explain``;
* ``data``, ``train``, ``checkpoint``, ``cli``: MNIST end to end;
* ``testing``: hypothesis strategies to property-test your own models' sharding.
"""

from minishard import tree
from minishard.layers import Axes, Layer, Linear, ReLU, Sequential, Swish, megatron_axes, mlp
from minishard.losses import accuracy, cross_entropy, one_hot
from minishard.optim import SGD, SGDState, exponential_decay
from minishard.report import Collective, Report, collectives, explain
from minishard.rules import AxisRules, ShardingError
from minishard.sharding import Sharded, make_mesh, partition_specs, shard

__all__ = [
    "SGD",
    "Axes",
    "AxisRules",
    "Collective",
    "Layer",
    "Linear",
    "ReLU",
    "Report",
    "SGDState",
    "Sequential",
    "Sharded",
    "ShardingError",
    "Swish",
    "accuracy",
    "collectives",
    "cross_entropy",
    "explain",
    "exponential_decay",
    "make_mesh",
    "megatron_axes",
    "mlp",
    "one_hot",
    "partition_specs",
    "shard",
    "tree",
]
