"""Issue 18: any bundled file (models/, data/, a CSV table) with one random
field corrupted gives either a valid result (exit 0 and a readable output)
or exit 2 with exactly one `epifit: error:` line, never a traceback, and the
input is byte-identical afterwards.

Hypothesis, derandomized and bounded; each example runs the cheapest command
that reads the file: `simulate --days 5` for models and datasets, `calibrate
--max-iterations 1 --no-uncertainty` for fit configurations, `forecast
--samples 0 --days 5` for scenarios, `data import` for CSV tables."""

from __future__ import annotations

import math
import os
import shutil
import tomllib
from pathlib import Path

import numpy as np
import pytest
import xarray as xr

hypothesis = pytest.importorskip("hypothesis")
from helpers import to_toml  # noqa: E402
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from epifit.cli import main  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODELS = REPO / "models"
DATA = REPO / "data"
BOARDING = DATA / "boarding_school_1978.nc"
METAPOP = DATA / "synthetic_metapop_20.nc"

# model files and the dataset each one is simulated on
MODEL_DATA = {
    "sir.toml": BOARDING,
    "seir.toml": BOARDING,
    "seird_boxcar.toml": BOARDING,
    "seird_metapop_counts.toml": METAPOP,
    "seird_metapop_mobility.toml": METAPOP,
}
FIT_MODEL = {"sir_fit.toml": "sir.toml", "seir_fit.toml": "seir.toml"}
DATASET_MODEL = {BOARDING.name: "sir.toml", METAPOP.name: "seird_metapop_counts.toml"}

# the replacements of one field
VALUES = st.one_of(
    st.just("DELETE"),
    st.text(max_size=8),
    st.integers(-(10**12), 10**12),
    st.sampled_from([-1, 0, -1.0, 1e300, -1e300, math.nan, math.inf, 1e-300]),
    st.just([]),
    st.just({}),
    st.booleans(),
)


@pytest.fixture(autouse=True)
def _no_persistent_cache(monkeypatch):
    monkeypatch.setenv("EPIFIT_NO_CACHE", "1")


# -- TOML -----------------------------------------------------------------------------
def _leaves(node, path=()):
    """Every field path of a TOML document (tables and arrays included)."""
    items = node.items() if isinstance(node, dict) else enumerate(node)
    for k, v in items:
        yield (*path, k)
        if isinstance(v, dict | list):
            yield from _leaves(v, (*path, k))


def _corrupt_toml(text: str, data) -> str:
    doc = tomllib.loads(text)
    paths = sorted(_leaves(doc), key=repr)
    path = data.draw(st.sampled_from(paths), label="field")
    value = data.draw(VALUES, label="value")
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    if value == "DELETE":
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return to_toml(doc)


# -- netCDF ---------------------------------------------------------------------------
def _corrupt_dataset(src: Path, dst: Path, data) -> None:
    ds = xr.open_dataset(src).load().drop_encoding()  # NaN stays NaN
    name = data.draw(st.sampled_from(sorted(map(str, ds.variables))), label="variable")
    how = data.draw(
        st.sampled_from(["drop", "nan", "negative", "huge", "string", "attrs", "dims"]),
        label="how",
    )
    var = ds[name]
    if how == "drop":
        ds = ds.drop_vars(name)
    elif how == "attrs":
        ds[name].attrs = {"units": data.draw(st.text(max_size=5)), "long_name": 3}
    elif how == "dims":
        if name in ds.dims or not var.dims:
            ds = ds.drop_vars(name)
        else:
            ds[name] = var.rename({var.dims[0]: "bogus"})
    elif np.issubdtype(var.dtype, np.number) and name not in ds.dims:
        fill = {"nan": np.nan, "negative": -5.0, "huge": 1e300}.get(how)
        if fill is None:
            ds[name] = var.astype(str)
        else:
            values = var.values.astype(np.float64)
            flat = values.reshape(-1)
            if flat.size:
                k = data.draw(st.integers(0, flat.size - 1), label="index")
                flat[k] = fill
                if data.draw(st.booleans(), label="everywhere"):
                    flat[:] = fill
            ds[name] = var.copy(data=values)
    else:
        ds = ds.drop_vars(name)
    ds.to_netcdf(dst)


# -- CSV ------------------------------------------------------------------------------
def _table(src: Path) -> str:
    ds = xr.open_dataset(src)
    dates = [str(t)[:10] for t in ds["time"].values]
    rows = ["date,in_bed"] + [
        f"{d},{v:g}" for d, v in zip(dates, ds["in_bed"].values, strict=True)
    ]
    return "\n".join(rows) + "\n"


def _corrupt_csv(text: str, data) -> str:
    rows = [r.split(",") for r in text.splitlines()]
    i = data.draw(st.integers(0, len(rows) - 1), label="row")
    j = data.draw(st.integers(0, 1), label="column")
    value = data.draw(
        st.one_of(
            st.sampled_from(["", "nan", "-5", "1e300", "inf", "x", "2020-13-45"]),
            st.text(alphabet="abc019-:.T ", max_size=12),
        ),
        label="cell",
    )
    rows[i][j] = value
    return "\n".join(",".join(r) for r in rows) + "\n"


# -- the property ---------------------------------------------------------------------
KINDS = (
    [("model", n) for n in MODEL_DATA]
    + [("fit", n) for n in FIT_MODEL]
    + [("scenarios", "scenarios_example.toml")]
    + [("dataset", n) for n in DATASET_MODEL]
    + [("csv", "table.csv")]
)


@pytest.fixture(scope="module")
def fit_file(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fit")
    shutil.copy(BOARDING, folder / "x.nc")
    out = folder / "FIT.nc"
    argv = ["calibrate", str(MODELS / "sir.toml"), "--data", str(folder / "x.nc")]
    argv += ["--out", str(out), "--max-iterations", "3", "--no-progress"]
    assert main(argv) == 0
    return out


def _command(kind: str, name: str, bad: Path, out: Path, fit_file: Path) -> list:
    if kind == "model":
        return ["simulate", str(bad), "--data", str(MODEL_DATA[name]), "--days", "5"]
    if kind == "fit":
        model = MODELS / FIT_MODEL[name]
        return ["calibrate", str(model), "--data", str(BOARDING), "--fit", str(bad)]
    if kind == "scenarios":
        return ["forecast", str(fit_file), "--scenarios", str(bad), "--samples", "0"]
    if kind == "dataset":
        model = MODELS / DATASET_MODEL[name]
        return ["simulate", str(model), "--data", str(bad), "--days", "5"]
    return ["data", "import", str(bad)]


@pytest.mark.slow
@settings(
    max_examples=int(os.environ.get("EPIFIT_FUZZ_EXAMPLES", "60")),
    derandomize=True,
    deadline=None,
    phases=[Phase.explicit, Phase.generate],  # no shrinking: each run compiles
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(kind_name=st.sampled_from(KINDS), data=st.data())
def test_a_corrupted_file_gives_a_result_or_one_error_line(
    kind_name, data, tmp_path_factory, fit_file, capsys
):
    kind, name = kind_name
    folder = tmp_path_factory.mktemp("fuzz")
    bad = folder / name
    if kind == "dataset":
        _corrupt_dataset(DATA / name, bad, data)
    elif kind == "csv":
        bad.write_text(_corrupt_csv(_table(BOARDING), data))
    else:
        bad.write_text(_corrupt_toml((MODELS / name).read_text(), data))
    before = bad.read_bytes()
    out = folder / "out.nc"
    argv = _command(kind, name, bad, out, fit_file) + ["--out", str(out)]
    if kind == "fit":
        argv += ["--max-iterations", "1", "--no-uncertainty", "--no-progress"]
    if kind == "scenarios":
        argv += ["--days", "5"]
    capsys.readouterr()
    rc = main(argv)
    captured = capsys.readouterr()
    hypothesis.event(f"{kind}: exit {rc}")
    assert "Traceback" not in captured.err + captured.out
    assert bad.read_bytes() == before
    if rc == 0:
        xr.open_dataset(out).close()  # a readable output
    else:
        assert rc == 2
        lines = captured.err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("epifit: error: "), lines
        assert not out.exists()
