"""Time-varying parameters (issue 20, item 1): `per_time` pieces, splines and
Fourier series, their random-walk smoothing prior, fits, FIT.nc and forecasts
(their gradients across adjoints: test_adjoints_models.py)."""

from __future__ import annotations

import copy
import math
import time

import jax.numpy as jnp
import numpy as np
import pandas as pd
import pytest
import scipy.interpolate
import scipy.stats
import xarray as xr
from helpers import to_toml

from epifit.fitting import FitResult, FreeParameters
from epifit.model import ModelSpecError, compile_model, loads_model
from epifit.simulation import Problem, SolverSettings

TIGHT = SolverSettings(rtol=1e-10, atol=1e-10)
DAYS = 120

SEIR = {
    "name": "seir_tv",
    "compartments": ["S", "E", "I", "R"],
    "parameters": {
        "N": {"value": 100000.0, "fixed": True},
        "beta": {"value": 0.5, "transform": "softplus", "per_time": 7},
        "sigma": {"value": 0.25, "transform": "softplus"},
        "gamma": {"value": 0.2, "transform": "softplus"},
    },
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
    "transitions": [
        {"from": "E", "to": "I", "rate": "sigma"},
        {"from": "I", "to": "R", "rate": "gamma"},
    ],
    "initial": {"S": "N - 20", "E": "20"},
    "observations": [
        {"name": "cases", "kind": "flow", "transition": "S->E", "family": "poisson"}
    ],
}


def with_beta(**fields):
    data = copy.deepcopy(SEIR)
    data["parameters"]["beta"] = {"value": 0.5, "transform": "softplus", **fields}
    return data


def load(data, path="models/x.toml"):
    return loads_model(to_toml(data), path=path)


def dataset(days=DAYS, cases=None, patches=None):
    time = pd.date_range("2021-03-01", periods=days)
    if patches is None:
        cases = np.ones(days) if cases is None else cases
        return xr.Dataset({"cases": ("time", cases)}, coords={"time": time})
    cases = np.ones((days, len(patches))) if cases is None else cases
    return xr.Dataset(
        {"cases": (("time", "patch"), cases)},
        coords={"time": time, "patch": list(patches)},
    )


# -- the daily values -----------------------------------------------------------
def test_pieces_spline_and_periodic_equal_a_direct_computation():
    rng = np.random.default_rng(0)
    days, n = 50, 3
    softplus = lambda v: np.logaddexp(0.0, v)  # noqa: E731
    # pieces of 7 days, per patch: (ceil(50 / 7), patch) = (8, 3)
    model = compile_model(load(with_beta(per_time=7, per_patch=True))).bind_days(days)
    c = rng.normal(size=(8, n))
    assert model.init_params(n)["beta"].shape == (8, n)
    got = np.asarray(model.daily_values({"beta": c}, days + 10)["beta"])
    want = softplus(c[np.minimum(np.arange(days + 10) // 7, 7)])
    np.testing.assert_allclose(got, want, rtol=1e-14)
    # a cubic spline of 10 basis functions over days 0 .. 49, kept past them
    model = compile_model(load(with_beta(per_time={"kind": "spline", "knots": 10})))
    model = model.bind_days(days)
    c = rng.normal(size=10)
    inner = np.linspace(0, days - 1, 10 - 3 + 1)[1:-1]
    knots = np.r_[[0.0] * 4, inner, [days - 1.0] * 4]
    spline = scipy.interpolate.BSpline(knots, c, 3)
    t = np.minimum(np.arange(days + 10), days - 1)
    got = np.asarray(model.daily_values({"beta": c}, days + 10)["beta"])
    np.testing.assert_allclose(got, softplus(spline(t)), rtol=1e-12)
    # a Fourier series of two harmonics, going on past the days
    per = {"kind": "periodic", "period": 365.25, "harmonics": 2}
    model = compile_model(load(with_beta(per_time=per))).bind_days(days)
    c = rng.normal(size=5)
    d = np.arange(days + 10)
    w = 2 * math.pi / 365.25
    eta = c[0] + sum(
        c[2 * k - 1] * np.cos(k * w * d) + c[2 * k] * np.sin(k * w * d) for k in (1, 2)
    )
    got = np.asarray(model.daily_values({"beta": c}, days + 10)["beta"])
    np.testing.assert_allclose(got, softplus(eta), rtol=1e-12)
    # its start holds the value on every day, the amplitudes at 0
    x0 = model.init_params(1)
    np.testing.assert_allclose(model.constrain(x0)["beta"][0], 0.5, rtol=1e-14)
    np.testing.assert_array_equal(np.asarray(x0["beta"][1:]), 0.0)
    np.testing.assert_allclose(model.daily_values(x0)["beta"], 0.5, rtol=1e-14)


def test_a_solve_with_pieces_equals_one_with_the_same_daily_covariate():
    days = 60
    data = with_beta(per_time=20)
    problem = Problem(load(data), dataset(days))
    params = problem.init_params()
    values = {**problem.model.constrain(params), "beta": np.array([0.6, 0.3, 0.5])}
    params = problem.model.unconstrain(values)
    daily = np.asarray(problem.model.daily_values(params)["beta"])
    np.testing.assert_allclose(daily, np.repeat([0.6, 0.3, 0.5], 20), rtol=1e-14)
    # the same model with beta a daily covariate (the `floor` rule)
    ref = copy.deepcopy(SEIR)
    del ref["parameters"]["beta"]
    ref["covariates"] = {"beta": {"dims": ["time"], "rule": "floor"}}
    ds = dataset(days)
    ds["beta"] = ("time", daily)
    ref_problem = Problem(load(ref), ds)
    ref_params = {k: v for k, v in params.items() if k != "beta"}
    a = problem.solve(params, TIGHT).ys["S->E"]
    b = ref_problem.solve(ref_params, TIGHT).ys["S->E"]
    np.testing.assert_allclose(a, b, rtol=1e-9)
    slot = [s for s in problem.model.plan.slots if s.key.endswith("transmission")]
    assert slot[0].time_varying


def test_an_unbound_model_says_how_to_bind_it():
    model = compile_model(load(SEIR))
    with pytest.raises(ValueError, match=r"vary in time.*bind_days"):
        model.init_params(1)


# -- reading ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "fields, location, message",
    [
        ({"per_time": 0}, "beta.per_time", "at least 1 day"),
        ({"per_time": -7}, "beta.per_time", "at least 1 day"),
        ({"per_time": 7.5}, "beta.per_time", "expected a number of days"),
        ({"per_time": {"kind": "wavelet"}}, "per_time.kind", "unknown value 'wavelet'"),
        ({"per_time": {"knots": 5}}, "per_time.kind", "missing required field 'kind'"),
        ({"per_time": {"kind": "spline", "knots": 3}}, "knots", "integer >= 4"),
        ({"per_time": {"kind": "spline"}}, "per_time", "knots"),
        ({"per_time": {"kind": "spline", "knots": 6, "days": 3}}, "per_time", "days"),
        ({"per_time": {"kind": "periodic", "period": 0}}, "period", "> 0"),
        (
            {"per_time": {"kind": "periodic", "period": 7, "harmonics": 0}},
            "harmonics",
            ">= 1",
        ),
        (
            {
                "per_time": {"kind": "periodic", "period": 7},
                "smoothing": {"kind": "random_walk", "sd": 0.1},
            },
            "beta.smoothing",
            "does not apply to the coefficients of a periodic",
        ),
        ({"smoothing": {"kind": "random_walk", "sd": 0.1}}, "smoothing", "per_time"),
        (
            {"per_time": 7, "smoothing": {"kind": "random_walk", "sd": 0}},
            "smoothing.sd",
            "> 0",
        ),
        (
            {"per_time": 7, "smoothing": {"kind": "random_walk", "sd": 1, "order": 3}},
            "smoothing.order",
            "1 or 2",
        ),
        (
            {"per_time": 7, "smoothing": {"kind": "ar1", "sd": 1}},
            "smoothing.kind",
            "unknown value 'ar1'",
        ),
        ({"per_time": 7, "fixed": True}, "beta.per_time", "fixed parameter"),
    ],
)
def test_reading_errors_name_the_field(fields, location, message):
    with pytest.raises(ModelSpecError, match=message) as e:
        load(with_beta(**fields))
    assert str(e.value).startswith("models/x.toml: parameters.")
    assert location in str(e.value)


def test_a_time_varying_parameter_is_refused_where_a_day_is_not_known():
    data = with_beta(per_time=7)
    data["derived"] = {"R0": "beta / gamma"}
    with pytest.raises(ModelSpecError, match=r"derived.R0: 'beta' \(a time-varying"):
        load(data)
    data = with_beta(per_time=7)
    data["initial"] = {"S": "N - 20 * beta", "E": "20"}
    with pytest.raises(ModelSpecError, match=r"initial.S: 'beta' \(a time-varying"):
        load(data)


# -- the smoothing prior ------------------------------------------------------------
@pytest.mark.parametrize("order", [1, 2])
def test_the_random_walk_penalty_is_the_gaussian_negative_log_density(order):
    sd = 0.2
    smoothing = {"kind": "random_walk", "sd": sd, "order": order}
    problem = Problem(load(with_beta(per_time=7, smoothing=smoothing)), dataset(60))
    free = FreeParameters(problem, problem.init_params())
    x = np.asarray(free.x0) + np.random.default_rng(1).normal(0, 0.3, free.n)
    beta = x[np.asarray(free.names) == "beta"]
    assert beta.size == 9  # ceil(60 / 7)
    d = np.diff(beta, n=order)
    want = -scipy.stats.norm.logpdf(d, 0.0, sd).sum()
    got = float(free.penalty(jnp.asarray(x), free.rest))
    assert got == pytest.approx(want, rel=1e-13)
    r = np.asarray(free.penalty_residuals(jnp.asarray(x), free.rest))
    assert r @ r == pytest.approx(0.5 * np.sum((d / sd) ** 2), rel=1e-13)
    assert not free.least_squares_penalty


def test_labels_name_the_pieces_and_patches():
    problem = Problem(
        load(with_beta(per_time=30, per_patch=True)), dataset(60, patches=["a", "b"])
    )
    free = FreeParameters(problem, problem.init_params())
    beta = [lab for lab in free.labels if lab.startswith("beta")]
    assert beta == ["beta[t0, a]", "beta[t0, b]", "beta[t1, a]", "beta[t1, b]"]
    per = {"kind": "periodic", "period": 7.0, "harmonics": 1}
    problem = Problem(load(with_beta(per_time=per)), dataset(30))
    free = FreeParameters(problem, problem.init_params())
    assert [lab for lab in free.labels if lab.startswith("beta")] == [
        "beta[c0]",
        "beta[a1]",
        "beta[b1]",
    ]


def _drop_model(**fields):
    """The SEIR whose recovery rate `gamma - drop` falls below 0 on the days
    where the time-varying `drop` (weekly pieces) exceeds gamma = 0.2."""
    data = copy.deepcopy(SEIR)
    data["parameters"]["gamma"] = {"value": 0.2, "fixed": True}
    data["parameters"]["drop"] = {
        "value": 0.05,
        "transform": "softplus",
        "per_time": 7,
        **fields,
    }
    data["transitions"][1]["rate"] = "gamma - drop"
    return load(data)


def test_ranges_that_read_a_time_varying_parameter_are_checked_each_day():
    from epifit.data import DataError
    from epifit.simulation import load_params

    problem = Problem(_drop_model(), dataset(28))
    model = problem.model
    params = problem.init_params()
    assert (
        model.range_violations(model.constrain(params), model.daily_values(params))
        == []
    )
    values = {**model.constrain(params), "drop": np.array([0.05, 0.1, 0.45, 0.05])}
    bad = model.unconstrain(values)
    # 0.2 - 0.45 on the third week's days, 14-20: the first one is named
    assert model.range_violations(model.constrain(bad), model.daily_values(bad)) == [
        "transitions[1].rate: a rate must be >= 0, but 'gamma - drop' is "
        f"{0.2 - float(model.daily_values(bad)['drop'][14])!r} on day 14"
    ]
    assert model.range_violations(model.constrain(bad)) == []  # no days: skipped
    with pytest.raises(
        DataError,
        match=r"^params: these values break the model: transitions\[1\]\.rate: a "
        r"rate must be >= 0, but 'gamma - drop' is -0\.2\d* on day 14$",
    ):
        load_params(problem, {"drop": [0.05, 0.1, 0.45, 0.05]})
    # per patch: the day and the patch's value; the other patch stays in range
    problem = Problem(_drop_model(per_patch=True), dataset(28, patches=["a", "b"]))
    model = problem.model
    drop = np.full((4, 2), 0.05)
    drop[3, 1] = 0.3
    p = model.unconstrain({**model.constrain(problem.init_params()), "drop": drop})
    got = 0.2 - float(model.daily_values(p)["drop"][21, 1])  # about -0.1
    assert model.range_violations(model.constrain(p), model.daily_values(p)) == [
        f"transitions[1].rate: a rate must be >= 0, but 'gamma - drop' is {got!r} "
        "on day 21"
    ]


# -- gradients ------------------------------------------------------------------------
# The gradients through weekly pieces under a random-walk prior, across the
# five adjoints against finite differences: test_adjoints_models.py::
# test_gradients_of_reported_open_and_time_varying_pieces_agree_across_adjoints
# (one model with the pieces of issues 19 and 20, one compiled gradient per
# adjoint).


# -- fits, FIT.nc and forecasts ------------------------------------------------
def _truth_counts(days, seed=3):
    """Poisson counts of an SEIR whose beta is 0.6, 0.4, 0.3, 0.5 on four
    30-day periods."""
    problem = Problem(load(with_beta(per_time=30)), dataset(days))
    values = problem.model.constrain(problem.init_params())
    values["beta"] = np.array([0.6, 0.4, 0.3, 0.5])[: -(-days // 30)]
    params = problem.model.unconstrain(values)
    mu = np.asarray(problem.predict(params, problem.solve(params, TIGHT).ys)["cases"])
    counts = np.random.default_rng(seed).poisson(mu[:, 0]).astype(float)
    truth = np.asarray(problem.model.daily_values(params)["beta"])
    return np.concatenate([[np.nan], counts]), truth


def _write_model(tmp_path, data):
    path = tmp_path / "seir_tv.toml"
    path.write_text(to_toml(data))
    return path


def test_fit_nc_round_trip_and_a_forecast_carries_the_last_value(tmp_path):
    import epifit
    from epifit.forecasting import forecast

    days = 42
    cases, _ = _truth_counts(days)
    ds = dataset(days, cases)
    ds.to_netcdf(tmp_path / "data.nc")
    smoothing = {"kind": "random_walk", "sd": 0.2}
    path = _write_model(tmp_path, with_beta(per_time=14, smoothing=smoothing))
    fit = epifit.calibrate(
        path, tmp_path / "data.nc", max_iterations=5, uncertainty=False, progress=False
    )
    assert [lab for lab in fit.labels if lab.startswith("beta")] == [
        "beta[t0]",
        "beta[t1]",
        "beta[t2]",
    ]
    out = tmp_path / "FIT.nc"
    fit.to_netcdf(out)
    back = FitResult.from_netcdf(out)
    np.testing.assert_array_equal(back.params["beta"], fit.params["beta"])
    np.testing.assert_array_equal(back.values["beta"], fit.values["beta"])
    with xr.open_dataset(out) as stored:
        daily = stored["beta_daily"].values
    assert daily.shape == (days,)
    want = np.asarray(fit.problem.model.daily_values(fit.params)["beta"])
    np.testing.assert_allclose(daily, want, rtol=1e-15)
    np.testing.assert_allclose(daily[28:], fit.values["beta"][2], rtol=1e-15)
    # a forecast keeps the last fitted value: its solve equals one with beta's
    # last piece on every later day
    fc = forecast(back, samples=0, days=14, rtol=1e-10, atol=1e-10)
    estimate = fc["estimate_cases"].isel(scenario=0).values[:, 0]
    longer = Problem(path, dataset(days + 14), days=days + 14)
    params = {k: v for k, v in back.params.items()}
    b = np.asarray(params["beta"])
    params["beta"] = jnp.asarray(np.r_[b, b[-1]])  # ceil(56 / 14) = 4 pieces
    mu = np.asarray(longer.predict(params, longer.solve(params, TIGHT).ys)["cases"])
    np.testing.assert_allclose(estimate[1:], mu[:, 0], rtol=1e-6)


@pytest.mark.slow
def test_a_weekly_random_walk_recovers_a_piecewise_beta(tmp_path):
    """The SEIR of `_truth_counts` (beta 0.6, 0.4, 0.3, 0.5 on four 30-day
    periods) fitted with weekly pieces under a random walk (sd 0.2), sigma
    and gamma known (fixed: incidence alone hardly separates them from a
    free beta(t)). A week holding a change of the truth (days 28-34, 56-62,
    84-90) can only take one value (near its average hazard, more than 10%
    from both sides of the first two changes): the 10% criterion is on the
    other days after day 14, and those weeks must lie between their truths."""
    import epifit

    cases, truth = _truth_counts(DAYS)
    data = with_beta(per_time=7, smoothing={"kind": "random_walk", "sd": 0.2})
    for name in ("sigma", "gamma"):
        data["parameters"][name]["fixed"] = True
    path = _write_model(tmp_path, data)
    t0 = time.perf_counter()
    ds = dataset(DAYS, cases)
    fit = epifit.calibrate(path, ds, uncertainty=False, progress=False)
    wall = time.perf_counter() - t0
    assert fit.converged, fit.message
    fitted = np.asarray(fit.problem.model.daily_values(fit.params)["beta"])
    days = np.arange(DAYS)
    week = days // 7
    straddles = np.array([np.ptp(truth[week == w]) > 0 for w in week])
    rel = np.abs(fitted / truth - 1.0)
    inside = (days >= 14) & ~straddles
    share = float(np.mean(rel[inside] < 0.10))
    print(
        f"recovery: {100 * share:.1f}% of {inside.sum()} days within 10% "
        f"(all days from 14: {100 * np.mean(rel[14:] < 0.10):.1f}%), median "
        f"error {100 * np.median(rel[14:]):.2f}%, {fit.iterations} iterations, "
        f"{wall:.1f} s ({fit.message})"
    )
    assert share >= 0.90
    for w in np.unique(week[straddles]):
        t = truth[week == w]
        assert t.min() <= fitted[week == w][0] <= t.max(), w


def test_a_scenario_sets_or_scales_a_time_varying_parameter():
    from epifit.forecasting import Change, Scenario, forecast

    days, extra = 28, 14
    problem = Problem(load(with_beta(per_time=7)), dataset(days))
    params = problem.init_params()
    values = problem.model.constrain(params)
    values["beta"] = np.array([0.6, 0.5, 0.4, 0.45])
    params = problem.model.unconstrain(values)
    scenarios = [
        Scenario("set", (Change(parameter="beta", value=0.3, start=days + 7),)),
        Scenario("half", (Change(parameter="beta", scale=0.5, start=days),)),
    ]
    fc = forecast(
        problem, params=params, scenarios=scenarios, samples=0, days=extra,
        rtol=1e-10, atol=1e-10,
    )  # fmt: skip
    longer = Problem(load(with_beta(per_time=7)), dataset(days + extra))

    def expected(pieces):
        p = longer.model.unconstrain({**values, "beta": pieces})
        mu = longer.predict(p, longer.solve(p, TIGHT).ys)["cases"]
        return np.asarray(mu)[:, 0]

    want = {
        "baseline": [0.6, 0.5, 0.4, 0.45, 0.45, 0.45],
        "set": [0.6, 0.5, 0.4, 0.45, 0.45, 0.3],
        "half": [0.6, 0.5, 0.4, 0.45, 0.225, 0.225],
    }
    for name, pieces in want.items():
        got = fc["estimate_cases"].sel(scenario=name).values[1:, 0]
        np.testing.assert_allclose(got, expected(np.array(pieces)), rtol=1e-6)


@pytest.mark.parametrize(
    "per_time, start, end",
    [
        ({"kind": "spline", "knots": 6}, 20, 35),  # from inside the fitted days
        ({"kind": "periodic", "period": 10.0, "harmonics": 2}, 30, 42),
    ],
)
def test_a_scale_multiplies_the_daily_values_of_a_spline_or_fourier_series(
    per_time, start, end
):
    """`scale` on a spline or a Fourier series multiplies its value on each
    day of the window, whatever its shape there: the forecast equals a solve
    of the same model with beta a daily covariate scaled on those days."""
    from epifit.forecasting import Change, Scenario, forecast

    days, extra = 28, 14
    problem = Problem(load(with_beta(per_time=per_time)), dataset(days))
    params = problem.init_params()
    k = params["beta"].shape[0]
    params["beta"] = params["beta"] + jnp.asarray(np.linspace(-0.5, 0.5, k))
    change = Change(parameter="beta", scale=0.5, start=start, end=end)
    fc = forecast(
        problem, [Scenario("half", (change,))], params=params, samples=0,
        days=extra, rtol=1e-10, atol=1e-10,
    )  # fmt: skip
    beta = np.asarray(problem.model.daily_values(params, days + extra)["beta"])
    assert np.ptp(beta[start:end]) > 0.05  # the shape inside the window matters
    day = np.arange(days + extra)
    scaled = beta * np.where((day >= start) & (day < end), 0.5, 1.0)
    ref = copy.deepcopy(SEIR)
    del ref["parameters"]["beta"]
    ref["covariates"] = {"beta": {"dims": ["time"], "rule": "floor"}}
    for name, b in (("baseline", beta), ("half", scaled)):
        ds = dataset(days + extra)
        ds["beta"] = ("time", b)
        longer = Problem(load(ref), ds)
        p = {k: v for k, v in params.items() if k != "beta"}
        mu = np.asarray(longer.predict(p, longer.solve(p, TIGHT).ys)["cases"])[:, 0]
        got = fc["estimate_cases"].sel(scenario=name).values[1:, 0]
        np.testing.assert_allclose(got, mu, rtol=1e-6)
