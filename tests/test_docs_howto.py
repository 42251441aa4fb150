"""The how-to guides do what they say: the CSV guide's table imports to the
bundled dataset's values, and the model written on the "write a model" page
(its TOML blocks, in order) loads, compiles and runs."""

import re
from pathlib import Path

import numpy as np
import pytest

import epifit
from epifit.cli import main

REPO = Path(__file__).resolve().parents[1]
HOWTO = REPO / "docs" / "howto"


def test_csv_guide_round_trip(tmp_path, capsys):
    bundled = epifit.open_dataset(REPO / "data" / "boarding_school_1978.nc")
    table = tmp_path / "school.csv"
    frame = bundled[["in_bed"]].to_dataframe().reset_index()
    frame.rename(columns={"time": "date"}).to_csv(table, index=False)
    assert table.read_text().startswith("date,in_bed\n1978-01-22,3\n")  # as shown
    out = tmp_path / "school.nc"
    assert main(["data", "import", str(table), "--out", str(out), "--json"]) == 0
    assert '"period": 1' in capsys.readouterr().out
    imported = epifit.open_dataset(out)
    np.testing.assert_array_equal(imported["in_bed"].values, bundled["in_bed"].values)
    np.testing.assert_array_equal(imported["time"].values, bundled["time"].values)
    # the guide's model binds to it
    problem = epifit.Problem(epifit.load_model(REPO / "models" / "sir.toml"), out)
    assert problem.n_patches == 1


def test_write_model_guide_builds_a_model(tmp_path):
    page = (HOWTO / "write-model.md").read_text()
    path = tmp_path / "seir.toml"
    path.write_text("\n".join(re.findall(r"```toml\n(.*?)```", page, re.S)))
    spec = epifit.load_model(path)
    assert [c.name for c in spec.compartments] == ["S", "E", "I", "R"]
    model = epifit.compile_model(spec)
    sim = epifit.simulate(model, None, days=100)
    n = sum(sim[c].sum(dim=[d for d in sim[c].dims if d != "time"]) for c in "SEIR")
    np.testing.assert_allclose(n.values, 1000.0, rtol=1e-6)  # closed population
    # the page's example error
    bad = tmp_path / "bad.toml"
    bad.write_text(path.read_text().replace('to = "R"', 'to = "Q"'))
    message = "transitions[1].to: unknown compartment 'Q'; known: S, E, I, R"
    assert message in page
    with pytest.raises(epifit.ModelSpecError, match=re.escape(message)):
        epifit.load_model(bad)
