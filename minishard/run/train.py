"""The training loop: sharded steps, evaluation, checkpoints and exact resume.

``fit`` is deliberately plain Python around two jitted functions:

* ``train_step(model, opt_state, batch) -> (model, opt_state, loss, accuracy)``
* ``eval_step(model, batch) -> (correct, count)``

Both are wrapped by ``Sharded``, so the model and optimizer state keep their
parameter shardings from step to step, and each global batch arrives split
over the mesh's data axis. The position in training is ``(epoch, batch
index)`` and the data order is a pure function of ``(shuffle_seed, epoch)``,
so a checkpoint that stores the position resumes *exactly*: ``--epochs 2``
straight and ``--epochs 1`` + ``--resume --epochs 2`` end with bit-identical
parameters.

>>> import jax, numpy as np
>>> from minishard import SGD, AxisRules, make_mesh, mlp
>>> from minishard.run.data import Dataset
>>> images, labels = np.zeros((64, 2, 2, 1), np.uint8), np.zeros(64, np.int32)
>>> data = Dataset(images, labels, batch_size=16)
>>> model = mlp([4, 8, 2], key=jax.random.key(0))
>>> mesh, rules = make_mesh({"data": 8}), AxisRules(batch="data")  # batches split 8 ways
>>> model, opt_state, history = fit(model, SGD(0.1), data, mesh=mesh, rules=rules, epochs=1,
...                                 log=lambda line: None)
>>> history[0]["epoch"], history[0]["steps"]
(1, 4)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import IO, Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from minishard.losses import accuracy, cross_entropy, one_hot
from minishard.optim import SGD
from minishard.pipeline import microbatched
from minishard.rules import AxisRules
from minishard.run.data import Batch, Dataset, to_global
from minishard.sharding import Sharded, shard

try:  # orbax is an optional extra (minishard[checkpoint]): without it, fit trains but cannot checkpoint
    from minishard.run import checkpoint
except ImportError:
    checkpoint = None  # type: ignore[assignment]

__all__ = [
    "CACHE_HIT",
    "COMPILE_PHASES",
    "CheckpointDirError",
    "NonFiniteLossError",
    "ResumeError",
    "TrainingError",
    "check_checkpoint_dir",
    "compile_report",
    "enable_compilation_cache",
    "eval_step",
    "evaluate",
    "fit",
    "format_epoch",
    "make_train_step",
    "microbatched_train_step",
]

History = list[dict[str, Any]]
GlobalBatch = dict[str, jax.Array]  # a Batch placed on the mesh by `to_global`


class TrainingError(RuntimeError):
    """Training cannot go on; the message says why and what was kept."""


class NonFiniteLossError(TrainingError):
    """The loss became NaN or infinite; training stopped before saving the bad state."""


class ResumeError(TrainingError):
    """The checkpoint's data position does not fit this run's data (another seed or batch size)."""


class CheckpointDirError(TrainingError):
    """The checkpoint directory cannot serve this run as asked: another run's checkpoints, no such step."""


def make_train_step(optimizer: SGD) -> Callable[..., Any]:
    """One SGD step on one batch; pure, so ``Sharded``/``jax.jit`` can compile it."""

    def train_step(model: Any, opt_state: Any, batch: GlobalBatch) -> tuple[Any, Any, jax.Array, jax.Array]:
        def loss_fn(model: Any) -> tuple[jax.Array, jax.Array]:
            logits = model(batch["image"])
            return cross_entropy(logits, one_hot(batch["label"], logits.shape[-1])), logits

        (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(model)
        model, opt_state = optimizer.update(model, grads, opt_state)
        return model, opt_state, loss, accuracy(logits, batch["label"])

    return train_step


def microbatched_train_step(optimizer: SGD, m: int) -> Callable[..., Any]:
    """``make_train_step``, its gradients accumulated over ``m`` microbatches (``pipeline.microbatched``).

    The same step (loss and gradients averaged over the batch), one microbatch's
    activations alive at a time: ``minishard train --microbatches M``.
    """

    def loss_fn(model: Any, batch: GlobalBatch) -> tuple[jax.Array, jax.Array]:
        logits = model(batch["image"])
        labels = batch["label"]
        return cross_entropy(logits, one_hot(labels, logits.shape[-1])), accuracy(logits, labels)

    def train_step(model: Any, opt_state: Any, batch: GlobalBatch) -> tuple[Any, Any, jax.Array, jax.Array]:
        (loss, acc), grads = microbatched(loss_fn, m)(model, batch)
        model, opt_state = optimizer.update(model, grads, opt_state)
        return model, opt_state, loss, acc

    return train_step


def eval_step(model: Any, batch: GlobalBatch) -> tuple[jax.Array, jax.Array]:
    """Correct predictions and real examples in a (possibly padded) batch."""
    logits = model(batch["image"])
    correct = (jnp.argmax(logits, axis=-1) == batch["label"]) * batch["mask"]
    return correct.sum(), batch["mask"].sum()


def evaluate(step: Callable[..., Any], model: Any, data: Dataset, sharding: NamedSharding) -> float:
    """Accuracy over a whole split; padding rows are masked out, so every example counts once."""
    correct = count = 0.0
    for batch in data.epoch(0):
        c, n = step(model, to_global(batch, sharding))
        correct, count = correct + float(c), count + float(n)  # float() waits for the step
    return correct / max(count, 1.0)


def check_checkpoint_dir(
    directory: str | os.PathLike[str] | None,
    *,
    resume: bool,
    resume_from: int | None = None,
    overwrite: bool = False,
) -> None:
    """Refuse a checkpoint directory this run cannot use as asked, before any data is loaded.

    A run that does not resume never deletes checkpoints it did not write: it
    stops here, naming them, unless ``overwrite`` says to delete them.
    ``resume_from`` must name a kept step. The directory must be writable (tried,
    not guessed). ``fit`` calls this first; the CLI calls it before the data loads.

    >>> check_checkpoint_dir(None, resume=False)  # no checkpoints: nothing to check
    """
    asked_to_resume = resume or resume_from is not None
    if directory is None:
        if asked_to_resume:
            raise CheckpointDirError("resuming needs a checkpoint directory (checkpoint_dir) to resume from")
        return
    if overwrite and asked_to_resume:
        raise CheckpointDirError(
            "--overwrite deletes the checkpoints that --resume would continue from: give only one of them"
        )
    _checkpoint_module().check_writable(directory)
    steps = checkpoint.saved_steps(directory)
    if resume_from is not None and resume_from not in steps:
        kept = f"it keeps steps {_listed(steps)}" if steps else "it holds no checkpoint"
        raise CheckpointDirError(
            f"--resume-from {resume_from}: {os.fspath(directory)} has no step {resume_from}; {kept}"
        )
    if steps and not asked_to_resume and not overwrite:
        raise CheckpointDirError(
            f"{os.fspath(directory)} holds the checkpoints of another run (steps {_listed(steps)}), which "
            "this run would replace. Continue that run with --resume, give this run another "
            "--checkpoint-dir, or delete them with --overwrite"
        )


def fit(
    model: Any,
    optimizer: SGD,
    train_data: Dataset,
    *,
    mesh: Mesh,
    rules: AxisRules | None = None,
    epochs: int,
    eval_data: Dataset | None = None,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    checkpoint_every: int | None = None,
    keep: int = 3,
    resume: bool = False,
    resume_from: int | None = None,
    overwrite: bool = False,
    log: Callable[[str], None] = print,
    metrics_log: str | os.PathLike[str] | None = None,
    log_every: int = 100,
    progress: bool | None = None,
    microbatches: int = 1,
    make_step: Callable[[SGD], Any] | None = None,
) -> tuple[Any, Any, History]:
    """Train ``model`` for ``epochs`` epochs in total; return ``(model, opt_state, history)``.

    ``history``: per epoch ``epoch``, ``seconds``, ``loss`` (the epoch's mean), ``train_acc``,
    ``test_acc`` (with ``eval_data``) and ``steps``. With ``checkpoint_dir``, a checkpoint
    every ``checkpoint_every`` steps and at each epoch end, the last ``keep`` kept; ``resume``
    continues from the latest good one, ``resume_from`` from that step (``epochs`` is the
    total); another run's checkpoints are refused unless ``overwrite`` (``check_checkpoint_dir``).
    A non-finite loss stops training before anything bad is saved, naming the kept steps.
    ``microbatches > 1`` accumulates gradients; ``make_step(optimizer)`` builds another step
    (``minishard.zero``'s places the state itself). ``fit`` trains a copy of ``model``.
    """
    check_checkpoint_dir(checkpoint_dir, resume=resume, resume_from=resume_from, overwrite=overwrite)
    _check_settings(epochs=epochs, keep=keep, log_every=log_every, checkpoint_every=checkpoint_every,
                    microbatches=microbatches)  # fmt: skip
    sharded = Sharded(mesh, rules, donate_argnums=(0, 1))  # the old model and state are dead after a step
    train_step = make_step(optimizer) if make_step else sharded(_step(optimizer, microbatches))
    test = _tester(Sharded(mesh, rules)(eval_step), eval_data, sharded.batch_sharding)  # None: no eval_data
    run = _Run.start(model, optimizer, mesh, rules, train_step)
    with contextlib.ExitStack() as open_files:
        checkpointer = _open_checkpointer(open_files, checkpoint_dir, keep, overwrite, log)
        if checkpointer is not None and (resume or resume_from is not None):
            _resume(run, checkpointer, train_data, epochs, resume_from, log)
        metrics = open_files.enter_context(open(metrics_log, "a")) if metrics_log else None
        for epoch in range(run.epoch, epochs):
            started = time.perf_counter()
            batches = _progress(train_data.epoch(epoch, run.batch), train_data, epoch, run.batch, progress)
            for index, batch in batches:
                global_batch = to_global(batch, sharded.batch_sharding, ("image", "label"))  # no padding
                loss = _take_step(run, train_step, global_batch, log)
                _check_finite(loss, run, epoch, index, checkpointer)
                if run.step % log_every == 0:
                    _sample_loss(run, loss, epoch, metrics)
                last_batch = index + 1 == train_data.steps_per_epoch  # saved below, at the epoch's end
                if checkpoint_every and run.step % checkpoint_every == 0 and not last_batch:
                    _save(checkpointer, run, train_data, epoch, index + 1)
            _end_epoch(run, epoch, started, train_data.steps_per_epoch, test, log, metrics)
            _save(checkpointer, run, train_data, epoch + 1, 0)
    return run.whole_model(), run.opt_state, run.history


# -- fit's helpers, in the order it calls them ------------------------------------------------
def _check_settings(**settings: int | None) -> None:
    """Each setting an int >= 1 (``checkpoint_every`` may be None: only at epoch ends)."""
    for name, value in settings.items():
        if value is None and name == "checkpoint_every":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"fit: {name} must be an int >= 1, got {value!r}")


@dataclasses.dataclass
class _Run:
    """Where training is: the state, the step, the position in the data, and what was measured."""

    model: Any
    opt_state: Any
    signature: str  # the model's structure: classes, sizes, activations, logical axes
    step: int = 0
    epoch: int = 0  # the epoch to run next ...
    batch: int = 0  # ... from this batch on
    sums: list[float] = dataclasses.field(default_factory=lambda: [0.0, 0.0])  # this epoch's loss, accuracy
    curve: list[list[float]] = dataclasses.field(default_factory=list)  # this epoch's [step, loss] samples
    history: History = dataclasses.field(default_factory=list)
    compiled: bool = False  # the first step compiles, and says so
    placer: Any = None  # a step that places the state itself (zero.ZeroStep), or None: Sharded's plan

    @classmethod
    def start(cls, model: Any, optimizer: SGD, mesh: Mesh, rules: AxisRules | None, step: Any = None) -> _Run:
        placer = step if all(hasattr(step, name) for name in ("shard", "init", "gather")) else None
        signature = str(jax.tree_util.tree_structure(model)) + (f" under {placer!r}" if placer else "")
        # A copy: `shard` may reuse the caller's buffers, and the first (donating) step would delete them.
        model = jax.tree_util.tree_map(jnp.copy, shard(model, mesh, rules))
        if placer is not None:
            model = placer.shard(model)
            return cls(model, placer.init(model), signature, placer=placer)
        return cls(model, shard(optimizer.init(model), mesh, rules), signature)

    def whole_model(self) -> Any:
        """The model as evaluated and saved: gathered, if the step keeps it split."""
        return self.placer.gather(self.model) if self.placer is not None else self.model

    def state(self) -> dict[str, Any]:
        return {"model": self.whole_model(), "opt_state": self.opt_state}


def _step(optimizer: SGD, microbatches: int) -> Callable[..., Any]:
    """The training step: whole batches, or accumulated over ``microbatches``."""
    if microbatches == 1:
        return make_train_step(optimizer)
    return microbatched_train_step(optimizer, microbatches)


def _tester(
    step: Callable[..., Any], data: Dataset | None, sharding: NamedSharding
) -> Callable[[Any], float] | None:
    """``model -> accuracy on data`` (None without data)."""
    return None if data is None else functools.partial(evaluate, step, data=data, sharding=sharding)


def _open_checkpointer(
    open_files: contextlib.ExitStack,
    directory: str | os.PathLike[str] | None,
    keep: int,
    overwrite: bool,
    log: Callable[[str], None],
) -> Any:
    """The run's Checkpointer (None without a directory); ``overwrite`` deletes what it holds, saying so."""
    if directory is None:
        return None
    checkpointer = open_files.enter_context(_checkpoint_module().Checkpointer(directory, keep=keep, log=log))
    if overwrite and (steps := checkpointer.steps()):
        checkpointer.delete(steps, "another run's checkpoints, deleted as asked (--overwrite)")
    return checkpointer


def _resume(
    run: _Run,
    checkpointer: Any,
    data: Dataset,
    epochs: int,
    step: int | None,
    log: Callable[[str], None],
) -> None:
    """Load the latest good checkpoint (or ``step``) into ``run``, and say where training goes on."""
    if not checkpointer.steps():
        log(f"No checkpoint in {checkpointer.directory} yet: starting from scratch")
        return

    def check_meta(meta: dict[str, Any]) -> None:
        _check_meta(meta, data, run.signature, checkpointer.directory)

    run.step, state, meta = checkpointer.restore(run.state(), step=step, check_meta=check_meta)
    run.model, run.opt_state = state["model"], state["opt_state"]
    if run.placer is not None:  # saved whole: split it again
        run.model = run.placer.shard(run.model)
    run.epoch, run.batch, run.sums, run.history = (meta[k] for k in ("epoch", "batch", "sums", "history"))
    run.curve = meta.get("curve", [])  # older checkpoints have none
    if run.epoch >= epochs:
        log(
            f"Nothing to do: the checkpoint of step {run.step} has finished epoch {run.epoch}, "
            f"and epochs={epochs}. Ask for more epochs to train on."
        )
        return
    log(f"Resumed from step {run.step}: epoch {run.epoch + 1}, batch {run.batch}")
    if step is not None and (later := [s for s in checkpointer.steps() if s > step]):
        log(f"The checkpoints of steps {_listed(later)} come after it: this run replaces them as it saves")


def _check_meta(meta: dict[str, Any], data: Dataset, signature: str, directory: Any) -> None:
    """Is this checkpoint's position possible, and is it a checkpoint *of this run*?

    Impossible metadata (missing fields, batch 9999 of 468) raises ValueError:
    the checkpoint is corrupt and ``restore`` falls back. Possible metadata of
    another run (another model, seed or batch size) raises ResumeError: falling
    back would not help, the user must choose.
    """
    for name, kind in (("epoch", int), ("batch", int), ("sums", list), ("history", list)):
        if not isinstance(meta.get(name), kind):
            raise ValueError(f"field {name!r} is {meta.get(name)!r}, not a {kind.__name__}")
    if meta["epoch"] < 0 or not 0 <= meta["batch"] < data.steps_per_epoch:
        raise ValueError(f"position epoch {meta['epoch']}, batch {meta['batch']} of {data.steps_per_epoch}")
    if "model" in meta and meta["model"] != signature:  # older checkpoints did not store it
        raise ResumeError(
            f"the checkpoint in {directory} was saved from another model:\n"
            f"  checkpoint: {_around_difference(meta['model'], signature)}\n"
            f"  this run:   {_around_difference(signature, meta['model'])}\n"
            "resume with the same model settings (--layers, --activation, ...), or start afresh"
        )
    saved = {name: meta.get(name) for name in _data_order(data)}
    if saved != _data_order(data):
        raise ResumeError(
            f"the checkpoint in {directory} was saved with data order {saved}, but this run has "
            f"{_data_order(data)}; resume with the same --seed and --batch-size, or start afresh"
        )


def _data_order(data: Dataset) -> dict[str, int]:
    """What fixes which examples batch ``b`` of epoch ``e`` holds."""
    return {"shuffle_seed": data.shuffle_seed, "batch_size": data.batch_size, "examples": data.num_examples}


def _around_difference(text: str, other: str, context: int = 50) -> str:
    """The part of ``text`` around its first difference from ``other``."""
    first = next((i for i, (a, b) in enumerate(zip(text, other)) if a != b), min(len(text), len(other)))
    start = max(first - context, 0)
    return (
        ("..." if start else "")
        + text[start : first + context]
        + ("..." if first + context < len(text) else "")
    )


def _progress(
    batches: Iterator[Batch], data: Dataset, epoch: int, start: int, show: bool | None
) -> Iterator[tuple[int, Batch]]:
    """Number the batches; draw a progress bar when attached to a terminal (rich, if installed)."""
    numbered = enumerate(batches, start)
    if not (sys.stdout.isatty() if show is None else show):
        yield from numbered
        return
    try:
        from rich.progress import Progress
    except ImportError:
        yield from numbered
        return
    with Progress(transient=True) as bar:
        task = bar.add_task(f"epoch {epoch + 1}", total=data.steps_per_epoch, completed=start)
        for item in numbered:
            yield item
            bar.advance(task)


def _take_step(run: _Run, train_step: Any, batch: GlobalBatch, log: Callable[[str], None]) -> float:
    """One step of ``run``; returns its loss. The first compiles: say how long that took, and its memory."""
    if not run.compiled:
        with _compile_events() as events:
            run.model, run.opt_state, loss, acc = jax.block_until_ready(
                train_step(run.model, run.opt_state, batch)
            )
        log(
            compile_report(events, train_step.lower(run.model, run.opt_state, batch).compile())
        )  # cached: free
        run.compiled = True
    else:
        run.model, run.opt_state, loss, acc = train_step(run.model, run.opt_state, batch)
    run.step += 1
    loss_value = float(loss)  # waits for the step; XLA:CPU must not queue collectives unboundedly
    run.sums = [run.sums[0] + loss_value, run.sums[1] + float(acc)]
    return loss_value


def _check_finite(loss: float, run: _Run, epoch: int, index: int, checkpointer: Any) -> None:
    if not math.isfinite(loss):
        raise NonFiniteLossError(
            f"loss is {loss} at step {run.step} (epoch {epoch + 1}, batch {index})"
            f"{_kept(checkpointer)}. Try a smaller --lr."
        )


def _kept(checkpointer: Any) -> str:
    """``"; the last good checkpoint (step 5) is kept, and steps 3, 4 before it (...)"``."""
    saved = checkpointer.steps() if checkpointer is not None else []
    if not saved:
        return ""
    line = f"; the last good checkpoint (step {saved[-1]}) is kept"
    if len(saved) > 1:
        line += (
            f", and steps {_listed(saved[:-1])} before it (if step {saved[-1]} had already begun to "
            "diverge, resume from one of them with --resume-from STEP)"
        )
    return line


def _listed(steps: list[int]) -> str:
    return ", ".join(map(str, steps))


def _sample_loss(run: _Run, loss: float, epoch: int, metrics: IO[str] | None) -> None:
    run.curve.append([run.step, loss])
    if metrics:
        metrics.write(json.dumps({"step": run.step, "epoch": epoch + 1, "loss": loss}) + "\n")


def _save(checkpointer: Any, run: _Run, data: Dataset, next_epoch: int, next_batch: int) -> None:
    """Checkpoint the state and where training continues from: (epoch, batch) to run next."""
    if checkpointer is None:
        return
    position = {"epoch": next_epoch, "batch": next_batch, **_data_order(data)}
    meta = {**position, "sums": run.sums, "curve": run.curve, "history": run.history, "model": run.signature}
    try:
        checkpointer.save(run.step, run.state(), meta)
    except checkpoint.NonFiniteStateError as e:
        raise NonFiniteLossError(f"{e}{_kept(checkpointer)}") from None


def _end_epoch(
    run: _Run,
    epoch: int,
    started: float,
    steps: int,
    test: Callable[[Any], float] | None,
    log: Callable[[str], None],
    metrics: IO[str] | None,
) -> None:
    """Record the epoch (its sums cover all ``steps``, resumed or not) and start the next at batch 0."""
    record = {
        "epoch": epoch + 1,
        "seconds": time.perf_counter() - started,
        "loss": run.sums[0] / steps,
        "train_acc": run.sums[1] / steps,
        "steps": steps,
        "loss_curve": run.curve,  # [step, loss] every log_every steps, for plots
    }
    if test is not None:
        record["test_acc"] = test(run.whole_model())
    run.history.append(record)
    log(format_epoch(record))
    if metrics:
        metrics.write(json.dumps(record) + "\n")
    run.batch, run.sums, run.curve = 0, [0.0, 0.0], []


def format_epoch(record: dict[str, Any]) -> str:
    """``Epoch 1 in 2.31 s · loss 0.412 · train acc 0.951 · test acc 0.948``."""
    line = f"Epoch {record['epoch']} in {record['seconds']:.2f} s · loss {record['loss']:.3f}"
    line += f" · train acc {record['train_acc']:.3f}"
    if "test_acc" in record:
        line += f" · test acc {record['test_acc']:.3f}"
    return line


def _checkpoint_module() -> Any:
    if checkpoint is None:
        raise ImportError("checkpoint_dir needs orbax-checkpoint: pip install 'minishard[checkpoint]'")
    return checkpoint


# -- compiling: how long it took, and JAX's persistent cache -------------------------------------
COMPILE_PHASES = {
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
    "/jax/core/compile/backend_compile_duration": "XLA",
}
"""JAX's monitoring events for the three phases of compiling a jitted function."""
CACHE_HIT = "/jax/compilation_cache/cache_hits"
_recording: list[tuple[str, float]] | None = None  # the events of the block being watched, if any


@contextlib.contextmanager
def _compile_events() -> Iterator[list[tuple[str, float]]]:
    """Collect JAX's compile events (``jax.monitoring``) while the block runs: (phase, seconds)."""
    global _recording
    _listen_once()
    events: list[tuple[str, float]] = []
    _recording = events
    try:
        yield events
    finally:
        _recording = None


@functools.cache
def _listen_once() -> None:
    """jax.monitoring has no way to remove a listener: register ours once per process."""

    def on_duration(event: str, duration_secs: float, **kwargs: str | int) -> None:
        if _recording is not None and event in COMPILE_PHASES:
            _recording.append((COMPILE_PHASES[event], duration_secs))

    def on_event(event: str, **kwargs: str | int) -> None:
        if _recording is not None and event == CACHE_HIT:
            _recording.append(("cache hit", 0.0))

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    jax.monitoring.register_event_listener(on_event)


def compile_report(events: list[tuple[str, float]], compiled: Any) -> str:
    """``Compiled train_step in 1.20 s (trace 0.05 s, lower 0.10 s, XLA 1.05 s); temporary memory ...``."""
    phases = {phase: sum(s for p, s in events if p == phase) for phase in COMPILE_PHASES.values()}
    line = f"Compiled train_step in {sum(phases.values()):.2f} s ("
    line += ", ".join(f"{phase} {seconds:.2f} s" for phase, seconds in phases.items()) + ")"
    if hits := sum(1 for phase, _ in events if phase == "cache hit"):
        line += f", {hits} program(s) read from the persistent compilation cache"
    memory = compiled.memory_analysis()
    if memory is not None:
        line += f"; temporary memory {memory.temp_size_in_bytes / 1e6:.2f} MB per device"
    return line


def enable_compilation_cache(directory: str | os.PathLike[str], log: Callable[[str], None] = print) -> bool:
    """Turn on JAX's persistent compilation cache in ``directory``; False (and a warning) if unusable.

    Compiled programs are written there, keyed by the program and the
    compiler's version and flags, so a second run with the same model and mesh
    reads them instead of compiling. A directory that cannot be written is
    reported and skipped: the run compiles as usual.
    """
    path = os.fspath(directory)
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".probe-{os.getpid()}")
        with open(probe, "w") as file:
            file.write("ok")
        os.remove(probe)
    except OSError as e:
        log(f"warning: the compilation cache {path} is not usable ({e}); compiling without it")
        return False
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # cache even small programs
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return True
