"""Property-test the sharding of your own models: strategies, four assertions, a profile.

Sharding a program promises three things, and each has its assertion:

* **numbers**, ``assert_sharded_equivalent``: the sharded run computes what the
  plain ``jax.jit`` run computes;
* **placement**, ``assert_placement``: every array is split the way *you* say it must
  be, read from the placed arrays themselves;
* **communication**, ``assert_collectives``: the compiled program sends no more
  than a budget of ``Limit``\\ s (no all-gather, bytes over "model", ...).

The first cannot see a wrong annotation: sharding never changes the numbers, so
a model with its two Megatron halves swapped computes exactly the same thing,
only slower. The second and third can, because they compare with what you
intended rather than with what the library derived from the same annotations.
And none of them tests anything where nothing is split: ``assert_split`` says
that something is, and ``assert_sharded_equivalent`` asks first that the model's
parameters are (or the logical axes you name: ``require_split="batch"``).

These are properties, so they are tested best on many random cases, drawn by
hypothesis strategies that keep the number of compiled programs small.

* ``strategies.py``: ``meshes``, ``axis_rules``, the widths they can split
  (``split_counts``, ``width_units``, ``splittable_widths``), ``batches``, ``seeds``;
* ``builders.py``: ``models`` from your own builder, and ``mlps``;
* ``assertions.py``: ``assert_sharded_equivalent``, ``assert_split``;
* ``placement.py``: ``assert_placement`` and the ``ExpectedPlacement`` it states;
* ``budgets.py``: ``Limit``, ``assert_collectives``, ``data_parallel_limits``, ``megatron_limits``;
* ``profiles.py``: the ``"minishard"`` hypothesis profiles (``register_profiles``);
* ``pipelines.py``: ``pipelines`` that fit a stacked model, ``assert_pipeline_equivalent``
  (pipelined == sequential, forward and gradients; ``rules=`` for tp inside pp; a leaking
  bubble is named);
* ``attention.py``: ``split_sequences`` (meshes, chunk orders, shapes), ``assert_attention_equivalent``
  (a context-parallel attention == attention on one device; the first wrong token is named);
* ``compositions.py``: ``compositions``, composed meshes (``Composition``: which dimensions of
  ``minishard.styles``, how many devices each, the composed rules) a model of given widths takes;
* ``experts.py``: ``moes``, ``expert_parallels``, ``moe_reference`` (a mixture of experts as a
  loop over tokens) and ``assert_moe_equivalent`` (by hand over a mesh == one device);
* ``precision.py``: ``step_tolerance`` (a precision policy's tolerance, from its compute dtype's
  epsilon and the replicas' sum) and ``assert_close_in`` (two runs of a step, leaf by leaf).

hypothesis is a development dependency (``pip install hypothesis``), so
``import minishard`` never imports this package; import it yourself.
docs/testing.md is the guide, built on a worked example.
"""

try:
    import hypothesis  # noqa: F401
except ImportError as error:  # only the tests need hypothesis, so minishard does not depend on it
    raise ImportError(
        "minishard.testing needs hypothesis, a development dependency: pip install hypothesis "
        "(or pip install 'minishard[dev]')"
    ) from error

from minishard.testing.assertions import assert_sharded_equivalent, assert_split
from minishard.testing.attention import SplitSequence, assert_attention_equivalent, split_sequences
from minishard.testing.budgets import Limit, assert_collectives, data_parallel_limits, megatron_limits
from minishard.testing.builders import LINEAR_AXES, mlps, models
from minishard.testing.compositions import ANNOTATED, Composition, compositions
from minishard.testing.experts import assert_moe_equivalent, expert_parallels, moe_reference, moes
from minishard.testing.pipelines import assert_pipeline_equivalent, pipelines
from minishard.testing.placement import ExpectedPlacement, assert_placement
from minishard.testing.precision import ROUNDINGS, assert_close_in, step_tolerance
from minishard.testing.profiles import register_profiles
from minishard.testing.strategies import (
    DEFAULT_CHOICES,
    MULTIPLES,
    axis_rules,
    batch_sizes,
    batches,
    meshes,
    seeds,
    split_counts,
    splittable_widths,
    width_units,
)

register_profiles()

__all__ = [
    "ANNOTATED",
    "DEFAULT_CHOICES",
    "LINEAR_AXES",
    "MULTIPLES",
    "ROUNDINGS",
    "Composition",
    "ExpectedPlacement",
    "Limit",
    "SplitSequence",
    "assert_attention_equivalent",
    "assert_close_in",
    "assert_collectives",
    "assert_placement",
    "assert_moe_equivalent",
    "assert_pipeline_equivalent",
    "assert_sharded_equivalent",
    "assert_split",
    "axis_rules",
    "batch_sizes",
    "batches",
    "compositions",
    "data_parallel_limits",
    "expert_parallels",
    "megatron_limits",
    "meshes",
    "mlps",
    "models",
    "moe_reference",
    "moes",
    "register_profiles",
    "pipelines",
    "seeds",
    "split_sequences",
    "split_counts",
    "splittable_widths",
    "step_tolerance",
    "width_units",
]
