"""minishard: a from-scratch mini-framework that teaches distributed training on JAX.

Read the modules in this order, which is their import order: each teaches one
idea, and imports only the ones before it.

* ``tree``: naming and counting the leaves of any pytree;
* ``rules``: logical axes -> mesh axes (``AxisRules``);
* ``constraints``: where activations live (``constrain``), read from the one sharding environment;
* ``layers``: models as pytrees (``Layer``, ``Linear``, ``Sequential``, ``mlp``);
* ``losses``, ``optim``: cross-entropy and a pure, functional SGD;
* ``sharding``: meshes, one ``plan`` for a whole tree, ``shard`` and ``Sharded``;
* ``presets``: five named styles (dp, tp, 2d, fsdp, fsdp+tp) as a mesh shape and rules;
* ``census``: ``collectives``, what a compiled program sends between devices, read from its HLO;
* ``costs``: what a step would take on a TPU or GPU (a roofline from the compiled program);
* ``report``: ``explain``, the plan, the collectives and the cost of a step, as one ``Report``;
* ``pipeline``: pipeline parallelism by hand (microbatches, GPipe, circular schedules);
* ``zero``: ZeRO by hand with ``shard_map``: the minimum bytes for data parallelism.

Running it (``minishard.run``, the workshop: it uses the names above as any user would):
``data``, ``checkpoint``, ``train``, ``distributed``, ``launch``, ``render`` (the report as
a rich table, HTML or pictures) and ``cli`` (``minishard train``, ``explain``, ``launch``).

Models (``minishard.models``): ``vit``, a Vision Transformer whose heads and MLP split like the MLP's.

Tools (``minishard.testing``): strategies and assertions (numbers, layout, communication)
to property-test your own models' sharding.
"""

import signal as _signal


def _mask(how: int, signals: set[int]) -> set[int]:
    """``signal.pthread_sigmask``, which only POSIX has: elsewhere nothing is held."""
    mask = getattr(_signal, "pthread_sigmask", None)
    return set() if mask is None else set(mask(how, signals))


# A Ctrl-C that lands while JAX imports can be swallowed there (inside its gc callback), and a
# launcher would run on: SIGINT and SIGTERM wait until these imports are done, then arrive.
_held = _mask(_signal.SIG_BLOCK, {_signal.SIGINT, _signal.SIGTERM})

from minishard import tree
from minishard.census import collectives
from minishard.constraints import constrain
from minishard.layers import Layer, Linear, ReLU, Sequential, Swish, megatron_axes, mlp
from minishard.losses import accuracy, cross_entropy, one_hot
from minishard.optim import SGD, SGDState, exponential_decay, warmup_cosine_decay
from minishard.report import Report, explain
from minishard.rules import AxisRules, LogicalAxes, ShardingError
from minishard.sharding import Sharded, make_mesh, partition_specs, plan, shard

_mask(_signal.SIG_SETMASK, _held)

__all__ = [
    "SGD",
    "AxisRules",
    "Layer",
    "Linear",
    "LogicalAxes",
    "ReLU",
    "Report",
    "SGDState",
    "Sequential",
    "Sharded",
    "ShardingError",
    "Swish",
    "accuracy",
    "collectives",
    "constrain",
    "cross_entropy",
    "explain",
    "exponential_decay",
    "make_mesh",
    "megatron_axes",
    "mlp",
    "one_hot",
    "partition_specs",
    "plan",
    "shard",
    "tree",
    "warmup_cosine_decay",
]
