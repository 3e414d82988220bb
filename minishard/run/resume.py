"""What a checkpoint directory promises a run, and how a run continues from one.

* **A run never deletes checkpoints it did not write.** Without ``resume``, a
  directory that holds checkpoints is refused before any data is loaded,
  unless ``overwrite`` says to delete them (``check_checkpoint_dir``).
* **A checkpoint resumes only the run that wrote it**: the same model (its
  structure, printed), the same data order (seed, batch size), else one
  ``ResumeError`` that names the difference (``check_meta``).
* **Every kept step is named** when training must stop (``kept``), so that
  ``--resume-from STEP`` can go back to any of them.

orbax is optional (``minishard[checkpoint]``): without it, a run without a
checkpoint directory trains as usual, and one with it is told what to install.

>>> check_checkpoint_dir(None, resume=False)  # no checkpoints: nothing to check
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping
from typing import Any

from minishard.run.errors import CheckpointDirError, ResumeError

try:  # orbax is an optional extra (minishard[checkpoint]): without it, fit trains but cannot checkpoint
    from minishard.run import checkpoint
except ImportError:
    checkpoint = None  # type: ignore[assignment]

__all__ = [
    "another_setting",
    "changed_setting",
    "check_checkpoint_dir",
    "check_meta",
    "kept",
    "listed",
    "name_later",
    "open_checkpointer",
    "restore",
    "setting_difference",
]


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
        held = f"it keeps steps {listed(steps)}" if steps else "it holds no checkpoint"
        raise CheckpointDirError(
            f"--resume-from {resume_from}: {os.fspath(directory)} has no step {resume_from}; {held}"
        )
    if steps and not asked_to_resume and not overwrite:
        raise CheckpointDirError(
            f"{os.fspath(directory)} holds the checkpoints of another run (steps {listed(steps)}), which "
            "this run would replace. Continue that run with --resume, give this run another "
            "--checkpoint-dir, or delete them with --overwrite"
        )


def open_checkpointer(
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


def restore(
    checkpointer: Any,
    target: Any,
    step: int | None,
    check: Callable[[int, dict[str, Any]], None],
    log: Callable[[str], None],
) -> tuple[int, Any, dict[str, Any]] | None:
    """``(step, state, meta)`` of the latest good checkpoint (or of ``step``); None if there is none yet.

    ``check(step, meta)`` raises ``ValueError`` for metadata that cannot be right (the
    checkpoint is corrupt: the one before is tried) or ``ResumeError`` for
    another run's.
    """
    if not checkpointer.steps():
        log(f"No checkpoint in {checkpointer.directory} yet: starting from scratch")
        return None
    return checkpointer.restore(target, step=step, check_meta=check)  # type: ignore[no-any-return]


def name_later(checkpointer: Any, step: int | None, log: Callable[[str], None]) -> list[int]:
    """Resumed from an older ``step``: the checkpoints after it, named; this run replaces them as it saves."""
    later = [s for s in checkpointer.steps() if s > step] if step is not None else []
    if later:
        log(f"The checkpoints of steps {listed(later)} come after it: this run replaces them as it saves")
    return later


def check_meta(
    meta: dict[str, Any],
    data_order: Mapping[str, Any],
    signatures: tuple[str, ...],
    directory: Any,
    info: Mapping[str, Any] | None = None,
) -> None:
    """Is this checkpoint's metadata possible, and is it a checkpoint *of this run*?

    Impossible metadata (a missing field) raises ValueError: the checkpoint is
    corrupt and ``restore`` falls back. Possible metadata of another run
    (another model, seed or batch size, or learning-rate schedule) raises
    ResumeError: falling back would not help, the user must choose. ``signatures``:
    this run's model, then the forms older versions saved of it; ``info``, what this
    run saves about itself (``FitSettings(info=...)``): its schedule and settings, to
    name the one that differs.
    """
    _check_schedule(meta, (info or {}).get("schedule"), directory)
    for name, kind in (("sums", list), ("history", list)):
        if not isinstance(meta.get(name), kind):
            raise ValueError(f"field {name!r} is {meta.get(name)!r}, not a {kind.__name__}")
    signature = signatures[0]
    if "model" in meta and meta["model"] not in signatures:  # older checkpoints did not store it
        if why := changed_setting(directory, meta, info):
            raise ResumeError(why)
        raise ResumeError(
            f"the checkpoint in {directory} was saved from another model:\n"
            f"  checkpoint: {_around_difference(meta['model'], signature)}\n"
            f"  this run:   {_around_difference(signature, meta['model'])}\n"
            "resume with the same model settings (--layers, --activation, ...), or start afresh"
        )
    saved = {name: meta.get(name) for name in data_order}
    if saved != dict(data_order):
        raise ResumeError(
            f"the checkpoint in {directory} was saved with data order {saved}, but this run has "
            f"{dict(data_order)}; resume with the same --seed and --batch-size, or start afresh"
        )


def changed_setting(directory: Any, meta: dict[str, Any], info: Mapping[str, Any] | None) -> str:
    """Why a checkpoint's arrays are not this run's, when a saved setting says it: another ``--precision``
    (fp16's optimizer state carries a loss scale), another style or model flag; "" when none does."""
    saved = meta.get("info") if isinstance(meta.get("info"), dict) else None
    was, now = (saved or {}).get("precision"), (info or {}).get("precision")
    if was and now and was != now:  # older checkpoints kept none
        return (
            f"the checkpoint in {directory} was saved with --precision {was}; this run asks for {now}, "
            f"and only fp16's optimizer state carries a loss scale: resume with --precision {was}, or "
            "start afresh"
        )
    differs = setting_difference(meta, info)
    return another_setting(directory, differs) if differs else ""


def setting_difference(meta: dict[str, Any], info: Mapping[str, Any] | None) -> str:
    """``"--parallel dp+cp, this run --parallel dp"``: the first saved setting (the style, then the model's
    flags) this run has another value of; "" when none does, or either side kept none."""
    saved = meta.get("info") if isinstance(meta.get("info"), dict) else None
    if not saved or not info:
        return ""
    pairs = [("parallel", saved.get("parallel"), info.get("parallel"))]
    theirs, ours = saved.get("flags") or {}, info.get("flags") or {}
    pairs += [(name, theirs.get(name), ours.get(name)) for name in sorted(theirs.keys() & ours.keys())]
    for name, was, now in pairs:
        if was != now:
            flag = "--" + name.replace("_", "-")
            return f"{flag} {was}, this run {flag} {now}"
    return ""


def another_setting(directory: Any, difference: str) -> str:
    """The message of a checkpoint whose model another setting built."""
    return (
        f"the checkpoint in {directory} was saved under {difference}, which builds another model "
        "(its arrays or its structure); resume under the saved setting, or start afresh "
        "(minishard sample reads a GPT's checkpoint of any style but zero)"
    )


def _check_schedule(meta: dict[str, Any], schedule: Mapping[str, Any] | None, directory: Any) -> None:
    """The learning-rate flags (``info["schedule"]``) are the saved ones; older checkpoints kept none."""
    saved = (meta.get("info") or {}).get("schedule") if isinstance(meta.get("info"), dict) else None
    if not schedule or not isinstance(saved, dict) or saved == dict(schedule):
        return
    flags = sorted(saved.keys() | schedule.keys())
    flag = next(flag for flag in flags if saved.get(flag) != schedule.get(flag))
    raise ResumeError(
        f"the checkpoint in {directory} follows the learning-rate schedule of {flag} {saved.get(flag)}, "
        f"this run {flag} {schedule.get(flag)}: the resumed run would follow neither; resume with "
        f"{flag} {saved.get(flag)}, or start afresh"
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


def kept(checkpointer: Any) -> str:
    """``"; the last good checkpoint (step 5) is kept, and steps 3, 4 before it (...)"``."""
    saved = checkpointer.steps() if checkpointer is not None else []
    if not saved:
        return ""
    line = f"; the last good checkpoint (step {saved[-1]}) is kept"
    if len(saved) > 1:
        line += (
            f", and steps {listed(saved[:-1])} before it (if step {saved[-1]} had already begun to "
            "diverge, resume from one of them with --resume-from STEP)"
        )
    return line


def listed(steps: list[int]) -> str:
    """``[3, 4]`` -> ``"3, 4"``."""
    return ", ".join(map(str, steps))


def _checkpoint_module() -> Any:
    if checkpoint is None:
        raise ImportError("checkpoint_dir needs orbax-checkpoint: pip install 'minishard[checkpoint]'")
    return checkpoint
