"""minishard.run.cli.models and .styles: a new model, or a style with a step of its own, is one entry.

``TOY`` is registered here as the GPT's entry will be (issue 24), without editing ``fit`` or the flag
checker: its own flags, batches drawn per step (random windows of a text: no epochs), a loss with no
accuracy (``val loss`` every evaluation, ``test loss`` after the last step), its own optimizer (a
hand-written Adam, not SGD) and its vocabulary saved with every checkpoint. ``Halves`` is a style
that brings its own step.
"""

from __future__ import annotations

import json
import re
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from strategies import assert_trees_equal

import minishard as ms
from minishard.run.checkpoint import Checkpointer
from minishard.run.cli import main, parse_args
from minishard.run.cli.flags import Flag, at_least
from minishard.run.cli.models import MODELS
from minishard.run.cli.models.entry import ModelEntry, Splits
from minishard.run.cli.styles import STYLES
from minishard.run.cli.styles.style import Style
from minishard.run.steps import Task, make_train_step

TEXT = "the quick brown fox jumps over the lazy dog; " * 40
VOCABULARY = "".join(sorted(set(TEXT)))
IDS = np.asarray([VOCABULARY.index(c) for c in TEXT], np.int32)


class Windows:
    """``context + 1`` characters at random places, drawn from ``(seed, step)``: a language model's batches.

    As evaluation data (``epoch``), a fixed set of windows, the same at every evaluation.
    """

    steps_per_epoch = None

    def __init__(self, ids: np.ndarray, batch_size: int, context: int, seed: int) -> None:
        self.ids, self.batch_size, self.context, self.seed = ids, batch_size, context, seed

    def _windows(self, key: list[int]) -> dict[str, np.ndarray]:
        starts = np.random.default_rng(key).integers(0, len(self.ids) - self.context, self.batch_size)
        windows = self.ids[starts[:, None] + np.arange(self.context + 1)]
        return {"tokens": windows[:, :-1], "next": windows[:, -1]}

    def batches(self, start: int, stop: int):
        for step in range(start, stop):
            yield self._windows([self.seed, step])

    def epoch(self, epoch: int, start_batch: int = 0):
        for index in range(start_batch, 2):  # two fixed batches
            yield {**self._windows([self.seed, 10**9 + index]), "mask": np.ones(self.batch_size, np.float32)}

    @property
    def data_order(self) -> dict[str, Any]:
        return {"seed": self.seed, "batch_size": self.batch_size, "context": self.context}


def next_character_loss(model, batch):
    logits = model(jax.nn.one_hot(batch["tokens"], len(VOCABULARY)).reshape(len(batch["tokens"]), -1))
    return ms.cross_entropy(logits, jax.nn.one_hot(batch["next"], len(VOCABULARY))), ()  # no accuracy


def next_character_sums(model, batch):
    logits = model(jax.nn.one_hot(batch["tokens"], len(VOCABULARY)).reshape(len(batch["tokens"]), -1))
    losses = -jnp.take_along_axis(jax.nn.log_softmax(logits), batch["next"][:, None], axis=1)[:, 0]
    return {"loss": (losses * batch["mask"]).sum(), "count": batch["mask"].sum()}


class AdamState(NamedTuple):
    count: jax.Array
    mu: Any
    nu: Any


class Adam:
    """Adam as two pure functions, as ``optim.AdamW`` will be: any optimizer with init/update trains."""

    def __init__(self, learning_rate, b1: float = 0.9, b2: float = 0.99) -> None:
        self.learning_rate, self.b1, self.b2 = learning_rate, b1, b2

    def init(self, params):  # two trees of zeros: the step donates its state, so no array may be in it twice
        return AdamState(jnp.zeros((), jnp.int32), *(jax.tree.map(jnp.zeros_like, params) for _ in "mv"))

    def update(self, params, grads, state):
        count, lr = state.count + 1, self.learning_rate(state.count)
        mu = jax.tree.map(lambda m, g: self.b1 * m + (1 - self.b1) * g, state.mu, grads)
        nu = jax.tree.map(lambda v, g: self.b2 * v + (1 - self.b2) * g * g, state.nu, grads)
        fix1, fix2 = 1 - self.b1**count, 1 - self.b2**count
        params = jax.tree.map(
            lambda p, m, v: p - lr * (m / fix1) / (jnp.sqrt(v / fix2) + 1e-8), params, mu, nu
        )
        return params, AdamState(count, mu, nu)


def toy_splits(args) -> Splits:
    cut = len(IDS) * 8 // 10
    train, held_out = IDS[:cut], IDS[cut:]
    windows = {"batch_size": args.batch_size, "context": args.context}
    return Splits(
        Windows(train, seed=args.seed, **windows),
        {"val": Windows(held_out, seed=1, **windows)},
        Windows(held_out, seed=2, **windows),  # named "test": evaluated once, after the last step
        info={"vocabulary": VOCABULARY},  # what sampling needs, without the data
    )


TOY = ModelEntry(
    name="toy",
    label="Toy",
    help="a character model of a toy text",
    flags={
        "context": Flag("characters of context", type=at_least(1)),
        "hidden": Flag("hidden units", type=at_least(1)),
    },
    defaults={"context": 4, "hidden": 32, "steps": 12, "eval_every": 4, "batch_size": 16, "lr": 0.01},
    datasets=("toy_text",),
    style="dp",
    task=Task(next_character_loss, (), next_character_sums),
    build=lambda args, key: ms.mlp(
        [args.context * len(VOCABULARY), args.hidden, len(VOCABULARY)], key=key, axes=ms.megatron_axes(2)
    ),
    data=toy_splits,
    optimizer=lambda args, total: Adam(ms.warmup_cosine_decay(args.lr, 2, total)),
    example=lambda args, size: {
        "tokens": jax.ShapeDtypeStruct((size, args.context), jnp.int32),
        "next": jax.ShapeDtypeStruct((size,), jnp.int32),
    },
)


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(MODELS, "toy", TOY)


def step_lines(output: str) -> list[str]:
    """The record lines, without their (machine-dependent) durations."""
    return [
        re.sub(r" in [\d.]+ s( \([^)]*\))?", "", line)
        for line in output.splitlines()
        if line.startswith("Step ")
    ]


@pytest.mark.slow  # two short trainings through the command line: ~15 s here
def test_a_registered_model_trains_by_steps_with_its_own_task_optimizer_and_data(toy, tmp_path, capsys):
    log, plot, directory = tmp_path / "metrics.jsonl", tmp_path / "curves.png", tmp_path / "ckpt"
    toy_run = [
        "train",
        "--model",
        "toy",
        "--checkpoint-dir",
        str(directory),
        "--checkpoint-every",
        "2",
        "--keep",
        "6",
    ]
    assert main([*toy_run, "--log", str(log), "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    lines = step_lines(out)
    assert [line.split(" · ")[0] for line in lines] == ["Step 4", "Step 8", "Step 12"]  # --eval-every 4
    assert all(re.search(r" · val loss \d+\.\d+", line) for line in lines) and " acc " not in out
    assert re.search(r" · test loss \d+\.\d+$", lines[-1]) and "test loss" not in lines[0]
    val = [float(re.search(r"val loss ([\d.]+)", line)[1]) for line in lines]
    assert val[-1] < val[0] < np.log(len(VOCABULARY)) + 0.5, val  # it learns
    records = [json.loads(line) for line in log.read_text().splitlines() if "seconds" in json.loads(line)]
    assert sorted(records[-1]) == [
        "loss",
        "loss_curve",
        "seconds",
        "speed",
        "step",
        "steps",
        "test_loss",
        "val_loss",
    ]
    assert plot.read_bytes()[:4] == b"\x89PNG"
    with Checkpointer(directory, read_only=True) as ckpt:
        step, meta = ckpt.read_meta()
    flags = {"context": 4, "hidden": 32}
    assert step == 12 and meta["info"] == {
        "model": "toy",
        "dataset": "toy_text",
        "flags": flags,
        "parallel": "dp",
        "precision": "fp32",  # what a resume under another --precision is refused by name for
        "vocabulary": VOCABULARY,
        # the learning-rate flags a resume must repeat: the task's own optimizer, none of them given
        "schedule": {
            "--lr": 0.01,
            "--schedule": None,
            "--decay-rate": None,
            "--decay-steps": None,
            "--staircase": None,
        },
    }
    # Back to step 6, as if the run had stopped there: the batches of a straight run, the same parameters.
    straight = restored(directory)
    assert main([*toy_run, "--resume-from", "6"]) == 0
    resumed = capsys.readouterr().out
    assert "Resumed from step 6\nThe checkpoints of steps 8, 10, 12 come after it" in resumed
    assert step_lines(resumed)[-1] == lines[-1]
    assert_trees_equal(restored(directory), straight)


def restored(directory):
    """The model and Adam state of the latest checkpoint in ``directory``."""
    args = parse_args(["train", "--model", "toy"])
    model = TOY.build(args, jax.random.key(0))
    with Checkpointer(directory, read_only=True) as ckpt:
        return ckpt.restore({"model": model, "opt_state": Adam(0.1).init(model)})[1]


TOY_FLAGS = ["--model", "toy"]
BAD_FLAGS = [
    (
        ["--context", "3"],
        "argument --context: only the GPT and the Toy take it, and --model is mlp; add --model gpt",
    ),
    ([*TOY_FLAGS, "--layers", "4,2"], "argument --layers: only the MLP takes it, and --model is toy"),
    (
        [*TOY_FLAGS, "--momentum", "0.5"],
        "argument --momentum: only the MLP and the ViT take it, and --model is toy",
    ),
    ([*TOY_FLAGS, "--dataset", "mnist"], "argument --dataset: the Toy trains on toy_text, not mnist"),
    ([*TOY_FLAGS, "--epochs", "2"], "argument --epochs: the Toy trains by steps; give --steps"),
    ([*TOY_FLAGS, "--parallel", "pp"], "argument --parallel: the Toy has no blocks to stack on 'stage'"),
    ([*TOY_FLAGS, "--batch-size", "12"], "argument --batch-size: 12 cannot be split evenly over data=8"),
    (["--steps", "10", "--epochs", "2"], "argument --steps: give --epochs or --steps, not both"),
    (["--eval-every", "5"], "argument --eval-every: only with --steps (by epochs, every epoch is evaluated)"),
]


@pytest.mark.parametrize(("flags", "message"), BAD_FLAGS, ids=[" ".join(f) for f, _ in BAD_FLAGS])
def test_a_registered_models_flags_are_checked_with_the_others_before_any_work(flags, message, toy, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["train", *flags])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err, err
    assert err.strip().splitlines()[-1].startswith("minishard train: error:")


def test_a_registered_model_gets_its_defaults_style_and_help(toy, capsys):
    args = parse_args(["train", "--model", "toy"])
    assert (args.parallel, args.mesh, args.steps, args.eval_every, args.epochs) == (
        "dp",
        {"data": 8},
        12,
        4,
        None,
    )
    assert (args.context, args.dataset, args.layers, args.momentum) == (4, "toy_text", None, None)
    assert parse_args(["train", "--model", "toy", "--steps", "6"]).eval_every == 4
    assert (
        parse_args(["train", "--steps", "6"]).eval_every is None
    )  # the MLP by steps: one evaluation, at the end
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    help = " ".join(capsys.readouterr().out.split())
    assert "--context CONTEXT GPT, Toy: characters each prediction sees (its learned positions) " \
        "(default: gpt 64, toy 4)" in help  # fmt: skip
    assert "--lr LR initial (or peak) learning rate (default: mlp 0.2, vit 0.1, gpt 0.003, toy 0.01)" in help


def test_explain_plans_a_registered_model(toy, capsys):
    assert main(["explain", "--model", "toy"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("toy under dp on 8 devices") and f"({4 * len(VOCABULARY)}, 32)" in out


class Halves(Style):
    """A made-up style with a step of its own: dp's mesh and rules, every batch in two halves."""

    def finish(self, args, error):
        if args.microbatches:
            error("argument --microbatches: --parallel halves always takes 2")

    def make_step(self, args, mesh):
        print("Halves: every batch in two")
        sharded = ms.Sharded(mesh, self.rules({}), donate_argnums=(0, 1))  # dp's rules: its like's
        return lambda optimizer: sharded(make_train_step(optimizer, TOY.task.loss, microbatches=2))


@pytest.mark.slow  # one short training and one compile: ~6 s here
def test_a_registered_style_brings_its_own_step_and_refusals(toy, monkeypatch, capsys):
    monkeypatch.setitem(STYLES, "halves", Halves("halves", like="dp"))
    assert main(["train", "--model", "toy", "--parallel", "halves", "--steps", "4"]) == 0
    out = capsys.readouterr().out
    assert "Halves: every batch in two" in out and re.search(r"Step 4 .* test loss \d", out)
    with pytest.raises(SystemExit):
        main(["train", "--model", "toy", "--parallel", "halves", "--microbatches", "4"])
    assert "argument --microbatches: --parallel halves always takes 2" in capsys.readouterr().err
    assert main(["explain", "--model", "toy", "--parallel", "halves"]) == 0  # dp's plan
    assert capsys.readouterr().out.startswith("toy under halves on 8 devices")
