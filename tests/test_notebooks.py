"""The notebooks in `notebooks/` are documentation that runs: each is executed
top to bottom (working directory the repository root) and must finish without
an error. Each ends with a cell of `assert`s checking the claims it makes
(fit against an independent SciPy fit, recovery of the true parameters,
scenario orderings) and printing `all checks passed`. They run here with
`EPIFIT_NOTEBOOK_QUICK=1` (notebook 02's second fit shortened, the same
checks); the docs build runs them in full."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = REPO / "notebooks"
NOTEBOOKS = (
    "01_quickstart.ipynb",
    "02_metapopulation_neural_beta.ipynb",
    "03_scenarios.ipynb",
)
# per cell: the longest cells are fits and the adjoint audit, a minute or two
# each on two busy cores when nothing is compiled yet
CELL_TIMEOUT = 900
DONE = "all checks passed"


def _read(name: str):
    return nbformat.read(NOTEBOOK_DIR / name, as_version=4)


def test_notebooks_present_and_committed_without_outputs():
    present = sorted(p.name for p in NOTEBOOK_DIR.glob("*.ipynb"))
    assert present == sorted(NOTEBOOKS)
    for name in NOTEBOOKS:
        nb = _read(name)
        nbformat.validate(nb)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert code, name
        for i, cell in enumerate(code):
            assert cell.outputs == [], f"{name}: code cell {i} has outputs"
            assert cell.execution_count is None, f"{name}: code cell {i} was run"
        # the notebook checks its own claims in its last cell
        assert "assert" in code[-1].source and DONE in code[-1].source, name


@pytest.mark.slow
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_executes(name, monkeypatch):
    monkeypatch.setenv("EPIFIT_NOTEBOOK_QUICK", "1")  # the kernel inherits it
    nb = _read(name)
    client = NotebookClient(
        nb,
        timeout=CELL_TIMEOUT,
        kernel_name="python3",
        resources={"metadata": {"path": str(REPO)}},
    )
    client.execute()  # raises CellExecutionError (with the traceback) on error
    last = [c for c in nb.cells if c.cell_type == "code"][-1]
    printed = "".join(
        o.get("text", "") for o in last.outputs if o.get("output_type") == "stream"
    )
    assert DONE in printed, printed
