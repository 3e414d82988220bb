"""The guards of the textbook modules: what each one checks, and the words it says.

A reader may skip this file. Each guard is one line where it is used
(``_checks.linear(in_features, out_features, ...)`` in ``Linear.__init__``), so the
module it guards reads like the idea; the conditions and the messages stand here.
Every message names what was wrong and where (argument, field, leaf path, axis),
and says how to fix it. Guards run before any work, and never on a Layer's
flatten path; under ``jit`` they run while tracing only (shapes, dtypes and
pytree structure are static), so they cost nothing per step.

Sections follow the reading order of the modules they guard. This module
imports ``tree`` (for ``path_str``) and ``rules`` (for ``ShardingError``), which
import it in turn: it only reads them when a guard runs, after all are loaded.
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from minishard import rules, tree

if TYPE_CHECKING:
    from minishard.layers import Layer, Linear
    from minishard.optim import SGD, SGDState


# -- tree ----------------------------------------------------------------------------------------
def leaves_with_path(where: str, pytree: Any) -> list[tuple[Any, Any]]:
    """``jax.tree_util.tree_leaves_with_path``; a dict whose keys cannot be sorted is named."""
    try:
        return jax.tree_util.tree_leaves_with_path(pytree)
    except ValueError:  # JAX visits a dict in sorted key order, and says only "Comparator raised ..."
        if (found := _unsortable_dict(pytree)) is None:
            raise
        path, keys = found
        raise TypeError(
            f"{where}: the dict at {tree.path_str(path)} has keys of different types ({keys!r:.100}), "
            "which cannot be sorted, and JAX flattens a dict in sorted key order; use keys of one type "
            "(all str, for example)"
        ) from None


def _unsortable_dict(pytree: Any) -> tuple[Any, list[Any]] | None:
    """The path and keys of the first dict JAX would sort but cannot; None if there is none."""

    def unsortable(node: Any) -> bool:
        if type(node) not in (dict, defaultdict):  # the dicts JAX sorts (an OrderedDict keeps its order)
            return False
        try:
            sorted(node)
        except TypeError:
            return True
        return False

    try:
        nodes = jax.tree_util.tree_leaves_with_path(pytree, is_leaf=unsortable)
    except ValueError:  # the flatten fails for another reason: JAX's own error says it
        return None
    return next(((path, list(node)) for path, node in nodes if unsortable(node)), None)


def array_leaves(where: str, pytree: Any) -> list[Any]:
    """The leaves, each checked to be an array (or an abstract one, from ``jax.eval_shape``)."""
    leaves = []
    for path, leaf in leaves_with_path(where, pytree):
        if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
            raise TypeError(
                f"{where}: leaf {tree.path_str(path)} is a {type(leaf).__name__} ({leaf!r:.40}), not an array"
            )
        leaves.append(leaf)
    return leaves


# -- rules ---------------------------------------------------------------------------------------
def rule_pairs(pairs: Any) -> tuple[tuple[str, rules.MeshAxes], ...]:
    """``AxisRules.from_pairs``'s argument as a tuple of pairs, or an error saying what it must be."""
    try:
        return tuple((name, target) for name, target in pairs)
    except (TypeError, ValueError):
        raise rules.ShardingError(
            f"AxisRules.from_pairs: expected (logical axis, mesh axes) pairs, got {pairs!r:.200}"
        ) from None


def rule(name: Any, target: Any) -> None:
    """One rule: a logical axis name -> a mesh axis, a tuple of distinct ones, or None."""
    names_mesh_axes = (
        target is None
        or isinstance(target, str)
        or (isinstance(target, tuple | list) and all(isinstance(a, str) for a in target))
    )
    if not isinstance(name, str) or not names_mesh_axes:
        raise rules.ShardingError(
            f"AxisRules: rule {name!r} -> {target!r} must map a logical axis (str) to a "
            "mesh axis name, a tuple of them, or None"
        )
    axes = rules.as_mesh_axes(target)
    if len(set(axes)) < len(axes):
        raise rules.ShardingError(
            f"AxisRules: rule {name!r} -> {target!r} names a mesh axis twice; an array "
            "dimension can be split over each mesh axis only once"
        )


def rule_on_mesh(name: str, target: rules.MeshAxes, mesh: rules.AnyMesh) -> None:
    for axis in rules.as_mesh_axes(target):
        if axis not in mesh.axis_names:
            raise rules.ShardingError(
                f"rule {name!r} -> {target!r} names mesh axis {axis!r}, but the mesh has "
                f"axes {mesh.axis_names}; fix the rule or the mesh"
            )


def logical_axes(value: Any) -> rules.LogicalAxes:
    """A tuple of str-or-None, each name used once; a bare string is a common slip."""
    if isinstance(value, str) or not isinstance(value, Sequence):
        hint = " (one string: did you mean a tuple?)" if isinstance(value, str) else ""
        raise rules.ShardingError(
            f"logical_axes must be a tuple with one name (or None) per dimension, got {value!r}"
            f"{hint}; for one dimension write ({value!r},)"
        )
    axes = tuple(value)
    if bad := [a for a in axes if a is not None and not isinstance(a, str)]:
        raise rules.ShardingError(f"logical axes {axes}: {bad} are not names (str) or None")
    names = [a for a in axes if a is not None]
    if twice := sorted({a for a in names if names.count(a) > 1}):
        raise rules.ShardingError(f"logical axes {axes}: {twice} name more than one dimension")
    return axes


def every_name_has_a_rule(
    axis_rules: rules.AxisRules, axes: rules.LogicalAxes, mesh: rules.AnyMesh | None
) -> None:
    """A logical axis needs a rule, unless it is itself the name of an axis of ``mesh``."""
    for name in axes:
        if name is None or name in axis_rules or (mesh is not None and name in mesh.axis_names):
            continue
        known = sorted({n for n, _ in axis_rules.pairs})
        where = "" if mesh is None else f" nor a mesh axis {mesh.axis_names}"
        raise rules.ShardingError(
            f"logical axis {name!r} (in {axes}) has no rule{where}; add one, e.g. "
            f"AxisRules({name}='model') or AxisRules({name}=None) to replicate. "
            f"Rules exist for {known}"
        )


def winners_on_mesh(attempts: Sequence[rules.Attempt], mesh: rules.AnyMesh | None) -> None:
    """The rules that decided a dimension name only axes ``mesh`` has."""
    for attempt in attempts:
        if mesh is not None and attempt.won:
            rule_on_mesh(attempt.name, attempt.target, mesh)


def every_dimension_decided(axes: rules.LogicalAxes, attempts: Sequence[rules.Attempt]) -> None:
    """Keyword rules are strict: a dimension whose one rule was blocked is an error, not replicated."""
    won = {attempt.dim for attempt in attempts if attempt.won}
    for dim, name in enumerate(axes):
        if name is not None and dim not in won:
            last = [attempt for attempt in attempts if attempt.dim == dim][-1]
            raise rules.ShardingError(
                f"logical axes {axes}: dimension {dim} ({name!r}) maps to a mesh axis that "
                f"another dimension already uses ({last}); a mesh axis can split an "
                "array only once. Give a fallback with an ordered list, e.g. "
                f"AxisRules.from_pairs([..., ({name!r}, None)])"
            )


# -- layers --------------------------------------------------------------------------------------
ARRAY_TYPES = (jax.Array, np.ndarray, np.number, np.bool_)  # what jit accepts as a leaf


def field_lists(cls: type[Layer]) -> None:
    """``param_fields``/``static_fields``: tuples of names, no name in both."""
    for kind in ("param_fields", "static_fields"):
        names = getattr(cls, kind)
        if not isinstance(names, tuple) or not all(isinstance(n, str) for n in names):
            raise TypeError(
                f"{cls.__name__}.{kind} must be a tuple of field names, got {names!r}"
                + (f"; for one field write ({names!r},)" if isinstance(names, str) else "")
            )
    if both := sorted(set(cls.param_fields) & set(cls.static_fields)):
        raise TypeError(f"{cls.__name__}: {both} listed in both param_fields and static_fields; choose one")


def not_frozen(layer: Layer, name: str, building: str) -> None:
    """Assignments are for ``__init__`` (while ``building`` is in the layer's ``__dict__``)."""
    if building not in layer.__dict__:
        raise AttributeError(
            f"cannot assign {type(layer).__name__}.{name}: a built Layer is immutable (jit would not "
            f"see the change). Make a changed copy: layer.replace({name}=...), or "
            "jax.tree_util.tree_map for every array"
        )


def field(cls: type[Layer], name: str, value: Any) -> None:
    """A declared field: a parameter holds arrays, static data is hashable and holds none."""
    where = f"{cls.__name__}.{name}"
    if name in cls.param_fields:
        _param(where, value)
    elif name in cls.static_fields:
        _static(where, value)
    else:
        raise AttributeError(
            f"{where} is neither in param_fields {cls.param_fields} nor in "
            f"static_fields {cls.static_fields}; declare it there, or "
            "tree_unflatten (used by jit, grad and vmap) would drop it"
        )


def _param(where: str, value: Any) -> None:
    for path, leaf in jax.tree_util.tree_leaves_with_path(value):
        if not isinstance(leaf, ARRAY_TYPES):
            at = tree.path_str(path, root=where)
            if callable(leaf):
                raise TypeError(
                    f"{at} is the function {getattr(leaf, '__name__', leaf)!r}; a function cannot be a "
                    "pytree leaf under jit. Wrap it in a parameter-free Layer, such as ReLU() or Swish()"
                )
            raise TypeError(
                f"parameter {at} is a {type(leaf).__name__} ({leaf!r:.40}); parameters "
                "must be arrays (wrap it in jnp.asarray), or list it in static_fields "
                "if it is configuration"
            )


def _static(where: str, value: Any) -> None:
    for path, leaf in jax.tree_util.tree_leaves_with_path(value):
        if isinstance(leaf, ARRAY_TYPES):
            raise TypeError(
                f"static field {tree.path_str(path, root=where)} holds an array of shape "
                f"{leaf.shape}; static data is hashed into jit's cache key, so an array "
                "there recompiles on every new value. Make it a parameter (param_fields)."
            )
        if isinstance(leaf, float) and math.isnan(leaf):
            raise ValueError(
                f"static field {tree.path_str(path, root=where)} is NaN; NaN != NaN, so jit's "
                "cache would never find its compiled code and recompile on every call"
            )
    try:
        hash(value)
    except TypeError:
        raise TypeError(
            f"static field {where} = {value!r:.60} is not hashable; jit hashes static "
            "data to find compiled code. Use a tuple instead of a list, for example."
        ) from None


def all_fields_set(layer: Layer) -> None:
    if missing := [n for n in (*layer.param_fields, *layer.static_fields) if n not in layer.__dict__]:
        raise TypeError(
            f"{type(layer).__name__}.__init__ never set {missing}; every field in param_fields "
            "and static_fields must be assigned (use None for an absent parameter)"
        )


def check_key(where: str, key: Any) -> None:
    """A PRNG key: ``jax.random.key(seed)`` (typed) or the older ``PRNGKey(seed)`` (uint32[2])."""
    dtype = getattr(key, "dtype", None)
    typed = dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)
    if not typed and not (dtype == jnp.uint32 and getattr(key, "shape", None) == (2,)):
        raise TypeError(f"{where}: key must be a PRNG key such as jax.random.key(0), got {key!r:.60}")


def check_input(where: str, x: Any) -> None:
    """Models take arrays; a list or a string would be turned into one in surprising ways."""
    if not isinstance(x, ARRAY_TYPES):
        raise TypeError(f"{where} takes an array (jax or numpy), got a {type(x).__name__}: {x!r:.60}")


def layer_axes(where: str, axes: Any, ndim: int) -> None:
    """``ndim`` logical axes, each a str or None, in a tuple (a bare string is a common slip)."""
    if isinstance(axes, str) or not isinstance(axes, Sequence):
        raise TypeError(
            f"{where} must be a tuple of {ndim} logical axes (str or None), got {axes!r}"
            + (f"; did you mean ({axes!r}, ...)?" if isinstance(axes, str) else "")
        )
    if len(axes) != ndim or not all(a is None or isinstance(a, str) for a in axes):
        raise TypeError(f"{where} must be a tuple of {ndim} logical axes (str or None), got {tuple(axes)!r}")


def _size(where: str, size: Any) -> None:
    if isinstance(size, bool) or not isinstance(size, int | np.integer) or size < 1:
        raise ValueError(f"{where} must be a positive int, got {size!r}")


def linear(in_features: Any, out_features: Any, *, scale: Any, key: Any, axes: Any) -> None:
    """``Linear``'s arguments, all before any weight is drawn."""
    _size("Linear: in_features", in_features)
    _size("Linear: out_features", out_features)
    number = not isinstance(scale, bool) and isinstance(scale, int | float | np.floating)
    if not number or not math.isfinite(scale):
        raise TypeError(f"Linear: scale must be a finite number, got {scale!r}")
    check_key("Linear", key)
    layer_axes("Linear: axes", axes, ndim=2)


def linear_fields(layer: Linear) -> None:
    """A built ``Linear`` (or a ``replace``d one): the fields fit together."""
    _size("Linear.in_features", layer.in_features)
    _size("Linear.out_features", layer.out_features)
    layer_axes("Linear.logical_axes", layer.logical_axes, ndim=2)
    for name, shape in (("weight", (layer.in_features, layer.out_features)), ("bias", (layer.out_features,))):
        got = getattr(layer.__dict__[name], "shape", None)
        if got != shape and not (name == "bias" and layer.bias is None):
            raise ValueError(
                f"Linear.{name} has shape {got}, but a Linear({layer.in_features} -> "
                f"{layer.out_features}) needs {shape}; change the sizes with it, or build a new Linear"
            )


def linear_call(layer: Linear, x: Any) -> None:
    """An array whose last dimension is ``in_features``, into a Linear whose arrays still exist."""
    where = f"Linear({layer.in_features} -> {layer.out_features})"
    check_input(where, x)
    if jnp.ndim(x) == 0 or jnp.shape(x)[-1] != layer.in_features:
        raise ValueError(
            f"{where} expects inputs whose last dimension is {layer.in_features}, got shape {jnp.shape(x)}"
        )
    not_donated(where, layer)


def not_donated(where: str, layer: Layer) -> None:
    """A parameter deleted by ``donate_argnums``; checked on concrete arrays only (a tracer has no buffer)."""
    for name in layer.param_fields:
        value = layer.__dict__[name]
        if isinstance(value, jax.Array) and not isinstance(value, jax.core.Tracer) and value.is_deleted():
            raise RuntimeError(
                f"{where}.{name} was deleted: this model was donated to a jitted function "
                "(donate_argnums), which reused its arrays' memory for its outputs. Call the model "
                "that function returned, or do not donate this one"
            )


def mlp(sizes: Any, *, key: Any, activation: str, activations: Sequence[str], axes: Any) -> None:
    """``mlp``'s arguments: a list of sizes, a known activation, a key, one axes pair per Linear."""
    if isinstance(sizes, str) or not isinstance(sizes, Sequence):
        raise TypeError(f"mlp: sizes must be a list of ints such as [784, 512, 10], got {sizes!r}")
    if len(sizes) < 2:
        raise ValueError(f"mlp needs at least two sizes (inputs and outputs), got {list(sizes)}")
    if activation not in activations:
        raise ValueError(f"mlp: unknown activation {activation!r}; choose from {sorted(activations)}")
    check_key("mlp", key)
    if axes is None:
        return
    if isinstance(axes, str) or not isinstance(axes, Sequence) or any(_not_a_pair(a) for a in axes):
        raise TypeError(
            f"mlp: axes must be a list with one (in, out) pair of logical axes per Linear, got {axes!r}; "
            "did you mean a list of tuples, such as [('embed', 'mlp'), ('mlp', 'classes')]?"
        )
    n_linear = len(sizes) - 1
    if len(axes) != n_linear:
        raise ValueError(f"mlp: {n_linear} Linear layers need {n_linear} axes pairs, got {len(axes)}")


def _not_a_pair(entry: Any) -> bool:
    return entry is None or isinstance(entry, str)  # a logical axis where a pair of them belongs


def num_linear(value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"megatron_axes: an MLP has at least one Linear, got num_linear={value!r}")


# -- losses --------------------------------------------------------------------------------------
def one_hot(labels: jax.Array, num_classes: Any) -> None:
    if isinstance(num_classes, bool) or not isinstance(num_classes, int | np.integer) or num_classes < 1:
        raise ValueError(f"one_hot: num_classes must be an int >= 1, got {num_classes!r}")
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise TypeError(f"one_hot: labels must be integers (class indices), got dtype {labels.dtype}")


def cross_entropy(logits: jax.Array, targets_onehot: jax.Array) -> None:
    if jnp.shape(logits) != jnp.shape(targets_onehot) or jnp.ndim(logits) == 0:
        raise ValueError(
            f"cross_entropy: logits {jnp.shape(logits)} and one-hot targets {jnp.shape(targets_onehot)} "
            "must have the same shape [..., classes]; turn labels into targets with one_hot(labels, classes)"
        )


def accuracy(logits: jax.Array, labels: jax.Array, mask: jax.Array | None) -> None:
    rows = jnp.shape(logits)[:-1]
    if jnp.ndim(logits) == 0 or jnp.shape(labels) != rows:
        raise ValueError(f"accuracy: labels {jnp.shape(labels)} must have the shape {rows} of logits[..., 0]")
    if mask is not None and jnp.shape(mask) != rows:
        raise ValueError(f"accuracy: mask {jnp.shape(mask)} must have the shape {rows} of the labels")


# -- optim ---------------------------------------------------------------------------------------
def positive(where: str, value: Any) -> float:
    """A finite number > 0, or an error naming the argument: a negative rate would ascend."""
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(f"{where} must be a finite number > 0, got {value!r}")
    return float(value)


def decay_steps(value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"exponential_decay: decay_steps must be a positive int, got {value!r}")


def warmup_cosine(warmup_steps: Any, decay_steps: Any) -> None:
    for name, steps in (("warmup_steps", warmup_steps), ("decay_steps", decay_steps)):
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"warmup_cosine_decay: {name} must be an int >= 0, got {steps!r}")
    if decay_steps <= warmup_steps:
        raise ValueError(
            f"warmup_cosine_decay: decay_steps {decay_steps} must exceed warmup_steps {warmup_steps}"
        )


def learning_rate(value: Any) -> float | Callable[[jax.Array], jax.Array]:
    """A number > 0, or a schedule: a callable of one argument, the step."""
    if not callable(value):
        return positive("SGD: learning_rate (a number, or a callable of the step)", value)
    try:
        signature = inspect.signature(value)
    except (TypeError, ValueError):  # some builtins have none: nothing to check
        return cast(Callable[[jax.Array], jax.Array], value)
    try:
        signature.bind(0)
    except TypeError:
        raise TypeError(
            f"SGD: learning_rate is a callable of {signature}, but a schedule is called with one "
            "argument, the step; write lambda step: ..., or use exponential_decay"
        ) from None
    return cast(Callable[[jax.Array], jax.Array], value)


def momentum(value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 <= float(value) < 1.0:
        raise ValueError(f"SGD: momentum must be a number in [0, 1), got {value!r}")


def sgd_update(sgd: SGD, params: Any, grads: Any, state: SGDState) -> None:
    """The state was made by this SGD's ``init``, and the gradients mirror the parameters."""
    fix = "make the state with the same SGD's init"
    if callable(sgd.learning_rate) and state.step is None:
        raise ValueError(
            f"SGD.update: this SGD's learning rate is a schedule, but the state has no step; {fix}"
        )
    if not callable(sgd.learning_rate) and state.step is not None:
        raise ValueError(
            "SGD.update: this SGD's learning rate is a constant, but the state has a step (it was made "
            f"for a schedule); {fix}"
        )
    if sgd.momentum and state.velocity is None:
        raise ValueError(
            f"SGD.update: this SGD has momentum {sgd.momentum}, but the state has no velocity; {fix}"
        )
    if not sgd.momentum and state.velocity is not None:
        raise ValueError(f"SGD.update: this SGD has no momentum, but the state has a velocity; {fix}")
    _same_structure(params, grads)


def _same_structure(params: Any, grads: Any) -> None:
    """Gradients must mirror the parameters; name the first place where they do not."""
    p_leaves, p_def = jax.tree_util.tree_flatten_with_path(params)
    g_leaves, g_def = jax.tree_util.tree_flatten_with_path(grads)
    p_def, g_def = cast(Any, p_def), cast(Any, g_def)  # PyTreeDef comes without type stubs
    if p_def == g_def and all(jnp.shape(p) == jnp.shape(g) for (_, p), (_, g) in zip(p_leaves, g_leaves)):
        return
    for (p_path, p), (g_path, g) in zip(p_leaves, g_leaves):
        if p_path != g_path or jnp.shape(p) != jnp.shape(g):
            raise ValueError(
                f"SGD.update: grads do not match params at {tree.path_str(p_path, root='params')} "
                f"(shape {jnp.shape(p)}): grads has {tree.path_str(g_path, root='grads')} "
                f"with shape {jnp.shape(g)}"
            )
    raise ValueError(
        f"SGD.update: grads have {len(g_leaves)} arrays, params {len(p_leaves)} (or other containers); "
        "compute grads with jax.grad with respect to the same params"
    )
