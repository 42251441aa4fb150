"""netCDF and CSV I/O of epifit.data: round trips through tmp_path, and errors."""

import os

import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import numpy as np
import pandas as pd
import pytest
import xarray as xr
from hypothesis import given, settings

from epifit.data import DataError, from_csv, open_dataset, write_dataset


def _full_dataset() -> xr.Dataset:
    """Observations, covariates and metadata of several dtypes."""
    rng = np.random.default_rng(0)
    n_time, patches = 6, np.array(["north", "south", "east"])
    cases = rng.poisson(5.0, (n_time, 3)).astype(np.float64)
    cases[2, 1] = np.nan
    return xr.Dataset(
        {
            "cases": (("time", "patch"), cases, {"units": "1", "long_name": "cases"}),
            "deaths": (("time", "patch"), rng.poisson(1.0, (n_time, 3)).astype("i4")),
            "mobility": (
                ("time", "patch", "feature"),
                rng.normal(size=(n_time, 3, 2)).astype(np.float32),
                {"long_name": "mobility index"},
            ),
            "coupling": (
                ("time", "patch", "patch_to"),
                rng.uniform(size=(n_time, 3, 3)),
            ),
            "population": ("patch", np.array([1000, 2500, 700], dtype=np.int64)),
            "closed": ("time", np.array([0, 0, 1, 1, 0, 0], dtype=bool)),
        },
        coords={
            "time": pd.date_range("2020-03-01", periods=n_time).to_numpy("M8[ns]"),
            "patch": patches,
            "patch_to": patches,
            "feature": np.array(["retail", "work"]),
        },
        attrs={
            "title": "test data",
            "source": "made up",
            "version": np.int64(3),
            "scale": 0.5,
            "levels": np.array([0.1, 0.5, 0.9]),
        },
    )


def _assert_round_trip(ds: xr.Dataset, back: xr.Dataset) -> None:
    xr.testing.assert_identical(ds, back)
    for name, var in ds.variables.items():
        assert back[name].dtype == var.dtype, name
        assert back[name].dims == var.dims, name
        assert back[name].attrs.keys() == var.attrs.keys(), name
    for key, value in ds.attrs.items():
        np.testing.assert_array_equal(back.attrs[key], value)
    assert list(back.data_vars) == list(ds.data_vars)


def test_netcdf_round_trip(tmp_path):
    ds = _full_dataset()
    path = write_dataset(ds, tmp_path / "data.nc")
    assert path == tmp_path / "data.nc"
    back = open_dataset(path)
    _assert_round_trip(ds, back)
    assert back["patch"].dtype.kind == "U"  # not object
    assert np.isnan(back["cases"].values[2, 1])
    assert sorted(os.listdir(tmp_path)) == ["data.nc"]  # no temporary left over


def test_netcdf_round_trip_integer_days(tmp_path):
    ds = xr.Dataset(
        {"in_bed": ("time", np.array([1.0, 3.0, np.nan]))},
        coords={"time": np.arange(10, 13, dtype=np.int64)},
    )
    back = open_dataset(write_dataset(ds, tmp_path / "d.nc"))
    _assert_round_trip(ds, back)


def test_netcdf_datetimes_other_resolution_keep_values(tmp_path):
    times = np.arange("1978-01-22", "1978-01-25", dtype="datetime64[D]")
    ds = xr.Dataset({"x": ("time", [1, 2, 3])}, coords={"time": times})
    back = open_dataset(write_dataset(ds, tmp_path / "d.nc"))
    assert back["time"].dtype == np.dtype("datetime64[ns]")
    np.testing.assert_array_equal(back["time"].values, times.astype("M8[ns]"))


def test_subset_of_opened_dataset_can_be_written(tmp_path):
    ds = _full_dataset()
    write_dataset(ds, tmp_path / "d.nc")
    part = open_dataset(tmp_path / "d.nc").isel(time=slice(1, 3), patch=[2, 0])
    back = open_dataset(write_dataset(part, tmp_path / "part.nc"))
    xr.testing.assert_identical(back, ds.isel(time=slice(1, 3), patch=[2, 0]))


def test_write_replaces_existing_file(tmp_path):
    path = tmp_path / "d.nc"
    write_dataset(_full_dataset(), path)
    small = xr.Dataset({"x": ("time", [1.0])}, coords={"time": [0]})
    write_dataset(small, path)
    _assert_round_trip(small, open_dataset(path))


def test_write_is_atomic_when_encoding_fails_midway(tmp_path, monkeypatch):
    path = tmp_path / "d.nc"
    old = _full_dataset()
    write_dataset(old, path)

    def broken(self, target, *args, **kwargs):
        with open(target, "wb") as f:
            f.write(b"half a file")
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(xr.Dataset, "to_netcdf", broken)
    with pytest.raises(DataError, match=r"Cannot write '.*d\.nc' as netCDF: disk"):
        write_dataset(old.isel(time=slice(0, 2)), path)
    monkeypatch.undo()
    _assert_round_trip(old, open_dataset(path))  # the old file is untouched
    assert sorted(os.listdir(tmp_path)) == ["d.nc"]  # temporary removed


def test_write_syncs_before_rename(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(
        os, "fsync", lambda fd: events.append("fsync") or real_fsync(fd)
    )
    monkeypatch.setattr(
        os,
        "replace",
        lambda a, b: events.append(("replace", a, b)) or real_replace(a, b),
    )
    write_dataset(_full_dataset(), tmp_path / "d.nc")
    replace = next(e for e in events if isinstance(e, tuple))
    assert events.index("fsync") < events.index(replace)
    src, dst = replace[1:]
    assert os.path.dirname(src) == str(tmp_path)  # same directory: rename is atomic
    assert dst == tmp_path / "d.nc"


def test_write_rejects_attribute_netcdf_cannot_hold(tmp_path):
    ds = _full_dataset()
    ds["cases"].attrs["meta"] = {"a": 1}
    with pytest.raises(
        DataError, match=r"Attribute 'meta' of variable 'cases' is a dict"
    ):
        write_dataset(ds, tmp_path / "d.nc")
    assert os.listdir(tmp_path) == []


def test_write_into_missing_directory(tmp_path):
    with pytest.raises(DataError, match=r"directory '.*nowhere' missing"):
        write_dataset(_full_dataset(), tmp_path / "nowhere" / "d.nc")


def test_open_missing_file_names_path(tmp_path):
    with pytest.raises(DataError, match=r"No such data file: '.*absent\.nc'"):
        open_dataset(tmp_path / "absent.nc")


def test_open_unreadable_file_names_path(tmp_path):
    path = tmp_path / "garbage.nc"
    path.write_text("this is not netCDF\n")
    with pytest.raises(DataError, match=r"Cannot read '.*garbage\.nc' as netCDF"):
        open_dataset(path)


def test_open_directory_names_path(tmp_path):
    with pytest.raises(DataError, match=r"is a directory"):
        open_dataset(tmp_path)


def test_open_does_not_keep_file_open(tmp_path):
    path = tmp_path / "d.nc"
    write_dataset(_full_dataset(), path)
    ds = open_dataset(path)
    os.remove(path)  # would fail on some platforms, and lose data lazily, if open
    assert float(ds["coupling"].sum()) > 0


@settings(max_examples=15, deadline=None)
@given(
    values=hnp.arrays(
        np.float64,
        hnp.array_shapes(min_dims=2, max_dims=2, min_side=1, max_side=6),
        elements=st.floats(0, 1e6) | st.just(np.nan),
    ),
    start=st.dates(min_value=pd.Timestamp("1900-01-01").date()),
)
def test_netcdf_round_trip_property(tmp_path_factory, values, start):
    n_time, n_patch = values.shape
    ds = xr.Dataset(
        {"cases": (("time", "patch"), values)},
        coords={
            "time": pd.date_range(start, periods=n_time).to_numpy("M8[ns]"),
            "patch": np.array([f"p{i:02d}" for i in range(n_patch)]),
        },
    )
    path = tmp_path_factory.mktemp("rt") / "d.nc"
    _assert_round_trip(ds, open_dataset(write_dataset(ds, path)))


# ------------------------------------------------------------------ CSV


def test_csv_long_layout_pivots_and_fills(tmp_path):
    path = tmp_path / "long.csv"
    path.write_text(
        "date,region,cases,deaths\n"
        "2020-03-02,south,4,0\n"
        "2020-03-01,north,1,0\n"
        "2020-03-01,south,2,\n"
        "2020-03-04,north,7,1\n"  # no row for 03-03 at all; no south on 03-04
        "2020-03-02,north,3,0\n"
    )
    ds = from_csv(path, patch="region", values=["cases", "deaths"])
    assert ds["cases"].dims == ("time", "patch")
    np.testing.assert_array_equal(
        ds["time"].values, np.arange("2020-03-01", "2020-03-05", dtype="M8[D]")
    )
    assert ds["patch"].values.tolist() == ["north", "south"]
    nan = np.nan
    np.testing.assert_array_equal(
        ds["cases"].values, [[1, 2], [3, 4], [nan, nan], [7, nan]]
    )
    np.testing.assert_array_equal(
        ds["deaths"].values, [[0, nan], [0, 0], [nan, nan], [1, nan]]
    )
    assert ds["cases"].dtype == np.float64
    assert ds.attrs["source"] == "long.csv"


def test_csv_wide_layout(tmp_path):
    path = tmp_path / "wide.csv"
    path.write_text("day,in_bed,convalescent\n0,3,0\n1,8,\n2,26,0\n")
    ds = from_csv(path, time="day", attrs={"source": "BMJ"})
    assert ds["in_bed"].dims == ("time",)
    assert ds["time"].values.tolist() == [0, 1, 2]
    np.testing.assert_array_equal(ds["convalescent"].values, [0, np.nan, 0])
    assert ds.attrs == {"source": "BMJ"}


def test_csv_keeps_leading_zeros_of_place_codes(tmp_path):
    path = tmp_path / "fips.csv"
    path.write_text("date,fips,cases\n2020-03-01,01001,1\n2020-03-01,10003,2\n")
    ds = from_csv(path, patch="fips")
    assert ds["patch"].values.tolist() == ["01001", "10003"]


def _long_frame(ds: xr.Dataset) -> pd.DataFrame:
    frame = ds.to_dataframe().reset_index()
    frame = frame.dropna(subset=list(ds.data_vars), how="all")  # absent rows
    return frame.sample(frac=1.0, random_state=1)  # any row order


@settings(max_examples=15, deadline=None)
@given(
    values=hnp.arrays(
        np.float64,
        hnp.array_shapes(min_dims=3, max_dims=3, min_side=1, max_side=5).map(
            lambda s: (s[0], s[1], 2)
        ),
        elements=st.integers(0, 10_000).map(float) | st.just(np.nan),
    ),
)
def test_csv_long_round_trip_property(tmp_path_factory, values):
    n_time, n_patch, _ = values.shape
    values[0, :, 0] = 1.0  # every patch has a row (on the first day)
    values[-1, -1, 1] = 2.0  # and the last day has one
    values[min(1, n_time - 1), 0, 0] = 3.0  # and the second: a daily table, not
    # one of every k-th day (at most 5 days: 1 stays the most common step)
    ds = xr.Dataset(
        {
            "cases": (("time", "patch"), values[..., 0]),
            "deaths": (("time", "patch"), values[..., 1]),
        },
        coords={
            "time": pd.date_range("2021-12-30", periods=n_time).to_numpy("M8[ns]"),
            "patch": np.array([f"region {i}" for i in range(n_patch)]),
        },
        attrs={"source": "test"},
    )
    for name in ds.data_vars:
        ds[name].attrs["period"] = 1  # from_csv records the period
    path = tmp_path_factory.mktemp("csv") / "long.csv"
    frame = _long_frame(ds).rename(columns={"time": "date", "patch": "place"})
    frame.to_csv(path, index=False, date_format="%Y-%m-%d")
    back = from_csv(
        path, patch="place", values=["cases", "deaths"], attrs={"source": "test"}
    )
    xr.testing.assert_identical(ds, back)


def test_csv_wide_round_trip(tmp_path):
    ds = xr.Dataset(
        {
            "in_bed": ("time", [3.0, 8.0, np.nan, 76.0]),
            "convalescent": ("time", [0.0] * 4),
        },
        coords={"time": pd.date_range("1978-01-22", periods=4).to_numpy("M8[ns]")},
        attrs={"source": "BMJ"},
    )
    path = tmp_path / "wide.csv"
    ds.to_dataframe().reset_index().rename(columns={"time": "date"}).to_csv(
        path, index=False
    )
    for name in ds.data_vars:
        ds[name].attrs["period"] = 1  # from_csv records the period
    xr.testing.assert_identical(ds, from_csv(path, attrs={"source": "BMJ"}))


@pytest.mark.parametrize(
    ("text", "kwargs", "message"),
    [
        ("date,cases\n", {}, r"'.*t\.csv' has a header but no rows"),
        (
            "when,cases\n2020-01-01,1\n",
            {},
            r"No time column 'date' in '.*t\.csv'; found \['when', 'cases'\]",
        ),
        (
            "date,cases\n2020-01-01,1\n",
            {"patch": "region"},
            r"No patch column 'region' in '.*'; found \['date', 'cases'\]",
        ),
        (
            "date,cases\n2020-01-01,1\n",
            {"values": ["deaths"]},
            r"No column 'deaths' in '.*'; found \['date', 'cases'\]",
        ),
        (
            "date,cases\n2020-01-01,1\nyesterday,2\n",
            {},
            r"Cannot read 'yesterday' in column 'date' of '.*' \(row 3\) as a date",
        ),
        (
            "date,cases\n2020-01-01,1\n2020-01-02,a few\n",
            {},
            r"Cannot read 'a few' in column 'cases' of '.*' \(row 3\) as a number",
        ),
        (
            "date,cases\n2020-01-01,1\n,2\n",
            {},
            r"Empty date in column 'date' of '.*' \(row 3\)",
        ),
        (
            "date,region,cases\n2020-01-01,a,1\n2020-01-01,,2\n",
            {"patch": "region"},
            r"Empty place in column 'region'",
        ),
        (
            "date,region,cases\n2020-01-01,a,1\n2020-01-02,a,2\n2020-01-01,a,3\n",
            {"patch": "region"},
            r"Duplicate rows for \{'date': '2020-01-01', 'region': 'a'\} in '.*' "
            r"\(file lines \[2, 4\]\)",
        ),
        (
            "date,cases\n2020-01-01,1\n2020-01-01,2\n",
            {},
            r"Duplicate rows for \{'date': .*\(file lines \[2, 3\]\)",
        ),
        (
            "date,cases\n2020-01-01,1\n",
            {"values": ["date"]},
            r"include the time or patch column",
        ),
        ("date\n2020-01-01\n", {}, r"No value columns in '.*'; found \['date'\]"),
    ],
)
def test_csv_errors(tmp_path, text, kwargs, message):
    path = tmp_path / "t.csv"
    path.write_text(text)
    with pytest.raises(DataError, match=message):
        from_csv(path, **kwargs)


def test_csv_missing_file(tmp_path):
    with pytest.raises(DataError, match=r"No such data file: '.*nope\.csv'"):
        from_csv(tmp_path / "nope.csv")


def test_csv_without_filling_keeps_gaps(tmp_path):
    # a daily table with a missing day (two dates two days apart alone would be
    # a series of every other day, period 2: see test_data_weekly.py)
    path = tmp_path / "gap.csv"
    path.write_text("date,cases\n2020-01-01,1\n2020-01-02,1\n2020-01-04,2\n")
    assert from_csv(path, fill_days=False).sizes["time"] == 3
    assert from_csv(path).sizes["time"] == 4
