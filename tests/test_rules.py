"""AxisRules: Flax's ordered semantics, checked against Flax itself, and every ShardingError.

``AxisRules.from_pairs`` promises the semantics of ``flax.linen.logical_to_mesh_axes``,
so Flax is the oracle: on random ordered rule lists both must give the same
``PartitionSpec``. Where minishard is stricter than Flax (a name with no rule, a
keyword rule that would use a mesh axis twice), it raises a ``ShardingError``; the
second half of this file triggers each one and reads the message.

Models here are built with ``jax.eval_shape`` and filled with numpy: building them
with ``jax.random`` would compile programs these tests never need.
"""

import re

import flax.linen as nn
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P
from models import numpy_mlp
from named import assert_named

import minishard as ms
from minishard import AxisRules, ShardingError
from minishard.rules import resolve
from minishard.sharding import partition_specs
from minishard.testing import axis_rules

MESH_TARGETS = ("data", "model", None, ("data", "model"))
LOGICAL_NAMES = ("batch", "embed", "mlp", "heads", "vocab")
MESH = ms.make_mesh({"data": 2, "model": 4})


@st.composite
def rules_and_axes(draw: st.DrawFn, ordered: bool) -> tuple[AxisRules, tuple[str | None, ...]]:
    """Rules for a few random logical names, and array axes naming some of them (and maybe None)."""
    names = draw(st.lists(st.sampled_from(LOGICAL_NAMES), min_size=2, max_size=4, unique=True))
    rules = draw(axis_rules(dict.fromkeys(names, MESH_TARGETS), ordered=ordered))
    axes = draw(st.lists(st.sampled_from([*names, None]), min_size=2, unique=True))
    return rules, tuple(axes)


def mesh_axes_wanted(rules: AxisRules, axes: tuple[str | None, ...]) -> list[str]:
    """Every mesh axis the (keyword) rules ask for, once per dimension asking."""
    targets = dict(rules.pairs)
    wanted = [targets[name] for name in axes if name is not None]
    return [a for t in wanted if t is not None for a in ((t,) if isinstance(t, str) else t)]


# -- Flax as the oracle ---------------------------------------------------------------
@given(rules_and_axes(ordered=True))
def test_ordered_rules_agree_with_flax(rules_axes):
    rules, axes = rules_axes
    expected = nn.logical_to_mesh_axes(axes, rules.pairs)
    assert rules.spec(axes) == expected
    assert rules.spec(axes, MESH) == expected  # a mesh adds checks, never changes the answer


@given(rules_and_axes(ordered=True))
def test_explain_gives_the_spec_and_one_decision_per_dimension(rules_axes):
    rules, axes = rules_axes
    first, *notes = str(rules.explain(axes)).splitlines()
    assert first == f"{axes} -> {rules.spec(axes)}"
    for dim, name in enumerate(axes):
        mine = [note for note in notes if note.startswith(f"  dim {dim} ({name!r}): ")]
        decided = [n for n in mine if n.endswith(("matched", "replicated", "replicated (as in Flax)"))]
        assert len(decided) == 1, mine


@given(rules_and_axes(ordered=False))
def test_keyword_rules_agree_with_flax_or_refuse_to_reuse_a_mesh_axis(rules_axes):
    rules, axes = rules_axes
    wanted = mesh_axes_wanted(rules, axes)
    if len(wanted) == len(set(wanted)):
        assert rules.spec(axes) == nn.logical_to_mesh_axes(axes, rules.pairs)
    else:
        with pytest.raises(ShardingError, match=r"can split an array only once.*AxisRules\.from_pairs"):
            rules.spec(axes)


def test_keyword_rules_suggest_an_ordered_list_with_a_fallback():
    with pytest.raises(ShardingError, match=re.escape("AxisRules.from_pairs([..., ('b', None)])")):
        AxisRules(a="model", b="model").spec(("a", "b"))
    with_fallback = AxisRules.from_pairs([("a", "model"), ("b", "model"), ("b", None)])
    assert with_fallback.spec(("a", "b")) == P("model", None)


def test_explain_names_matched_and_skipped_rules():
    rules = AxisRules.from_pairs([("mlp", "model"), ("embed", "model"), ("embed", None), ("mlp", None)])
    assert str(rules.explain(("embed", "mlp", None))).splitlines()[1:] == [
        "  dim 0 ('embed'): rule embed->'model' skipped: mesh axis 'model' already used by dim 1",
        "  dim 0 ('embed'): rule embed->None matched: replicated",
        "  dim 1 ('mlp'): rule mlp->'model' matched",
        "  dim 1 ('mlp'): rule mlp->None skipped: dimension already decided",
        "  dim 2 (None): not annotated: replicated",
    ]
    blocked = str(AxisRules.from_pairs([("a", "model"), ("b", "model")]).explain(("a", "b")))
    assert "dim 1 ('b'): every rule was blocked: replicated (as in Flax)" in blocked


# -- identity fallback: a mesh axis name needs no rule ------------------------------
def test_mesh_axis_names_map_to_themselves_when_the_mesh_is_known():
    assert AxisRules().spec((None, "model"), MESH) == P(None, "model")
    assert AxisRules(batch="data").spec(("batch", "model"), MESH) == P("data", "model")
    layer = numpy_mlp([8, 8], axes=[(None, "model")])
    placed = ms.shard(layer, MESH)  # rules=None
    assert placed[0].weight.sharding.spec == P(None, "model")
    with pytest.raises(ShardingError, match=r"logical axis 'model' \(in \(None, 'model'\)\) has no rule"):
        partition_specs(layer)  # no mesh: 'model' is just a name without a rule


# -- the record explain prints, and bad logical axes ---------------------------------
def test_resolve_records_every_rule_tried_in_order_and_skips_absent_names():
    spec, attempts = resolve(
        ("embed", "mlp"), [("vocab", "data"), ("mlp", "model"), ("embed", "model"), ("embed", None)]
    )
    assert spec == P(None, "model")
    assert [(a.dim, a.name, a.won, a.taken) for a in attempts] == [
        (1, "mlp", True, None),
        (0, "embed", False, ("model", 1)),
        (0, "embed", True, None),
    ]


def test_a_name_on_two_dimensions_is_refused_by_resolve_as_by_the_rules():
    message = r"^logical axes \('mlp', 'mlp'\): \['mlp'\] name more than one dimension$"
    with pytest.raises(ShardingError, match=message):
        resolve(("mlp", "mlp"), [("mlp", "model")])
    with pytest.raises(ShardingError, match=message):
        AxisRules(mlp="model").spec(("mlp", "mlp"))


@pytest.mark.parametrize("method", ["spec", "explain"])
def test_logical_axes_as_one_string_asks_for_a_tuple(method):
    with pytest.raises(ShardingError) as error:
        getattr(AxisRules(embed=None), method)("embed")
    assert str(error.value) == (
        "logical axes must be a tuple with one name (or None) per dimension, got 'embed' "
        "(one string: did you mean a tuple?); for one dimension write ('embed',)"
    )


# -- bad inputs: each named before any work starts (the call, the exception, words its message holds)
BAD_INPUTS = [
    (lambda: AxisRules.from_pairs([("mlp",)]), ShardingError, ["(logical axis, mesh axes) pairs"]),
    (lambda: AxisRules.from_pairs("mlp"), ShardingError, ["(logical axis, mesh axes) pairs"]),
    (lambda: AxisRules(mlp=("model", "model")), ShardingError, ["names a mesh axis twice"]),
    (lambda: AxisRules(mlp="model").spec("mlp"), ShardingError, ["for one dimension write ('mlp',)"]),
]


@pytest.mark.parametrize(("call", "kind", "words"), BAD_INPUTS)
def test_bad_input_is_named(call, kind, words):
    assert_named(call, kind, words)
