"""Mixture of experts: many MLPs, a few per token; expert parallelism by two ``all_to_all``\\ s.

A dense transformer runs every token through one MLP. A mixture-of-experts (MoE) layer holds
``E`` MLPs, the *experts*, and a *router* that sends each token to ``k`` of them (1: Switch;
2: GShard): ``E`` times the parameters, ``k`` times the work per token. In four steps:

1. **Routing.** Each token takes its ``k`` best experts (``top_k``), each expert has
   ``capacity`` slots; a routing that finds them full is *dropped* (``dispatch_and_combine``).
   ``moe_layers`` finds a model's ``MoE`` layers.
   Two auxiliary losses keep the router honest (``balance_loss``, ``z_loss``); an ``MoE`` sows
   them and its counts as an ``MoEStats``, and ``layers.collect(MoEStats, f)`` adds up those of
   every ``MoE`` that ``f`` calls.
2. **Dispatch and combine** (``MoE``): one-hot tensors and dense einsums, the tokens to every
   expert's slots ``[E, G, C, M]``, through the ``Experts`` (stacked on ``"expert"``), and back.
3. **Expert parallelism by annotation**: a rule ``expert -> "expert"``; one ``constrain`` makes
   XLA move the tokens (all-to-all) instead of the experts (all-gather).
4. **By hand** (``all_to_all_moe``, as an ``ExpertParallel`` says): in ``jax.shard_map``, one
   ``all_to_all`` sends every expert its slots, a second brings the results home.
   ``expert_report`` reads a compiled forward pass into an ``ExpertReport``: where each expert
   lives, the all-to-alls against the formula, the drops.
   ``moe_activations``: what a layer keeps for its backward pass.

The letters: ``G`` groups (the rows of a batch; each routes its own tokens), ``S`` tokens per
group, ``M`` features, ``E`` experts, ``C`` slots per expert and group, ``H`` hidden units.

>>> moe = MoE(4, k=2, capacity_factor=1.25, features=8, hidden=16, key=jax.random.key(0))
>>> from minishard.layers import collect
>>> y, stats = collect(MoEStats, moe)(jnp.ones((2, 6, 8)))   # 6 equal tokens: the same 2 experts
>>> y.shape, capacity(6, 4, 2, 1.25), int(stats.routed), int(stats.dropped)
((2, 6, 8), 4, 24, 8)
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from minishard import _checks_experts
from minishard.census import Collective, collectives, summary
from minishard.constraints import activation_axes, constrain
from minishard.layers import ACTIVATIONS, Layer, Linear, sow
from minishard.rules import AxisRules, LogicalAxes
from minishard.sharding import partition_specs

# --- 1. routing: k experts per token, C slots per expert -------------------------------------


def capacity(tokens: int, n_experts: int, k: int, capacity_factor: float) -> int:
    """Slots per expert and group: ``ceil(k · tokens / n_experts · capacity_factor)``.

    ``k · tokens`` routings spread evenly give each expert ``k · tokens / n_experts``; the factor is
    slack for an uneven spread. ``n_experts / k`` gives each expert a slot per token: no drops.

    >>> capacity(64, 8, 2, 1.25), capacity(64, 8, 2, 8 / 2)
    (20, 64)
    """
    _checks_experts.capacity(tokens, n_experts, k, capacity_factor)  # positive counts, a factor > 0
    even = k * tokens / n_experts  # routings per expert, spread evenly
    return math.ceil(round(even * capacity_factor, 9))  # round: 1.1·10 is 11.000000000000002


def top_k(probs: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The ``k`` most probable experts of each token, best first: ``(gates, experts)``, each
    ``[..., k]``.

    ``k`` rounds of argmax, each hiding the expert it took. ``jax.lax.top_k`` gives the same,
    but XLA's partitioner gathers its operand onto every device (measured: docs/experts.md).

    >>> gates, experts = top_k(jnp.array([0.1, 0.6, 0.3]), 2)
    >>> gates.tolist(), experts.tolist()
    ([0.6000000238418579, 0.30000001192092896], [1, 2])
    """
    gates = []
    experts = []
    for _ in range(k):
        best = jnp.argmax(probs, axis=-1)
        gates.append(jnp.max(probs, axis=-1))
        experts.append(best)
        probs = jnp.where(jax.nn.one_hot(best, probs.shape[-1], dtype=bool), -1.0, probs)  # taken
    return jnp.stack(gates, axis=-1), jnp.stack(experts, axis=-1)


def dispatch_and_combine(
    gates: jax.Array, experts: jax.Array, n_experts: int, slots_per_expert: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``[G, S, k]`` choices -> ``dispatch``, ``combine`` ``[G, S, E, C]`` and the routings dropped.

    ``dispatch[g, s, e, c] = 1``: token ``s`` of group ``g`` takes slot ``c`` of expert ``e``;
    ``combine`` weighs it by the gate. Slots go in token order, choices best first (a cumsum): no
    slot depends on a later token, so a causal model stays causal. Past the last slot a routing
    gets none: dropped.

    >>> gates = jnp.ones((1, 3, 1))   # k = 1
    >>> experts = jnp.array([[[0], [0], [1]]])
    >>> routed = dispatch_and_combine(gates, experts, n_experts=2, slots_per_expert=1)
    >>> dispatch, combine, dropped = routed
    >>> dispatch[0, :, :, 0].tolist(), int(dropped)   # token 1 found expert 0 full
    ([[1.0, 0.0], [0.0, 0.0], [0.0, 1.0]], 1)
    """
    groups, tokens, k = experts.shape
    chosen = jax.nn.one_hot(experts, n_experts, dtype=jnp.int32)  # [G, S, k, E]
    queue = chosen.reshape(groups, tokens * k, n_experts)  # token by token, choices best first
    ahead = (jnp.cumsum(queue, axis=1) * queue).sum(-1)  # how many in its queue, itself too
    place = ahead.reshape(groups, tokens, k) - 1  # its place in its queue, from 0
    slot = jax.nn.one_hot(place, slots_per_expert, dtype=gates.dtype)  # [G, S, k, C]
    dispatch = jnp.einsum("gske,gskc->gsec", chosen.astype(gates.dtype), slot)
    combine = jnp.einsum("gske,gskc,gsk->gsec", chosen.astype(gates.dtype), slot, gates)
    return dispatch, combine, jnp.sum(place >= slots_per_expert)


def balance_loss(probs: jax.Array, experts: jax.Array) -> jax.Array:
    """Switch's load-balancing loss, ``E · Σ_e f_e · P_e``, averaged over groups: 1 when balanced.

    ``f_e``: the share of routings that chose expert ``e`` (before capacity); ``P_e``: its mean
    probability. ``f`` has no gradient, ``P`` has: the loss pushes probability away from the
    experts chosen most. A uniform ``f`` or ``P`` makes it 1.

    >>> float(balance_loss(jnp.full((1, 4, 2), 0.5), jnp.array([[[0], [0], [0], [1]]])))
    1.0
    """
    n_experts = probs.shape[-1]
    share = jax.nn.one_hot(experts, n_experts).sum(-2).mean(-2) / experts.shape[-1]  # f: [G, E]
    return jnp.mean(n_experts * jnp.sum(share * probs.mean(-2), axis=-1))


def z_loss(logits: jax.Array) -> jax.Array:
    """ST-MoE's router z-loss, the mean of ``logsumexp(logits)²``: small logits, a steady softmax.

    >>> round(float(z_loss(jnp.zeros((1, 1, 4)))), 4)   # log(4)²
    1.9218
    """
    return jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MoEStats:
    """What an ``MoE`` call sows besides its output, a pytree: ``collect(MoEStats, moe)(x)``.

    * ``aux_loss``: ``balance_weight · balance_loss + z_weight · z_loss``, for the training loss;
    * ``balance_loss``, ``z_loss``: the two unweighted, to watch;
    * ``dropped``, ``routed``: routings that found their expert full, of ``k · tokens`` asked.
    """

    aux_loss: jax.Array
    balance_loss: jax.Array
    z_loss: jax.Array
    dropped: jax.Array
    routed: jax.Array


# --- 2. the layer: dispatch, the experts, combine ---------------------------------------------


class Experts(Layer):
    """``n`` MLPs side by side, each weight stacked on a leading ``"expert"`` axis: expert ``e``
    runs
    on ``slots[e]``. The stack is what a rule ``expert -> "expert"`` splits. No biases, as in
    Switch (T5) and Mixtral.

    >>> experts = Experts(4, 8, 16, key=jax.random.key(0))
    >>> experts.w_in.shape, experts.param_logical_axes()["w_in"]
    ((4, 8, 16), ('expert', 'embed', 'mlp'))
    """

    param_fields = ("w_in", "w_out")
    static_fields = ("activation",)

    def __init__(
        self, n: int, features: int, hidden: int, *, key: jax.Array, activation: str = "swish"
    ) -> None:
        _checks_experts.experts(n, features, hidden, activation, tuple(ACTIVATIONS))
        in_key, out_key = jax.random.split(key)
        self.w_in = jax.random.normal(in_key, (n, features, hidden)) / math.sqrt(features)  # fan-in
        self.w_out = jax.random.normal(out_key, (n, hidden, features)) / math.sqrt(hidden)
        self.activation = activation

    def __call__(self, slots: jax.Array) -> jax.Array:
        """``[E, G, C, M] -> [E, G, C, M]``: each expert's MLP on its own slots."""
        hidden = ACTIVATIONS[self.activation]()(jnp.einsum("egcm,emh->egch", slots, self.w_in))
        return jnp.einsum("egch,ehm->egcm", hidden, self.w_out)

    def param_logical_axes(self) -> dict[str, LogicalAxes]:
        return {"w_in": ("expert", "embed", "mlp"), "w_out": ("expert", "mlp", "embed")}


class MoE(Layer):
    """A mixture-of-experts MLP: ``y = moe(x)``, ``x`` of shape ``[..., S, M]``, as a dense MLP.

    The leading dimensions are groups (a GPT's ``[batch, sequence, features]``: one per sequence),
    each routing its ``S`` tokens into ``capacity(S, ...)`` slots per expert. A dropped routing
    adds nothing: ``x + y`` keeps the token's residual. The losses and counts, an ``MoEStats``, are
    sown (``layers.sow``) into the innermost open collection of ``MoEStats``, the one thing a call
    does besides computing ``y`` (while tracing: the program stays pure). ``parallel``: an
    ``ExpertParallel`` runs it by hand (section 4).
    """

    param_fields = ("router", "experts")
    static_fields = ("n_experts", "k", "capacity_factor", "balance_weight", "z_weight", "parallel")

    def __init__(
        self,
        n_experts: int,
        k: int = 2,
        capacity_factor: float = 1.25,
        *,
        features: int,
        hidden: int,
        key: jax.Array,
        activation: str = "swish",
        balance_weight: float = 0.01,
        z_weight: float = 0.001,
        parallel: ExpertParallel | None = None,
    ) -> None:
        _checks_experts.moe(n_experts, k, capacity_factor, balance_weight, z_weight)
        router_key, experts_key = jax.random.split(key)
        scale = (0.1 / features) ** 0.5  # Switch: a small router, near uniform at first; no bias
        self.router = Linear(
            features, n_experts, key=router_key, scale=scale, axes=("embed", None), use_bias=False
        )
        self.experts = Experts(n_experts, features, hidden, key=experts_key, activation=activation)
        self.n_experts = int(n_experts)
        self.k = int(k)
        self.capacity_factor = float(capacity_factor)
        self.balance_weight = float(balance_weight)
        self.z_weight = float(z_weight)
        self.parallel = parallel

    def __call__(self, x: jax.Array) -> jax.Array:
        _checks_experts.moe_input(x, self.router.in_features)
        if self.parallel is not None:
            y, stats = all_to_all_moe(self, x, self.parallel)
            sow(stats)
            return y
        groups = x.reshape(-1, *x.shape[-2:])  # [G, S, M]
        dispatch, combine, stats = self.route(groups)
        sow(stats)  # to the innermost open collection of MoEStats, if one is
        slot_axes = ("expert", *activation_axes(3, None, "embed"))  # [E, G, C, M]; see section 3
        with jax.named_scope("dispatch"):  # XLA's all-to-alls keep the scope's name (section 4)
            slots = jnp.einsum("gsm,gsec->egcm", groups, dispatch)  # to every expert
            slots = constrain(slots, slot_axes)
        with jax.named_scope("experts"):
            out = constrain(self.experts(slots), slot_axes)
        with jax.named_scope("combine"):
            y = jnp.einsum("egcm,gsec->gsm", out, combine)  # each token: its experts', weighted
        return y.reshape(x.shape)

    def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array, MoEStats]:
        """``[G, S, M]`` tokens -> ``dispatch``, ``combine`` ``[G, S, E, C]``, the ``MoEStats``."""
        logits = self.router(x).astype(jnp.float32)  # a softmax in float32, whatever x is
        probs = jax.nn.softmax(logits, axis=-1)
        gates, experts = top_k(probs, self.k)
        c = capacity(x.shape[1], self.n_experts, self.k, self.capacity_factor)
        gates = gates.astype(x.dtype)
        dispatch, combine, dropped = dispatch_and_combine(gates, experts, self.n_experts, c)
        balance = balance_loss(probs, experts)
        z = z_loss(logits)
        aux = self.balance_weight * balance + self.z_weight * z
        routed = jnp.array(experts.size, jnp.int32)  # k · tokens
        return dispatch, combine, MoEStats(aux, balance, z, dropped, routed)


def moe_activations(
    groups: int,
    tokens: int,
    experts: int,
    slots: int,
    features: int,
    hidden: int,
) -> int:
    """Numbers one ``MoE`` layer keeps for its backward pass, per device: ``groups`` of ``tokens``.

    Each device routes its own groups and holds ``experts / D`` experts of every device's slots:
    the same ``E G C`` slots' numbers either way (``C = slots``, ``capacity``). Autodiff keeps the
    router's probabilities ``G S E``, ``dispatch`` and ``combine`` ``2 G S E C``, the slots into
    and out of the experts ``2 E G C M``, and the Swish's input and output ``2 E G C H``.

    Against a dense MLP's ``2 G S H'`` (``H' = k H``, ``moe_mlp``): ``E C ≈ k S · capacity_factor``,
    so the experts keep ``capacity_factor`` times the dense MLP's, their slots
    ``2 k S M · capacity_factor`` more, and the one-hot tensors grow with ``E``: ``2 S E C`` per
    group, ``S²`` for a given k and factor.

    >>> moe_activations(groups=2, tokens=6, experts=4, slots=4, features=8, hidden=16)
    1968
    """
    router = groups * tokens * experts  # G S E: 48 above
    one_hot = 2 * groups * tokens * experts * slots  # dispatch and combine, 2 G S E C: 384
    slotted = 2 * experts * groups * slots * (features + hidden)  # 2 E G C (M + H): 1,536
    return router + one_hot + slotted


def moe_layers(model: Any) -> tuple[MoE, ...]:
    """Every ``MoE`` in ``model``, first to last (the pytree's order); none in a dense model.

    >>> len(moe_layers([MoE(4, features=8, hidden=16, key=jax.random.key(0)), jnp.ones(3)]))
    1
    """
    nodes = jax.tree.leaves(model, is_leaf=lambda node: isinstance(node, MoE))
    return tuple(node for node in nodes if isinstance(node, MoE))


# --- 3. expert parallelism by annotation ------------------------------------------------------
# A rule ``expert -> "expert"`` gives each device E/D experts. With the batch split over the same
# mesh axis (as usual) the slots come out split by group, not by expert: left alone, XLA gathers
# every expert's weights onto every device. The two ``constrain`` calls in ``MoE.__call__`` ask for
# slots split by expert, which XLA reaches with two all-to-alls (docs/experts.md: the rule order).

# --- 4. expert parallelism by hand: two all_to_alls in shard_map ------------------------------


@dataclasses.dataclass(frozen=True)
class ExpertParallel:
    """Experts over ``mesh[expert_axis]`` by hand; the batch's groups over it, and ``data_axis``."""

    mesh: Mesh
    expert_axis: str = "expert"
    data_axis: str | None = None

    def __post_init__(self) -> None:
        _checks_experts.expert_parallel(dict(self.mesh.shape), self.expert_axis, self.data_axis)

    @property
    def batch_axes(self) -> tuple[str, ...]:  # the mesh axes that split the groups
        return (self.expert_axis,) if self.data_axis is None else (self.data_axis, self.expert_axis)


def all_to_all_moe(moe: MoE, x: jax.Array, parallel: ExpertParallel) -> tuple[jax.Array, MoEStats]:
    """``moe(x)`` and its ``MoEStats``, the experts over ``parallel.expert_axis``, by hand.

    The router is whole on every device, the experts split by the layer's own annotations. The
    two ``all_to_all``\\ s each move one device's slots, ``E · G/D · C · M`` numbers; ``jax.grad``
    transposes each into another ``all_to_all``: 4 per layer and training step.
    """
    groups = x.reshape(-1, *x.shape[-2:])  # [G, S, M]
    mesh_shape = dict(parallel.mesh.shape)
    _checks_experts.experts_split(moe.n_experts, groups.shape[0], mesh_shape, parallel.batch_axes)
    rules = AxisRules(expert=parallel.expert_axis, embed=None, mlp=None)  # the experts split
    batch = P(parallel.batch_axes)
    run = jax.shard_map(
        functools.partial(_local, parallel=parallel),
        mesh=parallel.mesh,
        in_specs=(partition_specs(moe, rules), batch),
        out_specs=(batch, P()),
    )
    y, stats = run(moe, groups)
    return y.reshape(x.shape), stats


def _local(moe: MoE, x: jax.Array, parallel: ExpertParallel) -> tuple[jax.Array, MoEStats]:
    """One device: its own groups ``[G/D, S, M]``, the whole router, its ``E/D`` experts."""
    axis = parallel.expert_axis
    dispatch, combine, stats = moe.route(x)  # my tokens, routed here
    with jax.named_scope("dispatch"):  # the compiled program names its all-to-alls by these scopes
        slots = jnp.einsum("gsm,gsec->egcm", x, dispatch)  # [E, G/D, C, M]: my tokens' slots
        # [E/D, G, C, M]: my experts' slots, of every device's tokens
        slots = jax.lax.all_to_all(slots, axis, split_axis=0, concat_axis=1, tiled=True)
    with jax.named_scope("experts"):
        out = moe.experts(slots)  # my experts, on every device's slots
    with jax.named_scope("combine"):
        # [E, G/D, C, M]: my tokens' slots, home from every expert
        out = jax.lax.all_to_all(out, axis, split_axis=1, concat_axis=0, tiled=True)
        y = jnp.einsum("egcm,gsec->gsm", out, combine)
    axes = parallel.batch_axes  # counts add up; losses, each a mean over as many groups, average
    aux = jax.lax.pmean(stats.aux_loss, axes)
    balance = jax.lax.pmean(stats.balance_loss, axes)
    z = jax.lax.pmean(stats.z_loss, axes)
    dropped = jax.lax.psum(stats.dropped, axes)
    routed = jax.lax.psum(stats.routed, axes)
    return y, MoEStats(aux, balance, z, dropped, routed)


@dataclasses.dataclass(frozen=True)
class ExpertReport:
    """``expert_report``: where each expert lives, a forward pass's collectives (the census) beside
    formula, 2 all-to-alls per MoE layer of one device's slots ``[E, G/D, C, M]``, and the drops.

    >>> import minishard as ms
    >>> from minishard.layers import collect
    >>> mesh = ms.make_mesh({"expert": 4}, devices=jax.devices()[:4])
    >>> parallel = ExpertParallel(mesh)
    >>> moe = MoE(8, k=2, features=8, hidden=16, key=jax.random.key(0), parallel=parallel)
    >>> moe = ms.shard(moe, mesh, AxisRules(expert="expert", embed=None, mlp=None))
    >>> x = jax.random.normal(jax.random.key(1), (8, 6, 8))   # 8 groups of 6 tokens: 2 per device
    >>> forward = jax.jit(lambda moe, x: collect(MoEStats, moe)(x)).lower(moe, x)
    >>> compiled = forward.compile()   # one program: its census, its scopes, its stats
    >>> stats = compiled(moe, x)[1]
    >>> slots = capacity(6, 8, 2, 1.25)
    >>> report = expert_report(forward, moe.experts.w_in, stats, groups=2, slots=slots)
    >>> report.found["all-to-all"].bytes == report.formula[1]
    True
    >>> hlo = compiled.as_text().splitlines()   # each all-to-all named by its scope
    >>> named = lambda scope: any(f"/{scope}/all_to_all" in line for line in hlo)
    >>> [scope for scope in ("dispatch", "combine") if named(scope)]
    ['dispatch', 'combine']
    >>> print(report)
    Where each expert lives (8 per block, every block alike):
      experts 0-1: devices 0
      experts 2-3: devices 1
      experts 4-5: devices 2
      experts 6-7: devices 3
    <BLANKLINE>
    One forward pass, compiled:
      all-reduce  x2  20 B  over ('expert',)
      all-to-all  x2  2.0 kB  over ('expert',)
      2 all-to-alls per block, each E x G/D x C x M = 8 x 2 x 2 x 8 x 4 B = 1,024 B
      2 in all: 2,048 B
      dropped 14 of 96 routings (14.6%) at init
    """

    homes: tuple[tuple[tuple[int, int], tuple[int, ...]], ...]  # ((first, end), devices) per shard
    slots: tuple[int, int, int, int]  # one device's [E, G/D, C, M]
    itemsize: int
    layers: int  # MoE layers in the program
    found: Mapping[str, Collective]
    dropped: int
    routed: int

    @property
    def formula(self) -> tuple[int, int]:
        """``(count, bytes)`` of the all-to-alls: each one device's slots, 2 per layer."""
        return 2 * self.layers, 2 * self.layers * math.prod(self.slots) * self.itemsize

    def __str__(self) -> str:
        count, total = self.formula
        share = self.dropped / self.routed
        shape = " x ".join(map(str, self.slots))
        homes = [f"  {_span(first, end)}: devices {_ids(d)}" for (first, end), d in self.homes]
        sent = ["  " + line for line in summary(self.found).splitlines()]
        each = f"  2 all-to-alls per block, each E x G/D x C x M = {shape} x {self.itemsize} B = "
        formula_lines = [f"{each}{total // count:,} B", f"  {count} in all: {total:,} B"]
        dropped = f"  dropped {self.dropped:,} of {self.routed:,} routings ({share:.1%}) at init"
        where = f"Where each expert lives ({self.slots[0]} per block, every block alike):"
        compiled = "One forward pass, compiled:"
        return "\n".join([where, *homes, "", compiled, *sent, *formula_lines, dropped])


def _span(first: int, end: int) -> str:
    return f"expert {first}" if end - first == 1 else f"experts {first}-{end - 1}"


def _ids(devices: tuple[int, ...]) -> str:
    return ", ".join(map(str, devices))


def expert_report(
    program: Any,
    weight: jax.Array,
    stats: MoEStats,
    *,
    groups: int,
    slots: int,
    layers: int = 1,
) -> ExpertReport:
    """An ``ExpertReport`` of a lowered (or compiled) forward pass, whose ``stats`` are given.

    ``weight`` is an expert stack ``[E, M, ...]`` as placed; ``groups`` per device, ``slots`` per
    expert and group."""
    homes: dict[tuple[int, int], list[int]] = {}
    for device, index in weight.sharding.devices_indices_map(weight.shape).items():
        first, end, _ = index[0].indices(weight.shape[0])
        homes.setdefault((first, end), []).append(int(device.id))  # type: ignore[attr-defined]
    where = tuple((rows, tuple(sorted(ids))) for rows, ids in sorted(homes.items()))
    shape = (weight.shape[0], groups, slots, weight.shape[1])  # one device's [E, G/D, C, M]
    found = collectives(program)
    itemsize = weight.dtype.itemsize
    dropped = int(stats.dropped)
    routed = int(stats.routed)
    return ExpertReport(where, shape, itemsize, layers, found, dropped, routed)


__all__ = [
    "ExpertParallel",
    "ExpertReport",
    "Experts",
    "MoE",
    "MoEStats",
    "all_to_all_moe",
    "balance_loss",
    "capacity",
    "dispatch_and_combine",
    "expert_report",
    "moe_activations",
    "moe_layers",
    "top_k",
    "z_loss",
]
