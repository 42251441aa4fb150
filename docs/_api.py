"""The public API of epifit's packages, as the API reference documents it.

A package's public names are its `__all__` where it has one, else the names its
`__init__` re-exports explicitly (`from m import X as X`) and the public
functions and classes it defines itself. Each name has one home: the first
package (in layer order) that exports the same object; the API page of every
other package that exports it links there. `tests/test_docs.py` checks that
`docs/api/` has an entry for every one of them.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# layer order: a name's home is the lowest package that exports it
PACKAGES = (
    "epifit.ode",
    "epifit.model",
    "epifit.data",
    "epifit.simulation",
    "epifit.fitting",
    "epifit.forecasting",
    "epifit.sampling",
    "epifit.batch",
    "epifit.plotting",
    "epifit.cli",
    "epifit",
)


def _init_path(package: str) -> Path:
    path = REPO.joinpath(*package.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def public_names(package: str) -> list[str]:
    """The package's public names, in the order its `__init__` gives them."""
    mod = importlib.import_module(package)
    if hasattr(mod, "__all__"):
        return list(mod.__all__)
    tree = ast.parse(_init_path(package).read_text())
    names = []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            names += [a.asname for a in node.names if a.asname == a.name]
        elif isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.append(node.name)
    return [n for n in names if not n.startswith("_")]


def homes() -> dict[tuple[str, str], str]:
    """`(package, name) -> "home.name"`: where each public name is documented."""
    seen: dict[int, str] = {}
    out = {}
    for package in PACKAGES:
        mod = importlib.import_module(package)
        for name in public_names(package):
            obj = getattr(mod, name)
            shared = inspect.isclass(obj) or inspect.isfunction(obj) or callable(obj)
            key = id(obj)
            if shared and key in seen:
                out[(package, name)] = f"{seen[key]}.{name}"
            else:
                out[(package, name)] = f"{package}.{name}"
                if shared:
                    seen[key] = package
    return out


def _kind(obj) -> str:
    if inspect.isclass(obj):
        return "Errors" if issubclass(obj, BaseException) else "Classes"
    if callable(obj):
        return "Functions"
    return "Constants"


KINDS = ("Functions", "Classes", "Errors", "Constants")


def api_markdown(package: str) -> str:
    """The entries of `package`'s API page: one `:::` block per name it is the
    home of, by kind, then links to the names it re-exports from elsewhere."""
    mod = importlib.import_module(package)
    where = homes()
    groups: dict[str, list[str]] = {k: [] for k in KINDS}
    elsewhere = []
    for name in public_names(package):
        home = where[(package, name)]
        if home == f"{package}.{name}":
            groups[_kind(getattr(mod, name))].append(home)
        else:
            elsewhere.append((name, home))
    parts = []
    for kind in KINDS:
        if groups[kind]:
            parts.append(f"## {kind}\n")
            parts += [f"::: {path}\n" for path in groups[kind]]
    if elsewhere:
        parts.append("## Re-exported\n")
        parts.append(
            f"`{package}` also exports these names, documented where they live:\n"
        )
        parts += [f"- `{package}.{n}`: [`{home}`][{home}]" for n, home in elsewhere]
        parts.append("")
    return "\n".join(parts)
