"""The model cookbook (docs/cookbook.md): every recipe's model file loads and
simulates on the data it documents, and the age-structured recipe recovers its
per-group susceptibility."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import xarray as xr

import epifit
from epifit.simulation import Problem, SolverSettings

AGES = ["0-19", "20-64", "65+"]
POPULATION = np.array([20000.0, 55000.0, 25000.0])
# mean daily contacts of a person in group a (row) with group b (column):
# reciprocal, POPULATION[a] * C[a, b] == POPULATION[b] * C[b, a]
CONTACTS = np.array(
    [[7.0, 5.0, 1.0], [5.0 * 20 / 55, 8.0, 2.0], [1.0 * 20 / 25, 2.0 * 55 / 25, 3.0]]
)
DAYS = 150


def age_dataset(cases=None) -> xr.Dataset:
    time = pd.date_range("2021-01-04", periods=DAYS)
    cases = np.ones((DAYS, 3)) if cases is None else cases
    return xr.Dataset(
        {
            "population": ("patch", POPULATION),
            "contacts": (("patch", "patch_to"), CONTACTS),
            "cases": (("time", "patch"), cases),
        },
        coords={"patch": AGES, "patch_to": AGES, "time": time},
    )


def two_strain_dataset() -> xr.Dataset:
    time = pd.date_range("2021-01-04", periods=365)
    ones = ("time", np.ones(365))
    names = ("cases_strain1", "cases_strain2", "reinfections_strain2")
    return xr.Dataset({n: ones for n in names}, coords={"time": time})


RECIPES = {
    "seir_age3": age_dataset,
    "two_strain": two_strain_dataset,
}


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_loads_and_simulates(name):
    out = epifit.simulate(f"models/{name}.toml", RECIPES[name]())
    model = Problem(f"models/{name}.toml", RECIPES[name]()).model
    for c in model.compartments:
        assert np.isfinite(out[c].values).all() and (out[c].values >= -1e-9).all()
    for o in model.observations:
        series = out[f"predicted_{o.name}"].values[1:]
        assert np.isfinite(series).all() and (series >= 0).all()


def test_age_groups_keep_their_populations():
    out = epifit.simulate("models/seir_age3.toml", age_dataset())
    total = sum(out[c].values for c in ("S", "E", "I", "R"))
    np.testing.assert_allclose(
        total, np.broadcast_to(POPULATION, total.shape), rtol=1e-9
    )


@pytest.mark.slow
def test_age_structured_susceptibility_is_recovered():
    truth = np.array([0.6, 1.0, 1.4])
    problem = Problem("models/seir_age3.toml", age_dataset())
    values = problem.model.constrain(problem.init_params())
    values = {p.name: values[p.name] for p in problem.spec.parameters}
    params = problem.model.unconstrain({**values, "susceptibility": truth})
    settings = SolverSettings(rtol=1e-9, atol=1e-9)
    mu = np.asarray(
        problem.predict(params, problem.solve(params, settings).ys)["cases"]
    )
    counts = np.random.default_rng(11).poisson(mu).astype(float)
    data = age_dataset(np.concatenate([np.full((1, 3), np.nan), counts]))
    fit = epifit.calibrate(
        "models/seir_age3.toml", data, uncertainty=False, progress=False
    )
    assert fit.converged, fit.message
    np.testing.assert_allclose(fit.parameters["susceptibility"], truth, rtol=0.1)
