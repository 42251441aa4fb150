"""The `>>>` examples in epifit's docstrings run as doctests: every module of
the package is imported and each example found in it (functions, classes,
methods defined there, not re-exports) must print what it says it prints."""

import doctest
import importlib
import pkgutil
from pathlib import Path

import pytest

import epifit

REPO = Path(__file__).resolve().parents[1]


def _modules() -> list[str]:
    return sorted(
        m.name
        for m in pkgutil.walk_packages(epifit.__path__, prefix="epifit.")
        if m.name != "epifit.__main__"  # runs the CLI on import
    )


def _tests(name: str) -> list[doctest.DocTest]:
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    return [t for t in finder.find(module) if t.examples]


MODULES_WITH_EXAMPLES = [name for name in _modules() if _tests(name)]


def test_every_example_is_found():
    # each `>>>` line of a module's source is one example doctest runs (an
    # example on an object doctest cannot see, or in a comment, fails here)
    shown, found = {}, {}
    for path in (REPO / "epifit").rglob("*.py"):
        n = sum(
            line.lstrip().startswith(">>>") for line in path.read_text().splitlines()
        )
        if n:
            shown[str(path)] = n
    for name in MODULES_WITH_EXAMPLES:
        for test in _tests(name):
            found[test.filename] = found.get(test.filename, 0) + len(test.examples)
    assert shown, "no docstring examples at all"
    assert found == shown


@pytest.mark.parametrize("name", MODULES_WITH_EXAMPLES)
def test_docstring_examples(name, monkeypatch):
    monkeypatch.chdir(REPO)  # examples read the bundled models/ and data/
    runner = doctest.DocTestRunner(
        optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    )
    report = []
    for test in _tests(name):
        result = runner.run(test, out=report.append, clear_globs=True)
        assert result.attempted, test.name
    assert runner.failures == 0, "".join(report)
