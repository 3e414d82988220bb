"""Test set-up: 8 simulated CPU devices, a fast-compiling XLA, minishard.testing's hypothesis profiles.

XLA reads XLA_FLAGS once, when JAX first initialises its backend, so the flags
must be set here, before any test module imports jax.
"""

import os
import signal

# 8 simulated devices, and a compiler that compiles fast: XLA:CPU's backend (LLVM and its fusion
# emitters) took 85% of the suite's time; at optimisation level 0 with the loop emitters the suite
# ran in 728 s against 1,648 s on 2 cores, and a program runs slower (the dp+pp MNIST test
# 130 s against 80 s).
# Subprocesses inherit these through os.environ.
_FLAGS = (
    "--xla_force_host_platform_device_count=8",
    "--xla_backend_optimization_level=0",
    "--xla_cpu_use_fusion_emitters=false",
)
for _flag in _FLAGS:
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}".strip()

# A shell's background job starts with Ctrl-C ignored, and its children inherit that; the tests
# of Ctrl-C need what a terminal gives: Python's KeyboardInterrupt here, the default in children.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

from hypothesis import settings  # noqa: E402

from minishard.testing import register_profiles  # noqa: E402

# Unset, the quick loop (`pytest -m "not slow"`) gets the 10-example profile; `make test` sets "ci".
ALIASES = {"": "minishard", "ci": "minishard-ci", "dev": "minishard-dev"}
register_profiles()
_name = os.environ.get("HYPOTHESIS_PROFILE", "")
settings.load_profile(ALIASES.get(_name, _name))
