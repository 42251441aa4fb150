"""Forecasts of stratified models (`[strata]`): the cells mapped onto `(patch,
age)` in the outputs, scenarios whose patches mean all strata of a patch.
References: `epifit.simulate` of the same horizon (no scenario code), solves
on changed data or parameters, and sums over strata."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import xarray as xr

import epifit
from epifit.cli import main
from epifit.fitting import FitResult
from epifit.forecasting import Change, Scenario, ScenarioError, forecast
from epifit.model import loads_model
from epifit.ode import RK4, ConstantStepSize
from epifit.simulation import Problem

AGES = ["0-19", "20-64", "65+"]
C = np.array([[7.0, 5.0, 1.0], [2.0, 8.0, 2.0], [1.0, 4.0, 3.0]])
POP = np.array([[20000.0, 55000.0, 25000.0], [10000.0, 30000.0, 5000.0]])
TRAVEL = np.array([[0.9, 0.1], [0.2, 0.8]])
N_FIT, DAYS = 40, 20
TIGHT = {"rtol": 1e-10, "atol": 1e-10}
# a fixed step: cells that do not interact compute bit for bit the same
FIXED = {"solver": RK4(), "stepsize_controller": ConstantStepSize(dt0=0.25)}
REGION, AGE_TRAVEL = "models/seir_age_region.toml", "models/seir_age_travel.toml"
CHANGE_DAY = N_FIT + 5


def region_data(seed=0) -> xr.Dataset:
    """Cases drawn (Poisson) from the region model at its initial values."""
    regions = ["r0", "r1"]
    ds = xr.Dataset(
        {
            "population": (("patch", "age"), POP),
            "contacts": (("age", "age_to"), C),
            "travel": (("patch", "patch_to"), TRAVEL),
            "cases": (("time", "patch"), np.ones((N_FIT, 2))),
            "cases_by_age": (("time", "patch", "age"), np.ones((N_FIT, 2, 3))),
        },
        coords={
            "patch": regions,
            "patch_to": regions,
            "age": AGES,
            "age_to": AGES,
            "time": pd.date_range("2021-01-04", periods=N_FIT),
        },
    )
    problem = Problem(REGION, ds)
    params = problem.init_params()
    rng = np.random.default_rng(seed)
    for name, mu in problem.predict(params, problem.solve(params).ys).items():
        full = np.full(ds[name].shape, np.nan)
        full[1:] = rng.poisson(np.asarray(mu)).reshape(full[1:].shape)
        ds[name] = (ds[name].dims, full)
    return ds


def by_day(ds: xr.Dataset, days: int = N_FIT, **daily) -> xr.Dataset:
    """`ds` over `days` days (observations NaN past the data) with the
    covariates `daily` given per day, `(time, ...)`."""
    ds = ds.reindex(time=pd.date_range("2021-01-04", periods=days))
    for name, value in daily.items():
        dims = ds[name].dims if "time" in ds[name].dims else ("time", *ds[name].dims)
        ds[name] = (dims, value)
    return ds


@pytest.fixture(scope="module")
def data():
    return region_data()


def _estimate(fc, name, scenario="baseline"):
    return fc[f"estimate_{name}"].sel(scenario=scenario)


@pytest.mark.parametrize("model", [REGION, AGE_TRAVEL])
def test_the_baseline_is_a_simulate_of_the_horizon(model, data):
    problem = Problem(model, data)
    params = problem.init_params()
    fc = forecast(
        problem,
        params=params,
        samples=0,
        days=DAYS,
        compartments=list("SEIR"),
        observation_noise=False,  # the quantiles below are the point's, exactly
        **TIGHT,
    )
    # on the horizon's days: simulate predicts on the days of the data's time axis
    horizon = by_day(data, N_FIT + DAYS)
    sim = epifit.simulate(model, horizon, params, days=N_FIT + DAYS, **TIGHT)
    assert fc.sizes["age"] == 3 and list(fc["age"].values) == AGES
    cell = ("scenario", "quantile", "time", "patch", "age")
    cells = ("time", "patch", "age")
    for name, simulated, dims in [
        ("cases", "predicted_cases", ("time", "patch")),  # strata = "sum"
        ("cases_by_age", "predicted_cases_by_age", cells),  # strata = "each"
        ("S", "S", cells),
        ("R", "R", cells),
        ("R_eff", "R_eff", cells),
        ("R_eff_total", "R_eff_total", ("time",)),
    ]:
        got, want = _estimate(fc, name), sim[simulated]
        assert got.dims == dims == want.dims, name
        # the same solve, saved on the same days: equal to rounding
        np.testing.assert_allclose(got.values, want.values, rtol=1e-10, atol=1e-10)
    assert fc["cases_by_age"].dims == cell and fc["R_eff"].dims == cell
    assert fc["peak_cases_by_age"].dims == ("scenario", "quantile", "patch", "age")
    assert fc["cases"].dims == ("scenario", "quantile", "time", "patch")
    # summed over strata, as the model declares it: the sum of the age groups
    each = _estimate(fc, "cases_by_age").sum("age").values[1:]
    np.testing.assert_allclose(_estimate(fc, "cases").values[1:], each, rtol=1e-12)
    total = fc["cases_by_age_total"].sel(scenario="baseline", quantile=0.5).values[1:]
    np.testing.assert_allclose(total, each.sum(-1), rtol=1e-12)
    observed = fc["observed_cases_by_age"]
    assert observed.dims == ("time", "patch", "age")
    np.testing.assert_array_equal(
        observed.values[1:N_FIT], data["cases_by_age"].values[1:]
    )
    assert np.isnan(observed.values[N_FIT:]).all()


def test_a_region_s_transmission_change_changes_only_its_cells(data):
    problem = Problem(REGION, data)  # regions do not meet: kron(I, C)
    half = Scenario(
        "half_r0",
        [Change(transmission=True, scale=0.5, start=CHANGE_DAY, patches=["r0"])],
    )
    fc = forecast(
        problem,
        [half],
        params=problem.init_params(),
        samples=0,
        days=DAYS,
        compartments=["I"],
        **FIXED,
    )
    for name in ("I", "cases_by_age", "cases", "R_eff"):
        base, new = _estimate(fc, name), _estimate(fc, name, "half_r0")
        np.testing.assert_array_equal(new.sel(patch="r1"), base.sel(patch="r1"))
        before = slice(None, CHANGE_DAY)
        np.testing.assert_array_equal(new[before], base[before])
    # every age group of r0 changes after the change day
    base, new = _estimate(fc, "I").sel(patch="r0"), _estimate(fc, "I", "half_r0")
    gap = np.abs(new.sel(patch="r0") - base).values[CHANGE_DAY + 3 :]
    assert np.all(gap > 1e-3 * base.values[CHANGE_DAY + 3 :])
    # halving transmission halves the R_eff of r0's new infections that day
    r_base = _estimate(fc, "R_eff").sel(patch="r0").values[CHANGE_DAY]
    r_new = _estimate(fc, "R_eff", "half_r0").sel(patch="r0").values[CHANGE_DAY]
    np.testing.assert_allclose(r_new, r_base / 2, rtol=1e-12)


def test_with_travel_a_region_s_change_reaches_the_other_region(data):
    problem = Problem(AGE_TRAVEL, data)
    half = Scenario(
        "half_r0",
        [Change(transmission=True, scale=0.5, start=CHANGE_DAY, patches=["r0"])],
    )
    fc = forecast(
        problem,
        [half],
        params=problem.init_params(),
        samples=0,
        days=DAYS,
        compartments=["I"],
        **FIXED,
    )
    base, new = _estimate(fc, "I").sel(patch="r1"), _estimate(fc, "I", "half_r0")
    new = new.sel(patch="r1")
    np.testing.assert_array_equal(new[:CHANGE_DAY], base[:CHANGE_DAY])
    assert np.all(np.abs(new - base).values[CHANGE_DAY + 3 :] > 0)


def test_a_per_patch_parameter_change_equals_a_solve_with_it_changed(data):
    problem = Problem(REGION, data)
    params = problem.init_params()
    scenario = Scenario(
        "q_r1", [Change(parameter="q", scale=0.5, start=0, patches=["r1"])]
    )
    fc = forecast(problem, [scenario], params=params, samples=0, days=DAYS, **TIGHT)
    halved = {**params, "q": params["q"] * np.array([1.0, 0.5])}  # identity transform
    horizon = by_day(data, N_FIT + DAYS)
    sim = epifit.simulate(REGION, horizon, halved, days=N_FIT + DAYS, **TIGHT)
    np.testing.assert_allclose(
        _estimate(fc, "cases_by_age", "q_r1").values,
        sim["predicted_cases_by_age"].values,
        rtol=1e-10,
    )
    bad = Scenario("s", [Change(parameter="susceptibility", scale=2, patches=["r1"])])
    with pytest.raises(ScenarioError, match="'susceptibility' is not per patch"):
        forecast(problem, [bad], params=params, samples=0, days=DAYS)


def test_a_parameter_per_patch_and_stratum_changes_in_every_stratum_named(data):
    old = 'transform = "softplus", per_stratum = true }'
    text = open(REGION).read()
    assert old in text
    text = text.replace(
        old, 'transform = "softplus", per_stratum = true, per_patch = true }'
    )
    spec = loads_model(text, name="susceptibility_by_region")
    problem = Problem(spec, data)
    params = problem.init_params()
    assert params["susceptibility"].shape == (2, 3)
    scenario = Scenario(
        "s", [Change(parameter="susceptibility", scale=2.0, start=0, patches=["r1"])]
    )
    fc = forecast(problem, [scenario], params=params, samples=0, days=DAYS, **TIGHT)
    values = problem.model.constrain(params)
    values = {p.name: values[p.name] for p in spec.parameters}
    doubled = np.asarray(values["susceptibility"]) * np.array([[1.0], [2.0]])
    changed = problem.model.unconstrain({**values, "susceptibility": doubled})
    horizon = by_day(data, N_FIT + DAYS)
    sim = epifit.simulate(spec, horizon, changed, days=N_FIT + DAYS, **TIGHT)
    np.testing.assert_allclose(
        _estimate(fc, "cases_by_age", "s").values,
        sim["predicted_cases_by_age"].values,
        rtol=1e-10,
    )


def _time_varying(text: str, name: str, dims: str) -> str:
    old = f"{name} = {{ dims = [{dims}] }}"
    assert old in text
    return text.replace(old, f'{name} = {{ dims = ["time", {dims}], rule = "floor" }}')


def test_a_change_of_the_travel_matrix_equals_a_solve_on_changed_data(data):
    text = _time_varying(open(AGE_TRAVEL).read(), "travel", '"patch", "patch_to"')
    spec = loads_model(text, name="travel_by_day")
    days = N_FIT + DAYS
    problem = Problem(spec, by_day(data, travel=np.repeat(TRAVEL[None], N_FIT, 0)))
    params = problem.init_params()
    closed = Scenario(
        "closed",
        [Change(covariate="travel", scale=0.0, start=CHANGE_DAY, inflow=["r1"])],
    )
    fc = forecast(problem, [closed], params=params, samples=0, days=DAYS, **TIGHT)
    changed = np.repeat(TRAVEL[None], days, axis=0)
    changed[CHANGE_DAY:, 1, :] = 0.0  # r1 meets nobody: its rows of M
    sim = epifit.simulate(
        spec, by_day(data, days, travel=changed), params, days=days, **TIGHT
    )
    got = _estimate(fc, "cases_by_age", "closed").values
    np.testing.assert_allclose(got, sim["predicted_cases_by_age"].values, rtol=1e-9)
    # r1 is infected by nobody from the change day on: no new cases there
    assert np.all(got[CHANGE_DAY + 1 :, 1] == 0.0)
    assert np.all(got[CHANGE_DAY + 1 :, 0] > 0.0)


def test_a_covariate_change_in_a_region_reaches_all_its_age_groups(data):
    text = open(REGION).read()
    for old, new in [
        (
            'transmission = "q * susceptibility"',
            'transmission = "q * susceptibility * w"',
        ),
        (
            "[covariates]\n",
            '[covariates]\nw = { dims = ["time", "patch"], rule = "floor" }\n',
        ),
    ]:
        assert old in text
        text = text.replace(old, new)
    spec = loads_model(text, name="weighted_transmission")
    problem = Problem(spec, data.assign(w=(("time", "patch"), np.ones((N_FIT, 2)))))
    assert problem.covariates["w"].shape == (N_FIT, 6)  # on the cells
    stop = Scenario(
        "stop_r0",
        [Change(covariate="w", scale=0.0, start=CHANGE_DAY, patches=["r0"])],
    )
    fc = forecast(
        problem, [stop], params=problem.init_params(), samples=0, days=DAYS, **FIXED
    )
    base = _estimate(fc, "cases_by_age").values
    new = _estimate(fc, "cases_by_age", "stop_r0").values
    np.testing.assert_array_equal(new[:, 1], base[:, 1])  # r1 as it was
    np.testing.assert_array_equal(new[: CHANGE_DAY + 1], base[: CHANGE_DAY + 1])
    assert np.all(new[CHANGE_DAY + 1 :, 0] == 0.0)  # no age group of r0 infected
    assert np.all(base[CHANGE_DAY + 1 :, 0] > 0.0)


def test_a_contact_matrix_of_kron_has_no_patches_to_select(data):
    text = _time_varying(open(AGE_TRAVEL).read(), "contacts", '"age", "age_to"')
    spec = loads_model(text, name="contacts_by_day")
    days = N_FIT + DAYS
    problem = Problem(spec, by_day(data, contacts=np.repeat(C[None], N_FIT, 0)))
    params = problem.init_params()
    bad = Scenario("s", [Change(covariate="contacts", scale=0.5, inflow=["r0"])])
    with pytest.raises(
        ScenarioError,
        match=r"changes\[0\].inflow: covariate 'contacts' is the contact matrix "
        r"over strata of kron\(M, C\): it has no patches",
    ):
        forecast(problem, [bad], params=params, samples=0, days=DAYS)
    # changed whole, it scales every contact: a solve with C halved
    whole = Scenario("s", [Change(covariate="contacts", scale=0.5, start=CHANGE_DAY)])
    fc = forecast(problem, [whole], params=params, samples=0, days=DAYS, **TIGHT)
    halved = np.repeat(C[None], days, axis=0)
    halved[CHANGE_DAY:] /= 2
    sim = epifit.simulate(
        spec, by_day(data, days, contacts=halved), params, days=days, **TIGHT
    )
    np.testing.assert_allclose(
        _estimate(fc, "cases", "s").values, sim["predicted_cases"].values, rtol=1e-9
    )


# -- a fitted stratified model, through the CLI and the Python API ----------------
@pytest.fixture(scope="module")
def fit_file(data, tmp_path_factory):
    folder = tmp_path_factory.mktemp("strata_fit")
    data_file = folder / "DATA.nc"
    data.to_netcdf(data_file)
    fit = epifit.calibrate(REGION, data_file, optimizer="lbfgs", progress=False)
    assert fit.converged, fit.message
    path = folder / "FIT.nc"
    fit.to_netcdf(path)
    return fit, path


@pytest.mark.slow
def test_cli_forecast_of_a_fitted_stratified_model(fit_file, tmp_path, capsys):
    fit, path = fit_file
    # the fit file reads back: per-stratum parameters bound to its patches
    again = FitResult.from_netcdf(path)
    for name in ("susceptibility", "q"):
        np.testing.assert_array_equal(again.params[name], fit.params[name])
    assert again.problem.n_cells == 6
    out = tmp_path / "F.nc"
    argv = ["forecast", str(path), "--days", str(DAYS), "--samples", "8"]
    rc = main(
        [*argv, "--seed", "3", "--compartments", "I", "--out", str(out), "--json"]
    )
    assert rc == 0, capsys.readouterr().err
    summary = json.loads(capsys.readouterr().out)
    assert set(summary["scenarios"]["baseline"]) == {
        "failed_samples",
        "cases",
        "cases_by_age",
    }
    ds = xr.open_dataset(out)
    assert ds["cases_by_age"].dims == ("scenario", "quantile", "time", "patch", "age")
    assert ds["I"].dims == ("scenario", "quantile", "time", "patch", "age")
    assert ds["cases"].dims == ("scenario", "quantile", "time", "patch")
    # the Python API gives the same forecast from the same file and seed
    api = forecast(path, days=DAYS, samples=8, seed=3, compartments=["I"])
    for name in ("cases_by_age", "cases", "I", "R_eff", "estimate_cases_by_age"):
        np.testing.assert_array_equal(ds[name].values, api[name].values)
    # the point estimate is a simulate of the horizon at the fitted parameters
    s = fit.settings
    sim = epifit.simulate(
        REGION,
        by_day(fit.problem.dataset, N_FIT + DAYS),
        fit.params,
        days=N_FIT + DAYS,
        rtol=s["rtol"],
        atol=s["atol"],
    )
    np.testing.assert_allclose(
        ds["estimate_cases_by_age"].sel(scenario="baseline").values,
        sim["predicted_cases_by_age"].values,
        rtol=1e-10,
    )
    med = ds["cases_by_age"].sel(scenario="baseline", quantile=0.5).values
    assert np.all(np.isfinite(med[1:])) and np.all(med[1:] >= 0)
    lo = ds["cases_by_age"].sel(quantile=0.025).values[:, N_FIT:]
    hi = ds["cases_by_age"].sel(quantile=0.975).values[:, N_FIT:]
    assert np.all(hi - lo > 0)  # the draws spread every cell


def test_a_derived_series_of_a_stratified_model_is_forecast_on_its_cells(data):
    """A series reading per-age parameters and a `(patch, age)` covariate
    comes out on `(patch, age)`, equal to simulate's over the horizon."""
    text = (
        open(REGION)
        .read()
        .replace(
            "[covariates]",
            '[derived]\nrisk = "q * susceptibility * I / population"\n\n[covariates]',
            1,
        )
    )
    model = loads_model(text, path=REGION)
    problem = Problem(model, data)
    params = problem.init_params()
    fc = forecast(problem, params=params, samples=0, days=DAYS, **TIGHT)
    horizon = by_day(data, N_FIT + DAYS)
    sim = epifit.simulate(model, horizon, params, days=N_FIT + DAYS, **TIGHT)
    got = _estimate(fc, "risk")
    assert fc["risk"].dims == ("scenario", "quantile", "time", "patch", "age")
    assert got.dims == sim["risk"].dims == ("time", "patch", "age")
    np.testing.assert_allclose(got.values, sim["risk"].values, rtol=1e-10)
    assert "risk_total" not in fc  # a ratio per cell is not additive
