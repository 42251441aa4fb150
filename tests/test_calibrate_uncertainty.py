"""The Laplace approximation against a finite-difference Hessian computed here.

The reference negative log-likelihood is written with SciPy alone (SEIR by
`solve_ivp`, Poisson counts of new infections), as a function of the
unconstrained (softplus) coordinates the optimiser sees; its Hessian is taken
by central differences.
"""

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import xarray as xr
from scipy.integrate import solve_ivp
from scipy.special import gammaln
from scipy.stats import norm

from epifit.fitting import laplace
from epifit.fitting._objective import Objective
from epifit.fitting._parameters import FreeParameters
from epifit.fitting._uncertainty import parameter_table
from epifit.simulation import Problem, SolverSettings, load_params

REPO = Path(__file__).resolve().parents[1]
SEIR = REPO / "models" / "seir.toml"
N = 100000.0
DAYS = 150
TRUTH = {"E0": 10.0, "beta": 0.6, "gamma": 0.25, "sigma": 0.2}
ORDER = ("E0", "beta", "gamma", "sigma")  # epifit's free vector (sorted names)


def softplus(x):
    return np.logaddexp(0.0, x)


def incidence(beta, sigma, gamma, e0):
    def f(t, u):
        s, e, i, _ = u
        new = beta * s * i / N
        return [-new, new - sigma * e, sigma * e - gamma * i, gamma * i]

    sol = solve_ivp(
        f,
        (0.0, DAYS - 1.0),
        [N - e0, e0, 0.0, 0.0],
        t_eval=np.arange(DAYS, dtype=float),
        method="DOP853",
        rtol=1e-13,
        atol=1e-10,
    )
    return -np.diff(sol.y[0])


# data: the expected counts themselves, so that the truth is the optimum (the
# maximum-likelihood estimate) and the Hessian there is positive definite
CASES = incidence(0.6, 0.2, 0.25, 10.0)


def nll(x):
    e0, beta, gamma, sigma = softplus(np.asarray(x))
    mu = incidence(beta, sigma, gamma, e0)
    return float(np.sum(mu - CASES * np.log(mu) + gammaln(CASES + 1.0)))


def fd_hessian(f, x, h):
    n = x.size
    H = np.zeros((n, n))
    e = np.eye(n) * h
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
def setup():
    ds = xr.Dataset(
        {"cases": ("time", np.r_[np.nan, CASES])}, coords={"time": np.arange(DAYS)}
    )
    problem = Problem(SEIR, ds)
    params = load_params(problem, TRUTH)
    free = FreeParameters(problem, params)
    objective = Objective(problem, free, SolverSettings(rtol=1e-11, atol=1e-9))
    return objective, free


def test_hessian_laplace_matches_finite_differences(setup):
    objective, free = setup
    assert free.labels == ORDER
    x = np.asarray(free.x0)
    lap = laplace(objective, jnp.asarray(x), objective.data(), method="hessian")
    assert lap.method == "hessian" and lap.noise_variance is None  # Poisson
    H_fd = fd_hessian(nll, x, 2e-4)
    # the FD error (O(h²) truncation, solver noise / h²) is ~1e-6 relative; the
    # Hessian's condition number (~1e6) amplifies it in the inverse to ~1e-4
    np.testing.assert_allclose(lap.precision, H_fd, rtol=1e-5)
    se_fd = np.sqrt(np.diag(np.linalg.inv(H_fd)))
    se = np.sqrt(np.diag(lap.covariance))
    np.testing.assert_allclose(se, se_fd, rtol=1e-3)

    # constrained scale: delta-method SEs and transformed 95% intervals
    rows = {
        r["label"]: r
        for r in parameter_table(objective, x, objective.data(), lap.covariance)
    }
    z = norm.ppf(0.975)
    for k, name in enumerate(ORDER):
        dcdx = 1.0 / (1.0 + np.exp(-x[k]))
        assert rows[name]["estimate"] == pytest.approx(TRUTH[name], rel=1e-12)
        assert rows[name]["se"] == pytest.approx(dcdx * se_fd[k], rel=1e-3)
        assert rows[name]["lower"] == pytest.approx(
            softplus(x[k] - z * se_fd[k]), rel=1e-3
        )
        assert rows[name]["upper"] == pytest.approx(
            softplus(x[k] + z * se_fd[k]), rel=1e-3
        )
