"""Observations as epidemiologists record them (issue 19): flows integrated
beside the state, the incidence-with-inflows error, reporting delays, week
effects, ascertainment from a covariate, weekly totals (their gradients across
adjoints: test_adjoints_models.py)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import scipy.stats
import xarray as xr
from helpers import to_toml
from scipy.integrate import solve_ivp

from epifit.data import DataError
from epifit.model import ModelSpecError, loads_model
from epifit.simulation import Problem, SolverSettings

TIGHT = SolverSettings(rtol=1e-10, atol=1e-10)

SEIRS = {
    "name": "seirs",
    "compartments": ["S", "E", "I", "R"],
    "parameters": {
        "beta": {"value": 0.5, "transform": "softplus"},
        "sigma": {"value": 0.25, "transform": "softplus"},
        "gamma": {"value": 0.2, "transform": "softplus"},
        "omega": {"value": 0.01, "transform": "softplus"},
        "N": {"value": 1000.0, "fixed": True},
    },
    "transitions": [
        {"from": "E", "to": "I", "rate": "sigma"},
        {"from": "I", "to": "R", "rate": "gamma"},
        {"from": "R", "to": "S", "rate": "omega"},
    ],
    "infections": [
        {
            "from": "S",
            "to": "E",
            "transmission": "beta",
            "infectious": ["I"],
            "normalize": "population",
            "population": "N",
        }
    ],
    "initial": {"S": "N - 10", "I": "10"},
    "observations": [
        {"name": "cases", "kind": "flow", "transition": "S->E", "family": "poisson"},
        {"name": "waned", "kind": "flow", "transition": "R->S", "family": "poisson"},
    ],
}


def load(data, path="models/x.toml"):
    return loads_model(to_toml(data), path=path)


def with_obs(*observations, base=SEIRS, **edits):
    return {**base, "observations": list(observations), **edits}


def _seirs_reference(days):
    def f(t, y):
        s, e, i, r, _, _ = y
        new = 0.5 * s * i / 1000.0
        return [-new + 0.01 * r, new - 0.25 * e, 0.25 * e - 0.2 * i, 0.2 * i - 0.01 * r]

    def g(t, y):
        s, e, i, r, c, w = y
        return [*f(t, y), 0.5 * s * i / 1000.0, 0.01 * r]

    sol = solve_ivp(
        g,
        (0, days - 1),
        [990.0, 0, 10.0, 0, 0, 0],
        t_eval=np.arange(days),
        method="DOP853",
        rtol=1e-12,
        atol=1e-12,
    )
    return np.diff(sol.y[4]), np.diff(sol.y[5]), sol.y[0]


def test_seirs_flows_agree_with_solve_ivp_and_are_never_negative():
    days = 730
    problem = Problem(load(SEIRS), None, days=days)
    params = problem.init_params()
    sol = problem.solve(params, TIGHT)
    pred = problem.predict(params, sol.ys)
    cases, waned, s = _seirs_reference(days)
    assert pred["cases"].shape == (days - 1, 1)
    np.testing.assert_allclose(pred["cases"][:, 0], cases, rtol=1e-7, atol=1e-8)
    np.testing.assert_allclose(pred["waned"][:, 0], waned, rtol=1e-7, atol=1e-8)
    assert float(pred["cases"].min()) > 0 and float(pred["waned"].min()) > 0
    # what "incidence" of S would have said: negative on many days
    assert (-np.diff(s) < 0).sum() > 100


TWO_STRAIN = {
    "name": "two_strain",
    "compartments": ["S", "I1", "I2", "R1", "R2"],
    "parameters": {
        "b1": {"value": 0.4, "transform": "softplus"},
        "b2": {"value": 0.3, "transform": "softplus"},
        "g": {"value": 0.1, "transform": "softplus"},
        "w": {"value": 0.02, "transform": "softplus"},
    },
    "transitions": [
        {"from": "I1", "to": "R1", "rate": "g"},
        {"from": "I2", "to": "R2", "rate": "g"},
        {"from": "R1", "to": "I2", "rate": "w"},
        {"from": "R2", "to": "S", "rate": "w"},
    ],
    "infections": [
        {"from": "S", "to": "I1", "transmission": "b1", "infectious": ["I1"]},
        {"from": "S", "to": "I2", "transmission": "b2", "infectious": ["I2"]},
    ],
    "initial": {"S": "0.98", "I1": "0.01", "I2": "0.01"},
    "observations": [
        {"name": "new_r2", "kind": "flow", "transition": "I2->R2"},
        {"name": "reinfected", "kind": "flow", "transition": "R1->I2"},
    ],
}


def test_two_strain_flows_agree_with_solve_ivp():
    days = 400
    problem = Problem(load(TWO_STRAIN), None, days=days)
    params = problem.init_params()
    pred = problem.predict(params, problem.solve(params, TIGHT).ys)

    def f(t, y):
        s, i1, i2, r1, r2, _, _ = y
        n1, n2 = 0.4 * s * i1, 0.3 * s * i2
        return [
            -n1 - n2 + 0.02 * r2,
            n1 - 0.1 * i1,
            n2 - 0.1 * i2 + 0.02 * r1,
            0.1 * i1 - 0.02 * r1,
            0.1 * i2 - 0.02 * r2,
            0.1 * i2,
            0.02 * r1,
        ]

    y0 = [0.98, 0.01, 0.01, 0, 0, 0, 0]
    ref = solve_ivp(
        f,
        (0, days - 1),
        y0,
        t_eval=np.arange(days),
        method="DOP853",
        rtol=1e-12,
        atol=1e-14,
    )
    np.testing.assert_allclose(
        pred["new_r2"][:, 0], np.diff(ref.y[5]), rtol=1e-6, atol=1e-12
    )
    np.testing.assert_allclose(
        pred["reinfected"][:, 0], np.diff(ref.y[6]), rtol=1e-6, atol=1e-12
    )
    assert float(pred["new_r2"].min()) >= 0
    # the daily change of R2 is negative on many days: incidence would be wrong
    r2 = ref.y[4]
    assert (np.diff(r2) < 0).sum() > 20


def test_only_observed_flows_are_accumulated():
    model = Problem(load(SEIRS), None, days=3).model
    assert model.flow_keys == ("S->E", "R->S")
    plain = Problem(load(with_obs()), None, days=3).model
    assert plain.flow_keys == ()
    y0 = plain.initial_state(plain.init_params(1), None, 1)
    assert sorted(y0) == ["E", "I", "R", "S"]


def test_incidence_of_a_compartment_with_inflows_is_an_error():
    inc = {"name": "cases", "kind": "incidence", "compartments": ["S"], "sign": -1}
    with pytest.raises(ModelSpecError) as e:
        load(with_obs(inc))
    assert str(e.value) == (
        'models/x.toml: observations[0].compartments: kind = "incidence" observes '
        "minus the daily change of S, which is not a count of events: they also "
        'have inflows R->S; observe the flow instead: kind = "flow", transition '
        '= "S->E"'
    )
    two = {"name": "r2", "kind": "incidence", "compartments": ["R2"]}
    with pytest.raises(ModelSpecError, match=r"outflows R2->S; observe the flow"):
        load(with_obs(two, base=TWO_STRAIN))
    # one-way compartments keep their incidence
    sir = with_obs(
        {
            "name": "c",
            "kind": "incidence",
            "compartments": ["R1", "R2", "I2", "S", "I1"],
        },
        base=TWO_STRAIN,
    )
    assert load(sir).observations[0].kind == "incidence"


@pytest.mark.parametrize(
    ("obs", "message"),
    [
        ({"kind": "flow"}, r"observations\[0\]\.transition: missing; a flow"),
        (
            {"kind": "flow", "transition": "S->I"},
            r"transition: the model has no flow S->I; its flows: E->I, I->R, R->S, "
            r"S->E",
        ),
        ({"kind": "flow", "transition": "S-E"}, r'expected "FROM->TO"'),
        (
            {"kind": "flow", "transition": "S->E", "compartments": ["S"]},
            r"compartments: a flow observes a transition",
        ),
        (
            {"kind": "prevalence", "compartments": ["I"], "transition": "S->E"},
            r'transition: applies only to kind = "flow"',
        ),
        (
            {"kind": "prevalence", "compartments": ["I"], "family": "gaussian"},
            r"observations\[0\]\.sd: missing; a gaussian likelihood needs its "
            r"standard deviation",
        ),
        (
            {
                "kind": "prevalence",
                "compartments": ["I"],
                "family": "poisson",
                "sd": "N",
            },
            r"sd: a poisson likelihood has no sd",
        ),
        (
            {
                "kind": "flow",
                "transition": "S->E",
                "delay": {"family": "weibull", "mean": "1", "sd": "1"},
            },
            r"delay\.family: unknown value 'weibull'; expected one of: gamma, "
            r"lognormal",
        ),
        (
            {
                "kind": "flow",
                "transition": "S->E",
                "delay": {"family": "gamma", "mean": "-2", "sd": "1"},
            },
            r"delay\.mean: a delay mean must be > 0",
        ),
        (
            {
                "kind": "flow",
                "transition": "S->E",
                "delay": {"family": "gamma", "mean": "2", "sd": "1", "max_days": -1},
            },
            r"delay\.max_days: must be an integer >= 0",
        ),
        (
            {"kind": "flow", "transition": "S->E", "period": "month"},
            r"period: unknown value 'month'; expected one of: day, week",
        ),
        (
            {"kind": "flow", "transition": "S->E", "period": 0},
            r"period: must be an integer >= 1",
        ),
        (
            {
                "kind": "flow",
                "transition": "S->E",
                "week_effect": {"name": "dow", "values": [1, 0, 0, 0, 0, 0, 0]},
            },
            r"week_effect\.values: the 7 log-scale effects must sum to 0",
        ),
        (
            {"kind": "flow", "transition": "S->E", "week_effect": "1dow"},
            r"week_effect: .*'1dow'",
        ),
    ],
)
def test_observation_field_errors(obs, message):
    with pytest.raises(ModelSpecError, match=message):
        load(with_obs({"name": "y", **obs}))


# -- reporting -------------------------------------------------------------------
REPORTED = with_obs(
    {
        "name": "cases",
        "kind": "flow",
        "transition": "S->E",
        "family": "negative_binomial",
        "dispersion": "phi",
        "delay": {"family": "gamma", "mean": "dmean", "sd": "dsd", "max_days": 20},
        "ascertainment": "rho * testing",
        "week_effect": {
            "name": "dow",
            "values": [0.3, 0.1, 0.0, 0.0, -0.1, -0.2, -0.1],
        },
    },
    parameters={
        **SEIRS["parameters"],
        "phi": {"value": 20.0, "transform": "softplus"},
        "dmean": {"value": 5.0, "transform": "softplus"},
        "dsd": {"value": 2.5, "transform": "softplus"},
        "rho": {"value": 0.6, "transform": "sigmoid"},
    },
    covariates={"testing": {"dims": ["time"], "rule": "floor"}},
)


def _dataset(days, seed=0, cases=None):
    rng = np.random.default_rng(seed)
    time = pd.date_range("2021-03-01", periods=days)  # a Monday
    testing = 0.8 + 0.4 * rng.random(days)
    cases = np.full(days, 5.0) if cases is None else cases
    return xr.Dataset(
        {"testing": ("time", testing), "cases": ("time", cases)},
        coords={"time": time},
    )


def test_reports_equal_a_direct_convolution_ascertainment_and_week_effect():
    days = 60
    ds = _dataset(days)
    problem = Problem(load(REPORTED), ds)
    params = problem.init_params()
    sol = problem.solve(params, TIGHT)
    pred = np.asarray(problem.predict(params, sol.ys)["cases"][:, 0])
    flow = np.diff(np.asarray(sol.ys["S->E"][:, 0, 0]))  # day k -> k + 1
    shape, scale = (5.0 / 2.5) ** 2, 2.5**2 / 5.0
    cdf = scipy.stats.gamma(shape, scale=scale).cdf(np.arange(21) + 0.5)
    pmf = np.diff(cdf, prepend=0.0) / cdf[-1]
    delayed = np.convolve(flow, pmf)[: flow.size]
    report_days = np.arange(1, days)
    effect = np.array([0.3, 0.1, 0.0, 0.0, -0.1, -0.2, -0.1])
    weekday = np.asarray(ds.time.dt.dayofweek)[report_days]
    expected = delayed * 0.6 * ds.testing.values[report_days] * np.exp(effect[weekday])
    assert pred.shape == (days - 1,)
    np.testing.assert_allclose(pred, expected, rtol=1e-9)


def test_week_effect_needs_dates_and_has_its_parameters():
    spec = load(REPORTED)
    names = [p.name for p in spec.parameters]
    assert names[-6:] == [
        f"dow_{d}" for d in ("mon", "tue", "wed", "thu", "fri", "sat")
    ]
    assert [p.value for p in spec.parameters[-6:]] == [0.3, 0.1, 0.0, 0.0, -0.1, -0.2]
    assert not any(p.fixed for p in spec.parameters[-6:])
    assert spec.derived[-1].name == "dow_sun"
    ds = _dataset(30).assign_coords(time=np.arange(30))
    problem = Problem(spec, ds)
    params = problem.init_params()
    with pytest.raises(
        ModelSpecError,
        match=r"week_effect: needs the day of the "
        r"week of every day: give dated data",
    ):
        problem.predict(params, problem.solve(params).ys)


WEEKLY = with_obs(
    {
        "name": "cases",
        "kind": "flow",
        "transition": "S->E",
        "family": "poisson",
        "period": "week",
    },
)


def test_weekly_totals_are_sums_of_the_daily_flow():
    weeks = 12
    time = pd.date_range("2021-03-07", periods=weeks, freq="7D")
    ds = xr.Dataset({"cases": ("time", np.full(weeks, 40.0))}, coords={"time": time})
    problem = Problem(load(WEEKLY), ds)
    assert problem.ts.size == 7 * (weeks - 1) + 1
    np.testing.assert_array_equal(problem.stamps["cases"].days, 7 * np.arange(1, weeks))
    params = problem.init_params()
    sol = problem.solve(params, TIGHT)
    pred = np.asarray(problem.predict(params, sol.ys)["cases"][:, 0])
    acc = np.asarray(sol.ys["S->E"][:, 0, 0])
    np.testing.assert_allclose(pred, acc[7::7] - acc[:-7:7], rtol=1e-12)
    assert problem.observed["cases"].shape == (weeks - 1, 1)


def test_daily_observation_on_weekly_data_is_a_data_error():
    time = pd.date_range("2021-03-07", periods=5, freq="7D")
    ds = xr.Dataset({"cases": ("time", np.ones(5))}, coords={"time": time})
    with pytest.raises(
        DataError,
        match=r"observation 'cases' has period = 1 day\(s\) "
        r"in the model but the data's 'cases' has a period of 7",
    ):
        Problem(load(SEIRS), ds)
    daily = _dataset(20)[["cases"]]
    with pytest.raises(
        DataError,
        match=r"period = 7 day\(s\) in the model but the "
        r"data's 'cases' has a period of 1",
    ):
        Problem(load(WEEKLY), daily)


# -- gradients ---------------------------------------------------------------------
# The gradients through the delay, ascertainment, fitted week effect and weekly
# totals across the five adjoints, against finite
# differences: test_adjoints_models.py::
# test_gradients_of_reported_open_and_time_varying_pieces_agree_across_adjoints
# (one model with the pieces of issues 19 and 20, one compiled gradient per
# adjoint).


# -- the worked models -----------------------------------------------------------
def _worked_dataset(name: str, days: int = 120) -> xr.Dataset:
    time = pd.date_range("2021-03-01", periods=days)
    if name == "seir_reporting":
        testing = 1.0 + 0.2 * np.sin(np.arange(days) / 9.0)
        return xr.Dataset(
            {"testing": ("time", testing), "cases": ("time", np.ones(days))},
            coords={"time": time},
        )
    if name == "seir_weekly":
        weekly = pd.date_range("2021-03-01", periods=days // 7, freq="7D")
        return xr.Dataset(
            {"cases": ("time", np.ones(weekly.size))}, coords={"time": weekly}
        )
    return xr.Dataset({"cases": ("time", np.ones(days))}, coords={"time": time})


@pytest.mark.parametrize("name", ["seirs_flow", "seir_reporting", "seir_weekly"])
def test_worked_models_load_and_simulate(name):
    import epifit

    ds = _worked_dataset(name)
    out = epifit.simulate(f"models/{name}.toml", ds)
    predicted = out["predicted_cases"].values[:, 0]
    problem = Problem(f"models/{name}.toml", ds)
    days = problem.stamps["cases"].days
    assert np.all(np.isfinite(predicted[days])) and np.all(predicted[days] > 0)
    assert np.isnan(np.delete(predicted, days)).all()
    assert out["time"].size == problem.ts.size
    if name == "seir_weekly":
        np.testing.assert_array_equal(days, 7 * np.arange(1, ds.time.size))


@pytest.mark.slow
def test_weekly_totals_recover_beta_and_gamma():
    import epifit

    weeks = 20
    ds = _worked_dataset("seir_weekly", 7 * weeks)
    problem = Problem("models/seir_weekly.toml", ds)
    truth = {"beta": 0.55, "gamma": 0.22}
    values = problem.model.constrain(problem.init_params())
    values = {p.name: values[p.name] for p in problem.spec.parameters} | truth
    params = problem.model.unconstrain(values)
    mu = np.asarray(problem.predict(params, problem.solve(params, TIGHT).ys)["cases"])
    counts = np.random.default_rng(7).poisson(mu[:, 0]).astype(float)
    ds["cases"] = ("time", np.concatenate([[np.nan], counts]))
    res = epifit.calibrate(
        "models/seir_weekly.toml",
        ds,
        values={"beta": 0.4, "gamma": 0.3},
        uncertainty=False,
        progress=False,
    )
    assert res.converged, res.message
    for k, want in truth.items():
        assert res.parameters[k] == pytest.approx(want, rel=0.05), k


def test_the_builder_writes_the_same_observations_as_toml():
    from epifit.model import ModelBuilder

    b = ModelBuilder("seirs")
    for c in ("S", "E", "I", "R"):
        b = b.compartment(c)
    for name, p in REPORTED["parameters"].items():
        b = b.parameter(
            name, p["value"], **{k: v for k, v in p.items() if k != "value"}
        )
    b = b.covariate("testing", ["time"], rule="floor")
    for t in SEIRS["transitions"]:
        b = b.transition(t["from"], t["to"], rate=t["rate"])
    b = b.infection(
        "S",
        "E",
        transmission="beta",
        infectious=["I"],
        normalize="population",
        population="N",
    )
    b = b.initial("S", "N - 10").initial("I", "10")
    obs = dict(REPORTED["observations"][0])
    b = b.observation(obs.pop("name"), obs.pop("kind"), **obs)
    assert b.build() == load(REPORTED)


@pytest.mark.parametrize("name", ["seir_reporting", "seir_weekly"])
def test_forecasts_report_the_observations_as_the_fit_compares_them(name):
    from epifit.forecasting import forecast

    ds = _worked_dataset(name, 63)
    problem = Problem(f"models/{name}.toml", ds)
    params = problem.init_params()
    fc = forecast(problem, params=params, samples=0, days=14, rtol=1e-10, atol=1e-10)
    estimate = fc["estimate_cases"].isel(scenario=0).values[:, 0]
    assert estimate.shape == (problem.ts.size + 14,)
    assert np.all(np.isfinite(estimate[problem.ts.size :]))  # past the data
    sol = problem.solve(params, TIGHT)
    days = problem.stamps["cases"].days
    want = np.asarray(problem.predict(params, sol.ys)["cases"][:, 0])
    np.testing.assert_allclose(estimate[days], want, rtol=1e-7)
    first = 1 + (6 if name == "seir_weekly" else 0)  # a week's sum from day 7
    assert np.isnan(estimate[:first]).all() and np.isfinite(estimate[first:]).all()


@pytest.mark.slow
def test_a_weekly_csv_goes_through_import_and_calibrate(tmp_path, capsys):
    """CSV -> `epifit data import` (kept weekly, period 7) -> `epifit calibrate`
    of the weekly model: the fitted weekly totals follow the data."""
    import json

    from epifit.cli import main

    weeks = 16
    ds = _worked_dataset("seir_weekly", 7 * weeks)
    problem = Problem("models/seir_weekly.toml", ds)
    params = problem.init_params()
    totals = np.asarray(
        problem.predict(params, problem.solve(params, TIGHT).ys)["cases"]
    )
    counts = np.random.default_rng(3).poisson(totals[:, 0])
    dates = pd.DatetimeIndex(ds.time.values).strftime("%Y-%m-%d")
    # the first date's total (the week before the data) is not known: empty
    rows = [f"{dates[0]},\n"]
    rows += [f"{d},{c}\n" for d, c in zip(dates[1:], counts, strict=True)]
    table = tmp_path / "weekly.csv"
    table.write_text("date,cases\n" + "".join(rows))
    assert main(["data", "import", str(table), "--out", str(tmp_path / "w.nc")]) == 0
    argv = ["calibrate", "models/seir_weekly.toml", "--data", str(tmp_path / "w.nc")]
    argv += ["--out", str(tmp_path / "FIT.nc"), "--no-progress", "--json"]
    capsys.readouterr()
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["parameters"]["beta"] == pytest.approx(0.5, rel=0.05)
    assert out["parameters"]["gamma"] == pytest.approx(0.2, rel=0.05)
    assert out["n_data"] == weeks - 1  # the first date has no prediction
