"""Laplace approximation at the optimum: standard errors and intervals.

The posterior of the free unconstrained vector `x` (every free parameter,
neural weights included) is approximated by `Normal(x̂, H⁻¹)`, with `H` the
Hessian of the negative log posterior (the negative log-likelihood plus every
free parameter's negative log-prior, see `_priors.py`) at the MAP `x̂`:

* `gauss_newton` (least squares): `H = 2 JᵀJ + 2 J_pᵀJ_p` with `J` the
  Jacobian of the data residuals `sqrt(w) (predicted - observed)` (forward
  sensitivities) and `J_p` that of the prior/penalty residuals.
* `hessian`: the Hessian of the loss (`Objective.data_hessian`: forward over
  reverse mode, or forward over forward for small models).

For least_squares observations the loss is a weighted sum of squares, not a
likelihood: the residual variance is estimated as `s² = SSR / (n - p)` (`n`
observed points, `p` free parameters), as in nonlinear regression, so that the
intervals reflect the scatter of the data (`noise = "estimate"`, the default
for all-least_squares fits). The whole loss, priors and penalties included, is
then read as a quasi-likelihood in sum-of-squares units: both Hessians are
divided by `2 s²`. That is the objective whose minimum the fit found (dividing
by a constant moves no minimum) and the one [`profile`][epifit.fitting.profile]
profiles, so the two agree; a prior thus weighs as `calibrate` weighed it.
With `noise = "known"` the weights are taken as `1 / (2 σ²)` and the loss as
the negative log-likelihood, so the priors keep their stated scale. A `gaussian`
observation (with its `sd`) is a likelihood already: nothing is estimated.

Curvature is judged on `H` scaled to a unit diagonal. Where the `hessian` is
not positive definite, the message names the directions of negative or no
curvature (eigenvalue and largest loadings) and the fallback used: the data
Hessian with its negative eigenvalues set to zero plus the priors' Hessian.
Directions still without curvature (flat priors) get infinite variance.

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
from epifit.fitting._fallback import FALLBACK
from epifit.fitting._hessian import data_hessian_at
from epifit.fitting._objective import Objective
from epifit.fitting._parameters import time_labels
from epifit.model import constrain, constrain_coefficients

__all__ = [
    "Laplace",
    "interval_note",
    "laplace",
    "parameter_table",
    "standard_errors",
    "table_numbers",
    "table_rows",
]


@dataclasses.dataclass
class Laplace:
    """The Laplace approximation in the free unconstrained coordinates.

    Attributes:
        method: `gauss_newton` or `hessian`.
        covariance: `(n, n)` covariance of the free vector.
        precision: `(n, n)` the matrix inverted (`H`, or the fallback's).
        noise_variance: the estimated residual variance `s²`
            (least_squares observations with estimated noise), else None.
        message: a note when the Hessian was not positive definite (naming
            the directions and the fallback taken), else "".
        hessian: `(n, n)` the Hessian of the negative log posterior at `x`
            (scaled as `precision`), before any fallback.
    """

    method: str
    covariance: np.ndarray
    precision: np.ndarray
    noise_variance: float | None
    message: str = ""
    hessian: np.ndarray | None = None


def laplace(
    objective: Objective,
    x,
    data,
    *,
    method: str = "auto",
    noise: str = "auto",
    jacobian: tuple | None = None,
    loss: float | None = None,
) -> Laplace:
    """The Laplace approximation at `x` (the optimum).

    Args:
        objective: the fit objective.
        x: the free unconstrained vector at the optimum.
        data: the objective's traced data.
        method: `auto` (`gauss_newton` for least squares, else `hessian`),
            `gauss_newton` or `hessian`.
        noise: `auto`/`estimate` (least_squares observations: estimate the
            residual variance) or `known` (the weights are `1 / (2 σ²)`).
        jacobian: `(r, J)` at `x` when already computed (Gauss-Newton).
        loss: the loss at `x` when already computed (saves a solve).
    """
    n = int(x.shape[0])
    if method == "auto":
        method = "gauss_newton" if objective.least_squares else "hessian"
    estimate = objective.gaussian_data and noise in ("auto", "estimate")
    if noise == "estimate" and not objective.gaussian_data:
        raise ValueError(
            "noise = 'estimate' applies to least_squares observations only; this "
            "fit has "
            f"{sorted({o.family for o in objective.observations})} observations."
        )
    s2 = None
    dof = objective.n_data - n
    if method == "gauss_newton":
        if jacobian is None:
            xs = jnp.asarray(x)[None, :]
            r, J, *_ = objective.compiled("jacobian_and_solution")(xs, data)
            r, J = r[0], J[0]
        else:
            r, J = jacobian
        r, J = np.asarray(r, np.float64), np.asarray(J, np.float64)
        k = objective.n_data_rows
        rd, Jd, Jp = r[:k], J[:k], J[k:]
        ssr = float(rd @ rd)
        Hd, Hp = 2.0 * Jd.T @ Jd, 2.0 * Jp.T @ Jp
        if estimate:
            s2 = ssr / dof if dof > 0 else math.nan
    elif method == "hessian":
        # the data part is the expensive one (a solve); the penalty has none.
        # Each is evaluated once: a small model's Hessian and the penalty's
        # are compiled for that (`jit(once=True)`)
        Hd = data_hessian_at(objective, x, data)
        Hp = np.asarray(jit(objective.penalty_hessian, once=True)(x, data), np.float64)
        if estimate:
            if loss is None:
                ssr = float(jit(objective.data_loss)(x, data))
            else:
                ssr = float(loss) - float(jit(objective.penalty)(x, data))
            s2 = ssr / dof if dof > 0 else math.nan
    else:
        raise ValueError(
            f"Unknown uncertainty method {method!r}; expected auto, gauss_newton or "
            "hessian."
        )
    if s2 is not None:
        # the whole loss in sum-of-squares units, as the fit and the profile
        # read it (module docstring)
        Hd, Hp = Hd / (2.0 * s2), Hp / (2.0 * s2)
    Hd, Hp = 0.5 * (Hd + Hd.T), 0.5 * (Hp + Hp.T)
    raw = Hd + Hp
    H, cov, message = _posterior(Hd, Hp, tuple(objective.free.labels))
    if s2 is not None and not math.isfinite(s2):
        message = (
            f"{objective.n_data} observed points for {n} free parameters: too few "
            "to estimate the noise variance; intervals are undefined."
        )
        cov = np.full_like(H, np.nan)
    return Laplace(method, cov, H, s2, message, raw)


# eigenvalues below this fraction of the largest count as no curvature: the
# Hessian of a loss through an adaptive solve is accurate to about the solver
# tolerance, far from machine precision
CURVATURE_RTOL = 1e-9
# directions and loadings a note names
NOTE_DIRECTIONS, NOTE_LOADINGS = 3, 3


def _posterior(Hd: np.ndarray, Hp: np.ndarray, labels):
    """`(H, H⁻¹, message)` for the data's and the priors' Hessians: `Hd + Hp`
    when positive (semi-)definite (`_inverse`); else, with negative
    curvature, a note naming the directions and the fallback `psd(Hd) + Hp`
    (the data's negative curvature set to zero, the priors' kept), whose
    directions still without curvature get infinite variance (`_inverse`)."""
    H = Hd + Hp
    negative = False
    if H.size and np.all(np.isfinite(H)):
        w, _, _, bad = _curvature(H, Hp)
        negative = bool(np.any(bad & (w < 0)))
    if not negative:  # positive definite, or semi-definite: a pseudo-inverse
        cov, message = _inverse(H, labels, Hp)
        return H, cov, message
    note = _indefinite(H, Hp, labels)
    H = _psd(Hd) + Hp
    cov, rest = _inverse(H, labels, Hp)
    return H, cov, f"{note}; {FALLBACK}" + (f"; then {rest}" if rest else "")


def _psd(H: np.ndarray) -> np.ndarray:
    """`H` with its negative eigenvalues set to zero."""
    w, V = np.linalg.eigh(H)
    return (V * np.clip(w, 0.0, None)) @ V.T


def _directions(w: np.ndarray, V: np.ndarray, bad: np.ndarray, labels) -> str:
    """The bad eigenvectors (smallest eigenvalue first), each as its
    eigenvalue and the labels with the largest loadings."""
    out = []
    for k in np.flatnonzero(bad)[np.argsort(w[bad])][:NOTE_DIRECTIONS]:
        top = np.argsort(-np.abs(V[:, k]))[:NOTE_LOADINGS]
        names = ", ".join(
            f"{labels[i] if i < len(labels) else i} ({V[i, k]:+.2f})" for i in top
        )
        out.append(f"eigenvalue {w[k]:.3g}: {names}")
    more = int(bad.sum()) - len(out)
    return "; ".join(out) + (f"; and {more} more" if more > 0 else "")


def _scaled(H: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`(D⁻¹ H D⁻¹, D)` with `D = sqrt|diag H|` (1 where the diagonal is
    zero): the Hessian in coordinates of unit curvature, so that a direction's
    curvature is judged against the others' whatever their units."""
    d = np.sqrt(np.abs(np.diag(H)))
    d = np.where(d > 0, d, 1.0)
    return H / np.outer(d, d), d


def _curvature(H: np.ndarray, Hp: np.ndarray | None):
    """`(w, V, d, bad)`: the eigenvalues and eigenvectors of `H` scaled to a
    unit diagonal, the scale, and the directions without usable curvature:
    negative, or below `CURVATURE_RTOL` of the largest unless the priors
    (`Hp`, exact: no solver error in them) give at least half of it (a
    weight's prior curvature of 1 beside a count likelihood's 1e9 on the same
    weight is curvature, not none)."""
    Hs, d = _scaled(H)
    w, V = np.linalg.eigh(Hs)
    tiny = w <= CURVATURE_RTOL * max(w.max(), 0.0)
    if Hp is None or not np.any(Hp):
        return w, V, d, tiny
    prior = np.einsum("ik,ij,jk->k", V, Hp / np.outer(d, d), V)
    return w, V, d, (w <= 0) | (tiny & (prior < 0.5 * w))


def _indefinite(H: np.ndarray, Hp: np.ndarray, labels) -> str:
    """A note naming the directions of negative or no curvature of a finite
    `H`, "" when it is positive definite (or not finite: `_inverse` says so)."""
    if H.size == 0 or not np.all(np.isfinite(H)):
        return ""
    w, V, _, bad = _curvature(H, Hp)
    if not bad.any():
        return ""
    return (
        "the Hessian of the negative log posterior is not positive definite at "
        f"the optimum: {int(bad.sum())} direction(s) of negative "
        f"({int((w[bad] < 0).sum())}) or no curvature (eigenvalues of the "
        "Hessian scaled to a unit diagonal), with the largest loadings "
        f"{_directions(w, V, bad, labels)}"
    )


def _inverse(H: np.ndarray, labels=(), Hp=None) -> tuple[np.ndarray, str]:
    """`H⁻¹`, or for a Hessian that is not positive definite the pseudo-inverse
    on its directions of curvature (`_curvature`, judged on `H` scaled to a
    unit diagonal), with infinite variance for the coordinates that lie
    appreciably (over a tenth of their length) in the others, and a note
    naming those directions."""
    if H.size == 0:
        return H.copy(), ""
    if not np.all(np.isfinite(H)):
        return np.full_like(H, np.nan), "the Hessian is not finite at the optimum"
    w, V, d, bad = _curvature(H, Hp)
    good = ~bad
    cov = (V[:, good] / w[good]) @ V[:, good].T / np.outer(d, d)
    if good.all():
        return cov, ""
    flat = np.sum(np.square(V[:, ~good]), axis=1) > 0.1
    cov[flat, :] = np.nan
    cov[:, flat] = np.nan
    cov[flat, flat] = np.inf
    return cov, (
        "the Hessian is not positive definite: "
        f"{int((~good).sum())} direction(s) without curvature (not identified by "
        f"the data, under flat priors; largest loadings "
        f"{_directions(w, V, ~good, labels)}) are left out of the covariance "
        f"(a pseudo-inverse); {int(flat.sum())} coordinate(s) lying in them have "
        "infinite standard errors. Priors in the fit configuration identify them"
    )


def _z(level: float) -> float:
    return NormalDist().inv_cdf(0.5 + level / 2.0)


def table_numbers(objective: Objective, x, se_x, z, rest) -> dict:
    """Everything the parameter table needs (traceable; `parameter_table`
    compiles it alone, a fit's output program inside its one program):
    constrained values, and for every free entry its slope `dc/dx` and the
    transformed interval ends at `z` standard errors; derived values and
    their gradients."""
    problem, free = objective.problem, objective.free
    model = problem.model
    names = np.asarray(free.names)
    derived = [d.name for d in problem.spec.derived]
    values = model.constrain(free.params(x, rest))
    out = {"values": {p.name: values[p.name] for p in problem.spec.parameters}}
    ends = {}
    for p in problem.spec.parameters:
        idx = np.flatnonzero(names == p.name)
        if idx.size == 0:
            continue
        xp, sp = x[idx], se_x[idx]
        if p.per_time is not None:
            ends[p.name] = _coefficient_ends(p, values[p.name], xp, sp, z)
            continue
        c = lambda u, p=p: constrain(p.transform, u, *p.bounds)  # noqa: E731
        ends[p.name] = (jax.vmap(jax.grad(c))(xp), c(xp - z * sp), c(xp + z * sp))
    out["ends"] = ends
    if derived:

        def dfn(x):
            vals = model.constrain(free.params(x, rest))
            return {d: jnp.ravel(vals[d]) for d in derived}

        out["derived"] = dfn(x)
        out["derived_jac"] = jax.jacfwd(dfn)(x)
    return out


def _table_arrays(objective: Objective, x, se_x, data, z):
    """`table_numbers` in one compiled call, as NumPy."""

    def fn(x, se_x, rest):
        return table_numbers(objective, x, se_x, z, rest)

    return jax.tree.map(np.asarray, jit(fn)(x, se_x, data["rest"]))


def standard_errors(free, covariance) -> np.ndarray:
    """`se(x)`: the square roots of the covariance's diagonal (NaN without)."""
    if covariance is None:
        return np.full((free.n,), np.nan)
    cov = np.asarray(covariance, np.float64)
    return np.sqrt(np.clip(np.diag(cov), 0.0, np.inf))


def _coefficient_ends(p, value, xp, sp, z):
    """`(dc/dx, c(x - z se), c(x + z se))` of a time-varying parameter's
    coefficients, flat (the map is elementwise: its Jacobian is diagonal)."""
    shape = jnp.shape(value)

    def c(u):
        return jnp.ravel(constrain_coefficients(p, u.reshape(shape)))

    slope = jax.jvp(c, (xp,), (jnp.ones_like(xp),))[1]
    return slope, c(xp - z * sp), c(xp + z * sp)


def _entries(p, v: np.ndarray, patches, along, strata=()) -> list[tuple[str, str]]:
    """`(label, patch)` of each element of a parameter's value, flat."""
    if p.per_stratum and v.ndim == 2:
        return [(f"{p.name}[{q}, {s}]", q) for q in patches for s in strata]
    if p.per_stratum and v.ndim == 1:
        return [(f"{p.name}[{s}]", "") for s in strata]
    if p.per_time is not None:
        if v.ndim == 2:
            return [(f"{p.name}[{t}, {q}]", q) for t in along for q in patches]
        return [(f"{p.name}[{t}]", "") for t in along]
    if p.per_patch and v.ndim == 1:
        return [(f"{p.name}[{q}]", q) for q in patches]
    return [(p.name, "")]


def parameter_table(
    objective: Objective,
    x,
    data,
    covariance: np.ndarray | None,
    *,
    level: float = 0.95,
) -> list[dict]:
    """One row per scalar parameter value, per-patch element and derived
    quantity: `label, name, patch, kind, estimate, se, lower, upper`."""
    se_x = standard_errors(objective.free, covariance)
    arrays = _table_arrays(
        objective, jnp.asarray(x), jnp.asarray(se_x), data, _z(level)
    )
    return table_rows(objective, arrays, covariance, level=level)


def table_rows(
    objective: Objective, arrays: dict, covariance: np.ndarray | None, *, level: float
) -> list[dict]:
    """[`parameter_table`][]'s rows from `table_numbers` as NumPy (`arrays`),
    computed at the standard errors of `covariance`."""
    problem, free = objective.problem, objective.free
    z = _z(level)
    cov = None if covariance is None else np.asarray(covariance, np.float64)
    se_x = standard_errors(free, cov)
    names = np.asarray(free.names)
    along = time_labels(problem.model)
    rows = []
    for p in problem.spec.parameters:
        v = np.asarray(arrays["values"][p.name], np.float64)
        strata = () if problem.spec.strata is None else problem.spec.strata.labels
        entries = _entries(p, v, problem.patches, along.get(p.name), strata)
        idx = np.flatnonzero(names == p.name)
        for j, (label, patch) in enumerate(entries):
            est = float(np.ravel(v)[j])
            row = dict(
                label=label,
                name=p.name,
                patch=patch,
                kind="free" if idx.size else "fixed",
                estimate=est,
                se=0.0,
                lower=est,
                upper=est,
            )
            if idx.size:
                slope, lo, hi = (a[j] for a in arrays["ends"][p.name])
                se = abs(float(slope)) * se_x[idx[j]]
                row.update(se=se, lower=float(min(lo, hi)), upper=float(max(lo, hi)))
            rows.append(row)
    for d in problem.spec.derived:
        v = np.asarray(arrays["derived"][d.name], np.float64)
        jac = np.asarray(arrays["derived_jac"][d.name], np.float64)
        per = v.size == problem.n_patches and v.size > 1
        for j in range(v.size):
            est = float(v[j])
            row = dict(
                label=f"{d.name}[{problem.patches[j]}]" if per else d.name,
                name=d.name,
                patch=problem.patches[j] if per else "",
                kind="derived",
                estimate=est,
                se=math.nan,
                lower=math.nan,
                upper=math.nan,
            )
            if cov is not None:
                grad = jac[j]
                used = grad != 0
                var = float(grad[used] @ cov[np.ix_(used, used)] @ grad[used])
                se = math.sqrt(var) if var >= 0 else math.nan
                row["se"] = se
                if est > 0 and math.isfinite(se):
                    row["lower"] = est * _exp(-z * se / est)
                    row["upper"] = est * _exp(z * se / est)
                else:
                    row["lower"], row["upper"] = est - z * se, est + z * se
            rows.append(row)
    return rows


def _exp(v: float) -> float:
    """`exp(v)`, `inf` where it overflows (a log-scale interval end of a
    derived value with a huge standard error)."""
    try:
        return math.exp(v)
    except OverflowError:
        return math.inf


def interval_note(rows: list[dict]) -> str:
    """A note naming the estimated rows whose interval or standard error is
    not finite although the estimate is (they overflowed: the data barely
    constrain them), else ""."""
    bad = [
        r["label"]
        for r in rows
        if r["kind"] != "fixed"
        and math.isfinite(r["estimate"])
        and math.isfinite(r["se"])
        and not (math.isfinite(r["lower"]) and math.isfinite(r["upper"]))
    ]
    if not bad:
        return ""
    return (
        f"the intervals of {', '.join(bad)} overflow (their ends are inf or NaN): "
        "the data barely constrain them at this point"
    )
