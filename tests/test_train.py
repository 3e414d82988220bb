"""minishard.run.train: ``fit`` on a tiny synthetic dataset, then end to end on the real (offline) MNIST.

The first tests need no data: what ``fit`` promises beyond accuracy (it never
deletes the caller's arrays, saves each step once, refuses to resume a
checkpoint into a run that deals the data out differently). The MNIST tests need
the data prepared by TFDS; `make test` points TFDS_DATA_DIR at it.
"""

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from strategies import assert_trees_equal
from test_checkpoint import read_only_directory

import minishard as ms
from minishard.composition import ComposedPipeline
from minishard.models.vit import ViT, vit_rules
from minishard.pipeline import stacked_mlp
from minishard.run.checkpoint import Checkpointer, saved_steps
from minishard.run.compiling import enable_compilation_cache
from minishard.run.data import Dataset, mnist
from minishard.run.errors import CheckpointDirError, CheckpointError, NonFiniteLossError, ResumeError
from minishard.run.resume import check_checkpoint_dir, check_meta
from minishard.run.steps import CLASSIFICATION, Task, classification_sums, make_train_step
from minishard.run.train import FitSettings, first_loss, fit
from minishard.styles import style_rules

needs_mnist = pytest.mark.skipif(
    not os.path.isdir(os.path.join(os.environ.get("TFDS_DATA_DIR", "/nonexistent"), "mnist")),
    reason="needs MNIST prepared by tfds: set TFDS_DATA_DIR (make test does)",
)

MESH_RULES = {"mesh": ms.make_mesh({"data": 8}), "rules": ms.AxisRules(batch="data"), "progress": False}


def tiny_data(seed: int = 0, batch_size: int = 16) -> Dataset:
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (64, 2, 2, 1), dtype=np.uint8)
    return Dataset(images, images.reshape(64, -1).argmax(axis=1), batch_size=batch_size, shuffle_seed=seed)


def tiny_model():
    return ms.mlp([4, 8, 4], key=jax.random.key(0))


def test_fit_settings_print_what_a_run_changed_and_stay_as_made():
    settings = FitSettings(
        ms.make_mesh({"data": 8}, explicit=True),
        ms.AxisRules(batch="data"),
        epochs=1,
        eval_data={"val": tiny_data()},
        task=CLASSIFICATION,
        keep=3,
        log=print,
    )
    assert str(settings).splitlines() == [
        "FitSettings(",
        "    mesh=make_mesh({'data': 8}, explicit=True),",
        f"    rules={ms.AxisRules(batch='data')!r},",
        "    epochs=1,",
        "    eval_data={'val': <Dataset>},",
        ")",
    ]  # the defaults (task, keep, log) unsaid; a data set by its type
    counted_in_tokens = Task(ms.losses.classification_loss, ("acc",), classification_sums, unit="tokens")
    said = (
        "task=Task(loss=classification_loss, metrics=('acc',), evaluate=classification_sums, unit='tokens')"
    )
    assert said in str(FitSettings(settings.mesh, task=counted_in_tokens))  # functions by their names
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.epochs = 2  # type: ignore[misc]


def test_fit_leaves_the_callers_model_alive():
    model = tiny_model()
    trained, _, _ = fit(
        model, ms.SGD(0.1), tiny_data(), FitSettings(epochs=1, log=lambda line: None, **MESH_RULES)
    )
    assert not any(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(model))
    assert not np.array_equal(model[0].weight, trained[0].weight)


def test_each_step_is_saved_once_even_when_checkpoint_every_meets_an_epoch_end(tmp_path):
    lines = []
    fit(
        tiny_model(),
        ms.SGD(0.1),
        tiny_data(),
        FitSettings(epochs=2, checkpoint_dir=tmp_path, checkpoint_every=2, log=lines.append, **MESH_RULES),
    )
    assert not [line for line in lines if "discarding" in line], lines
    assert sorted(int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()) == [4, 6, 8]  # keep=3


@pytest.mark.parametrize("changed", [{"seed": 1}, {"batch_size": 32}], ids=["seed", "batch_size"])
def test_resume_refuses_a_run_that_deals_the_data_out_differently(tmp_path, changed):
    fit(
        tiny_model(),
        ms.SGD(0.1),
        tiny_data(),
        FitSettings(epochs=1, checkpoint_dir=tmp_path, log=lambda line: None, **MESH_RULES),
    )
    with pytest.raises(ResumeError, match="resume with the same --seed and --batch-size"):
        fit(
            tiny_model(),
            ms.SGD(0.1),
            tiny_data(**changed),
            FitSettings(epochs=2, checkpoint_dir=tmp_path, resume=True, log=lambda line: None, **MESH_RULES),
        )


@pytest.mark.slow  # over 5 s
def test_a_diverging_run_never_saves_non_finite_state_and_resumes_from_the_last_good_one(tmp_path):
    # Update 5 (the 6th) gets an infinite learning rate: its loss, computed before the update, is
    # still finite, but the parameters it produces are not. That state must never reach the disk.
    blows_up = ms.SGD(lambda step: jnp.where(step == 5, jnp.inf, 0.1), momentum=0.9)
    common = {"checkpoint_dir": tmp_path, "checkpoint_every": 1, **MESH_RULES}
    with pytest.raises(
        NonFiniteLossError,
        match=r"not saving step 6: .* non-finite .*last good checkpoint \(step 5\) is kept, and steps 3, 4",
    ):
        fit(tiny_model(), blows_up, tiny_data(), FitSettings(epochs=2, log=print, **common))
    with Checkpointer(tmp_path) as ckpt:
        assert ckpt.steps()[-1] == 5
        target = {"model": tiny_model(), "opt_state": blows_up.init(tiny_model())}
        for step in ckpt.steps():  # every checkpoint on disk holds finite numbers
            state = ckpt.restore(target, step=step)[1]
            assert all(np.isfinite(leaf).all() for leaf in jax.tree_util.tree_leaves(state))
    lines = []
    sane = ms.SGD(0.1, momentum=0.9)
    model, _, history = fit(
        tiny_model(), sane, tiny_data(), FitSettings(epochs=2, resume=True, log=lines.append, **common)
    )
    assert lines[0] == "Resumed from step 5: epoch 2, batch 1"  # a constant rate counts its steps too
    assert len(history) == 2
    assert all(np.isfinite(leaf).all() for leaf in jax.tree_util.tree_leaves(model))


def test_resume_with_another_activation_names_both_models(tmp_path):
    fit(
        tiny_model(),
        ms.SGD(0.1),
        tiny_data(),
        FitSettings(epochs=1, checkpoint_dir=tmp_path, log=print, **MESH_RULES),
    )
    relu = ms.mlp([4, 8, 4], key=jax.random.key(0), activation="relu")
    with pytest.raises(ResumeError, match=r"(?s)saved from another model:.*Swish.*this run: .*ReLU"):
        fit(
            relu,
            ms.SGD(0.1),
            tiny_data(),
            FitSettings(epochs=2, checkpoint_dir=tmp_path, resume=True, **MESH_RULES),
        )


def forget_the_metadata_checksum(step_dir):
    """A checkpoint as versions before the metadata's checksum wrote it: its record holds none."""
    record_file = step_dir / "integrity" / "process_0"
    record = json.loads(record_file.read_text())
    record_file.write_text(json.dumps({name: blocks for name, blocks in record.items() if name != "<meta>"}))


@pytest.mark.slow  # over 5 s
def test_impossible_metadata_is_corrupt_and_falls_back(tmp_path):
    fit(
        tiny_model(),
        ms.SGD(0.1),
        tiny_data(),
        FitSettings(epochs=1, checkpoint_dir=tmp_path, checkpoint_every=2, log=print, **MESH_RULES),
    )
    meta_file = tmp_path / "4" / "meta" / "metadata"
    meta_file.write_text(json.dumps({**json.loads(meta_file.read_text()), "batch": 9999}))
    forget_the_metadata_checksum(tmp_path / "4")  # as an older version wrote it: else the checksum says so
    lines = []
    fit(
        tiny_model(),
        ms.SGD(0.1),
        tiny_data(),
        FitSettings(epochs=2, checkpoint_dir=tmp_path, resume=True, log=lines.append, **MESH_RULES),
    )
    assert "is corrupt (its metadata cannot be right: position epoch 1, batch 9999 of 4)" in lines[0]
    assert lines[0].endswith("falling back to step 2") and lines[1] == "Resumed from step 2: epoch 1, batch 2"


def test_resume_says_when_there_is_nothing_to_do_and_when_it_starts_from_scratch(tmp_path):
    lines = []
    run = {"checkpoint_dir": tmp_path, "resume": True, "log": lines.append, **MESH_RULES}
    fit(tiny_model(), ms.SGD(0.1), tiny_data(), FitSettings(epochs=1, **run))
    assert lines[0] == f"No checkpoint in {tmp_path} yet: starting from scratch"
    _, _, history = fit(tiny_model(), ms.SGD(0.1), tiny_data(), FitSettings(epochs=1, **run))
    assert lines[-1].startswith("Nothing to do: the checkpoint of step 4 has finished epoch 1, and epochs=1")
    assert len(history) == 1


# -- the checkpoint directory: another run's, an older step, read-only storage, an interrupt ---------
def finished_run(directory, **options):
    """One epoch of 4 steps, checkpointed at steps 2 and 4."""
    fit(
        tiny_model(),
        ms.SGD(0.1),
        tiny_data(),
        FitSettings(
            epochs=1,
            checkpoint_dir=directory,
            checkpoint_every=2,
            log=lambda line: None,
            **options,
            **MESH_RULES,
        ),
    )


def files_of(directory):
    return {p: p.read_bytes() for p in directory.rglob("*") if p.is_file() and p.name != ".minishard.lock"}


def test_a_fresh_run_never_deletes_another_runs_checkpoints(tmp_path):
    finished_run(tmp_path)
    before = files_of(tmp_path)
    refused = (
        rf"{re.escape(str(tmp_path))} holds the checkpoints of another run \(steps 2, 4\), which this run "
        r"would replace. Continue that run with --resume, give this run another --checkpoint-dir, or "
        r"delete them with --overwrite"
    )
    with pytest.raises(CheckpointDirError, match=refused):
        check_checkpoint_dir(tmp_path, resume=False)
    with pytest.raises(CheckpointDirError, match=refused):
        finished_run(tmp_path)
    assert files_of(tmp_path) == before  # not a byte changed


def test_overwrite_deletes_the_other_runs_checkpoints_and_says_so(tmp_path):
    finished_run(tmp_path)
    lines = []
    fit(
        tiny_model(),
        ms.SGD(0.1),
        tiny_data(seed=1),
        FitSettings(epochs=1, checkpoint_dir=tmp_path, overwrite=True, log=lines.append, **MESH_RULES),
    )
    assert lines[0] == (
        f"discarding checkpoints [2, 4] in {tmp_path}: "
        "another run's checkpoints, deleted as asked (--overwrite)"
    )
    assert saved_steps(tmp_path) == [4]
    with Checkpointer(tmp_path, read_only=True) as ckpt:  # step 4 is the new run's (seed 1)
        assert (
            ckpt.restore({"model": tiny_model(), "opt_state": ms.SGD(0.1).init(tiny_model())})[2][
                "shuffle_seed"
            ]
            == 1
        )
    with pytest.raises(
        CheckpointDirError, match="--overwrite deletes the checkpoints that --resume would continue"
    ):
        check_checkpoint_dir(tmp_path, resume=True, overwrite=True)
    with pytest.raises(CheckpointDirError, match="resuming needs a checkpoint directory"):
        check_checkpoint_dir(None, resume=False, resume_from=4)


def test_resume_from_an_older_step_replaces_the_later_ones_and_a_step_not_kept_is_named(tmp_path):
    finished_run(tmp_path)
    with pytest.raises(
        CheckpointDirError,
        match=rf"--resume-from 3: {re.escape(str(tmp_path))} has no step 3; it keeps steps 2, 4$",
    ):
        check_checkpoint_dir(tmp_path, resume=True, resume_from=3)
    with pytest.raises(
        CheckpointDirError, match=r"--resume-from 3: .* has no step 3; it holds no checkpoint"
    ):
        check_checkpoint_dir(tmp_path / "new", resume=False, resume_from=3)
    lines = []
    fit(
        tiny_model(),
        ms.SGD(0.1),
        tiny_data(),
        FitSettings(epochs=1, checkpoint_dir=tmp_path, resume_from=2, log=lines.append, **MESH_RULES),
    )
    assert lines[:2] == [
        "Resumed from step 2: epoch 1, batch 2",
        "The checkpoints of steps 4 come after it: this run replaces them as it saves",
    ]
    assert (
        f"discarding checkpoints [4] in {tmp_path}: this run resumed before them and now saves step 4"
        in lines
    )
    assert saved_steps(tmp_path) == [2, 4]


def test_a_diverged_run_names_every_kept_step(tmp_path):
    nan_from_step_3 = ms.SGD(lambda step: jnp.where(step >= 3, jnp.nan, 0.1))  # the 4th update is NaN
    expected = (
        r"not saving step 4: .* non-finite .*; the last good checkpoint \(step 3\) is kept, and steps 1, 2 "
        r"before it \(if step 3 had already begun to diverge, resume from one of them with "
        r"--resume-from STEP\)$"
    )
    with pytest.raises(NonFiniteLossError, match=expected):
        fit(
            tiny_model(),
            nan_from_step_3,
            tiny_data(),
            FitSettings(
                epochs=1, checkpoint_dir=tmp_path, checkpoint_every=1, log=lambda line: None, **MESH_RULES
            ),
        )
    assert saved_steps(tmp_path) == [1, 2, 3]


def test_an_unwritable_checkpoint_directory_is_refused_before_any_work(tmp_path):
    with read_only_directory(tmp_path / "storage") as storage:
        unwritable = (
            rf"checkpoint directory {re.escape(str(storage / 'run'))} is not writable "
            r"\((Read-only file system|Permission denied)\); choose another --checkpoint-dir"
        )
        with pytest.raises(CheckpointError, match=unwritable):
            check_checkpoint_dir(storage / "run", resume=False)
        with pytest.raises(CheckpointError, match=unwritable):
            fit(
                tiny_model(),
                ms.SGD(0.1),
                None,
                FitSettings(epochs=1, checkpoint_dir=storage / "run", **MESH_RULES),
            )  # no data needed


def test_an_interrupt_passes_through_fit_and_leaves_the_directory_usable(tmp_path):
    def interrupt_after_compiling(line):
        if line.startswith("Compiled"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        fit(
            tiny_model(),
            ms.SGD(0.1),
            tiny_data(),
            FitSettings(
                epochs=1, checkpoint_dir=tmp_path / "run", log=interrupt_after_compiling, **MESH_RULES
            ),
        )
    assert saved_steps(tmp_path / "run") == []
    finished_run(tmp_path / "run")  # the lock was released, and there was nothing to refuse
    assert saved_steps(tmp_path / "run") == [2, 4]


# -- the real MNIST ------------------------------------------------------------------
MEGATRON_RULES = {"batch": "data", "embed": None, "mlp": "model", "classes": None}
QUIET = {"log": lambda line: None, "progress": False}


@pytest.fixture(scope="module")
def small_train():  # only MNIST tests ask for it
    return mnist("train[:1024]", 128)


def model_of(sizes, seed=0):
    return ms.mlp(sizes, key=jax.random.key(seed), axes=ms.megatron_axes(len(sizes) - 1))


def sgd():
    return ms.SGD(ms.exponential_decay(0.2, 0.7, 1000), momentum=0.9)


@needs_mnist
@pytest.mark.slow
def test_one_epoch_reaches_95_percent_on_the_full_test_split():
    train, test = mnist("train", 128), mnist("test", 128)
    assert test.num_examples == 10_000
    mesh = ms.make_mesh({"data": 2, "model": 4})
    _, _, history = fit(
        model_of([784, 512, 10]),
        sgd(),
        train,
        FitSettings(mesh=mesh, rules=ms.AxisRules(**MEGATRON_RULES), epochs=1, eval_data=test, **QUIET),
    )
    assert history[0]["test_acc"] >= 0.95, history


def losses_per_step(data, mesh_shape, rules, log):
    fit(
        model_of([784, 64, 10]),
        sgd(),
        data,
        FitSettings(
            mesh=ms.make_mesh(mesh_shape),
            rules=ms.AxisRules(**rules),
            epochs=1,
            metrics_log=log,
            log_every=1,
            **QUIET,
        ),
    )
    return [r["loss"] for r in map(json.loads, log.read_text().splitlines()) if "step" in r]


@needs_mnist
def test_data_tensor_and_2d_parallel_give_the_same_loss_curve(small_train, tmp_path):
    styles = {
        "2d": ({"data": 2, "model": 4}, MEGATRON_RULES),
        "dp": ({"data": 8, "model": 1}, {**MEGATRON_RULES, "mlp": None}),
        "tp": ({"data": 1, "model": 8}, {**MEGATRON_RULES, "batch": None}),
    }
    curves = {name: losses_per_step(small_train, *style, tmp_path / name) for name, style in styles.items()}
    assert len(curves["2d"]) == small_train.steps_per_epoch == 8
    np.testing.assert_allclose(curves["dp"], curves["2d"], rtol=2e-5)
    np.testing.assert_allclose(curves["tp"], curves["2d"], rtol=2e-5)


@needs_mnist
def test_gradient_accumulation_gives_the_loss_curve_of_the_full_batch(small_train, tmp_path):
    def curve(microbatches):
        log = tmp_path / f"m{microbatches}.jsonl"
        fit(
            model_of([784, 64, 10]),
            sgd(),
            small_train,
            FitSettings(
                mesh=ms.make_mesh({"data": 2, "model": 4}),
                rules=ms.AxisRules(**MEGATRON_RULES),
                epochs=1,
                metrics_log=log,
                log_every=1,
                microbatches=microbatches,
                **QUIET,
            ),
        )
        return [r["loss"] for r in map(json.loads, log.read_text().splitlines()) if "step" in r]

    full, accumulated = curve(1), curve(4)  # 4 microbatches of 32 per step of 128
    assert len(full) == 8 and full[-1] < full[0]
    np.testing.assert_allclose(accumulated, full, rtol=1e-5)
    with pytest.raises(ValueError, match=r"fit: microbatches must be an int >= 1, got 0"):
        fit(
            model_of([784, 64, 10]),
            sgd(),
            small_train,
            FitSettings(mesh=ms.make_mesh({"data": 8}), epochs=1, microbatches=0),
        )


@pytest.mark.slow  # over 5 s
def test_microbatches_cut_the_temporary_memory_of_a_vit_step():
    # What `minishard train --microbatches M` reports at compile: the activations of one microbatch.
    model = jax.eval_shape(lambda: ViT(depth=2, key=jax.random.key(0)))
    batch = {
        "image": jax.ShapeDtypeStruct((512, 28, 28, 1), jnp.float32),
        "label": jax.ShapeDtypeStruct((512,), jnp.int32),
    }
    mesh, optimizer = ms.make_mesh({"data": 8}), ms.SGD(0.1)
    temp = {}
    for m, step in ((1, make_train_step(optimizer)), (8, make_train_step(optimizer, microbatches=8))):
        lowered = ms.Sharded(mesh, vit_rules("dp"))(step).lower(
            model, jax.eval_shape(optimizer.init, model), batch
        )
        temp[m] = lowered.compile().memory_analysis().temp_size_in_bytes
    assert temp[8] < temp[1] / 3, temp


@needs_mnist
def test_non_finite_loss_stops_training_and_names_the_step(small_train):
    exploding = ms.SGD(1e6, momentum=0.9)
    # stopped as it diverges (3.1e8 at step 2), before the loss reaches inf or NaN
    stopped = (
        r"loss is (nan|inf|[\d.e+]+, over 10,000 times the run's first \([\d.]+\): diverged,) at step \d+ "
    )
    with pytest.raises(NonFiniteLossError, match=stopped + r"\(epoch 1, batch \d+\)"):
        fit(
            model_of([784, 64, 10]),
            exploding,
            small_train,
            FitSettings(
                mesh=ms.make_mesh({"data": 8}),
                rules=ms.AxisRules(batch="data", embed=None, mlp=None, classes=None),
                epochs=1,
                **QUIET,
            ),
        )


KILLED_TRAINER = """
import jax, numpy as np, minishard as ms
from minishard.run.data import Dataset
from minishard.run.train import FitSettings, fit
rng = np.random.default_rng(0)
data = Dataset(rng.integers(0, 256, (512, 28, 28, 1), np.uint8), rng.integers(0, 10, 512), batch_size=128)
model = ms.mlp([784, 4096, 10], key=jax.random.key(0), axes=ms.megatron_axes(2))
fit(model, ms.SGD(0.01, momentum=0.9), data, FitSettings(
    mesh=ms.make_mesh({"data": 2, "model": 4}),
    rules=ms.AxisRules(batch="data", embed=None, mlp="model", classes=None), epochs=2,
    checkpoint_dir=DIRECTORY, checkpoint_every=1, log=lambda line: None))
"""


@pytest.mark.slow
def test_a_trainer_killed_while_saving_resumes_from_the_previous_checkpoint(tmp_path):
    # MNIST's shape, drawn: the claim is about the processes, and the killed one need not import
    # TensorFlow to read MNIST (4 s of the test's 11). 512 images: 4 steps an epoch, 8 in all, each
    # saved; the kill lands in the save of step 3-8, and the resume runs the 2-6 steps left.
    directory = tmp_path / "ckpt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    script = KILLED_TRAINER.replace("DIRECTORY", repr(str(directory)))
    trainer = subprocess.Popen([sys.executable, "-c", script], env=env)
    try:
        deadline = time.monotonic() + 240
        while not list(directory.glob("[3-9].orbax-checkpoint-tmp*")):  # saving step 3 or later
            assert trainer.poll() is None and time.monotonic() < deadline, "never caught the trainer saving"
            time.sleep(0.005)
        trainer.send_signal(signal.SIGKILL)
    finally:
        trainer.kill()
        trainer.wait(30)

    lines = []
    model = ms.mlp([784, 4096, 10], key=jax.random.key(0), axes=ms.megatron_axes(2))
    rng = np.random.default_rng(0)  # the killed trainer's data
    images, labels = rng.integers(0, 256, (512, 28, 28, 1), np.uint8), rng.integers(0, 10, 512)
    _, _, history = fit(
        model,
        ms.SGD(0.01, momentum=0.9),
        Dataset(images, labels, batch_size=128),
        FitSettings(
            mesh=ms.make_mesh({"data": 8}),
            rules=ms.AxisRules(batch="data", embed=None, mlp=None, classes=None),
            epochs=2,
            checkpoint_dir=directory,
            resume=True,
            log=lines.append,
            progress=False,
        ),
    )
    assert lines[0].startswith(f"taking over the lock of {directory} left by a trainer that is gone"), lines
    assert re.match(r"Resumed from step [2-9]", lines[1]), lines
    assert [record["epoch"] for record in history] == [1, 2]


@needs_mnist
@pytest.mark.slow  # over 5 s
def test_resume_falls_back_past_a_corrupted_checkpoint_and_says_so(small_train, tmp_path):
    run = {
        "mesh": ms.make_mesh({"data": 8}),
        "rules": ms.AxisRules(batch="data", embed=None, mlp=None, classes=None),
        "progress": False,
        "epochs": 1,
        "checkpoint_dir": tmp_path,
    }
    fit(
        model_of([784, 16, 10]),
        sgd(),
        small_train,
        FitSettings(checkpoint_every=4, log=lambda line: None, **run),
    )
    for data_file in (tmp_path / "8").rglob("d/*"):  # the array data of the last checkpoint
        data_file.write_bytes(b"garbage")
    lines = []
    fit(model_of([784, 16, 10]), sgd(), small_train, FitSettings(resume=True, log=lines.append, **run))
    fallback = f"{tmp_path / '8'} is unreadable"
    assert any(fallback in line and "falling back to step 4" in line for line in lines), lines
    assert any(line.startswith("Resumed from step 4") for line in lines), lines


# -- the compilation cache and remat ---------------------------------------------------
CACHED_RUN = """
import sys, jax, numpy as np, minishard as ms
from minishard.run.data import Dataset
from minishard.run.compiling import enable_compilation_cache
from minishard.run.train import FitSettings, fit
enable_compilation_cache(sys.argv[1])
rng = np.random.default_rng(0)
images = rng.integers(0, 256, (64, 2, 2, 1), dtype=np.uint8)
data = Dataset(images, images.reshape(64, -1).argmax(axis=1), batch_size=16)
fit(ms.mlp([4, 8, 4], key=jax.random.key(0)), ms.SGD(0.1), data, FitSettings(
    epochs=1, mesh=ms.make_mesh({"data": 8}), rules=ms.AxisRules(batch="data"), progress=False))
"""


def run_cached(directory) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.getcwd()}  # XLA_FLAGS as conftest set them
    return subprocess.run([sys.executable, "-c", CACHED_RUN, str(directory)], env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip


@pytest.mark.slow
def test_a_second_process_reads_the_train_step_from_the_compilation_cache(tmp_path):
    first = run_cached(tmp_path)
    assert first.returncode == 0, first.stderr
    assert "read from the persistent compilation cache" not in first.stdout
    # Every entry but the train step's damaged (the model's initialisers, its copies): the second
    # process reads the train step, and each damaged entry is a warning and a normal compile. One
    # process for both: each is its own entry.
    entries = list(tmp_path.iterdir())
    kept = [entry for entry in entries if entry.name.startswith("jit_train_step-")]
    assert len(kept) == 1 and len(entries) > 1, [entry.name for entry in entries]
    for entry in set(entries) - set(kept):
        entry.write_bytes(b"garbage")
    second = run_cached(tmp_path)
    assert second.returncode == 0 and "Compiled train_step" in second.stdout, second.stderr
    # JAX's own monitoring event (/jax/compilation_cache/cache_hits), counted by fit, not a timing.
    assert "program(s) read from the persistent compilation cache" in second.stdout
    assert "Error reading persistent compilation cache entry" in second.stderr


def test_an_unusable_compilation_cache_is_a_warning_not_a_crash(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    lines = []
    assert not enable_compilation_cache(tmp_path / "file", log=lines.append)
    assert lines[0].startswith(f"warning: the compilation cache {tmp_path / 'file'} is not usable")


@pytest.mark.slow  # over 5 s
def test_remat_gives_the_same_gradients_and_recomputes_each_block():
    # What remat trades: memory for a second forward pass through each block in the backward
    # pass. The recomputation is visible in the compiled program: more matmuls (the memory it
    # saves: tests/test_remat.py).
    images = np.random.default_rng(0).random((32, 28, 28, 1), dtype=np.float32)
    labels = np.arange(32) % 10

    def loss(model):
        return ms.cross_entropy(model(images), ms.one_hot(labels, 10))

    grads, dots = {}, {}
    for remat in ("none", "full"):
        model = ViT(width=32, depth=3, heads=2, key=jax.random.key(0), remat=remat)
        step = jax.jit(jax.grad(loss))
        grads[remat] = step(model)
        dots[remat] = step.lower(model).compile().as_text().count(" dot(")
    for a, b in zip(
        jax.tree_util.tree_leaves(grads["none"]), jax.tree_util.tree_leaves(grads["full"]), strict=True
    ):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    per_block_forward = 5  # q/k/v, the scores, scores x values, the out projection, and the MLP's two
    assert dots["full"] - dots["none"] >= 3 * per_block_forward - 1, dots


# -- the Vision Transformer --------------------------------------------------------------
@needs_mnist
@pytest.mark.slow
def test_a_small_vit_learns_mnist_on_a_2d_mesh():
    # 128 steps of a 1-block, 32-wide ViT on an 8,192-image slice, heads and MLP split over
    # "model", the batch over "data". Chance is 0.10 and a linear model needs more steps than
    # this to pass 0.80 (measured: 0.66 after one epoch, 0.84 after two; 2 blocks: 0.72, 0.88,
    # in 1.4x the time).
    train, test = mnist("train[:8192]", 128, flatten=False), mnist("test[:2048]", 128, flatten=False)
    steps = 2 * train.steps_per_epoch
    optimizer = ms.SGD(ms.warmup_cosine_decay(0.1, 50, steps), momentum=0.9)
    model = ViT(width=32, depth=1, heads=4, key=jax.random.key(0))
    mesh = ms.make_mesh({"data": 2, "model": 4})
    _, _, history = fit(
        model,
        optimizer,
        train,
        FitSettings(mesh=mesh, rules=vit_rules("2d"), epochs=2, eval_data=test, **QUIET),
    )
    assert history[-1]["test_acc"] >= 0.80, history


@pytest.mark.slow
def test_the_vit_resumes_to_bit_identical_parameters(tmp_path):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (64, 28, 28, 1), dtype=np.uint8)
    data = Dataset(images, np.arange(64) % 10, batch_size=16, flatten=False)
    run = {"mesh": ms.make_mesh({"data": 8}), "rules": vit_rules("dp"), "progress": False, "log": print}

    def train(epochs, **options):
        model = ViT(width=16, depth=1, heads=2, key=jax.random.key(0))
        return fit(model, ms.SGD(0.05, momentum=0.9), data, FitSettings(epochs=epochs, **options, **run))[0]

    straight = train(2, checkpoint_dir=tmp_path)  # saved at the end of each epoch: steps 4 and 8
    resumed = train(2, checkpoint_dir=tmp_path, resume_from=4)  # epoch 2 again, from epoch 1's state
    assert_trees_equal(jax.device_get(resumed), jax.device_get(straight))


# -- by steps: batches drawn per step (a language model's random windows), records every eval_every steps ----
class DrawnBatches:
    """Each step's batch drawn from ``(seed, step)``, as a language model's random windows are: no epochs."""

    steps_per_epoch = None

    def __init__(self, seed: int = 0, batch_size: int = 16):
        self.seed, self.batch_size = seed, batch_size
        self.images = np.random.default_rng(0).integers(0, 256, (64, 4)).astype(np.float32) / 255

    def batches(self, start, stop):
        for step in range(start, stop):
            rows = np.random.default_rng([self.seed, step]).integers(0, 64, self.batch_size)
            yield {"image": self.images[rows], "label": self.images[rows].argmax(axis=1).astype(np.int32)}

    @property
    def data_order(self):
        return {"seed": self.seed, "batch_size": self.batch_size}


def by_steps(directory, steps, lines=None, **options):
    held_out = Dataset(np.zeros((24, 2, 2, 1), np.uint8), np.zeros(24, np.int32), 8, shuffle=False)
    return fit(
        tiny_model(),
        ms.SGD(0.1, momentum=0.9),
        DrawnBatches(),
        FitSettings(
            steps=steps,
            eval_every=4,
            eval_data={"val": held_out},
            test_data=held_out,
            checkpoint_dir=directory,
            log=(lines if lines is not None else []).append,
            **options,
            **MESH_RULES,
        ),
    )


def test_fit_by_steps_records_every_eval_every_steps_and_tests_after_the_last(tmp_path):
    lines = []
    _, _, history = by_steps(tmp_path, 10, lines)
    assert [(r["step"], r["steps"]) for r in history] == [(4, 4), (8, 4), (10, 2)]  # the last one shorter
    assert ["val_acc" in r for r in history] == [True] * 3 and ["test_acc" in r for r in history] == [0, 0, 1]
    records = [line for line in lines if line.startswith("Step ")]
    speed = r"\([\d,]+ examples/s, MFU [\d.e-]+%\)"  # the steps after the compiling one
    assert re.fullmatch(
        rf"Step 4 in [\d.]+ s {speed} · loss [\d.]+ · train acc [\d.]+ · val acc [\d.]+", records[0]
    )
    assert re.search(r"· val acc [\d.]+ · test acc [\d.]+$", records[-1]) and "epoch" not in lines[-1]
    assert saved_steps(tmp_path) == [4, 8, 10]


@pytest.mark.slow  # four short runs, each compiling its steps
def test_a_run_by_steps_resumes_to_the_parameters_of_a_straight_run(tmp_path):
    straight, _, _ = by_steps(None, 10)  # no checkpoints: saving costs more than its steps
    by_steps(tmp_path / "resumed", 6, checkpoint_every=5)  # checkpoints at 4, 5 and 6 (its end)
    lines = []
    resumed, _, history = by_steps(tmp_path / "resumed", 10, lines, resume_from=5)
    assert lines[:2] == [
        "Resumed from step 5",
        "The checkpoints of steps 6 come after it: this run replaces them as it saves",
    ]
    assert [r["step"] for r in history] == [4, 8, 10] and history[1]["steps"] == 4  # steps 5-8, 5 resumed
    assert any(line.startswith("discarding checkpoints [6] in") for line in lines)
    assert saved_steps(tmp_path / "resumed") == [5, 8, 10]
    assert_trees_equal(resumed, straight)  # every batch a pure function of the step: bit-identical
    _, _, history = by_steps(tmp_path / "resumed", 14, lines, resume=True)  # on from the end of a run
    assert [(r["step"], r["steps"]) for r in history] == [(4, 4), (8, 4), (10, 2), (12, 2), (14, 2)]
    _, _, done = by_steps(tmp_path / "resumed", 14, lines, resume=True)
    assert lines[-1] == "Nothing to do: the checkpoint of step 14 has trained 14 steps, and steps=14. " \
        "Ask for more steps to train on." and len(done) == 5  # fmt: skip


def test_fit_takes_epochs_or_steps_and_eval_every_only_by_steps():
    data = tiny_data()
    cases = [
        (dict(epochs=1, steps=4), "give epochs or steps, one of them; got epochs=1, steps=4"),
        ({}, "give epochs or steps"),
        (dict(epochs=1, eval_every=2), "eval_every is for training by steps"),
        (dict(steps=0), "steps must be an int >= 1, got 0"),
    ]
    for options, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            fit(tiny_model(), ms.SGD(0.1), data, FitSettings(**options, **MESH_RULES))
    with pytest.raises(ValueError, match=r"has no epochs \(each step draws its own batch\); give steps"):
        fit(tiny_model(), ms.SGD(0.1), DrawnBatches(), FitSettings(epochs=1, **MESH_RULES))


def test_a_finite_divergence_stops_training_as_a_nan_does():
    """A loss DIVERGED (10,000) times the run's first stops the run, named (measured: 5.5e4, step 4)."""
    leaps = ms.SGD(lambda step: jnp.where(step >= 2, 1e5, 0.1))  # the 3rd update is far too large
    with pytest.raises(NonFiniteLossError) as stopped:
        fit(tiny_model(), leaps, tiny_data(), FitSettings(epochs=3, log=lambda line: None, **MESH_RULES))
    message = str(stopped.value)
    assert re.fullmatch(
        r"loss is [\d.e+]+, over 10,000 times the run's first \(1\.\d+\): diverged, at step \d \(epoch 1, "
        r"batch \d\)\. Try a smaller --lr\.",
        message,
    ), message


def test_a_resumed_run_measures_divergence_against_its_historys_first_loss():
    history = [{"epoch": 1, "loss_curve": []}, {"epoch": 2, "loss_curve": [[40, 2.3], [41, 2.2]]}]
    assert first_loss(history, 2.9e18) == 2.3 and first_loss([], 1.5) == 1.5


@pytest.mark.slow  # over 5 s
def test_a_pipelined_run_resumes_with_other_microbatches(tmp_path):
    """The microbatches are a schedule, not parameters: changing them on resume keeps the model."""
    mesh = ms.make_mesh({"data": 4, "stage": 2})
    rules = style_rules("dp+pp")

    def piped(m):
        model = stacked_mlp([4, 8, 8, 8, 4], key=jax.random.key(0))
        return model.replace(pipeline=ComposedPipeline(mesh, m, data_axis="data"))

    quiet = dict(mesh=mesh, rules=rules, checkpoint_dir=tmp_path, log=lambda line: None, progress=False)
    fit(piped(2), ms.SGD(0.1), tiny_data(), FitSettings(epochs=1, **quiet))
    _, _, history = fit(piped(4), ms.SGD(0.1), tiny_data(), FitSettings(epochs=2, resume=True, **quiet))
    assert [record["epoch"] for record in history] == [1, 2]


def test_a_pipelined_checkpoint_saved_with_its_schedule_in_the_signature_resumes(tmp_path):
    """Before issue 27 the signature held the pipeline: such a checkpoint resumes at its --microbatches."""
    mesh = ms.make_mesh({"data": 4, "stage": 2})
    model = stacked_mlp([4, 8, 8, 8, 4], key=jax.random.key(0))
    model = model.replace(pipeline=ComposedPipeline(mesh, 2, data_axis="data"))
    quiet = dict(mesh=mesh, rules=style_rules("dp+pp"), checkpoint_dir=tmp_path, log=lambda line: None)
    fit(model, ms.SGD(0.1), tiny_data(), FitSettings(epochs=1, progress=False, **quiet))
    files = [path for path in tmp_path.rglob("*") if path.is_file()]
    [meta_file] = [path for path in files if '"model"' in path.read_text(errors="ignore")]
    meta = json.loads(meta_file.read_text())
    meta["model"] = str(jax.tree_util.tree_structure(model))  # the older form, schedule and all
    meta_file.write_text(json.dumps(meta))
    for step_dir in tmp_path.glob("[0-9]*"):
        forget_the_metadata_checksum(step_dir)
    _, _, history = fit(
        model, ms.SGD(0.1), tiny_data(), FitSettings(epochs=2, resume=True, progress=False, **quiet)
    )
    assert [record["epoch"] for record in history] == [1, 2]


def test_a_resume_under_another_learning_rate_schedule_is_refused_naming_the_flag():
    schedule = {"--lr": 0.001, "--schedule": "cosine", "--warmup-steps": 5, "--steps": 20}
    meta = {"sums": [], "history": [], "info": {"schedule": schedule}}
    check_meta(meta, {}, ("model",), "runs/gpt", {"schedule": schedule})  # the same schedule: resumed
    check_meta({**meta, "info": {}}, {}, ("model",), "runs/gpt", {"schedule": schedule})  # older: none kept
    with pytest.raises(ResumeError) as refused:
        check_meta(meta, {}, ("model",), "runs/gpt", {"schedule": {**schedule, "--steps": 40}})
    assert str(refused.value) == (
        "the checkpoint in runs/gpt follows the learning-rate schedule of --steps 20, this run --steps 40: "
        "the resumed run would follow neither; resume with --steps 20, or start afresh"
    )


ONE_DEVICE = {
    "mesh": ms.make_mesh({"data": 1}, devices=jax.devices()[:1]),
    "rules": ms.AxisRules(batch="data"),
    "progress": False,
}


@pytest.mark.parametrize("in_flight", [0, 1], ids=["each-step-waited-for", "one-in-flight"])
def test_a_step_in_flight_changes_no_loss_record_or_checkpoint(tmp_path, monkeypatch, in_flight):
    """On a chip ``fit`` reads a step's loss after dispatching the next (``steps_in_flight``): the
    history, its loss curve and the checkpoints are those of a run that waited for every step."""
    import minishard.run.train as train

    def run(flight, directory):
        monkeypatch.setattr(train, "steps_in_flight", lambda mesh: flight)
        common = {"checkpoint_dir": directory, "checkpoint_every": 3, "log_every": 2, **ONE_DEVICE}
        settings = FitSettings(epochs=2, log=lambda line: None, **common)
        return fit(tiny_model(), ms.SGD(0.1), tiny_data(), settings)

    waited = run(0, tmp_path / "waited")
    flown = run(in_flight, tmp_path / "flown")
    assert_trees_equal(waited[0], flown[0])
    keys = ("epoch", "loss", "train_accuracy", "steps", "loss_curve", "test_accuracy")
    assert [{k: r.get(k) for k in keys} for r in flown[2]] == [{k: r.get(k) for k in keys} for r in waited[2]]
    assert [[step for step, _ in record["loss_curve"]] for record in flown[2]] == [[2, 4], [6, 8]]
    assert saved_steps(tmp_path / "flown") == saved_steps(tmp_path / "waited")
    assert all("speed" in record for record in flown[2])  # the timed steps are counted


def test_a_loss_read_a_step_late_stops_the_run_at_its_own_step(monkeypatch, tmp_path):
    """With a step in flight, step n's divergence is read after step n + 1 is dispatched: the message
    still names step n, and no checkpoint after the last good step is written (step 4 diverges, step 3
    is saved, step 5 is in flight when step 4 is read)."""
    import minishard.run.train as train

    leaps = ms.SGD(lambda step: jnp.where(step >= 2, 1e5, 0.1))

    def stopped(flight, directory):
        monkeypatch.setattr(train, "steps_in_flight", lambda mesh: flight)
        with pytest.raises(NonFiniteLossError) as error:
            saving = {"checkpoint_dir": directory, "checkpoint_every": 3}
            settings = FitSettings(epochs=3, log=lambda line: None, **saving, **ONE_DEVICE)
            fit(tiny_model(), leaps, tiny_data(batch_size=8), settings)
        return str(error.value)

    waited, flown = stopped(0, tmp_path / "waited"), stopped(1, tmp_path / "flown")
    assert flown == waited
    step = int(re.search(r" at step (\d+) ", flown).group(1))
    assert step == 4, flown  # mid-epoch (8 steps an epoch): step 5 was in flight when it was read
    assert saved_steps(tmp_path / "flown") == saved_steps(tmp_path / "waited") == [3]
