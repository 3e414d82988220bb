"""``explain --topology v5e:2x4``: the slice's flags, checked before JAX starts; its XLA:CPU twin.

The slice's chips are the step's devices and price it, so a ``--devices`` or ``--hardware``
of another count or chip is refused; XLA:CPU compiles the same step on as many simulated
devices beside it (``minishard.run.topology.on_cpu_and_tpu``), asked for before JAX starts,
where there can be that many (``cpu_twin`` says in one line when there cannot).
"""

from __future__ import annotations

import argparse

import jax

from minishard.run.cli.accelerators import SENDS_UP_TO, simulate_devices
from minishard.run.cli.flags import Error
from minishard.run.cli.styles.style import Style
from minishard.run.topology import chip_count, hardware_of, tpu_devices

__all__ = ["check_topology", "cpu_twin"]


def check_topology(args: argparse.Namespace, given: bool, error: Error) -> list[jax.Device]:
    """--topology: its devices, whose count is --devices and whose chips price the step.

    XLA:CPU's twin of the step (``on_cpu_and_tpu``) needs as many simulated devices: asked for here,
    before JAX starts, up to ``SENDS_UP_TO`` (``cpu_twin`` says when there is none).
    """
    if args.compare:
        error("argument --topology: compiles the step of one style, not --compare")
    try:
        chips, generation = chip_count(args.topology), hardware_of(args.topology)
    except ValueError as refused_topology:
        error(f"argument --topology: {refused_topology}")
    if given and args.devices != chips:
        error(
            f"argument --devices: --topology {args.topology} is {chips} chips, the step's devices; "
            "drop --devices (or give a topology of that many chips)"
        )
    if args.hardware not in (None, generation):
        error(
            f"argument --hardware: --topology {args.topology}'s chips are {generation}, not "
            f"{args.hardware}; drop --hardware (the topology's chips price its step)"
        )
    if chips <= SENDS_UP_TO:
        simulate_devices(chips)
    try:
        devices = tpu_devices(args.topology)
    except ValueError as refused_topology:
        error(f"argument --topology: {refused_topology}")
    args.devices, args.hardware = len(devices), generation
    args.chosen_devices = devices  # every mesh of this command: the topology's (first_devices)
    return devices


def cpu_twin(args: argparse.Namespace, style: Style) -> bool:
    """Whether XLA:CPU compiles the topology's step too, on as many simulated devices; if not, why,
    in one line before any compile (256 chips: 8 simulated devices cannot make the mesh)."""
    if style.own_step:  # its model is built on the topology's mesh
        why = "a step of its own has no XLA:CPU twin here"
    elif args.devices > SENDS_UP_TO:
        why = f"XLA:CPU's twin is compiled on up to {SENDS_UP_TO} simulated devices (minutes more)"
    elif args.devices > (there := len(jax.devices("cpu"))):  # CPU's, also where JAX finds chips
        why = f"XLA:CPU's twin needs {args.devices} simulated devices, XLA_FLAGS set {there}"
    else:
        return True
    print(f"(compiled by XLA:TPU for {args.topology} alone: {why})")
    return False
