"""Twelve named ways to spread a model over devices: a mesh shape and ordered rules for each.

Nobody should have to write rules to *try* a style. ``mesh_rules(name, devices)``
returns the mesh shape and the ``AxisRules`` of one of them; the model never
changes, only where its logical axes go:

* ``dp``: data parallel. The batch over "data"; every parameter whole on every device.
* ``tp``: tensor (Megatron) parallel. MLP hidden units and attention heads over
  "model"; the batch whole.
* ``2d``: both, on a data x model grid.
* ``fsdp``: fully sharded data parallel (ZeRO-3). The batch over "data", and
  every parameter split over "data" too, along its first axis that can take
  it: ``embed`` first, then ``mlp``, then ``heads``. Each device *stores* 1/N
  of every weight and of the optimizer state that mirrors it, and XLA gathers
  a weight only while computing with it.
* ``fsdp+tp``: FSDP on "data" and Megatron on "model".
* ``pp``: pipeline parallel. A model's stacked blocks (``minishard.pipeline``)
  over "stage", every device a stage; ``dp+pp``: the batch over "data" too.
  They split only the logical axis "stage", which only stacked blocks name.
* ``cp``, ``dp+cp``: context parallel. The sequence ("seq") over a mesh axis of its own,
  "context", as the batch goes over "data"; attention then needs every key on every
  device (``minishard.context``'s ring). ``tp+sp``: tensor parallel, and Megatron's
  sequence parallelism: "seq" over "model" too, after heads and hidden units, so only
  the residual stream (``("batch", "seq", "embed")``) takes it (``minishard.sequence``).
* ``ep``: expert parallel. A mixture of experts' stacked experts (``minishard.experts``) over
  "expert", and the batch over it too, as is usual; ``dp+ep``: the batch over "data" x "expert".
  The expert rule comes first, so an MoE's slots split by expert: two all-to-alls per layer.

The rules are ordered (Flax's semantics): for an activation ``(batch, embed)``
the batch rule comes first and takes "data", so ``embed`` falls back to its
next rule, ``None``; for a weight ``(embed, mlp)`` no batch dimension competes,
so ``embed`` takes "data".

>>> shape, rules = mesh_rules("fsdp", 8)
>>> shape, rules.spec(("batch", "embed")), rules.spec(("embed", "mlp"))
({'data': 8}, P('data', None), P('data', None))

``SPLITS`` is the one table of what each style splits; the CLI's ``STYLES``
(``minishard.run.cli.styles``: a style's flags, build and step too), the ViT and
the docs read it. ``rules_for_mesh`` gives the rules for a mesh when
no style is named: the ``2d`` style, minus the mesh axes the mesh lacks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from minishard import _checks
from minishard.rules import AxisRules, MeshAxes

SPLITS: dict[str, tuple[tuple[str, MeshAxes], ...]] = {
    "dp": (("batch", "data"),),
    "tp": (("mlp", "model"), ("heads", "model")),
    "2d": (("batch", "data"), ("mlp", "model"), ("heads", "model")),
    "fsdp": (("batch", "data"), ("embed", "data"), ("mlp", "data"), ("heads", "data")),
    "fsdp+tp": (("batch", "data"), ("mlp", "model"), ("heads", "model"), ("embed", "data")),
    "pp": (("stage", "stage"),),
    "dp+pp": (("batch", "data"), ("stage", "stage")),
    "cp": (("seq", "context"),),
    "dp+cp": (("batch", "data"), ("seq", "context")),
    "tp+sp": (("mlp", "model"), ("heads", "model"), ("seq", "model")),
    "ep": (("expert", "expert"), ("batch", "expert")),
    "dp+ep": (("expert", "expert"), ("batch", ("data", "expert")), ("batch", "data")),
}
"""What each style splits, as ordered rules; every logical axis they leave is replicated."""
PIPELINED = tuple(name for name, splits in SPLITS.items() if ("stage", "stage") in splits)
"""The styles that need a model with stacked blocks (``minishard.pipeline.Stacked``)."""
SEQUENCE = tuple(name for name, splits in SPLITS.items() if "seq" in dict(splits))
"""The styles that split the sequence: for a model whose activations name "seq" (the GPT's)."""
EXPERT = tuple(name for name, splits in SPLITS.items() if ("expert", "expert") in splits)
"""The styles that split a mixture of experts' experts; a model without experts they leave as dp."""
ANY_MODEL = tuple(name for name in SPLITS if name not in PIPELINED + SEQUENCE + EXPERT)
"""The styles any model takes."""
LOGICAL_AXES = ("batch", "embed", "mlp", "heads", "kv", "seq", "patch", "classes", "stage", "expert", "vocab")
"""Every logical axis minishard's MLP, ViT, GPT and MoE name: each style gives each one a rule."""


def mesh_rules(name: str, devices: int) -> tuple[dict[str, int], AxisRules]:
    """``(mesh shape, rules)`` of the style ``name`` on ``devices`` devices.

    2-D styles put 2 devices on "data" and the rest on "model", "stage", "context" or "expert"
    (``2d`` on 8 devices: data=2 x model=4), or 1 on "data" when ``devices`` is odd.

    >>> mesh_rules("2d", 8)[0], mesh_rules("tp", 8)[0], mesh_rules("dp+ep", 8)[0]
    ({'data': 2, 'model': 4}, {'model': 8}, {'data': 2, 'expert': 4})
    """
    rules = style_rules(name)
    _checks.count("mesh_rules: devices", devices)
    targets = dict(SPLITS[name]).values()
    mesh_axes = [axis for axis in ("data", "model", "stage", "context", "expert") if axis in targets]
    if len(mesh_axes) == 1:
        return {mesh_axes[0]: devices}, rules
    data = 2 if devices % 2 == 0 and devices > 1 else 1
    return {"data": data, mesh_axes[1]: devices // data}, rules


def style_rules(name: str, overrides: Mapping[str, MeshAxes] = {}) -> AxisRules:
    """The ordered rules of the style ``name``: ``overrides`` first (so they win), then its splits.

    Last come ``LOGICAL_AXES`` to ``None``, the fallback of every axis: replicated.

    >>> style_rules("tp", {"embed": "model"}).spec(("embed", "mlp"))   # embed came first
    P('model', None)
    """
    if name not in SPLITS:
        raise ValueError(f"style_rules: unknown parallel style {name!r}; choose from {', '.join(SPLITS)}")
    replicated = [(axis, None) for axis in LOGICAL_AXES]
    return AxisRules.from_pairs([*overrides.items(), *SPLITS[name], *replicated])


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
    "EXPERT",
    "LOGICAL_AXES",
    "PIPELINED",
    "ANY_MODEL",
    "SEQUENCE",
    "SPLITS",
    "mesh_rules",
    "style_rules",
    "rules_for_mesh",
]
