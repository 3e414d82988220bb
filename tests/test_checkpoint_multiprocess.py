"""Checkpoints of a 2-process run carry every process's checksums, and both topologies verify them.

The run is the real ``minishard train`` in two processes through the launcher,

    minishard launch -n 2 --devices-per-process 4 -- python tests/test_checkpoint_multiprocess.py train ...

(the launcher started as ``launched.LAUNCHER``, its module as a file) on a small synthetic MNIST
(this file doubles as the program, see ``__main__``), on a ``data=2,model=4`` mesh whose "data"
axis also splits the first weight's rows (process 0 holds devices ``data=0``, process 1 ``data=1``),
so that each process writes its own blocks of it. The first launch's processes, once trained, go on
to a second task (``resave DIR train ...``): a ``Checkpointer`` in each process that discards a step
while one process lists the steps late; one launch holds both.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from launched import LAUNCHER

from minishard.run import cli, data
from minishard.run.data import Dataset

ROOT = Path(__file__).resolve().parent.parent
TRAIN = [
    "train",
    "--layers",
    "784,32,10",
    "--batch-size",
    "64",
    "--mesh",
    "data=2,model=4",
    "--rules",
    "embed=data",
]
"""16 steps per epoch; the first weight's rows split over "data", so each process writes half of it."""


def synthetic_mnist(split: str, batch_size: int, *, shuffle_seed: int = 0, flatten: bool = True, **_: object):
    """MNIST-shaped random images: enough to train a few steps, and no TensorFlow to import."""
    n = 1024 if split == "train" else 256
    rng = np.random.default_rng(0 if split == "train" else 1)
    images = rng.integers(0, 256, (n, 28, 28, 1), dtype=np.uint8)
    return Dataset(images, rng.integers(0, 10, n), batch_size, shuffle=split == "train",
                   shuffle_seed=shuffle_seed, flatten=flatten)  # fmt: skip


def launch(args: list[str], cache: Path) -> subprocess.CompletedProcess:
    command = [*LAUNCHER, "-n", "2", "--devices-per-process", "4", "--"]
    command += [sys.executable, __file__, *args, "--compile-cache", str(cache)]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)


def flip_16_bytes(file: Path) -> None:
    data = bytearray(file.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 16] = bytes(b ^ 0xFF for b in data[middle : middle + 16])
    file.write_bytes(bytes(data))


@pytest.mark.slow
def test_a_flipped_shard_is_caught_in_2_processes_and_in_1_and_a_step_is_deleted_once_all_have_listed(
    tmp_path, monkeypatch, capsys
):
    # One launch for the checkpoint and the resaving (one test: pytest-xdist never splits it over two
    # workers, each launching): an epoch in 2 processes, saved at steps 8 and 16, then the resaving.
    saved, cache = tmp_path / "saved", tmp_path / "cache"
    train = [*TRAIN, "--epochs", "1", "--checkpoint-dir", str(saved), "--checkpoint-every", "8"]
    run = launch(["resave", str(tmp_path / "resaved"), *train], cache)
    assert run.returncode == 0, run.stdout + run.stderr
    for rank in (0, 1):  # process 0 deleted step 16 only once process 1 had listed the steps
        assert f"[rank {rank}] process {rank} keeps steps [8, 12]" in run.stdout, run.stdout
    records = {f.name: json.loads(f.read_text()) for f in (saved / "16" / "integrity").glob("process_*")}
    assert sorted(records) == ["process_0", "process_1"]  # each process wrote its own record
    weight = "model.layers[0].weight"
    assert set(records["process_0"][weight]) == {f"0:392,{8 * i}:{8 * i + 8}" for i in range(4)}
    assert set(records["process_1"][weight]) == {f"392:784,{8 * i}:{8 * i + 8}" for i in range(4)}

    written_by_1 = [f for f in (saved / "16" / "state").glob("ocdbt.process_1/d/*") if f.is_file()]
    flip_16_bytes(max(written_by_1, key=lambda f: f.stat().st_size))
    caught = (  # process 1 finds the damage; process 0 speaks for the run
        r"checkpoint \S+/16 is corrupt \(\S+ \(shard \[392:784,\d+:\d+\]\) does not match the checksum "
        r"written with it\); falling back to step 8"
    )

    two = shutil.copytree(saved, tmp_path / "two", ignore=shutil.ignore_patterns(".minishard.lock"))
    run = launch([*TRAIN, "--epochs", "1", "--checkpoint-dir", str(two), "--resume"], cache)  # steps 9-16
    assert run.returncode == 0, run.stdout + run.stderr
    assert re.search(r"\[rank 0\] " + caught, run.stdout), run.stdout
    assert "[rank 0] Resumed from step 8: epoch 1, batch 8" in run.stdout

    monkeypatch.setitem(data.DATASETS, "mnist", synthetic_mnist)  # one process, 8 devices (conftest)
    assert cli.main([*TRAIN, "--epochs", "1", "--checkpoint-dir", str(saved), "--resume"]) == 0
    out = capsys.readouterr().out
    assert re.search(caught, out), out
    assert "not checked" not in out  # one process holds every block of step 8, written by two
    assert "Resumed from step 8: epoch 1, batch 8" in out


def resave_behind_a_slow_process(directory: str) -> None:
    """One process of the first launch, after its training: save steps 8 and 16, then 12, which
    discards 16 first.

    Process 1 lists the steps a second after process 0 does, as a loaded machine may make it:
    process 0 must not delete step 16 while process 1 has yet to read the listing.
    """
    import time

    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from minishard.run.checkpoint import Checkpointer

    sharding = NamedSharding(jax.make_mesh((jax.device_count(),), ("data",)), P("data"))
    state = {"w": jax.device_put(jnp.arange(16.0), sharding)}  # each process writes its half
    with Checkpointer(directory) as checkpointer:
        checkpointer.save(8, state, {})
        checkpointer.save(16, state, {})
        if jax.process_index() == 1:
            listed = checkpointer.steps

            def steps_a_second_late() -> list[int]:
                time.sleep(1.0)
                return listed()

            checkpointer.steps = steps_a_second_late  # type: ignore[method-assign]
        checkpointer.save(12, state, {})
        print(f"process {jax.process_index()} keeps steps {checkpointer.steps()}")


if __name__ == "__main__":  # one process of a launched run: the real CLI on the synthetic data
    data.DATASETS["mnist"] = synthetic_mnist
    resave = sys.argv[2] if sys.argv[1] == "resave" else None  # then the resaving, in these processes
    status = cli.main(sys.argv[3:] if resave else sys.argv[1:])
    if status == 0 and resave:
        resave_behind_a_slow_process(resave)
    sys.exit(status)
