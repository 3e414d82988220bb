"""minishard.run.launch: N local processes of one run; a failure or a signal, at any moment, stops them all.

The slow tests start real processes on 127.0.0.1 (``tests/launched.py`` is the
training program they run). Every subprocess runs under a timeout; none is left behind.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from launched import LAUNCHER, ROOT, TRAIN, fresh_compile_cache, launch_command

from minishard.run import cli, launch

pytestmark = pytest.mark.usefixtures(fresh_compile_cache.__name__)


# -- a dead process stops the run ------------------------------------------------------------------
GRACE = 3.0  # the launcher's SIGTERM -> SIGKILL wait
PATIENT = 30.0  # a grace no test waits for: a survivor that sat out SIGTERM would take all of it


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_killing_one_process_stops_the_other_quickly_and_leaves_no_process(signum):
    # SIGTERM ends a process at once, wherever it is, and so the survivor too, which the launcher
    # sends SIGTERM while it may wait in a collective for its dead peer. (JAX's own SIGTERM handler,
    # a preemption notice, kept both running: rank 1 trained on, the survivor lasted until SIGKILL.)
    command = launch_command([*TRAIN, "--epochs", "1000"], grace=PATIENT)  # would run for minutes
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
            if line.startswith("[rank 0] Epoch 1 "):  # mid-run: compiled, training, checkpoint-free
                break
        assert set(pids) == {0, 1}, "".join(lines)
        os.kill(pids[1], signum)
        killed = time.perf_counter()
        try:
            rest, _ = launcher.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the run went on 15 s after rank 1 got {signal.Signals(signum).name}")
        seconds = time.perf_counter() - killed
    finally:
        deadline.cancel()
        launcher.kill()
        launcher.wait()
    name = signal.Signals(signum).name
    print(f"{name} to rank 1 -> launcher exited in {seconds:.2f} s", file=sys.__stderr__)
    assert launcher.returncode == 128 + signum  # the dead process's status, as a shell reports it
    assert f"launch: the run failed: rank 1 was killed by {name}" in rest
    assert seconds < 3  # far less than the grace: nobody waited for SIGKILL
    for pid in pids.values():  # both gone, and reaped: no orphan, no zombie
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


SLEEPER = [sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(120)"]


def start_sleepers() -> tuple[subprocess.Popen, dict[int, int]]:
    """A launcher of two processes that only sleep (no JAX: quick; ``LAUNCHER``, no JAX there either);
    returns it and its children's pids."""
    command = [*LAUNCHER, "-n", "2", "--grace", str(GRACE), "--", *SLEEPER]
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


def test_launch_gives_each_process_its_place_and_its_devices():
    args = launch.parse_args(["-n", "3", "--devices-per-process", "2", "--", "train", "--batch-size", "96"])
    assert (args.processes, args.devices_per_process, args.command) == (3, 2, ["train", "--batch-size", "96"])
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
        (
            ["-n", "2", "--grace", "-1", "--", "x"],
            "argument --grace: must be a number of seconds >= 0, got -1",
        ),
        (
            ["-n", "2", "--grace", "nan", "--", "x"],
            "argument --grace: must be a number of seconds >= 0, got nan",
        ),
        (["-n", "2", "--gra", "1", "--", "x"], "unrecognized arguments: --gra"),  # no abbreviations
        (["-n", "2", "--", "launch", "-n", "2"], "a launch cannot launch launches"),
    ],
)
def test_launch_refuses_what_it_cannot_run(argv, message, capsys):
    for parse in (
        launch.parse_args,
        lambda argv: cli.parse_args(["launch", *argv]),
    ):  # alone, or a subcommand
        with pytest.raises(SystemExit) as exit_:
            parse(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and message in err, err
        assert err.strip().splitlines()[-1].startswith("minishard"), err  # argparse's one line


def test_launch_is_a_subcommand_whose_command_keeps_every_word_after_the_first_separator():
    args = cli.parse_args(["launch", "-n", "2", "--grace", "0", "--", "python", "--grace", "--", "-n"])
    assert (args.subcommand, args.processes, args.grace) == ("launch", 2, 0.0)
    assert args.command == ["python", "--grace", "--", "-n"]


def test_a_bad_flag_of_the_minishard_command_is_said_once_before_any_process_starts(capsys, monkeypatch):
    monkeypatch.setattr(subprocess, "Popen", None)  # no process may start
    with pytest.raises(SystemExit) as exit_:
        cli.parse_args(["launch", "-n", "3", "--", "train", "--batch-size", "16"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "[rank" not in err and err.count("usage:") == 1, err
    assert err.strip().splitlines()[-1] == (
        "minishard train: error: argument --batch-size: 16 cannot be split evenly over 3 processes"
    )
    assert "JAX_NUM_PROCESSES" not in os.environ  # the check's place, gone again


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")  # JAX's threads
def test_a_signal_while_the_processes_start_starts_no_more_and_stops_those_started(monkeypatch, capsys):
    started, popen = [], subprocess.Popen

    def popen_then_ctrl_c(*args, **kwargs):  # the real Popen; then Ctrl-C lands, before the next one
        started.append(popen(*args, **kwargs))
        os.kill(os.getpid(), signal.SIGINT)
        return started[-1]

    monkeypatch.setattr(launch.subprocess, "Popen", popen_then_ctrl_c)
    args = launch.parse_args(["-n", "3", "--grace", str(GRACE), "--", *SLEEPER])
    assert launch.run(args) == 130
    assert len(started) == 1 and started[0].poll() is not None  # one started, and stopped (and reaped)
    assert "launch: SIGINT: stopping the 1 of 3 processes started so far" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the launcher's handler is gone


JAX_SLEEPER = [sys.executable, "-c", "import jax; print('ready', flush=True); import time; time.sleep(120)"]
"""A child that takes a second or two to import JAX (which may swallow a Ctrl-C: a gc callback of its
own catches the KeyboardInterrupt), then sleeps: never ends by itself within a test."""


MOMENTS = {  # when to signal: once `count` lines contain `text`, and `delay` seconds later
    "launcher import": ("", 0, 0.5),  # the launcher is importing JAX, before any minishard code runs
    "spawned": ("is pid", 2, 0.0),  # both children forked, before they import JAX
    "child import": ("is pid", 2, 0.7),  # the children are importing JAX
    "running": ("] ready", 2, 0.0),
}


def signal_launcher(signum: int, moment: str) -> tuple[int, str, list[int]]:
    """A launcher of two ``JAX_SLEEPER``s, sent ``signum`` at ``moment``: its status, output, pids.

    Started as a user starts it (``python -m minishard launch``: JAX first) where that import is the
    moment; at the children's moments, as ``LAUNCHER``: the same ``Launch``, without 3 s of import first.
    """
    entry = [sys.executable, "-m", "minishard", "launch"] if moment == "launcher import" else LAUNCHER
    command = [*entry, "-n", "2", "--grace", str(GRACE), "--"]
    launcher = subprocess.Popen(
        [*command, *JAX_SLEEPER], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(launcher.stdout or []), daemon=True)
    reader.start()
    text, count, delay = MOMENTS[moment]
    try:
        deadline = time.monotonic() + 60
        while sum(text in line for line in list(lines)) < count and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(delay)
        launcher.send_signal(signum)
        launcher.wait(timeout=GRACE + 15)  # a lost signal: the children sleep on, and this times out
    finally:
        launcher.kill()
        launcher.wait()
        reader.join(timeout=5)
    pids = [int(found[1]) for line in lines if (found := re.match(r"launch: rank \d is pid (\d+)", line))]
    return launcher.returncode, "".join(lines), pids


@pytest.mark.slow
@pytest.mark.parametrize(
    ("signum", "moment"),
    [
        *[(signal.SIGINT, moment) for moment in ("spawned", "child import", "running")],
        *[(signal.SIGTERM, moment) for moment in ("spawned", "child import")],
        (signal.SIGINT, "launcher import"),
    ],
)
def test_a_signal_to_the_launcher_at_any_moment_stops_every_process(signum, moment):
    status, output, pids = signal_launcher(signum, moment)
    assert status == 128 + signum, output
    if not pids:  # it came while minishard imported: one line, as the trainer says it
        assert output.strip() == "interrupted: while minishard was importing; nothing ran", output
    assert all(dead(pid) for pid in pids), output
    if pids:
        assert f"launch: {signal.Signals(signum).name}: stopping" in output


NOISY_PEER = [  # rank 1 fails once rank 0 is ready; rank 0, stopped, prints what JAX prints in teardown
    sys.executable,
    "-c",
    "import os, pathlib, signal, sys, time\n"
    "ready = pathlib.Path(sys.argv[1])\n"
    "if os.environ['JAX_PROCESS_ID'] == '1':\n"
    "    while not ready.exists(): time.sleep(0.05)\n"
    "    print('error: --resume-from 5: no checkpoint', file=sys.stderr); sys.exit(1)\n"
    "def torn_down(*_):\n"
    "    print('F1202 05:00:00.000000  42 coordination.cc:4] Terminating process', file=sys.stderr)\n"
    "    print('E1202 05:00:00.000001  42 grpc_server.cc:7] GRPC: the peer went away', file=sys.stderr)\n"
    "    print('[Gloo] connection closed by peer', file=sys.stderr, flush=True); sys.exit(1)\n"
    "signal.signal(signal.SIGTERM, torn_down)\n"
    "ready.touch()  # a loaded machine may start rank 1 long before rank 0 gets here\n"
    "time.sleep(60)\n",
]


def test_a_peers_teardown_noise_is_kept_out_of_view_and_counted(tmp_path):
    command = [
        sys.executable,
        "-m",
        "minishard",
        "launch",
        "-n",
        "2",
        "--grace",
        str(GRACE),
        "--",
        *NOISY_PEER,
        str(tmp_path / "rank 0 is ready"),
    ]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 1 and "[rank 1] error: --resume-from 5: no checkpoint" in done.stderr
    assert (
        "Terminating process" not in done.stderr and "GRPC" not in done.stderr and "[Gloo]" not in done.stderr
    )
    assert "launch: rank 0's teardown: 3 line(s) of the runtime's log not shown" in done.stderr, done.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    "command",
    [["-m", "minishard"], ["-m", "minishard.run.cli"], ["-c", "import minishard"]],
    ids=["cli", "cli module", "library"],
)
def test_a_ctrl_c_while_minishard_imports_stops_the_command_in_one_line_and_a_library_import_raises(command):
    """The command exits 130 with one line; a script's ``import minishard`` gets a KeyboardInterrupt."""
    process = subprocess.Popen(
        [sys.executable, *command, "explain", "--devices", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
    )
    time.sleep(0.5)  # inside the imports (JAX alone takes over a second)
    process.send_signal(signal.SIGINT)
    output, _ = process.communicate(timeout=60)
    if command[0] == "-m":
        assert process.returncode == 130, output
        assert output.strip() == "interrupted: while minishard was importing; nothing ran"
    else:
        assert process.returncode == -signal.SIGINT and "KeyboardInterrupt" in output, output
