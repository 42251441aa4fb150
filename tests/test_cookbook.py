"""The model cookbook (docs/cookbook.md): every recipe's model file loads and
simulates on the data it documents, and the age-structured recipe recovers its
per-group susceptibility."""

from __future__ import annotations

import functools

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


def vaccination_dataset() -> xr.Dataset:
    time = pd.date_range("2021-01-04", periods=120)
    doses = np.where(np.arange(120) >= 30, 800.0, 0.0)
    ones = ("time", np.ones(120))
    return xr.Dataset(
        {"doses": ("time", doses), "cases": ones, "vaccinated": ones},
        coords={"time": time},
    )


def measles_dataset(years: int = 20) -> xr.Dataset:
    """Daily school terms (holidays: 1 Jan-7 Jan, Easter fortnight, 20 Jul-31
    Aug, 20-31 Dec) and weekly cases on the daily axis (NaN between)."""
    time = pd.date_range("1950-01-01", periods=int(365.25 * years))
    doy = time.day_of_year.values
    holiday = (doy <= 7) | ((doy >= 95) & (doy < 109)) | ((doy >= 201) & (doy <= 243))
    holiday |= doy >= 354
    cases = np.where(np.arange(time.size) % 7 == 6, 1.0, np.nan)
    ds = xr.Dataset(
        {"term": ("time", (~holiday).astype(float)), "cases": ("time", cases)},
        coords={"time": time},
    )
    ds["cases"].attrs["period"] = 7
    return ds


def rw_dataset() -> xr.Dataset:
    time = pd.date_range("2021-01-04", periods=120)
    return xr.Dataset({"cases": ("time", np.ones(120))}, coords={"time": time})


def age_region_dataset() -> xr.Dataset:
    regions = ["north", "south"]
    time = pd.date_range("2021-01-04", periods=90)
    population = np.array([[20000.0, 55000.0, 25000.0], [10000.0, 30000.0, 20000.0]])
    ds = xr.Dataset(
        {
            "population": (("patch", "age"), population),
            "contacts": (("age", "age_to"), CONTACTS),
        },
        coords={"patch": regions, "age": AGES, "age_to": AGES, "time": time},
    )
    from epifit.model import load_model

    for o in load_model("models/seir_age_region.toml").observations:
        dims = ("time", "patch", "age") if o.strata == "each" else ("time", "patch")
        ds[o.name] = (dims, np.ones(tuple(ds.sizes[d] for d in dims)))
    return ds


def age_travel_dataset() -> xr.Dataset:
    ds = age_region_dataset()
    travel = np.array([[0.9, 0.1], [0.2, 0.8]])
    regions = list(ds["patch"].values)
    ds["travel"] = (("patch", "patch_to"), travel)
    return ds.assign_coords(patch_to=regions)


RECIPES = {
    "seir_age_region": age_region_dataset,
    "seir_age_travel": age_travel_dataset,
    "seir_age3": age_dataset,
    "two_strain": two_strain_dataset,
    "seir_vaccination": vaccination_dataset,
    "measles_seasonal": measles_dataset,
    "seir_rw": rw_dataset,
}


@functools.cache
def simulated(name: str) -> xr.Dataset:
    """`epifit.simulate` of recipe `name` on its dataset, once per session (the
    tests below read it, none changes it)."""
    return epifit.simulate(f"models/{name}.toml", RECIPES[name]())


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_loads_and_simulates(name):
    out = simulated(name)
    model = Problem(f"models/{name}.toml", RECIPES[name]()).model
    for c in model.compartments:
        assert np.isfinite(out[c].values).all() and (out[c].values >= -1e-9).all()
    for o in model.observations:
        series = out[f"predicted_{o.name}"].values
        stamps = series[np.isfinite(series)]
        assert stamps.size >= (series.shape[0] - 1) // o.period
        assert (stamps >= 0).all()


def test_age_groups_keep_their_populations():
    out = simulated("seir_age3")
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


def test_vaccination_gives_the_doses_while_susceptibles_last():
    out = simulated("seir_vaccination")
    vaccinated = out["predicted_vaccinated"].values[1:, 0]
    np.testing.assert_allclose(vaccinated[:29], 0.0, atol=1e-9)
    # 90% of 800 doses a day protect, while S is large
    np.testing.assert_allclose(vaccinated[31:60], 720.0, rtol=1e-4)


def test_measles_recurs_over_twenty_years():
    out = simulated("measles_seasonal")
    weekly = out["predicted_cases"].values[:, 0]
    weekly = weekly[np.isfinite(weekly)]
    years = weekly[: 52 * 20].reshape(20, 52).sum(axis=1)
    # births replenish the susceptibles: epidemics keep coming back
    assert (years[5:] > 1000).all()
    # births mu N and deaths mu keep N; importations iota add iota / mu (1 - e^-mu t)
    total = sum(out[c].values for c in ("S", "E", "I", "R"))[:, 0]
    t = np.arange(total.size)
    mu, iota = 5.48e-5, 0.2
    np.testing.assert_allclose(total, 1e6 + iota / mu * -np.expm1(-mu * t), rtol=1e-7)


def test_a_scenario_changes_a_parameter_a_state_rate_reads():
    """Halving `eff` (read by the rate `min(eff * doses / S, 0.2)`, evaluated
    in the vector field) from day 60: the forecast equals a solve with eff
    halved on its days, and differs from the baseline after day 60 only."""
    from epifit.forecasting import Change, Scenario, forecast

    ds = vaccination_dataset()
    problem = Problem("models/seir_vaccination.toml", ds)
    params = problem.init_params()
    tight = {"rtol": 1e-10, "atol": 1e-10}
    scenario = Scenario("half_eff", [Change(parameter="eff", scale=0.5, start=60)])
    fc = forecast(problem, [scenario], params=params, samples=0, days=0, **tight)
    base = fc["estimate_vaccinated"].sel(scenario="baseline").values[:, 0]
    half = fc["estimate_vaccinated"].sel(scenario="half_eff").values[:, 0]
    np.testing.assert_allclose(half[1:60], base[1:60], rtol=1e-9)
    np.testing.assert_allclose(half[62:90], base[62:90] / 2, rtol=1e-3)


@pytest.mark.slow
def test_a_weekly_random_walk_recovers_r_eff():
    """`seir_rw.toml`: cases simulated with beta 0.6, 0.4, 0.3, 0.5 on four
    periods (days 0-27, 28-55, 56-90, 91-119: changes on week boundaries, as
    policy changes are dated), Poisson noise; the fit with the weekly random
    walk recovers R_eff(t) (from the model's next-generation matrix) within
    10% on at least 90% of the days after day 14."""
    from epifit.model import reproduction_number

    problem = Problem("models/seir_rw.toml", rw_dataset())
    model = problem.model
    weekly = np.repeat([0.6, 0.4, 0.3, 0.5], [4, 4, 5, 5])
    values = model.constrain(problem.init_params())
    values = {p.name: values[p.name] for p in problem.spec.parameters}
    truth_params = model.unconstrain({**values, "beta": weekly})
    settings = SolverSettings(rtol=1e-9, atol=1e-9)
    sol = problem.solve(truth_params, settings)
    mu = np.asarray(problem.predict(truth_params, sol.ys)["cases"][:, 0])
    truth = np.asarray(
        reproduction_number(model, sol.ys, truth_params, ts=problem.ts)["R_eff_total"]
    )
    counts = np.random.default_rng(5).poisson(mu).astype(float)
    data = rw_dataset()
    data["cases"] = ("time", np.concatenate([[np.nan], counts]))
    fit = epifit.calibrate(
        "models/seir_rw.toml", data, uncertainty=False, progress=False
    )
    assert fit.converged, fit.message
    fitted_sol = fit.problem.solve(fit.params, settings)
    fitted = np.asarray(
        reproduction_number(model, fitted_sol.ys, fit.params, ts=problem.ts)[
            "R_eff_total"
        ]
    )
    error = np.abs(fitted / truth - 1.0)[15:]
    assert np.mean(error < 0.10) >= 0.90, np.round(error, 3)


@pytest.mark.slow
def test_a_stratified_fit_recovers_and_labels_its_strata():
    ds = age_region_dataset()
    problem = Problem("models/seir_age_region.toml", ds)
    params = problem.init_params()
    rng = np.random.default_rng(0)
    for name, mu in problem.predict(params, problem.solve(params).ys).items():
        full = np.full(ds[name].shape, np.nan)
        full[1:] = rng.poisson(np.asarray(mu)).reshape(full[1:].shape)
        ds[name] = (ds[name].dims, full)
    fit = epifit.calibrate("models/seir_age_region.toml", ds, progress=False)
    rows = {r["label"]: r for r in fit.table}
    for age, want in zip(AGES, [0.8, 1.0, 1.2], strict=True):
        row = rows[f"susceptibility[{age}]"]
        assert abs(row["estimate"] - want) < 3 * row["se"], age
    assert not any("shared" in n for n in fit.notes)  # per age, not scalar
