"""Checkpoints: resharding on restore, retention, a save killed midway, corrupted files."""

import contextlib
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import minishard
from minishard.models.gpt import Embedding
from minishard.run.checkpoint import Checkpointer, check_writable, saved_steps
from minishard.run.errors import CheckpointError, NonFiniteStateError
from minishard.sharding import named_shardings, partition_specs

REPO = Path(__file__).resolve().parents[1]
MEGATRON = [("embed", "mlp"), ("mlp", "embed")]
TENSOR_PARALLEL = minishard.AxisRules(embed=None, mlp="model")


def train_state(seed=0, momentum=0.9):
    """A tiny model and its SGD state (momentum=0: the state's momentum is None)."""
    model = minishard.mlp([16, 32, 8], key=jax.random.key(seed), axes=MEGATRON)
    opt_state = minishard.SGD(0.1, momentum=momentum).init(model)
    if momentum:  # non-zero velocities, so a restore that dropped them would show
        opt_state = opt_state._replace(velocity=jax.tree_util.tree_map(lambda p: 2 * p, model))
    return {"model": model, "opt_state": opt_state._replace(step=jnp.asarray(7 + seed, jnp.int32))}


def saved_on_2x4(state):
    return minishard.shard(state, minishard.make_mesh({"data": 2, "model": 4}), TENSOR_PARALLEL)


def abstract(state, mesh, rules):
    """ShapeDtypeStructs carrying the shardings to restore onto: no arrays allocated."""
    shardings = named_shardings(partition_specs(state, rules, mesh), mesh)
    return jax.tree_util.tree_map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings
    )


def assert_same_values(restored, expected):
    assert jax.tree_util.tree_structure(restored) == jax.tree_util.tree_structure(expected)
    for got, want in zip(jax.tree_util.tree_leaves(restored), jax.tree_util.tree_leaves(expected)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


DATA_PARALLEL_8 = minishard.AxisRules(embed=None, mlp="data")
ONTO = {
    "data=8, mlp split over data": ({"data": 8}, DATA_PARALLEL_8),
    "data=8, replicated": ({"data": 8}, minishard.AxisRules(embed=None, mlp=None)),
    "one device": ({"data": 1}, minishard.AxisRules(embed=None, mlp=None)),
}


@pytest.mark.parametrize("momentum", [0.9, 0.0], ids=["momentum", "no-momentum"])
@pytest.mark.parametrize("onto", ONTO, ids=list(ONTO))
def test_restore_onto_another_mesh(tmp_path, onto, momentum):
    state = saved_on_2x4(train_state(momentum=momentum))
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(3, state, {"epoch": 1})
        shape, rules = ONTO[onto]
        mesh = minishard.make_mesh(shape, devices=jax.devices()[: int(np.prod(list(shape.values())))])
        target = abstract(train_state(seed=1, momentum=momentum), mesh, rules)
        step, restored, meta = ckpt.restore(target)
    jax.block_until_ready(restored)
    assert (step, meta) == (3, {"epoch": 1})
    assert_same_values(restored, state)  # equal treedefs: a None momentum came back as None
    for got, want in zip(jax.tree_util.tree_leaves(restored), jax.tree_util.tree_leaves(target)):
        assert got.sharding == want.sharding


def test_target_may_hold_arrays_and_gives_the_structure(tmp_path):
    state = saved_on_2x4(train_state())
    target = minishard.shard(train_state(seed=1), minishard.make_mesh({"data": 8}), DATA_PARALLEL_8)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, state, {})
        _, restored, _ = ckpt.restore(target)
    assert isinstance(restored["model"], minishard.Sequential)
    assert isinstance(restored["opt_state"], minishard.SGDState)
    assert_same_values(restored, state)


def test_keeps_the_last_k_and_meta_round_trips(tmp_path):
    state = saved_on_2x4(train_state())
    meta = {"epoch": 2, "batch": 17, "seed": 1234, "history": [{"loss": 0.5, "acc": 0.875}], "note": None}
    with Checkpointer(tmp_path, keep=2) as ckpt:
        for step in (10, 20, 30, 40):
            ckpt.save(step, state, {**meta, "step": step})
        assert ckpt.steps() == [30, 40]
        assert ckpt.restore(state, step=30)[2] == {**meta, "step": 30}
    assert sorted(p.name for p in tmp_path.iterdir()) == [".minishard.lock", "30", "40"]
    with Checkpointer(tmp_path) as reopened:  # another process sees the same steps
        assert reopened.steps() == [30, 40]


def test_saving_behind_the_latest_discards_the_abandoned_future(tmp_path):
    state, lines = saved_on_2x4(train_state()), []
    with Checkpointer(tmp_path, log=lines.append) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, state, {})
        ckpt.save(2, state, {"again": True})
        assert ckpt.steps() == [1, 2]
        assert ckpt.restore(state)[2] == {"again": True}
    assert len(lines) == 1 and "[2, 3]" in lines[0]


def test_meta_must_be_json(tmp_path):
    with Checkpointer(tmp_path) as ckpt, pytest.raises(CheckpointError, match="JSON"):
        ckpt.save(1, {"w": jnp.ones(2)}, {"seed": np.random.default_rng(0)})
    assert [p.name for p in tmp_path.iterdir()] == [".minishard.lock"]  # no checkpoint written


def test_empty_directory(tmp_path):
    with Checkpointer(tmp_path / "new") as ckpt, pytest.raises(CheckpointError, match="holds no checkpoint"):
        ckpt.restore({"w": jnp.ones(2)})


# --- a save killed midway --------------------------------------------------------

SAVE_THEN_DIE = """
import sys
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from minishard import make_mesh
from minishard.run.checkpoint import Checkpointer

put = lambda x: jax.device_put(x, NamedSharding(make_mesh({"data": 2, "model": 4}), P("data", "model")))
ckpt = Checkpointer(sys.argv[1], log=lambda line: None)
ckpt.save(1, {"w": put(jnp.full((8, 8), 1.5))}, {"epoch": 1})
big = put(jnp.ones((8192, 6400)))  # 200 MB: over a second to write, a wide window for SIGKILL
big.block_until_ready()
print("saving step 2", flush=True)
ckpt.save(2, {"w": big}, {"epoch": 2})
print("saved step 2", flush=True)
"""


@pytest.mark.slow
def test_sigkill_during_save_keeps_the_previous_checkpoint(tmp_path):
    directory = tmp_path / "ckpt"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}  # XLA_FLAGS as conftest set them
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    with (tmp_path / "child.log").open("w+") as log:
        child = subprocess.Popen(
            [sys.executable, "-c", SAVE_THEN_DIE, str(directory)], cwd=REPO, env=env, stdout=log, stderr=log
        )
        try:
            deadline = time.monotonic() + 120
            while not list(directory.glob("2.orbax-checkpoint-tmp*")):  # step 2 is being written
                if child.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    pytest.fail(
                        f"child ended ({child.returncode}) before saving step 2:\n{log.read()[-3000:]}"
                    )
                time.sleep(0.005)
            child.send_signal(signal.SIGKILL)
        finally:
            child.kill()
            child.wait(timeout=30)
    if (directory / "2").exists():
        pytest.skip("step 2 was finalized before SIGKILL landed; the kill window was missed")
    assert list(directory.glob("2.orbax-checkpoint-tmp*")), "the unfinished save should leave its tmp dir"

    with Checkpointer(directory) as ckpt:
        assert ckpt.steps() == [1]
        step, restored, meta = ckpt.restore({"w": jnp.zeros((8, 8))})
    assert (step, meta) == (1, {"epoch": 1})
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.full((8, 8), 1.5))
    assert not list(directory.glob("*.orbax-checkpoint-tmp*")), "opening a Checkpointer cleans tmp dirs"


# --- corrupted files ---------------------------------------------------------------


def truncate_array_data(step_dir):
    # OCDBT keeps the arrays (and its b-tree) in files under `d/`; checksums catch damage.
    files = [f for f in (step_dir / "state").rglob("*") if f.is_file() and f.parent.name == "d"]
    assert files
    for f in files:
        with f.open("r+b") as handle:
            handle.truncate(f.stat().st_size // 2)


def delete_manifest(step_dir):
    for f in (step_dir / "state").rglob("manifest.ocdbt"):
        f.unlink()


def delete_meta(step_dir):
    (step_dir / "meta" / "metadata").unlink()


@pytest.mark.parametrize("corrupt", [truncate_array_data, delete_manifest, delete_meta])
def test_corrupted_latest_falls_back_to_the_previous(tmp_path, corrupt):
    good, bad = saved_on_2x4(train_state(seed=0)), saved_on_2x4(train_state(seed=1))
    lines = []
    with Checkpointer(tmp_path, log=lines.append) as ckpt:
        ckpt.save(1, good, {"epoch": 1})
        ckpt.save(2, bad, {"epoch": 2})
        corrupt(tmp_path / "2")
        target = abstract(good, minishard.make_mesh({"data": 8}), DATA_PARALLEL_8)

        unreadable = re.escape(f"checkpoint {tmp_path / '2'} is unreadable (")
        with pytest.raises(CheckpointError, match=unreadable + r"\w+") as info:
            ckpt.restore(target, step=2)
        assert info.value.__cause__ is None and info.value.__suppress_context__  # no chained traceback
        assert "\n" not in str(info.value)

        step, restored, meta = ckpt.restore(target)
    assert (step, meta) == (1, {"epoch": 1})
    assert_same_values(restored, good)
    assert len(lines) == 1
    assert lines[0].startswith(f"checkpoint {tmp_path / '2'} is unreadable (")
    assert lines[0].endswith("; falling back to step 1")


def test_nothing_loadable_names_every_checkpoint(tmp_path):
    state = saved_on_2x4(train_state())
    with Checkpointer(tmp_path, log=lambda line: None) as ckpt:
        for step in (1, 2):
            ckpt.save(step, state, {})
            delete_manifest(tmp_path / str(step))
        with pytest.raises(CheckpointError, match="could be loaded:") as info:
            ckpt.restore(state)
    assert str(tmp_path / "1") in str(info.value) and str(tmp_path / "2") in str(info.value)
    assert info.value.__context__ is None
    with Checkpointer(tmp_path) as ckpt, pytest.raises(CheckpointError, match="no checkpoint for step 5"):
        ckpt.restore(state, step=5)


def test_a_target_of_another_model_is_named_not_taken_for_corruption(tmp_path):
    lines = []
    with Checkpointer(tmp_path, log=lines.append) as ckpt:
        ckpt.save(1, train_state(), {})
        ckpt.save(2, train_state(), {})
        wider = minishard.mlp([16, 64, 8], key=jax.random.key(0), axes=MEGATRON)
        target = {**train_state(momentum=0.0), "model": wider}
        expected = (
            r"(?s)2 holds other arrays.*weight: checkpoint \(16, 32\) float32, target \(16, 64\) float32"
            r".*has none"
        )
        with pytest.raises(CheckpointError, match=expected):
            ckpt.restore(target)
    assert lines == []  # no fallback: an older checkpoint would not fit either


def test_storage_noise_is_silenced_only_while_a_save_or_restore_runs(tmp_path):
    import logging
    import warnings

    before = sys.unraisablehook, list(logging.getLogger("asyncio").filters), list(warnings.filters)
    state = saved_on_2x4(train_state())
    with Checkpointer(tmp_path, log=lambda line: None) as ckpt:
        ckpt.save(1, state, {})
        ckpt.save(2, state, {})
        delete_manifest(tmp_path / "2")
        assert ckpt.restore(state)[0] == 1  # a failed read, then a good one
    assert (sys.unraisablehook, list(logging.getLogger("asyncio").filters), list(warnings.filters)) == before


def test_checkpoints_from_before_the_velocity_rename_still_load(tmp_path):
    # minishard 0.1 stored SGDState's velocities under "opt_state.momentum...".
    state = train_state()
    old_state = {
        "model": state["model"],
        "opt_state": {"step": state["opt_state"].step, "momentum": state["opt_state"].velocity},
    }
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(3, old_state, {})
        step, restored, _ = ckpt.restore(train_state(seed=1))
    assert step == 3
    assert_same_values(restored, state)


def test_checkpoints_from_before_the_position_table_rename_still_load(tmp_path):
    # Before issue 62 an Embedding's learned position table was stored as "...embedding.positions".
    embedding = Embedding(vocab=5, context=8, width=3, key=jax.random.key(0))
    old_state = {"embedding": {"tokens": embedding.tokens, "positions": embedding.position_table}}
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(3, old_state, {})
        step, restored, _ = ckpt.restore({"embedding": Embedding(5, 8, 3, key=jax.random.key(1))})
    assert step == 3
    assert_same_values(restored, {"embedding": embedding})


def test_a_checkpoint_without_sgds_step_counter_counts_from_its_step_and_says_so(tmp_path):
    # Before issue 44 a constant-rate SGD kept no opt_state.step, so its checkpoints hold none.
    state, lines = train_state(), []
    older = {**state, "opt_state": {"velocity": state["opt_state"].velocity}}  # saved without a step
    with Checkpointer(tmp_path, log=lines.append) as ckpt:
        ckpt.save(3, older, {})
        step, restored, _ = ckpt.restore(train_state(seed=1))
    assert step == 3 and int(restored["opt_state"].step) == 3
    assert_same_values(restored, {**state, "opt_state": state["opt_state"]._replace(step=jnp.int32(3))})
    assert lines == [
        "checkpoint 3 holds no opt_state.step (a constant-rate SGD kept no step counter before minishard's "
        "issue 44): counting from 3"
    ]


def test_a_scalar_named_step_outside_an_optimizer_state_is_still_refused(tmp_path):
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"w": jnp.ones(3), "step": jnp.asarray(4, jnp.int32)}, {})
        with pytest.raises(CheckpointError, match=r"step: checkpoint \(\) int32, target has none"):
            ckpt.restore({"w": jnp.zeros(3)})


# -- faults: a flipped bit, a failed write, a second trainer ---------------------------
def flip_16_bytes_of_the_biggest_file(step_dir: Path) -> None:
    biggest = max((p for p in step_dir.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(biggest.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 16] = bytes(b ^ 0xFF for b in data[middle : middle + 16])
    biggest.write_bytes(bytes(data))


def test_a_flipped_bit_is_caught_by_the_checksum_and_the_array_named(tmp_path):
    state = {"w": jnp.arange(4096, dtype=jnp.float32), "b": jnp.ones(16)}
    lines = []
    with Checkpointer(tmp_path, log=lines.append) as ckpt:
        ckpt.save(1, state, {})
        ckpt.save(2, jax.tree_util.tree_map(lambda x: x + 1, state), {})
        flip_16_bytes_of_the_biggest_file(tmp_path / "2")
        step, restored, _ = ckpt.restore(state)
    assert step == 1
    assert_same_values(restored, state)
    assert lines == [
        f"checkpoint {tmp_path / '2'} is corrupt (w does not match the checksum written with it); "
        "falling back to step 1"
    ]


@pytest.mark.parametrize("bad", [jnp.inf, jnp.nan])
def test_non_finite_state_is_never_saved(tmp_path, bad):
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"w": jnp.ones(3)}, {})
        with pytest.raises(NonFiniteStateError, match=r"not saving step 2: w holds 1 non-finite values"):
            ckpt.save(2, {"w": jnp.array([1.0, bad, 3.0])}, {})
        assert ckpt.steps() == [1]


def test_a_dtype_that_differs_is_refused_not_cast(tmp_path):
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"w": jnp.ones(3, jnp.float32)}, {})
        with pytest.raises(CheckpointError, match=r"w: checkpoint \(3,\) float32, target \(3,\) int8"):
            ckpt.restore({"w": jnp.zeros(3, jnp.int8)})


FAILING_WRITE = """
import resource, signal, sys
import jax, jax.numpy as jnp
from minishard.run.checkpoint import Checkpointer, check_writable, saved_steps
from minishard.run.errors import CheckpointError, NonFiniteStateError
with Checkpointer(sys.argv[1]) as ckpt:
    ckpt.save(1, {"w": jnp.ones(16)}, {})
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit a write fails (EFBIG), nothing is killed
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
    try:
        ckpt.save(2, {"w": jax.random.normal(jax.random.key(0), (100_000,))}, {})  # 400 kB, incompressible
    except CheckpointError as error:
        print(error)
"""


def test_a_failed_write_is_one_checkpoint_error_and_the_previous_one_is_intact(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", FAILING_WRITE, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"could not write the checkpoint of step 2 in {tmp_path} (")
    assert "File too large" in done.stdout and done.stdout.strip().endswith(
        "the previous checkpoint (step 1) is intact"
    )
    assert "Traceback" not in done.stderr  # orbax's writer threads' echoes stay out of the terminal
    with Checkpointer(tmp_path) as ckpt:
        assert ckpt.steps() == [1] and ckpt.restore({"w": jnp.zeros(16)})[1]["w"].tolist() == [1.0] * 16


def test_a_second_trainer_is_refused_and_the_first_keeps_its_checkpoints(tmp_path):
    with Checkpointer(tmp_path) as first:
        first.save(1, {"w": jnp.ones(2)}, {})
        holder = rf"pid {os.getpid()} on host {re.escape(socket.gethostname())}"
        with pytest.raises(CheckpointError, match=rf"in use by another trainer \({holder}, since .*\)"):
            Checkpointer(tmp_path)
        first.save(2, {"w": jnp.ones(2)}, {})
        assert first.steps() == [1, 2]


def test_the_lock_of_a_killed_trainer_is_taken_over_and_said(tmp_path):
    script = (
        f"from minishard.run.checkpoint import Checkpointer; c = Checkpointer({str(tmp_path)!r}); "
        "print('locked', flush=True); import time; time.sleep(60)"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    holder = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(CheckpointError, match=rf"pid {holder.pid} on host"):
            Checkpointer(tmp_path)
        holder.send_signal(signal.SIGKILL)
        holder.wait(30)
    finally:
        holder.kill()
    lines = []
    with Checkpointer(tmp_path, log=lines.append):
        pass
    assert len(lines) == 1 and lines[0].startswith(f"taking over the lock of {tmp_path} left by a trainer")
    assert f"pid {holder.pid} on host" in lines[0]
    with Checkpointer(tmp_path, log=lines.append):  # a clean close leaves nothing to take over
        pass
    assert len(lines) == 1


# -- checksums per block, on any topology; checkpoints from before them -----------------------------
def test_each_block_of_a_sharded_array_gets_its_own_checksum_and_a_flip_names_the_block(tmp_path):
    noise = jax.random.normal(jax.random.key(0), (64, 64))  # incompressible: a flip changes values
    state = {"w": jax.device_put(noise, split_2x4())}
    lines = []
    with Checkpointer(tmp_path, log=lines.append) as ckpt:
        ckpt.save(1, state, {})
        ckpt.save(2, jax.tree_util.tree_map(lambda x: x + 1, state), {})
        record = json.loads((tmp_path / "2" / "integrity" / "process_0").read_text())
        assert set(record["w"]) == {
            f"{32 * i}:{32 * i + 32},{16 * j}:{16 * j + 16}" for i in (0, 1) for j in range(4)
        }
        flip_16_bytes_of_the_biggest_file(tmp_path / "2")
        one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])  # another topology checks it too
        step, restored, _ = ckpt.restore(
            {"w": jax.ShapeDtypeStruct((64, 64), jnp.float32, sharding=one_device)}
        )
    assert step == 1
    assert_same_values(restored, state)
    assert re.fullmatch(
        rf"checkpoint {re.escape(str(tmp_path / '2'))} is corrupt \(w \(shard \[\d+:\d+,\d+:\d+\]\) does not "
        r"match the checksum written with it\); falling back to step 1",
        lines[0],
    ), lines


def split_2x4():
    mesh = minishard.make_mesh({"data": 2, "model": 4})
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", "model"))


def test_non_finite_values_are_counted_over_every_block(tmp_path):
    bad = jnp.ones((8, 8)).at[0, 0].set(jnp.nan).at[7, 7].set(jnp.inf)  # in two different blocks
    with Checkpointer(tmp_path) as ckpt, pytest.raises(NonFiniteStateError, match="w holds 2 non-finite"):
        ckpt.save(1, {"w": jax.device_put(bad, split_2x4())}, {})


def test_checkpoints_with_one_checksum_per_array_or_none_still_load_and_verify(tmp_path):
    # Migration: before per-block checksums, integrity/metadata held one CRC of each whole array;
    # before that, there was no integrity item at all.
    import zlib

    state, lines = {"w": jnp.arange(4096, dtype=jnp.float32)}, []
    with Checkpointer(tmp_path, log=lines.append) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, jax.tree_util.tree_map(lambda x, s=step: x + s, state), {})
        (tmp_path / "1" / "integrity" / "process_0").unlink()  # oldest: no checksums (and no folder)
        (tmp_path / "1" / "integrity").rename(tmp_path / "1" / "no-integrity")
        for step in (2, 3):
            folder = tmp_path / str(step) / "integrity"
            (folder / "process_0").unlink()
            crc = zlib.crc32(np.asarray(state["w"] + step).tobytes())
            (folder / "metadata").write_text(json.dumps({"w": crc}))
        assert ckpt.restore(state)[0] == 3  # the old record verifies
        flip_16_bytes_of_the_biggest_file(tmp_path / "3")
        assert ckpt.restore(state)[0] == 2  # and still catches a flip
        assert ckpt.restore(state, step=1)[1]["w"].tolist() == (state["w"] + 1).tolist()
    assert lines == [
        f"checkpoint {tmp_path / '3'} is corrupt (w does not match the checksum written with it); "
        "falling back to step 2"
    ]


# -- read-only storage, listing a directory that is not there -------------------------------------
@contextlib.contextmanager
def read_only_directory(path: Path):
    """``path`` made read-only: a read-only bind mount as root (root ignores permission bits), else chmod."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        path.chmod(0o555)
        try:
            yield path
        finally:
            path.chmod(0o755)
        return
    mounted = subprocess.run(
        ["mount", "--bind", "-o", "ro", str(path), str(path)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot make a read-only directory here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def test_read_only_storage_is_refused_for_writing_and_restores_without_a_lock(tmp_path):
    state = {"w": jnp.arange(3.0)}
    with Checkpointer(tmp_path / "run") as ckpt:
        ckpt.save(5, state, {"epoch": 1})
    (tmp_path / "run" / ".minishard.lock").unlink()
    with read_only_directory(tmp_path / "run") as directory:
        with pytest.raises(
            CheckpointError, match=rf"checkpoint directory {re.escape(str(directory))} is not writable \(\w"
        ):
            Checkpointer(directory)
        with Checkpointer(directory, read_only=True) as reader:
            assert reader.steps() == [5]
            step, restored, meta = reader.restore({"w": jnp.zeros(3)})
            with pytest.raises(CheckpointError, match="is open read-only: step 6 cannot be saved"):
                reader.save(6, state, {})
        assert (step, restored["w"].tolist(), meta) == (5, [0.0, 1.0, 2.0], {"epoch": 1})
        assert sorted(p.name for p in directory.iterdir()) == ["5"]  # no lock, nothing written
    with pytest.raises(CheckpointError, match="does not exist"):
        Checkpointer(tmp_path / "missing", read_only=True)


def test_a_directory_inside_a_file_is_named(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(
        CheckpointError, match=r"checkpoint directory .*/file/run is inside .*/file, which is a file"
    ):
        check_writable(tmp_path / "file" / "run")
    with pytest.raises(CheckpointError, match=r"checkpoint directory .*/file is a file; choose a directory"):
        check_writable(tmp_path / "file")


def test_saved_steps_lists_finalized_steps_and_never_raises(tmp_path):
    # What an interrupt handler calls: before the directory exists, on a file, and on a real one.
    assert saved_steps(tmp_path / "not-yet") == [] and saved_steps(None) == []
    (tmp_path / "file").write_text("")
    assert saved_steps(tmp_path / "file") == []
    with Checkpointer(tmp_path / "run") as ckpt:
        ckpt.save(20, {"w": jnp.ones(2)}, {})
    (tmp_path / "run" / "7.orbax-checkpoint-tmp-1").mkdir()  # an unfinished save does not count
    assert saved_steps(tmp_path / "run") == [20]


# -- one line per reason ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "damaged, expected",
    [
        (
            "_CHECKPOINT_METADATA",
            r"\S+/2/_CHECKPOINT_METADATA is damaged \(not JSON: .*\); orbax only describes",
        ),
        (
            "state/array_metadatas/process_0",
            r"checkpoint \S+/2 is unreadable \(JSONDecodeError: .*\); falling back",
        ),
        ("meta/metadata", r"checkpoint \S+/2 is unreadable \(JSONDecodeError: .*\); falling back to step 1"),
    ],
)
def test_a_damaged_json_file_gives_exactly_one_line(tmp_path, capfd, caplog, damaged, expected):
    lines = []
    with Checkpointer(tmp_path, log=lines.append) as ckpt:
        ckpt.save(1, {"w": jnp.ones(3)}, {"epoch": 1})
        ckpt.save(2, {"w": jnp.ones(3)}, {"epoch": 2})
        (tmp_path / "2" / damaged).write_text("{not json")
        capfd.readouterr()
        with caplog.at_level(logging.WARNING):
            ckpt.restore({"w": jnp.zeros(3)})
    assert len(lines) == 1 and re.match(expected, lines[0]), lines
    assert capfd.readouterr() == ("", "")  # no "ERROR:absl:Failed to json parse", no TensorStore spec
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_a_damaged_metadata_file_read_when_opening_is_one_line_too(tmp_path, capfd, caplog):
    with Checkpointer(tmp_path, log=print) as ckpt:
        ckpt.save(1, {"w": jnp.ones(3)}, {"epoch": 1})
    (tmp_path / "1" / "_CHECKPOINT_METADATA").write_text("{not json")
    capfd.readouterr()
    lines = []
    with caplog.at_level(logging.WARNING), Checkpointer(tmp_path, log=lines.append) as ckpt:
        ckpt.restore({"w": jnp.zeros(3)})  # orbax read every step's metadata as the Checkpointer opened
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert len(lines) == 1 and re.match(r"\S+/1/_CHECKPOINT_METADATA is damaged \(not JSON", lines[0]), lines
    assert capfd.readouterr() == ("", "")  # no raw "ERROR:absl:Failed to json parse"


def test_a_failed_read_is_one_line_without_tensorstore_s_spec_dump(tmp_path, capfd):
    state, lines = (
        {"w": jax.device_put(jnp.arange(64 * 64, dtype=jnp.float32).reshape(64, 64), split_2x4())},
        [],
    )
    with Checkpointer(tmp_path, log=lines.append) as ckpt:
        ckpt.save(1, state, {})
        ckpt.save(2, state, {})
        biggest = max((tmp_path / "2" / "state").rglob("d/*"), key=lambda f: f.stat().st_size)
        data = biggest.read_bytes()
        biggest.write_bytes(bytes(b ^ 0xFF for b in data[:16]) + data[16:])  # a zstd header: the read fails
        capfd.readouterr()
        assert ckpt.restore(state)[0] == 1
    assert len(lines) == 1 and lines[0].endswith("; falling back to step 1"), lines
    assert "is unreadable (Exception: Encountered error while reading array index" in lines[0]
    assert "bound method" not in lines[0] and "TensorStore(" not in lines[0] and "\n" not in lines[0]
    assert capfd.readouterr() == ("", "")  # no "Exception ignored in: <coroutine ...>" either


def test_a_missing_or_cut_checksum_record_is_corruption_not_an_old_checkpoint(tmp_path):
    state, lines = {"w": jax.device_put(jnp.ones((8, 8)), split_2x4()), "b": jnp.ones(3)}, []
    with Checkpointer(tmp_path, log=lines.append) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, state, {})
        (tmp_path / "3" / "integrity" / "process_0").unlink()
        record_2 = tmp_path / "2" / "integrity" / "process_0"
        record = json.loads(record_2.read_text())
        del record["w"]["4:8,6:8"]  # one block's checksum gone: a process's record, say
        record_2.write_text(json.dumps(record))
        assert ckpt.restore(state)[0] == 1
    assert lines == [
        f"checkpoint {tmp_path / '3'} is corrupt (its checksum records are missing from integrity/); "
        "falling back to step 2",
        f"checkpoint {tmp_path / '2'} is corrupt (the checksums of w cover 56 of its 64 values "
        "(a process's record is missing or cut)); falling back to step 1",
    ]


def test_the_metadata_of_a_checkpoint_reads_without_its_arrays(tmp_path):
    with Checkpointer(tmp_path) as ckpt:
        for step in (1, 2):
            ckpt.save(step, train_state(), {"info": {"model": "gpt", "vocabulary": "\n !ab"}, "step": step})
    with Checkpointer(tmp_path, read_only=True) as ckpt:  # what `minishard sample` reads: no target, no data
        assert ckpt.read_meta() == (2, {"info": {"model": "gpt", "vocabulary": "\n !ab"}, "step": 2})
        assert ckpt.read_meta(1)[1]["step"] == 1
        with pytest.raises(CheckpointError, match=r"has no checkpoint for step 3; it has \[1, 2\]"):
            ckpt.read_meta(3)
    with pytest.raises(CheckpointError, match="holds no checkpoint"), Checkpointer(tmp_path / "new") as ckpt:
        ckpt.read_meta()


def test_the_metadata_is_inside_the_checksum_and_a_changed_character_is_refused(tmp_path):
    lines = []
    with Checkpointer(tmp_path, log=lines.append) as ckpt:
        for step in (1, 2):
            ckpt.save(step, {"w": jnp.ones(3)}, {"info": {"vocabulary": "\n !ab"}, "step": step})
    meta_file = tmp_path / "2" / "meta" / "metadata"
    meta_file.write_text(meta_file.read_text().replace("!ab", "!ba"))  # two characters swapped
    corrupt = f"checkpoint {tmp_path / '2'} is corrupt (its metadata (meta/) does not match the checksum "
    with Checkpointer(tmp_path, log=lines.append, read_only=True) as ckpt:
        assert ckpt.read_meta() == (1, {"info": {"vocabulary": "\n !ab"}, "step": 1})  # what sample reads
        assert ckpt.restore({"w": jnp.zeros(3)})[0] == 1  # what a resume reads
        with pytest.raises(CheckpointError, match=re.escape(corrupt)):
            ckpt.read_meta(2)
    assert lines == [corrupt + "written with it); falling back to step 1"] * 2


def test_read_meta_of_a_broken_latest_step_falls_back_in_one_line(tmp_path):
    lines = []
    with Checkpointer(tmp_path, log=lines.append) as ckpt:
        for step in (1, 2):
            ckpt.save(step, {"w": jnp.ones(3)}, {"step": step})
    delete_meta(tmp_path / "2")
    with Checkpointer(tmp_path, log=lines.append, read_only=True) as ckpt:
        assert ckpt.read_meta() == (1, {"step": 1})
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert lines[0].startswith(f"checkpoint {tmp_path / '2'} is ")
    assert lines[0].endswith("falling back to step 1")


def test_after_a_failed_save_orbax_s_orphaned_futures_stay_out_of_view_and_nothing_else(caplog):
    """A full disk fails orbax's writes; the futures nobody awaited are reported when collected, at exit
    ("Future exception was never retrieved" and a traceback), after the one line that said it."""
    import logging

    from minishard.run.checkpoint.noise import quiet_orphaned_echoes

    asyncio_log, before = logging.getLogger("asyncio"), list(logging.getLogger("asyncio").filters)
    asyncio_log.filters[:] = [
        f for f in before if getattr(f, "__name__", "") != "_orphaned_echo"
    ]  # an earlier CLI test's

    def raised_in(filename):
        try:
            exec(compile("raise OSError(28, 'No space left on device')", filename, "exec"))
        except OSError:
            return sys.exc_info()

    try:
        quiet_orphaned_echoes()
        quiet_orphaned_echoes()  # once is enough: the same filter
        assert [getattr(f, "__name__", "") for f in asyncio_log.filters].count("_orphaned_echo") == 1
        future = "Future exception was never retrieved\nfuture: <Future finished exception=OSError(28)>"
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            in_orbax = raised_in("/site-packages/orbax/checkpoint/_src/path/async_path.py")
            asyncio_log.error(future, exc_info=in_orbax)
            assert caplog.records == []  # an echo of the error already said
            asyncio_log.error(future, exc_info=raised_in("/home/me/my_script.py"))  # the user's own: shown
            assert len(caplog.records) == 1
    finally:
        asyncio_log.filters[:] = before


SAVED_BEFORE_DROPOUT = (  # the "model" a checkpoint of GPT(depth=2) stored at 1486590, before issue 61
    "PyTreeDef(CustomNode(GPT[('none',)], [CustomNode(Embedding[()], [*, *]), (CustomNode(Block"
    "[()], [CustomNode(LayerNorm[(128, 1e-06)], [*, *]), CustomNode(Attention[(128, 4, 4, True,"
    " 'dense')], [*, *, *, *]), CustomNode(LayerNorm[(128, 1e-06)], [*, *]), CustomNode(Sequent"
    "ial[()], [(CustomNode(Linear[(128, 512, ('embed', 'mlp'))], [*, *]), CustomNode(Swish[()],"
    " []), CustomNode(Linear[(512, 128, ('mlp', 'embed'))], [*, *]))])]), CustomNode(Block[()],"
    " [CustomNode(LayerNorm[(128, 1e-06)], [*, *]), CustomNode(Attention[(128, 4, 4, True, 'den"
    "se')], [*, *, *, *]), CustomNode(LayerNorm[(128, 1e-06)], [*, *]), CustomNode(Sequential[("
    ")], [(CustomNode(Linear[(128, 512, ('embed', 'mlp'))], [*, *]), CustomNode(Swish[()], []),"
    " CustomNode(Linear[(512, 128, ('mlp', 'embed'))], [*, *]))])])), CustomNode(LayerNorm[(128"
    ", 1e-06)], [*, *]), CustomNode(Linear[(128, 65, ('embed', 'vocab'))], [*, *])]))"
)


def test_a_gpt_checkpoint_saved_before_dropout_is_this_gpt_at_rate_0_and_no_other():
    from minishard.models.gpt import GPT
    from minishard.run.checkpoint.migrations import before_dropout

    def structure(**kwargs):
        return str(
            jax.tree_util.tree_structure(
                jax.eval_shape(lambda: GPT(depth=2, key=jax.random.key(0), **kwargs))
            )
        )

    assert structure() != SAVED_BEFORE_DROPOUT == before_dropout(structure())
    assert before_dropout(structure(dropout=0.2)) != SAVED_BEFORE_DROPOUT  # a dropping run is another model
