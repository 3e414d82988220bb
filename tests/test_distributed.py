"""minishard.run.distributed: 2 processes x 4 devices train exactly like 1 x 8, and bad multi-process input.

The slow tests start real processes on 127.0.0.1 through the launcher (``tests/launched.py``
is the program they run). Every subprocess runs under a timeout; none is left behind.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from launched import ROOT, TRAIN, fresh_compile_cache, run_launch, synthetic_mnist

import minishard as ms
from minishard.run import cli, data, distributed, launch
from minishard.tree import named_leaves

pytestmark = pytest.mark.usefixtures(fresh_compile_cache.__name__)


def epoch_lines(output: str) -> list[str]:
    """The ``Epoch N ...`` lines without the rank prefix and the (machine-dependent) duration."""
    return [
        re.sub(r" in [\d.]+ s( \([^)]*\))?", "", line.split("] ", 1)[-1])
        for line in output.splitlines()
        if "Epoch " in line
    ]


def logged_losses(path: Path) -> list[float]:
    """Every loss in a ``--log`` file: per epoch and every 20 steps, in order."""
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return [record["loss"] for record in records]


def saved_state(directory: Path, step: int) -> dict[str, np.ndarray]:
    """The model and optimizer state of one checkpoint, restored into one device, by name."""
    from minishard.run.checkpoint import Checkpointer

    model = ms.mlp([784, 32, 10], key=jax.random.key(0), axes=ms.megatron_axes(2))
    target = {"model": model, "opt_state": ms.SGD(0.1, momentum=0.9).init(model)}
    with Checkpointer(directory, log=lambda line: None) as checkpointer:
        _, state, _ = checkpointer.restore(target, step=step)
    return {name: np.asarray(leaf) for name, leaf in named_leaves(state)}


def max_difference(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    assert a.keys() == b.keys()
    return max(float(np.max(np.abs(a[name] - b[name]))) for name in a)


def keep_only(directory: Path, step: int, into: Path) -> Path:
    """A copy of a checkpoint directory with only ``step`` in it: resuming starts there."""
    shutil.copytree(directory, into, ignore=shutil.ignore_patterns(".minishard.lock"))
    for other in into.iterdir():
        if other.name.isdigit() and int(other.name) != step:
            shutil.rmtree(other)
    return into


@pytest.fixture
def fake_mnist(monkeypatch):
    monkeypatch.setitem(data.DATASETS, "mnist", synthetic_mnist)


# -- two processes train like one ----------------------------------------------------------------
JOINED = "[rank 0] 2 processes x 4 devices: 8 in all"
"""What each training of a launch says first: it cuts a launch's output into its trainings."""


@pytest.mark.slow
def test_two_processes_train_like_one_and_checkpoints_move_between_them(tmp_path, fake_mnist, capsys):
    one, two = tmp_path / "one", tmp_path / "two"
    started = time.perf_counter()
    assert (
        cli.main(
            [*TRAIN, "--epochs", "2", "--checkpoint-dir", str(one), "--log", str(tmp_path / "one.jsonl")]
        )
        == 0
    )
    seconds_one = time.perf_counter() - started
    single = capsys.readouterr().out

    # One launch, two trainings in the same 2 processes: from scratch, then (1 -> 2) resuming the
    # 1-process checkpoint of epoch 1.
    one_to_two = keep_only(one, 16, tmp_path / "one-to-two")
    started = time.perf_counter()
    run = run_launch(
        [*TRAIN, "--epochs", "2", "--checkpoint-dir", str(two), "--log", str(tmp_path / "two.jsonl")],
        then=[*TRAIN, "--epochs", "2", "--checkpoint-dir", str(one_to_two), "--resume"],
    )
    seconds_two = time.perf_counter() - started
    assert run.returncode == 0, run.stdout + run.stderr
    assert not re.search(r"\[rank 1\] (Epoch|Rules|2 processes)", run.stdout)  # process 0 speaks for all
    scratch, resumed_run = run.stdout.split(JOINED)[1:]  # each training says it first
    print(
        f"2 processes: {seconds_two:.1f} s (2 whole runs), 1 process: {seconds_one:.1f} s (a whole run)",
        file=sys.__stderr__,
    )

    # The same loss curve (2 epoch means + the loss at step 20) and the same parameters and velocities,
    # up to float32 rounding: gloo sums the gradients of the two processes in another order than XLA's
    # in-process all-reduce does.
    assert len(epoch_lines(scratch)) == 2 and epoch_lines(scratch) == epoch_lines(single)
    losses_two, losses_one = logged_losses(tmp_path / "two.jsonl"), logged_losses(tmp_path / "one.jsonl")
    np.testing.assert_allclose(losses_two, losses_one, rtol=1e-6)
    final = saved_state(one, 32)
    differences = {"2 vs 1 process": max_difference(saved_state(two, 32), final)}

    # 1 -> 2: the two processes resumed the 1-process checkpoint of epoch 1.
    assert "[rank 0] Resumed from step 16" in resumed_run
    assert epoch_lines(resumed_run) == epoch_lines(single)[1:]
    differences["1 -> 2 resumed"] = max_difference(saved_state(one_to_two, 32), final)

    # 2 -> 1: one process resumes the 2-process checkpoint of epoch 1 and ends where both runs ended.
    resumed = keep_only(two, 16, tmp_path / "two-to-one")
    assert cli.main([*TRAIN, "--epochs", "2", "--checkpoint-dir", str(resumed), "--resume"]) == 0
    assert "Resumed from step 16" in capsys.readouterr().out
    differences["2 -> 1 resumed"] = max_difference(saved_state(resumed, 32), final)

    loss_gap = max(abs(a - b) for a, b in zip(losses_two, losses_one))
    print(
        f"max |loss difference| {loss_gap:.2g}, max |parameter difference| {differences}", file=sys.__stderr__
    )
    assert max(differences.values()) < 1e-6


# -- bad multi-process input: one clear line each ---------------------------------------------------
def test_a_batch_that_processes_cannot_share_is_refused_before_any_work(capsys, monkeypatch):
    flags = ["--coordinator", "127.0.0.1:1234", "--num-processes", "4", "--process-id", "0"]
    with pytest.raises(SystemExit) as exit_:
        cli.parse_args([*TRAIN[:-4], "--batch-size", "66", "--mesh", "data=2,model=4", *flags])
    assert exit_.value.code == 2
    assert "argument --batch-size: 66 cannot be split evenly over 4 processes" in capsys.readouterr().err
    for name, value in {
        "JAX_COORDINATOR_ADDRESS": "h:1",
        "JAX_NUM_PROCESSES": "4",
        "JAX_PROCESS_ID": "3",
    }.items():
        monkeypatch.setenv(name, value)  # the same from the environment, as `launch` sets it
    with pytest.raises(SystemExit):
        cli.parse_args([*TRAIN[:-4], "--batch-size", "66", "--mesh", "data=2,model=4"])
    assert "cannot be split evenly over 4 processes" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--num-processes", "2"], "2 processes, but no coordinator: give --coordinator HOST:PORT"),
        (["--coordinator", "h:1", "--num-processes", "2"], "2 processes, but no process id"),
        (["--coordinator", "h:1"], "coordinator given, but not the number of processes"),
        (
            ["--coordinator", "h:1", "--num-processes", "2", "--process-id", "2"],
            "process id 2 is outside 0..1",
        ),
        (["--coordinator", "nohost"], "argument --coordinator: coordinator 'nohost' is not HOST:PORT"),
        (["--process-id", "-1"], "argument --process-id: must be an integer >= 0"),
    ],
)
def test_half_a_multiprocess_description_is_refused(flags, message, capsys):
    with pytest.raises(SystemExit):
        cli.parse_args([*TRAIN, *flags])
    assert message in capsys.readouterr().err


def test_a_coordinator_that_never_answers_is_named_after_a_bounded_wait(capsys):
    address = f"127.0.0.1:{launch.free_port()}"  # nobody listens there
    flags = ["--coordinator", address, "--num-processes", "2", "--process-id", "1", "--init-timeout", "1"]
    started = time.perf_counter()
    assert cli.main([*TRAIN, *flags]) == 1
    assert time.perf_counter() - started < 10
    err = capsys.readouterr().err
    assert f"error: process 1 of 2 could not reach the coordinator at {address} within 1 s" in err


@pytest.mark.slow
def test_process_0_alone_gives_up_after_the_timeout_and_says_who_is_missing():
    address = f"127.0.0.1:{launch.free_port()}"
    flags = ["--coordinator", address, "--num-processes", "2", "--process-id", "0", "--init-timeout", "1"]
    command = [sys.executable, "-m", "minishard", *TRAIN, *flags]
    run = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert run.returncode == 1, run.stderr
    assert (
        f"error: process 0 hosts the coordinator at {address}, but not all 2 processes joined" in run.stderr
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mesh", "devices", "status", "message"),
    [
        ("data=2,model=4", 2, 2, "error: argument --mesh: data=2,model=4 needs 8 devices, there are 4"),
        ("model=4,data=2", 4, 1, "put the batch (data) axis first in --mesh"),  # each process: whole batch
    ],
)
def test_a_mesh_the_processes_cannot_hold_is_refused(mesh, devices, status, message):
    run = run_launch([*TRAIN[:-2], "--mesh", mesh, "--epochs", "1"], devices=devices, timeout=60)
    assert run.returncode == status, run.stdout + run.stderr
    assert "[rank 0] error: " in run.stderr and message in run.stderr
    assert "launch: the run failed: rank" in run.stderr


# -- the pieces, without processes ---------------------------------------------------------------
SLURM = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "gpu[3-4]", "SLURM_NTASKS": "2", "SLURM_PROCID": "1"}


def test_a_process_that_joined_a_run_joins_it_again_as_a_no_op_and_is_refused_another_place(monkeypatch):
    """A second ``minishard train`` in a process of a run (tests/launched.py's ``then``): joined as
    asked, nothing to do; asked to be another process, one line naming both."""
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "process_index", lambda: 0)
    assert distributed.initialize("localhost:1", 2, 0, environ={}).process_id == 0
    message = "this process already joined a run as process 0 of 2; asked to join as process 1 of 2"
    with pytest.raises(distributed.DistributedError, match=f"^{message}$"):
        distributed.initialize("localhost:1", 2, 1, environ={})


def test_flags_win_over_jax_variables_which_win_over_slurm():
    jax_env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:99", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "2"}
    assert distributed.detect(environ=SLURM) == distributed.Cluster("gpu3:61447", 2, 1, "SLURM")
    assert distributed.detect(environ={**SLURM, **jax_env}).coordinator == "10.0.0.1:99"
    both = distributed.detect(process_id=3, environ={**SLURM, **jax_env})
    assert (both.process_id, both.num_processes, both.source) == (3, 4, "flags+JAX_* variables")
    assert distributed.detect(environ={**SLURM, "JAX_COORDINATOR_PORT": "1234"}).coordinator == "gpu3:1234"
    one_task = {**SLURM, "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}  # a 1-task step: nothing to join
    assert distributed.detect(environ=one_task).multiprocess is False
