"""minishard: a from-scratch mini-framework that teaches distributed training on JAX.

Read the modules in this order, which is their import order: each teaches one
idea, and imports only the ones before it.

* ``tree``: naming and counting the leaves of any pytree;
* ``rules``: logical axes -> mesh axes (``AxisRules``);
* ``constraints``: where activations live (``constrain``), read from the one sharding environment;
* ``layers``: models as pytrees (``Layer``, ``Linear``, ``Sequential``, ``Residual``, ``mlp``);
* ``losses``, ``optim``: cross-entropy and pure, functional optimizers (SGD, AdamW);
* ``sharding``: meshes, one ``plan`` for a whole tree, ``shard`` and ``Sharded``;
* ``styles``: twelve named styles (dp, tp, 2d, fsdp, fsdp+tp, pp, dp+pp, cp, dp+cp, tp+sp, ep,
  dp+ep) as a mesh shape and rules;
* ``census``: ``collectives``, what a compiled program sends between devices, read from its HLO;
* ``hardware``: the accelerators a step is priced on, each number with its source, and their links;
* ``costs``: what a step would take on a TPU or GPU (a roofline from the compiled program);
* ``report``: ``explain``, the plan, the collectives and the cost of a step, as one ``Report``;
* ``pipeline``: pipeline parallelism by hand (microbatches, GPipe, circular schedules);
* ``pipeline_1f1b``: its appendix, 1F1B by hand (a forward and a backward per tick);
* ``zero``: ZeRO by hand with ``shard_map``: the minimum bytes for data parallelism;
* ``context``: ring attention by hand (online softmax across devices, a backward ring, zig-zag);
* ``flash``: flash attention by hand, a Pallas kernel for a TPU (tiles in VMEM, the causal skip);
* ``sequence``: the sequence split by one collective each (all-gather, all-to-all, Megatron's);
* ``experts``: a mixture of experts, and expert parallelism by hand: two ``all_to_all``
  collectives per layer;
* ``remat``: recomputation: what each ``jax.checkpoint`` policy keeps for the backward pass, and the
  FLOPs it adds (model against hardware FLOPs: MFU and HFU);
* ``composition``: how one dimension runs inside another (a ``ComposedPipeline``'s stages over
  "data" and "context", an MoE's statistics out of the pipeline's tick loop; the ring's
  grouped-query attention, decoding over a split cache, its memory terms and report);
* ``precision``: mixed precision: a step's dtypes (``Precision``), fp16's dynamic loss scale
  (against ``jmp``'s), the cast before FSDP's all-gather, the dtype gradients are reduced in;
* ``memory``: will it fit? A step's bytes per device, term by term (parameters, gradients,
  optimizer state, master copy, activations), against the compiler's ``memory_analysis()`` and
  the published tables;
* ``serving``: the inference roofline: prefill and decode priced on any chip, the KV cache, latency
  against throughput;
* ``layouts``: which layout, at what size: every dp x fsdp x tp x pp split of N chips priced
  from a model's shapes (step, memory, where it turns compute-bound) and ranked, nothing
  compiled (the scaling book's LLaMA-3 walk-through).

Private modules hold what a reader may skip, each at its place in that order:
``_checks``, the guards of the first chapters and the checks every guard shares (first: it
imports nothing), and one guard module for each later topic, just before the first chapter it
guards (``_checks_costs``, ``_checks_pipeline``, ``_checks_context``, ``_checks_experts``,
``_checks_precision``); ``_diagnose``, what went wrong after ``jax.jit`` refused a call (just
before sharding); ``_hlo``, parsing XLA's text (just before the census).

Running it (``minishard.run``, the workshop: it uses the names above as any user would):
``data``, ``checkpoint``, ``train``, ``distributed``, ``launch``, ``render`` (the report as
a rich table, HTML or pictures) and ``cli`` (``minishard train``, ``explain``, ``launch``).

Models (``minishard.models``): ``vit``, a Vision Transformer whose heads and MLP split like
the MLP's; ``gpt``, a character-level GPT (nanoGPT's shape) with a KV cache; ``transformer``,
the blocks they share.

Tools (``minishard.testing``): strategies and assertions (numbers, placement, communication)
to property-test your own models' sharding.
"""

import os as _os
import signal as _signal
import sys as _sys


def _mask(how: int, signals: set[int]) -> set[int]:
    """``signal.pthread_sigmask``, which only POSIX has: elsewhere nothing is held."""
    mask = getattr(_signal, "pthread_sigmask", None)
    return set() if mask is None else set(mask(how, signals))


# A Ctrl-C that lands while JAX imports can be swallowed there (inside its gc callback), and a
# launcher would run on: SIGINT and SIGTERM wait until these imports are done, then arrive.
_held = _mask(_signal.SIG_BLOCK, {_signal.SIGINT, _signal.SIGTERM})

# libtpu (the ``tpu`` extra, which compiles for a TPU slice ahead of time) is opened by every JAX
# start to look for a chip; on a machine with none it prints five lines of warnings. Tell it first
# what it would find: no metadata server to ask, one host, any valid type, no lock on a chip.
from jax._src import hardware_utils as _hardware  # JAX's own answer to "is there a TPU chip?"

if _hardware.num_available_tpu_chips_and_device_id()[0] == 0:
    for _name, _value in {
        "TPU_SKIP_MDS_QUERY": "1",
        "TPU_WORKER_HOSTNAMES": "localhost",
        # a topology's own name decides the devices compiled for
        "TPU_ACCELERATOR_TYPE": "v5litepod-8",
        # every process here opens libtpu: test workers, a launch's ranks
        "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
    }.items():
        _os.environ.setdefault(_name, _value)

from minishard import tree
from minishard.census import collectives
from minishard.constraints import constrain
from minishard.layers import Layer, Linear, ReLU, Residual, Sequential, Swish, megatron_axes, mlp
from minishard.losses import accuracy, cross_entropy, one_hot
from minishard.optim import SGD, AdamW, AdamWState, SGDState, exponential_decay, warmup_cosine_decay
from minishard.report import Report, explain
from minishard.rules import AxisRules, LogicalAxes, ShardingError
from minishard.sharding import Sharded, make_mesh, partition_specs, plan, shard


def _started_as_the_command() -> bool:
    """``minishard ...``, ``python -m minishard ...`` or ``-m minishard.run.cli``: this process
    is the CLI (a launcher's ranks too)."""
    command = list(getattr(_sys, "orig_argv", []))
    module = command[command.index("-m") + 1] if "-m" in command[:-1] else None
    named = _os.path.basename(_sys.argv[0]) == "minishard"
    return named or module in ("minishard", "minishard.run.cli")


# A signal that came while the imports ran arrives now: the command stops as it does elsewhere,
# one line and 128 + signal (a library import raises KeyboardInterrupt, as Python does).
_pending = set(getattr(_signal, "sigpending", set)()) & {_signal.SIGINT, _signal.SIGTERM}
if _pending and _started_as_the_command():
    print("\ninterrupted: while minishard was importing; nothing ran", file=_sys.stderr)
    raise SystemExit(128 + min(_pending))
_mask(_signal.SIG_SETMASK, _held)

__all__ = [
    "SGD",
    "AdamW",
    "AdamWState",
    "AxisRules",
    "Layer",
    "Linear",
    "LogicalAxes",
    "ReLU",
    "Residual",
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
