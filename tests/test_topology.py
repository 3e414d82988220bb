"""Compiling for a TPU slice that is not here (``minishard.run.topology``): XLA:TPU's real program.

libtpu is installed by the dev extra, so these run on every machine; nothing runs on a TPU.
"""

import argparse
import importlib.util
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest
from models import OPT, train_step

import minishard as ms
from minishard.census import bytes_by_mesh_axes, collectives, human_bytes
from minishard.constraints import constrain
from minishard.models import gpt
from minishard.run.cli import main, parse_args
from minishard.run.cli.accelerators import SENDS_UP_TO
from minishard.run.cli.styles import style_of
from minishard.run.cli.tpu_slice import cpu_twin
from minishard.run.next_token import next_token_loss
from minishard.run.steps import make_train_step
from minishard.run.topology import (
    INSTALL,
    chip_count,
    compile_for,
    hardware_of,
    on_cpu_and_tpu,
    side_by_side,
    tpu_devices,
)
from minishard.styles import mesh_rules
from minishard.tree import tree_bytes

TOPOLOGY = "v5e:2x4"  # 8 chips, as many as the suite's simulated CPU devices
UNKNOWN = "topology 'v7:2x4': unknown TPU generation 'v7' (v4, v5e, v5p, v6e)"


def test_with_libtpu_installed_and_no_chip_starting_jax_through_minishard_prints_nothing():
    # libtpu warns on stderr at every JAX start on a machine without a TPU, unless told what it would find
    assert importlib.util.find_spec("libtpu") is not None, INSTALL
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TPU_", "ALLOW_MULTIPLE_LIBTPU"))}
    env.pop("JAX_PLATFORMS", None)
    code = "import minishard, jax; print(jax.devices()[0].platform)"
    started = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert (started.returncode, started.stdout, started.stderr) == (0, "cpu\n", "")
    bare = subprocess.run(
        [sys.executable, "-c", code.replace("minishard, ", "")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "TPU_WORKER_HOSTNAMES" in bare.stderr  # what minishard's start keeps out of view


@pytest.mark.parametrize(
    ("topology", "message"),
    [
        ("v7:2x4", UNKNOWN),
        ("2x4", "topology '2x4': write GENERATION:SHAPE, e.g. v5e:2x4 or v5p:2x2x2"),
        ("v5e:3x5", "XLA:TPU refuses the topology 'v5e:3x5': Topology layout \"v5e:3x5\" is not divisible"),
    ],
)
def test_a_topology_xla_tpu_cannot_build_is_refused_by_name(topology, message):
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        tpu_devices(topology)


def test_a_topology_is_its_chips_and_their_generation_prices_them():
    devices = tpu_devices(TOPOLOGY)
    assert len(devices) == 8 and {d.device_kind for d in devices} == {"TPU v5 lite"}
    assert hardware_of(TOPOLOGY) == "v5e" and hardware_of("v4:2x2x2") == "v4p"
    assert len(tpu_devices("v4:2x2x2")) == 8  # one device per chip (megacore), as jax.make_mesh needs
    assert len(tpu_devices("v5p:2x2x2")) == 8 and len(tpu_devices("v5e:1x1")) == 1


def test_explain_refuses_a_bad_topology_in_one_line_before_any_work(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["explain", "--topology", "v7:2x4"])
    assert exit_.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == "minishard explain: error: argument --topology: " + UNKNOWN


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--topology", "v5e:2x4x2"], "argument --topology: topology 'v5e:2x4x2': a v5e slice is a 2-d "
         "torus of chips, not 3-d; write 2 sizes, e.g. v5e:2x2"),
        (["--topology", "v5p:2x4"], "argument --topology: topology 'v5p:2x4': a v5p slice is a 3-d "
         "torus of chips, not 2-d; write 3 sizes, e.g. v5p:2x2x2"),
        (["--topology", ""], "argument --topology: topology '': write GENERATION:SHAPE, e.g. v5e:2x4 or "
         "v5p:2x2x2"),
        (["--topology", TOPOLOGY, "--devices", "4"], f"argument --devices: --topology {TOPOLOGY} is 8 "
         "chips, the step's devices; drop --devices (or give a topology of that many chips)"),
        (["--topology", TOPOLOGY, "--hardware", "h100"], f"argument --hardware: --topology {TOPOLOGY}'s "
         "chips are v5e, not h100; drop --hardware (the topology's chips price its step)"),
    ],
)  # fmt: skip
def test_a_topology_that_conflicts_or_names_no_slice_is_refused_in_one_line(capsys, flags, message):
    with pytest.raises(SystemExit) as exit_:
        main(["explain", *flags])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == "minishard explain: error: " + message


def test_a_topology_agreeing_with_devices_and_hardware_is_taken(capsys):
    args = parse_args(["explain", "--topology", TOPOLOGY, "--devices", "8", "--hardware", "v5e"])
    assert (args.devices, args.hardware, len(args.topology_devices)) == (8, "v5e", 8)


@pytest.mark.parametrize(
    ("topology", "style", "why"),
    [
        ("v5e:2x4", "fsdp", None),  # XLA:CPU's twin beside it
        ("v5e:4x4", "fsdp", "XLA:CPU's twin needs 16 simulated devices, XLA_FLAGS set 8"),
        ("v5e:16x16", "fsdp", "XLA:CPU's twin is compiled on up to 64 simulated devices (minutes more)"),
        ("v5e:2x4", "zero", "a step of its own has no XLA:CPU twin here"),
    ],
)
def test_a_topology_s_step_has_a_cpu_twin_where_xla_cpu_can_compile_it_else_the_reason_first(
    capsys, topology, style, why
):
    args = argparse.Namespace(topology=topology, devices=chip_count(topology))
    assert cpu_twin(args, style_of(style)) is (why is None)
    said = f"(compiled by XLA:TPU for {topology} alone: {why})\n" if why else ""
    assert capsys.readouterr().out == said


@pytest.mark.slow  # 4-6 s: the MLP's step compiled by XLA:TPU for 16 chips
def test_more_chips_than_simulated_devices_compile_for_xla_tpu_alone_said_first(capsys):
    """v5e:4x4's 16 chips on the suite's 8 CPU devices: XLA:CPU has no twin (make_mesh failed, after the
    XLA:TPU compile); 256 chips: none above SENDS_UP_TO, where XLA:CPU would compile for minutes."""
    assert len(jax.devices()) == 8 < chip_count("v5e:4x4") <= SENDS_UP_TO < chip_count("v5e:16x16")
    assert main(["explain", "--topology", "v5e:4x4"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first == (
        "(compiled by XLA:TPU for v5e:4x4 alone: XLA:CPU's twin needs 16 simulated devices, XLA_FLAGS set 8)"
    )


@pytest.mark.slow  # 6-10 s: a fresh JAX, the default MLP's step compiled by both compilers
def test_explain_on_a_topology_simulates_the_cpu_devices_its_twin_needs_and_prints_both_programs():
    """docs/tpu.md's command without the suite's XLA_FLAGS: explain asks for the slice's 8 CPU devices,
    and prints XLA:TPU's report and both programs' collectives (one process does both: its output)."""
    flags = " ".join(flag for flag in os.environ["XLA_FLAGS"].split() if "device_count" not in flag)
    env = {**os.environ, "XLA_FLAGS": flags}
    command = [sys.executable, "-m", "minishard", "explain", "--parallel", "fsdp", "--topology", TOPOLOGY]
    done = subprocess.run(
        [*command, "--batch-size", "4096"], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    report, programs = done.stdout.split("compiled by XLA:CPU (8 simulated devices) and XLA:TPU:\n")
    assert report.endswith("One step, per device, ")
    assert "predicted step on TPU v5e, 512 examples per device" in report  # the slice's chips price it
    # the first weight's gradient, 784 x 512 float32, reduce-scattered: each chip its 784 / 8 = 98 rows,
    # padded to XLA:TPU's tile of 8 rows: 104
    rows_per_chip = -(-(784 // 8) // 8) * 8
    scattered = human_bytes(rows_per_chip * 512 * 4)
    assert re.search(rf"\n  reduce-scatter +x1  {scattered}  over \('data',\)\n", report)  # XLA:TPU's census
    rows = {line.split()[0]: line for line in programs.splitlines()}
    assert rows["reduce-scatter"].split()[1] == "-"  # XLA:CPU all-reduces the gradient whole
    assert rows["reduce-scatter"].split()[2:] == ["x1", *scattered.split(), "over", "data"]


class PinnedLinear(ms.Linear):
    """A Linear whose output lives as (batch, its output axis), as in test_styles."""

    def __call__(self, x):
        return constrain(super().__call__(x), ("batch", self.logical_axes[1]))


@pytest.mark.slow  # 7 s: the step compiled twice
def test_xla_tpu_reduce_scatters_the_fsdp_gradient_that_xla_cpu_all_reduces_whole():
    shape, rules = mesh_rules("fsdp", 8)
    # 1024 inputs: each device's 128 rows fill XLA:TPU's tiles of 8 (784 would pad to 104 each)
    layers = ms.mlp([1024, 512, 10], key=jax.random.key(0), axes=ms.megatron_axes(2))
    model = ms.Sequential([PinnedLinear.tree_unflatten(*reversed(layer.tree_flatten())) if isinstance(
        layer, ms.Linear) else layer for layer in layers])  # fmt: skip
    images, labels = np.ones((64, 1024), np.float32), np.zeros(64, np.int32)
    step = ms.Sharded(ms.make_mesh(shape, devices=tpu_devices(TOPOLOGY)), rules)(train_step)
    cpu, tpu = on_cpu_and_tpu(step, (model, OPT.init(model), images, labels))
    w1, b1, w2 = model[0].weight, model[0].bias, model[2].weight
    assert bytes_by_mesh_axes(cpu.text, cpu_mesh := ms.make_mesh(shape)) == {
        ("all-gather", ("data",)): tree_bytes([w1, b1, w2]),  # each split weight, whole
        ("all-reduce", ("data",)): tree_bytes(model) + 4,  # every gradient, whole, and the loss
    }
    assert cpu_mesh.shape == step.config.mesh.shape
    assert bytes_by_mesh_axes(tpu.text, step.config.mesh) == {
        ("reduce-scatter", ("data",)): w1.nbytes // 8,  # the first weight's gradient: each device its 1/8
        ("all-gather", ("data",)): (w1.size + w2.size) * 2,  # gathered in bf16, the precision its matmuls use
        ("all-reduce", ("data",)): b1.nbytes + tree_bytes(model) - w1.nbytes + 4,  # b1 gathered as a sum
    }
    assert tpu.compiler == "XLA:TPU" and cpu.compiler == "XLA:CPU"
    row = next(line for line in side_by_side([cpu, tpu]).splitlines() if "reduce-scatter" in line)
    assert row.split() == ["reduce-scatter", "-", "x1", *human_bytes(w1.nbytes // 8).split(), "over", "data"]


def test_the_compiled_arguments_are_the_plans_bytes_where_the_shards_fill_tpu_tiles():
    """(rows a multiple of 8, columns of 128: XLA:TPU pads an array to its (8, 128) tiles)."""
    shape, rules = mesh_rules("fsdp", 8)
    model = ms.Linear(1024, 1024, key=jax.random.key(0), axes=("embed", "mlp"), use_bias=False)
    step = ms.Sharded(ms.make_mesh(shape, devices=tpu_devices(TOPOLOGY)), rules)(lambda m, x: m(x).sum())
    program = compile_for(step.lower(model, np.ones((64, 1024), np.float32)))
    planned = step.config.plan_inputs((model, np.ones((64, 1024), np.float32)))
    assert program.memory.arguments == sum(4 * np.prod(leaf.shard_shape) for leaf in planned.leaves)


@pytest.mark.slow  # 10-20 s: a GPT step compiled by both compilers
def test_a_tp_gpt_step_sends_megatrons_four_all_reduces_per_block_on_both_compilers():
    """Megatron's prediction: per block, the attention's and the MLP's outputs all-reduced over "model"
    in the forward pass, the gradients of their inputs in the backward: 4 of (batch, context, width)."""
    sizes = dict(vocab=11, context=16, width=32, depth=2, heads=8, mlp_ratio=4)  # 8 heads, 128 hidden: 8 ways
    model = gpt.GPT(**sizes, key=jax.random.key(0))
    ids = np.zeros((8, sizes["context"] + 1), np.int32)
    batch = {"inputs": ids[:, :-1], "targets": ids[:, 1:]}
    shape, rules = mesh_rules("tp", 8)
    step = ms.Sharded(ms.make_mesh(shape, devices=tpu_devices(TOPOLOGY)), rules)(
        make_train_step(OPT, lambda m, b: (next_token_loss(m, b)[0], ()))
    )
    activation = 8 * sizes["context"] * sizes["width"] * 4  # the whole batch on every device, f32
    for program in on_cpu_and_tpu(step, (model, OPT.init(model), batch)):
        found = program.collectives
        assert list(found) == ["all-reduce"], program.compiler
        assert found["all-reduce"].count == 4 * sizes["depth"], program.compiler
        assert found["all-reduce"].bytes == 4 * sizes["depth"] * activation, program.compiler
        assert found["all-reduce"].mesh_axes == (("model",),), program.compiler


@pytest.mark.slow  # 9 s: ZeRO-3's shard_map step compiled by XLA:TPU
def test_zero_s_own_step_compiles_for_a_topology_and_xla_tpu_gathers_the_big_weight_in_bf16(capsys):
    assert main(["explain", "--parallel", "zero", "--topology", TOPOLOGY]) == 0
    out = capsys.readouterr().out
    assert f"(compiled by XLA:TPU for {TOPOLOGY} alone: a step of its own has no XLA:CPU twin here)" in out
    # the matmul reads its weight in bf16 (TPU's default precision), so XLA:TPU converts before gathering:
    # the 784 x 512 weight crosses in 2 bytes a number, the small ones in 4 (each padded to 8 x 640)
    assert f"sent: all-gather {784 * 512 * 2 + 8 * 640 * 4:,} B + reduce-scatter 0 B" in out
    assert "full-gradient all-reduce: 1,630,336 B" in out  # and it all-reduces the gradient, then slices


@pytest.mark.slow  # 11 s: the pipeline's step compiled by XLA:TPU
def test_a_pipeline_compiles_for_a_topology_with_the_bubble_read_from_xla_tpu_s_loop(capsys):
    assert main(["explain", "--parallel", "dp+pp", "--topology", TOPOLOGY]) == 0
    out = capsys.readouterr().out
    assert "predicted step on TPU v5e, 64 examples per device" in out
    assert "bubble 0.273 from the program, 0.273 = (p-1)/(m+p-1)" in out  # 4 stages, 8 microbatches


def test_without_libtpu_the_refusal_says_how_to_install_it(monkeypatch):
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "libtpu" else found(name))
    with pytest.raises(ValueError, match=r"^compiling for v5e:2x4 needs XLA:TPU, which libtpu holds: "):
        tpu_devices(TOPOLOGY)
    with pytest.raises(ValueError, match=re.escape(INSTALL) + "$"):
        tpu_devices(TOPOLOGY)


def test_a_collective_in_a_loop_counts_once_per_trip_though_xla_tpu_writes_no_trip_count():
    mesh = ms.make_mesh({"x": 8}, devices=tpu_devices(TOPOLOGY))

    def ring(chunk):
        def hop(carry, _):
            return jax.lax.ppermute(carry, "x", [(i, (i + 1) % 8) for i in range(8)]) + carry, None

        return jax.lax.scan(hop, chunk, None, length=5)[0]

    step = jax.jit(jax.shard_map(ring, mesh=mesh, in_specs=jax.P("x"), out_specs=jax.P("x")))
    compiled = step.lower(jax.ShapeDtypeStruct((8 * 1024,), np.float32)).compile()
    assert "known_trip_count" not in (compiled.as_text() or "")  # the condition, i < 5, says it
    found = collectives(compiled)["collective-permute"]
    assert (found.count, found.bytes) == (5, 5 * 1024 * 4)
