"""mkdocs hooks for epifit's site (`mkdocs.yml: hooks`).

- The tutorials: the notebooks in `notebooks/` are executed at build time (the
  working directory is the repository root, as `tests/test_notebooks.py` runs
  them) and handed to mkdocs-jupyter with their outputs as
  `tutorials/<name>.ipynb`. A notebook that raises fails the build.
  `EPIFIT_DOCS_EXECUTE=0` renders them without running them (quick builds).
- The CLI reference: `cli.md`'s `<!-- epifit-cli -->` marker is replaced by the
  `--help` text of `epifit` and of every sub-command, walked from the argparse
  parser itself, so the page cannot drift from the command.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import tempfile
from pathlib import Path

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = REPO / "notebooks"
TUTORIALS = "tutorials"
CLI_MARKER = "<!-- epifit-cli -->"
# argparse wraps help text to the terminal; the page and its test use this width
HELP_COLUMNS = "88"
# per cell: fits and the adjoint audit take a minute or two on two busy cores
CELL_TIMEOUT = 900

_build_dir: tempfile.TemporaryDirectory | None = None


def execute_notebooks() -> bool:
    """Whether this build runs the notebooks (`EPIFIT_DOCS_EXECUTE`, default 1)."""
    value = os.environ.get("EPIFIT_DOCS_EXECUTE", "1").strip().lower()
    if value not in {"0", "1", "false", "true", "no", "yes"}:
        raise ValueError(
            f"EPIFIT_DOCS_EXECUTE={value!r}: give 1 (run the notebooks) or 0"
        )
    return value in {"1", "true", "yes"}


def _executed_copy(src: Path, dest: Path, run: bool) -> None:
    import nbformat

    nb = nbformat.read(src, as_version=4)
    if run:
        from nbclient import NotebookClient

        NotebookClient(
            nb,
            timeout=CELL_TIMEOUT,
            kernel_name="python3",
            resources={"metadata": {"path": str(REPO)}},
        ).execute()  # raises CellExecutionError on the first failing cell
    nbformat.write(nb, dest)


# before mkdocs-jupyter's on_files (priority 0) wraps the notebooks it finds
@event_priority(50)
def on_files(files, config):
    global _build_dir
    _build_dir = tempfile.TemporaryDirectory(prefix="epifit-docs-")
    root = Path(_build_dir.name)
    (root / TUTORIALS).mkdir()
    run = execute_notebooks()
    for src in sorted(NOTEBOOKS.glob("*.ipynb")):
        _executed_copy(src, root / TUTORIALS / src.name, run)
        files.append(
            File(
                f"{TUTORIALS}/{src.name}",
                src_dir=str(root),
                dest_dir=config["site_dir"],
                use_directory_urls=config["use_directory_urls"],
            )
        )
    return files


def on_post_build(config):
    global _build_dir
    if _build_dir is not None:
        _build_dir.cleanup()
        _build_dir = None


def _commands(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> list[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """`(words, parser)` for the parser and each sub-command, depth first."""
    out = [(path, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out.extend(_commands(sub, (*path, name)))
    return out


def cli_commands() -> list[tuple[str, str]]:
    """`(command line, --help text)` for `epifit` and every sub-command."""
    from epifit.cli import _parser

    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = HELP_COLUMNS
    try:
        return [
            (" ".join(("epifit", *words)), sub.format_help())
            for words, sub in _commands(_parser())
        ]
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old


def cli_markdown() -> str:
    parts = []
    for command, text in cli_commands():
        level = "#" * min(2 + command.count(" "), 4)
        parts.append(f"{level} `{command}`\n\n```text\n{text.rstrip()}\n```\n")
    return "\n".join(parts)


def on_page_markdown(markdown, page, config, files):
    if CLI_MARKER in markdown:
        markdown = markdown.replace(CLI_MARKER, cli_markdown())
    if API_MARKER in markdown:
        markdown = _api_pages(markdown)
    return markdown


API_MARKER = "<!-- epifit-api:"


def load_api():
    """`docs/_api.py`, beside this file (the hooks are not a package)."""
    path = Path(__file__).resolve().parent / "_api.py"
    spec = importlib.util.spec_from_file_location("epifit_docs_api", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _api_pages(markdown: str) -> str:
    _api = load_api()
    out = []
    for line in markdown.splitlines():
        if line.startswith(API_MARKER):
            package = line[len(API_MARKER) :].removesuffix("-->").strip()
            out.append(_api.api_markdown(package))
        else:
            out.append(line)
    return "\n".join(out) + "\n"
