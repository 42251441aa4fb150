"""`[initial]` expressions and an infection's `population` read per-patch
variables of the dataset (issue 20, item 6): `S = "population - I0"` in
simulate, calibrate and forecast."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import xarray as xr
from helpers import to_toml

import epifit
from epifit.forecasting import forecast
from epifit.model import loads_model
from epifit.simulation import Problem

MODEL = {
    "name": "sir_regions",
    "compartments": ["S", "I", "R"],
    "parameters": {
        "beta": {"value": 0.5, "transform": "softplus"},
        "gamma": {"value": 0.2, "transform": "softplus"},
        "I0": {"value": 5.0, "transform": "softplus"},
    },
    "covariates": {"population": {"dims": ["patch"]}},
    "infections": [
        {
            "from": "S",
            "to": "I",
            "transmission": "beta",
            "infectious": ["I"],
            "normalize": "population",
            "population": "population",
        }
    ],
    "transitions": [{"from": "I", "to": "R", "rate": "gamma"}],
    "initial": {"S": "population - I0", "I": "I0"},
    "observations": [
        {"name": "cases", "kind": "flow", "transition": "S->I", "family": "poisson"}
    ],
}
POPULATION = np.array([1000.0, 5000.0])


@pytest.fixture(scope="module")
def data():
    spec = loads_model(to_toml(MODEL), path="sir_regions.toml")
    ds = xr.Dataset(
        {
            "population": ("patch", POPULATION),
            "cases": (("time", "patch"), np.ones((40, 2))),
        },
        coords={"patch": ["a", "b"], "time": pd.date_range("2020-01-01", periods=40)},
    )
    problem = Problem(spec, ds)
    params = problem.init_params()
    truth = np.asarray(problem.predict(params, problem.solve(params).ys)["cases"])
    ds["cases"] = (("time", "patch"), np.concatenate([np.full((1, 2), np.nan), truth]))
    return spec, ds


def test_simulate_reads_the_population_in_the_initial_state(data):
    spec, ds = data
    out = epifit.simulate(spec, ds)
    np.testing.assert_allclose(out["S"].values[0], POPULATION - 5.0)
    np.testing.assert_allclose(out["I"].values[0], [5.0, 5.0])
    total = out["S"].values + out["I"].values + out["R"].values
    np.testing.assert_allclose(total, np.broadcast_to(POPULATION, total.shape))


def test_calibrate_and_forecast_read_it_too(data):
    spec, ds = data
    fit = epifit.calibrate(
        spec,
        ds,
        values={"beta": 0.4, "gamma": 0.25},
        uncertainty=False,
        progress=False,
        rtol=1e-9,
        atol=1e-9,
    )
    assert fit.converged, fit.message
    assert fit.parameters["beta"] == pytest.approx(0.5, rel=1e-3)
    assert fit.parameters["I0"] == pytest.approx(5.0, rel=1e-3)
    fc = forecast(fit, samples=0, days=10)
    estimate = fc["estimate_cases"].isel(scenario=0).values
    assert np.isfinite(estimate[1:]).all()
    np.testing.assert_allclose(estimate[1:40], ds["cases"].values[1:], rtol=1e-3)


def test_an_initial_expression_naming_a_missing_variable_says_so(data):
    spec, ds = data
    with pytest.raises(epifit.DataError, match="population"):
        Problem(spec, ds.drop_vars("population"))
