"""The guards of the textbook modules: what each one checks, and the words it says.

A reader may skip this file. Each guard is one statement where it is used
(``_checks.linear(in_features, out_features, ...)`` in ``Linear.__init__``), so the
module it guards reads like the idea; the conditions and the messages stand here.
A guard raises or returns None: what the happy path computes stays in the textbook.
Every message names what was wrong and where (argument, field, leaf path, axis),
and says how to fix it. Guards run before any work, and never on a Layer's
flatten path; under ``jit`` they run while tracing only (shapes, dtypes and
pytree structure are static), so they cost nothing per step.

This module imports nothing from minishard, so every module may use it: it takes
plain values, and where it names a leaf of a tree it is handed the one namer,
``minishard.tree.path_str``. ``ShardingError`` is defined here, under it, and
``minishard.rules`` (and ``minishard``) export it. Sections follow the reading order.
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

Namer = Callable[..., str]
"""``minishard.tree.path_str``: ``(key path, root="") -> "layers[0].weight"``, handed in by the caller."""


class ShardingError(ValueError):
    """A sharding request that cannot work; the message names what and where, and how to fix it.

    Its fields, for a program to read rather than parse the message: ``why`` (what and where)
    and ``fix`` (how to fix it, when one is said apart): the message is ``"<why>; <fix>"``.
    """

    __module__ = "minishard.rules"  # where users meet it (and where pickle finds it)

    def __init__(self, why: str, fix: str = "") -> None:
        super().__init__(f"{why}; {fix}" if fix else why)
        self.why, self.fix = why, fix

    def retold(self, reword: Callable[[str], str]) -> ShardingError:
        """The same error, its ``why`` reworded (to name where it happened), its ``fix`` kept."""
        return ShardingError(reword(self.why), self.fix)


# -- the shared checks ---------------------------------------------------------------------------
def count(where: str, value: Any, minimum: int = 1) -> None:
    """An int (a numpy one too, never a bool) of at least ``minimum``: a size, a count, steps."""
    if not _is_count(value, minimum):
        kind = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ValueError(f"{where} must be {kind}, got {value!r}")


def _is_count(value: Any, minimum: int = 1) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | np.integer) and bool(value >= minimum)


def logical_axes(where: str, axes: Any, shape: tuple[int, ...] | None = None) -> None:
    """Logical axes: a tuple of names (str) or None, one per dimension of ``shape`` (when given).

    A bare string is the common slip: ``"embed"`` where ``("embed",)`` was meant.
    """
    at = f"{where}: " if where else ""
    if isinstance(axes, str) or not isinstance(axes, Sequence):
        hint = f" (one string: did you mean a tuple?); for one dimension write ({axes!r},)"
        if shape is not None and len(shape) != 1:
            hint = f" (one string: did you mean a tuple?); for {len(shape)} dimensions write ({axes!r}, ...)"
        raise ShardingError(
            f"{at}logical axes must be a tuple with one name (or None) per dimension, got {axes!r}"
            + (hint if isinstance(axes, str) else "")
        )
    axes = tuple(axes)
    if bad := [a for a in axes if a is not None and not isinstance(a, str)]:
        raise ShardingError(f"{at}logical axes {axes}: {bad} are not names (str) or None")
    if shape is not None and len(axes) != len(shape):
        raise ShardingError(f"{at}logical axes {axes} name {len(axes)} dims; its shape is {shape}")


def _mesh_axes(entry: Any) -> tuple[str, ...]:
    """A rule's target or a spec entry as mesh axis names, as ``rules.as_mesh_axes`` reads it."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


# -- tree ----------------------------------------------------------------------------------------
def sortable_dicts(where: str, pytree: Any, name: Namer) -> None:
    """After JAX failed to flatten ``pytree``: name a dict whose keys cannot be sorted, if there is one."""
    if (found := _unsortable_dict(pytree)) is None:
        return  # another failure: JAX's own error says it
    path, keys = found
    raise TypeError(
        f"{where}: the dict at {name(path)} has keys of different types ({keys!r:.100}), "
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


def arrays(where: str, leaves: Sequence[tuple[Any, Any]], name: Namer) -> None:
    """Each ``(path, leaf)`` holds an array (or an abstract one, from ``jax.eval_shape``)."""
    for path, leaf in leaves:
        if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
            kind = type(leaf).__name__
            raise TypeError(f"{where}: leaf {name(path)} is a {kind} ({leaf!r:.40}), not an array")


# -- rules ---------------------------------------------------------------------------------------
def rule_pairs(pairs: Any) -> NoReturn:
    """``AxisRules.from_pairs``'s argument did not unpack into pairs: say what it must be."""
    raise ShardingError(
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
        raise ShardingError(
            f"AxisRules: rule {name!r} -> {target!r} must map a logical axis (str) to a "
            "mesh axis name, a tuple of them, or None"
        )
    if len(set(_mesh_axes(target))) < len(_mesh_axes(target)):
        raise ShardingError(
            f"AxisRules: rule {name!r} -> {target!r} names a mesh axis twice; an array "
            "dimension can be split over each mesh axis only once"
        )


def rule_on_mesh(name: str, target: Any, mesh: Any) -> None:
    for axis in _mesh_axes(target):
        if axis not in mesh.axis_names:
            raise ShardingError(
                f"rule {name!r} -> {target!r} names mesh axis {axis!r}, but the mesh has "
                f"axes {mesh.axis_names}; fix the rule or the mesh"
            )


def each_name_once(axes: tuple[str | None, ...]) -> None:
    """A logical axis names one dimension of an array: the rules would not know which to split."""
    names = [a for a in axes if a is not None]
    if twice := sorted({a for a in names if names.count(a) > 1}):
        raise ShardingError(f"logical axes {axes}: {twice} name more than one dimension")


def every_name_has_a_rule(axis_rules: Any, axes: tuple[str | None, ...], mesh: Any) -> None:
    """A logical axis needs a rule, unless it is itself the name of an axis of ``mesh``."""
    for name in axes:
        if name is None or name in axis_rules or (mesh is not None and name in mesh.axis_names):
            continue
        known = sorted({n for n, _ in axis_rules.pairs})
        where = "" if mesh is None else f" nor a mesh axis {mesh.axis_names}"
        raise ShardingError(
            f"logical axis {name!r} (in {axes}) has no rule{where}; add one, e.g. "
            f"AxisRules({name}='model') or AxisRules({name}=None) to replicate. "
            f"Rules exist for {known}"
        )


def winners_on_mesh(attempts: Sequence[Any], mesh: Any) -> None:
    """The rules that decided a dimension (``rules.Attempt``\\ s that won) name only axes ``mesh`` has."""
    for attempt in attempts:
        if mesh is not None and attempt.won:
            rule_on_mesh(attempt.name, attempt.target, mesh)


def every_dimension_decided(axes: tuple[str | None, ...], attempts: Sequence[Any]) -> None:
    """Keyword rules are strict: a dimension whose one rule was blocked is an error, not replicated."""
    won = {attempt.dim for attempt in attempts if attempt.won}
    for dim, name in enumerate(axes):
        if name is not None and dim not in won:
            last = [attempt for attempt in attempts if attempt.dim == dim][-1]
            raise ShardingError(
                f"logical axes {axes}: dimension {dim} ({name!r}) maps to a mesh axis that "
                f"another dimension already uses ({last}); a mesh axis can split an "
                "array only once. Give a fallback with an ordered list, e.g. "
                f"AxisRules.from_pairs([..., ({name!r}, None)])"
            )


# -- constraints and sharding: arrays on a mesh --------------------------------------------------
def divisible(
    where: str, shape: tuple[int, ...], axes: tuple[str | None, ...], spec: PartitionSpec, mesh: Any
) -> None:
    """Each split dimension of an array (a parameter, an input, an activation) divides evenly."""
    if mesh is None:
        return
    for dim, (size, entry) in enumerate(zip(shape, spec)):
        if size % (ways := math.prod(mesh.shape[a] for a in _mesh_axes(entry))):
            sizes = ", ".join(f"{a!r}={mesh.shape[a]}" for a in _mesh_axes(entry))
            why = (
                f"{where}: shape {shape}, dimension {dim} (logical axis {axes[dim]!r}) has size {size}, "
                f"which mesh axis {sizes} cannot split evenly"
            )
            raise ShardingError(why, f"choose sizes divisible by {ways} or change the rules")


def mesh_shape(shape: Any, names: Any) -> None:
    """``make_mesh``'s shape and names: a dict, or sizes with a name each; positive sizes, distinct names."""
    if isinstance(shape, Mapping):
        if names is not None:
            raise ShardingError(f"make_mesh: {dict(shape)} already names its axes; drop names={names}")
        names, sizes = tuple(shape), tuple(shape.values())
    else:
        sizes = tuple(shape)
        if names is None or len(names) != len(sizes):
            raise ShardingError(f"make_mesh: shape {sizes} needs one name per axis, got names={names}")
        names = tuple(names)
    if not sizes:
        raise ShardingError("make_mesh: the mesh has no axes; name at least one, e.g. make_mesh({'data': 8})")
    if bad := [n for n in names if not isinstance(n, str)]:
        raise ShardingError(f"make_mesh: axis names must be str, got {', '.join(map(repr, bad))} in {names}")
    if bad := [f"{n}={s!r}" for n, s in zip(names, sizes) if not _is_count(s)]:
        raise ShardingError(f"make_mesh: axis sizes must be positive ints, got {', '.join(bad)}")
    if twice := sorted({n for n in names if names.count(n) > 1}):
        raise ShardingError(
            f"make_mesh: mesh axis {twice} named twice in {names}; each axis needs its own name"
        )


def mesh_devices(names: tuple[str, ...], sizes: tuple[int, ...], devices: Sequence[Any]) -> None:
    """As many devices as the mesh has places."""
    if not devices:
        raise ShardingError(
            f"make_mesh: no devices were given for mesh {dict(zip(names, sizes))}; pass some "
            "(jax.devices()), or leave devices=None for all of them"
        )
    if math.prod(sizes) != len(devices):
        raise ShardingError(
            f"make_mesh: mesh {dict(zip(names, sizes))} needs {math.prod(sizes)} devices, but "
            f"{len(devices)} {devices[0].platform} device(s) were given. To simulate N CPU devices, set "
            "XLA_FLAGS=--xla_force_host_platform_device_count=N before JAX is first imported."
        )


def spec_on_mesh(where: str, spec: Any, mesh: Any) -> None:
    """A leaf of ``named_shardings``' specs: a PartitionSpec naming only axes of ``mesh``."""
    if not isinstance(spec, PartitionSpec):
        raise ShardingError(
            f"named_shardings: {where} is {spec!r} ({type(spec).__name__}), not a PartitionSpec; "
            "use P(...) (None for an unspecified leaf)"
        )
    for axis in [axis for entry in spec for axis in _mesh_axes(entry)]:
        if axis not in mesh.axis_names:
            raise ShardingError(
                f"named_shardings: {where}: {spec} names mesh axis {axis!r}, which the mesh "
                f"{dict(mesh.shape)} lacks"
            )


def one_kind_of_axes(mesh: Any) -> None:
    if len(set(mesh.axis_types)) > 1:
        raise ShardingError(
            f"Sharded: mesh axes {dict(zip(mesh.axis_names, mesh.axis_types))} mix Auto and Explicit; "
            "minishard supports meshes of one kind: make_mesh(..., explicit=True) or explicit=False"
        )


def batch_axis_known(batch_axis: str | None, axis_rules: Any, mesh: Any) -> None:
    if batch_axis is not None and batch_axis not in axis_rules and batch_axis not in mesh.axis_names:
        raise ShardingError(
            f"Sharded: batch_axis={batch_axis!r} has no rule in {axis_rules} and is no mesh axis "
            f"{mesh.axis_names}; add a rule such as AxisRules({batch_axis}='data')"
        )


def donate_argnums(name: str, donate: Any, fn: Callable[..., Any]) -> None:
    """Each donated position is an argument of ``fn`` (any count when it takes ``*args``)."""
    one = isinstance(donate, str) or not isinstance(donate, Sequence)
    arg_names = positional_names(fn)
    takes = "" if arg_names is None else f"; {name} takes {len(arg_names)} positional arguments"
    for a in (donate,) if one else tuple(donate):
        if isinstance(a, bool) or not isinstance(a, int) or a < 0:
            raise ShardingError(
                f"{name}: donate_argnums={donate!r} must be non-negative ints (argument positions){takes}"
            )
        if arg_names is not None and a >= len(arg_names):
            raise ShardingError(
                f"{name}: donate_argnums={donate!r} names argument {a}, but {name} takes "
                f"{len(arg_names)} positional arguments ({', '.join(arg_names) or 'none'})"
            )


def positional_names(fn: Callable[..., Any]) -> list[str] | None:
    """The names of ``fn``'s positional parameters; None when it takes ``*args`` or has no signature."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_POSITIONAL for p in parameters):
        return None
    return [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def keywords(name: str, kwargs: dict[str, Any]) -> NoReturn:
    raise TypeError(
        f"Sharded function {name!r}: pass arguments by position; "
        f"shardings are derived per positional argument, got keywords {sorted(kwargs)}"
    )


# -- layers --------------------------------------------------------------------------------------
ARRAY_TYPES = (jax.Array, np.ndarray, np.number, np.bool_)  # what jit accepts as a leaf


def field_lists(cls: Any) -> None:
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


def field(cls: Any, name: str, value: Any, namer: Namer) -> None:
    """A declared field: a parameter holds arrays, static data is hashable and holds none."""
    where = f"{cls.__name__}.{name}"
    if name in cls.param_fields:
        _param(where, value, namer)
    elif name in cls.static_fields:
        _static(where, value, namer)
    else:
        raise AttributeError(
            f"{where} is neither in param_fields {cls.param_fields} nor in "
            f"static_fields {cls.static_fields}; declare it there, or "
            "tree_unflatten (used by jit, grad and vmap) would drop it"
        )


def _param(where: str, value: Any, namer: Namer) -> None:
    for path, leaf in jax.tree_util.tree_leaves_with_path(value):
        if not isinstance(leaf, ARRAY_TYPES):
            at = namer(path, root=where)
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


def _static(where: str, value: Any, namer: Namer) -> None:
    for path, leaf in jax.tree_util.tree_leaves_with_path(value):
        if isinstance(leaf, ARRAY_TYPES):
            raise TypeError(
                f"static field {namer(path, root=where)} holds an array of shape "
                f"{leaf.shape}; static data is hashed into jit's cache key, so an array "
                "there recompiles on every new value. Make it a parameter (param_fields)."
            )
        if isinstance(leaf, float) and math.isnan(leaf):
            raise ValueError(
                f"static field {namer(path, root=where)} is NaN; NaN != NaN, so jit's "
                "cache would never find its compiled code and recompile on every call"
            )
    try:
        hash(value)
    except TypeError:
        raise TypeError(
            f"static field {where} = {value!r:.60} is not hashable; jit hashes static "
            "data to find compiled code. Use a tuple instead of a list, for example."
        ) from None


def all_fields_set(layer: Any) -> None:
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


def linear(in_features: Any, out_features: Any, *, scale: Any, key: Any, axes: Any) -> None:
    """``Linear``'s arguments, all before any weight is drawn."""
    count("Linear: in_features", in_features)
    count("Linear: out_features", out_features)
    number = not isinstance(scale, bool) and isinstance(scale, int | float | np.floating)
    if not number or not math.isfinite(scale):
        raise TypeError(f"Linear: scale must be a finite number, got {scale!r}")
    check_key("Linear", key)
    logical_axes("Linear: axes", axes, (in_features, out_features))


def linear_fields(layer: Any) -> None:
    """A built ``Linear`` (or a ``replace``d one): the fields fit together."""
    count("Linear.in_features", layer.in_features)
    count("Linear.out_features", layer.out_features)
    logical_axes("Linear.logical_axes", layer.logical_axes, (layer.in_features, layer.out_features))
    for name, shape in (("weight", (layer.in_features, layer.out_features)), ("bias", (layer.out_features,))):
        got = getattr(layer.__dict__[name], "shape", None)
        if got != shape and not (name == "bias" and layer.bias is None):
            raise ValueError(
                f"Linear.{name} has shape {got}, but a Linear({layer.in_features} -> "
                f"{layer.out_features}) needs {shape}; change the sizes with it, or build a new Linear"
            )


def linear_call(layer: Any, x: Any) -> None:
    """An array whose last dimension is ``in_features``, into a Linear whose arrays still exist."""
    where = f"Linear({layer.in_features} -> {layer.out_features})"
    check_input(where, x)
    if jnp.ndim(x) == 0 or jnp.shape(x)[-1] != layer.in_features:
        raise ValueError(
            f"{where} expects inputs whose last dimension is {layer.in_features}, got shape {jnp.shape(x)}"
        )
    not_donated(where, layer)


def not_donated(where: str, layer: Any) -> None:
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


# -- losses --------------------------------------------------------------------------------------
def one_hot(labels: jax.Array, num_classes: Any) -> None:
    count("one_hot: num_classes", num_classes)
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
def positive(where: str, value: Any) -> None:
    """A finite number > 0, or an error naming the argument: a negative rate would ascend."""
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(f"{where} must be a finite number > 0, got {value!r}")


def warmup_cosine(warmup_steps: Any, decay_steps: Any, peak_value: float, end_value: Any) -> None:
    count("warmup_cosine_decay: warmup_steps", warmup_steps, minimum=0)
    count("warmup_cosine_decay: decay_steps", decay_steps, minimum=0)
    if decay_steps <= warmup_steps:
        raise ValueError(
            f"warmup_cosine_decay: decay_steps {decay_steps} must exceed warmup_steps {warmup_steps}"
        )
    if not _finite(end_value) or not 0 <= end_value <= peak_value:
        raise ValueError(
            f"warmup_cosine_decay: end_value must be a number from 0 to peak_value {peak_value}, got "
            f"{end_value!r}; a negative learning rate climbs the loss"
        )


def learning_rate(value: Any, where: str = "SGD") -> None:
    """A number > 0, or a ``LearningRate``: a callable of one argument, the step."""
    if not callable(value):
        positive(f"{where}: learning_rate (a number, or a callable of the step)", value)
        return
    try:
        signature = inspect.signature(value)
    except (TypeError, ValueError):  # some builtins have none: nothing to check
        return
    try:
        signature.bind(0)
    except TypeError:
        raise TypeError(
            f"{where}: learning_rate is a callable of {signature}, but a learning rate is called with one "
            "argument, the step; write lambda step: ..., or use exponential_decay"
        ) from None
    first = np.asarray(value(jnp.zeros((), jnp.int32)))
    if first.shape != () or not np.isfinite(first) or first < 0:
        raise ValueError(
            f"{where}: learning_rate(0) is {np.array2string(first)}; a schedule must give a finite "
            "number >= 0 at every step (a negative learning rate climbs the loss)"
        )


def momentum(value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 <= float(value) < 1.0:
        raise ValueError(f"SGD: momentum must be a number in [0, 1), got {value!r}")


def adamw(b1: Any, b2: Any, eps: Any, weight_decay: Any, clip_norm: Any) -> None:
    for name, beta in (("b1", b1), ("b2", b2)):
        if isinstance(beta, bool) or not isinstance(beta, numbers.Real) or not 0.0 <= float(beta) < 1.0:
            raise ValueError(f"AdamW: {name} must be a number in [0, 1), got {beta!r}")
    positive("AdamW: eps", eps)
    real = isinstance(weight_decay, numbers.Real) and not isinstance(weight_decay, bool)
    if not real or not float(weight_decay) >= 0:
        raise ValueError(f"AdamW: weight_decay must be a number >= 0, got {weight_decay!r}")
    if clip_norm is not None:
        positive("AdamW: clip_norm (None: no clipping)", clip_norm)


def adamw_update(params: Any, grads: Any, state: Any, namer: Namer) -> None:
    """The state has AdamW's two moments, shaped like the parameters, and the gradients mirror them."""
    if not hasattr(state, "mu") or not hasattr(state, "nu"):
        raise ValueError(
            f"AdamW.update: the state is a {type(state).__name__}, not AdamW's (step, mu, nu); "
            "make the state with the same AdamW's init"
        )
    _same_structure(params, grads, namer, "AdamW.update")
    _same_structure(params, state.mu, namer, "AdamW.update", other="state.mu")


def sgd_update(sgd: Any, params: Any, grads: Any, state: Any, namer: Namer) -> None:
    """The state was made by this SGD's ``init``, and the gradients mirror the parameters."""
    fix = "make the state with the same SGD's init"
    if not hasattr(state, "velocity") or not hasattr(state, "step"):
        kind = type(state).__name__
        raise ValueError(f"SGD.update: the state is a {kind}, not SGD's (step, velocity); {fix}")
    if state.step is None:
        raise ValueError(f"SGD.update: the state has no step (every SGD counts its updates); {fix}")
    if sgd.momentum and state.velocity is None:
        raise ValueError(
            f"SGD.update: this SGD has momentum {sgd.momentum}, but the state has no velocity; {fix}"
        )
    if not sgd.momentum and state.velocity is not None:
        raise ValueError(f"SGD.update: this SGD has no momentum, but the state has a velocity; {fix}")
    _same_structure(params, grads, namer)


def _same_structure(
    params: Any, grads: Any, namer: Namer, where: str = "SGD.update", other: str = "grads"
) -> None:
    """Gradients (or moments) must mirror the parameters; name the first place where they do not."""
    p_leaves, p_def = jax.tree_util.tree_flatten_with_path(params)
    g_leaves, g_def = jax.tree_util.tree_flatten_with_path(grads)
    p_def, g_def = cast(Any, p_def), cast(Any, g_def)  # PyTreeDef comes without type stubs
    if p_def == g_def and all(jnp.shape(p) == jnp.shape(g) for (_, p), (_, g) in zip(p_leaves, g_leaves)):
        return
    for (p_path, p), (g_path, g) in zip(p_leaves, g_leaves):
        if p_path != g_path or jnp.shape(p) != jnp.shape(g):
            raise ValueError(
                f"{where}: {other} do not match params at {namer(p_path, root='params')} "
                f"(shape {jnp.shape(p)}): {other} has {namer(g_path, root=other)} "
                f"with shape {jnp.shape(g)}"
            )
    if len(g_leaves) == len(p_leaves):  # the same arrays, other static fields (a Layer's remat, say)
        raise ValueError(
            f"{where}: {other} hold the same {len(p_leaves)} arrays as params, but their trees differ "
            f"(another container, or a Layer with other static fields); make {other} from these params"
        )
    raise ValueError(
        f"{where}: {other} have {len(g_leaves)} arrays, params {len(p_leaves)} (or other containers); "
        "compute grads with jax.grad with respect to the same params"
    )


# -- context parallelism (context.py, sequence.py) ------------------------------------------------
# Plain values in, nothing from minishard imported: these guards need no other module.
def sequence_layout(
    seq_len: Any, p: Any, layout: Any, chunks: dict[str, int], where: str = "context"
) -> None:
    """A known layout, whose chunks split the sequence evenly over ``p`` devices."""
    ring(where, p, layout, chunks)
    count(f"{where}: seq_len", seq_len)
    if seq_len % (p * chunks[layout]):
        n = p * chunks[layout]
        raise ValueError(
            f"{where}: a sequence of {seq_len} tokens does not split into {n} equal chunks ({chunks[layout]} "
            f"on each of {p} devices, layout {layout!r}); use a multiple of {n} tokens"
        )


def ring(where: str, p: Any, layout: Any, chunks: dict[str, int]) -> None:
    """A ring of ``p`` devices (a positive int), its sequence dealt out in a known layout."""
    count(f"{where}: p (the devices of the ring)", p)
    if layout not in chunks:
        known = ", ".join(map(repr, chunks))
        raise ValueError(f"{where}: unknown sequence layout {layout!r}; choose from {known}")


def chunk_holder(device: Any, p: Any, layout: Any, chunks: dict[str, int]) -> None:
    """A device of the ring: from 0 to p - 1 (checked when it is an int; traced, it cannot be wrong)."""
    ring("chunks", p, layout, chunks)
    if isinstance(device, int | np.integer) and not 0 <= device < p:
        raise ValueError(
            f"chunks: device={device!r} is no device of a ring of p={p}; devices run 0 to {p - 1}"
        )


def qkv(where: str, q: Any, k: Any, v: Any, *, here: str = "", grouped: bool = True) -> None:
    """q, k and v: float ``[batch, seq, heads, head_dim]`` arrays, k and v of one shape, q of theirs but
    its length (a cache's keys outnumber its queries) and, ``grouped``, its heads a multiple of theirs
    (grouped-query attention); an int would be truncated."""
    shapes = [jnp.shape(x) for x in (q, k, v)]
    if (
        {len(shapes[0]), len(shapes[1])} != {4}
        or shapes[1] != shapes[2]
        or shapes[0][::3] != shapes[1][::3]
        or shapes[0][2] % max(shapes[1][2], 1)
        or (not grouped and shapes[0][2] != shapes[1][2])
    ):
        heads = ", and hold a multiple of their heads" if grouped else ""
        raise ValueError(
            f"{where}: q, k and v must be [batch, seq, heads, head_dim] arrays of one shape (q may be "
            f"shorter or longer{heads}), got {shapes}{here}"
        )
    if ints := [f"{n} {jnp.result_type(x)}" for n, x in zip("qkv", (q, k, v)) if not _floating(x)]:
        raise TypeError(
            f"{where}: q, k and v must be float arrays, got {', '.join(ints)}; attention's softmax weights "
            "would be truncated to integers (cast with .astype(jnp.float32))"
        )


def _floating(x: Any) -> bool:
    return bool(jnp.issubdtype(jnp.result_type(x), jnp.floating))


def partials(out1: Any, lse1: Any, out2: Any, lse2: Any) -> None:
    """Two attentions of the same queries: outputs ``[b, q, h, d]`` of one shape, each lse ``[b, q, h]``."""
    shapes = [jnp.shape(x) for x in (out1, lse1, out2, lse2)]
    if shapes[0] != shapes[2] or not shapes[1] == shapes[3] == shapes[0][:-1]:
        raise ValueError(
            f"merge: out1 {shapes[0]}, lse1 {shapes[1]}, out2 {shapes[2]}, lse2 {shapes[3]}; the two parts "
            "attend the same queries: out1 and out2 of one shape [batch, queries, heads, head_dim], each lse "
            "that shape without head_dim"
        )


def context_inputs(
    where: str, q: Any, k: Any, v: Any, axis: Any, layout: Any, chunks: dict[str, int]
) -> None:
    """Inside ``shard_map`` over ``axis``: q, k, v of one ``[batch, seq, heads, head_dim]`` shape,
    but k's and v's heads may be a divisor of q's (grouped-query attention)."""
    qkv(where, q, k, v, here=" on this device")
    try:
        p = jax.lax.axis_size(axis)
    except NameError:
        raise ValueError(
            f"{where}: {axis!r} is no axis of a surrounding jax.shard_map; call it inside one whose mesh "
            "has it (minishard.sequence.over_sequence builds one)"
        ) from None
    sequence_layout(jnp.shape(q)[1] * p, p, layout, chunks)


def whole_sequence(q: Any, k: Any, v: Any, p: int, layout: Any, chunks: dict[str, int]) -> None:
    """``over_sequence``'s whole arrays: q, k, v alike, their sequence dealt out evenly over ``p`` devices."""
    qkv("over_sequence", q, k, v)
    sequence_layout(jnp.shape(q)[1], p, layout, chunks, where="over_sequence")


def heads_split(where: str, heads: int, p: int, axis: str) -> None:
    """DeepSpeed-Ulysses gives each device whole heads: they must split evenly."""
    if heads % p:
        raise ValueError(
            f"{where}: {heads} heads do not split over the {p} devices of axis {axis!r}: Ulysses gives "
            f"each device whole heads; use a multiple of {p} heads, or ring_attention"
        )


def mesh_has(where: str, axis: str, mesh_axes: tuple[str, ...]) -> None:
    """The sequence's mesh axis is one of the mesh's."""
    if axis not in mesh_axes:
        raise ValueError(
            f"{where}: axis={axis!r} is no axis of the mesh, whose axes are {mesh_axes}; split the "
            "sequence over one of them, or make the mesh with it"
        )


# -- experts (plain values only: this section imports nothing from minishard) ------------------
def moe(n_experts: Any, k: Any, capacity_factor: Any, balance_weight: Any, z_weight: Any) -> None:
    """``MoE``'s routing arguments, before any weight is drawn."""
    count("MoE: n_experts", n_experts)
    if isinstance(k, bool) or not isinstance(k, int | np.integer) or not 1 <= k <= n_experts:
        raise ValueError(
            f"MoE: k={k!r} with n_experts={n_experts}; each token picks k distinct experts, "
            f"so k must be an int from 1 to {n_experts} (1: Switch, 2: GShard)"
        )
    if not _finite(capacity_factor) or capacity_factor <= 0:
        raise ValueError(
            f"MoE: capacity_factor={capacity_factor!r}; it must be a number > 0 (1.25 is usual; "
            f"n_experts / k = {n_experts / k:g} never drops a token)"
        )
    for name, weight in (("balance_weight", balance_weight), ("z_weight", z_weight)):
        if not _finite(weight) or weight < 0:
            raise ValueError(f"MoE: {name}={weight!r}; a loss weight must be a number >= 0")


def experts(n: Any, features: Any, hidden: Any, activation: Any, activations: Sequence[str]) -> None:
    """``Experts``' sizes and activation, before any weight is drawn."""
    for name, size in (("n", n), ("features", features), ("hidden", hidden)):
        count(f"Experts: {name}", size)
    if activation not in activations:
        raise ValueError(f"Experts: unknown activation {activation!r}; choose from {', '.join(activations)}")


def _finite(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(value)


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


def collected_kind(where: str, kind: Any) -> None:
    """What a collection collects is a type: the class of the values layers sow into it."""
    if not isinstance(kind, type):
        raise TypeError(f"{where}: kind must be a type (the class of what is sown), got {kind!r}")


# -- pipeline ------------------------------------------------------------------------------------
def pipeline(pipe: Any) -> None:
    """``Pipeline``'s fields: counts, and a stage axis the mesh has."""
    count("Pipeline: microbatches", pipe.microbatches)
    count("Pipeline: repeats", pipe.repeats)
    mesh_shape, stage_axis = dict(pipe.mesh.shape), pipe.stage_axis
    if stage_axis not in mesh_shape:
        raise ValueError(
            f"Pipeline: stage_axis={stage_axis!r} is not an axis of the mesh {mesh_shape}; make the mesh "
            f"with it (make_mesh({{{stage_axis!r}: 4}})) or name the mesh's stage axis"
        )


def composed_pipeline(pipe: Any) -> None:
    """``ComposedPipeline``'s axes besides the stage axis: the mesh's, none of them the stage axis."""
    mesh_shape, stage_axis = dict(pipe.mesh.shape), pipe.stage_axis
    for name, axis in (("data_axis", pipe.data_axis), ("sequence_axis", pipe.sequence_axis)):
        if axis is not None and (axis not in mesh_shape or axis == stage_axis):
            raise ValueError(
                f"ComposedPipeline: {name}={axis!r} is not an axis of the mesh {mesh_shape} other than "
                f"the stage axis {stage_axis!r}; name one, or None"
            )


def nothing_sown(where: str, sown: Any) -> None:
    """A plain pipeline's blocks sowed nothing a collection asked for: its loop hands nothing out."""
    if sown is not None:
        raise ValueError(
            f"{where}: the blocks sow a {type(sown).__name__} (an MoE's statistics) that a plain "
            "Pipeline's ticks cannot hand out; use minishard.composition.ComposedPipeline"
        )


def pipeline_sizes(where: str, p: Any, m: Any, r: Any) -> None:
    """Stages, microbatches and repeats of a schedule or a bubble: each a positive int."""
    for name, value in (("p", p), ("m", m), ("r", r)):
        count(f"{where}: {name}", value)


def pipeline_batch(where: str, x: Any, pipe: Any, data_axis: Any = None) -> None:
    """The batch splits into the pipeline's microbatches, each split over ``data_axis``, if any."""
    rows, m = np.shape(x)[0], pipe.microbatches
    data = int(pipe.mesh.shape[data_axis]) if data_axis else 1
    if rows % (m * data):
        over = f" x {data_axis}={data} devices" if data_axis else ""
        raise ValueError(
            f"{where}: a batch of {rows} does not split into m={m} microbatches{over}; "
            f"use a batch that is a multiple of {m * data}, or other microbatches"
        )


def instance(where: str, value: Any, cls: type, hint: str) -> None:
    """``value`` is a ``cls``, or an error naming what it is instead and what to pass."""
    if not isinstance(value, cls):
        raise TypeError(f"{where} must be a {cls.__name__}, got a {type(value).__name__}; {hint}")


def stacked(n: Any, key: Any) -> None:
    """``Stacked``'s count of blocks and key, before any block is built."""
    count("Stacked: n", n)
    check_key("Stacked", key)


def blocks_keep_shape(body: Any, block: Any, x: Any) -> None:
    """Stacked blocks run one after another (a ``lax.scan`` of ``body``): each must keep its input's shape."""
    first = jax.tree.map(lambda a: a[0], block)
    out = jax.eval_shape(lambda h, b: body(h, b)[0], jax.ShapeDtypeStruct(np.shape(x), x.dtype), first)
    if (out.shape, out.dtype) != (np.shape(x), x.dtype):
        raise ValueError(
            f"Stacked: a block maps {x.dtype}{list(np.shape(x))} to {out.dtype}{list(out.shape)}; stacked "
            "blocks run one after another, each on the previous one's output, so each must keep its "
            "input's shape and dtype"
        )


def one_of(where: str, value: Any, allowed: Sequence[Any]) -> None:
    """``value`` is one of ``allowed``: a choice among a few named ones."""
    if value not in allowed:
        raise ValueError(f"{where} must be one of {', '.join(map(repr, allowed))}, got {value!r}")


def pipelined(where: str, pipeline: Any, args: Sequence[Any]) -> None:
    """A pipeline is given, or one of ``args`` is a model with one (a ``StackedModel``)."""
    if pipeline is None and not any(getattr(a, "pipeline", None) for a in args):
        raise ValueError(
            f"{where}: no argument is a model with a pipeline (a StackedModel with pipeline=...); "
            "give the model its Pipeline, or pass pipeline="
        )


# -- costs ---------------------------------------------------------------------------------------
def collective(kind: Any, nbytes: Any, devices: Any, kinds: Sequence[str]) -> None:
    """``collective_time``'s arguments: a known kind, bytes >= 0, a device count >= 1."""
    one_of("collective_time: kind", kind, kinds)
    if not _finite(nbytes) or nbytes < 0:
        raise ValueError(f"collective_time: nbytes must be a number of bytes >= 0, got {nbytes!r}")
    count("collective_time: devices", devices)


def layout_sizes(sizes: Mapping[str, Any], dimensions: Sequence[str]) -> None:
    """A layout's sizes: each a dimension it splits (``layouts.RANKED``), each a positive int."""
    for name, size in sizes.items():
        if name not in dimensions:
            raise ValueError(f"Layout: unknown dimension {name!r}; a layout splits {', '.join(dimensions)}")
        count(f"Layout: {name}", size)


def optional_count(where: str, value: Any) -> None:
    """None, or a positive int."""
    if value is not None:
        count(where, value)


def optional_positive(where: str, value: Any) -> None:
    """None, or a finite number > 0."""
    if value is not None:
        positive(where, value)


def program_mesh(where: str, given: Any, program: Any) -> None:
    """A mesh passed for a program is the one it was compiled for: the same axes, sizes and devices."""
    if given is None or program is None:
        return
    same = dict(given.shape) == dict(program.shape)
    if same and all(isinstance(m, jax.sharding.Mesh) for m in (given, program)):
        same = np.array_equal(given.device_ids, program.device_ids)
    if not same:
        raise ValueError(
            f"{where}: mesh={dict(given.shape)} is not the mesh the program was compiled for, "
            f"{dict(program.shape)}; omit mesh= (it is read from the program) or pass that mesh"
        )


# -- zero ----------------------------------------------------------------------------------------
def batch_splits(where: str, batch: Any, n: int, axis: str) -> None:
    """Every array of the batch splits evenly over the ``n`` devices of ``axis``: each its own examples."""
    for leaf in jax.tree.leaves(batch):
        rows = np.shape(leaf)[0] if np.ndim(leaf) else None
        if rows is None or rows % n:
            raise ValueError(
                f"{where}: a batch of {rows} examples does not split over the {n} devices of axis {axis!r}; "
                f"each device takes its own examples, so the batch must be a multiple of {n}"
            )


# -- hardware ------------------------------------------------------------------------------------
def scale_out(name: str, bandwidth: Any, devices: int, node: int) -> None:
    """A group wider than the fast level needs the slow level's figure: no silent NVLink or ICI speed."""
    if bandwidth is None:
        raise ValueError(
            f"{name}: {devices:,} devices span more than a node of {node}, and it has no scale_out "
            f"bandwidth beyond one; give Hardware(scale_out=bytes/s per device)"
        )


# -- memory and precision ------------------------------------------------------------------------
def copies_as_wide(precision: Mapping[str, Any]) -> None:
    """``Precision``'s copies hold more than what they copy: the master's numbers at least as wide as
    the weights', the accumulated gradients' as the gradients' (a narrower copy loses what it keeps)."""
    for copy, of in (("master", "params"), ("accumulated", "grads")):
        if precision[copy] is not None and _bytes(precision[copy]) < _bytes(precision[of]):
            raise ValueError(
                f"Precision: {copy}={precision[copy]!r} is narrower than {of}={precision[of]!r}: a copy "
                f"kept to hold what {of} lose must be at least as wide; give {copy}='float32', or None "
                "for no copy"
            )


def _bytes(dtype: str) -> int:
    return int(np.dtype(jnp.dtype(dtype)).itemsize)


def loss_scale(where: str, period: Any, factor: Any, floor: Any) -> None:
    """A dynamic loss scale's knobs: it grows by ``factor`` after ``period`` finite steps, shrinks by it
    on an overflow, never below ``floor``; a factor <= 1 would invert or freeze it."""
    count(f"{where}: period", period)
    if not _finite(factor) or factor <= 1:
        raise ValueError(
            f"{where}: factor must be a finite number > 1 (the scale is multiplied by it after period "
            f"finite steps, divided by it on an overflow), got {factor!r}; jmp's default is 2"
        )
    if not _finite(floor) or floor <= 0:
        raise ValueError(f"{where}: floor must be a finite number > 0 (the smallest scale), got {floor!r}")


def loss_scale_start(scale: Any) -> None:
    """A loss scale's first value: a finite number > 0 (NaN or inf would skip every step for ever)."""
    if not _finite(scale) or scale <= 0:
        raise ValueError(
            f"LossScale.start: scale must be a finite number > 0 (the loss is multiplied by it), got "
            f"{scale!r}; jmp starts at 2**15"
        )


def scalar_bool(where: str, value: Any) -> None:
    """One boolean (a Python bool, or an array of shape () and dtype bool): a single yes or no."""
    if np.shape(value) != () or jnp.result_type(value) != jnp.bool_:
        raise ValueError(
            f"{where} must be one boolean (shape (), dtype bool), got dtype {jnp.result_type(value)} "
            f"shape {np.shape(value)}; all_finite(grads) gives it"
        )


def optimizer(where: str, value: Any) -> None:
    """An optimizer: an object with ``init``, ``update`` and ``learning_rate`` (``SGD``, ``AdamW``)."""
    if not all(hasattr(value, name) for name in ("init", "update", "learning_rate")):
        shown = f" {value!r}" if isinstance(value, str | numbers.Number) else ""
        raise TypeError(
            f"{where} must be an Optimizer (init, update, learning_rate), got a {type(value).__name__}"
            f"{shown}; e.g. LossScaled(AdamW(1e-3))"
        )


def loss_scaled_state(where: str, state: Any, cls: type) -> None:
    """The state ``LossScaled.init`` made (the inner optimizer's, beside the scale), not the inner one's."""
    if not isinstance(state, cls):
        raise TypeError(
            f"{where}: state must be a {cls.__name__} (the optimizer's state and the loss scale), got a "
            f"{type(state).__name__}; init it with the LossScaled optimizer, not the one inside it"
        )


def flash(q: Any, k: Any, v: Any, blocks: Any, interpret: bool, row_tile: int, score_tile: int) -> None:
    """The flash kernel's inputs: q, k, v of one ``[batch, seq, heads, head_dim]`` shape, blocks that
    tile the sequence (divisors of it, multiples of the TPU's 8 sublanes or the whole; on a TPU query
    blocks of 128 lanes), tiles that fit VMEM, and a TPU to run on (or the interpreter)."""
    qkv("flash_attention", q, k, v, grouped=False)
    if jnp.shape(q) != jnp.shape(k):
        raise ValueError(f"flash_attention: q {jnp.shape(q)} and k {jnp.shape(k)}: one sequence, one shape")
    seq_len, head_dim = jnp.shape(q)[1], jnp.shape(q)[3]
    for name, block in zip(("block_q", "block_k"), blocks):
        if not _is_count(block) or seq_len % block or (block % 8 and block != seq_len):
            fits = [n for n in range(8, min(seq_len, 1024) + 1, 8) if seq_len % n == 0] or [seq_len]
            raise ValueError(
                f"flash_attention: {name}={block} does not tile the sequence of {seq_len} tokens; use a "
                f"divisor of it that is a multiple of 8 (the TPU's sublanes) or {seq_len} itself: "
                f"{', '.join(map(str, fits[-4:]))}"
            )
    flash_tiles(blocks, head_dim, jnp.dtype(q.dtype).itemsize, row_tile, score_tile)
    if not interpret and blocks[0] % 128 and blocks[0] != seq_len:
        fits = [n for n in range(128, min(seq_len, 1024) + 1, 128) if seq_len % n == 0] or [seq_len]
        raise ValueError(
            f"flash_attention: block_q={blocks[0]}: on a TPU the backward pass lays a query block's lse "
            f"along the 128 lanes, so block_q is a multiple of 128 or the whole sequence ({seq_len}): "
            f"{', '.join(map(str, fits[-4:]))} (the interpreter takes any multiple of 8)"
        )
    device = getattr(jax.config, "jax_default_device", None) or jax.devices()[0]  # where it would run
    platform = getattr(device, "platform", str(device))
    if not interpret and platform != "tpu":
        raise ValueError(
            f"flash_attention: the Pallas kernel runs on a TPU, and this device is a {platform}; pass "
            "interpret=True to run it here (slowly, as the tests do), or use minishard.context.attention"
        )


def flash_tiles(blocks: Any, head_dim: int, itemsize: int, row_tile: int, score_tile: int) -> None:
    """The flash kernel's tiles fit VMEM: a ``[block, head_dim]`` tile and the float32 score tile."""
    rows = max(blocks) * max(head_dim, 128) * itemsize  # a tile's lanes: 128 at least
    if rows > row_tile:
        raise ValueError(
            f"flash_attention: head_dim {head_dim} makes [{max(blocks)}, {head_dim}] tiles of "
            f"{rows / 2**20:g} MiB, over the {row_tile / 2**20:g} MiB that fit VMEM beside the rest; "
            f"use smaller blocks (at most {row_tile // (max(head_dim, 128) * itemsize)} rows) or heads"
        )
    if blocks[0] * blocks[1] * 4 > score_tile:
        raise ValueError(
            f"flash_attention: block_q x block_k = {blocks[0]} x {blocks[1]} makes a float32 score tile of "
            f"{blocks[0] * blocks[1] * 4 / 2**20:g} MiB, over the {score_tile / 2**20:g} MiB that fit "
            f"VMEM three times; use blocks with block_q x block_k <= {score_tile // 4:,}"
        )
