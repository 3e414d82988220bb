"""Reading a ``--profile`` trace back (``minishard.run.trace_reading``): the steps' host spans, each
device's ops by launch, the collectives; on events made here, and on a tiny GPT's real trace."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from minishard.run.trace_reading import Span, TracedStep, read_trace, traced_steps

HOST, WORKER = 7, 9  # the thread ids of the Python thread and of an XLA:CPU worker


def span(name: str, ts: float, dur: float, tid: int = HOST, **args: str) -> dict:
    return {"ph": "X", "pid": 1, "tid": tid, "ts": ts, "dur": dur, "name": name, "args": args}


def op(name: str, ts: float, dur: float, device: int, run: str) -> dict:
    return span(
        name, ts, dur, WORKER, hlo_op=name, device_ordinal=str(device), run_id=run, hlo_module="jit_step"
    )


EVENTS = [
    {"ph": "M", "pid": 1, "tid": HOST, "name": "thread_name", "args": {"name": "python"}},
    op("fusion.1", 50, 10, 0, "r0"),  # before the first traced step: not in any
    span("train", 100, 400, step_num="2"),
    span("PjitFunction(step)", 110, 40),
    span("PjitFunction(step)", 111, 38),  # jit's inner layer, nested in the outer one
    op("fusion.1", 160, 100, 0, "r1"),
    op("all-reduce.4", 260, 200, 0, "r1"),
    op("fusion.1", 170, 300, 1, "r1"),
    op("all-reduce.4", 470, 40, 1, "r1"),
    span("train", 530, 100, step_num="3"),
    op("fusion.2", 540, 30, 1, "r1"),  # device 1 is still in step 2's program when step 3 begins
    span("PjitFunction(step)", 540, 10),
    op("fusion.1", 560, 20, 0, "r2"),
    op("all-reduce.4", 580, 40, 0, "r2"),
    op("fusion.1", 565, 50, 1, "r2"),
]


def test_ops_go_to_the_step_their_launch_began_in_and_the_times_follow():
    first, second = traced_steps(EVENTS)
    assert (first.number, first.host, second.host) == (2, Span("train", 100, 500), Span("train", 530, 630))
    assert first.calls == (Span("PjitFunction(step)", 110, 150),)  # not the nested one
    assert [o.name for o in first.ops[1]] == ["fusion.1", "all-reduce.4", "fusion.2"]  # the straggler too
    assert [o.name for o in second.ops[0]] == ["fusion.1", "all-reduce.4"]
    assert first.collective_time() == {0: 200, 1: 40} and (first.gap, second.gap) == (30, None)
    times = first.times()
    assert times["collective_ms"] == pytest.approx((200 + 40) / 2 / 1e3)
    assert times["least_collective_ms"] == pytest.approx(40 / 1e3)
    assert times["collective_share"] == pytest.approx(120 / 400)
    assert (times["step_ms"], times["dispatch_ms"], times["gap_ms"]) == pytest.approx((0.4, 0.04, 0.03))
    assert "gap_ms" not in second.times()  # nothing after the last traced step


def test_a_device_whose_collective_was_cut_off_is_left_out_of_the_collective_times():
    cut = TracedStep(4, Span("train", 0, 100), (), {0: (Span("all-reduce.1", 0, 50),), 1: ()}, None)
    assert cut.times()["least_collective_ms"] == pytest.approx(0.05)


def test_a_directory_without_a_trace_or_a_trace_without_steps_is_said(tmp_path):
    with pytest.raises(FileNotFoundError, match=rf"no plugins/profile/\*/\*.trace.json.gz under {tmp_path}"):
        read_trace(tmp_path)
    with pytest.raises(ValueError, match="no `train` spans"):
        traced_steps([op("fusion.1", 0, 1, 0, "r0")])


needs_shakespeare = pytest.mark.skipif(
    not os.path.isdir(os.path.join(os.environ.get("TFDS_DATA_DIR", "/nonexistent"), "tiny_shakespeare")),
    reason="needs tiny_shakespeare prepared by tfds: set TFDS_DATA_DIR (make test does)",
)


@needs_shakespeare
@pytest.mark.slow  # a tiny GPT's compile and five steps
def test_a_tiny_gpts_trace_has_each_steps_ops_on_all_8_devices_and_their_all_reduce(tmp_path, capsys):
    from minishard.run.cli import main

    tiny = ["--model", "gpt", "--width", "16", "--depth", "1", "--heads", "2", "--context", "16"]
    trace = tmp_path / "trace"
    assert (
        main(["train", *tiny, "--no-download", "--steps", "5", "--devices", "8", "--profile", str(trace)])
        == 0
    )
    steps = read_trace(trace)
    assert [step.number for step in steps] == [2, 3, 4]
    for step in steps[:-1]:  # the last may have lost its latest ops: the trace stops at its loss
        assert sorted(step.ops) == list(range(8))
        assert all(any(op.name.startswith("all-reduce") for op in ops) for ops in step.ops.values())
        assert [call.name for call in step.calls] == ["PjitFunction(train_step)"]
        assert step.gap is not None and step.gap > 0
        assert 0 < step.times()["collective_share"] < 1
    assert len({len(ops) for step in steps[:-1] for ops in step.ops.values()}) == 1  # the same program

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import gpt_trace  # the benchmark that draws docs/gpt_trace.png, on this trace

    capsys.readouterr()
    assert gpt_trace.main(["--trace", str(trace), "--plot", str(tmp_path / "trace.png")]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert [row.split()[0] for row in rows[1:4]] == ["2", "3", "4"] and rows[
        -1
    ] == f"Wrote {tmp_path}/trace.png"
    assert (tmp_path / "trace.png").read_bytes()[:4] == b"\x89PNG"


def test_gpt_ops_classes_a_compiled_programs_ops_and_finds_its_dots() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import gpt_ops  # the benchmark behind docs/benchmarks.md's one-device ceiling

    def program(x: jax.Array, w: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        return jnp.tanh(x @ w), jnp.sum(jnp.exp(x), axis=0), x.T

    x, w = jnp.ones((32, 8)), jnp.ones((8, 16))
    hlo = jax.jit(program).lower(x, w).compile().as_text()
    kinds = gpt_ops.op_kinds(hlo)
    # tanh(x @ w): a matmul, then elementwise; sum(exp(x)): a reduction; x.T: a copy
    assert set(kinds.values()) == {"matmul", "elementwise", "reduction", "data movement"}
    (dot,) = gpt_ops.dots(hlo)
    assert dot == ((32, 8), (8, 16), (((1,), (0,)), ((), ())))
    flops, seconds = gpt_ops.alone(dot, repeats=1)
    assert flops == 2 * 32 * 8 * 16 and seconds > 0
