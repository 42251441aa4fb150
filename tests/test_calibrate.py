"""`calibrate` on the boarding-school outbreak against an independent fit.

The reference is written here with SciPy alone: the SIR model integrated by
`solve_ivp` (DOP853, rtol 1e-12) and fitted by `scipy.optimize.least_squares`
on the published `in_bed` counts, with beta, gamma and I0 free (N = 763).
"""

import math
from pathlib import Path

import numpy as np
import pytest
from scipy.integrate import solve_ivp
from scipy.optimize import least_squares
from scipy.stats import norm

import epifit
from epifit.fitting import FitResult
from epifit.simulation import Problem

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "models" / "sir.toml"
DATA = REPO / "data" / "boarding_school_1978.nc"
IN_BED = np.array([3, 8, 26, 76, 225, 298, 258, 233, 189, 128, 68, 29, 14, 4], float)
N = 763.0
DAYS = np.arange(14.0)
# epifit solves at rtol = atol = 1e-10 here, so its optimum differs from the
# reference's (rtol 1e-12) by far less than the 0.5% the issue asks for
FIT_TOL = dict(rtol=1e-10, atol=1e-10)


def reference_in_bed(theta):
    beta, gamma, i0 = theta

    def f(t, u):
        s, i = u
        new = beta * s * i / N
        return [-new, new - gamma * i]

    sol = solve_ivp(
        f,
        (0.0, 13.0),
        [N - i0, i0],
        t_eval=DAYS,
        method="DOP853",
        rtol=1e-12,
        atol=1e-10,
    )
    return sol.y[1]


@pytest.fixture(scope="module")
def reference():
    r = least_squares(
        lambda th: reference_in_bed(th) - IN_BED,
        x0=[2.0, 0.5, 1.0],
        x_scale="jac",
        xtol=1e-14,
        ftol=1e-14,
        gtol=1e-14,
    )
    assert r.success
    return r


@pytest.fixture(scope="module")
def fit():
    return epifit.calibrate(MODEL, DATA, progress=False, **FIT_TOL)


def test_agrees_with_scipy_least_squares(fit, reference):
    beta, gamma, i0 = reference.x
    got = fit.parameters
    for name, want in (("beta", beta), ("gamma", gamma), ("I0", i0)):
        assert got[name] == pytest.approx(want, rel=5e-3), name
    # much closer in fact: both are the same optimum up to solver tolerances
    for name, want in (("beta", beta), ("gamma", gamma), ("I0", i0)):
        assert got[name] == pytest.approx(want, rel=1e-5), name
    assert fit.loss == pytest.approx(2 * reference.cost, rel=1e-7)
    assert fit.converged, fit.message
    assert fit.parameters["N"] == 763.0  # fixed: never moves
    assert fit.parameters["R0"] == pytest.approx(beta / gamma, rel=1e-5)


def test_default_optimiser_is_levenberg_marquardt_and_fast(fit):
    assert fit.settings["phases"][0]["method"] == "levenberg_marquardt"
    assert fit.iterations <= 30
    assert np.all(np.diff(fit.loss_history) <= 0)  # LM never accepts an increase


def test_gauss_newton_intervals_agree_with_scipy_jacobian(fit, reference):
    """Standard errors from the reference's own Jacobian: `s² (JᵀJ)⁻¹` with
    `s² = SSR / (n - p)` on the constrained scale (the delta method)."""
    J = reference.jac
    n, p = J.shape
    s2 = 2 * reference.cost / (n - p)
    cov = s2 * np.linalg.inv(J.T @ J)
    se = np.sqrt(np.diag(cov))
    rows = {r["label"]: r for r in fit.table}
    for j, name in enumerate(("beta", "gamma", "I0")):
        assert rows[name]["se"] == pytest.approx(se[j], rel=1e-3), name
    assert fit.uncertainty["noise_variance"] == pytest.approx(s2, rel=1e-6)
    # the interval is the normal interval of the softplus coordinate, mapped
    x = np.log(np.expm1(reference.x))
    dcdx = 1.0 / (1.0 + np.exp(-x))  # softplus'(x)
    se_x = se / dcdx
    z = norm.ppf(0.975)
    for j, name in enumerate(("beta", "gamma", "I0")):
        lo = np.log1p(np.exp(x[j] - z * se_x[j]))
        hi = np.log1p(np.exp(x[j] + z * se_x[j]))
        assert rows[name]["lower"] == pytest.approx(lo, rel=2e-3), name
        assert rows[name]["upper"] == pytest.approx(hi, rel=2e-3), name
        assert rows[name]["lower"] < rows[name]["estimate"] < rows[name]["upper"]
    # R0 = beta / gamma by the delta method
    g = np.array([1 / reference.x[1], -reference.x[0] / reference.x[1] ** 2, 0.0])
    assert rows["R0"]["se"] == pytest.approx(math.sqrt(g @ cov @ g), rel=2e-3)
    assert rows["R0"]["lower"] < rows["R0"]["estimate"] < rows["R0"]["upper"]
    assert rows["N"]["kind"] == "fixed" and rows["N"]["se"] == 0.0


def test_result_views_and_json(fit):
    js = fit.to_json()
    assert set(js) >= {"parameters", "loss", "iterations", "converged"}
    assert js["parameters"]["beta"] == fit.parameters["beta"]
    assert "R0" in js["intervals"]
    text = fit.summary()
    assert "beta" in text and "R0" in text and "fixed" in text
    assert fit.trajectories["predicted_in_bed"].shape == (14, 1)


def test_netcdf_round_trip(fit, tmp_path):
    path = fit.to_netcdf(tmp_path / "FIT.nc")
    ds = epifit.open_dataset(path)
    assert ds.attrs["epifit_kind"] == "fit"
    assert ds.attrs["converged"] == 1
    assert "SIR" in ds.attrs["model_text"] or "sir" in ds.attrs["model_text"]
    assert ds.attrs["data_sha256"] and ds.attrs["model_sha256"]
    assert ds.attrs["version_jax"]
    np.testing.assert_allclose(
        ds["residual_in_bed"].values[:, 0],
        IN_BED - ds["predicted_in_bed"].values[:, 0],
    )
    assert ds["loss_history"].dims == ("iteration",)
    assert ds["covariance"].dims == ("free", "free_to")
    assert list(ds["free"].values) == ["I0", "beta", "gamma"]
    back = FitResult.from_netcdf(path)
    assert back.loss == fit.loss
    assert back.parameters == pytest.approx(fit.parameters, rel=1e-12)
    np.testing.assert_array_equal(back.covariance, fit.covariance)
    np.testing.assert_array_equal(back.loss_history, fit.loss_history)
    assert back.table == fit.table
    # the data file still exists unchanged: the problem is bound again and the
    # stored parameters reproduce the fitted trajectory
    assert back.problem is not None
    sol = back.problem.solve(back.params, rtol=1e-10, atol=1e-10)
    pred = back.problem.predict(back.params, sol.ys)["in_bed"][:, 0]
    np.testing.assert_allclose(pred, fit.trajectories["predicted_in_bed"][:, 0])


def test_fixed_override(tmp_path):
    """A fit config fixes I0 at 1: beta and gamma agree with SciPy's fit of the
    same two-parameter problem (started from values in a JSON file)."""
    start = tmp_path / "start.json"
    start.write_text('{"beta": 1.5, "gamma": 0.3}')
    res = epifit.calibrate(
        Problem(MODEL, DATA),
        fit={"parameters": {"I0": {"value": 1.0, "fixed": True}}},
        values=start,
        uncertainty=False,
        progress=False,
        **FIT_TOL,
    )
    assert res.parameters["I0"] == 1.0
    assert res.labels == ("beta", "gamma")
    r = least_squares(
        lambda th: reference_in_bed([th[0], th[1], 1.0]) - IN_BED,
        x0=[2.0, 0.5],
        x_scale="jac",
        xtol=1e-14,
        ftol=1e-14,
        gtol=1e-14,
    )
    assert res.parameters["beta"] == pytest.approx(r.x[0], rel=1e-5)
    assert res.parameters["gamma"] == pytest.approx(r.x[1], rel=1e-5)
    assert np.isnan(res.table[1]["se"])  # no uncertainty asked for


def test_restart_from_a_fit(fit):
    """Started at a previous optimum, Levenberg-Marquardt stops at once there."""
    res = epifit.calibrate(
        MODEL, DATA, init=fit, uncertainty=False, progress=False, **FIT_TOL
    )
    assert res.iterations <= 6
    assert res.initial_losses[0] == pytest.approx(fit.loss, rel=1e-12)
    # it does not leave the optimum: the loss stays, and the parameters move
    # only within the precision the first fit's stopping rule left them at
    # (measured 1.05e-9 relative for beta on one CPU, below 1e-9 on another)
    assert res.loss <= fit.loss * (1 + 1e-12)
    assert res.parameters == pytest.approx(fit.parameters, rel=1e-8)
    with pytest.raises(TypeError, match="For constrained values use values="):
        epifit.calibrate(MODEL, DATA, init={"beta": 2.0}, progress=False)


def test_loss_matches_the_definition(fit):
    """The reported loss is the sum of squared residuals of the trajectory."""
    residual = IN_BED - fit.trajectories["predicted_in_bed"].values[:, 0]
    assert fit.loss == pytest.approx(float(np.sum(np.square(residual))), rel=1e-10)


def test_an_optax_transformation_is_a_first_order_phase():
    """`optimizer=optax.adam(0.05)` runs the same compiled Adam phase as
    `{"method": "adam", "learning_rate": 0.05}` (optax.adam with the same
    defaults): the same iterations on the same bits. A chain with gradient
    clipping, followed by L-BFGS, runs too."""
    import optax

    settings = dict(uncertainty=False, progress=False, **FIT_TOL)
    named = epifit.calibrate(
        MODEL,
        DATA,
        optimizer={"method": "adam", "iterations": 15, "learning_rate": 0.05},
        **settings,
    )
    given = epifit.calibrate(
        MODEL,
        DATA,
        optimizer={"method": optax.adam(0.05), "iterations": 15},
        **settings,
    )
    assert given.iterations == named.iterations == 15
    np.testing.assert_array_equal(given.x, named.x)
    np.testing.assert_array_equal(given.loss_history, named.loss_history)
    assert given.settings["phases"] == [
        {
            "method": "optax",
            "iterations": 15,
            "transform": "optax.GradientTransformation",
        }
    ]
    clipped = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(0.05))
    chained = epifit.calibrate(
        MODEL,
        DATA,
        optimizer=[
            {"method": clipped, "iterations": 10},
            {"method": "lbfgs", "iterations": 50},
        ],
        **settings,
    )
    assert chained.iterations > 10
    assert (chained.phase_history[:10] == 0).all()
    assert chained.loss < chained.loss_history[0]
