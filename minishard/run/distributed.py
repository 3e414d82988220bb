"""One run, several processes: joining JAX's multi-process runtime.

On a cluster, a training run is one process per host, each driving its own
accelerators (8 GPUs, 4 TPU chips). ``jax.distributed.initialize`` joins
them: process 0 hosts a small *coordination service*, every process connects
to it, and from then on ``jax.devices()`` lists the devices of *all* hosts,
so one ``Mesh`` spans the cluster and one jitted step runs everywhere, with
XLA's collectives crossing hosts. Nothing else in minishard changes: each
process runs the same ``fit``, reads only its own rows of every global batch
(``minishard.run.data.Dataset``), and writes its own shards of each checkpoint.

Three numbers define a process's place in the run; this module finds them,
first match wins, field by field:

1. explicit arguments (the CLI's ``--coordinator``, ``--num-processes``,
   ``--process-id``);
2. JAX's own variables ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``,
   ``JAX_PROCESS_ID`` (what ``minishard launch`` sets for each process);
3. SLURM's, inside an ``srun`` step: ``SLURM_NTASKS``, ``SLURM_PROCID``, and the
   first node of ``SLURM_STEP_NODELIST`` as the coordinator.

>>> detect(environ={})                          # nothing says otherwise: one process
Cluster(coordinator=None, num_processes=1, process_id=0, source='single process')
>>> slurm = {"SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "gpu[07-08]",
...          "SLURM_NTASKS": "2", "SLURM_PROCID": "1"}
>>> detect(environ=slurm)
Cluster(coordinator='gpu07:61586', num_processes=2, process_id=1, source='SLURM')
>>> detect(num_processes=2, process_id=0, environ={"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"}).coordinator
'10.0.0.1:1234'

Why not just ``jax.distributed.initialize()``, which auto-detects SLURM too?
Three reasons, each worth knowing on a real cluster: (1) JAX's SLURM detection
also pins each process to the one GPU numbered ``SLURM_LOCALID``, right for
one process per GPU but wrong for minishard's one process per host; (2) a
coordinator that never answers makes JAX *abort* the process (a C++
``LOG(FATAL)`` after ``initialization_timeout``), with a stack trace instead of
an error naming the address; (3) on CPU the processes need a collectives
library (gloo) to talk, which is a config flag set before the backend starts.
And after it: (4) JAX's coordination client takes SIGTERM for a preemption
notice (it logs "SIGTERM caught" and runs on, until SIGKILL), so ``initialize``
gives SIGTERM back its default: the process ends at once, even while it waits
in a collective for a peer that died. A checkpoint it was writing is never
half there: saves are renamed into place only when complete.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import jax

DEFAULT_TIMEOUT = 300.0
"""Seconds to wait for the coordinator and every process to join (JAX's own default)."""


class DistributedError(RuntimeError):
    """The multi-process run cannot start or cannot work as set up; the message says why."""


@dataclasses.dataclass(frozen=True)
class Cluster:
    """This process's place in a run: who coordinates, how many processes, which one this is."""

    coordinator: str | None  # "host:port" of process 0's coordination service
    num_processes: int
    process_id: int
    source: str  # where the numbers came from: "flags", "JAX_* variables", "SLURM", "single process"

    @property
    def multiprocess(self) -> bool:
        return self.num_processes > 1


def detect(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    environ: Mapping[str, str] | None = None,
) -> Cluster:
    """Where this process stands, from the arguments, then JAX's variables, then SLURM's.

    Reads the environment only: JAX's backend does not start, so the CLI can
    check flags (is the batch divisible by the process count?) before any work.
    """
    values, sources = _first_match(
        {"coordinator": coordinator, "num_processes": num_processes, "process_id": process_id},
        os.environ if environ is None else environ,
    )
    count = values.get("num_processes")
    if count is None and values:  # half a description is a mistake, not a single process
        raise DistributedError(
            f"{' and '.join(values)} given, but not the number of processes: "
            "give --num-processes (or JAX_NUM_PROCESSES) too"
        )
    if count is not None and count < 1:
        raise DistributedError(f"the number of processes must be at least 1, got {count}")
    if count is None or count == 1:
        if values.get("process_id", 0) != 0:
            raise DistributedError(f"process id {values['process_id']} is outside 0..0 for 1 process")
        return Cluster(None, 1, 0, "single process")
    address, rank = _place(values, count)
    return Cluster(
        address, count, rank, "+".join(s for s in ("flags", "JAX_* variables", "SLURM") if s in sources)
    )


def _first_match(given: dict[str, Any], env: Mapping[str, str]) -> tuple[dict[str, Any], list[str]]:
    """Each of the three numbers from the flags, else JAX's variables, else SLURM's; and where from."""
    jax_env = {
        "coordinator": env.get("JAX_COORDINATOR_ADDRESS") or None,
        "num_processes": _int_var(env, "JAX_NUM_PROCESSES"),
        "process_id": _int_var(env, "JAX_PROCESS_ID"),
    }
    slurm = _slurm(env)
    values: dict[str, Any] = {}
    sources = []
    for name in given:
        for source, candidates in (("flags", given), ("JAX_* variables", jax_env), ("SLURM", slurm)):
            if candidates.get(name) is not None:
                values[name] = candidates[name]
                sources.append(source)
                break
    return values, sources


def _place(values: dict[str, Any], count: int) -> tuple[str, int]:
    """The coordinator's address and this process's id in a run of ``count`` processes, both checked."""
    if (address := values.get("coordinator")) is None:
        raise DistributedError(
            f"{count} processes, but no coordinator: give --coordinator HOST:PORT "
            "(or JAX_COORDINATOR_ADDRESS), the address of process 0"
        )
    split_address(address)
    if (rank := values.get("process_id")) is None:
        raise DistributedError(
            f"{count} processes, but no process id: give each process its own --process-id "
            f"(or JAX_PROCESS_ID) from 0 to {count - 1}"
        )
    if not 0 <= rank < count:
        raise DistributedError(f"process id {rank} is outside 0..{count - 1} for {count} processes")
    return address, rank


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    timeout: float = DEFAULT_TIMEOUT,
    environ: Mapping[str, str] | None = None,
) -> Cluster:
    """Join the multi-process run that the arguments or the environment describe (see ``detect``).

    Must run before anything starts JAX's backend (``jax.devices()``, the
    first array). A single process is a no-op, and so is a process that joined
    this run already (a second ``minishard train`` in it). Waits at most ``timeout``
    seconds for the coordinator and for every other process; past that,
    raises ``DistributedError`` naming the address (or, when the coordinator
    answered but some process never came, prints that and exits: JAX's
    connect cannot be interrupted, and would itself abort at its deadline).

    >>> initialize(environ={})   # one process: nothing to join
    Cluster(coordinator=None, num_processes=1, process_id=0, source='single process')
    """
    cluster = detect(coordinator, num_processes, process_id, environ=environ)
    if not cluster.multiprocess:
        return cluster
    if jax.distributed.is_initialized():
        joined = f"process {jax.process_index()} of {jax.process_count()}"
        asked = f"process {cluster.process_id} of {cluster.num_processes}"
        if joined == asked:
            return cluster  # joined already, as asked: nothing to do
        raise DistributedError(f"this process already joined a run as {joined}; asked to join as {asked}")
    # CPU devices of different processes talk through gloo (TCP); set before the
    # CPU backend exists. GPUs use NCCL and TPUs their own links, whatever this says.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    assert cluster.coordinator is not None  # detect() guarantees it for several processes
    deadline = time.monotonic() + timeout
    if cluster.process_id == 0:
        _check_port_free(cluster.coordinator)  # process 0 *hosts* the service on this port
    else:
        _wait_for_coordinator(cluster, deadline, timeout)
    _connect(cluster, deadline)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not JAX's preemption notice: see (4) above
    _leave_on_uncaught_exception()
    return cluster


def _connect(cluster: Cluster, deadline: float) -> None:
    """``jax.distributed.initialize`` with the three numbers found, watched until ``deadline``."""
    with _watchdog(cluster, deadline):
        jax.distributed.initialize(
            coordinator_address=cluster.coordinator,
            num_processes=cluster.num_processes,
            process_id=cluster.process_id,
            # Ours fires first; JAX's own deadline is a fallback a little later.
            initialization_timeout=int(max(deadline - time.monotonic(), 1)) + 30,
            # We found all three numbers: no auto-detection (on SLURM it would pin one GPU per process).
            cluster_detection_method="deactivate",
        )


def leave(status: int) -> int:
    """Return ``status``; but a *failed* process of a multi-process run exits here and now.

    Why: at exit, JAX waits in a shutdown barrier (up to 5 minutes) for every
    process to arrive, while the others wait in their next collective for this
    one: nobody moves until the timeout, then all abort with pages of logs.
    Leaving at once (``os._exit``, after flushing) lets the launcher, or the
    cluster's scheduler, see which process failed and stop the rest.

    >>> leave(1)   # one process: just the status
    1
    """
    if status != 0 and jax.distributed.is_initialized():  # never starts the backend
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status


def _leave_on_uncaught_exception() -> None:
    """An exception nobody caught (``--debug``, a user's script): print it, then ``leave(1)``."""
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, traceback: Any) -> None:
        previous(kind, value, traceback)
        leave(130 if issubclass(kind, KeyboardInterrupt) else 1)

    sys.excepthook = hook


def is_main_process() -> bool:
    """Process 0 speaks for the run: it prints, logs and plots (all processes compute)."""
    return jax.process_index() == 0


@contextlib.contextmanager
def print_on_main_only() -> Iterator[None]:
    """Silence ``print`` (stdout) on every process but 0, so N processes read like one run.

    Errors (stderr) still come from every process: each may fail for its own reason.
    """
    if is_main_process():
        yield
        return
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
        yield


# --- the details -----------------------------------------------------------------------


def _int_var(env: Mapping[str, str], name: str) -> int | None:
    text = env.get(name)
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        raise DistributedError(f"{name}={text!r} is not an integer") from None


def _slurm(env: Mapping[str, str]) -> dict[str, Any]:
    """The run's numbers inside an ``srun`` step (as JAX's own SLURM detection reads them)."""
    needed = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID")
    if not all(env.get(name) for name in needed):
        return {}
    # JAX's choice: a port in 61440..65535 derived from the job id, so all tasks agree on it.
    port = env.get("JAX_COORDINATOR_PORT") or str((_int_var(env, "SLURM_JOB_ID") or 0) % 4096 + 61440)
    return {
        "coordinator": f"{first_host(env['SLURM_STEP_NODELIST'])}:{port}",
        "num_processes": _int_var(env, "SLURM_NTASKS"),
        "process_id": _int_var(env, "SLURM_PROCID"),
    }


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: where process 0 (task 0) runs.

    >>> first_host("gpu[007-012,020],cpu01"), first_host("node3,node4"), first_host("a100-[2,5]")
    ('gpu007', 'node3', 'a100-2')
    """
    match = re.match(r"([^,\[]*)(?:\[([^\]\-,]*))?", nodelist)
    assert match is not None  # the pattern matches any string, possibly empty
    prefix, first_index = match.groups()
    return prefix + (first_index or "")


def split_address(address: str) -> tuple[str, int]:
    """``"10.0.0.1:1234"`` -> ``("10.0.0.1", 1234)``; what is not HOST:PORT is a ``DistributedError``.

    >>> split_address("[::1]:1234")
    ('::1', 1234)
    """
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DistributedError(f"coordinator {address!r} is not HOST:PORT (like 10.0.0.1:1234)")
    return host.strip("[]"), int(port)  # "[::1]:1234" -> ("::1", 1234)


def _reachable(address: str) -> bool:
    try:
        with socket.create_connection(split_address(address), timeout=1.0):
            return True
    except OSError:
        return False


def _wait_for_coordinator(cluster: Cluster, deadline: float, timeout: float) -> None:
    """Poll process 0's port until it answers; a plain Python error if it never does."""
    assert cluster.coordinator is not None
    while not _reachable(cluster.coordinator):
        if time.monotonic() >= deadline:
            raise DistributedError(
                f"process {cluster.process_id} of {cluster.num_processes} could not reach the coordinator "
                f"at {cluster.coordinator} within {timeout:g} s: is process 0 running, "
                "with the same address, and is that port open from this host?"
            )
        time.sleep(0.2)


def _check_port_free(address: str) -> None:
    _, port = split_address(address)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a TIME_WAIT leftover is fine
        try:
            probe.bind(("", port))
        except OSError as e:
            raise DistributedError(
                f"process 0 cannot host the coordinator at {address}: port {port} is taken ({e.strerror}); "
                "choose another port"
            ) from None


@contextlib.contextmanager
def _watchdog(cluster: Cluster, deadline: float) -> Iterator[None]:
    """Exit with a clear message if JAX's connect is still waiting at ``deadline``.

    The connect is C++ that releases the GIL, so this thread can run; it cannot
    raise into the main thread, which is stuck in C++, hence ``os._exit``.
    """

    def give_up() -> None:
        role = "hosts" if cluster.process_id == 0 else "reached"
        print(
            f"error: process {cluster.process_id} {role} the coordinator at {cluster.coordinator}, but "
            f"not all {cluster.num_processes} processes joined within the timeout: are they all started, "
            "with the same --num-processes and one --process-id each?",
            file=sys.stderr,
            flush=True,
        )
        sys.stdout.flush()
        os._exit(1)

    timer = threading.Timer(max(deadline - time.monotonic(), 0.0), give_up)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


__all__ = [
    "DEFAULT_TIMEOUT",
    "Cluster",
    "DistributedError",
    "detect",
    "first_host",
    "initialize",
    "is_main_process",
    "leave",
    "print_on_main_only",
    "split_address",
]
