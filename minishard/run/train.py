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
import functools
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from minishard.losses import accuracy, cross_entropy, one_hot
from minishard.optim import SGD
from minishard.rules import AxisRules
from minishard.run.data import Batch, Dataset, to_global
from minishard.sharding import Sharded, shard

try:  # orbax is an optional extra (minishard[checkpoint]): without it, fit trains but cannot checkpoint
    from minishard.run import checkpoint
except ImportError:
    checkpoint = None  # type: ignore[assignment]

History = list[dict[str, Any]]
GlobalBatch = dict[str, jax.Array]  # a Batch placed on the mesh by `to_global`


class TrainingError(RuntimeError):
    """Training cannot go on; the message says why and what was kept."""


class NonFiniteLossError(TrainingError):
    """The loss became NaN or infinite; training stopped before saving the bad state."""


class ResumeError(TrainingError):
    """The checkpoint's data position does not fit this run's data (another seed or batch size)."""


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
    log: Callable[[str], None] = print,
    metrics_log: str | os.PathLike[str] | None = None,
    log_every: int = 100,
    progress: bool | None = None,
) -> tuple[Any, Any, History]:
    """Train ``model`` for ``epochs`` epochs in total; return ``(model, opt_state, history)``.

    ``history`` has one dict per epoch: ``epoch``, ``seconds``, ``loss``
    (mean over the epoch's steps), ``train_acc``, ``test_acc`` (when
    ``eval_data`` is given) and ``steps``. With ``checkpoint_dir``, a
    checkpoint is written every ``checkpoint_every`` steps and at each epoch
    end; ``resume=True`` continues from the latest good one (``epochs`` is the
    total, so resuming after epoch 1 with ``epochs=2`` trains one more epoch).
    A non-finite loss stops training (``NonFiniteLossError``) before anything
    bad is saved. The caller's ``model`` is left intact: ``fit`` trains a copy.
    """
    for name, value, least in (("epochs", epochs, 1), ("keep", keep, 1), ("log_every", log_every, 1)):
        _check_int(name, value, least)
    if checkpoint_every is not None:
        _check_int("checkpoint_every", checkpoint_every, 1)
    sharded = Sharded(mesh, rules, donate_argnums=(0, 1))  # the old model and state are dead after a step
    train_step = sharded(make_train_step(optimizer))
    evaluate_step = Sharded(mesh, rules)(eval_step)
    signature = str(jax.tree_util.tree_structure(model))  # classes, sizes, activations, logical axes
    # A copy: `shard` may reuse the caller's buffers, and the first (donating) step would delete them.
    model = jax.tree_util.tree_map(jnp.copy, shard(model, mesh, rules))
    opt_state = shard(optimizer.init(model), mesh, rules)
    history: History = []
    first_epoch, start_batch, step, sums = 0, 0, 0, [0.0, 0.0]
    curve: list[list[float]] = []  # this epoch's [step, loss] samples

    with contextlib.ExitStack() as open_files:
        checkpointer = None
        if checkpoint_dir is not None:
            checkpointer = open_files.enter_context(_checkpointer(checkpoint_dir, keep, log))
        if checkpointer is not None and resume:
            if not checkpointer.steps():
                log(f"No checkpoint in {checkpointer.directory} yet: starting from scratch")
            else:

                def check_meta(meta: dict[str, Any]) -> None:
                    _check_meta(meta, train_data, signature, checkpointer.directory)

                state = {"model": model, "opt_state": opt_state}
                step, state, meta = checkpointer.restore(state, check_meta=check_meta)
                model, opt_state = state["model"], state["opt_state"]
                first_epoch, start_batch, sums, history = (
                    meta[k] for k in ("epoch", "batch", "sums", "history")
                )
                curve = meta.get("curve", [])  # older checkpoints have none
                if first_epoch >= epochs:
                    log(
                        f"Nothing to do: the checkpoint of step {step} has finished epoch {first_epoch}, "
                        f"and epochs={epochs}. Ask for more epochs to train on."
                    )
                    return model, opt_state, history
                log(f"Resumed from step {step}: epoch {first_epoch + 1}, batch {start_batch}")
        metrics = open_files.enter_context(open(metrics_log, "a")) if metrics_log else None

        def save(next_epoch: int, next_batch: int) -> None:
            """Checkpoint the state and where training continues from: (epoch, batch) to run next."""
            if checkpointer is None:
                return
            position = {"epoch": next_epoch, "batch": next_batch, **_data_order(train_data)}
            meta = {**position, "sums": sums, "curve": curve, "history": history, "model": signature}
            try:
                checkpointer.save(step, {"model": model, "opt_state": opt_state}, meta)
            except checkpoint.NonFiniteStateError as e:
                raise NonFiniteLossError(f"{e}{_last_good(checkpointer)}") from None

        compiled = None
        for epoch in range(first_epoch, epochs):
            started = time.perf_counter()
            batches = train_data.epoch(epoch, start_batch)
            for index, batch in _progress(batches, train_data, epoch, start_batch, progress):
                global_batch = to_global(
                    batch, sharded.batch_sharding, ("image", "label")
                )  # no mask: no padding
                if compiled is None:  # the first step compiles: say how long it took, and its memory
                    with _compile_events() as events:
                        model, opt_state, loss, acc = jax.block_until_ready(
                            train_step(model, opt_state, global_batch)
                        )
                    compiled = train_step.lower(model, opt_state, global_batch).compile()  # cached: free
                    log(compile_report(events, compiled))
                else:
                    model, opt_state, loss, acc = train_step(model, opt_state, global_batch)
                step += 1
                loss_value = float(loss)  # waits for the step; XLA:CPU must not queue collectives unboundedly
                if not math.isfinite(loss_value):
                    raise NonFiniteLossError(
                        f"loss is {loss_value} at step {step} (epoch {epoch + 1}, batch {index})"
                        f"{_last_good(checkpointer)}. Try a smaller --lr."
                    )
                sums = [sums[0] + loss_value, sums[1] + float(acc)]
                if step % log_every == 0:
                    curve.append([step, loss_value])
                    if metrics:
                        metrics.write(
                            json.dumps({"step": step, "epoch": epoch + 1, "loss": loss_value}) + "\n"
                        )
                last_batch = index + 1 == train_data.steps_per_epoch  # saved below, at the epoch's end
                if checkpoint_every and step % checkpoint_every == 0 and not last_batch:
                    save(epoch, index + 1)
            steps = train_data.steps_per_epoch  # sums cover the whole epoch, resumed or not
            record = {
                "epoch": epoch + 1,
                "seconds": time.perf_counter() - started,
                "loss": sums[0] / steps,
                "train_acc": sums[1] / steps,
                "steps": steps,
                "loss_curve": curve,  # [step, loss] every log_every steps, for plots
            }
            if eval_data is not None:
                record["test_acc"] = evaluate(evaluate_step, model, eval_data, sharded.batch_sharding)
            history.append(record)
            log(format_epoch(record))
            if metrics:
                metrics.write(json.dumps(record) + "\n")
            start_batch, sums, curve = 0, [0.0, 0.0], []
            save(epoch + 1, 0)
    return model, opt_state, history


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


def _check_int(name: str, value: Any, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"fit: {name} must be an int >= {least}, got {value!r}")


def _last_good(checkpointer: Any) -> str:
    saved = checkpointer.steps() if checkpointer is not None else []
    return f"; the last good checkpoint (step {saved[-1]}) is kept" if saved else ""


def format_epoch(record: dict[str, Any]) -> str:
    """``Epoch 1 in 2.31 s · loss 0.412 · train acc 0.951 · test acc 0.948``."""
    line = f"Epoch {record['epoch']} in {record['seconds']:.2f} s · loss {record['loss']:.3f}"
    line += f" · train acc {record['train_acc']:.3f}"
    if "test_acc" in record:
        line += f" · test acc {record['test_acc']:.3f}"
    return line


def _data_order(data: Dataset) -> dict[str, int]:
    """What fixes which examples batch ``b`` of epoch ``e`` holds."""
    return {"shuffle_seed": data.shuffle_seed, "batch_size": data.batch_size, "examples": data.num_examples}


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


def _around_difference(text: str, other: str, context: int = 50) -> str:
    """The part of ``text`` around its first difference from ``other``."""
    first = next((i for i, (a, b) in enumerate(zip(text, other)) if a != b), min(len(text), len(other)))
    start = max(first - context, 0)
    return (
        ("..." if start else "")
        + text[start : first + context]
        + ("..." if first + context < len(text) else "")
    )


def _checkpointer(directory: str | os.PathLike[str], keep: int, log: Callable[[str], None]) -> Any:
    if checkpoint is None:
        raise ImportError("checkpoint_dir needs orbax-checkpoint: pip install 'minishard[checkpoint]'")
    return checkpoint.Checkpointer(directory, keep=keep, log=log)


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
