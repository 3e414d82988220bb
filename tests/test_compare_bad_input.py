"""Issue 63's bad input to ``explain --compare --size``, each one line before any work.

A ``--context`` that does not divide the batch's tokens and a ``--layout`` the size cannot split
(heads for tp, layers for pp, the sequence for cp) are in tests/test_cli.py (``LAYOUT_FLAGS``);
here, a chip without a scale-out figure asked for more devices than one node of it, and
``--remat`` (which prices the memory of its policy) beside ``--check``.
"""

from __future__ import annotations

import dataclasses

import pytest

from minishard import hardware, layouts, serving
from minishard.run.cli import main

WORDS = r"^H100: 16 devices span more than a node of 8, .* scale_out"
RANKED = ["explain", "--compare", "--size", "llama3-8b", "--hardware", "h100", "--batch-size", "1M"]


@pytest.fixture
def island(monkeypatch):
    """The H100 with no figure beyond its node of 8 (an NVLink island), as ``--hardware h100``."""
    chip = dataclasses.replace(hardware.HARDWARE["h100"], scale_out=None)
    monkeypatch.setitem(hardware.HARDWARE, "h100", chip)
    return chip


def test_devices_beyond_a_node_without_a_scale_out_figure_are_one_line(island, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*RANKED, "--devices", "16"])
    out, err = capsys.readouterr()
    message = "argument --devices: H100: 16 devices span more than a node of 8, and it has no"
    assert exit_.value.code == 2 and message in err and out == "", err
    assert len(err.strip().splitlines()[-1:]) == 1 and "Traceback" not in err


def test_within_a_node_no_scale_out_figure_is_needed(island, capsys) -> None:
    assert main([*RANKED, "--devices", "8"]) == 0
    first = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("* "))
    networked = dataclasses.replace(island, scale_out=hardware.NIC["ConnectX-7"])  # the H100's own
    best = layouts.rank(serving.LLAMA3_8B, 2**20, 8, networked).costs[0]
    assert first.startswith(f"* {best.layout}")


def test_the_ranking_itself_refuses_it_in_the_same_words(island) -> None:
    with pytest.raises(ValueError, match=WORDS):
        layouts.rank(serving.LLAMA3_8B, 2**20, 16, island)


SEVENTY = ["explain", "--compare", "--size", "llama3-70b", "--hardware", "h100", "--devices", "256",
           "--batch-size", "1M", "--context", "8192"]  # fmt: skip


def test_remat_prices_the_memory_of_its_policy(capsys) -> None:
    for remat in ("full", "none"):
        assert main([*SEVENTY, "--remat", remat]) == 0
        first = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("* "))
        kept = layouts.Kept(remat=remat)
        ranked = layouts.rank(serving.LLAMA3_70B, 2**20, 256, "h100", context=8192, kept=kept)
        assert first.startswith(f"* {next(cost for cost in ranked.costs if cost.fits).layout} ")
    # without recomputation FSDP alone no longer fits: a pipeline and cp split the activations
    assert "fsdp 256 " not in first and " pp " in first and " cp " in first


def test_remat_with_check_is_one_line_before_any_work(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([*SEVENTY, "--remat", "none", "--check"])
    out, err = capsys.readouterr()
    message = "argument --remat: --check compiles the GPT's step without remat; drop --remat"
    assert exit_.value.code == 2 and message in err and out == "", err
