"""Smoke tests for ``benchmarks/``: every section runs on tiny sizes and writes the promised JSON.

They check structure and correctness guards (equal losses, collective bytes
equal to their analytic minimum), never timings: timings on a shared machine
are reports, not facts a test can assert.
"""

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))  # the benchmark modules import each other by name

import harness  # noqa: E402
import memory_styles  # noqa: E402
import report  # noqa: E402


def run_tiny(tmp_path: Path, sections: str) -> dict:
    """``benchmarks/run.py --tiny``'s JSON, run in this process: what it writes does not depend on the
    process (a fresh one cost 3-8 s importing JAX, Flax and Equinox; the compile section still starts
    its own processes), and the epoch section reads MNIST as conftest cached it."""
    import run

    out = tmp_path / "bench.json"
    assert run.main(["--tiny", "--sections", sections, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def is_stat(entry: dict) -> bool:
    return set(entry) == {"median", "range"} and entry["range"][0] <= entry["median"] <= entry["range"][1]


def test_order_rotates_and_reverses_so_everyone_goes_first_equally_often():
    names = ["a", "b", "c"]
    orders = [harness.order(names, i) for i in range(6)]
    assert orders[:3] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert orders[3] == ["c", "b", "a"]  # the second cycle runs backwards: new neighbours
    assert sorted(o[0] for o in orders) == ["a", "a", "b", "b", "c", "c"]


def test_comparison_pairs_samples_of_the_same_iteration():
    # b is always 2x a within an iteration, while the load triples between iterations
    rounds = [{"a": [1.0, 3.0, 9.0], "b": [2.0, 6.0, 18.0]}, {"a": [2.0, 2.0, 2.0], "b": [4.0, 4.0, 4.0]}]
    comparison = harness.Comparison.of(rounds, "a")
    assert comparison.ratio["b"] == harness.Stat(2.0, 2.0, 2.0)
    assert comparison.as_json()["a"] == {"median": 1.0, "range": [1.0, 1.0]}


def test_targets_and_report_render_from_a_synthetic_result(tmp_path):
    import run

    stat = {"median": 1.01, "range": [1.0, 1.05]}
    doc = {
        "host_ratio": {"raw": {"median": 1.0, "range": [1.0, 1.0]}, "minishard_jit": stat},
        "sharded_vs_handwritten": {"2d": stat},
        "collectives": {
            "2d": {"bytes": 10, "analytic_bytes": 10, "all_gather_of_weights": False, "kinds": {}}
        },
    }
    rows = {row["target"]: row for row in run.check_targets(doc)}
    assert rows["host_ratio.minishard_jit"]["met"] and rows["host_ratio.minishard_jit"]["met_every_round"]
    assert (
        rows["sharded_vs_handwritten.2d"]["met"] and not rows["sharded_vs_handwritten.2d"]["met_every_round"]
    )
    assert rows["collectives.2d: bytes == analytic minimum"]["met"]
    assert "| `host_ratio.minishard_jit` | 1.1 |" in report.targets_table({"targets": list(rows.values())})
    figures = run.figures({"targets": list(rows.values())})  # the figures this run measured
    assert [row["target"] for row in figures] == ["host_ratio.minishard_jit"]
    page = tmp_path / "page.md"
    page.write_text(f"intro\n{report.START}\nold\n{report.END}\noutro\n")
    report.update_page(str(page), "new tables\n")
    assert page.read_text() == f"intro\n{report.START}\n\nnew tables\n\n{report.END}\noutro\n"


@pytest.mark.slow
def test_tiny_run_writes_every_promised_key_and_renders(tmp_path, capsys):
    doc = run_tiny(tmp_path, "steps,flatten,compile,parallel,roofline,variants,phases")
    for key in ("machine", "versions", "date", "loadavg_start", "loadavg_end", "targets"):
        assert key in doc
    contenders = {"raw", "minimal_pytree", "minishard_jit", "minishard_sharded", "nnx_jit", "nnx_fast",
                  "linen", "eqx_filter_jit", "eqx_partition_jit"}  # fmt: skip
    assert contenders <= set(doc["host_ratio"]) and contenders <= set(doc["host_overhead_us"])
    for size in ("micro", "seed"):
        assert contenders <= set(doc["step_ratio"][size])
        assert all(is_stat(entry) for entry in doc["step_ratio"][size].values())
    assert doc["host_ratio"]["raw"]["median"] == 1.0
    assert {"raw", "minishard_sharded"} <= set(doc["compile_ratio"])
    assert set(doc["sharded_vs_handwritten"]) == {"data_parallel", "megatron", "2d", "fsdp"}
    for style, collectives in doc["collectives"].items():
        assert doc["parallel"]["styles"][style]["same_program"]
        if style != "fsdp":  # XLA:CPU all-reduces FSDP gradients instead of reduce-scattering them
            assert collectives["bytes"] == collectives["analytic_bytes"], style
    assert set(doc["matmul_fraction"]) == {"raw", "minishard_sharded"}
    assert {"layers", "sharded_floor"} <= set(doc["variants"]["host_ratio"])
    phases = doc["phases"]
    assert set(phases["host_diff_us"]) == {"raw", "minimal_pytree", "handwritten", "sharded"}
    assert all(is_stat(entry) for entry in phases["breakdown_us"].values())
    assert {"flatten_arguments", "structure_key", "donation_check", "unflatten_outputs"} <= set(
        phases["phase_us"]
    )
    assert doc["figures"][0]["figure"].startswith("`Sharded` host overhead")

    chart = tmp_path / "chart.png"
    capsys.readouterr()  # the run's own lines
    assert report.main([str(tmp_path / "bench.json"), "--chart", str(chart)]) == 0
    rendered = capsys.readouterr().out
    assert "### Targets" in rendered and "### 9. One `Sharded` call" in rendered
    assert chart.stat().st_size > 0


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("TFDS_DATA_DIR"), reason="needs prepared MNIST (TFDS_DATA_DIR)")
def test_tiny_epoch_section_compares_the_loops_on_equal_losses(tmp_path):
    doc = run_tiny(tmp_path, "epoch")
    assert is_stat(doc["epoch_ratio"])
    assert doc["epoch"]["fit"]["same_loss"]
    assert doc["epoch"]["input_pipeline"]["images_per_s"]["median"] > 0


@pytest.mark.slow
def test_tiny_gpt_section_times_minishard_against_a_handwritten_step_of_equal_losses(tmp_path):
    doc = run_tiny(tmp_path, "gpt")
    assert is_stat(doc["gpt_step_ratio"])
    losses = doc["gpt_step"]["losses_first_three_steps"]
    np.testing.assert_allclose(losses["minishard"], losses["handwritten"], rtol=1e-5)
    assert set(doc["gpt_step"]["tokens_per_s"]) == {"minishard", "handwritten", "handwritten_copy"}
    assert "### 8. The GPT's AdamW step" in report.render({**doc, "mode": "tiny", "seconds": 1.0})


def test_memory_styles_draws_explain_memorys_prediction_per_style(tmp_path, capsys):
    memory_styles.main(["--plot", str(tmp_path / "memory.png")])
    assert (tmp_path / "memory.png").read_bytes()[:4] == b"\x89PNG"
    fp32, bf16 = memory_styles.budgets("fp32"), memory_styles.budgets("bf16")
    assert set(fp32) == {"dp", "tp", "2d", "fsdp", "fsdp+tp"}
    for style, step in bf16.items():  # bf16: the float32 weights are the master, the step's copy half of them
        assert step.terms["master"] == fp32[style].terms["parameters"] == 2 * step.terms["parameters"]
    assert capsys.readouterr().out.count("total") == 2


def test_the_pytorch_reference_is_the_default_gpt_in_shape_parameters_and_flops(monkeypatch, capsys):
    import jax
    import torch_gpt  # the reference issue 49 names; PyTorch itself is not a dependency

    from minishard.costs import model_flops
    from minishard.models.gpt import GPT
    from minishard.run.cli.models import MODELS
    from minishard.run.next_token import next_token_loss

    flags = MODELS["gpt"].defaults
    ours = {"context": torch_gpt.CONTEXT, "width": torch_gpt.WIDTH, "depth": torch_gpt.DEPTH}
    ours |= {"heads": torch_gpt.HEADS, "lr": torch_gpt.LR, "weight_decay": torch_gpt.DECAY}
    assert {name: flags[name] for name in ours} == ours
    assert flags["mlp_ratio"] * flags["width"] == torch_gpt.MLP
    gpt = GPT(torch_gpt.VOCAB, flags["context"], key=jax.random.key(0))
    assert sum(leaf.size for leaf in jax.tree.leaves(gpt)) == torch_gpt.PARAMETERS
    window = jax.ShapeDtypeStruct((torch_gpt.BATCH, torch_gpt.CONTEXT), "int32")
    assert model_flops(next_token_loss, gpt, {"inputs": window, "targets": window}) == torch_gpt.model_flops()
    with pytest.raises(SystemExit):  # a flag that cannot work: one line before any step
        torch_gpt.main(["--peak", "0"])
    assert capsys.readouterr().err.endswith("error: argument --peak: must be positive, got 0.0\n")
    monkeypatch.setitem(sys.modules, "torch", None)  # as without PyTorch: one line, no traceback
    assert torch_gpt.main([]) == 2
    said = capsys.readouterr().err
    assert said == "error: PyTorch is not installed (not a minishard dependency): pip install torch\n"


@pytest.mark.slow
def test_flash_smoke_times_every_contender_and_agrees_with_xla(tmp_path, monkeypatch, capsys):
    """benchmarks/flash.py --smoke: the Pallas kernels interpreted on tiny shapes, JSON rows per contender.
    Its main in this process, as run_tiny's: the rows do not depend on the process (a fresh one
    imported JAX for seconds)."""
    import flash

    out = tmp_path / "flash.json"
    monkeypatch.setattr(sys, "argv", ["flash.py", "--smoke", "--repeat", "1", "--json", str(out)])
    flash.main()
    rows = json.loads(out.read_text())["rows"]
    names = {row["contender"] for row in rows}
    assert {"XLA dot_product_attention", "JAX flash, default blocks", "minishard 128x128"} <= names
    assert all(row["ms"] > 0 and row["error"] < 2e-2 for row in rows)  # bf16: about 0.4% a rounding
    assert "| contender |" in capsys.readouterr().out


def test_the_recipe_timer_runs_docs_gpt_md_s_command_and_it_parses_looped_and_scanned():
    import recipe_time

    from minishard.run.cli import parse_args

    flags = recipe_time.recipe_flags()
    assert flags[:2] == ["--model", "gpt"] and "--dropout" in flags
    assert "--scan" in flags  # the page's command scans its blocks; the loop is the same without it
    loop = recipe_time.looped(flags)
    for scan in ([], ["--scan"]):
        args = parse_args(["train", *loop, *scan])
        shape = (args.depth, args.width, args.context, args.dropout)
        assert shape == (6, 384, 256, 0.2) and args.scan == bool(scan)


def test_the_recipe_compile_worker_times_the_build_the_lowering_and_the_compile():
    import recipe_compile

    tiny = ["--depth", "2", "--width", "16", "--heads", "2", "--context", "16", "--batch-size", "8", "--scan"]
    times = recipe_compile.measure("here", tiny)
    assert set(times) == {"build", "lower", "compile", "temporaries_mb", "accessed_mb"}
    assert all(times[part] > 0 for part in ("build", "lower", "compile", "temporaries_mb"))


def test_chip_trace_sums_each_op_and_each_kind_on_the_first_tpu_only(tmp_path):
    """benchmarks/chip_trace.py reads a ``jax.profiler`` trace: the "XLA Ops" line of TPU:0, each op's
    microseconds summed over its events with its HLO kept, and per kind (the op's name less its
    number); other chips' and other lines' events are not the step's."""
    import gzip

    import chip_trace

    def meta(pid, tid, what, name):
        return {"ph": "M", "pid": pid, "tid": tid, "name": what, "args": {"name": name}}

    def op(pid, tid, name, dur):
        return {
            "ph": "X",
            "pid": pid,
            "tid": tid,
            "name": name,
            "dur": dur,
            "args": {"long_name": f"%{name} = hlo"},
        }

    events = [
        meta(1, 0, "process_name", "/device:TPU:0"),
        meta(2, 0, "process_name", "/device:TPU:1"),
        meta(1, 7, "thread_name", "XLA Ops"),
        meta(1, 8, "thread_name", "Steps"),
        meta(2, 7, "thread_name", "XLA Ops"),
        *(op(1, 7, "fusion.1", 10.0) for _ in range(3)),
        op(1, 7, "fusion.22", 5.0),
        op(1, 7, "convolution.3", 4.0),
        op(1, 8, "fusion.1", 100.0),  # the step's own line, not an op
        op(2, 7, "fusion.1", 100.0),  # another chip
    ]
    folder = tmp_path / "plugins" / "profile"
    folder.mkdir(parents=True)
    with gzip.open(folder / "host.trace.json.gz", "wt") as out:
        json.dump({"traceEvents": events}, out)
    ops, count = chip_trace.op_times(str(tmp_path))
    assert count == 5 and ops == {
        "fusion.1": (30.0, "%fusion.1 = hlo"),
        "fusion.22": (5.0, "%fusion.22 = hlo"),
        "convolution.3": (4.0, "%convolution.3 = hlo"),
    }
    kinds, _ = chip_trace.busy_ops(str(tmp_path))
    assert kinds == {"fusion": 35.0, "convolution": 4.0}


def test_matmul_peak_says_each_shapes_share_of_the_chips_published_peak(tmp_path, monkeypatch):
    """benchmarks/matmul_peak.py --smoke: a tiny matmul timed, its FLOPs 2mkn over its time, and its
    share of the peak of the chip ``device_kind`` names (here a v5e's, as on the chip)."""
    import matmul_peak

    from minishard.hardware import HARDWARE

    out = tmp_path / "matmul.json"
    monkeypatch.setattr(matmul_peak, "chip_of", lambda kind: HARDWARE["v5e"])
    monkeypatch.setattr(sys, "argv", ["matmul_peak.py", "--smoke", "--repeat", "2", "--json", str(out)])
    matmul_peak.main()
    found = json.loads(out.read_text())
    assert found["peak"] == 197e12
    (row,) = found["rows"]
    m, k, n = row["mkn"]
    assert row["us"] > 0 and row["flops"] == pytest.approx(2 * m * k * n / (row["us"] * 1e-6))
    assert row["of_peak"] == pytest.approx(row["flops"] / 197e12)
