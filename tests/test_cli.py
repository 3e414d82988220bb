"""minishard.cli: ``minishard train`` on the real (offline) MNIST, and its argument checks."""

import json
import os
import re

import pytest

from minishard.cli import main

needs_mnist = pytest.mark.skipif(
    not os.path.isdir(os.path.join(os.environ.get("TFDS_DATA_DIR", "/nonexistent"), "mnist")),
    reason="needs MNIST prepared by tfds: set TFDS_DATA_DIR (make test does)",
)


def final_line(output: str) -> str:
    """The last epoch line, without its (machine-dependent) duration."""
    lines = [line for line in output.splitlines() if line.startswith("Epoch ")]
    return re.sub(r" in [\d.]+ s", "", lines[-1])


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


def test_cli_rejects_layers_that_do_not_fit_the_dataset(capsys):
    assert main(["train", "--layers", "100,10", "--mesh", "data=8"]) == 2
    assert "must start with 784 inputs" in capsys.readouterr().err
