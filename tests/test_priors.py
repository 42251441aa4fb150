"""Priors on every free parameter (issue 22): the default prior of neural
weights, declared priors, their records in `FIT.nc`, and the derivatives of
the prior terms against finite differences of a NumPy re-implementation."""

import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import xarray as xr

from epifit.data import DataError, open_dataset
from epifit.fitting import FitConfigError, FitResult, calibrate, parse_fit_config
from epifit.fitting._parameters import FreeParameters
from epifit.fitting._priors import NEURAL_PRIOR_GAIN, check_prior_records
from epifit.simulation import Problem

REPO = Path(__file__).resolve().parents[1]
METAPOP = REPO / "models" / "seird_metapop_counts.toml"
DATA = REPO / "data" / "synthetic_metapop_20.nc"
SIR = REPO / "models" / "sir.toml"
SCHOOL = REPO / "data" / "boarding_school_1978.nc"


@pytest.fixture(scope="module")
def metapop():
    return Problem(METAPOP, open_dataset(DATA))


def _free(problem, fit=None):
    config = None if fit is None else parse_fit_config(fit)
    return FreeParameters(problem, problem.init_params(), config)


def softplus(x):
    return np.logaddexp(0.0, x)


def _numpy_penalty(free, x, gamma_prior, scaler_prior):
    """The negative log-prior written out: the MLP's weights Normal(0, 3 /
    sqrt(fan_in)) each (fan_in 7 for every layer of the 7-7-7-7-1 MLP),
    gamma ~ Normal(m, s) and scaler ~ LogNormal(median, sdlog) on the
    constrained (softplus) scale; the other parameters flat."""
    labels = np.asarray(free.labels)
    weights = np.array([lab.startswith("beta.") for lab in labels])
    sd = NEURAL_PRIOR_GAIN / math.sqrt(7.0)
    total = 0.5 * np.sum((x[weights] / sd) ** 2)
    m, s = gamma_prior
    g = softplus(x[labels == "gamma"])
    total += np.sum(0.5 * ((g - m) / s) ** 2)
    median, sdlog = scaler_prior
    c = softplus(x[[lab.startswith("scaler[") for lab in labels]])
    total += np.sum(0.5 * ((np.log(c) - math.log(median)) / sdlog) ** 2 + np.log(c))
    return total


def test_every_free_parameter_has_a_prior_and_weights_a_proper_default(metapop):
    free = _free(metapop)
    assert (
        set(free.records)
        == set(free.names)
        == {
            "alpha",
            "beta",
            "gamma",
            "kappa",
            "scaler",
        }
    )
    beta = free.records["beta"]
    assert beta["family"] == "normal" and beta["on"] == "weights"
    assert beta["source"] == "default" and beta["mean"] == 0.0
    # 4 layers x (weight, bias), each fan_in 7
    assert sorted(beta["sd"]) == sorted(
        f"layers[{k}].{w}" for k in range(4) for w in ("weight", "bias")
    )
    for sd in beta["sd"].values():
        assert sd == pytest.approx(3.0 / math.sqrt(7.0), rel=1e-15)
    for name in ("alpha", "gamma", "kappa", "scaler"):
        assert free.records[name] == {
            "family": "flat",
            "on": "unconstrained",
            "source": "default",
        }
    assert check_prior_records(free.records, set(free.names)) == ""
    # the penalty at the initial point is the Gaussian of the weights
    x = np.asarray(free.x0)
    weights = np.array([lab.startswith("beta.") for lab in free.labels])
    assert weights.sum() == 176
    want = 0.5 * np.sum((x[weights] / (3.0 / math.sqrt(7.0))) ** 2)
    assert float(free.penalty(free.x0, free.rest)) == pytest.approx(want, rel=1e-13)
    r = np.asarray(free.penalty_residuals(free.x0, free.rest))
    assert np.sum(r**2) == pytest.approx(want, rel=1e-13)
    assert free.least_squares_penalty  # a Gaussian: least-squares methods use it


def test_declared_priors_flat_l2_and_refusals(metapop):
    free = _free(metapop, {"parameters": {"beta": {"prior": {"family": "flat"}}}})
    assert free.records["beta"] == {
        "family": "flat",
        "on": "unconstrained",
        "source": "fit",
    }
    assert float(free.penalty(free.x0, free.rest)) == 0.0
    free = _free(metapop, {"parameters": {"beta": {"prior": {"mean": 0.1, "sd": 2}}}})
    rec = free.records["beta"]
    assert rec["source"] == "fit" and rec["mean"] == 0.1
    assert set(rec["sd"].values()) == {2.0}
    x = np.asarray(free.x0)
    weights = np.array([lab.startswith("beta.") for lab in free.labels])
    want = 0.5 * np.sum(((x[weights] - 0.1) / 2.0) ** 2)
    assert float(free.penalty(free.x0, free.rest)) == pytest.approx(want, rel=1e-13)
    # l2 is the weights' Gaussian prior, recorded as such
    free = _free(metapop, {"parameters": {"beta": {"l2": 0.5}}})
    assert free.records["beta"]["sd"] == pytest.approx(1.0)
    assert free.records["beta"]["l2"] == 0.5
    assert float(free.penalty(free.x0, free.rest)) == pytest.approx(
        0.5 * np.sum(x[weights] ** 2), rel=1e-13
    )
    with pytest.raises(FitConfigError, match=r"parameters\.beta\.prior.*lognormal"):
        calibrate(
            metapop,
            fit={
                "parameters": {
                    "beta": {"prior": {"family": "lognormal", "median": 1, "sdlog": 1}}
                }
            },  # noqa: E501
            uncertainty=False,
        )
    with pytest.raises(FitConfigError, match=r"parameters\.beta\.l2.*both"):
        calibrate(
            metapop,
            fit={"parameters": {"beta": {"prior": {"mean": 0, "sd": 1}, "l2": 0.1}}},
            uncertainty=False,
        )
    with pytest.raises(FitConfigError, match=r"parameters\.gamma\.prior"):
        parse_fit_config(
            {"parameters": {"gamma": {"prior": {"family": "flat", "sd": 1}}}}
        )


def test_prior_gradient_and_hessian_agree_with_finite_differences(metapop):
    gamma_prior, scaler_prior = (1.4, 0.3), (0.9, 0.5)
    fit = {
        "parameters": {
            "gamma": {"prior": {"family": "normal", "mean": 1.4, "sd": 0.3}},
            "scaler": {"prior": {"family": "lognormal", "median": 0.9, "sdlog": 0.5}},
        }
    }
    free = _free(metapop, fit)
    rng = np.random.default_rng(0)
    x = np.asarray(free.x0) + 0.1 * rng.standard_normal(free.n)

    def f(v):
        return _numpy_penalty(free, v, gamma_prior, scaler_prior)

    def penalty(v):
        return free.penalty(v, free.rest)

    assert float(penalty(jnp.asarray(x))) == pytest.approx(f(x), rel=1e-12)
    g = np.asarray(jax.jit(jax.grad(penalty))(jnp.asarray(x)))
    h = 1e-5
    eye = np.eye(free.n)
    g_fd = np.array([(f(x + h * e) - f(x - h * e)) / (2 * h) for e in eye])
    np.testing.assert_allclose(g, g_fd, rtol=1e-7, atol=1e-8)
    H = np.asarray(jax.jit(jax.hessian(penalty))(jnp.asarray(x)))
    # the Hessian by central differences of the NumPy gradient-free function,
    # column by column from the FD gradient (h large enough for 1e-6)
    hh = 1e-4

    def grad_fd(v):
        return np.array([(f(v + hh * e) - f(v - hh * e)) / (2 * hh) for e in eye])

    # alpha, weights, gamma, kappa, a scaler (the free vector is sorted by name)
    assert free.labels[177] == "gamma" and free.labels[178] == "kappa"
    cols = [0, 8, 40, 100, 177, 178, 185]
    for j in cols:
        col = (grad_fd(x + hh * eye[j]) - grad_fd(x - hh * eye[j])) / (2 * hh)
        np.testing.assert_allclose(H[:, j], col, rtol=1e-5, atol=1e-5)
    # the weights' block is exactly the prior precision, diagonal
    weights = np.array([lab.startswith("beta.") for lab in free.labels])
    np.testing.assert_allclose(
        np.diag(H)[weights], 7.0 / NEURAL_PRIOR_GAIN**2, rtol=1e-13
    )
    off = H[np.ix_(weights, weights)] - np.diag(np.diag(H)[weights])
    assert np.all(off == 0.0)


def test_smoothing_prior_is_recorded_and_differentiates_like_fd():
    days = 60
    ds = xr.Dataset(
        {"cases": ("time", np.linspace(10.0, 200.0, days))},
        coords={"time": np.arange(days)},
    )
    problem = Problem(REPO / "models" / "seir_rw.toml", ds)
    free = _free(problem)
    assert free.records == {
        "beta": {
            "family": "random_walk",
            "order": 1,
            "sd": 0.2,
            "on": "increments",
            "source": "model",
        }
    }
    rng = np.random.default_rng(1)
    x = np.asarray(free.x0) + 0.3 * rng.standard_normal(free.n)

    def f(v):
        d = np.diff(v) / 0.2
        return np.sum(0.5 * d**2 + math.log(0.2) + 0.5 * math.log(2 * math.pi))

    def penalty(v):
        return free.penalty(v, free.rest)

    assert float(penalty(jnp.asarray(x))) == pytest.approx(f(x), rel=1e-12)
    g = np.asarray(jax.jit(jax.grad(penalty))(jnp.asarray(x)))
    eye = np.eye(free.n)
    h = 1e-5
    g_fd = np.array([(f(x + h * e) - f(x - h * e)) / (2 * h) for e in eye])
    np.testing.assert_allclose(g, g_fd, rtol=1e-7, atol=1e-8)
    H = np.asarray(jax.jit(jax.hessian(penalty))(jnp.asarray(x)))
    hh = 1e-3
    H_fd = np.array(
        [
            [
                (
                    f(x + hh * (ei + ej))
                    - f(x + hh * (ei - ej))
                    - f(x - hh * (ei - ej))
                    + f(x - hh * (ei + ej))
                )
                / (4 * hh * hh)
                for ej in eye
            ]
            for ei in eye
        ]
    )
    np.testing.assert_allclose(H, H_fd, rtol=1e-6, atol=1e-6)


def test_fit_nc_stores_every_prior_and_checks_them_on_reading(tmp_path):
    fit = calibrate(
        SIR,
        SCHOOL,
        fit={
            "parameters": {
                "beta": {"prior": {"family": "lognormal", "median": 2, "sdlog": 0.5}}
            }
        },  # noqa: E501
        optimizer=[{"method": "lbfgs", "iterations": 5}],
        uncertainty=False,
        progress=False,
    )
    assert fit.priors == {
        "I0": {"family": "flat", "on": "unconstrained", "source": "default"},
        "beta": {
            "family": "lognormal",
            "median": 2.0,
            "sdlog": 0.5,
            "on": "constrained",
            "source": "fit",
        },
        "gamma": {"family": "flat", "on": "unconstrained", "source": "default"},
    }
    path = fit.to_netcdf(tmp_path / "fit.nc")
    back = FitResult.from_netcdf(path)
    assert back.priors == fit.priors
    ds = xr.load_dataset(path)
    assert json.loads(ds.attrs["priors"]) == fit.priors
    # a file whose priors lack a free parameter, or hold a bad one, is refused
    bad = dict(fit.priors)
    del bad["gamma"]
    ds.attrs["priors"] = json.dumps(bad)
    ds.to_netcdf(tmp_path / "bad.nc")
    with pytest.raises(DataError, match="no prior for gamma"):
        FitResult.from_netcdf(tmp_path / "bad.nc")
    bad = {**fit.priors, "beta": {**fit.priors["beta"], "sdlog": -1.0}}
    ds.attrs["priors"] = json.dumps(bad)
    ds.to_netcdf(tmp_path / "bad2.nc")
    with pytest.raises(DataError, match="'beta' has a scale that is not > 0"):
        FitResult.from_netcdf(tmp_path / "bad2.nc")
