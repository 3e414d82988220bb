"""Where a command runs: on the accelerators JAX finds, or on CPU devices simulated.

On a machine with a TPU or a GPU (a Colab or Kaggle TPU, one GPU), ``train``, ``explain`` and
``sample`` run on its chips, and a run that names no ``--devices`` takes the chips there are: the
MLP's default 2-D mesh on one chip is data=1,model=1, said in one line with the reason. Without an
accelerator, ``--devices N`` asks XLA for N simulated CPU devices (``simulate_devices``), the
teaching setting; ``JAX_PLATFORMS=cpu`` (JAX's own switch) keeps JAX off the chips, so the same
simulation runs on a machine that has them.

The chips can only be counted once JAX's backends start, and XLA reads its CPU device count
(``XLA_FLAGS``) at that start: so the count is asked for first, then the backends started. A run of
several processes never looks here: ``jax.distributed.initialize`` must come before any backend.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
from collections.abc import Callable, Iterator
from typing import NoReturn

import jax

from minishard.run import distributed

__all__ = [
    "SENDS_UP_TO",
    "SIMULATE",
    "accelerators",
    "built_on_the_host",
    "first_devices",
    "fit_devices",
    "run_devices",
    "simulate_devices",
]

SENDS_UP_TO = 64
"""Without ``--hardware``, ``explain`` compiles a preset's step on up to this many simulated
devices to show what it sends, and a topology's XLA:CPU twin on as many (XLA:CPU compiles for
minutes beyond); above, the plan alone, or XLA:TPU's program alone, said in one line."""
SIMULATE = "JAX_PLATFORMS=cpu"
"""What keeps JAX off a machine's chips, so ``--devices N`` simulates N CPU devices there too."""


def simulate_devices(count: int) -> None:
    """``--devices``: ask XLA for ``count`` CPU devices; must run before JAX initialises its backend.

    A device count already in ``XLA_FLAGS`` wins (the user set it on purpose); ``train`` says so.
    """
    current = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in current:
        os.environ["XLA_FLAGS"] = f"{current} --xla_force_host_platform_device_count={count}".strip()


def accelerators(simulated: int) -> list[jax.Device]:
    """This process's accelerators, or [] (no chip, or ``JAX_PLATFORMS=cpu``); ``simulated`` CPU devices
    are asked for first, since this starts JAX's backends."""
    simulate_devices(simulated)
    found = jax.devices()
    return [] if found[0].platform == "cpu" else found


def fit_devices(args: argparse.Namespace, given: bool, error: Callable[[str], NoReturn]) -> None:
    """On a machine with chips: a run without ``--devices`` (``given`` False) takes the chips there are,
    and ``--devices N`` beyond them is refused, naming the switch that simulates N CPU devices."""
    place = (getattr(args, name, None) for name in ("coordinator", "num_processes", "process_id"))
    try:
        if distributed.detect(*place).multiprocess:  # its devices are counted after it joins
            return
    except distributed.DistributedError:  # half a description: the process flags' check says which half
        return
    if not (chips := accelerators(args.devices)):
        return
    there = f"{len(chips)} {chips[0].device_kind} {'chip' if len(chips) == 1 else 'chips'}"
    instead = f"{SIMULATE} simulates {args.devices} CPU devices instead"
    if given and args.devices > len(chips):
        error(f"argument --devices: {args.devices} asked, there are {there}; {instead}")
    if not given:
        args.devices_reason = f"the {there} here ({instead})"
        args.devices = len(chips)


def first_devices(args: argparse.Namespace) -> list[jax.Device] | None:
    """``--devices N``: the first N devices (simulated if none are yet), said once per command if there are
    more (docs/testing.md's ``XLA_FLAGS`` set 8); more than there are: an ``error:`` line, and None."""
    if (chosen := getattr(args, "chosen_devices", None)) is not None:
        return list(chosen)
    simulate_devices(args.devices)
    if (count := args.devices) > len(found := jax.devices()):  # the backend starts here, after XLA_FLAGS
        print(f"error: argument --devices: {count} asked, there are {len(found)}", file=sys.stderr)
        return None
    if count < len(found):
        print(f"Using the first {count} of the {len(found)} devices (--devices {count})")
    args.chosen_devices = found[:count]
    return list(args.chosen_devices)


def run_devices(args: argparse.Namespace) -> list[jax.Device] | None:
    """The devices the run uses, said; None (one ``error:`` line) if the mesh does not fit them.

    One process takes the first ``--devices`` of those there are (``first_devices``), as ``explain`` does.
    """
    devices = jax.devices()  # with several processes: the devices of all of them
    if jax.process_count() > 1:
        print(f"{jax.process_count()} processes x {jax.local_device_count()} devices: {len(devices)} in all")
    elif devices[0].platform == "cpu":
        print(f"No accelerator: simulating {len(devices)} CPU devices (XLA_FLAGS={os.environ['XLA_FLAGS']})")
        if reason := getattr(args, "devices_reason", ""):  # the model's default run chose its count
            print(f"({args.devices} devices: {reason}; --devices N for another count)")
        if len(devices) < args.devices:
            print(f"(XLA_FLAGS already set the device count, so --devices {args.devices} is not used)")
    else:  # a TPU or a GPU: the run's chips, and why so many (accelerators.fit_devices)
        chosen = (
            getattr(args, "devices_reason", "") or f"{args.devices} of the {devices[0].device_kind} chips"
        )
        print(f"Running on {chosen}")
    if jax.process_count() == 1 and args.devices < len(devices):
        devices = first_devices(args) or devices
    if (needed := math.prod(args.mesh.values())) != len(devices):
        axes = ",".join(f"{name}={size}" for name, size in args.mesh.items())
        print(
            f"error: argument --mesh: {axes} needs {needed} devices, there are {len(devices)}",
            file=sys.stderr,
        )
        return None
    return devices


@contextlib.contextmanager
def built_on_the_host() -> Iterator[None]:
    """What runs inside, on the host's CPU when the default device is a chip.

    Building a model is many small operations (each weight drawn, scaled, stacked), run one at a
    time: on a chip each compiles a program of its own, about a tenth of a second on a TPU v5e,
    where XLA:CPU compiles one in milliseconds. ``fit`` places what was built on the mesh
    (``sharding.shard``), so only where the numbers are drawn changes: the host's, the numbers a
    machine without a chip draws. Without a chip: nothing changes.
    """
    if jax.default_backend() == "cpu":
        yield
        return
    with jax.default_device(jax.local_devices(backend="cpu")[0]):
        yield
