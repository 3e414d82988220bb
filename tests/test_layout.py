"""The wall between the textbook and the workshop, read from the source (no module is imported).

* The textbook (``minishard/*.py``) never imports the workshop (``minishard.run``),
  the models or the testing tools.
* The workshop, the models and the testing tools use the textbook as a user would:
  no ``_``-prefixed name of it, no private module.
* The textbook fits in one sitting: its core modules at most 2,000 lines together,
  each later chapter at most 300 lines of its own, no function over 30 lines.
* No layer and no model spells the batch axis: it is ``Sharded(batch_axis=...)``'s.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "minishard"
ORDER = (
    "tree", "rules", "constraints", "layers", "losses", "optim", "sharding", "presets",
    "census", "costs", "report", "pipeline", "zero",
)  # fmt: skip
"""The reading path: the import order."""
CHAPTERS = ("costs", "pipeline", "zero")
"""Chapters with a budget of their own (at most 300 lines each); the rest is the core."""
CORE = tuple(name for name in ORDER if name not in CHAPTERS)
OUTSIDE = ("run", "models", "testing")


def textbook(private: bool = False) -> list[Path]:
    """``minishard/*.py``: the reading path, and with ``private`` the ``_``-modules a reader may skip."""
    return sorted(p for p in PACKAGE.glob("*.py") if private or not p.name.startswith("_"))


def imports(path: Path) -> list[tuple[str, str | None]]:
    """``(module, name)`` for each import in ``path``: ``name`` None for ``import module``."""
    found: list[tuple[str, str | None]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found += [(node.module, alias.name) for alias in node.names]
    return found


def test_the_textbook_never_imports_the_workshop_models_or_tools():
    wrong = [
        f"{path.name}: {module}"
        for path in textbook(private=True)
        if path.name != "__main__.py"  # the command line's entry point
        for module, name in imports(path)
        if any(
            module == f"minishard.{part}"
            or module.startswith(f"minishard.{part}.")
            or (module == "minishard" and name == part)
            for part in OUTSIDE
        )
    ]
    assert not wrong, wrong


def test_no_textbook_function_hides_an_import_of_minishard():
    hidden = [
        f"{path.name}:{node.lineno} {function.name} imports {node.module}"
        for path in textbook(private=True)
        for function in ast.walk(ast.parse(path.read_text()))
        if isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef)
        for node in ast.walk(function)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("minishard")
    ]
    assert not hidden, hidden


@pytest.mark.parametrize("part", OUTSIDE)
def test_the_workshop_models_and_tools_use_only_public_names(part):
    wrong = []
    for path in sorted((PACKAGE / part).rglob("*.py")):
        for module, name in imports(path):
            if not module.startswith("minishard") or module.startswith(f"minishard.{part}"):
                continue
            if any(piece.startswith("_") for piece in module.split(".")) or (name or "").startswith("_"):
                wrong.append(f"{path.relative_to(PACKAGE)}: from {module} import {name}")
    assert not wrong, wrong


def test_the_textbook_reads_in_one_sitting():
    lines = {p.stem: len(p.read_text().splitlines()) for p in textbook()}
    unknown = sorted(set(lines) - set(ORDER) - {"__init__", "__main__"})
    assert not unknown, f"modules not on the reading path: {unknown}; add them to ORDER"
    core = sum(lines[name] for name in CORE)
    assert core <= 2000, f"the core textbook has {core} lines: {[(n, lines[n]) for n in CORE]}"
    over = {name: lines[name] for name in CHAPTERS if lines.get(name, 0) > 300}
    assert not over, f"chapters over 300 lines: {over}"


def test_no_textbook_function_is_over_30_lines():
    long = [
        f"{path.name}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path in textbook()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno + 1 > 30
    ]
    assert not long, long


def test_no_layer_or_model_spells_the_batch_axis():
    spelled = [
        f"{path.relative_to(PACKAGE)}:{node.lineno}"
        for path in [PACKAGE / "layers.py", *sorted((PACKAGE / "models").rglob("*.py"))]
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and node.value == "batch"
    ]
    assert not spelled, f"the literal 'batch' in {spelled}: use minishard.constraints.activation_axes"


def test_every_module_lists_its_public_names():
    missing = [
        str(path.relative_to(PACKAGE))
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name not in ("__main__.py",)
        and not path.name.startswith("_")
        and not any(
            isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets)
            for node in ast.parse(path.read_text()).body
        )
    ]
    assert not missing, f"modules without __all__: {missing}"


def reading_order(text: str) -> list[str]:
    """The textbook modules a text names, in the order it first names them."""
    names = list(ORDER)
    found = re.findall(r"\b(" + "|".join(names) + r")(?:\.py|``)", text)
    return list(dict.fromkeys(found))


def test_readme_package_docstring_and_index_give_the_import_order():
    order = [name for name in ORDER if (PACKAGE / f"{name}.py").exists()]
    root = PACKAGE.parent
    texts = {
        "README.md": (root / "README.md").read_text().split("## A tour")[0],
        "minishard/__init__.py": ast.get_docstring(ast.parse((PACKAGE / "__init__.py").read_text())) or "",
        "docs/index.md": (root / "docs" / "index.md").read_text().split("## Running it")[0],
    }
    for where, text in texts.items():
        assert reading_order(text) == order, f"{where} reads {reading_order(text)}; the imports say {order}"


def test_fit_reads_in_sixty_lines():
    tree = ast.parse((PACKAGE / "run" / "train.py").read_text())
    (fit,) = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "fit"]
    assert fit.end_lineno - fit.lineno + 1 <= 60
