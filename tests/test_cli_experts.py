"""``minishard train`` and ``explain`` with ``--experts``: the GPT's MLPs as a mixture of experts,
the styles ``ep`` and ``dp+ep``, and every bad input as one line before any work."""

import os
import re

import pytest

from minishard.run.cli import main, parse_args

needs_shakespeare = pytest.mark.skipif(
    not os.path.isdir(os.path.join(os.environ.get("TFDS_DATA_DIR", "/nonexistent"), "tiny_shakespeare")),
    reason="needs tiny_shakespeare prepared by tfds: set TFDS_DATA_DIR (make test does)",
)
GPT = ["--model", "gpt"]
BAD = [
    (["--model", "vit", "--experts", "4"], "argument --experts: only the GPT takes it, and --model is vit; add --model gpt"),  # noqa: E501
    (["--experts", "8"], "argument --experts: only the GPT takes it, and --model is mlp; add --model gpt"),
    ([*GPT, "--experts", "2", "--top-k", "3"], "argument --top-k: 3 with --experts 2; each token picks k distinct experts, so k must be from 1 to 2"),  # noqa: E501
    ([*GPT, "--experts", "8", "--capacity-factor", "0"], "argument --capacity-factor: must be a finite number > 0, got 0"),  # noqa: E501
    ([*GPT, "--experts", "8", "--capacity-factor", "-1.5"], "argument --capacity-factor: must be a finite number > 0"),  # noqa: E501
    ([*GPT, "--top-k", "1"], "argument --top-k: only with --experts N (the MLPs are dense without it)"),
    ([*GPT, "--experts", "4", "--top-k", "1", "--capacity-factor", "1e9"], "argument --capacity-factor: 1e+09 is more than 4 (--experts / --top-k), where each expert already has a slot for every token and none is dropped; give at most that"),  # noqa: E501
    ([*GPT, "--experts", "6", "--parallel", "dp+ep"], "argument --experts: 6 experts do not split over expert=4 devices; give a multiple of 4"),  # noqa: E501
    ([*GPT, "--parallel", "ep"], "argument --parallel: ep splits a mixture of experts over 'expert', and the GPT has none; add --experts N"),  # noqa: E501
    ([*GPT, "--experts", "8", "--parallel", "ep", "--batch-size", "12"], "argument --batch-size: 12 windows do not split over the 8 devices of expert=8; give a multiple of 8"),  # noqa: E501
    ([*GPT, "--experts", "8", "--explicit"], "argument --explicit: not with --experts"),
    ([*GPT, "--experts", "8", "--parallel", "zero"], "argument --experts: not with --parallel zero"),
    ([*GPT, "--experts", "6", "--parallel", "pp+ep"], "argument --experts: 6 experts do not split over expert=4 devices; give a multiple of 4"),  # noqa: E501
    ([*GPT, "--experts", "8", "--parallel", "ep", "--mesh", "data=8"], "argument --mesh: --parallel ep splits expert, batch over 'expert', and --mesh data=8 has no such axis"),  # noqa: E501
]  # fmt: skip


@pytest.mark.parametrize(("flags", "message"), BAD, ids=[" ".join(f) for f, _ in BAD])
@pytest.mark.parametrize("command", ["train", "explain"])
def test_bad_expert_flags_are_one_line_before_any_work(command, flags, message, capsys):
    if command == "explain" and {"--mesh", "--batch-size", "--explicit"} & set(flags):
        pytest.skip("explain's mesh is the style's, Auto; its --batch-size only for a compiled step")
    with pytest.raises(SystemExit) as exit_:
        main([command, *flags])
    out, err = capsys.readouterr()
    assert exit_.value.code == 2 and message in err and out == "", err
    assert err.strip().splitlines()[-1].startswith(f"minishard {command}: error: ")


def test_expert_styles_fill_a_batch_that_splits_over_data_and_expert():
    args = parse_args(["train", *GPT, "--experts", "8", "--parallel", "dp+ep"])
    assert args.mesh == {"data": 2, "expert": 4} and args.batch_size == 16  # 8 devices split it, near 12
    assert (args.top_k, args.capacity_factor) == (2, 1.25)  # the MoE's defaults, with --experts only
    dense = parse_args(["train", *GPT])
    assert dense.experts == 0 and dense.top_k is None and dense.batch_size == 16  # dp on 8: 16


@pytest.mark.parametrize(
    ("experts", "filled", "notes"),
    [
        (
            "1",
            (1, 1.0),
            [
                "--top-k 2 is more than --experts 1 allows: 1",
                "--capacity-factor 1.25 is more than --experts 1 allows: 1",
            ],
        ),
        ("2", (2, 1.0), ["--capacity-factor 1.25 is more than --experts 2 allows: 1"]),
        ("4", (2, 1.25), []),
    ],
)
def test_defaults_too_big_for_few_experts_are_capped_and_said_not_refused(experts, filled, notes, capsys):
    args = parse_args(["train", *GPT, "--experts", experts])
    assert (args.top_k, args.capacity_factor) == filled
    out = capsys.readouterr().out
    assert [
        line.removeprefix("note: the default ") for line in out.splitlines() if line.startswith("note:")
    ] == notes


@pytest.mark.slow  # the GPT with experts compiles its forward pass on 8 devices
def test_explain_shows_where_each_expert_lives_two_all_to_alls_per_block_and_the_dropped(capsys):
    assert main(["explain", *GPT, "--experts", "8", "--parallel", "dp+ep"]) == 0
    out = capsys.readouterr().out
    assert "experts 0-1: devices 0, 4" in out and "experts 6-7: devices 3, 7" in out  # data=2 x expert=4
    # 4 blocks x 2; each 8 experts x 16/8 groups x 20 slots x 128 features x 4 bytes = 163,840 B
    assert re.search(r"all-to-all  x8  1\.3 MB  over \('expert',\)", out), out
    assert "8 x 2 x 20 x 128 x 4 B = 163,840 B\n  8 in all: 1,310,720 B" in out
    dropped, routed = map(
        lambda n: int(n.replace(",", "")), re.search(r"dropped ([\d,]+) of ([\d,]+)", out).groups()
    )
    assert routed == 4 * 16 * 64 * 2 and 0 < dropped < routed  # every block, every token, k = 2


@needs_shakespeare
@pytest.mark.slow  # 40 steps of the MoE GPT on 8 simulated devices
def test_train_dp_ep_learns_and_reports_the_dropped_routings_each_evaluation(capsys):
    argv = ["train", *GPT, "--experts", "8", "--parallel", "dp+ep", "--steps", "40", "--eval-every", "20"]
    assert main([*argv, "--width", "32", "--heads", "2", "--depth", "2", "--warmup-steps", "5"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("Step ")]
    assert len(lines) == 2 and all("val dropped" in line for line in lines)
    losses = [float(re.search(r"val loss ([\d.]+)", line).group(1)) for line in lines]
    assert losses[1] < losses[0] < 4.2  # ln 65 = 4.17: it learns


@needs_shakespeare
@pytest.mark.slow  # a step of the MoE GPT compiles; the resume stops at the checkpoint's metadata
def test_a_resume_under_another_capacity_factor_is_refused_naming_the_flag(tmp_path, capsys):
    # The same arrays, another capacity (a static field of every MoE): the routing a run resumes under
    # would drop other tokens than the one it saved. Named, not "another model", and nothing trained.
    directory = str(tmp_path / "run")
    tiny = [*GPT, "--width", "16", "--depth", "1", "--heads", "2", "--context", "16", "--no-download"]
    moe = [*tiny, "--experts", "2", "--top-k", "1", "--steps", "1", "--warmup-steps", "0"]
    assert main(["train", *moe, "--checkpoint-dir", directory]) == 0
    capsys.readouterr()
    resumed = ["train", *moe, "--checkpoint-dir", directory, "--resume", "--capacity-factor", "2"]
    assert main(resumed) == 1
    out, err = capsys.readouterr()
    assert err.splitlines()[-1] == (
        f"error: the checkpoint in {directory} was saved under --capacity-factor 1.25, this run "
        "--capacity-factor 2.0, which builds another model (its arrays or its structure); resume under "
        "the saved setting, or start afresh (minishard sample reads a GPT's checkpoint of any style but zero)"
    ), err
    assert "Step " not in out and "Resumed" not in out
