"""Parameter recovery from synthetic data generated here with SciPy."""

from pathlib import Path

import numpy as np
import pytest
import xarray as xr
from scipy.integrate import solve_ivp

import epifit

REPO = Path(__file__).resolve().parents[1]
SIR = REPO / "models" / "sir.toml"
SEIR = REPO / "models" / "seir.toml"
DATES = np.datetime64("2020-03-01") + np.arange(120).astype("timedelta64[D]")


def seir_incidence(beta, sigma, gamma, e0, days, n=100000.0):
    def f(t, u):
        s, e, i, _ = u
        new = beta * s * i / n
        return [-new, new - sigma * e, sigma * e - gamma * i, gamma * i]

    sol = solve_ivp(
        f,
        (0.0, days - 1.0),
        [n - e0, e0, 0.0, 0.0],
        t_eval=np.arange(days, dtype=float),
        method="DOP853",
        rtol=1e-12,
        atol=1e-9,
    )
    return np.concatenate([[np.nan], -np.diff(sol.y[0])])  # nothing before day 0


def sir_prevalence(beta, gamma, i0, days, n=763.0):
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
    return sol.y[1]


def test_seir_poisson_recovery_adam_then_lbfgs():
    """Noise-free expected counts: the Poisson fit recovers the generating
    parameters from a start 30-50% off, with the default Adam + L-BFGS."""
    truth = dict(beta=0.6, sigma=0.2, gamma=0.25, E0=10.0)
    days = 100
    cases = seir_incidence(truth["beta"], truth["sigma"], truth["gamma"], 10.0, days)
    ds = xr.Dataset({"cases": ("time", cases)}, coords={"time": DATES[:days]})
    res = epifit.calibrate(
        SEIR,
        ds,
        values={"beta": 0.4, "sigma": 0.3, "gamma": 0.15, "E0": 20.0},
        uncertainty=False,
        progress=False,
        rtol=1e-9,
        atol=1e-9,
    )
    assert [p["method"] for p in res.settings["phases"]] == ["adam", "lbfgs"]
    assert res.converged, res.message
    for name, want in truth.items():
        # exact data: limited by the solver tolerances only
        assert res.parameters[name] == pytest.approx(want, rel=1e-4), name
    assert res.parameters["R0"] == pytest.approx(2.4, rel=1e-4)


def test_sir_recovery_with_noise_and_multistart():
    """Gaussian noise (sd 5 on counts up to ~300); four starts. The
    estimates lie within three standard errors of the truth, the best start
    wins, and the truth's loss is no better than the fit's."""
    rng = np.random.default_rng(42)
    truth = dict(beta=1.7, gamma=0.45, I0=2.0)
    days = 20
    clean = sir_prevalence(truth["beta"], truth["gamma"], truth["I0"], days)
    noisy = clean + rng.normal(0.0, 5.0, days)
    ds = xr.Dataset({"in_bed": ("time", noisy)}, coords={"time": DATES[:days]})
    res = epifit.calibrate(
        SIR,
        ds,
        n_starts=4,
        perturbation=0.4,
        seed=3,
        progress=False,
        rtol=1e-10,
        atol=1e-10,
    )
    assert len(res.start_losses) == 4
    assert res.best_start == int(np.argmin(res.start_losses))
    assert res.loss == res.start_losses[res.best_start]
    assert len(set(np.round(res.initial_losses, 6))) == 4  # distinct starts
    rows = {r["label"]: r for r in res.table}
    for name, want in truth.items():
        assert abs(rows[name]["estimate"] - want) < 3 * rows[name]["se"], name
    # the noise variance estimate is near the true 25
    assert 10 < res.uncertainty["noise_variance"] < 60
    ssr_truth = float(np.sum((clean - noisy) ** 2))
    assert res.loss <= ssr_truth


def test_multistart_one_after_another_matches_batched(monkeypatch):
    """On CPU the starts run one after another (`default_group` is 1); the
    same fit with every start batched by `vmap` ends at the same points."""
    import epifit.fitting._objective as objective_module

    ds = epifit.open_dataset(REPO / "data" / "boarding_school_1978.nc")
    settings = dict(
        optimizer=[
            {"method": "adam", "iterations": 15, "learning_rate": 0.05},
            {"method": "lbfgs", "iterations": 10},
        ],
        n_starts=3,
        seed=1,
        uncertainty=False,
        progress=False,
        rtol=1e-8,
        atol=1e-8,
    )
    seq = epifit.calibrate(SIR, ds, **settings)
    monkeypatch.setattr(objective_module, "default_group", lambda: None)
    batched = epifit.calibrate(SIR, ds, **settings)
    assert len(set(np.round(seq.initial_losses, 6))) == 3
    np.testing.assert_allclose(seq.initial_losses, batched.initial_losses, rtol=1e-12)
    np.testing.assert_allclose(seq.start_losses, batched.start_losses, rtol=1e-8)
    assert seq.best_start == batched.best_start
    np.testing.assert_allclose(seq.x, batched.x, rtol=1e-6)


def test_multistart_draws_again_a_start_whose_loss_is_not_finite():
    """SEIR with Poisson counts, four starts spread 3 (unconstrained): starts 1
    and 2 of the first draw have an infinite loss. They are drawn again
    until finite; start 0 (the initial values) and start 3 are as drawn."""
    cases = seir_incidence(0.6, 0.2, 0.25, 10.0, 100)
    ds = xr.Dataset({"cases": ("time", cases)}, coords={"time": DATES[:100]})
    settings = dict(
        values={"beta": 0.4, "sigma": 0.3, "gamma": 0.15, "E0": 20.0},
        optimizer=[{"method": "adam", "iterations": 2}],
        uncertainty=False,
        progress=False,
        rtol=1e-9,
        atol=1e-9,
    )
    res = epifit.calibrate(SEIR, ds, n_starts=4, perturbation=3.0, seed=0, **settings)
    redraws = res.settings["start_redraws"]
    assert redraws[0] == 0 and redraws[3] == 0
    assert redraws[1] >= 1 and redraws[2] >= 1
    assert np.all(np.isfinite(res.initial_losses))
    assert "(best of 4 starts, 2 drawn again for a finite loss)" in res.summary()
    # start 0 is the initial point: the loss of a single-start fit there
    one = epifit.calibrate(SEIR, ds, n_starts=1, **settings)
    assert one.settings["start_redraws"] == [0]
    np.testing.assert_allclose(res.initial_losses[0], one.initial_losses[0], rtol=1e-12)
    # deterministic: the same seed draws the same points again
    again = epifit.calibrate(SEIR, ds, n_starts=4, perturbation=3.0, seed=0, **settings)
    np.testing.assert_array_equal(again.initial_losses, res.initial_losses)
    assert again.settings["start_redraws"] == redraws


def test_finite_starts_replaces_only_the_non_finite_perturbed_starts():
    import jax.numpy as jnp

    from epifit.fitting._calibrate import MAX_REDRAWS, finite_starts

    def draw(d):  # start i of draw d is (i, d)
        return jnp.asarray([[float(i), float(d)] for i in range(4)])

    def loss(xs, data):
        # start 1 is finite from draw 2 on, start 2 never; start 0 never
        # either, but it is the initial point and is kept as it is
        i, d = np.asarray(xs).T
        bad = (i == 0) | ((i == 1) & (d < 2)) | (i == 2)
        return np.where(bad, np.inf, i + d)

    xs, redraws = finite_starts(draw, loss, None)
    np.testing.assert_array_equal(
        np.asarray(xs), [[0, 0], [1, 2], [2, MAX_REDRAWS], [3, 0]]
    )
    assert redraws == [0, 2, MAX_REDRAWS, 0]
    xs, redraws = finite_starts(draw, None, None)  # one start: nothing evaluated
    np.testing.assert_array_equal(np.asarray(xs), np.asarray(draw(0)))
    assert redraws == [0, 0, 0, 0]
