"""``PipelineStyle``: ``--parallel pp`` and ``dp+pp``, and ``--microbatches`` (docs/pipeline.md).

The model's blocks stacked on a "stage" axis (its entry's ``Stacking`` says
how), the batch in microbatches; ``explain`` compiles one step and prints the
pipeline's ticks, bubble and sends, read from the compiled loop. Composed with cp or ep, their
entries run inside it (``Style.inner``, from the dimensions' rules): with cp (``dp+pp+cp``) the
stacked blocks attend by ring, each stage holding its share of the tokens; with ep (``dp+pp+ep``)
they are mixtures of experts, each microbatch's rows over "expert" too, their statistics
leaving the stages (``run_blocks``).

>>> PipelineStyle("dp+pp").mesh(8)
{'data': 2, 'stage': 4}
"""

from __future__ import annotations

import sys
from typing import Any

import jax
from jax.sharding import Mesh

from minishard import pipeline
from minishard.census import instructions
from minishard.composition import ComposedPipeline
from minishard.costs import StepCost, cost_report
from minishard.rules import AxisRules
from minishard.run.cli.accelerators import first_devices
from minishard.run.cli.flags import Error
from minishard.run.cli.models.entry import ModelEntry
from minishard.run.cli.styles.composed import by_dimension
from minishard.run.cli.styles.style import Args, Style
from minishard.run.steps import make_train_step
from minishard.sharding import Sharded, make_mesh
from minishard.styles import SPLITS, batch_axes

__all__ = ["PipelineStyle"]


class PipelineStyle(Style):
    """``pp`` and ``dp+pp``: the model's blocks stacked on a "stage" axis, the batch in
    microbatches.

    By default one stacked block per stage and 2 microbatches per stage. Its
    step is the model's ``Sharded`` step: the pipeline is the model's own
    schedule (``minishard.pipeline``), so microbatches are not accumulated.
    """

    # each flag, and its value that asks for nothing
    refuses = (("remat", "none"), ("explicit", False))
    own_step = checks_microbatches = True

    def fill(self, args: Args, model: ModelEntry) -> None:
        stages = int((getattr(args, "mesh", None) or self.mesh(args.devices)).get("stage", 1))
        args.microbatches = args.microbatches or 2 * stages
        if model.stack is not None:
            model.stack.fill(args, stages)

    def check(self, args: Args, model: ModelEntry, error: Error) -> None:
        """Its blocks split over the stages (the model's entry says how)."""
        self.check_explain(args, model, error)
        for flag, nothing in self.refuses:
            if getattr(args, flag, None) not in (None, nothing):
                error(f"argument --{flag}: not with a pipeline (--parallel {self.name})")
        assert model.stack is not None  # checked above
        model.stack.check(args, args.mesh["stage"], error)
        super().check(args, model, error)

    def check_microbatches(self, args: Args, error: Error) -> None:
        """Each microbatch's rows split over "data", and over every other axis that splits the batch
        (with experts, "expert")."""
        super().check_microbatches(args, error)
        axes = batch_axes(self.name)
        split = args.microbatches * self.ways(args.mesh)
        if set(axes) - {"data"} and args.batch_size % split:
            error(
                f"argument --microbatches: --batch-size {args.batch_size} does not split into "
                f"{args.microbatches} microbatches over the {split // args.microbatches} devices of "
                f"{' x '.join(axes)} ({args.batch_size} is not a multiple of {split})"
            )

    def check_explain(self, args: Args, model: ModelEntry, error: Error) -> None:
        if model.stack is None:
            error(f"argument --parallel: the {model.label} has no blocks to stack on 'stage' for a pipeline")
        super().check_explain(args, model, error)

    def built(self, model: ModelEntry, args: Args, key: jax.Array) -> Any:
        """The model's blocks stacked (its entry's ``Stacking``)."""
        assert model.stack is not None  # checked with the flags
        return model.stack.build(args, key)

    def pipelined(self, model: Any, args: Args, mesh: jax.sharding.Mesh) -> Any:
        """``model`` with its pipeline on ``mesh``: ``args.microbatches``, the batch over "data" and
        its tokens over "context", if the mesh has them."""
        data, tokens = (axis if axis in mesh.axis_names else None for axis in ("data", "context"))
        return model.replace(
            pipeline=ComposedPipeline(mesh, args.microbatches, data_axis=data, sequence_axis=tokens)
        )

    def prepare(self, model: Any, args: Args, mesh: jax.sharding.Mesh) -> Any:
        """``model`` with its pipeline on ``mesh``, said in one line."""
        model = self.pipelined(model, args, mesh)
        pipe = model.pipeline
        p = pipe.stages
        m = pipe.microbatches
        print(
            f"Pipeline: {model.blocks.n} blocks over {p} stages, {m} microbatches of "
            f"{args.batch_size // m} examples, {pipe.ticks} ticks; "
            f"bubble {pipeline.bubble_fraction(p, m):.3f}"
        )
        return model

    def microbatches(self, args: Args) -> int:
        return 1  # a pipeline's microbatches are its own

    def own_step_cost(self, entry: ModelEntry, args: Args, built: Any, batch: Any, mesh: Mesh) -> StepCost:
        optimizer = entry.compiled_optimizer(args)
        built = self.pipelined(built, args, mesh)
        step_args = (built, optimizer.init(built), batch)
        return cost_report(
            make_train_step(optimizer, entry.task.loss), step_args, mesh, self.rules({}), args.hardware
        )

    def before_explain(self, args: Args) -> int:
        """Simulate the devices ``after_plan`` compiles on; 2 (one ``error:`` line) if they
        cannot."""
        split = args.microbatches * self.mesh(args.devices).get("data", 1)
        if args.batch_size % split:  # a microbatch's rows split over "data"
            print(
                f"error: argument --microbatches: a batch of {args.batch_size} is not a multiple of {split}",
                file=sys.stderr,
            )
            return 2
        return 0 if first_devices(args) is not None else 2

    def after_plan(self, args: Args, model: ModelEntry, rules: AxisRules) -> int:
        """Compile one training step of the pipelined model and print what it costs
        (``pipeline_report``)."""
        mesh = make_mesh(self.mesh(args.devices), devices=first_devices(args))
        stacked = self.pipelined(
            jax.eval_shape(lambda: self.build(model, args, jax.random.key(0))), args, mesh
        )
        optimizer = model.compiled_optimizer(args)
        step = Sharded(mesh, rules)(make_train_step(optimizer, model.task.loss))
        example = (stacked, jax.eval_shape(optimizer.init, stacked), model.example(args, args.batch_size))
        report = str(pipeline.pipeline_report(step, example))
        print(f"\nOne training step (batch {args.batch_size}), compiled:")
        print("\n".join("  " + line for line in report.splitlines()))
        if self.name not in SPLITS:  # a composition: whose each collective is
            print(by_dimension(self.name, instructions(step.lower(*example))))
        return 0
