"""On a machine with chips (issue 60): the peak from the chip's own ``device_kind``, MFU never above
100% or guessed, and the CLI's defaults fitted to the chips there are. Off a chip these run with
stand-in devices (``Chip``); the tests marked ``tpu`` run on a real one and skip in one line without."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from minishard import hardware, make_mesh
from minishard.hardware import DEVICE_KINDS, HARDWARE, chip_of
from minishard.models.gpt import GPT
from minishard.run.cli import accelerators, main, parse_args
from minishard.run.next_token import next_token_loss
from minishard.run.profiling import Speed, format_speed, peak_flops
from minishard.styles import mesh_rules
from minishard.testing import assert_sharded_equivalent


@dataclasses.dataclass(frozen=True)
class Chip:
    """What ``peak_flops`` and the CLI read of a ``jax.Device``."""

    device_kind: str
    platform: str = "tpu"
    process_index: int = 0


@pytest.mark.parametrize(
    ("kind", "name"),
    [
        ("TPU v4", "TPU v4p"),
        ("TPU v5 lite", "TPU v5e"),
        ("TPU v5", "TPU v5p"),
        ("TPU v6 lite", "TPU v6e"),
        ("NVIDIA H100 80GB HBM3", "H100"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA B200", "B200"),
    ],
)
def test_the_device_kind_a_real_chip_reports_finds_its_entry(kind, name):
    assert chip_of(kind).name == name
    flops, source = peak_flops([Chip(kind), Chip(kind)], "bfloat16")
    assert flops == 2 * chip_of(kind).flops and source == f"2 x {name}'s peak, bf16"


def test_every_device_kind_names_an_entry_and_pallas_reads_the_tpus_alike():
    assert set(DEVICE_KINDS.values()) <= set(HARDWARE)
    tpu_info = pytest.importorskip("jax._src.pallas.mosaic.tpu_info")  # JAX's own reading of the strings
    pallas = {"TPU_V4": "v4p", "TPU_V5E": "v5e", "TPU_V5P": "v5p", "TPU_V6E": "v6e"}
    for kind, name in DEVICE_KINDS.items():
        if kind.startswith("TPU"):
            assert pallas[tpu_info.chip_version_from_device_kind(kind).name] == name, kind


def test_a_float32_step_s_peak_is_the_mxu_s_bf16_pass_on_a_tpu_and_tf32_on_a_gpu():
    tpu, _ = peak_flops([Chip("TPU v5 lite")], "float32")
    gpu, source = peak_flops([Chip("NVIDIA H100 80GB HBM3", platform="gpu")], "float32")
    assert tpu == HARDWARE["v5e"].flops and gpu == HARDWARE["h100"].flops / 2
    assert source == "1 x H100's peak, float32 at JAX's default precision"


def test_a_chip_the_table_does_not_hold_has_no_peak_and_its_speed_no_mfu():
    flops, source = peak_flops([Chip("NVIDIA A100-SXM4-80GB", platform="gpu")])
    assert flops is None
    assert source == "'NVIDIA A100-SXM4-80GB' is not in minishard.hardware.DEVICE_KINDS: no MFU"
    speed = Speed(flops=6e9, items=1024, unit="tokens", peak=flops, source=source)
    rates = speed.of(steps=10, seconds=1.0)
    assert "mfu" not in rates and format_speed(rates) == "10,240 tokens/s"
    assert speed.said().endswith(f"peak unknown ({source})")


def test_an_mfu_above_100_percent_is_never_printed():
    slow_peak = Speed(flops=6e9, items=1024, unit="tokens", peak=1e9)  # a busy minute's measured peak
    rates = slow_peak.of(steps=1, seconds=1.0)
    assert rates["mfu"] == 6.0
    assert format_speed(rates) == "1,024 tokens/s, MFU unknown (the step beat the peak: see the peak line)"
    assert format_speed(Speed(6e9, 1024, "tokens", peak=1e10).of(1, 1.0)) == "1,024 tokens/s, MFU 60%"


@pytest.fixture
def one_chip(monkeypatch):
    """A machine with one TPU v5e: what ``accelerators`` would find there."""
    monkeypatch.setattr(accelerators, "accelerators", lambda simulated: [Chip("TPU v5 lite")])


def test_on_one_chip_both_readme_commands_fit_it_and_say_why(one_chip):
    mlp = parse_args(["train"])
    assert (mlp.devices, mlp.mesh) == (1, {"data": 1, "model": 1})
    simulated = "JAX_PLATFORMS=cpu simulates 8 CPU devices instead"
    assert mlp.devices_reason == f"the 1 TPU v5 lite chip here ({simulated})"
    gpt = parse_args(["train", "--model", "gpt"])
    assert (gpt.devices, gpt.mesh, gpt.batch_size) == (1, {"data": 1}, 16)
    assert "simulates 2 CPU devices instead" in gpt.devices_reason


def test_more_devices_than_chips_is_one_line_naming_the_switch_that_simulates(one_chip, capsys):
    with pytest.raises(SystemExit):
        parse_args(["train", "--devices", "8"])
    assert capsys.readouterr().err.splitlines()[-1] == (
        "minishard train: error: argument --devices: 8 asked, there are 1 TPU v5 lite chip; "
        "JAX_PLATFORMS=cpu simulates 8 CPU devices instead"
    )


def test_a_compiled_explain_fits_the_chips_and_a_plan_keeps_its_count(one_chip):
    assert parse_args(["explain", "--memory"]).devices == 1  # compiled: on the chip there is
    assert parse_args(["explain"]).devices == 8  # a plan on an abstract mesh: any count


def test_without_chips_nothing_changes(monkeypatch):
    monkeypatch.setattr(accelerators, "accelerators", lambda simulated: [])
    args = parse_args(["train"])
    assert (args.devices, args.mesh) == (8, {"data": 2, "model": 4})


def test_the_peak_of_a_known_chip_is_not_measured(monkeypatch):
    def refuse(devices):
        raise AssertionError("a chip in the table is never measured")

    monkeypatch.setattr("minishard.run.profiling.cached_peak", refuse)
    assert peak_flops([Chip("TPU v6 lite")])[0] == hardware.HARDWARE["v6e"].flops


# -- on a real chip ------------------------------------------------------------------------------
@pytest.mark.tpu
def test_on_the_chip_its_own_device_kind_finds_its_peak():
    (device, *_) = jax.devices()
    assert chip_of(device.device_kind) is not None, device.device_kind
    flops, source = peak_flops(jax.devices(), "bfloat16")
    assert flops == len(jax.devices()) * chip_of(device.device_kind).flops, source


@pytest.mark.tpu
def test_on_the_chip_the_readme_s_gpt_trains_with_an_mfu_in_0_to_100_percent(capsys):
    flags = ["--depth", "2", "--width", "128", "--heads", "4", "--context", "64", "--steps", "30"]
    assert main(["train", "--model", "gpt", *flags, "--eval-every", "15", "--precision", "bf16"]) == 0
    out = capsys.readouterr().out
    assert f"Running on the {jax.device_count()} {jax.devices()[0].device_kind} chip" in out  # said
    shares = [float(line.split("MFU ")[1].split("%")[0]) for line in out.splitlines() if "MFU " in line]
    assert shares and all(0 < share <= 100 for share in shares), out


@pytest.mark.tpu
def test_on_the_chip_train_draws_the_model_on_the_host_and_off_it_where_it_is():
    # docs/benchmarks.md: the recipe's GPT drawn on the chip took 11.9 s (a program per operation),
    # on the host 6.6 s
    (chip, *_) = jax.devices()
    with accelerators.built_on_the_host():
        drawn = jax.random.normal(jax.random.key(0), (4,))
    assert drawn.devices() == {jax.local_devices(backend="cpu")[0]} != {chip}


@pytest.mark.tpu
def test_on_the_chip_float32_at_default_precision_agrees_to_about_3_digits():
    a, b = jax.random.normal(jax.random.key(0), (2, 512, 512))
    exact = jnp.matmul(a, b, precision="highest")
    default = a @ b
    relative = float(jnp.max(jnp.abs(default - exact)) / jnp.max(jnp.abs(exact)))
    assert 1e-5 < relative < 1e-2, relative  # a bf16 pass: not float32's 7 digits, about 3


def loss_and_gradients(model, batch):
    return jax.value_and_grad(lambda model: next_token_loss(model, batch)[0])(model)


@pytest.mark.tpu
def test_on_the_chip_the_equivalence_assertions_pass_at_their_default_tolerance():
    """``minishard.testing`` compares at JAX's default precision on the backend that runs both sides:
    on a TPU a float32 dot is one bf16 pass in each, so the GPT's loss and gradients under ``Sharded``
    (dp over the chips there are) agree with ``jax.jit``'s to the default rtol of 1e-5."""
    shape, rules = mesh_rules("dp", jax.device_count())
    tokens = jax.random.randint(jax.random.key(1), (8 * jax.device_count(), 64), 0, 65)
    batch = {"inputs": tokens, "targets": jnp.roll(tokens, -1, axis=1)}
    model = GPT(key=jax.random.key(0))
    mesh = make_mesh(shape)
    assert_sharded_equivalent(loss_and_gradients, model, batch, mesh=mesh, rules=rules, require_split=False)


def chip_benchmark():
    """benchmarks/chip.py, imported by name as the benchmarks import each other."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import chip

    return chip


@pytest.mark.slow  # compiles and runs a tiny GPT's step twice (fp32, bf16) on the CPU
def test_the_chip_benchmark_runs_off_a_chip(tmp_path):
    chip = chip_benchmark()
    row = chip.measure("gpt tiny", chip.SMOKE["gpt tiny"], "bf16", steps=2, rounds=1)
    assert row["compiled_memory"]["arguments"] == row["predicted_arguments"]  # the held bytes, exactly
    assert row["measured_step_s"] > 0 and row["predicted_step_s"] > 0
    assert row["predicted_step_s"] == row["compute_s"] < row["hbm_s"]  # XLA:CPU's bytes: shown, not priced


@pytest.mark.tpu
def test_on_the_chip_the_roofline_meets_gpt2_small_s_step_within_25_percent():
    """docs/tpu.md: at 12 x 768, context 1,024, batch 16 the step is HBM-bound and XLA:TPU's bytes
    price it (measured 231 ms fp32, 206 ms bf16; predicted 229 and 184)."""
    chip = chip_benchmark()
    flags = chip.SIZES["gpt 12x768 ctx1024 b16"]
    for precision in ("fp32", "bf16"):
        row = chip.measure("gpt-2 small", flags, precision, steps=5, rounds=1)
        ratio = row["predicted_step_s"] / row["measured_step_s"]
        assert 0.75 <= ratio <= 1.25, (precision, row["predicted_step_s"], row["measured_step_s"])
        # XLA:TPU pads small arrays to its (8, 128) tiles: 1031.3 MB held where the arrays are 1031.0 MB
        assert row["compiled_memory"]["arguments"] == pytest.approx(row["predicted_arguments"], rel=1e-3)


def test_the_chip_speed_benchmark_times_both_steps_from_the_same_numbers():
    """benchmarks/chip_speed.py, on any device: the plain step and minishard's start from the same
    model and compute the same loss (bf16: to 2%), and each row's tokens/s is its batch over its step."""
    chip_benchmark()  # puts benchmarks/ on the path
    import chip_speed

    shape = chip_speed.SMOKE_SHAPES["tiny"]
    contenders = {
        label: chip_speed.contender(shape, b, core, flags)
        for label, b, core, flags in chip_speed.SMOKE["tiny"]
    }
    batch = contenders["minishard bf16 dense"][2]  # the same windows for both: the losses must agree
    ours, plain = contenders["minishard bf16 dense"][1][0], contenders["plain bf16"][1][0]
    same = jax.tree.map(lambda a, b: bool((a == b).all()), chip_speed.params_of(ours), plain)
    assert all(jax.tree.leaves(same))  # both start from the same numbers
    losses = {}
    for label, (step, carried, _) in contenders.items():
        carried[0], carried[1], loss, *_ = step(*carried, batch)
        losses[label] = float(loss)
        assert 0 < chip_speed.timed(step, carried, batch, steps=2, rounds=1) < 10
    assert losses["plain bf16"] == pytest.approx(losses["minishard bf16 dense"], rel=0.02), losses
    parameters = sum(leaf.size for leaf in jax.tree.leaves(carried[0]))
    flops = chip_speed.model_flops_a_token(shape, parameters)
    assert flops == 6 * parameters + 12 * shape["depth"] * shape["context"] * shape["width"]
