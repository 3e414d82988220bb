"""Every docs page runs: the code the tutorials show is the code that works.

For each ``docs/*.md`` page, the ```` ```python ```` fenced blocks are run in
order in ONE shared namespace (a later block sees the names an earlier block
defined), inside a fresh temporary working directory, so a page may write
files. A failing block fails the page, and the traceback points at the page's
own line numbers.

Conventions for page authors:

* Fences start at the beginning of a line: ```` ```python ```` opens a block,
  ```` ``` ```` closes it. Other languages (```` ```bash ````, ...) are not run.
* ```` ```python no-run ```` shows code without running it (for example a
  command that needs real hardware or a download).
* Show results with ``assert``, or with ``print(...)`` followed *directly* by
  its output as ``# `` comment lines. The runner runs each top-level statement
  on its own, captures what it prints, and compares it with the comment lines
  right below it (doctest's checker: ``...`` matches anything, runs of
  whitespace compare equal). A statement that prints with no comment below it
  is not compared; a comment below a statement that prints nothing is prose.
* A page that needs something from the environment (prepared data, say) names
  the variables in an HTML comment, ``<!-- docs-test: requires-env TFDS_DATA_DIR -->``;
  the page is skipped, with a reason, when one of them is unset.
"""

import ast
import contextlib
import doctest
import io
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]  # the README's tour runs too
SKIP_MARKER = "no-run"

FENCE = re.compile(r"^```python(?P<info>[^\n]*)\n(?P<code>.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
REQUIRES_ENV = re.compile(r"<!--\s*docs-test:\s*requires-env\s+(?P<names>[\w\s]+?)\s*-->")


def python_blocks(markdown: str) -> list[tuple[int, str]]:
    """(line number of the first code line, code) of each runnable python block."""
    return [
        (markdown.count("\n", 0, match.start("code")) + 1, match["code"])
        for match in FENCE.finditer(markdown)
        if SKIP_MARKER not in match["info"].split()
    ]


def missing_env(markdown: str) -> list[str]:
    """The variables a page requires (``requires-env``) that are unset or empty."""
    names = [name for match in REQUIRES_ENV.finditer(markdown) for name in match["names"].split()]
    return [name for name in names if not os.environ.get(name)]


CHECKER = doctest.OutputChecker()
OPTIONS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def output_comment(lines: list[str], after: int) -> str | None:
    """The ``# `` lines directly below line ``after`` (1-based), without their ``#``; None if none."""
    comment = []
    for line in lines[after:]:
        if not line.lstrip().startswith("#"):
            break
        comment.append(line.lstrip()[1:].removeprefix(" "))
    return "\n".join(comment) + "\n" if comment else None


def run_block(code: str, first_line: int, page: Path, namespace: dict) -> None:
    """Run ``code`` statement by statement; printed output must match the comment below it."""
    padded = "\n" * (first_line - 1) + code  # tracebacks show the page's own line numbers
    lines = padded.splitlines()
    for statement in ast.parse(padded, str(page)).body:
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(compile(ast.Module([statement], type_ignores=[]), str(page), "exec"), namespace)
        expected = output_comment(lines, statement.end_lineno or statement.lineno)
        got = printed.getvalue()
        if got and expected is not None and not CHECKER.check_output(expected, got, OPTIONS):
            raise AssertionError(
                f"{page}:{statement.lineno}: printed output differs from the comment below it\n"
                f"--- the page says:\n{expected}--- the code printed:\n{got}"
            )


def run_page(page: Path) -> None:
    namespace: dict = {"__name__": f"docs.{page.stem}"}
    for line, code in python_blocks(page.read_text()):
        run_block(code, line, page, namespace)


def test_python_blocks_are_found_in_order_and_no_run_is_skipped():
    page = "\n".join(
        [
            "# Title",
            "```python",
            "x = 1",
            "```",
            "```bash",
            "echo not python",
            "```",
            "```python no-run",
            "raise SystemExit",
            "```",
            "```python",
            "y = x + 1",
            "",
            "```",
        ]
    )
    assert python_blocks(page) == [(3, "x = 1\n"), (12, "y = x + 1\n\n")]


def test_blocks_share_a_namespace_and_errors_point_at_the_page(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("text\n```python\nx = 2\n```\nmore\n```python\nassert x == 2\nassert x == 3\n```\n")
    with pytest.raises(AssertionError) as failure:
        run_page(page)
    where = failure.traceback[-1]
    assert (Path(where.path), where.lineno + 1) == (page, 8)  # pytest counts lines from 0


def test_requires_env_names_the_unset_variables(monkeypatch):
    monkeypatch.setenv("DOCS_TEST_SET", "yes")
    monkeypatch.delenv("DOCS_TEST_UNSET", raising=False)
    page = "<!-- docs-test: requires-env DOCS_TEST_SET DOCS_TEST_UNSET -->\n# Title\n"
    assert missing_env(page) == ["DOCS_TEST_UNSET"]
    assert missing_env("# no requirements\n") == []


def test_printed_output_is_compared_with_the_comment_below_it(tmp_path, capsys):
    page = tmp_path / "page.md"
    good = "```python\nfor i in range(2):\n    print(i, 'x' * 40)\n# 0 x...\n# 1 x...\n```\n"
    page.write_text(good + "```python\nprint(1 + 1)\n# 2\nx = 5  # a statement that prints nothing\n```\n")
    run_page(page)
    page.write_text(good + "```python\nprint(1 + 1)\n# 3\n```\n")  # one printed value changed
    with pytest.raises(
        AssertionError, match=r"page\.md:8: printed output differs(?s:.*)says:\n3\n.*printed:\n2"
    ):
        run_page(page)


# over 5 s each
SLOW_PAGES = {
    "compose.md",  # --check compiles the GPT's step for two layouts
    "context.md",
    "costs.md",
    "experts.md",
    "memory.md",
    "pipeline.md",
    "sharding.md",
    "testing.md",
    "training.md",
    "then-and-now.md",
}


@pytest.mark.parametrize(
    "page",
    [pytest.param(page, marks=[pytest.mark.slow] if page.name in SLOW_PAGES else []) for page in PAGES],
    ids=[page.name for page in PAGES],
)
def test_page_runs(page, tmp_path, monkeypatch):
    if missing := missing_env(page.read_text()):
        pytest.skip(f"{page.name} needs {', '.join(missing)} set")
    monkeypatch.chdir(tmp_path)
    run_page(page)


def test_costs_md_zero_table_counts_the_bytes_of_the_step_minishard_train_runs(monkeypatch, capsys):
    # One basis per table, said in its caption: the dp and fsdp rows are the CLI's step (loss and accuracy)
    import minishard.run.cli.explain as explain_command
    from minishard.run.cli import main

    sent, summary = [], explain_command.summary
    monkeypatch.setattr(explain_command, "summary", lambda found: sent.append(found) or summary(found))
    for style in ("dp", "fsdp"):
        assert main(["explain", "--parallel", style]) == 0  # the MLP, batch 128 on 8 devices, compiled
    capsys.readouterr()
    dp, fsdp = sent[0]["all-reduce"].bytes, sent[1]
    page = (ROOT / "docs" / "costs.md").read_text()
    assert "every step on one basis: each returns its loss *and* its accuracy" in page
    rows = {
        line.split("|")[1].strip(): line.split("|")[2].strip()
        for line in page.splitlines()
        if line.startswith("| `dp` (Sharded)") or line.startswith("| `fsdp` (Sharded, rules)")
    }
    assert rows["`dp` (Sharded)"] == f"all-reduce {dp:,}"
    assert rows["`fsdp` (Sharded, rules)"] == ", ".join(
        f"{kind} {fsdp[kind].bytes:,}" for kind in ("all-gather", "all-to-all", "all-reduce")
    )
