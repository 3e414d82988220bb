"""minishard.run.cli: ``minishard train`` on the real (offline) MNIST, and its argument checks."""

import dataclasses
import json
import os
import re
import signal
import time
import types

import jax
import pytest
from etils import epy

from minishard import layouts, serving
from minishard.census import human_bytes
from minishard.costs import ring_bound
from minishard.hardware import HARDWARE
from minishard.pipeline import bubble_fraction
from minishard.run.cli import main, parse_args
from minishard.run.cli import ranking as ranking_cli
from minishard.run.cli.models import MODELS
from minishard.run.cli.styles import cli_rules, unused_mesh_axes
from minishard.run.errors import TrainingError
from minishard.run.tfds_reading import DataError

needs_mnist = pytest.mark.skipif(
    not os.path.isdir(os.path.join(os.environ.get("TFDS_DATA_DIR", "/nonexistent"), "mnist")),
    reason="needs MNIST prepared by tfds: set TFDS_DATA_DIR (make test does)",
)


def final_line(output: str) -> str:
    """The last epoch line, without its (machine-dependent) duration."""
    lines = [line for line in output.splitlines() if line.startswith("Epoch ")]
    return re.sub(r" in [\d.]+ s( \([^)]*\))?", "", lines[-1])


@needs_mnist
@pytest.mark.slow
def test_cli_trains_plots_logs_and_resumes_to_the_same_final_line(tmp_path, capsys):
    common = ["train", "--layers", "784,32,10", "--batch-size", "256", "--mesh", "data=4,model=2"]
    log, plot = tmp_path / "metrics.jsonl", tmp_path / "curves.png"

    assert main([*common, "--epochs", "2", "--log", str(log), "--plot", str(plot)]) == 0
    straight = capsys.readouterr().out
    assert "simulating 8 CPU devices" in straight
    assert "layers[0].weight" in straight  # the explain report
    assert [json.loads(line)["epoch"] for line in log.read_text().splitlines() if "seconds" in line] == [1, 2]
    assert plot.read_bytes()[:4] == b"\x89PNG"

    checkpoints = str(tmp_path / "ckpt")
    assert main([*common, "--epochs", "1", "--checkpoint-dir", checkpoints]) == 0
    assert main([*common, "--epochs", "2", "--checkpoint-dir", checkpoints, "--resume"]) == 0
    resumed = capsys.readouterr().out
    assert "Resumed from step" in resumed
    assert final_line(resumed) == final_line(straight)


# -- every flag checked before any data is loaded -------------------------------------
BAD_FLAGS = [
    (["--epochs", "0"], "argument --epochs: must be at least 1, got 0"),
    (["--batch-size", "0"], "argument --batch-size: must be at least 1"),
    (["--batch-size", "129"], "argument --batch-size: 129 cannot be split evenly over data=2"),
    (["--batch-size", "60002", "--mesh", "data=2,model=4"], "exceeds the 60000 training examples"),
    (["--lr", "nan"], "argument --lr: must be a finite number > 0, got nan"),
    (["--lr", "-1"], "argument --lr: must be a finite number > 0"),
    (["--decay-rate", "0"], "argument --decay-rate: must be a finite number > 0"),
    (["--decay-steps", "0"], "argument --decay-steps: must be at least 1"),
    (["--checkpoint-every", "0", "--checkpoint-dir", "x"], "argument --checkpoint-every: must be at least 1"),
    (["--keep", "0"], "argument --keep: must be at least 1"),
    (["--devices", "0"], "argument --devices: must be at least 1"),
    (["--seed", "-1"], "argument --seed: must be at least 0"),
    (["--momentum", "1"], "argument --momentum: must be a finite number in [0, 1)"),
    (["--mesh", "data=2,data=4"], "argument --mesh: 'data' is given twice"),
    (["--mesh", "data=0"], "argument --mesh: mesh axis sizes must be at least 1"),
    (["--mesh", "data=two"], "argument --mesh: mesh axis sizes must be integers"),
    (["--layers", "100,10"], "argument --layers: must start with 784 inputs and end with 10 classes"),
    (["--layers", "784"], "argument --layers: expected at least two positive sizes"),
    (["--resume"], "--resume and --checkpoint-every need --checkpoint-dir"),
    (["--checkpoint-dir", "FILE"], "argument --checkpoint-dir: FILE is a file, not a directory"),
    (["--plot", "curves.txt"], "argument --plot: curves.txt must end with one of .png, .pdf, .svg"),
    (["--plot", "missing/curves.png"], "argument --plot: the directory of missing/curves.png does not exist"),
    (["--log", "metrics.csv"], "argument --log: metrics.csv must end with one of .jsonl"),
    (["--log", "missing/m.jsonl"], "argument --log: the directory of missing/m.jsonl does not exist"),
    (["--mes", "data=2,model=4"], "unrecognized arguments: --mes"),  # no abbreviation stands for --mesh
    (
        ["--model", "vit", "--layers", "784,10"],
        "argument --layers: only the MLP takes it, and --model is vit",
    ),
    (["--model", "vit", "--activation", "relu"], "argument --activation: only the MLP takes it"),
    (
        ["--width", "32"],
        "argument --width: only the ViT and the GPT take it, and --model is mlp; add --model vit",
    ),
    (["--remat", "full"], "argument --remat: only the ViT and the GPT take it"),
    (["--resume-from", "300"], "argument --resume-from: needs --checkpoint-dir"),
    (["--overwrite"], "argument --overwrite: needs --checkpoint-dir"),
    (["--overwrite", "--resume", "--checkpoint-dir", "x"], "give --overwrite or --resume, not both"),
    (
        ["--overwrite", "--resume-from", "3", "--checkpoint-dir", "x"],
        "give --overwrite or --resume, not both",
    ),
    # pipelines (docs/pipeline.md): the blocks must split over the stages, the batch into microbatches
    (
        ["--parallel", "pp", "--devices", "4", "--layers", "784,256,256,256,256,10"],
        "argument --layers: 3 identical 256x256 blocks cannot split over 4 stages; give 4 blocks",
    ),
    (["--parallel", "pp", "--layers", "784,256,128,10"], "argument --layers: a pipeline stacks equal hidden"),
    (["--parallel", "pp", "--layers", "784,256,10"], "argument --layers: a pipeline stacks equal hidden"),
    (
        ["--parallel", "pp", "--model", "vit", "--depth", "6"],
        "argument --depth: 6 blocks cannot split over 8",
    ),
    (
        ["--parallel", "pp", "--model", "vit", "--remat", "full"],
        "argument --remat: not with a pipeline (--parallel pp)",
    ),
    (["--parallel", "dp+pp", "--explicit"], "argument --explicit: not with a pipeline (--parallel dp+pp)"),
    (
        ["--parallel", "pp", "--mesh", "data=8"],
        "argument --mesh: --parallel pp splits stage over 'stage', and --mesh data=8 has no such axis; give "
        "its mesh (stage=8), or a --parallel for these axes",
    ),
    (
        ["--parallel", "dp+pp", "--microbatches", "3"],
        "argument --microbatches: --batch-size 128 does not split",
    ),
    (["--microbatches", "5"], "argument --microbatches: --batch-size 128 does not split into 5 microbatches"),
    (["--microbatches", "0"], "argument --microbatches: must be at least 1"),
    (["--parallel", "gpipe"], "argument --parallel: unknown parallel style 'gpipe'; choose from dp, tp, 2d,"),
]


@pytest.mark.parametrize(("flags", "message"), BAD_FLAGS, ids=[" ".join(f) for f, _ in BAD_FLAGS])
def test_a_bad_flag_is_one_error_line_before_any_work(flags, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "FILE").write_text("not a directory")
    with pytest.raises(SystemExit) as exit_:
        main(["train", *flags])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err, err
    assert err.strip().splitlines()[-1].startswith(("minishard train: error:", "minishard: error:"))


def test_the_mesh_is_decided_from_the_parsed_values_however_it_is_spelled():
    for spelling in (["--mesh", "data=2,model=4"], ["--mesh=data=2,model=4"]):
        args = parse_args(["train", "--parallel", "dp", *spelling])
        assert args.mesh == {"data": 2, "model": 4}  # --mesh wins over --parallel's data=8
    assert parse_args(["train", "--parallel", "dp"]).mesh == {"data": 8}
    assert parse_args(["train", "--parallel", "fsdp+tp", "--devices", "4"]).mesh == {"data": 2, "model": 2}
    assert parse_args(["train"]).mesh == {"data": 2, "model": 4}


def test_a_pipeline_stacks_one_block_per_stage_by_default_with_two_microbatches_per_stage():
    dp_pp, pp = parse_args(["train", "--parallel", "dp+pp"]), parse_args(["train", "--parallel", "pp"])
    assert dp_pp.mesh == {"data": 2, "stage": 4} and dp_pp.layers == [784, *[256] * 5, 10]
    assert (pp.mesh, pp.microbatches, len(pp.layers)) == ({"stage": 8}, 16, 11)  # 8 blocks of 256 x 256
    assert parse_args(["train", "--parallel", "pp", "--mesh", "stage=4", "--devices", "4"]).microbatches == 8
    vit = parse_args(["train", "--model", "vit", "--parallel", "dp+pp"])
    assert (vit.depth, vit.microbatches) == (4, 8)
    assert parse_args(["train", "--model", "vit", "--parallel", "pp"]).depth == 8  # 4 rounded up to 8 stages
    assert parse_args(["train", "--microbatches", "4"]).layers == [784, 512, 10]  # no pipeline: accumulation


def test_a_pipeline_builds_its_blocks_with_the_activation_asked_for():
    from minishard.layers import ReLU, Swish
    from minishard.run.cli.models import MODELS

    for activation, kind in [("relu", ReLU), ("swish", Swish)]:
        args = parse_args(["train", "--parallel", "pp", "--activation", activation])
        model = jax.eval_shape(lambda a=args: MODELS["mlp"].stack.build(a, jax.random.key(0)))
        assert isinstance(model.before.layers[1], kind) and isinstance(model.blocks.block.layers[1], kind)


def test_each_model_gets_its_own_defaults():
    vit, mlp = parse_args(["train", "--model", "vit"]), parse_args(["train"])
    assert (vit.epochs, vit.schedule, vit.width, vit.remat) == (3, "cosine", 64, "none")
    assert (mlp.epochs, mlp.schedule, mlp.layers, mlp.activation) == (
        5,
        "exponential",
        [784, 512, 10],
        "swish",
    )
    assert mlp.width is None and vit.layers is None  # neither takes the other's shape


@pytest.fixture
def no_data(monkeypatch):
    """Loading any data raises KeyError: a test that stops before the data load never meets it."""
    monkeypatch.setattr("minishard.run.data.DATASETS", {})


def test_the_checkpoint_directory_is_checked_before_any_data(tmp_path, capsys, monkeypatch, no_data):
    calls = []

    def refuse(directory, **flags):
        calls.append((directory, flags))
        raise TrainingError(f"{directory} holds another run's checkpoints (steps 850, 900, 936)")

    monkeypatch.setattr("minishard.run.cli.train.check_checkpoint_dir", refuse)
    directory = str(tmp_path / "ckpt")
    assert main(["train", "--checkpoint-dir", directory, "--resume-from", "900"]) == 1
    assert calls == [(directory, {"resume": True, "resume_from": 900, "overwrite": False})]
    err = capsys.readouterr().err.strip()
    assert err == f"error: {directory} holds another run's checkpoints (steps 850, 900, 936)"
    assert main(["train", "--checkpoint-dir", directory, "--overwrite"]) == 1
    assert calls[-1][1] == {"resume": False, "resume_from": None, "overwrite": True}


def test_ctrl_c_before_the_checkpoint_directory_exists_is_one_line(tmp_path, capsys, monkeypatch):
    def interrupted(args):  # as during the data load or the compile: nothing written yet
        raise KeyboardInterrupt

    monkeypatch.setattr("minishard.run.cli.train.train_on_mesh", interrupted)
    missing = tmp_path / "not-yet"
    assert main(["train", "--checkpoint-dir", str(missing)]) == 130
    assert capsys.readouterr().err.strip() == f"interrupted: no checkpoint was written in {missing}"


def test_without_parallel_any_mesh_is_taken_with_the_rules_for_its_axes():
    """Style.check_mesh holds a named style to its axes; without one, the mesh's own rules are used."""
    for shape in ({"data": 8}, {"model": 8}, {"x": 8}):
        given = ",".join(f"{name}={size}" for name, size in shape.items())
        assert parse_args(["train", "--mesh", given]).mesh == shape


def test_a_mesh_axis_no_rule_uses_is_found_from_the_rules():
    args = parse_args(["train", "--parallel", "fsdp", "--mesh", "data=2,model=4"])
    assert unused_mesh_axes(args.mesh, cli_rules(args, list(args.mesh))) == ["model"]
    args = parse_args(["train", "--parallel", "fsdp", "--mesh", "data=2,model=4", "--rules", "mlp=model"])
    assert unused_mesh_axes(args.mesh, cli_rules(args, list(args.mesh))) == []
    args = parse_args(["train", "--mesh", "data=8,model=1"])  # one device: nothing is copied
    assert unused_mesh_axes(args.mesh, cli_rules(args, list(args.mesh))) == []


@pytest.mark.slow
def test_a_mesh_axis_no_rule_uses_is_warned_about_in_one_line(capsys, no_data):
    small = ["--layers", "784,16,10"]
    assert main(["train", *small, "--parallel", "fsdp", "--mesh", "data=2,model=4"]) == 1  # stops at the data
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert warnings == [
        "warning: no rule uses mesh axis 'model': every array is replicated over its 4 devices (they all "
        "compute the same); add a rule (--rules NAME=model) or drop it from --mesh"
    ]
    assert main(["train", *small, "--mesh", "data=2,model=4"]) == 1  # the default rules use both axes
    assert "warning:" not in capsys.readouterr().err


def test_a_rule_for_a_logical_axis_no_array_carries_is_refused_naming_the_nearest(capsys, no_data):
    mlp = ["train", "--layers", "784,16,10", "--mesh", "data=2,model=4"]
    assert main([*mlp, "--rules", "mpl=model"]) == 2  # before the data, and not a use of "model"
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "error: argument --rules: no array of the mlp carries the logical axis 'mpl' (did you mean "
        "'mlp'?); its logical axes are batch, classes, embed, mlp"
    ]
    assert main([*mlp, "--rules", "mlp=model,embed=none"]) == 1  # names it carries: on to the data


def test_no_import_of_the_build_meets_tfds_s_lazy_imports(tmp_path, capsys, monkeypatch):
    """TFDS's import holds etils' ``lazy_imports``, which swaps ``builtins.__import__`` for the whole
    process: an import anywhere else meanwhile comes back a LazyModule (issue 59's random crash). The
    data here holds it for 0.5 s, as a slow TFDS import would; the build imports a module no one has."""
    fresh = f"fresh_{os.getpid()}_{len(os.listdir(tmp_path))}"
    (tmp_path / f"{fresh}.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    imported = []
    entry = MODELS["mlp"]

    def build(args, key):
        time.sleep(0.2)  # a data load beside the build would be inside its lazy_imports by now
        namespace: dict = {}
        exec(f"import {fresh} as module", namespace)  # an import statement: builtins.__import__
        imported.append(namespace["module"])
        return entry.build(args, key)

    def data(args):
        with epy.lazy_imports():  # as tensorflow_datasets/__init__.py does
            time.sleep(0.5)
        raise DataError("no data in this test")

    monkeypatch.setitem(MODELS, "mlp", dataclasses.replace(entry, build=build, data=data))
    assert main(["train", "--layers", "784,16,10", "--mesh", "data=2,model=4"]) == 1
    assert "error: no data in this test" in capsys.readouterr().err
    assert [type(module) for module in imported] == [types.ModuleType], imported


def test_a_mesh_that_does_not_fit_the_devices_stops_before_data(capsys, monkeypatch):
    monkeypatch.setattr("minishard.run.data.DATASETS", {})  # loading any data would raise KeyError
    assert main(["train", "--mesh", "data=2,model=2", "--batch-size", "128"]) == 2
    assert "error: argument --mesh: data=2,model=2 needs 4 devices, there are 8" in capsys.readouterr().err


def test_library_errors_are_one_line_and_debug_shows_the_traceback(capsys, monkeypatch):
    def broken(args):
        raise OSError("disk on fire")

    monkeypatch.setattr("minishard.run.cli.train.train_on_mesh", broken)
    assert main(["train"]) == 1
    assert (
        capsys.readouterr().err.strip() == "error: OSError: disk on fire (run with --debug for the traceback)"
    )
    with pytest.raises(OSError, match="disk on fire"):
        main(["train", "--debug"])


def test_ctrl_c_says_which_checkpoint_is_the_latest(tmp_path, capsys, monkeypatch):
    (tmp_path / "ckpt" / "300").mkdir(parents=True)
    (tmp_path / "ckpt" / "200").mkdir()

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr("minishard.run.cli.train.train_on_mesh", interrupted)
    assert main(["train", "--checkpoint-dir", str(tmp_path / "ckpt")]) == 130
    err = capsys.readouterr().err.strip()
    assert (
        err
        == f"interrupted; the latest checkpoint is step 300 in {tmp_path / 'ckpt'}: continue with --resume"
    )


def test_sigterm_stops_a_run_as_ctrl_c_does_saying_the_latest_checkpoint_and_exits_143(
    tmp_path, capsys, monkeypatch
):
    """What a scheduler sends on preemption: a real SIGTERM to this process, mid-run."""
    (tmp_path / "ckpt" / "30").mkdir(parents=True)

    def preempted(args):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises within the sleep
        raise AssertionError("SIGTERM did not stop the run")

    monkeypatch.setattr("minishard.run.cli.train.train_on_mesh", preempted)
    before = signal.getsignal(signal.SIGTERM)
    assert main(["train", "--checkpoint-dir", str(tmp_path / "ckpt")]) == 143
    assert capsys.readouterr().err.strip() == (
        f"terminated (SIGTERM); the latest checkpoint is step 30 in {tmp_path / 'ckpt'}: "
        "continue with --resume"
    )
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is the run's alone


@needs_mnist
@pytest.mark.slow
def test_the_cli_trains_on_an_explicit_mesh_with_a_style(tmp_path, capsys):
    argv = ["train", "--layers", "784,32,10", "--batch-size", "256", "--epochs", "1", "--parallel", "fsdp"]
    assert main([*argv, "--explicit"]) == 0
    explicit = capsys.readouterr().out
    assert main(argv) == 0
    auto = capsys.readouterr().out
    assert "AxisRules.from_pairs([('batch', 'data'), ('embed', 'data')" in explicit
    assert final_line(explicit)[:40] == final_line(auto)[:40]  # same loss and train accuracy, to the digit


def test_explain_prints_and_draws_the_plan_of_a_default_model(tmp_path, capsys):
    picture = tmp_path / "fsdp.png"
    assert main(["explain", "--parallel", "fsdp", "--plot", str(picture)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("mlp under fsdp on 8 devices") and "P('data', None)" in out
    assert picture.read_bytes()[:4] == b"\x89PNG"
    assert main(["explain", "--model", "vit", "--parallel", "tp"]) == 1  # 8 "model" devices, 4 heads
    assert "heads" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--plot", "missing/plan.png"], "argument --plot: the directory of missing/plan.png does not exist"),
        (["--plot", "plan.txt"], "argument --plot: plan.txt must end with one of .png, .pdf, .svg"),
        (["--plot", "/proc/x.png"], "argument --plot: /proc/x.png cannot be written (No such file or"),
        (["--dev", "4"], "unrecognized arguments: --dev"),
        (["--devices", "0"], "argument --devices: must be at least 1"),
    ],
)
def test_explain_checks_its_flags_before_the_report(flags, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(["explain", *flags])
    out, err = capsys.readouterr()
    assert exit_.value.code == 2 and message in err and out == "", err
    assert err.strip().splitlines()[-1].startswith(("minishard explain: error:", "minishard: error:"))


def test_explain_without_hardware_lists_what_the_compiled_fsdp_step_sends(capsys):
    # The reading path's step 7: the collectives are the compiled program's; --hardware only adds the price.
    assert main(["explain", "--parallel", "fsdp"]) == 0
    out = capsys.readouterr().out
    sends = out[out.index("collectives of train_step, batch 128 (compiled; --hardware prices them):") :]
    assert sends.splitlines()[1:] == [
        "  all-reduce  x1  20.5 kB  over ('data',)",
        "  all-gather  x5  1.9 MB  over ('data',)",
        "  all-to-all  x4  148.5 kB  over ('data',)",
    ]


def test_explain_plans_its_own_model_on_any_device_count(capsys):
    # The style's own rules and mesh, no train command line: 100000 devices need no batch to split.
    assert main(["explain", "--parallel", "dp", "--devices", "100000"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("mlp under dp on 100000 devices") and out.endswith(
        "(the step is not compiled: 100000 devices; explain compiles on up to 64 without --hardware; "
        "the plan above is all)\n"
    )
    assert main(["explain", "--devices", "100000"]) == 1  # 2d: data=2 x model=50000 cannot split 512
    err = capsys.readouterr().err
    assert err.startswith("error: layers[0].weight:") and "mesh axis 'model'=50000" in err
    assert "usage:" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow  # compiles the fsdp step twice
def test_explain_shows_what_the_compiled_step_sends_with_or_without_hardware(capsys):
    def sends(*flags):
        assert main(["explain", "--parallel", "fsdp", *flags]) == 0
        lines = capsys.readouterr().out.splitlines()
        start = next(i for i, line in enumerate(lines) if line.startswith("collectives of train_step"))
        return [line for line in lines[start + 1 :] if line.startswith("  all-")]

    plain, priced = sends(), sends("--hardware", "v5p")  # --hardware only adds the price
    assert plain == priced and any(line.startswith("  all-gather") for line in plain), (plain, priced)


# -- what a step costs (explain --hardware, --compare) and ZeRO by hand (--parallel zero) ---------------
def test_explain_prices_a_preset_on_an_accelerator(capsys):
    assert main(["explain", "--parallel", "fsdp", "--hardware", "v5p"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("mlp under fsdp on 8 devices, batch 128") and "P('data', None)" in out
    assert "collectives of train_step:" in out
    assert "predicted step on TPU v5p, 16 examples per device" in out  # 128 over data=8
    step = next(line for line in out.splitlines() if line.strip().startswith("step "))
    assert re.search(r"step +[\d.]+ [µm]?s +communication-bound by x[\d.]+; flips at [\d,]+ examples", step)


def test_explain_zero_sends_no_full_gradient_all_reduce_and_the_minimum(capsys):
    assert main(["explain", "--parallel", "zero", "--hardware", "h100", "--batch-size", "64"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("mlp under zero (ZeRO-3 by hand) on 8 devices, batch 64")
    assert "full-gradient all-reduce: 0 B (8 B all-reduced, 8 B of it the loss and accuracy)" in out
    # 407,050 float32 parameters, each array padded to a multiple of 8 (the (10,) bias to 16): 1,628,224 B
    # gathered, 1/8 of it reduce-scattered to each device.
    assert "sent: all-gather 1,628,224 B + reduce-scatter 203,528 B = 1,831,752 B" in out
    assert "+ 1/8: 1,831,752 B" in out and "predicted step on H100, 8 examples per device" in out


@pytest.mark.slow  # 11 layouts compiled: ~8 s
def test_explain_compare_ranks_every_layout_and_draws_them(tmp_path, capsys):
    picture = tmp_path / "compare.png"
    assert main(["explain", "--compare", "--hardware", "v5p", "--plot", str(picture)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "mlp, batch 128, on 8 devices: every style and mesh shape"
    rows = [line for line in lines if re.match(r"[* ] \w", line) and "style" not in line]
    assert len(rows) == 17 and rows[0].startswith("* ") and not any(r.startswith("* ") for r in rows[1:])
    styles = {row[2:].split()[0] for row in rows}  # the pipelines and ZeRO ranked with the other styles
    assert styles == {"dp", "tp", "2d", "fsdp", "fsdp+tp", "pp", "dp+pp", "zero"}
    pp_row = next(row for row in rows if row[2:].startswith("pp "))
    assert "stage=8" in pp_row and "communication-bound" in pp_row
    steps = [float(re.split(r"\s+", row[2:].strip())[2]) for row in rows]  # all in µs for this model
    assert steps == sorted(steps) and "(* the fastest predicted step on TPU v5p)" in lines
    assert picture.read_bytes()[:4] == b"\x89PNG"


COST_FLAGS = [
    (["explain", "--hardware", "v9"], "argument --hardware: invalid choice: 'v9'"),
    (["explain", "--compare"], "argument --compare: needs --hardware"),
    (["explain", "--parallel", "dp", "--hardware", "h100", "--batch-size", "100"],
     "argument --batch-size: 100 cannot be split evenly over data=8 devices"),
    (["explain", "--parallel", "2d", "--hardware", "h100", "--batch-size", "3"],
     "argument --batch-size: 3 cannot be split evenly over data=2 devices"),
    (["explain", "--compare", "--hardware", "v5p", "--batch-size", "4"],
     "argument --batch-size: 4 cannot be split evenly over data=8 devices"),
    (["explain", "--batch-size", "64"],
     "argument --batch-size: only a compiled step takes it; add --hardware"),
    (["explain", "--parallel", "zero", "--plot", "zero.png"], "argument --plot: --parallel zero has no plan"),
    (["explain", "--compare", "--hardware", "v5p", "--parallel", "pp"],
     "argument --parallel: --compare ranks every style, each as it trains by default; drop --parallel"),
    (["explain", "--compare", "--hardware", "v5p", "--parallel", "zero"],
     "argument --parallel: --compare ranks"),
    (["explain", "--compare", "--hardware", "v5p", "--microbatches", "4"],
     "argument --microbatches: --compare ranks every style"),
    (["explain", "--microbatches", "4"],
     "argument --microbatches: only a compiled step takes it; add --hardware"),
    (["explain", "--hardware", "v5p", "--microbatches", "3"],
     "argument --microbatches: --batch-size 128 does not split into 3 microbatches over data=2 devices"),
    (["explain", "--memory", "--microbatches", "2"],
     "argument --microbatches: --memory predicts a step of whole batches"),
    (["explain", "--parallel", "zero", "--microbatches", "4"],
     "argument --microbatches: --parallel zero's step (minishard.zero) takes each batch whole"),
    (["train", "--parallel", "zero", "--microbatches", "4"],
     "argument --microbatches: --parallel zero's step (minishard.zero) takes each batch whole"),
    (["train", "--parallel", "zero", "--rules", "mlp=data"], "argument --rules: --parallel zero places"),
    (["train", "--parallel", "zero", "--explicit"], "argument --explicit: --parallel zero places"),
    (["train", "--parallel", "zero", "--mesh", "data=2,model=4"],
     "argument --mesh: --parallel zero runs on one axis, data=N"),
    (["train", "--parallel", "zero", "--batch-size", "100"], "argument --batch-size: 100 cannot be split"),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "message"), COST_FLAGS, ids=[" ".join(a) for a, _ in COST_FLAGS])
def test_cost_and_zero_flags_are_one_error_line_before_any_work(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    out, err = capsys.readouterr()
    assert exit_.value.code == 2 and message in err and out == "", err
    assert err.strip().splitlines()[-1].startswith(f"minishard {argv[0]}: error: argument --")


# -- a named size's layouts ranked from its shapes (explain --compare --size), nothing compiled ----------
LLAMA = ["explain", "--compare", "--size", "llama3-70b", "--hardware", "v5p", "--devices", "8960"]


def test_explain_compare_size_ranks_llama3_70b_as_the_book_does_without_compiling(monkeypatch, capsys):
    def refuse(*args, **kwargs):
        raise AssertionError("compiled")

    monkeypatch.setattr(jax, "jit", refuse)  # a ranking by shapes compiles nothing
    assert main([*LLAMA, "--batch-size", "4M", "--context", "4096"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "batch 4,194,304 tokens (1,024 sequences of 4,096): 468 per device"
    assert "pure FSDP needs 850 tokens per device (C/W over 3 axes)" in lines[2]  # the book's 850
    rows = [line for line in lines if re.match(r"[* ] (dp|fsdp|tp) \d", line)]
    # The scaling book's "2048-way FSDP and 4-way model parallelism", on the pod's own 8,960: first
    assert rows[0].startswith("* fsdp 2240 (2 axes) x tp 4") and "<- the book's X_opt" in rows[0]
    assert rows[0].endswith("[a sequence over 2.19 shards]")  # 1,024 sequences on 2,240 shards: said
    ranking = layouts.rank(serving.LLAMA3_70B, 4 * 2**20, 8960, "v5p")
    shown = [cost for cost in ranking.costs if cost.fits][: ranking_cli.TOP]
    assert [row[2:].split("  ")[0].replace(" (2 axes)", "") for row in rows[: len(shown)]] == [
        str(cost.layout) for cost in shown
    ]
    pure = next(row for row in rows if row.startswith("  fsdp 8960 (3 axes)"))  # the best of each kind too
    # the book's x1.8 from 6P a token (tests/test_layouts.py); attention's FLOPs hide a little more
    cost = layouts.price(serving.LLAMA3_70B, layouts.Layout(fsdp=8960), 4 * 2**20, "v5p")
    assert cost.verdict in pure and f"{cost.flips_at:,.0f}" in pure and 1.5 < cost.bound < 1.8
    assert "do not fit" in lines[lines.index(rows[-1]) + 1]
    # Why the runner-up loses, from the ranking's own terms: its collectives, not hidden, cost more
    best, second = shown[:2]
    lost = layouts.human_seconds(second.step_s - best.step_s)
    runner_up = next(line for line in lines if line.startswith("runner-up"))
    assert runner_up.startswith(f"runner-up fsdp 1120 x tp 8 loses {lost} a step to communication")
    assert second.waiting_s - best.waiting_s == pytest.approx(second.step_s - best.step_s)
    # the book's 44 days count 6P a token; with attention's 12 L T N H at 4,096 the budget takes longer
    days = layouts.train_seconds(serving.LLAMA3_70B, 15e12, 8960, "v5p", 0.4, 4096) / 86400
    assert days > layouts.train_seconds(serving.LLAMA3_70B, 15e12, 8960, "v5p", 0.4) / 86400 > 44
    assert any(line.startswith(f"15T tokens: 6.83e+24 FLOPs, {days:.1f} days at 40% MFU") for line in lines)


def test_explain_compare_size_says_why_an_equally_fast_runner_up_loses(capsys):
    assert main(["explain", "--compare", "--size", "llama3-8b", "--hardware", "v5e", "--devices", "256",
                 "--batch-size", "1M"]) == 0  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    ranking = layouts.rank(serving.LLAMA3_8B, 2**20, 256, "v5e")
    best, second = ranking.costs[:2]
    assert best.step_s == second.step_s and best.bound < second.bound  # both compute-bound on a 2D torus
    assert lines[-1] == (
        f"runner-up {second.layout}: as fast, compute-bound; its collectives fill {second.bound:.1%} "
        f"of the time its matmuls hide them, against {best.bound:.1%}"
    )


def test_explain_compare_size_breaks_a_tie_of_equal_sends_by_memory(capsys):
    # Behind a switch, dp 2 x fsdp 4 sends what fsdp 8 sends (the all-reduce over 2 of a quarter
    # adds what FSDP's ring factor 3/4 saves), but less of it forward (a gather over 4, not 8): the
    # backward pass, its recomputed forward counted, hides more than the forward pass (issue 63).
    assert (
        main(["explain", "--compare", "--size", "llama3-8b", "--hardware", "h100", "--batch-size", "128K"])
        == 0
    )
    last = capsys.readouterr().out.splitlines()[-1]
    best, second = layouts.rank(serving.LLAMA3_8B, 2**17, 8, "h100").costs[:2]
    assert (best.layout, second.layout) == (layouts.Layout(dp=2, fsdp=4), layouts.Layout(fsdp=8))
    assert last.startswith("runner-up fsdp 8: as fast, compute-bound"), last
    assert best.forward.total < second.forward.total
    assert best.backward.total == pytest.approx(second.backward.total)
    # On the v5p's torus, dp 2 x tp 8 and dp 4 x tp 4 each run over the same axes' links alike:
    # only the memory tells them apart.
    argv = ["explain", "--compare", "--size", "llama2-13b", "--hardware", "v5p", "--devices", "16"]
    assert main([*argv, "--batch-size", "16K"]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("runner-up dp 4 x tp 4: as fast, as busy; it holds"), last
    best, second = layouts.rank(serving.LLAMA2_13B, 2**14, 16, "v5p").costs[:2]
    assert best.layout == layouts.Layout(dp=2, tp=8) and best.bound == pytest.approx(second.bound)
    assert best.memory.total < second.memory.total


def test_explain_compare_size_prices_a_token_budget_at_an_mfu(capsys):
    argv = ["explain", "--compare", "--size", "llama3-8b", "--hardware", "v5e", "--devices", "256"]
    assert main([*argv, "--batch-size", "1M", "--tokens", "2T", "--mfu", "0.5"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("2T tokens"))
    days = layouts.train_seconds(serving.LLAMA3_8B, 2e12, 256, "v5e", 0.5, 4096) / 86400
    best = layouts.rank(serving.LLAMA3_8B, 2**20, 256, "v5e").costs[0]
    at_best = layouts.train_seconds(serving.LLAMA3_8B, 2e12, 256, "v5e", best.mfu, 4096) / 86400
    assert line.startswith(
        f"2T tokens: {layouts.train_flops(serving.LLAMA3_8B, 2e12, 4096):.3g} FLOPs, {days:,.1f} days at 50%"
    )
    assert f"{at_best:,.1f} at the {best.mfu:.0%} its step predicts" in line


def test_explain_compare_size_says_where_a_given_layout_ranks(capsys):
    # issue 63: the book's layout ranks first; pure FSDP where the ranking's own costs put it
    assert main([*LLAMA, "--batch-size", "4M", "--layout", "fsdp=8960"]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    fit = [cost for cost in layouts.rank(serving.LLAMA3_70B, 4 * 2**20, 8960, "v5p").costs if cost.fits]
    pure = layouts.price(serving.LLAMA3_70B, layouts.Layout(fsdp=8960), 4 * 2**20, "v5p")
    place = 1 + sum(cost.step_s < pure.step_s for cost in fit)
    assert last.startswith(f"--layout fsdp 8960: {layouts.human_seconds(pure.step_s)}, {pure.mfu:.0%} MFU")
    assert last.endswith(f"ranks {place:,} of the {len(fit):,} that fit") and place > 1
    assert main([*LLAMA, "--batch-size", "4M", "--layout", "fsdp=2240,tp=4"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith(f"ranks 1 of the {len(fit):,} that fit")


def test_explain_compare_size_repeats_prices_every_pipeline_interleaved(capsys):
    # --repeats 2: Megatron's 1T pipeline of 64 stages, 2 of its 128 layers a stage, one a chunk
    argv = [
        "explain",
        "--compare",
        "--size",
        "megatron-1t",
        "--hardware",
        "a100",
        "--devices",
        "3072",
        "--batch-size",
        str(3072 * 2048),
        "--context",
        "2048",
        "--layout",
        "dp=6,tp=8,pp=64",
    ]
    assert main([*argv, "--repeats", "2"]) == 0
    ranking = layouts.rank(serving.MEGATRON_1T, 3072 * 2048, 3072, "a100", 2048, repeats=2)
    fit = [cost for cost in ranking.costs if cost.fits]
    theirs = layouts.Layout(dp=6, tp=8, pp=64)
    priced = layouts.price(serving.MEGATRON_1T, theirs, 3072 * 2048, "a100", context=2048, repeats=2)
    assert priced.bubble == bubble_fraction(64, priced.microbatches, 2)
    place = 1 + sum(cost.step_s < priced.step_s for cost in fit)
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.endswith(f"ranks {place:,} of the {len(fit):,} that fit"), last
    assert f"{priced.mfu:.0%} MFU" in last


def test_explain_compare_size_without_a_fused_kernel_keeps_the_scores(capsys):
    # issue 63: at 128K a sequence, every head's T x T scores no longer fit the fused kernel's choice
    argv = ["explain", "--compare", "--size", "llama3-405b", "--hardware", "h100", "--devices", "16384",
            "--batch-size", "16M", "--context", "131072"]  # fmt: skip
    firsts = []
    for flags in ([], ["--unfused-attention"]):
        assert main([*argv, *flags]) == 0
        firsts.append(next(line for line in capsys.readouterr().out.splitlines() if line.startswith("* ")))
    run = (serving.LLAMA3_405B, 16 * 2**20, 16384, "h100", 131072)
    fused, unfused = (layouts.rank(*run, fused=kernel).costs[0] for kernel in (True, False))
    assert firsts[0].startswith(f"* {fused.layout}") and firsts[1].startswith(f"* {unfused.layout}")
    assert unfused.layout != fused.layout and unfused.step_s > fused.step_s


LAYOUT_FLAGS = [
    (["--batch-size", "4M", "--size", "llama9"], "argument --size: invalid choice: 'llama9'"),
    (["--batch-size", "4Q"], "argument --batch-size: expected an integer (or 512K, 4M), got '4Q'"),
    (["--batch-size", "4096"], "argument --batch-size: 4,096 tokens leave some of 8,960 devices none"),
    (["--batch-size", "4M", "--context", "3000"],
     "argument --batch-size: 4,194,304 tokens are not whole --context 3000 sequences"),
    ([], "argument --batch-size: --compare --size needs the batch in tokens (e.g. 4M)"),
    (["--batch-size", "4M", "--devices", "0"], "argument --devices: must be at least 1"),
    (["--batch-size", "4M", "--parallel", "fsdp"], "argument --parallel: --compare --size ranks layouts"),
    (["--batch-size", "4M", "--width", "64"], "argument --width: --compare --size ranks layouts"),
    (["--batch-size", "4M", "--memory"], "argument --memory: --compare --size ranks layouts"),
    (["--batch-size", "4M", "--tokens", "lots"],
     "argument --tokens: expected a number of tokens (15T, 1.5e12), got 'lots'"),
    (["--batch-size", "4M", "--tokens", "0"], "argument --tokens: must be a positive number of tokens"),
    (["--batch-size", "4M", "--mfu", "40"], "argument --mfu: must be above 0 and at most 1 (0.4 is 40%)"),
    # issue 63: a layout the size cannot split, one line each before any work
    (["--batch-size", "4M", "--layout", "xp=3"], "argument --layout: expected name=ways pairs of tp, cp, ep"),
    (["--batch-size", "4M", "--layout", "ep=2,fsdp=4480"], "ep 2 splits a mixture's experts, and llama3-70b"),
    (["--batch-size", "4M", "--layout", "tp=8"],
     "argument --layout: tp 8: its 8 devices are not --devices 8,960"),
    (["--batch-size", "4M", "--layout", "fsdp=1792,tp=5"],
     "argument --layout: fsdp 1792 x tp 5: tp 5 does not divide llama3-70b's 64 heads"),
    (["--batch-size", "4M", "--layout", "fsdp=56,pp=160"],
     "argument --layout: fsdp 56 x pp 160: pp 160 is more stages than llama3-70b's 80 layers"),
    (["--batch-size", "4M", "--layout", "fsdp=1792,cp=5"],
     "argument --layout: fsdp 1792 x cp 5: cp 5 does not divide the --context 4,096 sequence"),
    # a pipeline's interleaved schedule: r chunks of a stage's layers, at least as many microbatches
    (["--batch-size", "4M", "--repeats", "0"], "argument --repeats: must be 1 or more chunks a stage, got 0"),
    (["--batch-size", "4M", "--repeats", "2", "--check"],
     "argument --repeats: --check compiles each pipeline un-interleaved (r = 1)"),
    (["--batch-size", "4M", "--repeats", "3", "--layout", "fsdp=112,pp=80"],
     "fsdp 112 x pp 80: pp 80 x --repeats 3 is more chunks than a stage's layers (1 at most)"),
    (["--batch-size", "4M", "--repeats", "2", "--layout", "fsdp=448,pp=20"],
     "fsdp 448 x pp 20: pp 20 at --repeats 2 runs 2 microbatches, fewer than its stages"),
]  # fmt: skip


@pytest.mark.parametrize(("flags", "message"), LAYOUT_FLAGS, ids=[" ".join(f) for f, _ in LAYOUT_FLAGS])
def test_explain_compare_size_refuses_bad_input_in_one_line(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*LLAMA, *flags])
    out, err = capsys.readouterr()
    assert exit_.value.code == 2 and message in err and out == "", err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["explain", "--compare", "--size", "llama3-8b", "--batch-size", "1M"],
            "argument --hardware: --compare",
        ),
        (
            ["explain", "--size", "llama3-8b", "--hardware", "v5p"],
            "argument --size: only --decode or --compare takes it",
        ),
        (
            ["explain", "--model", "gpt", "--tokens", "15T"],
            "argument --tokens: only --compare --size takes it",
        ),
        (
            ["explain", "--decode", "--size", "llama3-8b", "--hardware", "v5e", "--mfu", "0.5"],
            "argument --mfu: only --compare --size takes it",
        ),
        (
            ["explain", "--model", "gpt", "--layout", "tp=2"],
            "argument --layout: only --compare --size takes it (where a layout ranks)",
        ),
        (
            ["explain", "--model", "gpt", "--unfused-attention"],
            "argument --unfused-attention: only --compare --size takes it (the memory of attention's scores)",
        ),
    ],
)
def test_a_size_needs_a_chip_and_compare_or_decode(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_train_parallel_zero_is_dp_s_mesh_and_rules_with_zero_s_step():
    zero, dp = parse_args(["train", "--parallel", "zero"]), parse_args(["train", "--parallel", "dp"])
    assert zero.zero and not dp.zero
    assert (zero.mesh, str(cli_rules(zero, list(zero.mesh)))) == (dp.mesh, str(cli_rules(dp, list(dp.mesh))))
    assert parse_args(["train", "--parallel", "zero", "--mesh", "data=4", "--devices", "4"]).mesh == {
        "data": 4
    }


@pytest.fixture
def synthetic_data(monkeypatch):
    from launched import synthetic_mnist

    from minishard.run import data

    monkeypatch.setitem(data.DATASETS, "mnist", synthetic_mnist)


@pytest.mark.slow  # four short trainings: ~8 s
def test_train_zero_learns_like_dp_and_resumes_only_under_zero(tmp_path, capsys, synthetic_data):
    small = ["train", "--layers", "784,32,10", "--batch-size", "64", "--checkpoint-dir"]
    assert main([*small, str(tmp_path / "dp"), "--parallel", "dp", "--epochs", "2"]) == 0
    dp = capsys.readouterr().out
    zero = [*small, str(tmp_path / "zero"), "--parallel", "zero"]
    assert main([*zero, "--epochs", "1"]) == 0
    assert main([*zero, "--epochs", "2", "--resume"]) == 0
    out = capsys.readouterr().out
    assert "ZeRO-3 by hand (minishard.zero): every array split 1/8 per device" in out
    assert "Resumed from step 16" in out and final_line(out) == final_line(dp)  # the same to 3 digits
    dp_resumes_zero = [*small, str(tmp_path / "zero"), "--parallel", "dp", "--epochs", "3", "--resume"]
    assert main(dp_resumes_zero) == 1  # its velocity is ZeRO's flat shards: refused before any restore
    err = capsys.readouterr().err
    assert err.startswith(f"error: the checkpoint in {tmp_path / 'zero'} was saved under --parallel zero, ")
    assert "this run --parallel dp, which builds another model" in err
    zero_resumes_dp = [*small, str(tmp_path / "dp"), "--parallel", "zero", "--epochs", "3", "--resume"]
    assert main(zero_resumes_dp) == 1
    err = capsys.readouterr().err
    assert (
        "saved under --parallel dp, this run --parallel zero" in err
        and "resume under the saved setting" in err
    )


@needs_mnist
@pytest.mark.slow
def test_train_parallel_zero_reaches_95_percent_on_mnist_in_one_epoch(capsys):
    assert main(["train", "--parallel", "zero", "--epochs", "1"]) == 0
    line = final_line(capsys.readouterr().out)
    assert float(line.rsplit("test acc ", 1)[1]) >= 0.95, line


def test_explain_with_hardware_says_in_one_line_what_cannot_compile(capsys):
    assert main(["explain", "--model", "vit", "--parallel", "tp", "--hardware", "h100"]) == 1  # 4 heads
    err = capsys.readouterr().err
    assert err.startswith("error: blocks[0].attention.query:") and len(err.strip().splitlines()) == 1
    assert main(["explain", "--parallel", "dp", "--hardware", "h100", "--devices", "16"]) == 2  # 8 here
    assert capsys.readouterr().err.strip() == "error: argument --devices: 16 asked, there are 8"


def test_devices_below_those_simulated_are_the_first_n_said_in_one_line(capsys, no_data):
    assert main(["explain", "--parallel", "dp", "--hardware", "h100", "--devices", "4"]) == 0  # 8 here
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "Using the first 4 of the 8 devices (--devices 4)" and "Using" not in "".join(out[1:])
    assert "mlp under dp on 4 devices, batch 128" in out
    assert main(["train", "--parallel", "dp", "--devices", "4", "--layers", "784,16,10"]) == 1  # at the data
    out = capsys.readouterr().out
    assert "Using the first 4 of the 8 devices (--devices 4)\n" in out
    assert "mesh {'data': 4} (4 devices)" in out


@pytest.mark.slow  # each compiles a step on 4 devices
@pytest.mark.parametrize(
    ("flags", "heading", "sends"),
    [  # the paths that refused ("4 asked, there are 8") or only planned; the GPT's 4 heads under tp.
        # the GPT of one block, whose step shows each path in a third to a half of four blocks' compile
        # time: under tp 4 all-reduces a block
        ([], "mlp under 2d on 4 devices", "all-reduce  x2"),  # the learner's `explain --devices 4`
        (
            ["--model", "gpt", "--depth", "1", "--parallel", "tp"],
            "gpt under tp on 4 devices",
            "all-reduce  x4",
        ),
        (["--parallel", "zero"], "mlp under zero (ZeRO-3 by hand) on 4 devices", "reduce-scatter  x4"),
        (
            ["--model", "gpt", "--depth", "1", "--parallel", "cp"],
            "gpt under cp on 4 devices, batch 16",
            "collective-permute",
        ),
        (
            ["--model", "gpt", "--depth", "1", "--parallel", "dp+cp"],
            "gpt under dp+cp on 4 devices",
            "collective-permute",
        ),
        (  # every block's MLP is the mixture: its two all-to-alls
            ["--model", "gpt", "--depth", "1", "--experts", "4", "--parallel", "dp+ep"],
            "gpt under dp+ep on 4 devices",
            "all-to-all  x2",
        ),
    ],
    ids=["default", "gpt tp", "zero", "gpt cp", "gpt dp+cp", "gpt dp+ep"],
)
def test_every_explain_path_compiles_on_the_first_n_devices_and_says_so_once(flags, heading, sends, capsys):
    assert main(["explain", *flags, "--devices", "4"]) == 0  # 8 simulated here
    out = capsys.readouterr().out
    assert out.count("Using the first 4 of the 8 devices (--devices 4)\n") == 1, out
    assert heading in out
    assert sends in out  # what the step (a forward pass under ep) compiled on those 4 sends: not only planned


@needs_mnist
@pytest.mark.slow  # compiles the pipelined step and its evaluation
def test_the_cli_trains_a_pipeline_on_data_and_stage_axes(capsys):
    # That it learns (the stacked MLP on data 2 x stage 4, through the command line) is
    # test_pipeline.py's test_minishard_train_parallel_dp_pp_reaches_97_percent_in_two_epochs; here
    # --microbatches reaches the pipeline, in 2 steps (120 steps to 0.889 took 10 s more).
    assert main(["train", "--parallel", "dp+pp", "--steps", "2", "--microbatches", "4"]) == 0
    out = capsys.readouterr().out
    assert "Pipeline: 4 blocks over 4 stages, 4 microbatches of 32 examples, 7 ticks; bubble 0.429" in out
    assert (
        "blocks.block.layers[0].weight  (4, 256, 256)  ('stage', None, None)  P('stage', None, None)" in out
    )
    assert 0 <= float(re.findall(r"Step 2 .* test acc ([\d.]+)", out)[-1]) <= 1  # 2 steps, then evaluated


@pytest.mark.slow  # compiles one training step
def test_explain_reads_a_pipelines_ticks_bubble_and_bytes_from_the_compiled_step(capsys):
    assert main(["explain", "--parallel", "pp", "--devices", "4", "--microbatches", "8"]) == 0
    out = capsys.readouterr().out
    assert "mlp under pp on 4 devices" in out and "(4, 256, 256)" in out
    assert "stages 4, microbatches 8, ticks 11 (read from the compiled loop)" in out
    assert "bubble 0.273 from the program, 0.273 = (p-1)/(m+p-1)" in out
    # forward and backward: 2 shifts per tick of one microbatch, 16 rows x 256 float32
    assert f"collective-permute over 'stage': {2 * 11 * 16 * 256 * 4} bytes per step" in out
    assert re.search(r"temporary memory: [\d.]+ MB per device", out)
    assert "stage 3 | . . . 0 1 2 3 4 5 6 7" in out


@pytest.mark.slow  # compiles the pipelined step twice: priced, then its ticks read
def test_explain_prices_the_pipelined_step_that_train_runs(capsys):
    assert main(["explain", "--parallel", "pp", "--hardware", "v5p"]) == 0
    out = capsys.readouterr().out
    collectives = out[out.index("collectives of train_step:") : out.index("predicted step")]
    assert "collective-permute  x46" in collectives and "all-gather" not in collectives  # 23 ticks, twice
    communication = next(line for line in out.splitlines() if line.strip().startswith("communication"))
    assert "collective-permute" in communication and "flips at" not in out  # its bytes grow with the batch
    assert "stages 8, microbatches 16, ticks 23 (read from the compiled loop)" in out
    assert "bubble 0.304 from the program, 0.304 = (p-1)/(m+p-1)" in out


def test_explain_checks_a_pipelines_microbatches_and_devices_before_any_work(capsys):
    assert main(["explain", "--parallel", "dp+pp", "--microbatches", "3"]) == 2
    out, err = capsys.readouterr()
    assert (out, err.strip()) == ("", "error: argument --microbatches: a batch of 128 is not a multiple of 6")
    assert main(["explain", "--parallel", "pp", "--devices", "16"]) == 2
    out, err = capsys.readouterr()
    assert (out, err.strip()) == ("", "error: argument --devices: 16 asked, there are 8")


# -- context parallelism: --parallel cp, dp+cp (docs/context.md) -----------------------------
# dp+cp's training through the command line, ring attention printing dp's losses, is
# tests/test_compose.py's test_train_prints_the_val_loss_of_dp_under_compositions (one dp run for all).


@pytest.mark.slow  # compiles one GPT step
def test_explain_dp_cp_shows_the_rings_permutes_against_the_formula_and_its_balance(capsys):
    # Grouped heads, 2 blocks: one compile shows the sends per block times the blocks, and that K and
    # V travel at their 2 heads (repeated for the 4 query heads where they arrive). The multi-head
    # ring's bytes (kv heads = heads) are tests/test_gpt.py's test_under_dp_cp_the_ring_gpt_has_the_
    # loss_and_gradients_of_dp[8]; a test of its own compiled a second GPT here for the grouped one.
    gpt = ["--model", "gpt", "--depth", "2", "--context", "32"]  # 2 blocks: half the default's compile
    assert main(["explain", *gpt, "--parallel", "dp+cp", "--kv-heads", "2", "--hardware", "v5p"]) == 0
    out = capsys.readouterr().out
    # p = 4 over "context", batch 16 (the GPT's default on 8 devices) over data = 2: chunks of
    # [8, 8 tokens, 2 kv heads, 32] float32 = 16,384 bytes; 20 of them a block, 2 blocks.
    sent = human_bytes(2 * 20 * 8 * 8 * 2 * 32 * 4)
    assert "Ring attention over 'context', p = 4, zig-zag. Per block, forward: K and V x 3 trips;" in out
    assert f"census: collective-permute over context x40, {sent}" in out
    assert f"formula: 2 blocks x 20 chunks [8, 8, 2, 32] f32 = {sent}" in out
    assert "balance (slowest device / mean): zig-zag 1.0, in order 1.6" in out
    # the verdict: the 2 heads' bytes sent, against the 4 query heads' work
    k = ring_bound(32, 4, 2, 32, 4, HARDWARE["v5p"], batch=8)
    assert f"on v5p: a step's sends / the attention they hide behind = {k:.3g}:" in out
    assert "gpt under dp+cp on 8 devices" in out and "P('context', None)" in out  # the position table


@pytest.mark.parametrize(
    "argv, message",
    [
        (["explain", "--parallel", "cp"], "argument --parallel: cp splits a sequence, and the MLP has none"),
        (
            ["explain", "--model", "gpt", "--parallel", "cp", "--context", "40"],
            "40 tokens do not cut into 2 x 8",
        ),
        (["explain", "--context", "64"], "argument --context: only the GPT takes it, and --model is mlp"),
        (["train", "--model", "gpt", "--parallel", "dp+cp", "--explicit"], "runs ring attention's shard_map"),
        (
            ["train", "--model", "gpt", "--parallel", "dp+cp", "--mesh", "data=1,context=8", "--context=24"],
            "argument --context: 24 tokens do not cut into 2 x 8 zig-zag chunks (context=8 devices)",
        ),
    ],
)
def test_context_parallel_flags_are_one_error_line_before_any_work(argv, message, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert message in err
