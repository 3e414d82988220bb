"""``minishard launch`` and ``minishard.run.distributed``: 2 processes x 4 devices train exactly like 1 x 8.

The slow tests start real processes on 127.0.0.1 through the launcher:

    minishard launch -n 2 --devices-per-process 4 -- python tests/test_launch.py train ...

This file doubles as the program they run (see ``__main__`` at the bottom): the
real ``minishard train`` (``cli.main``) on a small synthetic MNIST, so each
process starts in seconds instead of importing TensorFlow for a minute. Every
subprocess runs under a timeout; none is left behind.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import minishard as ms
from minishard.run import cli, distributed, launch
from minishard.run.data import Dataset
from minishard.tree import named_leaves

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ["train", "--layers", "784,32,10", "--batch-size", "64", "--mesh", "data=2,model=4"]
"""16 steps per epoch on the synthetic set below; a data=2 x model=4 mesh (Megatron MLP, batch split)."""


def synthetic_mnist(split: str, batch_size: int, *, shuffle_seed: int = 0, flatten: bool = True, **options):
    """MNIST-shaped random images with one bright row per class: learnable, and no TensorFlow."""
    options.pop("data_dir", None), options.pop("download", None)
    n = 1024 if split == "train" else 256
    rng = np.random.default_rng(0 if split == "train" else 1)
    labels = rng.integers(0, 10, n)
    images = rng.integers(0, 32, (n, 28, 28, 1), dtype=np.uint8)
    images[np.arange(n), 2 * labels, :, 0] = 255  # class c lights up row 2c
    shuffle = split == "train"
    return Dataset(
        images, labels, batch_size, shuffle=shuffle, shuffle_seed=shuffle_seed, flatten=flatten, **options
    )


def launch_command(args: list[str], *, processes: int = 2, devices: int = 4, grace: float = 5.0) -> list[str]:
    """``minishard launch -n 2 --devices-per-process 4 -- python tests/test_launch.py <args>``.

    The launched runs share one persistent compilation cache: the second one compiles little.
    """
    command = [sys.executable, "-m", "minishard", "launch", "-n", str(processes), "--grace", str(grace)]
    command += ["--devices-per-process", str(devices), "--", sys.executable, __file__, *args]
    return [*command, "--compile-cache", str(COMPILE_CACHE)] if args[0] == "train" else command


def run_launch(args: list[str], *, devices: int = 4, timeout: float = 120) -> subprocess.CompletedProcess:
    command = launch_command(args, devices=devices)
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


COMPILE_CACHE = Path(tempfile.gettempdir()) / f"minishard-test-launch-{os.getuid()}"


@pytest.fixture(scope="module", autouse=True)
def _fresh_compile_cache():
    shutil.rmtree(COMPILE_CACHE, ignore_errors=True)
    yield
    shutil.rmtree(COMPILE_CACHE, ignore_errors=True)


def epoch_lines(output: str) -> list[str]:
    """The ``Epoch N ...`` lines without the rank prefix and the (machine-dependent) duration."""
    return [
        re.sub(r" in [\d.]+ s", "", line.split("] ", 1)[-1])
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
    monkeypatch.setitem(cli.DATASETS, "mnist", synthetic_mnist)


# -- two processes train like one ----------------------------------------------------------------
@pytest.mark.slow
def test_two_processes_train_like_one_and_checkpoints_move_between_them(tmp_path, fake_mnist, capsys):
    one, two = tmp_path / "one", tmp_path / "two"
    started = time.perf_counter()
    run = run_launch(
        [*TRAIN, "--epochs", "2", "--checkpoint-dir", str(two), "--log", str(tmp_path / "two.jsonl")]
    )
    seconds_two = time.perf_counter() - started
    assert run.returncode == 0, run.stdout + run.stderr
    assert "[rank 0] 2 processes x 4 devices: 8 in all" in run.stdout
    assert not re.search(r"\[rank 1\] (Epoch|Rules|2 processes)", run.stdout)  # process 0 speaks for all
    assert len(epoch_lines(run.stdout)) == 2

    started = time.perf_counter()
    assert (
        cli.main(
            [*TRAIN, "--epochs", "2", "--checkpoint-dir", str(one), "--log", str(tmp_path / "one.jsonl")]
        )
        == 0
    )
    seconds_one = time.perf_counter() - started
    single = capsys.readouterr().out
    print(
        f"2 processes: {seconds_two:.1f} s, 1 process: {seconds_one:.1f} s (whole runs)", file=sys.__stderr__
    )

    # The same loss curve (2 epoch means + the loss at step 20) and the same parameters and velocities,
    # up to float32 rounding: gloo sums the gradients of the two processes in another order than XLA's
    # in-process all-reduce does.
    assert epoch_lines(run.stdout) == epoch_lines(single)
    losses_two, losses_one = logged_losses(tmp_path / "two.jsonl"), logged_losses(tmp_path / "one.jsonl")
    np.testing.assert_allclose(losses_two, losses_one, rtol=1e-6)
    final = saved_state(one, 32)
    differences = {"2 vs 1 process": max_difference(saved_state(two, 32), final)}

    # 2 -> 1: one process resumes the 2-process checkpoint of epoch 1 and ends where both runs ended.
    resumed = keep_only(two, 16, tmp_path / "two-to-one")
    assert cli.main([*TRAIN, "--epochs", "2", "--checkpoint-dir", str(resumed), "--resume"]) == 0
    assert "Resumed from step 16" in capsys.readouterr().out
    differences["2 -> 1 resumed"] = max_difference(saved_state(resumed, 32), final)

    # 1 -> 2: two processes resume the 1-process checkpoint of epoch 1.
    resumed = keep_only(one, 16, tmp_path / "one-to-two")
    run = run_launch([*TRAIN, "--epochs", "2", "--checkpoint-dir", str(resumed), "--resume"])
    assert run.returncode == 0, run.stdout + run.stderr
    assert "[rank 0] Resumed from step 16" in run.stdout
    assert epoch_lines(run.stdout) == epoch_lines(single)[1:]
    differences["1 -> 2 resumed"] = max_difference(saved_state(resumed, 32), final)

    loss_gap = max(abs(a - b) for a, b in zip(losses_two, losses_one))
    print(
        f"max |loss difference| {loss_gap:.2g}, max |parameter difference| {differences}", file=sys.__stderr__
    )
    assert max(differences.values()) < 1e-6


# -- a dead process stops the run ------------------------------------------------------------------
GRACE = 3.0  # the launcher's SIGTERM -> SIGKILL wait; a killed peer's partner dies at SIGTERM anyway


@pytest.mark.slow
def test_killing_one_process_stops_the_other_quickly_and_leaves_no_process(tmp_path):
    command = launch_command([*TRAIN, "--epochs", "1000"], grace=GRACE)  # would run for minutes
    launcher = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT
    )
    deadline = threading.Timer(120, launcher.kill)  # bounds the reading loop below, whatever happens
    deadline.daemon = True
    deadline.start()
    pids, lines = {}, []
    try:
        assert launcher.stdout is not None
        for line in launcher.stdout:
            lines.append(line)
            if found := re.match(r"launch: rank (\d) is pid (\d+)", line):
                pids[int(found[1])] = int(found[2])
            if line.startswith("[rank 0] Epoch 2 "):  # mid-run: compiled, training, checkpoint-free
                break
        assert set(pids) == {0, 1}, "".join(lines)
        os.kill(pids[1], signal.SIGKILL)
        killed = time.perf_counter()
        rest, _ = launcher.communicate(timeout=GRACE + 20)
        seconds = time.perf_counter() - killed
    finally:
        deadline.cancel()
        launcher.kill()
        launcher.wait()
    print(f"killed rank 1 -> launcher exited in {seconds:.2f} s", file=sys.__stderr__)
    assert launcher.returncode == 128 + signal.SIGKILL  # the dead process's status, as a shell reports it
    assert "launch: the run failed: rank 1 was killed by SIGKILL" in rest
    assert seconds < GRACE + 5
    for pid in pids.values():  # both gone, and reaped: no orphan, no zombie
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


SLEEPER = [sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(120)"]


def start_sleepers() -> tuple[subprocess.Popen, dict[int, int]]:
    """A launcher of two processes that only sleep (no JAX: quick); returns it and its children's pids."""
    command = [sys.executable, "-m", "minishard", "launch", "-n", "2", "--grace", str(GRACE), "--", *SLEEPER]
    launcher = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT
    )
    deadline = threading.Timer(60, launcher.kill)  # bounds the reading loop below, whatever happens
    deadline.daemon = True
    deadline.start()
    pids, ready = {}, 0
    assert launcher.stdout is not None
    for line in launcher.stdout:
        if found := re.match(r"launch: rank (\d) is pid (\d+)", line):
            pids[int(found[1])] = int(found[2])
        ready += line.endswith("] ready\n")
        if ready == 2:
            return launcher, pids
    raise AssertionError(f"the launcher ended early: {launcher.wait()}")


def dead(pid: int, within: float = 5.0) -> bool:
    """Gone, or a zombie (dead, waiting for init to reap it), within ``within`` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.slow
def test_ctrl_c_reaches_every_process_and_the_launcher_exits_130():
    launcher, pids = start_sleepers()
    launcher.send_signal(signal.SIGINT)  # what a terminal's Ctrl-C sends the launcher
    rest, _ = launcher.communicate(timeout=GRACE + 10)
    assert launcher.returncode == 130
    assert "launch: SIGINT: stopping all 2 processes" in rest
    assert rest.count("KeyboardInterrupt") == 2  # each process got it, and stopped
    assert all(dead(pid) for pid in pids.values())


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_killed_launcher_takes_its_processes_with_it():
    launcher, pids = start_sleepers()
    launcher.kill()  # SIGKILL: the launcher cannot clean up; the kernel does (PR_SET_PDEATHSIG)
    launcher.wait()
    assert all(dead(pid) for pid in pids.values())


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
    flags = ["--coordinator", address, "--num-processes", "2", "--process-id", "0", "--init-timeout", "2"]
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


def test_flags_win_over_jax_variables_which_win_over_slurm():
    jax_env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:99", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "2"}
    assert distributed.detect(environ=SLURM) == distributed.Cluster("gpu3:61447", 2, 1, "SLURM")
    assert distributed.detect(environ={**SLURM, **jax_env}).coordinator == "10.0.0.1:99"
    both = distributed.detect(process_id=3, environ={**SLURM, **jax_env})
    assert (both.process_id, both.num_processes, both.source) == (3, 4, "flags+JAX_* variables")
    assert distributed.detect(environ={**SLURM, "JAX_COORDINATOR_PORT": "1234"}).coordinator == "gpu3:1234"
    one_task = {**SLURM, "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}  # a 1-task step: nothing to join
    assert distributed.detect(environ=one_task).multiprocess is False


def test_launch_gives_each_process_its_place_and_its_devices():
    args = launch.parse_args(["-n", "3", "--devices-per-process", "2", "--", "train", "-n", "--", "x"])
    assert (args.processes, args.devices_per_process, args.command) == (3, 2, ["train", "-n", "--", "x"])
    assert launch.command_line(["train", "--epochs", "1"])[1:] == [
        "-m",
        "minishard",
        "train",
        "--epochs",
        "1",
    ]
    assert launch.command_line(["python", "script.py"]) == ["python", "script.py"]
    env = launch.environment(
        2, 3, "127.0.0.1:5", 2, base={"XLA_FLAGS": "--a --xla_force_host_platform_device_count=8"}
    )
    assert env["XLA_FLAGS"] == "--a --xla_force_host_platform_device_count=2"
    assert (env["JAX_COORDINATOR_ADDRESS"], env["JAX_NUM_PROCESSES"], env["JAX_PROCESS_ID"]) == (
        "127.0.0.1:5",
        "3",
        "2",
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-n", "2"], "no command: put it after --"),
        (["-n", "0", "--", "train"], "argument -n: must be at least 1"),
        (["-n", "2", "train"], "unrecognized arguments: train (put the command after --)"),
    ],
)
def test_launch_refuses_what_it_cannot_run(argv, message, capsys):
    with pytest.raises(SystemExit):
        launch.parse_args(argv)
    assert message in capsys.readouterr().err


if __name__ == "__main__":  # one process of a launched run: the real CLI on the synthetic data
    cli.DATASETS["mnist"] = synthetic_mnist
    sys.exit(cli.main(sys.argv[1:]))
