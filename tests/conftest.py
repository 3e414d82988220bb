"""Test set-up: 8 simulated CPU devices, a fast-compiling XLA, minishard.testing's hypothesis profiles.

XLA reads XLA_FLAGS once, when JAX first initialises its backend, so the flags
must be set here, before any test module imports jax.
"""

import gc
import os
import signal
import tempfile

# 8 simulated devices, and a compiler that compiles fast: XLA:CPU's backend (LLVM and its fusion
# emitters) took 85% of the suite's time; at optimisation level 0 with the loop emitters the suite
# ran in 728 s against 1,648 s on 2 cores. A program runs slower (a dp+pp MNIST epoch 39 s against
# 14 s), so the one test that trains for long, test_pipeline's two epochs, runs at XLA's defaults.
# Subprocesses inherit these through os.environ.
_FLAGS = (
    "--xla_force_host_platform_device_count=8",
    "--xla_backend_optimization_level=0",
    "--xla_cpu_use_fusion_emitters=false",
)
for _flag in _FLAGS:
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}".strip()

# What minishard measures once and caches (a CPU's matmul peak) goes to a directory of this run's,
# never the user's ~/.cache: a test's load would become the machine's peak. Subprocesses inherit it.
os.environ.setdefault("MINISHARD_CACHE_DIR", tempfile.mkdtemp(prefix="minishard-cache-"))

# A shell's background job starts with Ctrl-C ignored, and its children inherit that; the tests
# of Ctrl-C need what a terminal gives: Python's KeyboardInterrupt here, the default in children.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

from minishard.run import data, tfds_reading  # noqa: E402
from minishard.testing import register_profiles  # noqa: E402

# Unset, the quick loop (`pytest -m "not slow"`) gets the 10-example profile; `make test` sets "ci".
ALIASES = {"": "minishard", "ci": "minishard-ci", "dev": "minishard-dev"}
register_profiles()
_name = os.environ.get("HYPOTHESIS_PROFILE", "")
settings.load_profile(ALIASES.get(_name, _name))


# The real MNIST, read through TensorFlow once per test process rather than once per training run:
# a read is 4-5 s of tf.data pulling 70,000 images, and a dozen tests train on it. The arrays are
# read-only, so no test can change another's data. Every other data set, and MNIST from any other
# directory (the tests of missing or damaged data), is read as a user's run reads it.
_read_through_tensorflow = data._read
_MNIST: dict[tuple[str, str], tuple] = {}


def _read_mnist_once(name, split, prepare, data_dir, download):
    if name != "mnist":
        return _read_through_tensorflow(name, split, prepare, data_dir, download)
    key = (split, tfds_reading.data_directory(data_dir))
    if key not in _MNIST:
        arrays = _read_through_tensorflow(name, split, prepare, data_dir, download)
        for array in arrays:
            array.flags.writeable = False
        _MNIST[key] = arrays
    return _MNIST[key]


data._read = _read_mnist_once


def pytest_ignore_collect(collection_path, config):
    """``-m tpu`` on a chip collects only the files that hold such tests: the others build 8-device
    meshes as they import, and a one-chip machine has one device."""
    asked = config.getoption("markexpr", "") or ""
    if "tpu" not in asked or "not tpu" in asked or collection_path.suffix != ".py":
        return None
    return "pytest.mark.tpu" not in collection_path.read_text()


def pytest_collection_finish(session):
    """What collecting imported (JAX, the test modules: 150,000-175,000 objects for 3-5 files) lives
    to the end of the run: frozen, out of the collector's sight, so that a full collection walks what
    the tests made, not all of it again (0.3-2.9 s each in a full run, docs/benchmarks.md). Measured
    on a few files' quick tests: 1.8-3.4 s of full collections became 0.6-1.7 s."""
    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(config, items):
    """Tests marked ``tpu`` run on a TPU chip (``make test-tpu``, docs/tpu.md) and skip in one line
    elsewhere: CI has none. Looking starts JAX's backends, after the XLA_FLAGS above."""
    marked = [item for item in items if "tpu" in item.keywords]
    if not marked:
        return
    import jax

    if jax.default_backend() != "tpu":
        skip = pytest.mark.skip(reason="needs a TPU chip (make test-tpu on one; docs/tpu.md)")
        for item in marked:
            item.add_marker(skip)
