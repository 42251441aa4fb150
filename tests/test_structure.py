"""The package's structure, read from its source with `ast` (nothing imported):
imports point downward without cycles, no module imports another package's
private module, and functions and modules stay short enough to read.

Imports inside functions and under `TYPE_CHECKING` count like any other: a
cycle hidden behind a late import is still a cycle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "epifit"
MAX_FUNCTION_LINES = 100  # from `def` to the last line, docstring included
MAX_MODULE_LINES = 500


def _modules() -> dict[str, Path]:
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


MODULES = _modules()


def _imported(module: str, path: Path) -> set[str]:
    """The epifit modules that `module` imports, anywhere in its source."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        found |= {n for n in names if n in MODULES and n != module}
    return found


GRAPH = {m: _imported(m, p) for m, p in MODULES.items()}


def _owner(module: str) -> str:
    """The package whose private module `module` is (`epifit.model` for
    `epifit.model._spec`; `epifit` for `epifit._toml`), or `None` if public."""
    parts = module.split(".")
    for i, part in enumerate(parts[1:], start=1):
        if part.startswith("_"):
            return ".".join(parts[:i])
    return None


def _cycles() -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(GRAPH[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return components


def test_the_checks_see_the_package():
    # guards against a vacuous pass: the parser must find the layers and edges
    assert {"epifit.ode", "epifit.model", "epifit.fitting", "epifit.cli"} <= set(
        MODULES
    )
    assert "epifit.ode" in GRAPH["epifit.ode._solve"] or GRAPH["epifit.ode._solve"]
    assert any("epifit.model" in targets for targets in GRAPH.values())


def test_cycle_detection_finds_a_planted_cycle(monkeypatch):
    monkeypatch.setitem(GRAPH, "epifit.ode._solve", {"epifit.cli"})
    monkeypatch.setitem(GRAPH, "epifit.cli", {"epifit.ode._solve"})
    assert ["epifit.cli", "epifit.ode._solve"] in _cycles()


def test_no_import_cycles():
    assert _cycles() == []


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_private_imports_across_packages(module):
    foreign = sorted(
        target
        for target in GRAPH[module]
        if (owner := _owner(target)) is not None
        and not (module == owner or module.startswith(owner + "."))
    )
    assert foreign == [], f"{module} imports private modules of another package"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_functions_and_modules_are_short(module):
    source = MODULES[module].read_text()
    n_lines = len(source.splitlines())
    assert n_lines <= MAX_MODULE_LINES, f"{module}: {n_lines} lines"
    long = [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines, line {node.lineno})"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert long == [], f"{module}: functions over {MAX_FUNCTION_LINES} lines"


def test_the_layers_import_downward():
    order = [
        "ode",
        "model",
        "data",
        "simulation",
        "fitting",
        "forecasting",
        "batch",
        "cli",
    ]
    rank = {f"epifit.{name}": i for i, name in enumerate(order)}

    def layer(module):
        parts = module.split(".")
        return rank.get(".".join(parts[:2])) if len(parts) > 1 else None

    upward = sorted(
        f"{m} -> {t}"
        for m, targets in GRAPH.items()
        for t in targets
        if layer(m) is not None and layer(t) is not None and layer(t) > layer(m)
    )
    assert upward == []
