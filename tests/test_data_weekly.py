"""Weekly (k-daily) series: from_csv, check_time, data_period, validate_dataset,
the netCDF round trip of `period` and `epifit data import` (issue 19)."""

import json
import re

import numpy as np
import pandas as pd
import pytest
import xarray as xr

from epifit.cli import main
from epifit.data import (
    DataError,
    data_period,
    from_csv,
    open_dataset,
    validate_dataset,
    write_dataset,
)
from epifit.data._validate import check_time

WEEKLY = """\
date,region,cases
2020-03-01,north,3
2020-03-01,south,1
2020-03-08,north,5
2020-03-08,south,2
2020-03-22,north,4
"""


@pytest.fixture(autouse=True)
def _no_persistent_cache(monkeypatch):
    """`main` would enable JAX's persistent compilation cache for the session."""
    monkeypatch.setenv("EPIFIT_NO_CACHE", "1")


def _dates(ds: xr.Dataset) -> list[str]:
    return ds["time"].values.astype("datetime64[D]").astype(str).tolist()


def _weekly(n: int = 4, period=7, step: int = 7) -> xr.Dataset:
    ds = xr.Dataset(
        {"cases": ("time", np.arange(n, dtype=float)), "population": 100.0},
        coords={"time": pd.date_range("2020-03-01", periods=n, freq=f"{step}D")},
    )
    if period is not None:
        ds["cases"].attrs["period"] = period
    return ds


# ------------------------------------------------------------------ from_csv


def test_weekly_table_stays_weekly(tmp_path):
    path = tmp_path / "weekly.csv"
    path.write_text("date,cases\n2020-03-01,3\n2020-03-08,5\n2020-03-15,4\n")
    ds = from_csv(path)
    assert _dates(ds) == ["2020-03-01", "2020-03-08", "2020-03-15"]
    assert ds["cases"].values.tolist() == [3.0, 5.0, 4.0]  # no NaN days between
    assert ds["cases"].attrs["period"] == 7
    assert type(ds["cases"].attrs["period"]) is int


def test_missing_week_is_nan_on_the_weekly_axis(tmp_path):
    path = tmp_path / "weekly.csv"
    path.write_text(WEEKLY)
    ds = from_csv(path, patch="region")
    assert _dates(ds) == ["2020-03-01", "2020-03-08", "2020-03-15", "2020-03-22"]
    nan = np.nan
    np.testing.assert_array_equal(
        ds["cases"].values, [[3.0, 1.0], [5.0, 2.0], [nan, nan], [4.0, nan]]
    )
    assert ds["cases"].attrs == {"period": 7}
    # without filling, the missing week stays out
    kept = from_csv(path, patch="region", fill_days=False)
    assert _dates(kept) == ["2020-03-01", "2020-03-08", "2020-03-22"]
    assert kept["cases"].attrs == {"period": 7}


def test_weekly_day_numbers_and_other_periods(tmp_path):
    path = tmp_path / "days.csv"
    path.write_text("day,cases\n0,1\n7,2\n21,3\n")
    ds = from_csv(path, time="day")
    assert ds["time"].values.tolist() == [0, 7, 14, 21]
    assert ds["cases"].attrs["period"] == 7
    path.write_text("date,cases\n2020-01-01,1\n2020-01-03,2\n")  # every other day
    ds = from_csv(path)
    assert _dates(ds) == ["2020-01-01", "2020-01-03"]
    assert ds["cases"].attrs["period"] == 2


def test_daily_table_unchanged(tmp_path):
    path = tmp_path / "daily.csv"
    path.write_text(
        "date,cases,deaths\n2020-03-01,1,0\n2020-03-02,2,0\n2020-03-04,4,1\n"
    )
    ds = from_csv(path)
    assert _dates(ds) == ["2020-03-01", "2020-03-02", "2020-03-03", "2020-03-04"]
    np.testing.assert_array_equal(ds["cases"].values, [1.0, 2.0, np.nan, 4.0])
    assert ds["cases"].attrs == {"period": 1}
    assert ds["deaths"].attrs == {"period": 1}
    path.write_text("date,cases\n2020-03-01,1\n")  # a single date is daily
    assert from_csv(path)["cases"].attrs == {"period": 1}


def test_steps_of_no_one_period_are_an_error(tmp_path):
    path = tmp_path / "mixed.csv"
    path.write_text(
        "date,cases\n2020-03-01,1\n2020-03-08,2\n2020-03-11,3\n2020-03-18,4\n"
    )
    message = (
        f"Dates of '{path}' are not regularly spaced: a step of 3 days from "
        "2020-03-08 to 2020-03-11 is not a multiple of the step of 7 days between "
        "most dates (as from 2020-03-01 to 2020-03-08); steps found: [3, 7] days."
    )
    with pytest.raises(DataError, match=re.escape(message)):
        from_csv(path)
    # kept as they are without filling, but with no period to record
    kept = from_csv(path, fill_days=False)
    assert kept.sizes["time"] == 4
    assert "period" not in kept["cases"].attrs


def test_a_stray_date_in_a_weekly_series_is_named(tmp_path):
    path = tmp_path / "stray.csv"
    path.write_text(
        "date,cases\n2020-03-01,1\n2020-03-08,2\n2020-03-09,3\n2020-03-15,4\n"
        "2020-03-22,5\n"
    )
    with pytest.raises(
        DataError, match=r"a step of 1 day from 2020-03-08 to 2020-03-09 is not a "
    ):
        from_csv(path)


# -------------------------------------------------------- check_time, binding


@pytest.mark.parametrize("dated", [True, False])
def test_check_time_accepts_a_weekly_axis(dated):
    ds = _weekly(4)
    if not dated:
        ds = ds.assign_coords(time=np.array([0, 7, 14, 21]))
    assert check_time(ds, "cases") == 7
    assert check_time(_weekly(4, step=1), "cases") == 1
    assert check_time(_weekly(1), "cases") == 1


def test_check_time_refuses_an_irregular_axis():
    ds = _weekly(4).isel(time=[0, 1, 3])  # steps 7 and 14 (tied: 7 is the step)
    with pytest.raises(
        DataError,
        match=r"Coordinate 'time' is not regular: a step of 14 days from 2020-03-08 "
        r"to 2020-03-22 \(index 1\) where the axis's step is 7 days",
    ):
        check_time(ds, "cases")
    ds = _weekly(5).isel(time=[0, 1, 2, 4])  # steps 7, 7, 14
    with pytest.raises(
        DataError,
        match=r"is not regular: a step of 14 days from 2020-03-15 to 2020-03-29 "
        r"\(index 2\) where the axis's step is 7 days; the axis must be regular "
        r"\(daily, or every k days such as weekly\), with NaN for missing points",
    ):
        check_time(ds, "cases")


def test_validate_dataset_binds_a_weekly_axis():
    bound = validate_dataset(
        _weekly(4), observations={"cases": ("time",)}, covariates={"population": ()}
    )
    assert bound.step == 7
    np.testing.assert_array_equal(bound.times, [0.0, 7.0, 14.0, 21.0])
    assert bound.observed["cases"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert validate_dataset(_weekly(), covariates={"population": ()}).step is None
    with pytest.raises(DataError, match=r"Variable 'cases' has attribute period=14"):
        validate_dataset(_weekly(4, period=14), observations={"cases": ("time",)})


# ------------------------------------------------------------- data_period


def test_data_period_from_the_attribute_or_the_axis():
    assert data_period(_weekly(4), "cases") == 7
    assert data_period(_weekly(4, period=None), "cases") == 7  # inferred
    assert data_period(_weekly(4, period=None, step=1), "cases") == 1
    assert data_period(_weekly(4, period=np.int64(7)), "cases") == 7
    # weekly totals on a daily axis (NaN between): the attribute counts
    assert data_period(_weekly(15, period=7, step=1), "cases") == 7
    assert data_period(_weekly(), "population") is None  # no time dim


@pytest.mark.parametrize("bad", [0, -7, 7.0, 7.5, "7", True])
def test_data_period_refuses_a_bad_attribute(bad):
    with pytest.raises(
        DataError,
        match=rf"Variable 'cases' has attribute period={re.escape(repr(bad))}; "
        r"expected a whole number of days >= 1",
    ):
        data_period(_weekly(4, period=bad), "cases")


def test_data_period_refuses_an_attribute_unlike_the_axis():
    with pytest.raises(
        DataError,
        match=r"Variable 'cases' has attribute period=7 but its 'time' axis has a "
        r"step of 14 days; the two must agree",
    ):
        data_period(_weekly(4, period=7, step=14), "cases")
    with pytest.raises(DataError, match=r"No variable 'deaths' in dataset"):
        data_period(_weekly(4), "deaths")


def test_period_survives_netcdf(tmp_path):
    ds = _weekly(4)
    back = open_dataset(write_dataset(ds, tmp_path / "weekly.nc"))
    xr.testing.assert_identical(ds, back)
    assert type(back["cases"].attrs["period"]) is int
    assert data_period(back, "cases") == 7


# --------------------------------------------------------------------- CLI


def test_cli_imports_a_weekly_table(tmp_path, capsys):
    table = tmp_path / "weekly.csv"
    table.write_text(WEEKLY)
    out = tmp_path / "weekly.nc"
    argv = ["data", "import", str(table), "--out", str(out), "--patch", "region"]
    assert main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {
        "out": str(out),
        "variables": ["cases"],
        "days": 28,
        "times": 4,
        "period": 7,
        "patches": 2,
    }
    ds = open_dataset(out)
    assert _dates(ds) == ["2020-03-01", "2020-03-08", "2020-03-15", "2020-03-22"]
    assert ds["cases"].attrs == {"period": 7}
    assert main(argv) == 0
    assert capsys.readouterr().out.strip() == (
        f"wrote {out}: cases, 4 dates (every 7 days) x 2 patches"
    )


def test_cli_refuses_steps_of_no_one_period(tmp_path, capsys):
    table = tmp_path / "mixed.csv"
    table.write_text("date,cases\n2020-03-01,1\n2020-03-08,2\n2020-03-11,3\n")
    out = tmp_path / "mixed.nc"
    assert main(["data", "import", str(table), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(
        f"epifit: error: Dates of '{table}' are not regularly spaced: a step of "
    )
    assert not out.exists()
