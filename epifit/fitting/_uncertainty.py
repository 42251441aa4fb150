"""Laplace approximation at the optimum: standard errors and intervals.

The posterior (or sampling distribution) of the free unconstrained vector `x`
is approximated by `Normal(x̂, H⁻¹)`, with `H` the Hessian of the negative
log-likelihood (plus log-prior) at the optimum:

* `gauss_newton` (least squares): `H = JᵀJ / s² + 2 J_pᵀJ_p` with `J` the
  Jacobian of the data residuals `sqrt(w) (predicted - observed)` (forward
  sensitivities) and `J_p` that of the prior/penalty residuals.
* `hessian`: `jax.hessian` of the loss (forward over reverse mode).

For gaussian observations the loss is a weighted sum of squares, not a
likelihood: the residual variance is estimated as `s² = SSR / (n - p)` (`n`
observed points, `p` free parameters), as in nonlinear regression, so that the
intervals reflect the scatter of the data (`noise = "estimate"`, the default
for all-gaussian fits). With `noise = "known"` the weights are taken as
`1 / (2 σ²)` and the loss as the negative log-likelihood.

Intervals on the constrained scale map the normal quantiles of `x` through the
(monotone) transform, so they respect bounds; standard errors are the delta
method's `|dc/dx| se(x)`. Derived quantities (e.g. `R0 = beta / gamma`) get
delta-method standard errors and, when positive, intervals on the log scale
(`d exp(±z se/d)`), else `d ± z se`.
"""

from __future__ import annotations

import dataclasses
import math
from statistics import NormalDist

import jax
import jax.numpy as jnp
import numpy as np

from epifit._jit import jit
from epifit.fitting._loss import FitObjective

__all__ = ["Laplace", "laplace", "parameter_table"]


@dataclasses.dataclass
class Laplace:
    """The Laplace approximation in the free unconstrained coordinates.

    Attributes:
        method: `gauss_newton` or `hessian`.
        covariance: `(n, n)` covariance of the free vector.
        precision: `(n, n)` the matrix inverted (`H`).
        noise_variance: the estimated residual variance `s²` (gaussian
            least squares with estimated noise), else None.
        message: a note when the Hessian was not positive definite, else "".
    """

    method: str
    covariance: np.ndarray
    precision: np.ndarray
    noise_variance: float | None
    message: str = ""


def laplace(
    objective: FitObjective,
    x,
    data,
    *,
    method: str = "auto",
    noise: str = "auto",
) -> Laplace:
    """The Laplace approximation at `x` (the optimum).

    Args:
        objective: the fit objective.
        x: the free unconstrained vector at the optimum.
        data: the objective's traced data.
        method: `auto` (`gauss_newton` for least squares, else `hessian`),
            `gauss_newton` or `hessian`.
        noise: `auto`/`estimate` (gaussian observations: estimate the
            residual variance) or `known` (the weights are `1 / (2 σ²)`).
    """
    n = int(x.shape[0])
    if method == "auto":
        method = "gauss_newton" if objective.least_squares else "hessian"
    estimate = objective.gaussian_data and noise in ("auto", "estimate")
    if noise == "estimate" and not objective.gaussian_data:
        raise ValueError(
            "noise = 'estimate' applies to gaussian observations only; this fit has "
            f"{sorted(set(objective.families.values()))} observations."
        )
    s2 = None
    dof = objective.n_data - n
    if method == "gauss_newton":
        rd, Jd, rp, Jp = jit(objective.split_jacobian)(x, data)
        rd, Jd, rp, Jp = (np.asarray(a, np.float64) for a in (rd, Jd, rp, Jp))
        ssr = float(rd @ rd)
        if estimate:
            s2 = ssr / dof if dof > 0 else math.nan
            H = Jd.T @ Jd / s2 + 2.0 * Jp.T @ Jp
        else:
            H = 2.0 * (Jd.T @ Jd + Jp.T @ Jp)
    elif method == "hessian":
        H = np.asarray(jit(jax.hessian(objective.loss))(x, data), np.float64)
        if estimate:
            Hd = np.asarray(jit(jax.hessian(objective.data_loss))(x, data), np.float64)
            ssr = float(jit(objective.data_loss)(x, data))
            s2 = ssr / dof if dof > 0 else math.nan
            H = Hd / (2.0 * s2) + (H - Hd)
    else:
        raise ValueError(
            f"Unknown uncertainty method {method!r}; expected auto, gauss_newton or "
            "hessian."
        )
    H = 0.5 * (H + H.T)
    cov, message = _inverse(H)
    if s2 is not None and not math.isfinite(s2):
        message = (
            f"{objective.n_data} observed points for {n} free parameters: too few "
            "to estimate the noise variance; intervals are undefined."
        )
        cov = np.full_like(H, np.nan)
    return Laplace(method, cov, H, s2, message)


def _inverse(H: np.ndarray) -> tuple[np.ndarray, str]:
    if H.size == 0:
        return H.copy(), ""
    if not np.all(np.isfinite(H)):
        return np.full_like(H, np.nan), "the Hessian is not finite at the optimum"
    w, V = np.linalg.eigh(H)
    tol = max(w.max(), 0.0) * H.shape[0] * np.finfo(np.float64).eps
    if np.all(w > tol):
        return (V / w) @ V.T, ""
    bad = int(np.sum(w <= tol))
    good = w > tol
    cov = (V[:, good] / w[good]) @ V[:, good].T
    # directions without curvature: unidentified, infinite variance
    var_extra = np.sum(np.square(V[:, ~good]), axis=1)
    cov[np.diag_indices_from(cov)] = np.where(var_extra > 1e-12, np.inf, np.diag(cov))
    return cov, (
        f"the Hessian is not positive definite ({bad} direction(s) without "
        "curvature): those parameters are not identified by the data; their "
        "standard errors are infinite"
    )


def _z(level: float) -> float:
    return NormalDist().inv_cdf(0.5 + level / 2.0)


def parameter_table(
    objective: FitObjective,
    x,
    data,
    covariance: np.ndarray | None,
    *,
    level: float = 0.95,
) -> list[dict]:
    """One row per scalar parameter value, per-patch element and derived
    quantity: `label, name, patch, kind, estimate, se, lower, upper`."""
    problem = objective.problem
    free = objective.free
    model = problem.model
    z = _z(level)
    x = jnp.asarray(x)
    params = free.params(x, data["rest"])
    values = model.constrain(params)
    cov = None if covariance is None else np.asarray(covariance, np.float64)
    se_x = None if cov is None else np.sqrt(np.clip(np.diag(cov), 0.0, np.inf))
    index = {label: i for i, label in enumerate(free.labels)}
    rows = []
    for p in problem.spec.parameters:
        v = np.asarray(values[p.name], np.float64)
        per = p.per_patch and v.ndim == 1
        labels = [f"{p.name}[{q}]" for q in problem.patches] if per else [p.name]
        for j, label in enumerate(labels):
            est = float(v[j] if per else v)
            row = dict(
                label=label,
                name=p.name,
                patch=problem.patches[j] if per else "",
                kind="free" if label in index else "fixed",
                estimate=est,
                se=0.0,
                lower=est,
                upper=est,
            )
            if label in index:
                i = index[label]
                if se_x is None:
                    row.update(se=math.nan, lower=math.nan, upper=math.nan)
                else:
                    from epifit.model._transform import constrain

                    xi = float(x[i])
                    c = lambda u, p=p: constrain(p.transform, u, *p.bounds)  # noqa: E731
                    slope = float(jax.grad(c)(jnp.asarray(xi)))
                    row["se"] = abs(slope) * se_x[i]
                    lo = float(c(jnp.asarray(xi - z * se_x[i])))
                    hi = float(c(jnp.asarray(xi + z * se_x[i])))
                    row["lower"], row["upper"] = min(lo, hi), max(lo, hi)
            rows.append(row)
    derived = [d.name for d in problem.spec.derived]
    if derived:

        def fn(x):
            vals = model.constrain(free.params(x, data["rest"]))
            return {d: jnp.ravel(vals[d]) for d in derived}

        vals = {k: np.asarray(v, np.float64) for k, v in fn(x).items()}
        jac = jax.jacfwd(fn)(x) if cov is not None and free.n else None
        for d in derived:
            v = vals[d]
            per = v.size == problem.n_patches and v.size > 1
            for j in range(v.size):
                label = f"{d}[{problem.patches[j]}]" if per else d
                est = float(v[j])
                row = dict(
                    label=label,
                    name=d,
                    patch=problem.patches[j] if per else "",
                    kind="derived",
                    estimate=est,
                    se=math.nan,
                    lower=math.nan,
                    upper=math.nan,
                )
                if jac is not None:
                    grad = np.asarray(jac[d][j], np.float64)
                    used = grad != 0
                    var = float(grad[used] @ cov[np.ix_(used, used)] @ grad[used])
                    se = math.sqrt(var) if var >= 0 else math.nan
                    row["se"] = se
                    if est > 0 and math.isfinite(se):
                        row["lower"] = est * math.exp(-z * se / est)
                        row["upper"] = est * math.exp(z * se / est)
                    else:
                        row["lower"], row["upper"] = est - z * se, est + z * se
                rows.append(row)
    return rows
