"""``Style``: the hooks the command line calls for whichever ``--parallel`` style was chosen.

A style that is only a mesh and rules (``minishard.styles``) is a ``Style`` as
it is: its mesh and rules, and the model's own ``Sharded`` step. A style
with a step of its own subclasses it in a module of its own beside this one
(``pipeline``, ``zero``, ``context``, ``experts``) and overrides what it
changes; ``STYLES`` (the package) lists them all. A style never reaches into a
model: it asks the model's entry (``ModelEntry``: ``stack``, ``sequence``, ``experts``).

The hooks, by the question they answer:

* mesh and rules: ``mesh``, ``ways``, ``rules``, ``check_mesh``;
* the flags: ``parsed``, ``finish``, ``fill``, ``check``, ``check_explain``, ``checks_microbatches``;
* build and step: ``build`` (``built``, ``adapt``), ``prepare``, ``make_step``, ``microbatches``,
  ``own_step``, ``own_step_cost``;
* what ``explain`` shows: ``compiles``, ``before_explain``, ``explain_step``, ``after_plan``.

Their calling order, the one place it is written (``flags.finish_train``, ``train.run``,
``explain.check``, ``explain.run`` and ``explain._own_steps`` follow it)::

    parse      parsed (every style's defaults)
    train      finish -> mesh (unless --mesh) -> check_mesh -> fill -> check (the model's first)
               -> rules -> build -> prepare -> make_step, microbatches (fit's settings)
    explain    mesh -> check_explain -> fill -> ways (the batch split)
               -> before_explain (0, or the exit status of a refusal)
               -> the plan only:   rules -> build -> [plan printed] -> after_plan
               -> compiled (compiles, --hardware):   rules -> build -> prepare
                  -> explain_step (None: the report follows) -> after_plan
    --compare  each own_step style, each mesh shape: check_explain -> fill -> check -> build
               -> own_step_cost
    sample     build (the shapes a checkpoint restores into)

>>> Style("dp").mesh(8), Style("dp").ways({"data": 8})
({'data': 8}, 8)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import jax
from jax.sharding import Mesh

from minishard.costs import StepCost
from minishard.optim import Optimizer
from minishard.rules import AxisRules, as_mesh_axes
from minishard.run.cli.flags import Error
from minishard.run.cli.models.entry import Args, ModelEntry  # Args: the parsed flags, one home
from minishard.sharding import ShardedFunction
from minishard.styles import batch_axes, mesh_rules, style_rules

__all__ = ["Args", "Style"]


class Style:
    """A ``--parallel`` style that is its mesh and rules (``minishard.styles``), nothing more.

    Every method is a hook the command line calls for whichever style was chosen
    (grouped and in order: the module's docstring); a style with a step of its own
    subclasses this and overrides some.
    """

    def __init__(self, name: str, like: str | None = None, inner: tuple[Style, ...] = ()) -> None:
        self.name = name
        self.like = like or name  # the style (minishard.styles) whose mesh and rules it uses
        self.inner = inner  # the steps inside this one's (styles.steps): checked and built after it

    # -- mesh and rules ----------------------------------------------------------------------------
    def mesh(self, devices: int) -> dict[str, int]:
        return mesh_rules(self.like, devices)[0]

    def ways(self, mesh: Mapping[str, int]) -> int:
        """The devices a batch splits over: the mesh axes of the dimensions whose rules split it."""
        return math.prod(int(mesh.get(axis, 1)) for axis in batch_axes(self.like))

    def rules(self, overrides: Mapping[str, Any]) -> AxisRules:
        return style_rules(self.like, overrides)

    def check_mesh(self, args: Args, error: Error) -> None:
        """``train --mesh``: every mesh axis the style's rules split over is on it (dp on model=8
        names that conflict, not the model's heads, which would not split over "model"). Without
        --parallel the rules are the mesh's own (``cli_rules``): nothing to check."""
        if args.parallel is None:
            return
        splits: dict[str, list[str]] = {}  # mesh axis -> the logical axes split over it
        for logical, target in self.rules(args.rules).pairs:
            for axis in as_mesh_axes(target):
                splits.setdefault(axis, []).append(logical)
        if missing := [axis for axis in splits if axis not in args.mesh]:
            given = ",".join(f"{name}={size}" for name, size in args.mesh.items())
            own = ",".join(
                f"{name}={size}" for name, size in self.mesh(math.prod(args.mesh.values())).items()
            )
            split = {axis: ", ".join(dict.fromkeys(splits[axis])) for axis in missing}
            what = "; ".join(f"{logical} over {axis!r}" for axis, logical in split.items())
            defaulted = getattr(args, "parallel_default", False)
            default = f" (the {args.model}'s default)" if defaulted else ""
            error(
                f"argument --mesh: --parallel {self.name}{default} splits {what}, and --mesh "
                f"{given} has no such axis; give its mesh ({own}), or a --parallel for these axes"
            )

    # -- the flags ---------------------------------------------------------------------------------
    parsed: ClassVar[Mapping[str, Any]] = {}
    """What every parse holds, whichever style is chosen: ``args.zero`` is None but under ZeRO."""
    checks_microbatches = False
    """Whether it checks ``--microbatches`` itself (a pipeline's schedule takes them, ZeRO refuses
    them by name); every other style accumulates the gradients over them, in ``train`` and
    ``explain`` alike."""

    def finish(self, args: Args, error: Error) -> None:
        """``train``: refuse what the style cannot honour, before the mesh is decided."""

    def fill(self, args: Args, model: ModelEntry) -> None:
        """Defaults the style decides (train and explain): no microbatches but whole batches."""
        args.microbatches = args.microbatches or 1

    def check(self, args: Args, model: ModelEntry, error: Error) -> None:
        """``train``'s flags as the style needs them, with everything filled in; then the inner
        steps'."""
        for step in self.inner:
            step.check(args, model, error)

    def check_explain(self, args: Args, model: ModelEntry, error: Error) -> None:
        """``explain``'s flags as the style needs them; then the inner steps'."""
        for step in self.inner:
            step.check_explain(args, model, error)

    def check_microbatches(self, args: Args, error: Error) -> None:
        """Each microbatch (of accumulation, or of a pipeline) splits evenly over "data" too."""
        m = args.microbatches
        data = args.mesh.get("data", 1)
        if args.batch_size % (m * data):
            error(
                f"argument --microbatches: --batch-size {args.batch_size} does not split into {m} "
                f"microbatches over data={data} devices ({args.batch_size} is not a multiple of {m * data})"
            )

    # -- build and step ----------------------------------------------------------------------------
    own_step = False
    """Whether it trains a step of its own (``own_step_cost`` prices it), not ``fit``'s ``Sharded``
    one."""

    def build(self, model: ModelEntry, args: Args, key: jax.Array) -> Any:
        """The model as this style's step builds it (``built``), then changed by each step inside
        it, and by its own (``adapt``): a ring's attention in a pipeline's stacked blocks."""
        built = self.built(model, args, key)
        for step in (*self.inner, self):
            built = step.adapt(built, model)
        return built

    def built(self, model: ModelEntry, args: Args, key: jax.Array) -> Any:
        """The model as this style's step takes it: the model's own build (a pipeline: its blocks
        stacked)."""
        return model.build(args, key)

    def adapt(self, built: Any, model: ModelEntry) -> Any:
        """What this dimension's step changes in a model built by any (the ring: its attention)."""
        return built

    def prepare(self, built: Any, args: Args, mesh: jax.sharding.Mesh) -> Any:
        """The built model, made ready for its mesh (a pipeline's schedule)."""
        return built

    def make_step(self, args: Args, mesh: jax.sharding.Mesh) -> Callable[[Optimizer], Any] | None:
        """``FitSettings.make_step``: None for ``fit``'s own ``Sharded`` step."""
        return None

    def microbatches(self, args: Args) -> int:
        """``fit``'s gradient accumulation."""
        return int(args.microbatches)

    def own_step_cost(self, entry: ModelEntry, args: Args, built: Any, batch: Any, mesh: Mesh) -> StepCost:
        """``explain --compare``: an ``own_step`` style's step on ``built``, priced on
        ``args.hardware``."""
        raise NotImplementedError(f"--parallel {self.name} trains fit's Sharded step: compare prices it")

    # -- what explain shows ------------------------------------------------------------------------
    compiles = False
    """Whether ``explain`` compiles its step even without ``--hardware`` (to show what it sends)."""

    def before_explain(self, args: Args) -> int:
        """``explain``: 0, or the exit status of a refusal already printed (before any work)."""
        return 0

    def explain_step(
        self,
        args: Args,
        model: ModelEntry,
        step: ShardedFunction,
        optimizer: Optimizer,
        built: Any,
        batch: Any,
    ) -> int | None:
        """``explain`` pricing the train ``step``: an exit status, or None for the plan's report."""
        return None

    def after_plan(self, args: Args, model: ModelEntry, rules: AxisRules) -> int:
        """``explain``, after the plan is printed: what more the style shows; an exit status."""
        return 0
