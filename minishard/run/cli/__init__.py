"""``minishard train | explain | sample | launch``: the command line, one module per subcommand.

>>> args = parse_args(["train", "--mesh", "data=2,model=4", "--rules", "mlp=model"])
>>> args.mesh, args.rules, args.layers
({'data': 2, 'model': 4}, {'mlp': 'model'}, [784, 512, 10])

Each subcommand is a module with ``HELP``, ``add_arguments(parser)``,
``check(args, error)`` (every flag, together, before any work) and
``run(args) -> exit status``: ``train``, ``explain``, ``sample`` (a GPT's
checkpoint continues a prompt) and ``minishard.run.launch``, one row each of
``COMMANDS``. What they share lives beside them: ``flags`` (flag types
and the checks of several flags at once), ``ignored`` (the flags a mode of
``explain`` would ignore, refused), ``models`` (one entry per model) and
``styles`` (one entry per ``--parallel`` style).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from minishard.run import launch
from minishard.run.cli import explain, sample, train

__all__ = ["COMMANDS", "Command", "main", "parse_args"]


class Command(NamedTuple):
    """A subcommand: its one-line help, its flags, their checks, and what it runs."""

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    check: Callable[[argparse.Namespace, Callable[[str], Any]], argparse.Namespace]
    run: Callable[[argparse.Namespace], int]
    description: str | None = None
    epilog: str | None = None


COMMANDS = {
    "train": Command(train.HELP, train.add_arguments, train.check, train.run),
    "explain": Command(explain.HELP, explain.add_arguments, explain.check, explain.run, explain.DESCRIPTION),
    "sample": Command(sample.HELP, sample.add_arguments, sample.check, sample.run, sample.__doc__),
    "launch": Command(
        launch.HELP, launch.add_arguments, launch.check, launch.run, launch.HELP, launch.EXAMPLE
    ),
}
"""``minishard <name>``'s subcommands."""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse ``minishard train|explain|sample|launch ...`` and check every flag before any work.

    For ``train``, mesh and rules come back as dicts, layers as a list. A bad
    flag exits with argparse's one-line ``error: argument --flag: ...`` and
    status 2. No flag may be abbreviated (``--mes`` is not ``--mesh``).
    """
    parser = argparse.ArgumentParser(
        prog="minishard", description=__doc__.split("\n\n")[0], allow_abbrev=False
    )
    subcommands = parser.add_subparsers(dest="subcommand", required=True)  # launch has its own "command"
    errors = {}
    for name, command in COMMANDS.items():  # allow_abbrev is per parser: each subcommand parses its own flags
        sub = subcommands.add_parser(
            name,
            help=command.help,
            description=command.description,
            epilog=command.epilog,
            allow_abbrev=False,
        )
        command.add_arguments(sub)
        errors[name] = sub.error  # "minishard train: error: ...", as argparse words its own
    args = parser.parse_args(_dashed_values(sys.argv[1:] if argv is None else argv))
    return COMMANDS[args.subcommand].check(args, errors[args.subcommand])


def _dashed_values(argv: Sequence[str]) -> list[str]:
    """``--profile-steps -1:3`` -> ``--profile-steps=-1:3``: argparse takes a value that
    starts with a dash and a digit, but is no plain number, for a flag ("expected one
    argument"); joined, the flag's own check says what is wrong with it."""
    joined: list[str] = []
    for word in argv:
        flag = joined[-1] if joined else ""
        if flag.startswith("--") and flag != "--" and "=" not in flag and re.match(r"-\d", word):
            joined[-1] += "=" + word
        else:
            joined.append(word)
    return joined


def main(argv: Sequence[str] | None = None) -> int:
    """The ``minishard`` console script: ``train``, ``explain``, ``sample`` or ``launch``, as parsed.

    Every failure reaches the user as one ``error:`` line (``--debug`` shows the
    traceback); Ctrl-C (and ``train``'s SIGTERM) stops with one line that says where to resume
    from, and the program (``argv`` None: the command line's) exits 130 (143) there and then:
    Ctrl-C inside TensorFlow's data load leaves threads that crash the
    interpreter's teardown (a segfault, exit -11, 4-8 s into a GPT run).
    """
    args = parse_args(argv)
    status = COMMANDS[args.subcommand].run(args)  # launch: N processes of this same main (train ...)
    if status in (130, 143) and argv is None:  # Ctrl-C, or SIGTERM (run.errors.Terminated)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status
