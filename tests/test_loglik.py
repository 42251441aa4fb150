"""True log-likelihoods (issue 19): the families against SciPy, `Normal` with a
fitted standard deviation, a fit's log-likelihood, AIC and BIC (in Python,
`FIT.nc` and `--json`), and the note on parameters shared by several patches."""

import functools as ft
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
import xarray as xr
from scipy.integrate import solve_ivp

import epifit
from epifit.cli import main
from epifit.data import Gaussian, NegativeBinomial, Normal, Poisson
from epifit.fitting import FitResult, FreeParameters, Objective
from epifit.fitting._information import shared_parameter_note
from epifit.fitting._objective import observation_model
from epifit.model import loads_model

REPO = Path(__file__).resolve().parents[1]
RTOL = 1e-10  # float64 sums of O(100) terms of size O(10)
DATES = np.datetime64("2020-03-01") + np.arange(200).astype("timedelta64[D]")


def _data(rng, shape, mean=20.0):
    """Predictions, counts drawn from them, and a mask with NaN where it is
    False (missing data, as in a dataset)."""
    predicted = rng.gamma(2.0, mean / 2.0, shape) + 1e-3
    observed = rng.poisson(predicted).astype(float)
    mask = rng.uniform(size=shape) < 0.7
    mask.flat[0] = True
    observed[~mask] = np.nan
    observed.flat[1] = np.nan  # NaN even where the mask says present
    return predicted, observed, mask


def _kept(observed, mask):
    return mask & np.isfinite(observed)


# ------------------------------------------------------ families against SciPy


@pytest.mark.parametrize("seed", range(3))
def test_normal_is_the_sum_of_scipy_norm_logpdf(seed):
    rng = np.random.default_rng(seed)
    predicted, observed, mask = _data(rng, (30, 4))
    keep = _kept(observed, mask)
    for sd in (rng.uniform(0.5, 5.0), rng.uniform(0.5, 5.0, (1, 4))):
        sds = np.broadcast_to(sd, observed.shape)
        want = scipy.stats.norm.logpdf(observed, predicted, sds)[keep].sum()
        model = Normal(sd, weight=3.0)
        np.testing.assert_allclose(
            model.log_likelihood(predicted, observed, mask), want, rtol=RTOL
        )
        np.testing.assert_allclose(
            model.loss(predicted, observed, mask), -3.0 * want, rtol=RTOL
        )
        points = np.asarray(model.point_log_likelihood(predicted, observed, mask))
        np.testing.assert_array_equal(points[~keep], 0.0)
        np.testing.assert_allclose(
            points[keep],
            scipy.stats.norm.logpdf(observed, predicted, sds)[keep],
            rtol=RTOL,
        )


@pytest.mark.parametrize("seed", range(3))
def test_gaussian_least_squares_log_likelihood_is_a_normal_of_its_weight(seed):
    """Least squares keeps its loss (the weighted sum of squares) and its
    log-likelihood is the normal density of sd sqrt(1 / (2 weight))."""
    rng = np.random.default_rng(seed)
    predicted, observed, mask = _data(rng, (25, 3))
    keep = _kept(observed, mask)
    weight = rng.uniform(0.01, 2.0)
    sd = math.sqrt(1.0 / (2.0 * weight))
    want = scipy.stats.norm.logpdf(observed, predicted, sd)[keep].sum()
    model = Gaussian(weight=weight)
    np.testing.assert_allclose(
        model.log_likelihood(predicted, observed, mask), want, rtol=RTOL
    )
    ssr = np.sum((predicted - observed)[keep] ** 2)
    np.testing.assert_allclose(
        model.loss(predicted, observed, mask), weight * ssr, rtol=RTOL
    )


@pytest.mark.parametrize("seed", range(3))
def test_poisson_and_negative_binomial_are_sums_of_scipy_logpmf(seed):
    rng = np.random.default_rng(seed)
    predicted, observed, mask = _data(rng, (40, 3))
    observed[2, 2], mask[2, 2] = 0.0, True
    keep = _kept(observed, mask)
    want = scipy.stats.poisson.logpmf(observed, predicted)[keep].sum()
    np.testing.assert_allclose(
        Poisson(weight=2.0).log_likelihood(predicted, observed, mask), want, rtol=RTOL
    )
    phi = rng.uniform(0.5, 20.0)
    want = scipy.stats.nbinom.logpmf(observed, phi, phi / (phi + predicted))[keep]
    model = NegativeBinomial(phi, weight=2.0)
    np.testing.assert_allclose(
        model.log_likelihood(predicted, observed, mask), want.sum(), rtol=RTOL
    )
    np.testing.assert_allclose(
        model.loss(predicted, observed, mask), -2.0 * want.sum(), rtol=RTOL
    )


def test_normal_gradient_in_sd_matches_finite_differences():
    rng = np.random.default_rng(11)
    predicted, observed, mask = _data(rng, (20, 2))

    @jax.jit
    def loss(sd):
        return Normal(sd, weight=1.5).loss(predicted, observed, mask)

    for sd in (jnp.asarray(3.0), jnp.asarray([[2.0, 6.0]])):
        g = np.asarray(jax.grad(loss)(sd))
        eps = 1e-6
        for i in np.ndindex(sd.shape):
            step = jnp.zeros_like(sd).at[i].set(eps)
            fd = (loss(sd + step) - loss(sd - step)) / (2 * eps)
            np.testing.assert_allclose(g[i], fd, rtol=1e-7)
    # the loss is least at the residuals' root mean square (the MLE of sd)
    keep = _kept(observed, mask)
    rms = np.sqrt(np.mean((predicted - observed)[keep] ** 2))
    np.testing.assert_allclose(jax.grad(loss)(jnp.asarray(rms)), 0.0, atol=1e-9)
    assert float(loss(jnp.asarray(0.8 * rms))) > float(loss(jnp.asarray(rms)))
    assert float(loss(jnp.asarray(1.25 * rms))) > float(loss(jnp.asarray(rms)))


def test_normal_masked_points_give_no_gradient():
    rng = np.random.default_rng(3)
    predicted, observed, mask = _data(rng, (8, 3))
    bad = np.where(mask, predicted, np.nan)

    @ft.partial(jax.grad, argnums=(0, 1))
    def grad(p, sd):
        return Normal(sd).log_likelihood(p, observed, mask)

    g_p, g_sd = grad(jnp.asarray(bad), jnp.full((8, 3), 2.0))
    keep = _kept(observed, mask)
    assert np.all(np.isfinite(g_p)) and np.all(np.isfinite(g_sd))
    np.testing.assert_array_equal(np.asarray(g_p)[~keep], 0.0)
    np.testing.assert_array_equal(np.asarray(g_sd)[~keep], 0.0)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Normal(0.0), r"Normal\(sd=...\) must be > 0"),
        (lambda: Normal(1.0, weight=-1.0), r"Normal\(weight=...\) must be > 0"),
    ],
)
def test_normal_refuses_non_positive_values(make, message):
    with pytest.raises(ValueError, match=message):
        make()


# --------------------------------------------------------------- the models


def _sir(observation: str, parameters: str = "", per_patch: bool = False) -> str:
    """A SIR in counts (N = 1000, I0 = 5 fixed; beta, gamma free) observed as
    `y` by the `observation` lines, with further `parameters` lines."""
    pp = ", per_patch = true" if per_patch else ""
    return f"""
name = "sir_counts"
compartments = ["S", "I", "R"]

[parameters]
N = {{ value = 1000.0, fixed = true }}
beta = {{ value = 0.5, transform = "softplus"{pp} }}
gamma = {{ value = 0.2, transform = "softplus" }}
I0 = {{ value = 5.0, fixed = true }}
{parameters}

[[infections]]
from = "S"
to = "I"
transmission = "beta"
infectious = ["I"]
normalize = "population"
population = "N"

[[transitions]]
from = "I"
to = "R"
rate = "gamma"

[initial]
S = "N - I0"
I = "I0"

[[observations]]
name = "y"
{observation}
"""


PREVALENCE = 'kind = "prevalence"\ncompartments = ["I"]'
POISSON = 'kind = "incidence"\ncompartments = ["S"]\nsign = -1\nfamily = "poisson"'
GAUSSIAN_SD = PREVALENCE + '\nfamily = "gaussian"\nsd = "sigma"'
GAUSSIAN_S = GAUSSIAN_SD.replace('["I"]', '["S"]')
SIGMA = 'sigma = { value = 2.0, transform = "softplus" }'


def _model(observation, parameters="", per_patch=False):
    return loads_model(_sir(observation, parameters, per_patch))


def _sir_prevalence(beta, gamma, days, n=1000.0, i0=5.0):
    def f(t, u):
        s, i = u
        new = beta * s * i / n
        return [-new, new - gamma * i]

    sol = solve_ivp(
        f,
        (0.0, days - 1.0),
        [n - i0, i0],
        t_eval=np.arange(days, dtype=float),
        method="DOP853",
        rtol=1e-12,
        atol=1e-10,
    )
    return sol.y[0], sol.y[1]


def _poisson_fit():
    rng = np.random.default_rng(5)
    s, _ = _sir_prevalence(0.5, 0.2, 40)
    cases = np.concatenate([[np.nan], rng.poisson(-np.diff(s)).astype(float)])
    cases[7] = np.nan  # a missing day
    ds = xr.Dataset({"y": ("time", cases)}, coords={"time": DATES[:40]})
    model = _model(POISSON)
    fit = epifit.calibrate(
        model,
        ds,
        optimizer={"method": "lbfgs", "iterations": 40},
        values={"beta": 0.45, "gamma": 0.22},
        uncertainty=False,
        progress=False,
    )
    return model, ds, fit


@pytest.fixture(scope="module")
def poisson_fit():
    return _poisson_fit()


def test_fit_reports_the_log_likelihood_aic_and_bic(poisson_fit):
    _, ds, fit = poisson_fit
    traj = fit.trajectories
    observed = np.asarray(traj["observed_y"]).ravel()
    predicted = np.asarray(traj["predicted_y"]).ravel()
    keep = np.isfinite(observed)
    assert keep.sum() == 38  # 40 days, no incidence on day 0, one missing
    want = scipy.stats.poisson.logpmf(observed[keep], predicted[keep]).sum()
    np.testing.assert_allclose(fit.log_likelihood, want, rtol=1e-10)
    # the loss is the Poisson negative log-likelihood (weight 1, no priors)
    np.testing.assert_allclose(fit.loss, -fit.log_likelihood, rtol=1e-8)
    assert fit.n_parameters == len(fit.x) == 2
    assert fit.n_data == 38
    assert fit.aic == pytest.approx(2 * 2 - 2 * want, rel=1e-10)
    assert fit.bic == pytest.approx(2 * math.log(38) - 2 * want, rel=1e-10)
    text = fit.summary()
    assert f"log-likelihood {fit.log_likelihood:.10g}" in text
    assert "(2 free parameters, 38 observed points)" in text
    assert fit.notes == [] and "shared by" not in text  # one patch: no note
    summary = fit.to_json()
    assert summary["log_likelihood"] == fit.log_likelihood
    assert (summary["aic"], summary["bic"]) == (fit.aic, fit.bic)
    assert (summary["n_parameters"], summary["n_data"]) == (2, 38)
    assert summary["notes"] == []


def test_objective_log_likelihood_is_unweighted(poisson_fit):
    """`weight` scales the loss, not the log-likelihood."""
    _, ds, fit = poisson_fit
    heavy = _model(POISSON + "\nweight = 4.0")
    problem = epifit.Problem(heavy, ds)
    objective = Objective(problem, FreeParameters(problem, fit.params))
    data = objective.data()
    x = jnp.asarray(fit.x)
    ll = float(epifit.jit(objective.log_likelihood)(x, data))
    np.testing.assert_allclose(ll, fit.log_likelihood, rtol=1e-8)
    np.testing.assert_allclose(
        float(epifit.jit(objective.loss)(x, data)), -4.0 * ll, rtol=1e-8
    )


def test_fit_file_round_trip_and_older_files(poisson_fit, tmp_path):
    model, ds, fit = poisson_fit
    path = fit.to_netcdf(tmp_path / "FIT.nc")
    back = FitResult.from_netcdf(path, model=model, data=ds)
    assert back.log_likelihood == fit.log_likelihood
    assert (back.aic, back.bic) == (fit.aic, fit.bic)
    assert (back.n_parameters, back.n_data) == (2, 38)
    assert back.notes == []
    # a FIT.nc written before these fields: NaN, None, no notes
    old = epifit.open_dataset(path)
    for k in ("log_likelihood", "aic", "bic", "n_parameters", "n_data", "notes"):
        del old.attrs[k]
    epifit.write_dataset(old, tmp_path / "OLD.nc")
    back = FitResult.from_netcdf(tmp_path / "OLD.nc", model=model, data=ds)
    assert math.isnan(back.log_likelihood) and math.isnan(back.aic)
    assert math.isnan(back.bic)
    assert back.n_parameters is None and back.n_data is None and back.notes == []
    assert "log-likelihood" not in back.summary()
    assert back.to_json()["aic"] is None
    # a damaged attribute is named
    old.attrs["n_data"] = -3
    epifit.write_dataset(old, tmp_path / "BAD.nc")
    with pytest.raises(epifit.DataError, match=r"BAD\.nc.*'n_data' = -3"):
        FitResult.from_netcdf(tmp_path / "BAD.nc", model=model, data=ds)


# --------------------------------------------------------- observation models


def test_observation_model_maps_the_families():
    spec = _model(GAUSSIAN_SD, SIGMA)
    obs = spec.observations[0]
    ls = _model(PREVALENCE + "\nweight = 3.0").observations[0]
    model = observation_model(ls, {})
    assert type(model) is Gaussian and float(model.weight) == 3.0
    model = observation_model(obs, {"sigma": jnp.asarray(2.5)})
    assert type(model) is Normal and float(model.sd) == 2.5
    model = observation_model(obs, {"sigma": jnp.asarray([1.0, 2.0])})
    assert model.sd.shape == (1, 2)  # (patch,) against (stamp, patch)
    y = jnp.ones((5, 2))
    want = scipy.stats.norm.logpdf(1.0, 0.0, [[1.0, 2.0]] * 5).sum()
    np.testing.assert_allclose(model.log_likelihood(jnp.zeros((5, 2)), y), want)


def test_gaussian_with_sd_is_not_least_squares():
    spec = _model(GAUSSIAN_SD, SIGMA)
    s, i = _sir_prevalence(0.5, 0.2, 30)
    ds = xr.Dataset({"y": ("time", i)}, coords={"time": DATES[:30]})
    problem = epifit.Problem(spec, ds)
    objective = Objective(problem, FreeParameters(problem, problem.init_params()))
    assert not objective.gaussian_data and not objective.least_squares
    with pytest.raises(
        NotImplementedError, match="need least_squares observations; 'y' is gaussian"
    ):
        objective.residuals(objective.free.x0, objective.data())
    with pytest.raises(
        NotImplementedError,
        match="least_squares observations and only normal priors; this fit has 'y' "
        "gaussian",
    ):
        epifit.calibrate(spec, ds, optimizer="levenberg_marquardt", progress=False)


# ------------------------------------------------------------- sd recovery


def test_gaussian_fit_recovers_the_noise_sd():
    """The susceptibles (1000 down to ~100) with normal noise of sd 6 over 90
    days: the fitted `sigma` is the noise's within 20% (and its MLE, the RMS
    of the fitted residuals); the loss is the negative log-likelihood."""
    rng = np.random.default_rng(19)
    clean, _ = _sir_prevalence(0.5, 0.2, 90)
    noisy = clean + rng.normal(0.0, 6.0, clean.shape)
    ds = xr.Dataset({"y": ("time", noisy)}, coords={"time": DATES[:90]})
    spec = _model(GAUSSIAN_S, SIGMA)
    fit = epifit.calibrate(
        spec,
        ds,
        optimizer={"method": "lbfgs", "iterations": 60},
        values={"beta": 0.45, "gamma": 0.22, "sigma": 3.0},
        uncertainty=False,
        progress=False,
    )
    sigma = fit.parameters["sigma"]
    assert sigma == pytest.approx(6.0, rel=0.2)
    resid = np.asarray(fit.trajectories["observed_y"] - fit.trajectories["predicted_y"])
    rms = float(np.sqrt(np.nanmean(resid**2)))
    assert sigma == pytest.approx(rms, rel=1e-3)
    assert fit.parameters["beta"] == pytest.approx(0.5, rel=0.05)
    np.testing.assert_allclose(fit.loss, -fit.log_likelihood, rtol=1e-8)
    want = scipy.stats.norm.logpdf(
        np.asarray(fit.trajectories["observed_y"]).ravel(),
        np.asarray(fit.trajectories["predicted_y"]).ravel(),
        sigma,
    ).sum()
    np.testing.assert_allclose(fit.log_likelihood, want, rtol=1e-8)
    assert fit.n_parameters == 3 and fit.n_data == 90


# ------------------------------------------------- shared parameters, --json


def _two_patches(per_patch: bool):
    spec = _model(PREVALENCE, per_patch=per_patch)
    _, a = _sir_prevalence(0.5, 0.2, 30)
    _, b = _sir_prevalence(0.6, 0.2, 30)
    ds = xr.Dataset(
        {"y": (("time", "patch"), np.stack([a, b], axis=1))},
        coords={"time": DATES[:30], "patch": ["north", "south"]},
    )
    return spec, ds


SHARED = (
    "beta, gamma are shared by all 2 patches (scalar parameters); give them "
    "per_patch = true to fit one value per patch"
)


@pytest.mark.parametrize("per_patch", [False, True])
def test_note_on_parameters_shared_by_patches(per_patch):
    spec, ds = _two_patches(per_patch)
    problem = epifit.Problem(spec, ds)
    objective = Objective(problem, FreeParameters(problem, problem.init_params()))
    if per_patch:  # beta per patch, gamma still shared
        want = (
            "gamma is shared by all 2 patches (scalar parameters); give it "
            "per_patch = true to fit one value per patch"
        )
    else:
        want = SHARED
    assert shared_parameter_note(objective) == want
    # one patch: nothing is shared
    one = epifit.Problem(spec, ds.isel(patch=[0]))
    objective = Objective(one, FreeParameters(one, one.init_params()))
    assert shared_parameter_note(objective) == ""


def test_calibrate_json_has_the_log_likelihood_and_notes(tmp_path, capsys, monkeypatch):
    """`epifit calibrate --json` on two patches with scalar parameters: the
    log-likelihood, AIC, BIC, counts and the note; FIT.nc keeps the note."""
    monkeypatch.setenv("EPIFIT_NO_CACHE", "1")
    _, ds = _two_patches(False)
    model = tmp_path / "model.toml"
    model.write_text(_sir(PREVALENCE))
    data = tmp_path / "data.nc"
    epifit.write_dataset(ds, data)
    out = tmp_path / "FIT.nc"
    argv = ["calibrate", str(model), "--data", str(data), "--out", str(out)]
    argv += ["--no-progress", "--no-uncertainty", "--max-iterations", "3"]
    assert main([*argv, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    fit = FitResult.from_netcdf(out)
    assert summary["log_likelihood"] == fit.log_likelihood
    assert math.isfinite(summary["log_likelihood"])
    assert summary["aic"] == pytest.approx(4 - 2 * summary["log_likelihood"])
    assert summary["bic"] == pytest.approx(
        2 * math.log(60) - 2 * summary["log_likelihood"]
    )
    assert (summary["n_parameters"], summary["n_data"]) == (2, 60)
    assert summary["notes"] == fit.notes == [SHARED]
    assert f"note: {SHARED}" in fit.summary().splitlines()


def test_a_non_finite_point_is_named_with_a_per_patch_sd():
    """The diagnosis of a non-finite likelihood finds the point from each
    point's log-likelihood, with an sd of one value per patch."""
    from epifit.fitting._diagnose import explain_nonfinite

    # residuals of ~1e-3 over sd 1e-150 square to ~1e294; 1e15's overflows
    sigma = 'sigma = { value = 1e-150, transform = "softplus", per_patch = true }'
    spec = _model(GAUSSIAN_SD, sigma)
    _, ds = _two_patches(False)
    ds["y"][5, 1] = 1e15
    problem = epifit.Problem(spec, ds)
    objective = Objective(problem, FreeParameters(problem, problem.init_params()))
    why = explain_nonfinite(objective, objective.free.x0, objective.data())
    assert why == (
        "observation 'y' gives a non-finite likelihood: value 1e+15 against "
        f"prediction {why.split('prediction ')[1].split(' at')[0]} at day 5 "
        "(2020-03-06), patch 'south' (gaussian); check that value in the data"
    )
