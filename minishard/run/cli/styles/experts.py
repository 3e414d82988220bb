"""``ExpertStyle``: ``--parallel ep`` and ``dp+ep``, a model's experts over "expert"
(docs/experts.md).

Only a mesh and rules as steps go; its own are the checks (experts and windows that
split over the devices) and what ``explain`` shows: where each expert lives,
one forward pass's all-to-alls against the formula, the routings it drops.

>>> ExpertStyle("dp+ep").ways({"data": 2, "expert": 4})
8
"""

from __future__ import annotations

from typing import Any

import jax

from minishard.experts import MoEStats, capacity, expert_report
from minishard.layers import collect
from minishard.rules import AxisRules
from minishard.run.cli.accelerators import first_devices
from minishard.run.cli.flags import Error
from minishard.run.cli.models.entry import ModelEntry
from minishard.run.cli.styles.style import Args, Style
from minishard.sharding import Sharded, make_mesh, shard

__all__ = ["ExpertStyle"]


class ExpertStyle(Style):
    """``ep`` and ``dp+ep``: a model's experts (its entry's ``ExpertSplit``) over "expert", the
    batch too.

    Only a mesh and rules: the MoE's own constraints make XLA send every expert its slots and the
    results home, two all-to-alls per block forward. ``explain`` shows where each expert lives,
    those all-to-alls against the formula, and the routings one batch drops.
    """

    def check(self, args: Args, model: ModelEntry, error: Error) -> None:
        self.check_explain(args, model, error)  # its "expert" axis is on --mesh: Style.check_mesh

    def check_explain(self, args: Args, model: ModelEntry, error: Error) -> None:
        """A model with experts; the experts over "expert", the batch over "data" x "expert"."""
        split = model.experts
        if split is None or not model.expert_count(args):
            how = f"; add --{split.flag} N (a multiple of the 'expert' devices)" if split else ""
            error(
                f"argument --parallel: {self.name} splits a mixture of experts over 'expert', and the "
                f"{model.label} has none{how}"
            )
        # every mesh shape is tried: one that cannot split says so
        if getattr(args, "compare", False):
            return
        mesh = args.mesh
        experts = model.expert_count(args)
        if experts % (devices := mesh["expert"]):
            error(
                f"argument --{split.flag}: {experts} experts do not split over expert={devices} devices; "
                f"give a multiple of {devices}"
            )
        if args.batch_size is not None and args.batch_size % (ways := self.ways(mesh)):
            error(
                f"argument --batch-size: {args.batch_size} windows do not split over the {ways} devices of "
                f"{' x '.join(f'{a}={n}' for a, n in mesh.items())}; give a multiple of {ways}"
            )

    def before_explain(self, args: Args) -> int:
        """Simulate the devices ``after_plan`` compiles on; 2 (one ``error:`` line) if they
        cannot."""
        return 0 if first_devices(args) is not None else 2

    def after_plan(self, args: Args, model: ModelEntry, rules: AxisRules) -> int:
        """Where each expert lives; one batch's forward compiled: its all-to-alls, its dropped
        routings."""
        assert model.experts is not None  # checked with the flags
        # the report runs a forward pass for its dropped routings: no chip is here
        if args.topology:
            print(f"\n(no expert report: it runs a forward pass, and {args.topology}'s chips are not here)")
            return 0
        mesh = make_mesh(self.mesh(args.devices), devices=first_devices(args))
        built = shard(self.build(model, args, jax.random.key(0)), mesh, rules)
        moe, *_ = layers = model.experts.layers(built)  # every layer alike
        inputs = model.experts.inputs(args, built)
        forward = Sharded(mesh, rules)(_forward)
        _, stats = jax.block_until_ready(forward(built, inputs))
        slots = capacity(inputs.shape[1], moe.n_experts, moe.k, moe.capacity_factor)
        groups = args.batch_size // self.ways(mesh.shape)  # one device's
        program = forward.lower(built, inputs)
        w_in = moe.experts.w_in  # [E, M, H]: the stack "expert" splits
        report = expert_report(program, w_in, stats, groups=groups, slots=slots, layers=len(layers))
        print(f"\n{report}")
        return 0


def _forward(model: Any, inputs: jax.Array) -> tuple[Any, MoEStats | None]:
    """A forward pass, the outputs and the ``MoEStats``: what ``explain`` compiles under an expert
    style."""
    # the outputs too: without them XLA drops the last block's all-to-alls
    return collect(MoEStats, model)(inputs)
