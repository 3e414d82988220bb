"""The same training code on JAX's multi-process runtime: 2 processes x 4 CPU devices = 1 mesh of 8.

Each process runs ``fit`` on the same global mesh; its ``Dataset`` yields only
its own rows of every global batch, and ``to_global`` assembles them with
``jax.make_array_from_process_local_data``. The loss curve must equal one
process with 8 devices.
"""

import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

import minishard as ms
from minishard.data import Dataset
from minishard.train import fit

WORKER = """
import json, os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=sys.argv[2], num_processes=2, process_id=int(sys.argv[1]))
sys.path.insert(0, sys.argv[3])
from test_multiprocess import train
print("LOSSES", json.dumps(train(), separators=(",", ":")), jax.process_count(), len(jax.local_devices()))
"""


def train() -> list[float]:
    """Two epochs on a tiny synthetic set over a data=8 mesh; one loss per epoch."""
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (64, 2, 2, 1), dtype=np.uint8)
    data = Dataset(images, images.reshape(64, -1).argmax(axis=1), batch_size=16)
    model = ms.mlp([4, 8, 4], key=jax.random.key(0))
    mesh, rules = ms.make_mesh({"data": 8}), ms.AxisRules(batch="data")  # 8 devices, from 1 or 2 processes
    quiet = {"log": lambda line: None, "progress": False}
    _, _, history = fit(model, ms.SGD(0.1, momentum=0.9), data, mesh=mesh, rules=rules, epochs=2, **quiet)
    return [record["loss"] for record in history]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_train_like_one():
    address = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    here = os.path.dirname(__file__)
    command = [sys.executable, "-c", WORKER]
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    workers = [subprocess.Popen([*command, str(i), address, here], env=env, **pipes) for i in range(2)]
    try:
        outputs = [worker.communicate(timeout=240)[0] for worker in workers]
    finally:
        for worker in workers:
            worker.kill()
    results = [line.split() for out in outputs for line in out.splitlines() if line.startswith("LOSSES")]
    assert len(results) == 2, outputs
    for _, losses, processes, local_devices in results:
        assert (processes, local_devices) == ("2", "4")
        np.testing.assert_allclose(json.loads(losses), train(), rtol=1e-6)
