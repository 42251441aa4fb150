"""The documentation site's sources (`mkdocs.yml`, `docs/`): every public name
has an API entry, the CLI page is the commands' `--help`, and no page a user
reads names an internal path or a private module. The built site itself is
checked in `tests/test_docs_site.py`."""

import contextlib
import importlib.util
import io
import json
import re
from pathlib import Path

import pytest

from epifit.cli import _commands, main

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"docs_{name}", DOCS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


api = _load("_api")
hooks = pytest.importorskip("mkdocs") and _load("_hooks")

# What a user-facing page must not name: the sibling folder of external
# benchmarks, the test suite's helper modules (a test file, `tests/test_*.py`,
# is named as where a measurement comes from), private modules as dotted
# names or files, private packages.
INTERNAL = re.compile(
    r"(?<![\w/.-])(?:\.\./)?shared/"
    r"|tests/(?!test_)\w+\.py"
    r"|\bepifit(?:\.\w+)*\._(?!_)\w+"
    r"|\bepifit/(?:\w+/)*_(?!_)\w+"
    r"|(?<![\w./])_(?!_)\w+\.py\b"
)


def _api_page_text() -> str:
    return "\n".join(p.read_text() for p in sorted((DOCS / "api").glob("*.md")))


def test_every_public_name_has_one_api_entry():
    markers = re.findall(r"<!-- epifit-api: ([\w.]+) -->", _api_page_text())
    assert sorted(markers) == sorted(api.PACKAGES), "one API page per package"
    entries = []
    for package in api.PACKAGES:
        page = api.api_markdown(package)
        entries += re.findall(r"^::: ([\w.]+)$", page, re.M)
        for name in api.public_names(package):
            home = api.homes()[(package, name)]
            if home == f"{package}.{name}":
                assert f"::: {home}\n" in page, (package, name)
            else:  # documented where it lives, linked from here
                assert f"[`{home}`][{home}]" in page, (package, name)
                home_page = api.api_markdown(home.rsplit(".", 1)[0])
                assert f"::: {home}\n" in home_page, (package, name)
    assert len(entries) == len(set(entries)), "a name documented twice"
    # spot checks against the packages' own lists
    assert "epifit.fitting.calibrate" in entries
    assert "epifit.ode.CheckpointAdjoint" in entries
    assert "epifit.forecasting.forecast" in entries
    assert "epifit.jit" in entries and "epifit.enable_compilation_cache" in entries
    assert "epifit.calibrate" not in entries  # top level links to epifit.fitting


def test_api_covers_every_public_module():
    import pkgutil

    import epifit

    public = {
        f"epifit.{m.name}"
        for m in pkgutil.iter_modules(epifit.__path__)
        if not m.name.startswith("_")
    }
    assert public | {"epifit"} == set(api.PACKAGES)


def test_public_names_follow_the_packages():
    import epifit.ode
    import epifit.simulation

    assert api.public_names("epifit.simulation") == epifit.simulation.__all__
    assert "solve" in api.public_names("epifit.ode")
    assert api.public_names("epifit.cli") == ["main", "run"]  # not its imports
    assert all(not n.startswith("_") for p in api.PACKAGES for n in api.public_names(p))
    for name in api.public_names("epifit.ode"):
        assert hasattr(epifit.ode, name)


def _help(words: list[str], monkeypatch) -> str:
    monkeypatch.setenv("COLUMNS", hooks.HELP_COLUMNS)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as e:
        main([*words, "--help"])
    assert e.value.code == 0
    return out.getvalue()


def test_cli_page_is_the_commands_help(monkeypatch):
    page = (DOCS / "cli.md").read_text()
    assert hooks.CLI_MARKER in page
    generated = hooks.cli_markdown()
    commands = [c for c, _ in hooks.cli_commands()]
    # every sub-command, and the nested `data import`
    assert commands[0] == "epifit"
    assert {f"epifit {name}" for name in _commands.COMMANDS} <= set(commands)
    assert "epifit data import" in commands
    for command in commands:
        text = _help(command.split()[1:], monkeypatch)
        assert f"`{command}`" in generated
        assert f"```text\n{text.rstrip()}\n```" in generated, command


def _user_pages() -> dict[str, str]:
    """Every source of a page on the site: the Markdown pages, the CLI page as
    generated, and the notebooks' cells."""
    pages = {
        str(p.relative_to(REPO)): p.read_text() for p in sorted(DOCS.rglob("*.md"))
    }
    pages["docs/cli.md (generated)"] = hooks.cli_markdown()
    for nb in sorted((REPO / "notebooks").glob("*.ipynb")):
        cells = json.loads(nb.read_text())["cells"]
        pages[str(nb.relative_to(REPO))] = "\n".join(
            "".join(c["source"]) for c in cells
        )
    return pages


def test_internal_path_pattern():
    for bad in (
        "see shared/bench/peers.py",
        "`../shared/bench/`",
        "tests/helpers.py",
        "epifit._cache",
        "epifit.ode._solve.pack",
        "epifit/model/_strata.py",
        "`_lbfgs.py`",
    ):
        assert INTERNAL.search(bad), bad
    for fine in (
        "tests/test_cookbook.py",
        "epifit.fitting.calibrate",
        "epifit/ode/",
        "models/seir_age3.toml",
        "__init__.py",
        "make_synthetic.py",
        "benchmarks/forward.py",
    ):
        assert not INTERNAL.search(fine), fine


def test_no_user_page_names_internal_paths():
    found = [
        f"{name}: {m.group(0)!r}"
        for name, text in _user_pages().items()
        for m in INTERNAL.finditer(text)
    ]
    assert not found, "internal paths on user pages:\n" + "\n".join(found)


def test_nav_lists_every_page():
    import yaml

    class _Loader(yaml.SafeLoader):
        pass

    # mkdocs.yml may use mkdocs' !ENV and python tags
    _Loader.add_multi_constructor("!", lambda loader, suffix, node: None)
    config = yaml.load((REPO / "mkdocs.yml").read_text(), Loader=_Loader)
    listed = set(re.findall(r"[\w/.-]+\.(?:md|ipynb)", json.dumps(config["nav"])))
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert pages <= listed, sorted(pages - listed)
    tutorials = {f"tutorials/{p.name}" for p in (REPO / "notebooks").glob("*.ipynb")}
    assert tutorials <= listed, sorted(tutorials - listed)
    assert config["strict"] is True
