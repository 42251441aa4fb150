"""The bundled boarding-school outbreak carries the published numbers."""

import importlib.util
from pathlib import Path

import numpy as np
import xarray as xr

from epifit.data import open_dataset, time_index, validate_dataset, weekday

DATA = Path(__file__).resolve().parents[1] / "data"
FILE = DATA / "boarding_school_1978.nc"

# BMJ, 4 March 1978, p. 587: 763 boys; 14 consecutive days from 22 January 1978.
PUBLISHED_IN_BED = [3, 8, 26, 76, 225, 298, 258, 233, 189, 128, 68, 29, 14, 4]
PUBLISHED_CONVALESCENT = [0, 0, 0, 0, 9, 17, 105, 162, 176, 166, 150, 85, 47, 20]


def test_published_numbers():
    ds = open_dataset(FILE)
    assert ds["in_bed"].dims == ("time",)
    assert ds["in_bed"].values.tolist() == PUBLISHED_IN_BED
    assert ds["convalescent"].values.tolist() == PUBLISHED_CONVALESCENT
    assert int(ds["population"]) == 763
    assert str(ds["time"].values[0])[:10] == "1978-01-22"
    assert str(ds["time"].values[-1])[:10] == "1978-02-04"
    assert weekday(ds)[0] == 6  # 22 January 1978 was a Sunday
    assert (ds["in_bed"] + ds["convalescent"] <= ds["population"]).all()


def test_source_is_cited():
    ds = open_dataset(FILE)
    assert "British Medical Journal" in ds.attrs["source"]
    assert "4 March 1978" in ds.attrs["source"]
    assert "10.1136/bmj.1.6112.587" in ds.attrs["references"]
    for name in ("in_bed", "convalescent", "population"):
        assert ds[name].attrs["long_name"]
        assert "units" in ds[name].attrs


def test_binds_as_a_single_population():
    ds = open_dataset(FILE)
    bound = validate_dataset(
        ds,
        observations={"in_bed": ("time",), "convalescent": ("time",)},
        covariates={"population": ()},
    )
    np.testing.assert_array_equal(bound.times, np.arange(14.0))
    np.testing.assert_array_equal(time_index(ds), np.arange(14.0))
    assert bound.mask["in_bed"].all()
    assert bound.covariates["population"] == 763.0


def test_script_reproduces_the_committed_file(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "make_boarding_school", DATA / "make_boarding_school.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "school.nc"
    assert module.main(["--out", str(out)]) == 0
    xr.testing.assert_identical(open_dataset(out), open_dataset(FILE))
