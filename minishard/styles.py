"""Twelve named ways to spread a model over devices, and every composition of seven dimensions.

Nobody should have to write rules to *try* a style. ``mesh_rules(name, devices)``
returns the mesh shape and the ``AxisRules`` of one of them; the model never
changes, only where its logical axes go. Each *dimension* of parallelism splits
some logical axes over one mesh axis of its own (``DIMENSIONS``):

* ``dp``: data parallel. The batch over "data"; every parameter whole on every device.
* ``fsdp``: fully sharded data parallel (ZeRO-3). The batch over "data", and
  every parameter split over "data" too, along its first axis that can take
  it: ``embed`` first, then ``mlp``, then ``heads``. Each device *stores* 1/N
  of every weight and of the optimizer state that mirrors it, and XLA gathers
  a weight only while computing with it.
* ``tp``: tensor (Megatron) parallel. MLP hidden units and attention heads over
  "model"; the batch whole.
* ``sp``: Megatron's sequence parallelism, on tp's "model" axis (so only with ``tp``):
  "seq" over "model" too, after heads and hidden units, so only the residual stream
  (``("batch", "seq", "embed")``) takes it (``minishard.sequence``).
* ``pp``: pipeline parallel. A model's stacked blocks (``minishard.pipeline``) over
  "stage". It splits only the logical axis "stage", which only stacked blocks name.
* ``cp``: context parallel. The sequence ("seq") over "context"; attention then needs
  every key on every device (``minishard.context``'s ring).
* ``ep``: expert parallel. A mixture of experts' stacked experts (``minishard.experts``) over
  "expert", and the batch over it too, as is usual.

Each dimension's rule is a ``Dimension``, data from which every composition is derived.
``ORDER`` is the one order their splits take, ``MESH_AXES`` the order a composed mesh lists its
axes in, ``CONFLICTS`` the pairs that cannot work together (each rule's ``excludes``), and
``ALIASES`` the named styles that are other names for dimensions (``2d``). ``steps`` gives the
dimensions of a style with a step of their own, the outermost first (``MAX_STEPS`` at most), and
``batch_axes`` the mesh axes its batch splits over.

A style is dimensions joined by ``+`` (``compose``): ``dp+tp+pp`` is a data x model x stage
grid. Twelve have names (``SPLITS``): dp, tp, fsdp, pp, cp, ep alone, ``2d`` (dp+tp),
``fsdp+tp``, ``dp+pp``, ``dp+cp``, ``tp+sp`` and ``dp+ep``. Of them ``PIPELINED`` need a model
with stacked blocks, ``SEQUENCE`` one whose activations name "seq", ``EXPERT`` a mixture of
experts, and ``ANY_MODEL`` are the ones any model takes. ``style_rules`` gives a style's ordered
rules, which end with each of the ``LOGICAL_AXES`` replicated.

The rules are ordered (Flax's semantics): for an activation ``(batch, embed)``
the batch rule comes first and takes "data", so ``embed`` falls back to its
next rule, ``None``; for a weight ``(embed, mlp)`` no batch dimension competes,
so ``embed`` takes "data".

>>> shape, rules = mesh_rules("fsdp", 8)
>>> shape, rules.spec(("batch", "embed")), rules.spec(("embed", "mlp"))
({'data': 8}, P('data', None), P('data', None))

``SPLITS`` is the table of the named styles; the CLI's ``STYLES``
(``minishard.run.cli.styles``: a style's flags, build and step too), the ViT and
the docs read it. ``rules_for_mesh`` gives the rules for a mesh when
no style is named: the ``2d`` style, minus the mesh axes the mesh lacks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

from minishard import _checks
from minishard.rules import AxisRules, MeshAxes

# --- 1. the dimensions, each a rule, and the one order their splits take --------------------------


class Dimension(NamedTuple):
    """One dimension of parallelism as data: what composing it with others needs to know.

    * ``axis``: the mesh axis it splits over (sp rides on tp's "model");
    * ``what``: what it splits, in words; ``splits``: the logical axes, in its own order of
      preference (``ORDER`` interleaves every dimension's);
    * ``needs``: the dimension whose axis it rides on, which must be there too (sp: tp);
    * ``excludes``: the dimensions it cannot run with, each with why;
    * ``step``: the chapter whose step it needs beyond its rules (``None``: its rules are all):
      the pipeline's schedule, the context chapter's ring, the experts' routing;
    * ``inside``: the dimensions with a step of their own that it can run inside (cp and ep inside
      pp's stages, ep inside cp's ring): the outer one's step carries its checks and build;
    * ``sends``: the collectives it adds to a step, by kind;
    * ``shards_weights``: whether it splits every device's share of the parameters (and of the
      optimizer's state that mirrors them): the memory term it changes.

    >>> DIMENSIONS["sp"].axis, DIMENSIONS["sp"].needs, DIMENSIONS["ep"].inside
    ('model', 'tp', ('pp', 'cp'))
    """

    name: str
    axis: str
    what: str
    splits: tuple[str, ...]
    needs: str | None = None
    excludes: Mapping[str, str] = {}
    step: str | None = None
    inside: tuple[str, ...] = ()
    sends: tuple[str, ...] = ()
    shards_weights: bool = False


DIMENSIONS: dict[str, Dimension] = {
    dim.name: dim
    for dim in (
        Dimension("dp", "data", "the batch", ("batch",), sends=("all-reduce",)),
        Dimension(
            "fsdp",
            "data",
            "the batch, and every weight",
            ("batch", "embed", "mlp", "heads"),
            excludes={
                "dp": "both split the batch over 'data' (fsdp is dp that also splits the weights)",
            },
            sends=("all-gather", "reduce-scatter"),
            shards_weights=True,
        ),
        Dimension(
            "tp",
            "model",
            "MLP hidden units and attention heads",
            ("mlp", "heads"),
            sends=("all-reduce",),
            shards_weights=True,
        ),
        Dimension(
            "sp",
            "model",
            "the sequence",
            ("seq",),
            needs="tp",
            excludes={"cp": "both split 'seq' (cp over 'context', sp over tp's 'model')"},
            sends=("all-gather", "reduce-scatter"),  # in place of tp's all-reduces
        ),
        Dimension(
            "pp",
            "stage",
            "the stacked blocks",
            ("stage",),
            step="pipeline",
            sends=("collective-permute", "all-reduce"),
            shards_weights=True,
        ),
        Dimension(
            "cp",
            "context",
            "the sequence",
            ("seq",),
            step="context",
            inside=("pp",),
            # the ring; Llama 3's, ranked; the gradients of the weights its devices share
            sends=("collective-permute", "all-gather", "reduce-scatter", "all-reduce"),
        ),
        Dimension(
            "ep",
            "expert",
            "a mixture's experts, and the batch",
            ("expert", "batch"),
            step="experts",
            inside=("pp", "cp"),
            sends=("all-to-all", "all-reduce"),  # the tokens to their experts; the rest's gradients
            shards_weights=True,
        ),
    )
}
"""Every dimension of parallelism, by name: its rule."""
ORDER: tuple[tuple[str, str], ...] = (
    ("ep", "expert"),  # an MoE's slots [E, G, C, M]: the experts claim "expert" before the groups
    ("dp", "batch"),  # the batch next, so an activation's embed (fsdp's) falls back to whole
    ("fsdp", "batch"),
    ("ep", "batch"),
    ("tp", "mlp"),  # tp's before fsdp's: a weight [embed, mlp] is Megatron's over "model",
    ("tp", "heads"),  # and fsdp splits it along embed, the axis left
    ("fsdp", "embed"),
    ("fsdp", "mlp"),  # fsdp's fallbacks (a bias of hidden units), unless tp splits them
    ("fsdp", "heads"),
    ("pp", "stage"),  # only stacked blocks name "stage": nothing competes
    ("cp", "seq"),
    ("sp", "seq"),  # after tp's heads: attention's [batch, seq, heads, kv] keeps its sequence whole
)
"""Every dimension's splits ``(dimension, logical axis)``, each over the dimension's mesh axis, in
the order a composition's rules take them: each dimension's ``splits`` in its own order,
interleaved. A logical axis keeps the rule of the first dimension that splits it; the batch, which
several split, goes over all of their mesh axes at once."""
MESH_AXES = ("data", "model", "stage", "context", "expert")
"""The mesh axes of the dimensions, in the order a composed mesh lists them."""
CONFLICTS: dict[frozenset[str], str] = {
    frozenset({dim.name, other}): why  # a pair, and why it cannot be
    for dim in DIMENSIONS.values()
    for other, why in dim.excludes.items()
}
"""Pairs of dimensions that cannot work together, and why: each rule's ``excludes``."""
MAX_STEPS = 2
"""Dimensions with a step of their own that one composition holds at most: one outer step that
carries one other inside it (pp+cp, pp+ep, cp+ep). Not all three: inside a pipeline with a ring each
device holds its share of the tokens, so an MoE would route each share as a group of its own."""
ALIASES = {"2d": "dp+tp"}
"""Named styles that are other names for dimensions: ``2d`` is dp+tp."""


def dimensions(name: str) -> tuple[str, ...]:
    """The dimensions of ``name`` (``"2d"``: dp and tp), in ``DIMENSIONS``' order; a composition
    that cannot work is refused in one line that names the two dimensions and why.

    >>> dimensions("tp+pp+dp"), dimensions("2d")
    (('dp', 'tp', 'pp'), ('dp', 'tp'))
    """
    given = ALIASES.get(name, name).split("+")
    if len(given) == 1 and name not in DIMENSIONS:
        raise ValueError(
            f"unknown parallel style {name!r}; choose from {', '.join(SPLITS)}, or dimensions "
            f"joined by + from {', '.join(DIMENSIONS)}"
        )
    for dim in given:
        if dim not in DIMENSIONS:
            known = ", ".join(DIMENSIONS)
            raise ValueError(f"{name}: unknown dimension {dim!r}; the dimensions are {known}")
        if given.count(dim) > 1:
            raise ValueError(f"{name}: {dim} is named twice")
    for pair, why in CONFLICTS.items():
        if pair <= set(given):
            first, second = sorted(pair, key=given.index)
            raise ValueError(f"{name}: {first} and {second} do not compose: {why}")
    for rule in (DIMENSIONS[dim] for dim in given):
        if rule.needs and rule.needs not in given:
            axis = DIMENSIONS[rule.needs].axis
            split = f"{rule.name} splits {rule.what} over {rule.needs}'s {axis!r} axis"
            raise ValueError(f"{name}: {split}, and there is no {rule.needs}; add {rule.needs}")
    return tuple(dim for dim in DIMENSIONS if dim in given)


def steps(name: str) -> tuple[str, ...]:
    """The dimensions of ``name`` with a step of their own, the outermost first: each later one
    runs inside the first, whose rule's ``inside`` it names. A composition no rule nests is
    refused in one line.

    >>> steps("dp+tp+pp"), steps("ep+cp"), steps("dp+tp")
    (('pp',), ('cp', 'ep'), ())
    """
    own = [dim for dim in dimensions(name) if DIMENSIONS[dim].step]
    outers = [dim for dim in own if all(dim in DIMENSIONS[d].inside for d in own if d != dim)]
    outer = outers[0] if outers else None
    if len(own) > MAX_STEPS or (own and outer is None):
        nests = [f"{outside}+{dim.name}" for dim in DIMENSIONS.values() for outside in dim.inside]
        named = f"{', '.join(own[:-1])} and {own[-1]}"
        raise ValueError(
            f"{name}: {named} do not compose here: each is a step of its own, and one step carries "
            f"{MAX_STEPS - 1} other at most, inside it; these do: {', '.join(nests)}"
        )
    return (outer, *(dim for dim in own if dim != outer)) if outer else ()


def batch_axes(name: str) -> tuple[str, ...]:
    """The mesh axes the batch of ``name`` splits over: those of its dimensions that split "batch".

    >>> batch_axes("dp+ep+pp"), batch_axes("tp")
    (('data', 'expert'), ())
    """
    found = [DIMENSIONS[dim].axis for dim in dimensions(name) if "batch" in DIMENSIONS[dim].splits]
    return tuple(dict.fromkeys(found))


def compose(name: str) -> tuple[tuple[str, MeshAxes], ...]:
    """The ordered splits of the dimensions of ``name``, ``ORDER``'s rows for them.

    The batch goes over every mesh axis that splits it at once, then over "data" alone (where
    the experts took "expert"); a logical axis keeps the rule of the first dimension that splits it.

    >>> compose("fsdp+tp")   # fsdp's mlp and heads: tp's already
    (('batch', 'data'), ('mlp', 'model'), ('heads', 'model'), ('embed', 'data'))
    >>> compose("dp+ep")
    (('expert', 'expert'), ('batch', ('data', 'expert')), ('batch', 'data'))
    """
    dims = dimensions(name)
    rows = [(dim, logical, DIMENSIONS[dim].axis) for dim, logical in ORDER if dim in dims]
    batch = tuple(mesh_axis for _, logical, mesh_axis in rows if logical == "batch")
    splits: list[tuple[str, MeshAxes]] = []
    owner: dict[str, str] = {}  # logical axis -> the dimension whose rule it keeps
    for dim, logical, mesh_axis in rows:
        if logical == "batch" and "batch" not in owner:  # the batch once, over all of its axes
            splits.append(("batch", batch[0] if len(batch) == 1 else batch))
            if len(batch) > 1:  # then "data" alone, where another of them is taken
                splits.append(("batch", batch[0]))
        if owner.setdefault(logical, dim) == dim and logical != "batch":
            splits.append((logical, mesh_axis))
    return tuple(splits)


# --- 2. the named styles ------------------------------------------------------------------------

_NAMED = ("dp", "tp", "2d", "fsdp", "fsdp+tp", "pp", "dp+pp", "cp", "dp+cp", "tp+sp", "ep", "dp+ep")
SPLITS: dict[str, tuple[tuple[str, MeshAxes], ...]] = {name: compose(name) for name in _NAMED}
"""What each named style splits, as ordered rules; every logical axis they leave is replicated."""
PIPELINED = tuple(name for name, splits in SPLITS.items() if ("stage", "stage") in splits)
"""The styles that need a model with stacked blocks (``minishard.pipeline.Stacked``)."""
SEQUENCE = tuple(name for name, splits in SPLITS.items() if "seq" in dict(splits))
"""The styles that split the sequence: for a model whose activations name "seq" (the GPT's)."""
EXPERT = tuple(name for name, splits in SPLITS.items() if ("expert", "expert") in splits)
"""The styles that split a mixture of experts' experts; a model without experts they leave as dp."""
ANY_MODEL = tuple(name for name in SPLITS if name not in PIPELINED + SEQUENCE + EXPERT)
"""The styles any model takes."""
LOGICAL_AXES = (
    *("batch", "embed", "mlp", "heads", "kv", "seq"),  # the MLP's and the GPT's
    *(
        "patch",
        "classes",
        "stage",
        "expert",
        "vocab",
    ),  # the ViT's, stacked blocks', experts', the vocabulary's
)
"""Every logical axis minishard's MLP, ViT, GPT and MoE name: each style gives each one a rule."""


def mesh_rules(name: str, devices: int) -> tuple[dict[str, int], AxisRules]:
    """``(mesh shape, rules)`` of the style ``name`` (named, or composed) on ``devices`` devices.

    An axis per dimension (sp rides on tp's), split evenly: each axis but the last takes 2
    devices while they pair up (1 when ``devices`` is odd), the last the rest: 2 x 2 x 2 on 8
    for three axes, 2 x 4 for two.

    >>> mesh_rules("dp+tp+pp", 8)[0], mesh_rules("2d", 8)[0], mesh_rules("tp+sp", 8)[0]
    ({'data': 2, 'model': 2, 'stage': 2}, {'data': 2, 'model': 4}, {'model': 8})
    """
    rules = style_rules(name)
    _checks.count("mesh_rules: devices", devices)
    used = {DIMENSIONS[dim].axis for dim in dimensions(name)}
    axes = [axis for axis in MESH_AXES if axis in used]
    shape: dict[str, int] = {}
    left = devices
    for axis in axes[:-1]:
        shape[axis] = 2 if left % 2 == 0 else 1
        left //= shape[axis]
    return {**shape, axes[-1]: left}, rules


def style_rules(name: str, overrides: Mapping[str, MeshAxes] = {}) -> AxisRules:
    """The ordered rules of the style ``name``: ``overrides`` first (so they win), then its splits.

    Last come ``LOGICAL_AXES`` to ``None``, the fallback of every axis: replicated.

    >>> style_rules("tp", {"embed": "model"}).spec(("embed", "mlp"))   # embed came first
    P('model', None)
    """
    try:
        splits = compose(name)
    except ValueError as e:
        raise ValueError(f"style_rules: {e}") from None
    replicated = [(axis, None) for axis in LOGICAL_AXES]
    return AxisRules.from_pairs([*overrides.items(), *splits, *replicated])


def rules_for_mesh(mesh_axes: Sequence[str], overrides: Mapping[str, MeshAxes] = {}) -> AxisRules:
    """Rules for a mesh when no style is named: ``2d``'s splits onto the mesh axes it has.

    The batch goes over "data", MLP hidden units and attention heads over
    "model", each only if the mesh has that axis; every other logical axis is
    replicated; ``overrides`` replace single rules. One rule per logical axis
    (``AxisRules(**...)``): a rule that cannot apply is an error, not skipped.

    >>> rules = rules_for_mesh(["data"], {"embed": "data"})   # no "model": heads replicated
    >>> rules.spec(("embed", "heads", "kv")), rules.spec(("batch", "mlp"))
    (P('data', None, None), P('data', None))
    """
    splits = {axis: target for axis, target in SPLITS["2d"] if target in mesh_axes}
    return AxisRules(**{**{axis: splits.get(axis) for axis in LOGICAL_AXES}, **overrides})


__all__ = [
    "ALIASES",
    "Dimension",
    "MAX_STEPS",
    "batch_axes",
    "steps",
    "CONFLICTS",
    "DIMENSIONS",
    "MESH_AXES",
    "ORDER",
    "EXPERT",
    "LOGICAL_AXES",
    "PIPELINED",
    "ANY_MODEL",
    "SEQUENCE",
    "SPLITS",
    "compose",
    "dimensions",
    "mesh_rules",
    "style_rules",
    "rules_for_mesh",
]
