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
  is not compared. A comment below a statement that prints nothing is prose only
  where code follows it directly (it introduces the next statement); a comment
  that ends the block, or a blank line, promises output the statement did not print.
* A command that fails fails its page: a statement that raises ``SystemExit``
  with a non-zero code, or during which the CLI's ``main`` returns non-zero
  (``minishard.run.cli.main``, however the page calls it). A page that shows a
  failure on purpose shows what it wrote: the comment below the statement
  matches its stdout and stderr together, the ``error: ...`` line included.
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
from typing import NamedTuple

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


def introduces_code(lines: list[str], after: int) -> bool:
    """Whether the ``# `` lines below line ``after`` run straight into code: they introduce it."""
    rest = [line for line in lines[after:] if not line.lstrip().startswith("#")]
    return bool(rest) and bool(rest[0].strip())


class _Tee(io.StringIO):
    """One stream's text, kept apart and also written to ``both``: stdout and stderr in the order written."""

    def __init__(self, both: io.StringIO) -> None:
        super().__init__()
        self.both = both

    def write(self, text: str) -> int:
        self.both.write(text)
        return super().write(text)


@contextlib.contextmanager
def _cli_statuses():
    """The CLI's ``main`` patched to record each non-zero status it returns, in the list yielded."""
    from minishard.run import cli  # only the pages need the CLI

    failed: list[int] = []
    main = cli.main

    def recorded(*args, **kwargs):
        status = main(*args, **kwargs)
        if status:
            failed.append(status)
        return status

    cli.main = recorded
    try:
        yield failed
    finally:
        cli.main = main


class Ran(NamedTuple):
    """What one statement wrote: ``out`` and ``err``, ``both`` in the order written; and why it failed."""

    out: str
    err: str
    both: str
    failure: str  # a non-zero SystemExit, or the CLI's main returning non-zero; "" if neither


def run_statement(statement: ast.stmt, page: Path, namespace: dict, failed: list[int]) -> Ran:
    """Run one statement, its stdout and stderr captured; ``failed``: the CLI's statuses, emptied first."""
    both = io.StringIO()
    out, err = _Tee(both), _Tee(both)
    failure = ""
    del failed[:]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            exec(compile(ast.Module([statement], type_ignores=[]), str(page), "exec"), namespace)
    except SystemExit as stop:
        if stop.code not in (0, None):
            failure = f"SystemExit({stop.code!r})"
    except BaseException:
        print(both.getvalue(), end="")  # what it wrote before it raised, for pytest to show
        raise
    if failed and not failure:
        failure = f"minishard.run.cli.main returned {', '.join(map(str, failed))}"
    return Ran(out.getvalue(), err.getvalue(), both.getvalue(), failure)


def run_block(code: str, first_line: int, page: Path, namespace: dict, failed: list[int]) -> None:
    """Run ``code`` statement by statement: the comment below a statement must match what it printed
    (stdout, or stdout and stderr together), and a command that failed must be shown failing."""
    padded = "\n" * (first_line - 1) + code  # tracebacks show the page's own line numbers
    lines = padded.splitlines()
    for statement in ast.parse(padded, str(page)).body:
        ran = run_statement(statement, page, namespace, failed)
        expected = output_comment(lines, statement.end_lineno or statement.lineno)
        shown = expected is not None and any(
            CHECKER.check_output(expected, text, OPTIONS) for text in (ran.out, ran.both) if text
        )
        wrote = f"--- the code printed:\n{ran.out}" + (
            f"--- and wrote to stderr:\n{ran.err}" if ran.err else ""
        )
        if ran.failure and not shown:
            raise AssertionError(
                f"{page}:{statement.lineno}: the command failed ({ran.failure}), and the page does not "
                f"show it failing\n--- the page says:\n{expected or '(nothing)'}\n{wrote}"
            )
        if expected is not None and not ran.both and introduces_code(lines, statement.end_lineno or 0):
            continue  # prose that introduces the next statement
        if expected is not None and not shown:
            why = "printed output differs from" if ran.both else "printed nothing, against"
            raise AssertionError(
                f"{page}:{statement.lineno}: {why} the comment below it\n"
                f"--- the page says:\n{expected}{wrote}"
            )


def run_page(page: Path) -> None:
    namespace: dict = {"__name__": f"docs.{page.stem}"}
    with _cli_statuses() as failed:
        for line, code in python_blocks(page.read_text()):
            run_block(code, line, page, namespace, failed)


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


def test_a_statement_below_which_the_page_shows_output_must_print_it(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("```python\nx = 5\n# prose: it introduces the next line\nprint(x)\n# 5\n```\n")
    run_page(page)
    for promise in ("x = 5\n# 5\n", "x = 5\n# 5\n\ny = 6\n"):  # the block ends, or a blank line
        page.write_text(f"```python\n{promise}```\n")
        with pytest.raises(
            AssertionError, match=r"page\.md:2: printed nothing, against the comment below it"
        ):
            run_page(page)


# An error: line on stderr, nothing on stdout, and 1 returned: 512 hidden units do not split 3 ways
QUIET_FAILURE = (
    "from minishard.run.cli import main\n\nmain(['explain', '--parallel', 'tp', '--devices', '3'])\n"
)


@pytest.mark.parametrize(
    ("code", "failure"),
    [
        (QUIET_FAILURE, r"minishard\.run\.cli\.main returned 1"),
        (QUIET_FAILURE.replace("main([", "status = main(["), r"minishard\.run\.cli\.main returned 1"),
        ("from minishard.run.cli import main\n\nmain(['explain', '--nonsense'])\n", r"SystemExit\(2\)"),
        ("import sys\n\nsys.exit(3)\n", r"SystemExit\(3\)"),
    ],
)
def test_a_command_that_fails_fails_its_page_unless_the_page_shows_its_error(tmp_path, code, failure):
    page = tmp_path / "page.md"
    page.write_text(f"```python\n{code}```\n")
    with pytest.raises(AssertionError, match=rf"page\.md:4: the command failed \({failure}\)"):
        run_page(page)
    shown = "# ...error: ...\n" if "exit(3)" not in code else "# ...\n"
    page.write_text(f"```python\n{code}{shown}```\n")  # the failure, shown on purpose
    if "exit(3)" in code:  # it writes nothing: there is no error to show
        with pytest.raises(AssertionError, match="the command failed"):
            run_page(page)
    else:
        run_page(page)


def test_the_error_a_page_shows_is_compared_with_stderr(tmp_path):
    page = tmp_path / "page.md"
    error = (
        "# error: layers[0].weight: ... has size 512, which mesh axis 'model'=3 cannot split evenly; ...\n"
    )
    page.write_text(f"```python\n{QUIET_FAILURE}{error}```\n")
    run_page(page)
    page.write_text(f"```python\n{QUIET_FAILURE}{error.replace('=3', '=4')}```\n")
    with pytest.raises(
        AssertionError, match=r"(?s)the command failed.*'model'=4.*stderr:\nerror: .*'model'=3"
    ):
        run_page(page)


# over 5 s each
SLOW_PAGES = {
    "compose.md",  # --check compiles the GPT's step for three layouts, a scaled Megatron-LM's for two
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
