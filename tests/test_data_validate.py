"""Binding a model to data: validate_dataset, time_index, weekday."""

import datetime

import hypothesis.strategies as st
import numpy as np
import pandas as pd
import pytest
import xarray as xr
from hypothesis import given, settings

from epifit.data import DataError, time_index, validate_dataset, weekday

PATCHES = ["a", "b", "c"]
OBS = {"cases": ("time", "patch")}
COV = {
    "mobility": ("time", "patch", "feature"),
    "coupling": ("time", "patch", "patch_to"),
    "population": ("patch",),
}


def make(n_time=5, patches=PATCHES, n_feature=2, start="2020-03-01", seed=0):
    rng = np.random.default_rng(seed)
    n = len(patches)
    return xr.Dataset(
        {
            "cases": (("time", "patch"), rng.poisson(4.0, (n_time, n)).astype(float)),
            "deaths": (("time", "patch"), rng.poisson(1.0, (n_time, n))),
            "in_bed": ("time", rng.poisson(9.0, n_time)),
            "mobility": (
                ("time", "patch", "feature"),
                rng.normal(size=(n_time, n, n_feature)),
            ),
            "coupling": (
                ("time", "patch", "patch_to"),
                rng.uniform(size=(n_time, n, n)),
            ),
            "population": ("patch", rng.integers(100, 1000, n)),
        },
        coords={
            "time": pd.date_range(start, periods=n_time).to_numpy("M8[ns]"),
            "patch": np.array(patches),
            "patch_to": np.array(patches),
        },
    )


def test_binds_arrays_in_requested_order_and_masks_nan():
    ds = make()
    ds["cases"][1, 2] = np.nan
    bound = validate_dataset(ds, observations=OBS, covariates=COV, patches=PATCHES)
    assert bound.patches == ("a", "b", "c")
    np.testing.assert_array_equal(bound.times, [0.0, 1.0, 2.0, 3.0, 4.0])
    assert bound.times.dtype == np.float64
    expected_mask = np.ones((5, 3), bool)
    expected_mask[1, 2] = False
    np.testing.assert_array_equal(bound.mask["cases"], expected_mask)
    assert bound.observed["cases"][1, 2] == 0.0
    np.testing.assert_array_equal(
        bound.observed["cases"][expected_mask], ds["cases"].values[expected_mask]
    )
    for name, dims in COV.items():
        np.testing.assert_array_equal(bound.covariates[name], ds[name].values)
        assert bound.covariates[name].dtype == np.float64
        assert bound.dataset[name].dims == dims


def test_transposed_variables_are_bound_day_major():
    ds = make()
    ds["mobility"] = ds["mobility"].transpose("feature", "patch", "time")
    bound = validate_dataset(ds, covariates={"mobility": COV["mobility"]})
    assert bound.covariates["mobility"].shape == (5, 3, 2)
    assert bound.covariates["mobility"].flags["C_CONTIGUOUS"]
    np.testing.assert_array_equal(
        bound.covariates["mobility"][2, 1], ds["mobility"].values[:, 1, 2]
    )


def test_does_not_modify_the_callers_dataset():
    ds = make()
    ds["mobility"] = ds["mobility"].transpose("feature", "patch", "time")
    before = ds.copy(deep=True)
    validate_dataset(
        ds, covariates={"mobility": COV["mobility"]}, patches=["c", "a", "b"]
    )
    xr.testing.assert_identical(ds, before)


def test_scalar_covariate_and_one_population():
    ds = xr.Dataset(
        {"in_bed": ("time", [3, 8, 26]), "population": ((), 763)},
        coords={"time": pd.date_range("1978-01-22", periods=3)},
    )
    bound = validate_dataset(
        ds, observations={"in_bed": ("time",)}, covariates={"population": ()}
    )
    assert bound.covariates["population"] == 763.0
    assert bound.patches is None


# ---------------------------------------------------------- documented errors


def test_missing_variable_lists_what_is_there():
    ds = make()[["deaths", "in_bed"]]
    with pytest.raises(
        DataError,
        match=r"^No variable 'cases' in dataset; found \['deaths', 'in_bed'\]$",
    ):
        validate_dataset(ds, observations=OBS)


def test_missing_dim():
    ds = make()
    ds["mobility"] = ds["mobility"].isel(feature=0)
    with pytest.raises(
        DataError,
        match=r"Variable 'mobility' has dims \('time', 'patch'\); expected \('time', "
        r"'patch', 'feature'\) \(missing \['feature'\]\)",
    ):
        validate_dataset(ds, covariates=COV)


def test_unexpected_dim():
    with pytest.raises(
        DataError,
        match=r"Variable 'cases' has dims \('time', 'patch'\); expected \('time',\) "
        r"\(unexpected \['patch'\]\)",
    ):
        validate_dataset(make(), observations={"cases": ("time",)})


def test_size_of_dim():
    with pytest.raises(
        DataError,
        match=r"Dimension 'feature' has size 2 in the dataset; expected 7 \(used by "
        r"\['mobility'\]\)",
    ):
        validate_dataset(make(), covariates=COV, sizes={"feature": 7})


def test_size_of_missing_dim():
    with pytest.raises(DataError, match=r"No dimension 'age' in dataset; found \["):
        validate_dataset(make(), covariates=COV, sizes={"age": 3})


@pytest.mark.parametrize("values", [np.array(["x"] * 5), np.zeros(5, bool)])
def test_dtype(values):
    ds = make().assign(in_bed=("time", values))
    with pytest.raises(
        DataError, match=r"Variable 'in_bed' has dtype .*; expected real numbers"
    ):
        validate_dataset(ds, observations={"in_bed": ("time",)})


def test_time_without_coordinate():
    ds = make().drop_vars("time")
    with pytest.raises(
        DataError, match=r"Dimension 'time' of variable 'cases' has no coordinate"
    ):
        validate_dataset(ds, observations=OBS)


def test_time_of_wrong_dtype():
    ds = make().assign_coords(time=np.arange(5) + 0.5)
    with pytest.raises(
        DataError,
        match=r"Coordinate 'time' has dtype float64; expected dates \(datetime64\) or "
        "integer day numbers",
    ):
        validate_dataset(ds, observations=OBS)


def test_duplicate_times():
    ds = make()
    times = ds["time"].values.copy()
    times[3] = times[2]
    with pytest.raises(
        DataError, match=r"Coordinate 'time' has duplicate values \['2020-03-03'\]"
    ):
        validate_dataset(ds.assign_coords(time=times), observations=OBS)


def test_unsorted_times():
    ds = make().isel(time=[0, 1, 3, 2, 4])
    with pytest.raises(
        DataError,
        match=r"Coordinate 'time' is not sorted: 2020-03-04 at index 2 comes before "
        r"2020-03-03; sort with ds.sortby\('time'\)",
    ):
        validate_dataset(ds, observations=OBS)


def test_irregular_times():
    ds = make().isel(time=[0, 1, 3, 4])
    with pytest.raises(
        DataError,
        match=r"Coordinate 'time' is not regular: a step of 2 days from 2020-03-02 to "
        r"2020-03-04 \(index 1\) where the axis's step is 1 day; the axis must be "
        r"regular \(daily, or every k days such as weekly\), with NaN for missing "
        r"points",
    ):
        validate_dataset(ds, observations=OBS)


def test_regular_integer_days_every_other_day():
    # a constant step of 2 days was "not daily"; it is now a regular axis
    ds = make().assign_coords(time=np.array([0, 2, 4, 6, 8]))
    bound = validate_dataset(ds, observations=OBS)
    assert bound.step == 2
    assert bound.times.tolist() == [0.0, 2.0, 4.0, 6.0, 8.0]


def test_irregular_integer_days():
    ds = make().assign_coords(time=np.array([0, 2, 4, 5, 7]))
    with pytest.raises(
        DataError, match=r"not regular: a step of 1 day from 4 to 5 \(index 2\)"
    ):
        validate_dataset(ds, observations=OBS)


def test_sub_daily_times():
    times = pd.date_range("2020-03-01", periods=5, freq="12h").to_numpy("M8[ns]")
    with pytest.raises(
        DataError,
        match=r"Coordinate 'time' is not in whole days: a step of 0.5 days from "
        r"2020-03-01 to ",
    ):
        validate_dataset(make().assign_coords(time=times), observations=OBS)


def test_nan_in_covariate_names_location():
    ds = make()
    ds["mobility"][1, 2, 0] = np.nan
    with pytest.raises(
        DataError,
        match=r"Covariate 'mobility' has 1 NaN value\(s\), first at time=2020-03-02, "
        r"patch='c', feature=0; covariates must be complete",
    ):
        validate_dataset(ds, observations=OBS, covariates=COV)


def test_infinite_observation():
    ds = make()
    ds["cases"][4, 0] = np.inf
    with pytest.raises(
        DataError,
        match=r"Observation 'cases' has 1 infinite value\(s\), first at "
        r"time=2020-03-05, patch='a'",
    ):
        validate_dataset(ds, observations=OBS)


def test_negative_counts():
    ds = make()
    ds["cases"][3, 1] = -2.0
    ds["cases"][4, 1] = -1.0
    with pytest.raises(
        DataError,
        match=r"Observation 'cases' has 2 negative value\(s\), first -2.0 at "
        r"time=2020-03-04, patch='b'; counts must be >= 0 \(use NaN for missing\)",
    ):
        validate_dataset(ds, observations=OBS)


def test_population_must_be_positive():
    ds = make()
    ds["population"][1] = 0
    with pytest.raises(
        DataError, match=r"Covariate 'population' must be > 0; found 0.0 at patch='b'"
    ):
        validate_dataset(ds, covariates=COV)


def test_patches_in_data_not_in_model():
    with pytest.raises(
        DataError,
        match=r"Patches in the dataset but not in the model: \['b'\]; pass "
        r"subset_patches=True to keep only the model's patches \['a', 'c'\]",
    ):
        validate_dataset(make(), observations=OBS, patches=["a", "c"])


def test_patches_in_model_not_in_data():
    with pytest.raises(
        DataError,
        match=r"Patches in the model but not in the dataset: \['d'\]; the dataset has "
        r"\['a', 'b', 'c'\]",
    ):
        validate_dataset(
            make(), observations=OBS, patches=["a", "d"], subset_patches=True
        )


def test_number_of_patches():
    with pytest.raises(
        DataError,
        match=r"The model has 4 patches but the dataset has 3: \['a', 'b', 'c'\]",
    ):
        validate_dataset(make(), observations=OBS, patches=4)
    assert validate_dataset(make(), observations=OBS, patches=3).patches == tuple(
        PATCHES
    )


def test_subset_patches_selects_and_reorders_coupling_too():
    ds = make(patches=["a", "b", "c", "d"])
    bound = validate_dataset(
        ds, observations=OBS, covariates=COV, patches=["d", "b"], subset_patches=True
    )
    assert bound.patches == ("d", "b")
    full = ds["coupling"].values
    np.testing.assert_array_equal(
        bound.covariates["coupling"], full[:, [3, 1]][:, :, [3, 1]]
    )
    np.testing.assert_array_equal(
        bound.observed["cases"], ds["cases"].values[:, [3, 1]]
    )
    np.testing.assert_array_equal(
        bound.covariates["population"], ds["population"].values[[3, 1]]
    )


def test_patch_labels_must_be_strings():
    ds = make().assign_coords(patch=[1, 2, 3], patch_to=[1, 2, 3])
    with pytest.raises(DataError, match=r"patch labels must be strings"):
        validate_dataset(ds, observations=OBS)


def test_duplicate_patch_labels():
    ds = make().assign_coords(patch=["a", "b", "a"], patch_to=["a", "b", "a"])
    with pytest.raises(
        DataError, match=r"Coordinate 'patch' has duplicate labels \['a'\]"
    ):
        validate_dataset(ds, observations=OBS)


def test_patch_to_must_match_patch():
    ds = make().assign_coords(patch_to=["a", "c", "b"])
    with pytest.raises(
        DataError,
        match=r"Coordinate 'patch_to' must hold the labels of 'patch' in the same "
        r"order",
    ):
        validate_dataset(ds, covariates=COV)


def test_patch_to_without_labels_takes_patch_labels():
    ds = make().drop_vars("patch_to")
    bound = validate_dataset(ds, covariates=COV, patches=["c", "b", "a"])
    np.testing.assert_array_equal(
        bound.covariates["coupling"], ds["coupling"].values[:, ::-1, ::-1]
    )


def test_patch_without_coordinate():
    ds = make().drop_vars(["patch", "patch_to"])
    with pytest.raises(
        DataError, match=r"Dimension 'patch' of variable 'cases' has no"
    ):
        validate_dataset(ds, observations=OBS)


def test_same_variable_requested_twice():
    with pytest.raises(ValueError, match=r"\['cases'\] are requested as observation"):
        validate_dataset(make(), observations=OBS, covariates={"cases": OBS["cases"]})


# --------------------------------------------------------- time_index, weekday


def test_time_index_dates_and_integer_days():
    ds = make(start="2020-02-27")  # across a leap day
    np.testing.assert_array_equal(time_index(ds), [0.0, 1.0, 2.0, 3.0, 4.0])
    ds = xr.Dataset(coords={"time": np.array([7, 8, 10])})
    np.testing.assert_array_equal(time_index(ds), [0.0, 1.0, 3.0])


def test_time_index_errors():
    with pytest.raises(DataError, match=r"No coordinate 'time'; found \['patch'\]"):
        time_index(xr.Dataset(coords={"patch": ["a"]}))
    with pytest.raises(DataError, match=r"has dtype <U1; expected dates"):
        time_index(xr.Dataset(coords={"time": ["x"]}))


def test_weekday_against_the_calendar():
    ds = make(n_time=10, start="1978-01-22")
    expected = [
        (datetime.date(1978, 1, 22) + datetime.timedelta(days=k)).weekday()
        for k in range(10)
    ]
    assert weekday(ds).tolist() == expected
    assert expected[0] == 6  # a Sunday
    with pytest.raises(DataError, match=r"needs dates"):
        weekday(xr.Dataset(coords={"time": np.arange(3)}))


# ------------------------------------------------------ properties (hypothesis)

shapes = st.tuples(st.integers(1, 12), st.integers(1, 5), st.integers(1, 3))


def _labelled(n_patch):
    return [f"p{i}" for i in range(n_patch)]


@settings(max_examples=40, deadline=None)
@given(shape=shapes, data=st.data())
def test_property_shapes_and_masks(shape, data):
    n_time, n_patch, n_feature = shape
    ds = make(n_time, _labelled(n_patch), n_feature, seed=data.draw(st.integers(0, 99)))
    missing = data.draw(
        st.lists(st.booleans(), min_size=n_time * n_patch, max_size=n_time * n_patch)
    )
    missing = np.array(missing).reshape(n_time, n_patch)
    ds["cases"] = ds["cases"].where(~missing)
    bound = validate_dataset(ds, observations=OBS, covariates=COV)
    assert bound.observed["cases"].shape == (n_time, n_patch)
    assert bound.covariates["mobility"].shape == (n_time, n_patch, n_feature)
    assert bound.covariates["coupling"].shape == (n_time, n_patch, n_patch)
    np.testing.assert_array_equal(bound.mask["cases"], ~missing)
    assert not np.isnan(bound.observed["cases"]).any()
    np.testing.assert_array_equal(bound.observed["cases"][missing], 0.0)
    np.testing.assert_array_equal(
        bound.observed["cases"][~missing], ds["cases"].values[~missing]
    )
    np.testing.assert_array_equal(bound.times, np.arange(n_time, dtype=float))


@settings(max_examples=30, deadline=None)
@given(n_time=st.integers(2, 12), data=st.data())
def test_property_duplicated_times(n_time, data):
    ds = make(n_time)
    i = data.draw(st.integers(0, n_time - 1))
    j = data.draw(st.integers(0, n_time - 1).filter(lambda j: j != i))
    times = ds["time"].values.copy()
    times[j] = times[i]
    with pytest.raises(DataError, match=r"Coordinate 'time' has duplicate values"):
        validate_dataset(ds.assign_coords(time=times), observations=OBS)


@settings(max_examples=30, deadline=None)
@given(n_time=st.integers(2, 12), data=st.data())
def test_property_unsorted_times(n_time, data):
    order = data.draw(
        st.permutations(range(n_time)).filter(lambda p: list(p) != sorted(p))
    )
    ds = make(n_time).isel(time=list(order))
    with pytest.raises(DataError, match=r"Coordinate 'time' is not sorted: "):
        validate_dataset(ds, observations=OBS)


def _days(n: int) -> str:
    return f"{n} day" if n == 1 else f"{n} days"


@settings(max_examples=30, deadline=None)
@given(
    steps=st.lists(st.sampled_from([1, 1, 1, 2, 3, 7]), min_size=1, max_size=10).filter(
        lambda s: len(set(s)) > 1
    ),
    dated=st.booleans(),
)
def test_property_irregular_times(steps, dated):
    days = np.concatenate([[0], np.cumsum(steps)])
    kinds, counts = np.unique(steps, return_counts=True)
    axis = int(kinds[np.argmax(counts)])  # the most common step, smallest if tied
    first = int(np.flatnonzero(np.array(steps) != axis)[0])
    times = (
        np.datetime64("2021-06-01", "ns") + days * np.timedelta64(1, "D")
        if dated
        else days
    )
    ds = make(len(days)).assign_coords(time=times)
    with pytest.raises(
        DataError,
        match=rf"not regular: a step of {_days(steps[first])} from .* "
        rf"\(index {first}\) where the axis's step is {_days(axis)};",
    ):
        validate_dataset(ds, observations=OBS)


@settings(max_examples=30, deadline=None)
@given(step=st.integers(1, 30), n_time=st.integers(1, 8), dated=st.booleans())
def test_property_regular_times(step, n_time, dated):
    days = np.arange(n_time) * step
    times = (
        np.datetime64("2021-06-01", "ns") + days * np.timedelta64(1, "D")
        if dated
        else days
    )
    bound = validate_dataset(make(n_time).assign_coords(time=times), observations=OBS)
    assert bound.step == (step if n_time > 1 else 1)
    np.testing.assert_array_equal(bound.times, days.astype(float))


@settings(max_examples=30, deadline=None)
@given(shape=shapes, data=st.data())
def test_property_nan_covariate_is_located(shape, data):
    n_time, n_patch, n_feature = shape
    ds = make(n_time, _labelled(n_patch), n_feature)
    t = data.draw(st.integers(0, n_time - 1))
    p = data.draw(st.integers(0, n_patch - 1))
    f = data.draw(st.integers(0, n_feature - 1))
    ds["mobility"][t, p, f] = np.nan
    date = str(ds["time"].values[t])[:10]
    with pytest.raises(
        DataError,
        match=rf"Covariate 'mobility' has 1 NaN value\(s\), first at time={date}, "
        rf"patch='p{p}', feature={f};",
    ):
        validate_dataset(ds, observations=OBS, covariates=COV)


@settings(max_examples=30, deadline=None)
@given(shape=shapes, data=st.data())
def test_property_negative_count_is_located(shape, data):
    n_time, n_patch, _ = shape
    ds = make(n_time, _labelled(n_patch))
    t = data.draw(st.integers(0, n_time - 1))
    p = data.draw(st.integers(0, n_patch - 1))
    ds["cases"][t, p] = -data.draw(st.floats(1e-9, 1e9))
    date = str(ds["time"].values[t])[:10]
    with pytest.raises(
        DataError,
        match=rf"Observation 'cases' has 1 negative value\(s\), first .* at "
        rf"time={date}, patch='p{p}'",
    ):
        validate_dataset(ds, observations=OBS)


@settings(max_examples=30, deadline=None)
@given(n_patch=st.integers(1, 6), data=st.data())
def test_property_patch_subsets(n_patch, data):
    labels = _labelled(n_patch)
    ds = make(4, labels)
    model = data.draw(
        st.permutations(labels).flatmap(
            lambda p: st.integers(1, n_patch).map(lambda k: list(p[:k]))
        )
    )
    extra = len(model) < n_patch
    if extra:
        with pytest.raises(
            DataError, match=r"Patches in the dataset but not in the model"
        ):
            validate_dataset(ds, observations=OBS, covariates=COV, patches=model)
    bound = validate_dataset(
        ds, observations=OBS, covariates=COV, patches=model, subset_patches=True
    )
    assert bound.patches == tuple(model)
    expected = ds.sel(patch=model, patch_to=model)
    np.testing.assert_array_equal(
        bound.covariates["coupling"], expected["coupling"].values
    )
    np.testing.assert_array_equal(bound.observed["cases"], expected["cases"].values)
