"""Every script in examples/ runs to the end (each checks its own results with asserts)."""

import runpy
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.py"))
SLOW = {"vit_2d_mesh.py", "data_parallel_by_hand.py"}  # over ~5 s on 2 cores


@pytest.mark.parametrize(
    "script",
    [pytest.param(s, marks=pytest.mark.slow) if s.name in SLOW else s for s in EXAMPLES],
    ids=[script.name for script in EXAMPLES],
)
def test_example_runs(script, capsys):
    runpy.run_path(str(script), run_name="__main__")
    assert capsys.readouterr().out  # each example prints what it shows
