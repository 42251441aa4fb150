"""The Laplace approximation over every free parameter (issue 22): the
posterior's Hessian is the data's plus the prior's; where it is not positive
definite, a note names the directions and the stated fallback (the data
Hessian's negative eigenvalues set to zero, plus the prior's curvature) is
used, never silently."""

from pathlib import Path

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import xarray as xr

import epifit.fitting._hessian as hessian_module
import epifit.fitting._objective as objective_module
from epifit._jit import jit, once_options
from epifit.data import open_dataset
from epifit.fitting import laplace, parse_fit_config
from epifit.fitting._fallback import is_fallback
from epifit.fitting._objective import HESSIAN_MAP_MAX_WORK, Objective
from epifit.fitting._parameters import FreeParameters
from epifit.fitting._priors import NEURAL_PRIOR_GAIN
from epifit.fitting._uncertainty import _inverse, _posterior, parameter_table
from epifit.simulation import Problem, SolverSettings

REPO = Path(__file__).resolve().parents[1]
SIR = REPO / "models" / "sir.toml"
SCHOOL = REPO / "data" / "boarding_school_1978.nc"
COUNTS = REPO / "models" / "seird_metapop_counts.toml"
PRIORS = {
    "parameters": {
        "beta": {"prior": {"family": "normal", "mean": 2.0, "sd": 1.0}},
        "gamma": {"prior": {"family": "lognormal", "median": 0.5, "sdlog": 0.5}},
        "I0": {"prior": {"family": "normal", "mean": 3.0, "sd": 3.0}},
    }
}
# a point far from the optimum (free vector I0, beta, gamma) where the data
# Hessian of the boarding-school SIR has one negative eigenvalue
INDEFINITE = np.array([1.445, 1.949, -1.176])


def _objective(fit=None):
    problem = Problem(SIR, open_dataset(SCHOOL))
    config = None if fit is None else parse_fit_config(fit)
    free = FreeParameters(problem, problem.init_params(), config)
    return Objective(problem, free, SolverSettings(rtol=1e-10, atol=1e-10))


def _psd(H):
    w, V = np.linalg.eigh(H)
    return (V * np.clip(w, 0.0, None)) @ V.T


def _unit_diagonal(H):
    d = np.sqrt(np.abs(np.diag(H)))
    return H / np.outer(d, d)


def _fd_hessian(f, x, h):
    n = x.size
    e = np.eye(n) * h
    H = np.zeros((n, n))
    for i in range(n):
        for j in range(i, n):
            H[i, j] = H[j, i] = (
                f(x + e[i] + e[j])
                - f(x + e[i] - e[j])
                - f(x - e[i] + e[j])
                + f(x - e[i] - e[j])
            ) / (4 * h * h)
    return H


@pytest.fixture(scope="module")
def indefinite():
    """The Laplace approximation at `INDEFINITE` under proper priors on all
    three parameters, with the data Hessian by finite differences of the
    loss and the priors' by `jax.hessian` (no solve: test_priors checks it)."""
    objective = _objective(PRIORS)
    assert objective.free.labels == ("I0", "beta", "gamma")
    data = objective.data()
    lap = laplace(
        objective, jnp.asarray(INDEFINITE), data, method="hessian", noise="known"
    )
    loss = jax.jit(objective.data_loss)
    Hd = _fd_hessian(lambda v: float(loss(jnp.asarray(v), data)), INDEFINITE, 1e-4)
    Hp = np.asarray(jax.hessian(objective.penalty)(jnp.asarray(INDEFINITE), data))
    return objective, lap, Hd, Hp, loss


def test_the_posterior_hessian_is_the_data_one_plus_the_priors(indefinite):
    objective, lap, Hd, Hp, _ = indefinite
    assert lap.method == "hessian" and lap.noise_variance is None
    # noise known: the loss is the negative log posterior, H = Hd + Hp
    np.testing.assert_allclose(lap.hessian, Hd + Hp, rtol=1e-5)


def test_an_indefinite_hessian_is_named_and_the_fallback_stated(indefinite):
    objective, lap, Hd, Hp, _ = indefinite
    Hd = lap.hessian - Hp  # the data part, as laplace scaled it
    w, V = np.linalg.eigh(_unit_diagonal(lap.hessian))
    assert w[0] < 0 < w[1]  # the posterior's Hessian is indefinite here
    msg = lap.message
    assert "not positive definite" in msg and "fallback" in msg, msg
    assert is_fallback(msg)  # what FitResult.laplace_fallback reads
    # the direction of negative curvature, by its largest loading
    top = objective.free.labels[int(np.argmax(np.abs(V[:, 0])))]
    assert f"eigenvalue {w[0]:.3g}: {top} (" in msg, msg
    # the fallback: data Hessian clipped to positive semi-definite, plus the
    # priors' (proper on every parameter: positive definite)
    want = _psd(0.5 * (Hd + Hd.T)) + Hp
    np.testing.assert_allclose(lap.precision, want, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(
        lap.covariance, np.linalg.inv(want), rtol=1e-7, atol=1e-14
    )
    assert np.all(np.linalg.eigvalsh(lap.covariance) > 0)
    x = jnp.asarray(INDEFINITE)
    rows = parameter_table(objective, x, objective.data(), lap.covariance)
    assert all(np.isfinite(r["se"]) for r in rows if r["kind"] == "free")


def test_under_flat_priors_the_fallback_leaves_the_unidentified_direction_out(
    indefinite,
):
    objective, lap, _, Hp, _ = indefinite
    # what the fallback inverts without the priors: the clipped data Hessian,
    # singular along the direction of negative curvature
    Hd = lap.hessian - Hp
    clipped = _psd(0.5 * (Hd + Hd.T))
    cov, msg = _inverse(clipped, objective.free.labels)
    assert "without curvature" in msg and "infinite standard errors" in msg, msg
    w, V = np.linalg.eigh(_unit_diagonal(clipped))
    lying = V[:, 0] ** 2 > 0.1
    se = np.sqrt(np.diag(cov))
    assert lying.any() and np.all(np.isinf(se[lying]))
    assert np.all(np.isfinite(se[~lying]))


def test_a_positive_definite_hessian_is_inverted_as_it_is(indefinite):
    objective, *_, loss = indefinite
    data = objective.data()
    x = np.asarray(objective.free.x0) + np.array([0.126, -0.132, 0.641])
    Hd = _fd_hessian(lambda v: float(loss(jnp.asarray(v), data)), x, 1e-4)
    Hp = np.asarray(jax.hessian(objective.penalty)(jnp.asarray(x), data))
    assert np.all(np.linalg.eigvalsh(Hd) > 0)
    H, cov, message = _posterior(Hd, Hp, objective.free.labels)
    assert message == ""
    np.testing.assert_array_equal(H, Hd + Hp)
    np.testing.assert_allclose(cov @ H, np.eye(3), rtol=0, atol=1e-8)


def test_prior_curvature_far_below_the_data_scale_still_counts():
    """Two weights whose sum the data pin (curvature 1e9) and whose difference
    only the prior sees (curvature 1 each): on the Hessian scaled to a unit
    diagonal the difference's eigenvalue is 1e-9 of the largest, below the
    threshold of no curvature, but the prior gives all of it: curvature."""
    Hd = np.array([[1e9, 1e9, 0.0], [1e9, 1e9, 0.0], [0.0, 0.0, 5.0]])
    Hp = np.diag([1.0, 1.0, 0.0])
    labels = ("w1", "w2", "rate")
    H, cov, message = _posterior(Hd, Hp, labels)
    assert message == "" and np.all(np.isfinite(cov))
    np.testing.assert_allclose(cov, np.linalg.inv(Hd + Hp), rtol=1e-6)
    # the difference keeps the prior's variance (1 along the unit vector)
    diff = np.array([1.0, -1.0, 0.0]) / np.sqrt(2.0)
    assert diff @ cov @ diff == pytest.approx(1.0, rel=1e-6)
    # without the prior the difference has no curvature: named, infinite
    H, cov, message = _posterior(Hd, 0.0 * Hp, labels)
    assert "w1 (" in message and "w2 (" in message, message
    assert np.isinf(cov[0, 0]) and np.isinf(cov[1, 1]) and np.isfinite(cov[2, 2])


def _small_mlp_problem(tmp_path):
    """Three patches, 30 days, the counts model with a 7-3-1 MLP (28 weights):
    Poisson counts simulated at the initial parameters (a seeded draw)."""
    text = COUNTS.read_text().replace("layers = [7, 7, 7, 7, 1]", "layers = [7, 3, 1]")
    model = tmp_path / "small.toml"
    model.write_text(text)
    rng = np.random.default_rng(0)
    days, patches = 30, ["a", "b", "c"]
    e0 = np.array([1e-3, 2e-4, 5e-4])
    ds = xr.Dataset(
        {
            "mobility": (
                ("time", "patch", "feature"),
                rng.uniform(0.2, 0.8, (days, 3, 7)),
            ),  # noqa: E501
            "coupling": (
                ("time", "patch", "patch_to"),
                rng.uniform(0, 0.05, (days, 3, 3)),
            ),  # noqa: E501
            "population": ("patch", np.array([2e5, 1e5, 1.5e5])),
            "initial_S": ("patch", 1.0 - e0),
            "initial_E": ("patch", e0),
            "initial_ID": (("stage_ID", "patch"), np.zeros((7, 3))),
            "initial_D": ("patch", np.zeros(3)),
            "initial_IR": (("stage_IR", "patch"), np.zeros((5, 3))),
            "initial_R": ("patch", np.zeros(3)),
            "new_infections": (("time", "patch"), np.ones((days, 3))),
            "new_deaths": (("time", "patch"), np.ones((days, 3))),
        },
        coords={"time": np.arange(days), "patch": patches, "patch_to": patches},
    )
    problem = Problem(model, ds)
    free = FreeParameters(problem, problem.init_params())
    objective = Objective(problem, free, SolverSettings(rtol=1e-8, atol=1e-10))
    _, _, pred = objective.predictions(free.x0, objective.data())
    for name in ("new_infections", "new_deaths"):
        mu = np.clip(np.asarray(pred[name]), 0.0, None)
        counts = np.full((days, 3), np.nan)
        counts[days - mu.shape[0] :] = rng.poisson(mu)
        ds[name] = (("time", "patch"), counts)
    return model, ds


@pytest.mark.slow
def test_the_laplace_approximation_spans_the_mlp_under_its_prior(tmp_path):
    model, ds = _small_mlp_problem(tmp_path)
    problem = Problem(model, ds)
    free = FreeParameters(problem, problem.init_params())
    assert free.n == 3 + 3 + 28  # kappa, alpha, gamma, scaler[3], the MLP
    objective = Objective(problem, free, SolverSettings(rtol=1e-8, atol=1e-10))
    x = free.x0
    data = objective.data()
    lap = laplace(objective, x, data, method="hessian")
    Hp = np.asarray(jax.jit(jax.hessian(objective.penalty))(x, data))
    Hd = lap.hessian - Hp  # Poisson: H = Hd + Hp
    # the data alone leave MLP directions without curvature ...
    w = np.linalg.eigvalsh(Hd)
    assert w[0] < 1e-6 * w[-1]
    # ... the prior's curvature is the weights' precision, fan_in 7 then 3
    weights = np.array([lab.startswith("beta.") for lab in free.labels])
    fan_in = np.array(
        [3.0 if ".layers[1]." in lab else 7.0 for lab in np.asarray(free.labels)]
    )
    np.testing.assert_allclose(
        np.diag(Hp)[weights], fan_in[weights] / NEURAL_PRIOR_GAIN**2, rtol=1e-13
    )
    assert np.all(Hp[~weights] == 0.0)
    H = lap.hessian
    if np.linalg.eigvalsh(_unit_diagonal(H))[0] > 1e-9:  # invertible
        assert lap.message == ""
        np.testing.assert_array_equal(lap.precision, H)
    else:  # not at an optimum: then the fallback, said
        assert "fallback" in lap.message
        np.testing.assert_allclose(
            lap.precision, _psd(0.5 * (Hd + Hd.T)) + Hp, rtol=1e-9, atol=1e-9
        )
    # every coordinate, the MLP's included, gets a finite standard error
    se = np.sqrt(np.diag(lap.covariance))
    assert np.all(np.isfinite(se)) and np.all(se > 0)
    # a weight the data barely see keeps about its prior's spread
    assert np.max(se[weights]) == pytest.approx(
        NEURAL_PRIOR_GAIN / np.sqrt(3.0), rel=0.5
    )


def test_a_small_model_takes_its_hessian_forward_over_forward(monkeypatch):
    """The boarding-school SIR (3 parameters x 3 states) with the default
    adjoint: `data_hessian` forward over forward mode, no adjoint's backward
    pass traced; the same Hessian as forward over reverse (the checkpoint
    adjoint named in the settings) to the solver's tolerance (forward mode
    also differentiates the step-size control)."""
    objective = _objective(PRIORS)
    reverse = Objective(
        objective.problem,
        objective.free,
        SolverSettings(rtol=1e-10, atol=1e-10, adjoint="checkpoint"),
    )
    assert objective.forward_pays and not reverse.forward_pays
    traced = helpers.backward_traces(monkeypatch)
    data, x = objective.data(), jnp.asarray(INDEFINITE)
    H = np.asarray(jax.jit(objective.data_hessian)(x, data))
    assert not traced
    H_rev = np.asarray(jax.jit(reverse.data_hessian)(x, data))
    assert traced
    # 5e-11 of the largest entry, measured
    np.testing.assert_allclose(H, H_rev, rtol=1e-8, atol=1e-9 * np.abs(H).max())
    # `laplace` compiles it for its one evaluation (LLVM at level 0 on CPU):
    # the same numbers
    assert once_options().get("xla_backend_optimization_level") == (
        0 if jax.default_backend() == "cpu" else None
    )
    H_once = np.asarray(jit(objective.data_hessian, once=True)(x, data))
    np.testing.assert_allclose(H_once, H, rtol=1e-12)


def test_forward_over_reverse_hessian_one_column_at_a_time(monkeypatch):
    """Forward over reverse mode (the checkpoint adjoint named): up to
    `HESSIAN_MAP_MAX_WORK` free parameters x states one Hessian-vector
    product at a time (`lax.map`), batched above it; both are the columns of
    `jax.jacfwd(jax.grad(data_loss))`, and a finite-difference Hessian's."""
    base = _objective(PRIORS)
    objective = Objective(
        base.problem,
        base.free,
        SolverSettings(rtol=1e-10, atol=1e-10, adjoint="checkpoint"),
    )
    assert not objective.forward_pays
    assert objective.free.n * objective.problem.n_states <= HESSIAN_MAP_MAX_WORK
    maps = []
    lax_map = jax.lax.map

    def spy(f, xs, **kw):
        maps.append(xs.shape)
        return lax_map(f, xs, **kw)

    monkeypatch.setattr(jax.lax, "map", spy)
    data, x = objective.data(), jnp.asarray(INDEFINITE)
    H = np.asarray(jax.jit(objective.data_hessian)(x, data))
    assert maps == [(3, 3)]  # one product a trip over the 3 unit vectors
    H_ref = np.asarray(jax.jit(jax.jacfwd(jax.grad(objective.data_loss)))(x, data))
    np.testing.assert_allclose(H, H_ref, rtol=1e-12, atol=1e-12 * np.abs(H).max())
    # the Laplace step's evaluation: the unit vectors split between threads
    # (two blocks of two, a zero vector padding the second): the same bits
    monkeypatch.setattr(hessian_module, "thread_workers", lambda: 2)
    np.testing.assert_array_equal(hessian_module.data_hessian_at(objective, x, data), H)
    assert maps[1:] == [(2, 3)]
    # batched above the bound (no loop over the vectors): the same columns
    maps.clear()
    monkeypatch.setattr(objective_module, "HESSIAN_MAP_MAX_WORK", 0)
    H_batched = np.asarray(jax.jit(objective.data_hessian)(x, data))
    assert maps == []
    np.testing.assert_allclose(
        H_batched, H_ref, rtol=1e-12, atol=1e-12 * np.abs(H).max()
    )
    # central differences of the gradient, step 1e-5
    grad = jax.jit(jax.grad(objective.data_loss))
    eye = np.eye(x.size)
    fd = np.stack(
        [
            (
                np.asarray(grad(x + 1e-5 * e, data))
                - np.asarray(grad(x - 1e-5 * e, data))
            )
            / 2e-5
            for e in eye
        ],
        axis=1,
    )
    np.testing.assert_allclose(H, fd, rtol=1e-5, atol=1e-6 * np.abs(H).max())


def test_a_batch_worker_takes_its_hessian_in_one_thread(monkeypatch):
    """Where XLA is limited to one thread (`single_threaded_env`, a batch
    worker's), the Laplace step does not split its Hessian between threads."""
    from epifit._workers import cpu_cores, single_threaded_env, thread_workers

    monkeypatch.setenv("XLA_FLAGS", single_threaded_env()["XLA_FLAGS"])
    assert thread_workers() == 1
    monkeypatch.setenv("XLA_FLAGS", "")
    assert thread_workers() == cpu_cores()
