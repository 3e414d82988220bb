"""ZeRO across processes: its ``reduce_scatter`` is right at every chunk size, and 2 processes train like 1.

A JAX issue reported wrong ``psum_scatter`` results on multi-process CPU for chunks
over 256 KiB, and this suite saw them under load, so ``minishard.zero.reduce_scatter``
steps around gloo's reduce-scatter there; both are measured. One launch of real processes holds
both claims: ZeRO trains on a synthetic MNIST (``tests/launched.py``'s), then the same two processes
probe the scatters,

    minishard launch -n 2 -- python tests/test_zero_multiprocess.py train --parallel zero ...

(this file doubles as the program, see ``__main__``; the launcher started as ``launched.LAUNCHER``).
Every subprocess runs under a timeout.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from launched import LAUNCHER, ROOT, synthetic_mnist
from test_distributed import epoch_lines, logged_losses

from minishard.run import cli, data

CASES = [(8, kib) for kib in (16, 255, 256, 257, 512, 1024)] + [(2, kib) for kib in (256, 1024, 4096)]
"""(devices in each psum_scatter group, KiB of float32 each device receives): over all 8 devices as
ZeRO runs it, and in groups of 2 that pair a device of each process, as the JAX issue (jax-ml/jax#40830:
4 MiB float64 chunks wrong at the end of rank 0's chunk, on jaxlib 0.12 dev builds) reproduced it.
Seen here on jaxlib 0.10.2 too, only under load: groups of 8, 1024 KiB, rank 0 off by 4098, in 1 of 6
and 1 of 9 runs beside 3 busy cores (XLA's default flags and the suite's alike), none in 10 runs idle."""
REPEATS = 3  # the issue saw it intermittently (148 of 150 iterations at 4 MiB)
TRAIN_ZERO = ["train", "--parallel", "zero", "--mesh", "data=8", "--layers", "784,1024,10"]
"""784 x 1024 float32 weights: each device's 1/8 of the first gradient is 392 KiB, over 256 KiB."""


def probe() -> None:
    """One process of the launched run, after its training: ``jax.lax.psum_scatter`` and
    ``minishard.zero.reduce_scatter`` in groups over both processes, per case and repeat; prints the
    largest error of this process's results against the sum done by NumPy."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import minishard as ms
    from minishard.zero import reduce_scatter

    scatters = {
        "psum_scatter": lambda x, axis: jax.lax.psum_scatter(x, axis, tiled=True),
        "reduce_scatter": reduce_scatter,
    }

    devices = jax.device_count()  # of both processes: the training joined them
    for group, kib in CASES:
        mesh = ms.make_mesh({"data": group, "rest": devices // group})  # "data" spans both processes
        blocks, chunk = NamedSharding(mesh, P("data", "rest")), kib * 1024 // 4
        shape = (group, devices // group, group * chunk)
        rows = (np.arange(shape[-1]) % 1024 + np.indices(shape[:2]).sum(0)[..., None]).astype(np.float32)
        expected = rows.sum(0).reshape(shape[1], group, chunk).transpose(1, 0, 2)  # exact: small integers
        for name, scatter in scatters.items():
            per_device = lambda x, f=scatter: f(x[0, 0], "data")[None, None]  # noqa: E731
            run = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=blocks.spec, out_specs=blocks.spec))
            errors = []
            for _ in range(REPEATS):
                out = run(jax.make_array_from_callback(shape, blocks, rows.__getitem__))
                shards = jax.block_until_ready(out).addressable_shards
                errors.append(
                    max(float(np.abs(np.asarray(s.data) - expected[s.index]).max()) for s in shards)
                )
            print(f"{name} groups of {group}, {kib} KiB: max error {max(errors):g}", flush=True)


@pytest.mark.slow
def test_two_processes_train_zero_like_one_and_its_reduce_scatter_is_exact_at_every_chunk_size(
    tmp_path, monkeypatch, capsys
):
    # One launch for both claims (one test: pytest-xdist never splits it over two workers, each
    # launching): ZeRO's 2 epochs in 2 processes, then the probe in the same processes.
    argv = [*TRAIN_ZERO, "--batch-size", "64", "--epochs", "2"]
    command = [*LAUNCHER, "-n", "2", "--devices-per-process", "4", "--", sys.executable, __file__]
    run = subprocess.run(
        [*command, *argv, "--log", str(tmp_path / "two.jsonl")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stdout + run.stderr

    # The probe: every case in both processes; minishard's reduce_scatter exact in each.
    found = re.findall(r"\[rank (\d)\] (\w+) groups of (\d+), (\d+) KiB: max error (\S+)", run.stdout)
    cases = sorted((name, int(rank), int(group), int(kib)) for rank, name, group, kib, _ in found)
    names = ("psum_scatter", "reduce_scatter")
    assert cases == sorted((name, rank, *case) for name in names for rank in (0, 1) for case in CASES), (
        run.stdout
    )
    wrong = {name: [] for name in names}
    for rank, name, group, kib, error in found:
        if float(error) != 0.0:
            wrong[name].append(f"rank {rank}, groups of {group}, {kib} KiB: {error}")
    print(f"jax.lax.psum_scatter through gloo, wrong: {wrong['psum_scatter'] or 'none'}", file=sys.__stderr__)
    assert not wrong["reduce_scatter"], wrong["reduce_scatter"]

    # The training: as one process trains.
    monkeypatch.setitem(data.DATASETS, "mnist", synthetic_mnist)
    assert "[rank 0] 2 processes x 4 devices: 8 in all" in run.stdout and "ZeRO-3 by hand" in run.stdout
    assert cli.main([*argv, "--log", str(tmp_path / "one.jsonl")]) == 0
    single = capsys.readouterr().out
    assert len(epoch_lines(single)) == 2 and epoch_lines(run.stdout) == epoch_lines(single)
    two, one = logged_losses(tmp_path / "two.jsonl"), logged_losses(tmp_path / "one.jsonl")
    assert len(one) == 3  # the epochs' means and the loss at step 20
    gap = max(abs(a - b) for a, b in zip(two, one))
    print(f"2 vs 1 process: {epoch_lines(single)[-1]}; max |loss difference| {gap:.2g}", file=sys.__stderr__)
    # gloo sums in another order than XLA's in-process sum. The loss at step 20 is 3e-4: 20 steps of
    # differently rounded updates move it by 1.4e-6 of itself (16 float32 ulps) on a Zen 5 CPU, 2026-12-04.
    assert two == pytest.approx(one, rel=1e-5)


if __name__ == "__main__":  # one process of the launched run: ZeRO trains (the real CLI), then the probe
    data.DATASETS["mnist"] = synthetic_mnist
    status = cli.main(sys.argv[1:])
    if status == 0:
        probe()
    sys.exit(status)
