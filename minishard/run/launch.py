"""``minishard launch``: a whole multi-process run on one machine, the way a cluster starts one.

    minishard launch -n 2 --devices-per-process 4 -- train --mesh data=2,model=4

starts ``minishard train ...`` twice, as processes 0 and 1 of one run, each
with 4 simulated CPU devices: together, the 8 devices of one ``data=2,model=4``
mesh. On a real cluster a scheduler (``srun``, ``mpirun``, Kubernetes) starts
one process per host; this launcher plays that part locally, so the
multi-process code paths (``minishard.run.distributed``) run and are tested
without a cluster. After ``--`` comes a minishard command (``train ...``) or
any program (``python my_script.py``).

What it does, and why each matters with N processes:

* **Tells each process its place** through JAX's own variables,
  ``JAX_COORDINATOR_ADDRESS=127.0.0.1:<free port>``, ``JAX_NUM_PROCESSES``,
  ``JAX_PROCESS_ID``, which ``minishard.run.distributed.initialize`` reads.
* **Checks a minishard command's flags once**, as rank 0 would, before any process
  starts: a bad flag is one usage and one ``error:`` line, not one from every rank.
* **Prefixes every line with its rank** (``[rank 1] ...``). Only process 0
  prints the run's progress, so the output reads like a single run.
* **Fails fast.** The processes run in lockstep: when one dies, the others
  wait forever in their next collective. So the first failure stops the rest
  (SIGTERM, then SIGKILL after ``--grace`` seconds), and the launcher exits
  with that process's status and a line naming its rank.
* **Passes Ctrl-C (and SIGTERM) on** to every process, whenever it comes: while
  they start, before they import JAX, mid-run; a second one kills them, and
  what does not stop within ``--grace`` seconds is killed. It exits 130 (143).
* **Leaves no orphans.** Each process leads its own process group, which is
  what gets signalled, and on Linux it is killed if the launcher itself dies.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import IO, Any, NoReturn, TextIO

MINISHARD_COMMANDS = ("train",)
"""Words after ``--`` that mean ``python -m minishard <word> ...``; anything else runs as given."""
HELP = "run N local processes of one multi-process run: minishard launch -n 2 -- train ..."
POLL_SECONDS = 0.05
GLOO_CONNECTED = re.compile(r"(\[Gloo\] Rank )*(\d+ )?is connected to \d+ peer ranks\. Expected .* is : \d+")
"""gloo's "peers connected" notice: printed (by C++, to stdout) per process and per device group,
sometimes two threads' copies interleaved. It says that all is well; the launcher drops it."""
RUNTIME_LOG = re.compile(
    r"[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ \S+:\d+\] .*|\[Gloo\].*|\*\*\* .*|\s+@\s+0x.*"
)
"""A line of the C++ runtime's own log (glog's ``F1202 12:00:00.123  99 file.cc:42] ...``: the
coordination service, gRPC, Gloo; its stack dumps): what a peer prints as it is torn down after
another rank failed, and what the launcher then keeps out of the user's view (counted, once)."""


EXAMPLE = "example: minishard launch -n 2 --devices-per-process 4 -- train --mesh data=2,model=4"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The launcher's flags, and the command after ``--`` (``check`` finishes them)."""
    add = parser.add_argument
    add("-n", "--processes", type=int, required=True, help="processes to start")
    add(
        "--devices-per-process",
        type=int,
        default=4,
        help="CPU devices each process simulates (default %(default)s)",
    )
    add("--port", type=int, help="coordinator port on 127.0.0.1 (default: a free one)")
    add(
        "--grace",
        type=float,
        default=5.0,
        help="seconds between SIGTERM (or Ctrl-C) and SIGKILL when stopping (default %(default)s)",
    )
    add("command", nargs=argparse.REMAINDER, help="after --: train ... or any program")


def check(args: argparse.Namespace, error: Callable[[str], NoReturn]) -> argparse.Namespace:
    """Refuse what cannot run, each with argparse's one-line ``error:``; ``args.command`` loses its ``--``.

    Everything after the first ``--`` is the command, even words that look like our own flags
    (argparse keeps that ``--`` at the head of a ``REMAINDER``).
    """
    for flag, value in (("-n", args.processes), ("--devices-per-process", args.devices_per_process)):
        if value < 1:
            error(f"argument {flag}: must be at least 1, got {value}")
    if args.port is not None and not 0 < args.port < 65536:
        error(f"argument --port: must be a port number in 1..65535, got {args.port}")
    if not 0 <= args.grace < math.inf:  # NaN fails too
        error(f"argument --grace: must be a number of seconds >= 0, got {args.grace:g}")
    command = list(args.command)
    if command[:1] != ["--"] and command:
        before = command[: command.index("--")] if "--" in command else command
        error(f"unrecognized arguments: {' '.join(before)} (put the command after --)")
    args.command = command[1:]
    if not args.command:
        error("no command: put it after --, e.g. minishard launch -n 2 -- train --epochs 1")
    if args.command[0] == "launch":
        error("a launch cannot launch launches")
    if args.command[0] in MINISHARD_COMMANDS:
        _check_command(args)
    return args


def _check_command(args: argparse.Namespace) -> None:
    """The minishard command's flags, checked once here as rank 0 would check them, before any process
    starts: a bad flag is one usage and one ``error:`` line (exit 2), not one from every rank."""
    from minishard.run.cli import parse_args as parse_command  # (the command line imports this module)

    place = environment(0, args.processes, "127.0.0.1:1", args.devices_per_process)
    saved = dict(os.environ)
    os.environ.update({name: value for name, value in place.items() if name.startswith("JAX_")})
    try:
        parse_command(args.command)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """``-n N [--devices-per-process K] [--grace S] -- COMMAND ...`` (``minishard launch`` parses the same).

    >>> args = parse_args(["-n", "2", "--", "train", "--epochs", "1"])
    >>> args.processes, args.devices_per_process, args.command
    (2, 4, ['train', '--epochs', '1'])
    """
    parser = argparse.ArgumentParser(
        prog="minishard launch", description=HELP, epilog=EXAMPLE, allow_abbrev=False
    )
    add_arguments(parser)
    return check(parser.parse_args(argv), parser.error)


def command_line(command: Sequence[str]) -> list[str]:
    """``["train", ...]`` -> ``[python, "-m", "minishard", "train", ...]``; other programs as given."""
    if command[0] in MINISHARD_COMMANDS:
        return [sys.executable, "-m", "minishard", *command]
    return list(command)


def environment(
    rank: int, processes: int, address: str, devices: int, base: dict[str, str] | None = None
) -> dict[str, str]:
    """The environment of process ``rank``: its place in the run and its simulated devices.

    >>> inherited = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    >>> env = environment(1, 2, "127.0.0.1:1234", 4, base=inherited)
    >>> env["JAX_PROCESS_ID"], env["XLA_FLAGS"]
    ('1', '--xla_force_host_platform_device_count=4')
    """
    env = dict(os.environ if base is None else base)
    flags = re.sub(r"--xla_force_host_platform_device_count=\S*", "", env.get("XLA_FLAGS", ""))
    env.update(
        JAX_COORDINATOR_ADDRESS=address,
        JAX_NUM_PROCESSES=str(processes),
        JAX_PROCESS_ID=str(rank),
        XLA_FLAGS=" ".join([*flags.split(), f"--xla_force_host_platform_device_count={devices}"]),
        PYTHONUNBUFFERED="1",  # lines arrive as they are printed, not in 8 kB blocks
    )
    env.setdefault("JAX_PLATFORMS", "cpu")  # N local processes would fight over one machine's GPUs
    return env


def free_port() -> int:
    """A port nobody listens on now (the OS picks it); process 0 binds it a moment later."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def run(args: argparse.Namespace) -> int:
    """Start the processes ``args`` (``parse_args``) describes, relay their output, return the status."""
    address = f"127.0.0.1:{args.port or free_port()}"
    command = command_line(args.command)
    envs = [
        environment(rank, args.processes, address, args.devices_per_process) for rank in range(args.processes)
    ]
    return Launch(command, envs, grace=args.grace).run()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m minishard.run.launch ...``, as ``minishard launch ...``."""
    return run(parse_args(sys.argv[1:] if argv is None else argv))


class Launch:
    """N processes of one command; the first failure or a Ctrl-C stops them all."""

    def __init__(self, command: list[str], envs: list[dict[str, str]], *, grace: float = 5.0) -> None:
        self.command, self.envs, self.grace = command, envs, grace
        self.processes: list[subprocess.Popen[bytes]] = []
        self.relays: list[threading.Thread] = []
        self.lock = threading.Lock()  # one line at a time on our stdout/stderr
        self.dropped: dict[int, int] = {}  # rank -> runtime lines of its teardown kept out of view
        self.signalled: int | None = None

    def run(self) -> int:
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            self._start()
            return self._watch()
        finally:
            self._stop(signal.SIGKILL, wait=0.0)  # a no-op when all have exited; never leaves one behind
            for relay in self.relays:
                relay.join(timeout=2.0)
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _start(self) -> None:
        address = self.envs[0]["JAX_COORDINATOR_ADDRESS"]
        for rank, env in enumerate(self.envs):
            if self.signalled is not None:  # stopped while starting: start no more
                break
            try:
                process = subprocess.Popen(
                    self.command,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,  # its own process group: we signal the group, Ctrl-C is ours
                    preexec_fn=functools.partial(_die_with_parent, os.getpid()),
                )
            except OSError as e:
                raise SystemExit(f"launch: cannot start {self.command[0]!r}: {e.strerror}") from None
            self.processes.append(process)
            self._say(f"launch: rank {rank} is pid {process.pid} ({address})")
        for rank, process in enumerate(self.processes):  # threads after all forks (preexec_fn + threads)
            for stream, out in ((process.stdout, sys.stdout), (process.stderr, sys.stderr)):
                relay = threading.Thread(target=self._relay, args=(rank, stream, out), daemon=True)
                relay.start()
                self.relays.append(relay)

    def _watch(self) -> int:
        """Poll until all succeed (0), one fails (its status), or we are interrupted (128 + signal)."""
        while True:
            if self.signalled is not None:
                return self._interrupted(self.signalled)
            codes = [process.poll() for process in self.processes]
            if failed := [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]:
                # Seen together, a process killed by a signal is the cause, and one that
                # exited with an error the consequence (its peer vanished mid-collective).
                return self._failed(*min(failed, key=lambda rank_code: (rank_code[1] >= 0, rank_code[0])))
            if all(code == 0 for code in codes):
                return 0
            time.sleep(POLL_SECONDS)

    def _failed(self, rank: int, code: int) -> int:
        if running := sum(process.poll() is None for process in self.processes):
            self._say(f"launch: rank {rank} {_describe(code)}; stopping the other {running} process(es)")
        self._stop(signal.SIGTERM, wait=self.grace)
        self._say_dropped()
        self._say(f"launch: the run failed: rank {rank} {_describe(code)}")
        return code if code > 0 else 128 - code  # killed by signal S: the shell's 128 + S

    def _interrupted(self, signum: int) -> int:
        name, started, wanted = signal.Signals(signum).name, len(self.processes), len(self.envs)
        which = (
            f"all {started} processes"
            if started == wanted
            else f"the {started} of {wanted} processes started so far"
        )
        self._say(f"launch: {name}: stopping {which}")
        self._stop(signum, wait=self.grace)
        self._say_dropped()
        return 128 + signum

    def _stop(self, signum: int, wait: float) -> None:
        """Send ``signum`` to every running process's group; SIGKILL what is left after ``wait`` s."""
        for process in self.processes:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signum)  # the pid is still ours: not reaped yet
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and any(process.poll() is None for process in self.processes):
            time.sleep(POLL_SECONDS)
        for process in self.processes:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
            process.wait()  # reap: no zombie outlives the launcher

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.signalled is not None:  # the second Ctrl-C: no more waiting
            for process in self.processes:
                if process.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(process.pid, signal.SIGKILL)
        self.signalled = signum

    def _relay(self, rank: int, stream: IO[bytes] | None, out: TextIO) -> None:
        """Copy one child's stream to ours, line by line, each line prefixed with the rank."""
        assert stream is not None
        for line in iter(stream.readline, b""):
            text = line.decode(errors="replace").rstrip("\n")
            if GLOO_CONNECTED.fullmatch(text):
                continue
            if RUNTIME_LOG.fullmatch(text) and self._torn_down(rank):
                with self.lock:
                    self.dropped[rank] = self.dropped.get(rank, 0) + 1
                continue
            with self.lock:
                print(f"[rank {rank}] {text}", file=out, flush=True)

    def _say_dropped(self) -> None:
        """One line for what each rank's teardown printed that the launcher kept out of view."""
        for relay in self.relays:
            relay.join(timeout=1.0)  # the streams end with their processes: read to the end
        for rank, lines in sorted(self.dropped.items()):
            self._say(f"launch: rank {rank}'s teardown: {lines} line(s) of the runtime's log not shown")

    def _torn_down(self, rank: int) -> bool:
        """Is ``rank`` being stopped because of another: a signal to the launcher, or a peer that failed?"""
        others = [process for r, process in enumerate(self.processes) if r != rank]
        return self.signalled is not None or any(process.poll() not in (None, 0) for process in others)

    def _say(self, line: str) -> None:
        with self.lock:
            print(line, file=sys.stderr, flush=True)


def _describe(code: int) -> str:
    """``"exited with status 1"`` or ``"was killed by SIGKILL"`` (Popen's negative codes)."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
        return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _die_with_parent(launcher: int) -> None:
    """In the child, before exec: ask Linux for SIGKILL when the launcher dies (even by SIGKILL).

    Also drop the launcher's signal handlers, so that a signal sent between fork and exec
    stops the child (the default) instead of running the launcher's handler in it.
    """
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
        if os.getppid() != launcher:  # it died before we asked
            os._exit(1)


if __name__ == "__main__":
    sys.exit(main())


__all__ = [
    "HELP",
    "MINISHARD_COMMANDS",
    "Launch",
    "add_arguments",
    "check",
    "command_line",
    "environment",
    "free_port",
    "main",
    "parse_args",
    "run",
]
