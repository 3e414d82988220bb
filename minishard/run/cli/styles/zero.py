"""``ZeroStyle``: ``--parallel zero``, data parallelism written by hand (``minishard.zero``).

dp's mesh and rules, ``minishard.zero``'s step at ZeRO-3 instead of the
model's ``Sharded`` one; ``explain`` shows what that step sends against the
analytic minimum, and what each device holds.

>>> ZeroStyle("zero", like="dp").mesh(8)
{'data': 8}
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import jax
from jax.sharding import Mesh

from minishard.costs import StepCost, cost_report
from minishard.optim import Optimizer
from minishard.run.cli.accelerators import first_devices
from minishard.run.cli.flags import Error
from minishard.run.cli.models import MODELS
from minishard.run.cli.models.entry import ModelEntry
from minishard.run.cli.styles.style import Args, Style
from minishard.run.steps import CLASSIFICATION, Task
from minishard.sharding import ShardedFunction, make_mesh
from minishard.zero import zero_report, zero_train_step

__all__ = ["ZeroStyle"]


class ZeroStyle(Style):
    """``zero``: data parallelism written by hand (``minishard.zero``) at ``LEVEL``: parameters,
    gradients and optimizer state split over "data". dp's mesh ("data" over every device) and
    rules."""

    LEVEL = 3
    parsed: ClassVar[Mapping[str, Any]] = {"zero": None}  # ZeRO's level, under --parallel zero
    compiles = True
    own_step = checks_microbatches = True

    def finish(self, args: Args, error: Error) -> None:
        if args.rules or args.explicit:
            flag = "--rules" if args.rules else "--explicit"
            error(f"argument {flag}: --parallel zero places every array itself (minishard.zero); drop {flag}")
        if args.mesh is not None and list(args.mesh) != ["data"]:
            error(f"argument --mesh: --parallel zero runs on one axis, data=N; got {args.mesh}")
        self.whole_batches(args, error)
        args.zero = self.LEVEL

    def whole_batches(self, args: Args, error: Error) -> None:
        """Its step takes each batch whole: --microbatches would be ignored."""
        if args.microbatches is not None:
            error(
                "argument --microbatches: --parallel zero's step (minishard.zero) takes each batch whole; "
                "drop --microbatches"
            )

    def check(self, args: Args, model: ModelEntry, error: Error) -> None:
        # measured: a small MoE GPT's first loss, 0.015 off
        if model.experts and model.expert_count(args):
            error(
                f"argument --{model.experts.flag}: not with --parallel zero "
                "(its step does not equal one device's for MoE)"
            )

    def check_explain(self, args: Args, model: ModelEntry, error: Error) -> None:
        self.check(args, model, error)
        self.whole_batches(args, error)
        if args.precision != "fp32":  # --memory's: its step computes in float32
            error(
                f"argument --precision: {args.precision} casts Sharded's step, and --parallel zero runs "
                f"ZeRO-{self.LEVEL}'s own in float32 (minishard.zero's bfloat16 keeps the weights whole: "
                "levels 1 and 2, from Python)"
            )
        if args.plot and not args.compare:
            error(
                "argument --plot: --parallel zero has no plan to draw (it splits flat shards); use --compare"
            )

    def make_step(self, args: Args, mesh: jax.sharding.Mesh) -> Callable[[Optimizer], Any]:
        print(f"ZeRO-{self.LEVEL} by hand (minishard.zero): every array split 1/{mesh.size} per device")
        return lambda optimizer: self.step(optimizer, mesh, MODELS[args.model].task)

    def step(self, optimizer: Optimizer, mesh: jax.sharding.Mesh, task: Task = CLASSIFICATION) -> Any:
        """``minishard.zero``'s step at ``LEVEL`` on ``task``'s loss (any optax-like optimizer
        splits)."""
        return zero_train_step(optimizer, mesh, level=self.LEVEL, loss=task.loss)

    def own_step_cost(self, entry: ModelEntry, args: Args, built: Any, batch: Any, mesh: Mesh) -> StepCost:
        step = self.step(entry.compiled_optimizer(args), mesh, entry.task)
        placed = step.shard(built)
        return cost_report(step, (placed, step.init(placed), batch), mesh, self.rules({}), args.hardware)

    def explain_step(
        self,
        args: Args,
        model: ModelEntry,
        train_step: ShardedFunction,
        optimizer: Optimizer,
        built: Any,
        batch: Any,
    ) -> int:
        """What ZeRO's step (built here, in place of the plain ``train_step``) sends, against the
        analytic minimum: an all-gather of the parameters (each padded to split evenly) plus a
        reduce-scatter of their gradients; no gradient all-reduce."""
        n = args.devices
        mesh = make_mesh({"data": args.devices}, devices=first_devices(args))
        step = self.step(optimizer, mesh, model.task)
        # shapes and shardings: a topology holds no arrays
        step_args = (*step.placed_shapes(built), batch)
        print(f"{args.model} under zero (ZeRO-{self.LEVEL} by hand) on {n} devices, batch {args.batch_size}")
        print(zero_report(step, step_args))
        if args.hardware:
            print(cost_report(step, step_args, mesh, self.rules({}), args.hardware))
        return 0
