"""Import this first: 8 simulated CPU devices, and the offline data when it is there.

XLA reads ``XLA_FLAGS`` once, when JAX first starts its backend, so the flag is
set here, at import, before any module imports jax.
"""

from __future__ import annotations

import os

FLAG = "--xla_force_host_platform_device_count=8"
if FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FLAG}".strip()
DATA = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "data", "tensorflow_datasets"
)
if os.path.isdir(DATA):
    os.environ.setdefault("TFDS_DATA_DIR", os.path.normpath(DATA))
