"""Test set-up: 8 simulated CPU devices and minishard.testing's hypothesis profiles.

XLA reads XLA_FLAGS once, when JAX first initialises its backend, so the flag
must be set here, before any test module imports jax.
"""

import os
import signal

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()

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
