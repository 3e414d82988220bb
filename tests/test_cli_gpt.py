"""``minishard train --model gpt``, ``minishard sample`` and ``minishard explain --model gpt``.

The runs here are tiny GPTs (16 features, one or two blocks, a context of 16) for a few steps on the real
tiny_shakespeare; the default run (nanoGPT's CPU configuration, val loss <= 1.88) is measured in docs/gpt.md.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import re
import signal
import string
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from strategies import assert_trees_equal

import minishard as ms
from minishard.models.gpt import GPT, as_stacked, stream
from minishard.pipeline import Stacked, unstack
from minishard.run.checkpoint import Checkpointer
from minishard.run.cli import main, parse_args
from minishard.run.cli.models import gpt as gpt_entry
from minishard.run.cli.models.gpt import DERIVED_BATCH_LIMIT, FLASH_FROM, GPT_ENTRY
from minishard.run.cli.sample import MOST_BATCH, continuation, restore, sample
from minishard.run.text_data import Vocabulary

needs_shakespeare = pytest.mark.skipif(
    not os.path.isdir(os.path.join(os.environ.get("TFDS_DATA_DIR", "/nonexistent"), "tiny_shakespeare")),
    reason="needs tiny_shakespeare prepared by tfds: set TFDS_DATA_DIR (make test does)",
)
TINY = ["--model", "gpt", "--width", "16", "--depth", "1", "--heads", "2", "--context", "16", "--no-download"]
FLOAT = r"(\d+\.\d+)"
SHAKESPEARE = "\n !$&',-.3:;?" + string.ascii_uppercase + string.ascii_lowercase
"""tiny_shakespeare's 65 characters, sorted: its vocabulary."""


def records(output: str) -> list[str]:
    """The lines of each evaluation, without their (machine-dependent) durations."""
    return [
        re.sub(r" in [\d.]+ s( \([^)]*\))?", "", line)
        for line in output.splitlines()
        if line.startswith("Step ")
    ]


@needs_shakespeare
@pytest.mark.slow  # reading the text imports TensorFlow; a step, two evaluations and decoding compile
def test_the_gpt_trains_by_steps_and_its_checkpoint_samples_without_data(tmp_path, capsys, monkeypatch):
    directory, log, plot = str(tmp_path / "run"), tmp_path / "metrics.jsonl", tmp_path / "curves.png"
    flags = ["--steps", "4", "--eval-every", "2", "--checkpoint-dir", directory]
    assert main(["train", *TINY, *flags, "--log", str(log), "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "(2 devices: the GPT's default run: 2 split the batch (an all-reduce a step)" in out  # said why
    assert "mesh {'data': 2} (2 devices)" in out
    lines = records(out)
    assert [re.search(rf"· val loss {FLOAT}", line) is not None for line in lines] == [True, True]
    assert re.search(rf"· test loss {FLOAT}$", lines[-1]) and "test loss" not in lines[0]
    val = [float(re.search(rf"val loss {FLOAT}", line)[1]) for line in lines]
    assert val[1] < val[0] < 2 * math.log(65)  # learning, from about chance
    assert [json.loads(line)["step"] for line in log.read_text().splitlines() if "seconds" in line] == [2, 4]
    assert plot.read_bytes()[:4] == b"\x89PNG"
    with Checkpointer(directory, read_only=True) as checkpointer:
        step, meta = checkpointer.read_meta()
    info = meta["info"]
    assert step == 4 and info["model"] == "gpt" and info["parallel"] == "dp" and len(info["vocabulary"]) == 65
    assert info["flags"]["context"] == 16 and meta["batch_size"] == 16

    monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path / "no-data-here"))  # sampling reads only the checkpoint
    sample = ["sample", "--checkpoint-dir", directory, "--prompt", "ROMEO:", "--tokens", "40"]
    texts = []
    for seed in ("0", "0", "1"):
        assert main([*sample, "--temperature", "0.8", "--seed", seed]) == 0
        texts.append(capsys.readouterr().out.rstrip("\n"))
    assert texts[0].startswith("ROMEO:") and len(texts[0]) == len("ROMEO:") + 40
    assert texts[0] == texts[1] and texts[0] != texts[2]  # the same seed, the same text


@needs_shakespeare
@pytest.mark.slow  # two short runs, each compiling its steps
def test_a_resumed_gpt_run_ends_bit_identical_to_a_straight_one(tmp_path, capsys):
    directory = str(tmp_path / "run")

    def trained(*flags):
        common = ["--steps", "6", "--eval-every", "3", "--checkpoint-dir", directory]
        assert main(["train", *TINY, *common, *flags]) == 0
        with Checkpointer(directory, read_only=True) as checkpointer:
            step, meta = checkpointer.read_meta()
        return jax.device_get(restore(directory, step, meta["info"])), records(capsys.readouterr().out)

    # The same 6 steps (a cosine's length is the run's): straight, then again from the checkpoint of step 4.
    straight, straight_lines = trained("--checkpoint-every", "2")
    resumed, resumed_lines = trained("--resume-from", "4")
    assert_trees_equal(resumed, straight)  # every step's windows a pure function of (seed, step)
    assert resumed_lines == straight_lines[-1:]  # steps 5-6 of the period 4-6: the same losses, val and test
    others = (("--steps", "8", "6"), ("--lr", "0.002", "0.003"), ("--warmup-steps", "2", "5"))
    for flag, value, saved in others:
        other = ["--steps", "6", "--checkpoint-dir", directory, "--resume-from", "4", flag, value]
        assert main(["train", *TINY, *other]) == 1  # a cosine that spans 8 steps is another curve
        err = capsys.readouterr().err.splitlines()
        assert err[-1] == (
            f"error: the checkpoint in {directory} follows the learning-rate schedule of {flag} {saved}, "
            f"this run {flag} {value}: the resumed run would follow neither; resume with {flag} {saved}, "
            "or start afresh"
        ), err
    styles = [
        (["--parallel", "dp+cp", "--batch-size", "16"], "--parallel dp, this run --parallel dp+cp"),  # a ring
        (["--parallel", "dp+pp", "--mesh", "data=8,stage=1"], "--parallel dp, this run --parallel dp+pp"),
        (["--remat", "dots"], "--remat none, this run --remat dots"),
    ]
    for flags, difference in styles:  # the same arrays, or stacked: the setting is named, not "another model"
        assert main(["train", *TINY, "--steps", "6", "--checkpoint-dir", directory, "--resume", *flags]) == 1
        assert capsys.readouterr().err.splitlines()[-1] == (
            f"error: the checkpoint in {directory} was saved under {difference}, which builds another model "
            "(its arrays or its structure); resume under the saved setting, or start afresh (minishard "
            "sample reads a GPT's checkpoint of any style but zero)"
        )


@needs_shakespeare
@pytest.mark.slow  # four short runs, each compiling its steps, and two samples
def test_a_scanned_gpt_trains_to_the_looped_gpts_losses_resumes_bit_identical_and_samples_as_one(
    tmp_path, capsys
):
    """--scan stacks the blocks and runs them as one lax.scan: the same function of the same numbers.
    With dropout: block i draws its masks from key_at(step key, i + 1) looped or scanned, so the
    training losses hold the masks and the val and test losses the undropped forward (evaluation
    drops nothing: tests/test_dropout.py). The scanned run resumes bit-identical, as the looped one
    does (test_a_resumed_gpt_run_ends_bit_identical_to_a_straight_one). One looped run for all, where
    a test of scanned-vs-looped trained a pair of its own. That the masks are recomputed so under
    --remat full is tests/test_dropout.py's test_a_scanned_gpt_draws_the_looped_gpts_masks_and_
    recomputes_them_so[full]; --remat's way to the model is test_under_remat_each_line_gives_the_hfu_
    of_the_flops_the_step_runs's."""

    def trained(name, *flags):
        directory = str(tmp_path / name)
        common = ["--depth", "2", "--steps", "6", "--eval-every", "3", "--checkpoint-dir", directory]
        assert main(["train", *TINY, *common, *flags]) == 0  # 2 blocks: a scan of more than one, 2 keys
        with Checkpointer(directory, read_only=True) as checkpointer:
            step, meta = checkpointer.read_meta()
        model = jax.device_get(restore(directory, step, meta["info"]))
        return model, meta["info"]["flags"]["dropout"], capsys.readouterr().out

    _, _, looped_out = trained("looped", "--dropout", "0.2")
    # the masks' keys come from (seed, step), the step from the optimizer's state: nothing else to save
    straight, rate, out = trained("run", "--scan", "--dropout", "0.2", "--checkpoint-every", "2")
    assert "blocks.block.attention.query" in out  # the plan names the stacked blocks
    straight_lines = records(out)
    assert straight_lines == records(looped_out)
    resumed, _, resumed_out = trained("run", "--scan", "--dropout", "0.2", "--resume-from", "4")
    assert_trees_equal(resumed, straight)
    assert records(resumed_out) == straight_lines[-1:] and rate == 0.2 and straight.dropout == 0.2
    assert isinstance(straight.blocks, Stacked)  # restored as trained: scanned
    undropped, _, _ = trained("none", "--scan")  # the same run at --dropout 0 ends elsewhere
    assert not np.array_equal(undropped.head.weight, straight.head.weight)
    resume = ["--steps", "6", "--checkpoint-dir", str(tmp_path / "run"), "--resume", "--depth", "2", "--scan"]
    assert main(["train", *TINY, *resume]) == 1
    assert "was saved under --dropout 0.2, this run --dropout 0.0," in capsys.readouterr().err
    sample = ["sample", "--prompt", "ROMEO:", "--tokens", "20", "--seed", "0"]  # sampling drops nothing
    texts = []
    for name in ("looped", "run"):
        assert main([*sample, "--checkpoint-dir", str(tmp_path / name)]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1]  # the scanned checkpoint unstacks into the looped GPT


@needs_shakespeare
@pytest.mark.slow  # a process of its own: imports JAX and TensorFlow
def test_ctrl_c_while_the_gpt_s_data_loads_exits_130_not_a_segfault():
    argv = [sys.executable, "-m", "minishard", "train", *TINY, "--steps", "2", "--warmup-steps", "1"]
    trainer = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert trainer.stdout is not None
    for line in trainer.stdout:  # the plan's last line: the data load (TensorFlow's import, its read) is next
        if line.startswith("total:"):
            break
    time.sleep(1.0)
    for _ in range(30):  # Python drops a Ctrl-C that lands in a garbage-collector callback: press again
        trainer.send_signal(signal.SIGINT)
        try:
            _, err = trainer.communicate(timeout=2)
            break
        except subprocess.TimeoutExpired:
            continue
    else:
        trainer.kill()
        pytest.fail("30 Ctrl-Cs, 2 s apart, did not stop the run")
    assert trainer.returncode == 130, (trainer.returncode, err[-2000:])
    assert err.strip().splitlines()[-1] == "interrupted", err


@needs_shakespeare
@pytest.mark.slow  # a process of its own, trained until its first checkpoint
def test_sigterm_mid_run_says_the_latest_checkpoint_as_ctrl_c_does_and_exits_143(tmp_path):
    """A scheduler's preemption: one line of its own, not XLA's C++ stack dump of the signal."""
    directory = tmp_path / "run"
    flags = ["--steps", "100000", "--checkpoint-dir", str(directory), "--checkpoint-every", "5"]
    argv = [sys.executable, "-m", "minishard", "train", *TINY, *flags]
    trainer = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not any(p.name.isdigit() for p in directory.glob("*")) and time.monotonic() < deadline:
        time.sleep(0.5)
    trainer.send_signal(signal.SIGTERM)
    _, err = trainer.communicate(timeout=120)
    latest = max(int(p.name) for p in directory.iterdir() if p.name.isdigit())
    assert trainer.returncode == 143, (trainer.returncode, err[-2000:])
    assert err.strip().splitlines()[-1] == (
        f"terminated (SIGTERM); the latest checkpoint is step {latest} in {directory}: continue with --resume"
    )
    assert "SIGTERM received" not in err and "Traceback" not in err


BAD_FLAGS = [
    (["--context", "60000"], "argument --context: 60000 characters and the next one do not fit"),
    (["--heads", "3"], "argument --heads: 3 heads must divide --width 128"),
    (["--parallel", "tp"], "argument --heads: 4 heads cannot split over model=8 devices"),
    (["--kv-heads", "3"], "argument --kv-heads: 3 must divide --heads 4 (each group of heads / kv-heads"),
    (
        ["--parallel", "2d", "--kv-heads", "2"],
        "argument --kv-heads: 2 key and value heads cannot split over model=4 devices (they split as the "
        "heads do); give a multiple of 4, or fewer --devices",
    ),
    (
        ["--mesh", "model=8", "--parallel", "dp"],  # not "4 heads cannot split over model=8"
        "argument --mesh: --parallel dp splits batch over 'data', and --mesh model=8 has no such axis; give "
        "its mesh (data=8), or a --parallel for these axes",
    ),
    (
        ["--mesh", "model=8"],
        "argument --mesh: --parallel dp (the gpt's default) splits batch over 'data', and --mesh model=8",
    ),
    (["--epochs", "2"], "argument --epochs: the GPT trains by steps; give --steps"),
    (["--schedule", "exponential"], "argument --schedule: the GPT's AdamW warms up, then follows a cosine"),
    (["--dataset", "mnist"], "argument --dataset: the GPT trains on tiny_shakespeare, not mnist"),
    (["--momentum", "0.9"], "argument --momentum: only the MLP and the ViT take it, and --model is gpt"),
    (["--batch-size", "13"], "argument --batch-size: 13 cannot be split evenly over data=2 devices"),
    (["--parallel", "dp+pp", "--depth", "3"], "argument --depth: 3 blocks cannot split over 4 stages"),
    (["--weight-decay", "1.5"], "argument --weight-decay: must be a finite number in [0, 1), got 1.5"),
    (["--dropout", "1"], "argument --dropout: must be a finite number in [0, 1), got 1"),
    (["--dropout", "-0.1"], "argument --dropout: must be a finite number in [0, 1), got -0.1"),
    (
        ["--dropout", "0.2", "--parallel", "zero"],
        "argument --dropout: 0.2 with --parallel zero, which runs a step of its own that draws no masks; "
        "give dp, fsdp, tp, 2d or tp+sp",
    ),
    (
        ["--dropout", "0.2", "--parallel", "dp+pp"],
        "argument --dropout: 0.2 with --parallel dp+pp, which runs",
    ),
    (
        ["--dropout", "0.2", "--parallel", "dp+cp"],
        "argument --dropout: 0.2 with --parallel dp+cp: ring attention never holds the attention weights to "
        "drop; give a style without cp",
    ),
    (
        ["--dropout", "0.2", "--attention", "flash"],
        "argument --dropout: 0.2 with --attention flash, whose kernel never forms the attention weights to "
        "drop; give --attention dense (auto picks it with --dropout)",
    ),
    (
        ["--dropout", "0.2", "--microbatches", "2"],
        "argument --dropout: 0.2 with --parallel dp and --microbatches 2: masks are drawn per batch; give 1",
    ),
    (
        ["--attention", "flash", "--context", "600"],
        "argument --attention: flash tiles --context into blocks of 512 tokens (a shorter one whole); 600 "
        "is not a multiple of 512: give a --context that is a multiple of 512, or at most 512",
    ),
    (  # under cp the kernels attend each pair of the ring's chunks: 2 devices, 2 zig-zag chunks each
        ["--attention", "flash", "--parallel", "cp", "--devices", "2", "--context", "2560"],
        "argument --attention: flash tiles each of the ring's 4 chunks (640 tokens) into blocks of 512 "
        "tokens (a shorter one whole); 640 is not a multiple of 512: give a --context that is a multiple of "
        "2048, or at most 2048",
    ),
    (
        ["--steps", "50", "--warmup-steps", "50"],
        "argument --warmup-steps: 50 warmup steps do not end within --steps 50 (the learning rate would only "
        "rise); give fewer than 50",
    ),
]


@pytest.mark.parametrize(("flags", "message"), BAD_FLAGS, ids=[" ".join(f) for f, _ in BAD_FLAGS])
def test_bad_gpt_flags_are_one_line_before_any_work(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--model", "gpt", *flags])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err, err
    assert err.strip().splitlines()[-1].startswith("minishard train: error:")


def test_microbatches_that_make_the_default_batch_far_larger_are_refused_naming_both_flags(capsys):
    """lcm(2 devices, 2 x M microbatches): the default batch grows with M; up to 8x the 16 it is taken."""
    most = DERIVED_BATCH_LIMIT * 16 // 2  # microbatches of one window per device: 64, a batch of 128
    assert parse_args(["train", "--model", "gpt", "--microbatches", str(most)]).batch_size == 2 * most
    given = parse_args(["train", "--model", "gpt", "--microbatches", "1000000", "--batch-size", "2000000"])
    assert given.batch_size == 2_000_000  # asked for: the user's to give
    for microbatches in (most + 1, 1_000_000):
        with pytest.raises(SystemExit) as exit_:
            main(["train", "--model", "gpt", "--microbatches", str(microbatches)])
        batch = math.lcm(2, 2 * microbatches)
        assert exit_.value.code == 2
        assert capsys.readouterr().err.strip().splitlines()[-1] == (
            f"minishard train: error: argument --microbatches: {microbatches} microbatches make the default "
            f"batch {batch:,} windows, {batch / 16:,.0f}x the 16 without them (at most 8x); give fewer "
            "--microbatches, or --batch-size"
        )


def test_a_cut_warmup_is_said_first_and_a_rule_no_array_carries_is_refused(capsys):
    sequence = ["--mesh", "data=2,context=4", "--rules", "batch=data,sequence=context"]
    assert main(["train", *TINY, "--steps", "4", *sequence]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "note: the default --warmup-steps 100 does not fit in --steps 4: warming up for 3 (every step but "
        "the last); give --warmup-steps below 4 for a cosine after the warmup",
        "error: argument --rules: no array of the gpt carries the logical axis 'sequence' (did you mean "
        "'seq'?); its logical axes are batch, embed, heads, kv, mlp, seq, vocab",
    ]


def test_the_gpt_defaults_are_nanogpts_cpu_configuration_at_its_own_lr_on_2_devices_batch_near_16():
    args = parse_args(["train", "--model", "gpt"])
    shape = (args.depth, args.heads, args.width, args.context, args.mlp_ratio, args.weight_decay)
    assert shape == (4, 4, 128, 64, 4, 0.1) and (args.lr, args.warmup_steps, args.schedule) == (
        3e-3,
        100,
        "cosine",
    )
    assert (args.steps, args.eval_every, args.epochs, args.dataset) == (2000, 250, None, "tiny_shakespeare")
    assert (args.parallel, args.devices, args.mesh, args.batch_size) == ("dp", 2, {"data": 2}, 16)
    assert parse_args(["train", "--model", "gpt", "--parallel", "dp"]).devices == 2  # its own style, named
    assert parse_args(["train", "--model", "gpt", "--devices", "8"]).mesh == {"data": 8}  # the same batch
    assert parse_args(["train", "--model", "gpt", "--devices", "8"]).batch_size == 16
    two_d = parse_args(["train", "--model", "gpt", "--parallel", "2d"])  # another style: 8 devices
    assert (two_d.devices, two_d.batch_size) == (8, 16)
    assert parse_args(["train", "--model", "gpt", "--mesh", "data=4"]).devices == 8  # --mesh: not its run
    assert parse_args(["train", "--model", "gpt", "--parallel", "dp+tp+cp"]).batch_size == 16
    assert parse_args(["train", "--model", "gpt", "--devices", "6"]).batch_size == 18  # data=6: 18 is nearest
    assert parse_args(["train", "--model", "gpt", "--devices", "3"]).batch_size == 15
    assert parse_args(["train", "--model", "mlp"]).devices == 8  # the others' default
    piped = parse_args(["train", "--model", "gpt", "--parallel", "dp+pp"])  # 8 microbatches of 2 rows
    assert (piped.depth, piped.microbatches, piped.batch_size) == (4, 8, 16)
    rate = ms.warmup_cosine_decay(3e-3, 100, 2000, end_value=3e-4)  # a warmup, then a cosine to lr / 10
    optimizer = GPT_ENTRY.optimizer(args, 2000)
    steps = np.array([0, 50, 100, 1000, 2000])
    assert np.allclose([optimizer.learning_rate(s) for s in steps], [rate(s) for s in steps])
    assert float(optimizer.learning_rate(2000)) == pytest.approx(3e-4)


@pytest.mark.slow  # over 5 s
def test_sample_continues_a_prompt_from_a_checkpoint_the_same_for_the_same_seed(tmp_path, capsys):
    settings = {"width": 16, "depth": 2, "heads": 2, "mlp_ratio": 2, "context": 8, "remat": "none"}
    vocabulary, directory = SHAKESPEARE, str(tmp_path / "run")
    model = jax.jit(lambda key: GPT(65, 8, 16, 2, 2, 2, key=key))(jax.random.key(3))  # one compile, not many
    info = {"model": "gpt", "dataset": "tiny_shakespeare", "parallel": "dp", "vocabulary": vocabulary}
    with Checkpointer(directory) as checkpointer:  # what train saves (a GPT, AdamW's state, its settings)
        state = {
            "model": model,
            "opt_state": GPT_ENTRY.compiled_optimizer(parse_args(["train", "--model", "gpt"])).init(model),
        }
        checkpointer.save(5, state, {"info": info | {"flags": settings | {"weight_decay": 0.1}}})
    texts = []
    for seed in ("0", "0", "1"):
        assert (
            main(
                [
                    "sample",
                    "--checkpoint-dir",
                    directory,
                    "--prompt",
                    "ROMEO:",
                    "--tokens",
                    "20",
                    "--seed",
                    seed,
                ]
            )
            == 0
        )
        texts.append(capsys.readouterr().out.rstrip("\n"))
    assert (
        texts[0].startswith("ROMEO:")
        and len(texts[0]) == len("ROMEO:") + 20
        and set(texts[0]) <= set(vocabulary)
    )
    assert texts[0] == texts[1] and texts[0] != texts[2]  # the same seed, the same text
    oracle = sample(model, Vocabulary(vocabulary), "ROMEO:", 20, temperature=0.8, seed=0, stream=stream)
    assert texts[0] == oracle  # the saved numbers, restored
    # a billion characters stream: the first ones come as they are drawn, the same as a short run's
    endless = continuation(
        model, Vocabulary(vocabulary), "ROMEO:", 10**9, temperature=0.8, seed=0, stream=stream
    )
    assert "".join(itertools.islice(endless, 20)) == oracle[len("ROMEO:") :]


def test_sample_refuses_a_prompt_outside_the_vocabulary_in_one_line(tmp_path, capsys):
    directory = tmp_path / "run"
    with Checkpointer(directory) as checkpointer:  # what train saves, without the training
        info = {"model": "gpt", "dataset": "tiny_shakespeare", "parallel": "dp", "vocabulary": "\n !ABab"}
        checkpointer.save(1, {"w": jax.numpy.ones(2)}, {"info": info})
    cases = [
        (["--prompt", "AbZ"], "argument --prompt: the character 'Z' (at 2) is not in the vocabulary"),
        (["--prompt", ""], "argument --prompt: it is empty"),
        (["--step", "7"], "has no checkpoint for step 7; it has [1]"),
    ]
    for flags, message in cases:
        with pytest.raises(SystemExit) as exit_:
            main(["sample", "--checkpoint-dir", str(directory), *flags])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and message in err, err
        assert err.strip().splitlines()[-1].startswith("minishard sample: error:")
    with pytest.raises(SystemExit):
        main(["sample", "--checkpoint-dir", str(tmp_path / "nothing")])
    assert "is not a directory" in capsys.readouterr().err


def test_sample_refuses_a_zero_checkpoint_in_one_line_as_docs_gpt_md_says(tmp_path, capsys):
    info = {"model": "gpt", "dataset": "tiny_shakespeare", "parallel": "zero", "vocabulary": "\n !ABab"}
    with Checkpointer(tmp_path) as checkpointer:  # what train saves under zero, without the training
        checkpointer.save(3, {"w": jax.numpy.ones(2)}, {"info": info})
    with pytest.raises(SystemExit) as exit_:
        main(["sample", "--checkpoint-dir", str(tmp_path), "--prompt", "Ab"])
    out, err = capsys.readouterr()
    assert exit_.value.code == 2 and out == "", err
    assert err.strip().splitlines()[-1] == (
        f"minishard sample: error: argument --checkpoint-dir: step 3 in {tmp_path} was trained under zero, "
        "whose optimizer state is flat shards of the devices it ran on; sample reads the other styles' "
        "checkpoints"
    )


def _flags_only_checkpoint(directory, flags):
    """A GPT's checkpoint metadata (its flags), without the training: what ``sample``'s checks read."""
    info = {"model": "gpt", "dataset": "tiny_shakespeare", "parallel": "dp", "vocabulary": "\n !ABab"}
    with Checkpointer(directory) as checkpointer:
        checkpointer.save(3, {"w": jax.numpy.ones(2)}, {"info": info | {"flags": flags}})
    return ["sample", "--checkpoint-dir", str(directory), "--prompt", "Ab"]


@pytest.mark.parametrize(
    ("parallel", "flags", "line", "fits"),
    [
        ("tp", {"heads": 8, "kv_heads": 2}, "tp splits 2 key and value heads over 8 devices: uneven", 2),
        ("tp", {}, "tp splits 4 heads over 8 devices: uneven", 4),  # the default GPT's 4 heads
        ("cp", {"context": 12}, "cp splits the cache's 12 positions over 8 context devices: uneven", 6),
        ("dp+cp", {"context": 6}, "dp+cp splits the cache's 6 positions over 4 context devices: uneven", 3),
    ],
)
def test_sample_refuses_a_style_that_cannot_split_the_cache_naming_the_devices_that_can(
    tmp_path, capsys, parallel, flags, line, fits
):
    """The way out: the most of the first devices that split it and the batch (dp+cp on 6: data=2 would
    not split 1 sequence), as train and explain take the first N."""
    sample_ = [*_flags_only_checkpoint(tmp_path, flags), "--parallel", parallel]
    with pytest.raises(SystemExit) as exit_:
        main(sample_)
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"minishard sample: error: argument --parallel: {line}; give --devices {fits} (the first {fits} "
        "decode it)"
    )
    assert parse_args([*sample_, "--devices", str(fits)]).decode_devices == jax.devices()[:fits]
    for more in range(fits + 1, 8):  # none between it and all 8 would do
        with pytest.raises(SystemExit):
            parse_args([*sample_, "--devices", str(more)])
    capsys.readouterr()


@pytest.mark.parametrize(
    ("flags", "line"),
    [
        (["--batch", "100000"], "argument --batch: 100,000 continuations print only once all are drawn, "
         "each step 100,000 characters (minutes of silence); give at most 1,024"),
        (["--devices", "4"], "argument --devices: only with --parallel (without it, one device decodes)"),
        (["--parallel", "dp", "--devices", "9"], "argument --devices: 9 asked, there are 8"),
    ],
)  # fmt: skip
def test_sample_refuses_a_batch_that_would_print_nothing_for_minutes_and_devices_it_cannot_use(
    tmp_path, capsys, flags, line
):
    with pytest.raises(SystemExit) as exit_:
        main([*_flags_only_checkpoint(tmp_path, {}), *flags])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"minishard sample: error: {line}"
    assert parse_args([*_flags_only_checkpoint(tmp_path, {}), "--batch", str(MOST_BATCH)]).batch == MOST_BATCH


@pytest.mark.parametrize("broken", ["meta missing", "meta half-written", "meta changed", "an empty step"])
def test_sample_on_a_broken_latest_step_falls_back_in_one_line(tmp_path, capsys, broken):
    info = {"model": "gpt", "dataset": "tiny_shakespeare", "parallel": "dp", "vocabulary": "\n !ABab"}
    with Checkpointer(tmp_path) as checkpointer:  # what train saves, without the training
        for step in (1, 2):
            checkpointer.save(step, {"w": jax.numpy.ones(2)}, {"info": info})
    meta = tmp_path / "2" / "meta" / "metadata"
    if broken == "meta missing":
        meta.unlink()
    elif broken == "meta half-written":
        meta.write_text(meta.read_text()[:20])
    elif broken == "meta changed":
        meta.write_text(meta.read_text().replace("ABab", "BAab"))
    else:
        (tmp_path / "2").rename(tmp_path / "old")
        (tmp_path / "2").mkdir()  # orbax still lists it
    args = parse_args(["sample", "--checkpoint-dir", str(tmp_path), "--prompt", "Ab"])
    out, err = capsys.readouterr()
    assert args.step == 1 and args.info == info and out == ""
    assert len(err.splitlines()) == 1 and err.startswith(f"checkpoint {tmp_path / '2'} is "), err
    assert err.rstrip().endswith("falling back to step 1")


def test_a_pipelines_stacked_gpt_unstacks_to_the_same_gpt():
    def build(key):
        return GPT(vocab=7, context=8, width=8, depth=3, heads=2, key=key)

    model = jax.jit(build)(jax.random.key(0))
    unstacked = jax.jit(lambda m: unstack(as_stacked(m), jax.eval_shape(build, jax.random.key(1))))(model)
    assert_trees_equal(unstacked, model)


@pytest.mark.slow  # compiles the default GPT's step on 8 devices
def test_explain_prices_the_gpt_step_at_six_n_tokens_plus_attention(capsys):
    """The scaling book's transformer chapter: a training step costs 6 N FLOPs per token for the
    matmuls of its N parameters (2 forward, 4 backward) plus 12 L T D for attention (QK^T and AV)."""
    assert main(["explain", "--model", "gpt", "--parallel", "dp", "--hardware", "h100"]) == 0
    out = capsys.readouterr().out
    flops = float(re.search(r"compute .* ([\d.e+]+) FLOP at", out)[1])  # per device
    model = jax.eval_shape(lambda: GPT(key=jax.random.key(0)))
    n, (layers, context, width) = ms.tree.count_params(model), (4, 64, 128)
    tokens = 16 // 8 * context  # a batch of 16 windows over 8 devices
    formula = 6 * n * tokens + 12 * layers * context * width * tokens
    assert flops == pytest.approx(formula, rel=0.05), (flops, formula)
    moments = re.search(r"per device: parameters (.+?), gradients \1, AdamW mu \1, AdamW nu \1;", out)
    assert moments and moments[1] == "3.3 MB"  # dp: every device holds all of each


@needs_shakespeare
@pytest.mark.slow  # a tiny GPT's five steps, three of them traced
def test_profile_traces_the_chosen_steps_and_the_mfu_is_the_model_flops_over_the_step_time(
    tmp_path, capsys, monkeypatch
):
    import gzip

    from minishard.costs import model_flops
    from minishard.run.next_token import next_token_loss

    flush, stop_trace = 2.0, jax.profiler.stop_trace

    def slow_stop_trace():  # a trace written to a slow disk: 22 s of a period here, once
        stop_trace()
        time.sleep(flush)

    monkeypatch.setattr(jax.profiler, "stop_trace", slow_stop_trace)
    trace, log = tmp_path / "trace", tmp_path / "metrics.jsonl"
    assert main(["train", *TINY, "--steps", "5", "--profile", str(trace), "--log", str(log)]) == 0
    out = capsys.readouterr().out
    assert f"Wrote a trace of steps 2-4 to {trace}" in out
    (written,) = trace.glob("plugins/profile/*/*.trace.json.gz")  # TensorBoard's layout; Perfetto opens it
    events = json.loads(gzip.decompress(written.read_bytes()))["traceEvents"]
    assert sorted(int(e["args"]["step_num"]) for e in events if e.get("name") == "train") == [2, 3, 4]
    assert any(e.get("name") == "PjitFunction(train_step)" for e in events)  # the step itself, inside them

    (record,) = [json.loads(line) for line in log.read_text().splitlines() if "seconds" in line]
    speed = record["speed"]
    assert speed["mfu"] == pytest.approx(speed["step_flops"] / speed["step_s"] / speed["peak_flops"])
    assert speed["tokens_per_s"] == pytest.approx(16 * 16 / speed["step_s"])  # batch 16 x context 16
    gpt = GPT(65, 16, 16, 1, 2, 4, key=jax.random.key(0))
    window = jax.ShapeDtypeStruct((16, 16), np.int32)
    assert speed["step_flops"] == model_flops(next_token_loss, gpt, {"inputs": window, "targets": window})
    assert speed["step_s"] < flush / 4  # the 4 timed steps' mean: the flush is none of theirs
    assert record["trace_seconds"] >= flush  # said apart (with the real start and flush), out of "seconds"
    line = next(line for line in out.splitlines() if line.startswith("Step 5 "))
    tokens = f"{speed['tokens_per_s']:,.0f} tokens/s"
    writing = f"{record['trace_seconds']:.2f} s writing the --profile trace"
    assert re.search(rf" s \({tokens}, MFU [\d.e-]+%\) \(\+{writing}\) · loss", line), line


@needs_shakespeare
@pytest.mark.slow  # a tiny GPT's three steps
def test_under_remat_each_line_gives_the_hfu_of_the_flops_the_step_runs(tmp_path, capsys):
    from minishard.remat import step_flops
    from minishard.run.next_token import next_token_loss

    log = tmp_path / "metrics.jsonl"
    assert main(["train", *TINY, "--steps", "3", "--remat", "full", "--log", str(log)]) == 0
    out = capsys.readouterr().out
    speed = [json.loads(line) for line in log.read_text().splitlines() if "seconds" in line][-1]["speed"]
    gpt = GPT(65, 16, 16, 1, 2, 4, key=jax.random.key(0), remat="full")
    window = jax.ShapeDtypeStruct((16, 16), np.int32)
    flops = step_flops(next_token_loss, gpt, {"inputs": window, "targets": window})
    assert speed["hfu"] / speed["mfu"] == pytest.approx(flops.hardware / flops.model)  # > 1: recomputed
    assert flops.hardware > flops.model
    assert f", {flops.hardware / 1e9:.3g} G run (" in out  # the Model FLOPs line says both
    line = next(line for line in out.splitlines() if line.startswith("Step 3 "))
    assert re.search(r"MFU [\d.e-]+%, HFU [\d.e-]+%\) · loss", line), line


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--steps", "3", "--profile-steps", "2:5"], "argument --profile-steps: 2:5 is not a range"),
        (["--steps", "9", "--profile-steps", "4:2"], "argument --profile-steps: 4:2 is not a range"),
        (["--steps", "9", "--profile-steps", "two"], "expected FIRST:LAST step numbers"),
        (  # argparse alone took "-1:3" for a flag: "expected one argument"
            ["--steps", "9", "--profile-steps", "-1:3"],
            "argument --profile-steps: -1:3 is not a range (FIRST:LAST, FIRST <= LAST) of the run's "
            "steps 1..9",
        ),
        (
            ["--steps", "9", "--profile-steps", "2:3:4"],
            "expected FIRST:LAST step numbers (e.g. 2:4), got '2:3:4'",
        ),
    ],
)
def test_profile_refuses_steps_outside_the_run_in_one_line(tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as exit_:
        main(["train", *TINY, "--profile", str(tmp_path / "trace"), *flags])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err, err


def test_profile_refuses_a_directory_it_cannot_create_before_any_data_loads(tmp_path, capsys, monkeypatch):
    (tmp_path / "file").write_text("not a directory")
    monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path / "no-data-here"))  # refused before the data is read
    with pytest.raises(SystemExit) as exit_:
        main(["train", *TINY, "--steps", "5", "--profile", str(tmp_path / "file" / "trace")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "argument --profile: cannot create" in err, err


@pytest.mark.slow  # over 5 s
def test_sample_sharded_prints_the_same_texts_as_on_one_device_row_b_as_seed_b(tmp_path, capsys):
    settings = {"width": 16, "depth": 2, "heads": 8, "mlp_ratio": 2, "context": 8, "remat": "none"}
    directory = str(tmp_path / "run")
    model = jax.jit(lambda key: GPT(65, 8, 16, 2, 8, 2, key=key))(jax.random.key(3))
    info = {"model": "gpt", "dataset": "tiny_shakespeare", "parallel": "dp", "vocabulary": SHAKESPEARE}
    with Checkpointer(directory) as checkpointer:
        state = {
            "model": model,
            "opt_state": GPT_ENTRY.compiled_optimizer(parse_args(["train", "--model", "gpt"])).init(model),
        }
        checkpointer.save(5, state, {"info": info | {"flags": settings | {"weight_decay": 0.1}}})
    flags = ["sample", "--checkpoint-dir", directory, "--prompt", "ROMEO:", "--tokens", "12", "--seed", "4"]
    texts = {}
    # 2d splits the rows over "data" and the heads over "model" (dp's and tp's cache splits at once;
    # dp and tp alone decoded here too, each compiling its own prefill and decode, and could fail only
    # with 2d); cp: the 8 positions of the cache, one per device; dp+cp: rows and positions at once.
    styles = ("2d", "cp", "dp+cp")
    for parallel in ("none", *styles):  # 12 tokens past a context of 8: the restart too
        assert main([*flags, "--parallel", parallel, "--batch", "8"]) == 0
        texts[parallel] = capsys.readouterr().out
    assert all(texts[style] == texts["none"] for style in styles), [
        s for s in styles if texts[s] != texts["none"]
    ]
    rows = dict(chunk.split("\n", 1) for chunk in texts["none"].split("--- seed ")[1:])  # text has "\n"s
    assert list(rows) == [str(seed) for seed in range(4, 12)]
    assert len(set(rows.values())) == 8 and all(len(text) == len("ROMEO:") + 12 + 1 for text in rows.values())
    assert main([*flags[:-1], "7"]) == 0  # one sequence, on one device, by gpt.stream: row 3's text
    assert capsys.readouterr().out == rows["7"]
    for bad, line in [
        (
            ["--parallel", "dp", "--batch", "3"],
            "argument --batch: 3 sequences must split evenly over 8 data devices",
        ),
        (
            ["--parallel", "dp+cp", "--batch", "3"],
            "argument --batch: 3 sequences must split evenly over 2 data devices",
        ),
    ]:
        with pytest.raises(SystemExit):
            main([*flags, *bad])
        assert capsys.readouterr().err.strip().splitlines()[-1] == f"minishard sample: error: {line}"


def test_the_flash_kernel_asked_for_off_a_tpu_is_one_error_line(capsys):
    assert main(["train", *TINY, "--steps", "1", "--attention", "flash"]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: argument --attention: flash runs its Pallas kernel on a TPU, and this backend is cpu; use "
        "dense here (auto picks it)"
    )


@pytest.mark.parametrize(("backend", "context", "core"), [("cpu", 2048, "dense"), ("tpu", 256, "dense"),
                                                         ("tpu", FLASH_FROM, "flash")])  # fmt: skip
def test_auto_attention_picks_the_kernel_on_a_tpu_from_flash_from_tokens_and_says_so(
    backend, context, core, monkeypatch, capsys
):
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    args = argparse.Namespace(attention="auto", context=context)
    assert gpt_entry._attention_core(args) == core == args.attention
    assert capsys.readouterr().err == (
        f"note: --attention auto: {core} (a context of {context} on {backend}; the kernel from "
        f"{FLASH_FROM} tokens on a TPU)\n"
    )
    assert gpt_entry._attention_core(args) == core and capsys.readouterr().err == ""  # decided: said once


def test_auto_attention_picks_the_dense_core_on_a_tpu_with_dropout_and_says_why(monkeypatch, capsys):
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    args = argparse.Namespace(attention="auto", context=FLASH_FROM, dropout=0.2)  # the kernel's length
    assert gpt_entry._attention_core(args) == "dense" == args.attention  # flash never forms the weights
    assert capsys.readouterr().err == (
        f"note: --attention auto: dense (a context of {FLASH_FROM} on tpu; the kernel from {FLASH_FROM} "
        "tokens on a TPU, without --dropout)\n"
    )
