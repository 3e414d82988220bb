"""The training loop: sharded steps, evaluation, checkpoints and exact resume.

``fit(model, optimizer, train_data, settings)`` trains as its ``FitSettings`` say
(``minishard.run.settings``). It is deliberately plain Python around two jitted
functions, both from a ``Task`` (``minishard.run.steps``):

* ``train_step(model, opt_state, batch) -> (model, opt_state, loss, *metrics)``
* ``evaluate(model, batch) -> {name: sum, "count": n}``

Both are wrapped by ``Sharded``, so the model and optimizer state keep their
parameter shardings from step to step, and each global batch arrives split
over the mesh's data axis. The position in training is the step, and the batch
of every step is a pure function of the data's settings and the step
(``TrainingData``), so a checkpoint resumes *exactly*: ``--epochs 2`` straight
and ``--epochs 1`` + ``--resume --epochs 2`` end with bit-identical parameters.
A run lasts ``epochs`` (MNIST's shuffled epochs) or ``steps`` (a language
model's random windows); it records, evaluates and checkpoints at the end of
every epoch, or of every ``eval_every`` steps (a ``Horizon``).

>>> import jax, numpy as np
>>> from minishard import SGD, AxisRules, make_mesh, mlp
>>> from minishard.run.data import Dataset
>>> images, labels = np.zeros((64, 2, 2, 1), np.uint8), np.zeros(64, np.int32)
>>> data = Dataset(images, labels, batch_size=16)
>>> model = mlp([4, 8, 2], key=jax.random.key(0))
>>> settings = FitSettings(make_mesh({"data": 8}), AxisRules(batch="data"), epochs=1,
...                        log=lambda line: None)   # batches split 8 ways, one epoch, no lines
>>> model, opt_state, history = fit(model, SGD(0.1), data, settings)
>>> history[0]["epoch"], history[0]["steps"]
(1, 4)
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from minishard.optim import Optimizer
from minishard.pipeline import StackedModel
from minishard.rules import AxisRules
from minishard.run.checkpoint.migrations import before_dropout
from minishard.run.compiling import compile_events, compile_summary
from minishard.run.data import EvalData, TrainingData, to_global
from minishard.run.errors import CheckpointMismatchError, NonFiniteLossError, NonFiniteStateError, ResumeError
from minishard.run.horizon import Horizon, check_counts
from minishard.run.profiling import Speed, check_profile
from minishard.run.resume import (
    changed_setting,
    check_checkpoint_dir,
    check_meta,
    kept,
    name_later,
    open_checkpointer,
    restore,
)
from minishard.run.saying import Say, format_epoch
from minishard.run.settings import EvalSets, FitSettings
from minishard.run.steps import evaluate, make_train_step, own_step
from minishard.sharding import Sharded, shard

__all__ = ["FitSettings", "fit"]

History = list[dict[str, Any]]


def fit(
    model: Any, optimizer: Optimizer, train_data: TrainingData, settings: FitSettings
) -> tuple[Any, Any, History]:
    """Train ``model`` as ``settings`` say, on ``train_data``: ``(model, opt_state, history)``.

    ``history``, a record per epoch (or per ``eval_every`` steps): ``epoch`` (or ``step``),
    ``seconds``, ``speed`` (``Speed.of``), ``loss`` and ``train_<metric>`` of the task (the
    period's means), ``steps``, ``loss_curve``, ``<set>_<metric>`` of the evaluation sets. A
    non-finite loss, or one ``DIVERGED`` times the run's first, stops training before anything
    bad is saved. ``fit`` trains a copy of ``model``.
    """
    how = settings  # where, how long, what is measured, kept and said
    check_checkpoint_dir(
        how.checkpoint_dir, resume=how.resume, resume_from=how.resume_from, overwrite=how.overwrite
    )
    every = {"log_every": how.log_every, "checkpoint_every": how.checkpoint_every}
    check_counts(keep=how.keep, **every, microbatches=how.microbatches)
    horizon = Horizon.of(how.epochs, how.steps, how.eval_every, train_data)
    sharded = Sharded(how.mesh, how.rules, donate_argnums=(0, 1))  # the old model and state die
    step = make_train_step(optimizer, how.task.loss, how.microbatches, how.precision, how.seed)
    train_step = own_step(how.make_step, optimizer, how.seed) if how.make_step else sharded(step)
    run = _Run.start(model, optimizer, how.mesh, how.rules, train_step, how.task.metrics)
    sharding = sharded.batch_sharding
    evaluating = Sharded(how.mesh, how.rules)(how.task.evaluate)
    measure = _evaluator(evaluating, how.eval_data, how.test_data, sharding)
    with contextlib.ExitStack() as open_files:
        checkpointer = open_checkpointer(open_files, how.checkpoint_dir, how.keep, how.overwrite, how.log)
        metrics = open_files.enter_context(open(how.metrics_log, "a")) if how.metrics_log else None
        say = Say(how.log, metrics, how.log_every, how.progress)
        loop = _Loop(run, horizon, train_data, train_step, sharding, measure, checkpointer, say, how)
        loop.in_flight = steps_in_flight(how.mesh)
        if checkpointer is not None and (how.resume or how.resume_from is not None):
            loop.resume(how.resume_from)
        loop.train()
    return run.whole_model(), run.opt_state, run.history


def steps_in_flight(mesh: Mesh) -> int:
    """How many steps ``fit`` dispatches before it reads the oldest one's loss.

    One on an accelerator: while the chip runs step ``n``, the host reads step ``n - 1``'s loss
    and places batch ``n + 1``, so the chip does not idle between steps. None on CPU devices,
    where each step is waited for: XLA:CPU's collectives between simulated devices must not queue.
    """
    return 0 if mesh.devices.flat[0].platform == "cpu" else 1


def _evaluator(
    measure: Callable[..., Any], eval_data: EvalSets, test_data: EvalSets, sharding: NamedSharding
) -> Callable[[Any, bool], dict[str, float]]:
    """``(model, last) -> {"test_acc": 0.95, ...}``: ``measure`` (a compiled ``Task.evaluate``) over
    each set of ``eval_data``, and of ``test_data`` when ``last``; a bare set is named ``test``."""

    def named(sets: EvalSets) -> Mapping[str, EvalData]:
        return {} if sets is None else sets if isinstance(sets, Mapping) else {"test": sets}

    def evaluate_all(model: Any, last: bool) -> dict[str, float]:
        sets = {**named(eval_data), **(named(test_data) if last else {})}
        return {
            f"{name}_{metric}": value
            for name, data in sets.items()
            for metric, value in evaluate(measure, model, data.epoch(0), sharding).items()
        }

    return evaluate_all


@dataclasses.dataclass
class _Run:
    """Where training is: the state, the step, and what was measured since the period began."""

    model: Any
    opt_state: Any
    signature: str  # the model's structure: classes, sizes, activations, logical axes
    signature_before: str  # as saved before the schedule was left out (issue 27): same --microbatches only
    metrics: tuple[str, ...]  # the names of the train step's outputs after the loss
    step: int = 0
    since: int = 0  # the step this period's measuring began at
    sums: list[float] = dataclasses.field(default_factory=list)  # this period's loss and metrics, summed
    curve: list[list[float]] = dataclasses.field(default_factory=list)  # this period's [step, loss] samples
    timed: tuple[int, float] = (0, 0.0)  # this period's steps but a compiling one, and their seconds
    history: History = dataclasses.field(default_factory=list)
    compiled: bool = False  # the first step compiles, and says so
    first_loss: float | None = None  # the run's first (a resumed run's from its history): DIVERGED's unit
    placer: Any = None  # a step that places the state itself (zero.ZeroStep), or None: Sharded's plan

    @classmethod
    def start(
        cls,
        model: Any,
        optimizer: Optimizer,
        mesh: Mesh,
        rules: AxisRules | None,
        step: Any,
        metrics: tuple[str, ...],
    ) -> _Run:
        placer = step if all(hasattr(step, name) for name in ("shard", "init", "gather")) else None
        under = f" under {placer!r}" if placer else ""
        signature = str(jax.tree_util.tree_structure(unscheduled(model))) + under  # the schedule may change
        signatures = signature, str(jax.tree_util.tree_structure(model)) + under
        # A copy: `shard` may reuse the caller's buffers, and the first (donating) step would delete them.
        model = jax.tree_util.tree_map(jnp.copy, shard(model, mesh, rules))
        if placer is not None:
            model = placer.shard(model)
            return cls(model, placer.init(model), *signatures, metrics, placer=placer).restart()
        return cls(model, shard(optimizer.init(model), mesh, rules), *signatures, metrics).restart()

    def restart(self, since: int = 0) -> _Run:
        """A new period, from step ``since``: nothing measured yet."""
        self.sums, self.curve, self.since = [0.0] * (1 + len(self.metrics)), [], since
        self.timed = (0, 0.0)
        return self

    def means(self, steps: int) -> dict[str, float]:
        """The period's mean loss, and ``train_<metric>`` of each metric, over its ``steps`` steps."""
        means = [total / steps for total in self.sums]
        return {"loss": means[0], **{f"train_{name}": mean for name, mean in zip(self.metrics, means[1:])}}

    def whole_model(self) -> Any:
        """The model as evaluated and saved: gathered, if the step keeps it split."""
        return self.placer.gather(self.model) if self.placer is not None else self.model

    def state(self) -> dict[str, Any]:
        return {"model": self.whole_model(), "opt_state": self.opt_state}


def unscheduled(model: Any) -> Any:
    """``model`` without its pipeline: a schedule (``--microbatches``), not parameters, so not the model."""
    return model.replace(pipeline=None) if isinstance(model, StackedModel) else model


DIVERGED = 1e4
"""A loss this many times the run's first has diverged, finite or not, and training stops as for a NaN.

A healthy run's loss falls from its first value, and a spike (the end of a warmup, a bad
batch) is a few times it at most: cross-entropy starts near log(classes), and 10,000 times
that needs logits off by about as much. A run resumed from a diverged step is measured
against its history's first loss, so it stops at once.
"""


def first_loss(history: list[dict[str, Any]], loss: float) -> float:
    """The run's first recorded loss (``[step, loss]`` of its first period's curve), or ``loss`` if none."""
    return next((record["loss_curve"][0][1] for record in history if record.get("loss_curve")), loss)


Pending = tuple[int, list[Any], bool]  # a step dispatched, not yet read: its number, outputs, timed


@dataclasses.dataclass
class _Loop:
    """``fit``'s loop: a run, how long it lasts, what it steps on, and how it measures, saves and says."""

    run: _Run
    horizon: Horizon
    data: TrainingData
    train_step: Any
    sharding: NamedSharding
    measure: Callable[[Any, bool], dict[str, float]]  # (model, last period) -> evaluation metrics
    checkpointer: Any
    say: Say
    # checkpoint_every; info, saved with every checkpoint; task, what the loss is and what a batch
    # is counted in; profile; precision, whose compute dtype is the one whose peak MFU divides by
    settings: FitSettings
    speed: Speed | None = None
    # The checkpoints after the step this run resumed from: another future, which its next save drops.
    abandoned: list[int] = dataclasses.field(default_factory=list)
    in_flight: int = 0  # steps dispatched before the oldest one's loss is read (steps_in_flight)
    pending: collections.deque[Pending] = dataclasses.field(default_factory=collections.deque)
    clock: float = 0.0  # when the last step's loss was read: a timed step runs from there to its own

    def train(self) -> None:
        """Every period from the run's step on: its steps, then its record and a checkpoint."""
        run, horizon = self.run, self.horizon
        check_profile(self.settings.profile, horizon.total)
        for start, stop in horizon.periods(run.step, run.since):
            started = time.perf_counter()
            self.clock = started
            batches = self.data.batches(run.step, stop)
            for batch in self.say.bar(batches, horizon.title(start, stop), stop - start, run.step - start):
                self.take_step(to_global(batch, self.sharding))
                every = self.settings.checkpoint_every
                if every and run.step % every == 0 and run.step < stop:
                    self.settle(0)
                    self.save()  # (a period's last step is saved below, with its record)
                    self.clock = time.perf_counter()  # a save is no step's time
            self.settle(0)
            self.end_period(start, stop, started)
            self.save()

    def settle(self, in_flight: int) -> None:
        """Read the losses of the steps dispatched but not yet read, until ``in_flight`` are left.

        JAX dispatches a step and returns at once; reading its loss (``float``) waits for the chip.
        Reading each step's loss only after the next is dispatched keeps the chip busy while the
        host prepares the next batch. A loss that diverged stops the run before anything is saved.
        """
        run = self.run
        while len(self.pending) > in_flight:
            step, values, timed = self.pending.popleft()
            measured = [float(value) for value in values]  # waits for the step
            now = time.perf_counter()
            if timed:
                run.timed = (run.timed[0] + 1, run.timed[1] + now - self.clock)
            self.clock = now
            run.sums = [total + value for total, value in zip(run.sums, measured)]
            loss = measured[0]
            run.first_loss = run.first_loss or first_loss(run.history, loss)
            if not math.isfinite(loss) or loss > DIVERGED * run.first_loss:
                raise NonFiniteLossError(self.diverged(loss, step))
            if step % self.say.every == 0:
                run.curve.append([step, loss])
                self.say.json({"step": step, **self.horizon.epoch_of(step), "loss": loss, **self.rate()})

    def diverged(self, loss: float, step: int) -> str:
        """Why training stopped: a loss that is NaN, infinite, or ``DIVERGED`` times the first."""
        run = self.run
        where = f"at step {step}{self.horizon.where(step)}{kept(self.checkpointer)}"
        grown = f", over {DIVERGED:,.0f} times the run's first ({run.first_loss:.3g}): diverged,"
        return f"loss is {loss:.3g}{grown if math.isfinite(loss) else ''} {where}. Try a smaller --lr."

    def take_step(self, batch: dict[str, jax.Array]) -> None:
        """Dispatch one step. The first compiles: say how long that took, its memory and speed."""
        run, step = self.run, self.train_step
        if not run.compiled:
            with compile_events() as events:
                outputs = jax.block_until_ready(step(run.model, run.opt_state, batch))
            run.model, run.opt_state, *values = outputs
            compiled = step.lower(run.model, run.opt_state, batch).compile()  # cached: free
            self.say.log(compile_summary(events, compiled))
            devices = list(self.sharding.mesh.devices.flat)
            computes_in = self.settings.precision.params if self.settings.precision else "float32"
            model = unscheduled(run.whole_model())
            self.speed = Speed.of_step(
                self.settings.task.loss, model, batch, self.settings.task.unit, devices, computes_in
            )
            self.say.log(self.speed.said())
            run.compiled = True
            run.step += 1
            self.pending.append((run.step, values, False))
            self.settle(0)  # the compiling step is not timed
            return
        profile = self.settings.profile
        traced = profile is not None and profile.first <= run.step + 1 <= profile.last
        if traced:
            self.settle(0)  # a trace holds its step whole, and only it
        with profile.step(run.step + 1, self.say.log) if profile else contextlib.nullcontext():
            if traced:
                self.clock = time.perf_counter()  # the trace's start is no step's time
            run.model, run.opt_state, *values = step(run.model, run.opt_state, batch)
            run.step += 1
            self.pending.append((run.step, values, True))
            self.settle(0 if traced else self.in_flight)
        if traced:
            self.clock = time.perf_counter()  # nor is its flush

    def rate(self) -> dict[str, Any]:
        """``{"speed": Speed.of(...)}`` of this period's timed steps, or nothing before any."""
        steps, seconds = self.run.timed
        return {"speed": self.speed.of(steps, seconds)} if self.speed and steps else {}

    def end_period(self, start: int, stop: int, started: float) -> None:
        """Record the period (its sums cover all its steps, resumed or not), evaluate, and start the next."""
        run = self.run
        traced = (
            self.settings.profile.taken() if self.settings.profile else 0.0
        )  # said apart: a trace is no step
        record: dict[str, Any] = {
            **self.horizon.label(stop),
            "seconds": time.perf_counter() - started - traced,
        }
        record |= {"trace_seconds": traced} if traced else {}
        record |= run.means(stop - start)
        record |= {"steps": stop - start, "loss_curve": run.curve}  # [step, loss] every log_every steps
        record |= self.rate() | self.measure(run.whole_model(), stop == self.horizon.total)
        run.history.append(record)
        self.say.log(format_epoch(record))
        self.say.json(record)
        run.restart(since=stop)

    def save(self) -> None:
        """Checkpoint the state, where training continues from, and what was measured so far."""
        run = self.run
        if self.checkpointer is None:
            return
        meta = {**self.horizon.position(run.step, run.since), **self.data.data_order}
        meta |= {"sums": run.sums, "curve": run.curve, "history": run.history, "model": run.signature}
        meta |= {"info": self.settings.info} if self.settings.info else {}
        if self.abandoned:
            why = f"this run resumed before them and now saves step {run.step}"
            self.checkpointer.delete(self.abandoned, why)
            self.abandoned = []
        try:
            self.checkpointer.save(run.step, run.state(), meta)
        except NonFiniteStateError as e:
            raise NonFiniteLossError(f"{e}{kept(self.checkpointer)}") from None

    def resume(self, step: int | None) -> None:
        """Load the latest good checkpoint (or ``step``) into the run, and say where training goes on."""
        run, horizon, directory = self.run, self.horizon, self.checkpointer.directory

        def check(saved: int, meta: dict[str, Any]) -> None:
            horizon.since(meta, saved)
            signatures = run.signature, run.signature_before, before_dropout(run.signature)
            check_meta(meta, self.data.data_order, signatures, directory, self.settings.info)

        try:
            found = restore(self.checkpointer, run.state(), step, check, self.say.log)
        except CheckpointMismatchError as error:  # other arrays: name the setting that built them, if saved
            meta = self.checkpointer.read_meta(step)[1]
            if why := changed_setting(directory, meta, self.settings.info):
                raise ResumeError(why) from None
            raise error from None
        if found is None:
            return
        run.step, state, meta = found
        run.since = horizon.since(meta, run.step)
        run.model, run.opt_state = state["model"], state["opt_state"]
        if run.placer is not None:  # saved whole: split it again
            run.model = run.placer.shard(run.model)
        run.sums, run.history, run.curve = meta["sums"], meta["history"], meta.get("curve", [])  # older: none
        if run.step >= horizon.total:
            self.say.log(horizon.finished(run.step))
            return
        self.say.log(horizon.resumed(run.step))
        self.abandoned = name_later(self.checkpointer, step, self.say.log)
