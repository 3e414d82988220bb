"""Five named ways to spread a model over devices: a mesh shape and ordered rules for each.

Nobody should have to write rules to *try* a style. ``preset(name, devices)``
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

The rules are ordered (Flax's semantics): for an activation ``(batch, embed)``
the batch rule comes first and takes "data", so ``embed`` falls back to its
next rule, ``None``; for a weight ``(embed, mlp)`` no batch dimension competes,
so ``embed`` takes "data".

>>> shape, rules = preset("fsdp", 8)
>>> shape, rules.spec(("batch", "embed")), rules.spec(("embed", "mlp"))
({'data': 8}, P('data', None), P('data', None))
"""

from __future__ import annotations

from minishard.rules import AxisRules, MeshAxes

PRESETS = ("dp", "tp", "2d", "fsdp", "fsdp+tp")
LOGICAL_AXES = ("batch", "embed", "mlp", "heads", "kv", "tokens", "patch", "classes")
"""Every logical axis minishard's MLP and ViT name: each preset gives each one a rule."""


def preset(name: str, devices: int) -> tuple[dict[str, int], AxisRules]:
    """``(mesh shape, rules)`` of the style ``name`` on ``devices`` devices.

    2-D styles put 2 devices on "data" and the rest on "model" (``2d`` on 8
    devices: data=2 x model=4), or 1 on "data" when ``devices`` is odd.
    """
    if name not in PRESETS:
        raise ValueError(f"preset: unknown parallel style {name!r}; choose from {', '.join(PRESETS)}")
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ValueError(f"preset: devices must be an int >= 1, got {devices!r}")
    data = 2 if devices % 2 == 0 and devices > 1 else 1
    shapes = {
        "dp": {"data": devices},
        "tp": {"model": devices},
        "2d": {"data": data, "model": devices // data},
        "fsdp": {"data": devices},
        "fsdp+tp": {"data": data, "model": devices // data},
    }
    pairs: list[tuple[str, MeshAxes]] = []
    if name in ("dp", "2d", "fsdp", "fsdp+tp"):
        pairs.append(("batch", "data"))
    if name in ("tp", "2d", "fsdp+tp"):
        pairs += [("mlp", "model"), ("heads", "model")]
    if name == "fsdp":
        pairs += [("embed", "data"), ("mlp", "data"), ("heads", "data")]
    if name == "fsdp+tp":
        pairs += [("embed", "data")]
    pairs += [(axis, None) for axis in LOGICAL_AXES]  # the fallback of every axis: replicated
    return shapes[name], AxisRules.from_pairs(pairs)
