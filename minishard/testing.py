"""Property-test your own sharded code: hypothesis strategies and one assertion.

Sharding must never change *what* a program computes, only *where*. That is a
property, so it is tested best with many random cases rather than a few
hand-picked ones: random meshes, random rules, random models, random batch
sizes, and every time the same check, ``assert_sharded_equivalent``: the
sharded run equals the plain ``jax.jit`` run, and every output is laid out as
``Sharded`` declared.

The strategies compose (each is a hypothesis ``@composite``): ``mlps`` takes
the drawn mesh and rules and draws only widths they can split evenly, and
``batch_sizes`` only batches the data axis can split::

    from hypothesis import given, strategies as st
    from minishard.testing import assert_sharded_equivalent, axis_rules, batch_sizes, meshes, mlps

    def forward(model, x):        # module level: jit caches it across examples
        return model(x)

    @given(st.data())
    def test_forward_is_sharding_invariant(data):
        mesh, rules = data.draw(meshes()), data.draw(axis_rules())
        model = data.draw(mlps(mesh, rules))
        x = jnp.ones((data.draw(batch_sizes(mesh, rules)), model[0].in_features))
        assert_sharded_equivalent(forward, model, x, mesh=mesh, rules=rules)

hypothesis is a development dependency (``pip install hypothesis``), so
``import minishard`` never imports this module; import it yourself.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

try:
    from hypothesis import strategies as st
except ImportError as error:  # only the tests need hypothesis, so minishard does not depend on it
    raise ImportError(
        "minishard.testing needs hypothesis, a development dependency: pip install hypothesis "
        "(or pip install 'minishard[dev]')"
    ) from error

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from minishard.layers import ACTIVATIONS, Sequential, mlp
from minishard.rules import AxisRules, LogicalAxes, MeshAxes, split_count
from minishard.sharding import Sharded, make_mesh
from minishard.tree import path_str

MESH_AXES = ("data", "model")

DEFAULT_CHOICES: Mapping[str, Sequence[MeshAxes]] = {
    "batch": ("data", None),
    "embed": (None,),
    "mlp": ("model", None, ("data", "model")),
}
"""What ``axis_rules()`` may map each logical name to: data, tensor and 2-D parallelism."""

LINEAR_AXES: Sequence[LogicalAxes] = (
    ("embed", "mlp"),
    ("mlp", "embed"),
    (None, "mlp"),
    ("mlp", None),
    (None, None),
)
"""Logical axes a Linear's weight may get in ``mlps``: both Megatron halves, one-sided, unannotated."""


@st.composite
def meshes(draw: st.DrawFn, shapes: Sequence[tuple[int, int]] | None = None) -> Mesh:
    """2-D meshes named ``("data", "model")`` over all devices.

    ``shapes`` defaults to every way of factoring the device count: on 8
    devices 1x8, 2x4, 4x2 and 8x1, i.e. pure tensor parallel to pure data
    parallel.
    """
    n = jax.device_count()
    shapes = shapes or [(d, n // d) for d in range(1, n + 1) if n % d == 0]
    return make_mesh(dict(zip(MESH_AXES, draw(st.sampled_from(shapes)))))


@st.composite
def axis_rules(
    draw: st.DrawFn, choices: Mapping[str, Sequence[MeshAxes]] | None = None, *, ordered: bool | None = None
) -> AxisRules:
    """Random ``AxisRules``, each logical name mapped to one of its ``choices``.

    The keyword form (``ordered=False``) maps each name to one target. The
    ordered form (``ordered=True``) gives each name one to three distinct
    targets and shuffles all the pairs, so later rules become fallbacks and
    names compete for mesh axes in a random order. ``None`` draws the form too.
    The keyword form raises ``ShardingError`` when two dimensions of one array
    get the same mesh axis, so the default ``choices`` never allow that.
    """
    choices = DEFAULT_CHOICES if choices is None else choices
    if not (draw(st.booleans()) if ordered is None else ordered):
        return AxisRules(**{name: draw(st.sampled_from(targets)) for name, targets in choices.items()})
    pairs = [
        (name, target)
        for name, targets in choices.items()
        for target in draw(st.lists(st.sampled_from(targets), min_size=1, max_size=3, unique=True))
    ]
    return AxisRules.from_pairs(draw(st.permutations(pairs)))


def _width_units(axes: Sequence[LogicalAxes], mesh: Mesh | None, rules: AxisRules | None) -> list[int]:
    """For the widths of Linears with these ``axes``: what each must be a multiple of."""
    if mesh is None or rules is None:
        return [1 if mesh is None else mesh.size] * (len(axes) + 1)
    units = [1] * (len(axes) + 1)
    for i, (axis_in, axis_out) in enumerate(axes):  # as Linear.param_axes: weight (in, out), bias (out,)
        weight, bias = rules.spec((axis_in, axis_out), mesh), rules.spec((axis_out,), mesh)
        units[i] = math.lcm(units[i], split_count(mesh, weight[0]))
        units[i + 1] = math.lcm(units[i + 1], split_count(mesh, weight[1]), split_count(mesh, bias[0]))
    return units


@st.composite
def mlps(
    draw: st.DrawFn,
    mesh: Mesh | None = None,
    rules: AxisRules | None = None,
    *,
    max_linears: int = 3,
    max_width: int = 32,
    scale: float = 0.25,
) -> Sequential:
    """Random ``minishard.mlp`` models whose every width ``rules`` can split on ``mesh``.

    One to ``max_linears`` Linears, with either the Megatron pattern
    ``("embed", "mlp"), ("mlp", "embed"), ...`` or axes drawn per layer from
    ``LINEAR_AXES``. Each width is a multiple (up to ``max_width``) of the
    number of blocks ``rules`` split it into on ``mesh``; without ``rules``, a
    multiple of ``mesh.size`` (safe under any rules); without ``mesh``, any
    width. Parameters are normal with standard deviation ``scale``, drawn from
    a seeded numpy generator; the default keeps activations of order one, so
    comparisons with an absolute tolerance stay meaningful.
    """
    n_linear = draw(st.integers(1, max_linears))
    if draw(st.booleans()):
        axes = [(("embed", "mlp"), ("mlp", "embed"))[i % 2] for i in range(n_linear)]
    else:
        axes = draw(st.lists(st.sampled_from(LINEAR_AXES), min_size=n_linear, max_size=n_linear))
    units = _width_units(axes, mesh, rules)
    sizes = [unit * draw(st.integers(1, max(1, max_width // unit))) for unit in units]
    activation = draw(st.sampled_from(sorted(ACTIVATIONS)))
    # jax.eval_shape builds the model without computing (or compiling) anything; numpy then draws
    # the parameters. jax.random would compile small programs for every new shape: seconds per model.
    shapes = jax.eval_shape(lambda: mlp(sizes, key=jax.random.key(0), activation=activation, axes=axes))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return jax.tree.map(lambda leaf: (scale * rng.standard_normal(leaf.shape)).astype(leaf.dtype), shapes)


def batch_sizes(
    mesh: Mesh, rules: AxisRules | None = None, batch_axis: str = "batch", max_multiple: int = 4
) -> st.SearchStrategy[int]:
    """Batch sizes that ``Sharded(mesh, rules, batch_axis)`` can split evenly."""
    unit = split_count(mesh, Sharded(mesh, rules, batch_axis).batch_sharding.spec[0])
    return st.integers(1, max_multiple).map(lambda k: k * unit)


def assert_sharded_equivalent(
    fn: Callable[..., Any],
    *args: Any,
    mesh: Mesh,
    rules: AxisRules | None = None,
    batch_axis: str = "batch",
    rtol: float = 1e-5,
    atol: float = 1e-6,
) -> Any:
    """Run ``fn`` unsharded and sharded; outputs must agree and be laid out as declared.

    The reference is ``jax.jit(fn)`` on one device; the other run is
    ``Sharded(mesh, rules, batch_axis)(fn)``. Every output leaf must match
    (``numpy.testing.assert_allclose``, the message names the leaf's path) and
    every leaf whose spec ``ShardedFunction.specs`` declares (Layer parameters,
    scalars) must carry that sharding; leaves it leaves to XLA are not checked.
    Returns the sharded outputs. Define ``fn`` once, at module level: jit
    caches compiled code per function, so a new lambda per call recompiles.

    >>> import jax, jax.numpy as jnp
    >>> from minishard import AxisRules, make_mesh, mlp
    >>> model = mlp([8, 16, 4], key=jax.random.key(0), axes=[("embed", "mlp"), ("mlp", "embed")])
    >>> rules = AxisRules(batch="data", embed=None, mlp="model")
    >>> mesh = make_mesh({"data": 2, "model": 4})
    >>> def forward(model, x):
    ...     return model(x)
    >>> assert_sharded_equivalent(forward, model, jnp.ones((4, 8)), mesh=mesh, rules=rules).shape
    (4, 4)
    """
    sharded = Sharded(mesh, rules, batch_axis)(fn)
    declared = sharded.specs(*args).outputs
    # jax.block_until_ready after each run: dispatching sharded programs back to
    # back can deadlock the collectives of simulated CPU devices.
    expected = jax.block_until_ready(jax.jit(fn)(*jax.device_put(args, mesh.devices.flat[0])))
    actual = jax.block_until_ready(sharded(*args))
    treedef: Any = jax.tree_util.tree_structure(actual)  # Any: PyTreeDef comes without type stubs
    specs = treedef.flatten_up_to(declared)  # None where Sharded left the layout to XLA
    leaves = zip(jax.tree_util.tree_leaves_with_path(actual), jax.tree_util.tree_leaves(expected), specs)
    for (path, got), want, spec in leaves:
        where = f"output {path_str(path)}"
        np.testing.assert_allclose(got, want, rtol, atol, err_msg=f"{where}: sharded != unsharded")
        if spec is not None and not NamedSharding(mesh, spec).is_equivalent_to(got.sharding, got.ndim):
            raise AssertionError(f"{where}: has sharding {got.sharding}, but Sharded declared {spec}")
    return actual


__all__ = [
    "DEFAULT_CHOICES",
    "LINEAR_AXES",
    "assert_sharded_equivalent",
    "axis_rules",
    "batch_sizes",
    "meshes",
    "mlps",
]
