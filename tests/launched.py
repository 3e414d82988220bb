"""The program that launched tests run, and the helpers that start it.

    minishard launch -n 2 --devices-per-process 4 -- python tests/launched.py train ...

runs the real ``minishard train`` (``cli.main``) in each process on a small
synthetic MNIST, so each process starts in seconds instead of importing
TensorFlow for a minute. ``train A ... then train B ...`` runs two trainings, one
after the other, in the same processes (joined once): one launch where two would
start and join two more processes. Used by tests/test_launch.py and
tests/test_distributed.py; every subprocess runs under a timeout.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from minishard.run import cli, data
from minishard.run.data import Dataset

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


LAUNCHER = [sys.executable, str(ROOT / "minishard" / "run" / "launch.py")]
"""``minishard launch``, its module run as a file: the same ``Launch`` of the same processes, started in
0.2 s instead of 4. ``python -m minishard`` first imports JAX and every command, which the launcher
needs only to check the flags of a ``train ...`` it starts (never ``python tests/launched.py``). The
runs started so are about their processes; tests/test_launch.py's signal test at the launcher's own
import and its noisy-peer test start ``python -m minishard launch`` as a user does."""


def launch_command(args: list[str], *, processes: int = 2, devices: int = 4, grace: float = 5.0) -> list[str]:
    """``minishard launch -n 2 --devices-per-process 4 -- python tests/launched.py <args>`` (``LAUNCHER``).

    The launched runs share one persistent compilation cache: the second one compiles little.
    """
    command = [*LAUNCHER, "-n", str(processes), "--grace", str(grace)]
    command += ["--devices-per-process", str(devices), "--", sys.executable, __file__, *args]
    return [*command, *CACHED] if args[0] == "train" else command


def run_launch(
    args: list[str], *, then: list[str] | None = None, devices: int = 4, timeout: float = 120
) -> subprocess.CompletedProcess:
    """``args`` launched, and ``then`` (another ``train ...``) in the same processes once it succeeds."""
    command = launch_command([*args, *CACHED, THEN, *then] if then else args, devices=devices)
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


# One per pytest-xdist worker ("gw0", "gw1"; "" when serial): a module's fixture removes its cache while
# another worker's launched processes may be reading theirs.
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
COMPILE_CACHE = Path(tempfile.gettempdir()) / f"minishard-test-launch-{os.getuid()}{WORKER}"
CACHED = ["--compile-cache", str(COMPILE_CACHE)]
THEN = "then"
"""The word between two trainings of one launched program (``run_launch``'s ``then``)."""


@pytest.fixture(scope="module")
def fresh_compile_cache():
    """One compilation cache per test module, removed after it."""
    shutil.rmtree(COMPILE_CACHE, ignore_errors=True)
    yield
    shutil.rmtree(COMPILE_CACHE, ignore_errors=True)


if __name__ == "__main__":  # one process of a launched run: the real CLI on the synthetic data
    data.DATASETS["mnist"] = synthetic_mnist
    first, then = sys.argv[1:], []
    if THEN in first:  # "train A ... then train B ...": B in these processes once A succeeds
        at = first.index(THEN)
        first, then = first[:at], first[at + 1 :]
    status = cli.main(first)
    sys.exit(cli.main(then) if status == 0 and then else status)
