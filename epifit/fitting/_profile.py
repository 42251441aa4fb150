"""Profile likelihoods of a fit: one free parameter held at each value of a
grid, the others re-optimised, and likelihood-ratio intervals.

[`profile`][] takes a fit (a `FitResult` or its `FIT.nc`) and one free scalar
entry of its free vector (`gamma`, `scaler[north]`). At each grid value `v`
the other free entries are re-optimised: `p(v) = min_y f(insert(y, v))`, with
`f` the fit's own objective ([`Objective`][epifit.fitting.Objective], priors
and penalties included; see "The profiled function" below). The walk starts
at the fitted point and goes outwards in both directions, each point
warm-started from its inner neighbour, the outward walk on the right starting
again from the optimum at the fitted value.

The whole profile is one compiled program: a `lax.scan` over the grid points
whose body runs an optimistix BFGS minimisation (a tolerance-terminated
`while_loop`) over the other free entries; the fixed value enters as scanned
data, and the objective's gradient is its reverse-mode one (the fit's
adjoint), so the program holds one copy of the solve's gradient.

**The profiled function** is the fit's loss (`Objective.loss`: the
observations' negative log-likelihood plus the priors and penalties), whose
minimum is the fit. For least_squares observations with the noise variance
estimated (the default) that loss is a weighted sum of squares, not a
likelihood: the profile then divides it by `2 s²`, `s²` the fit's estimated
residual variance (`SSR / (n - p)`, stored with the Laplace approximation),
so that it is the negative log-likelihood with the noise scale held at its
estimate, the function whose curvature the Laplace approximation inverts.
(A prior on such a fit is weighed as `calibrate` weighs it, in sum-of-squares
units, so it is divided by `2 s²` too, as in the Laplace approximation; a note
says so. `noise = "known"` gives the priors their stated scale.)

**The grid** spans the fitted value `± span` Laplace standard errors (default
4) on the transformed (unconstrained) scale, where the quadratic approximation
predicts a rise of `span² / 2 = 8`, well over the 95% cut of 1.92; without a
finite standard error (no Laplace approximation, or a direction without
curvature) it spans `± FALLBACK_WIDTH` transformed units. The fitted value is
a grid point (the middle one for an odd number of points).

**Intervals**: where `p(v) - min p` crosses `chi2_1(level) / 2` on each side of
the minimum, interpolated linearly in the signed root `sqrt(2 (p - min p))`
(nearly linear in the parameter), between grid points, on the transformed
scale, then mapped through the parameter's transform. A side on which the
profile never reaches the cut within the grid is reported as not identifiable
there (its end NaN).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from statistics import NormalDist

import jax
import jax.numpy as jnp
import numpy as np

from epifit._errors import LocatedError
from epifit._jit import jit
from epifit.fitting._config import merge, parse_fit_config
from epifit.fitting._objective import Objective
from epifit.fitting._profile_result import Profile
from epifit.fitting._resolve import resolve_fit
from epifit.fitting._result import FitResult
from epifit.fitting._uncertainty import laplace
from epifit.model import constrain, constrain_coefficients
from epifit.simulation import ADJOINTS, SOLVERS

__all__ = [
    "DEFAULT_POINTS",
    "DEFAULT_SPAN",
    "FALLBACK_WIDTH",
    "MAX_POINTS",
    "ProfileError",
    "profile",
    "profile_objective",
    "profile_output",
]

DEFAULT_POINTS = 21
DEFAULT_SPAN = 4.0  # Laplace standard errors either side (transformed scale)
FALLBACK_WIDTH = 3.0  # transformed units either side without a standard error
MIN_POINTS, MAX_POINTS = 3, 1001
# the inner minimisation: BFGS's Cauchy termination (relative and absolute
# change of the point and of the value both below these) and its step cap
RTOL, ATOL, MAX_STEPS = 1e-9, 1e-9, 500


class ProfileError(LocatedError):
    """A profile that cannot be computed as asked: an unknown, fixed or derived
    parameter, a bad number of points or span; the location names the
    argument (`parameter`, `points`, `span`)."""


# ------------------------------------------------------------------ the fit
def _fit_of(fit, data) -> tuple[FitResult, str | None]:
    """The `FitResult` and the path it was read from (None for an object)."""
    if isinstance(fit, FitResult):
        if data is not None:
            raise ValueError(
                "data= applies to a fit file path; a FitResult has its data."
            )
        return fit, None
    if isinstance(fit, str | os.PathLike):
        return FitResult.from_netcdf(fit, data=data), str(fit)
    raise TypeError(
        f"fit must be a FitResult or a FIT.nc path; got {type(fit).__name__}."
    )


def profile_objective(fit: FitResult) -> Objective:
    """The objective of `fit`, rebuilt as `calibrate` built it: the problem
    with the fit configuration's overrides, the same free parameters, priors
    and penalties, and the solver settings the fit recorded (solver, adjoint,
    tolerances, step cap)."""
    if fit.problem is None:
        raise ValueError(
            "the fit's data file was not found (moved or changed since the fit); "
            "pass the dataset (data= in Python, --data on the command line)."
        )
    s = fit.settings
    config = parse_fit_config(fit.fit_config, file="FIT.nc fit_config")
    config = merge(config, **{k: s.get(k) for k in ("rtol", "atol", "max_steps")})
    setup = resolve_fit(
        fit.problem,
        config,
        init=fit.params,
        solver=_named(SOLVERS, s.get("solver")),
        adjoint=_named(ADJOINTS, s.get("adjoint")),
    )
    return setup.objective


def _named(table, class_name):
    """The table's name of a recorded class name (`Tsit5` -> `tsit5`)."""
    for key, cls in table.items():
        if cls.__name__ == class_name:
            return key
    return None


def _entry(fit: FitResult, objective: Objective, parameter: str, file) -> int:
    """The index in the free vector of the entry `parameter` names."""
    labels = list(objective.free.labels)
    if not isinstance(parameter, str):
        raise ProfileError(
            f"must be a parameter name; got {type(parameter).__name__}",
            file=file,
            location="parameter",
        )
    if parameter in labels:
        j = labels.index(parameter)
        spec = {p.name: p for p in objective.problem.spec.parameters}
        p = spec.get(objective.free.names[j])
        if p is not None and p.per_time is not None and p.per_time.kind == "periodic":
            raise ProfileError(
                f"'{parameter}' is a coefficient of the periodic time-varying "
                f"parameter '{p.name}'; its profile is not supported (profile a "
                "scalar, per-patch or piecewise time-varying entry)",
                file=file,
                location="parameter",
            )
        return j
    free = _free_list(labels)
    kinds = {r["label"]: r["kind"] for r in fit.table}
    entries = [
        lab
        for lab, n in zip(labels, objective.free.names, strict=True)
        if n == parameter
    ]
    if entries:
        raise ProfileError(
            f"'{parameter}' has {len(entries)} free entries; name one: "
            f"{_free_list(entries)}",
            file=file,
            location="parameter",
        )
    if kinds.get(parameter) == "fixed" or parameter in _fixed_names(fit):
        why = f"'{parameter}' is fixed in this fit (by the model or the fit file)"
    elif kinds.get(parameter) == "derived":
        why = f"'{parameter}' is a derived quantity, not a free parameter"
    else:
        why = f"unknown parameter '{parameter}'"
    raise ProfileError(
        f"{why}; the free parameters are {free}", file=file, location="parameter"
    )


def _fixed_names(fit: FitResult) -> set[str]:
    return {r["name"] for r in fit.table if r["kind"] == "fixed"}


def _free_list(labels, most: int = 12) -> str:
    more = f" and {len(labels) - most} more" if len(labels) > most else ""
    return ", ".join(labels[:most]) + more


def _check_grid_settings(points, span, file) -> None:
    if isinstance(points, bool) or not isinstance(points, int | np.integer):
        raise ProfileError(
            f"must be an integer; got {type(points).__name__} {points!r}",
            file=file,
            location="points",
        )
    if not MIN_POINTS <= points <= MAX_POINTS:
        raise ProfileError(
            f"must be between {MIN_POINTS} and {MAX_POINTS}; got {points}",
            file=file,
            location="points",
        )
    if not (isinstance(span, int | float) and math.isfinite(span) and span > 0):
        raise ProfileError(
            f"must be a finite number > 0 (standard errors); got {span!r}",
            file=file,
            location="span",
        )


# ------------------------------------------------------------------ the grid
def _scale_and_se(fit: FitResult, objective: Objective, x, data, j: int):
    """`(scale, se_j, note)`: the factor on the data loss (`1 / (2 s²)` for an
    estimated noise variance, else 1), the Laplace standard error of entry
    `j` (transformed scale; NaN when there is none) and a note."""
    unc = fit.uncertainty
    s2, cov, note = unc.get("noise_variance"), fit.covariance, ""
    if cov is None:  # no Laplace approximation stored: compute it here
        noise = parse_fit_config(fit.fit_config).noise or "auto"
        lap = laplace(objective, jnp.asarray(x), data, noise=noise)
        s2, cov = lap.noise_variance, lap.covariance
        note = "the fit stored no Laplace approximation; computed it here"
    se = float(np.sqrt(cov[j, j])) if np.isfinite(cov[j, j]) else math.nan
    if s2 is not None and not (math.isfinite(s2) and s2 > 0):
        raise ValueError(
            f"the fit's estimated noise variance is {s2}: too few observed points "
            "to scale the sum of squares into a likelihood; no profile"
        )
    scale = 1.0 if s2 is None else 1.0 / (2.0 * float(s2))
    return scale, se, note


def _grid(x_hat: float, se: float, points: int, span: float) -> np.ndarray:
    """`points` values on the transformed scale, the fitted one among them."""
    half = span * se if math.isfinite(se) and se > 0 else FALLBACK_WIDTH
    n_left = (points - 1) // 2
    n_right = points - 1 - n_left
    left = x_hat - half * np.arange(n_left, 0, -1) / max(n_left, n_right)
    right = x_hat + half * np.arange(1, n_right + 1) / max(n_left, n_right)
    return np.concatenate([left, [x_hat], right])


def _walk(points: int, centre: int):
    """The scan's order: the centre, then outwards to the left, then outwards
    to the right (restarting from the centre's optimum), and the flags."""
    order = [centre, *range(centre - 1, -1, -1), *range(centre + 1, points)]
    restart = np.zeros(points, bool)
    restart[0] = True
    if centre + 1 < points:
        restart[centre + 1] = True
    return np.asarray(order), restart


# ------------------------------------------------------------------ the program
def _reverse_gradient(fn):
    """`fn(y, args)` whose JVP in `y` is `grad · t` from a reverse-mode
    gradient: optimistix linearises the function, and the solve's adjoints
    are reverse-mode rules."""

    @jax.custom_jvp
    def f(y, args):
        return fn(y, args)

    @f.defjvp
    def f_jvp(primals, tangents):
        y, args = primals
        value, grad = jax.value_and_grad(fn)(y, args)
        return value, jnp.vdot(grad, tangents[0])

    return f


def profile_program(objective: Objective, j: int, reported):
    """The compiled profile over entry `j` of the free vector: a function of
    `(x_hat, grid, restart, centre_flags, scale, data)` returning, per step of
    the walk, the profile value, the re-optimised free vector, whether the
    inner minimisation succeeded, its steps and `reported(x, rest)` (the
    constrained values to store). One compilation per call shape."""

    def insert(y, v):
        return jnp.concatenate([y[:j], v[None], y[j:]])

    def fn(y, args):
        v, scale, data = args
        x = insert(y, v)
        return scale * objective.loss(x, data)

    # imported here: optimistix (and lineax) took 85 ms of every command's
    # start-up, which only a profile needs
    import optimistix as optx

    f = _reverse_gradient(fn)
    solver = optx.BFGS(rtol=RTOL, atol=ATOL)

    def run(x_hat, grid, restart, centre, scale, data):
        y_hat = jnp.concatenate([x_hat[:j], x_hat[j + 1 :]])

        def body(carry, step):
            y_prev, y_centre = carry
            v, again, is_centre = step
            y0 = jnp.where(again, y_centre, y_prev)
            sol = optx.minimise(
                f, solver, y0, (v, scale, data), max_steps=MAX_STEPS, throw=False
            )
            value = sol.state.f_info.f
            good = jnp.isfinite(value)
            y = jnp.where(good, sol.value, y0)
            ok = good & (sol.result == optx.RESULTS.successful)
            y_centre = jnp.where(is_centre, y, y_centre)
            x = insert(y, v)
            out = (value, x, ok, sol.stats["num_steps"], reported(x, data["rest"]))
            return (y, y_centre), out

        _, outs = jax.lax.scan(body, (y_hat, y_hat), (grid, restart, centre))
        return outs

    return jit(run)


def _reported(objective: Objective, fit: FitResult):
    """`(labels, fn)`: the fit table's free and derived rows (not time-varying
    coefficients) and the function giving their constrained values at a free
    vector, in that order."""
    problem = objective.problem
    names = set(objective.free.names)
    spec = problem.spec
    params = [p.name for p in spec.parameters if p.name in names and p.per_time is None]
    derived = [d.name for d in spec.derived]
    keep = set(params) | set(derived)
    labels = [
        r["label"] for r in fit.table if r["name"] in keep and r["kind"] != "fixed"
    ]

    def fn(x, rest):
        values = problem.model.constrain(objective.free.params(x, rest))
        parts = [jnp.ravel(values[n]) for n in [*params, *derived]]
        return jnp.concatenate(parts) if parts else jnp.zeros((0,), x.dtype)

    x0, rest = objective.free.x0, objective.free.rest
    size = jax.eval_shape(fn, x0, rest).shape[0]
    if size != len(labels):  # not the table's rows: label them by position
        labels = [f"value[{i}]" for i in range(size)]
    return labels, fn


# ------------------------------------------------------------------ profile
def profile(
    fit: FitResult | str | os.PathLike,
    parameter: str,
    *,
    points: int = DEFAULT_POINTS,
    span: float = DEFAULT_SPAN,
    level: float = 0.95,
    data=None,
) -> Profile:
    """The profile likelihood of one free parameter of a fit.

    Args:
        fit: a [`FitResult`][epifit.FitResult] or a `FIT.nc` path.
        parameter: a free scalar entry: a scalar parameter's name (`gamma`)
            or a label of the free vector (`scaler[north]`).
        points: grid points (3 to 1001; default 21), the fitted value one of
            them.
        span: the grid's half-width in Laplace standard errors on the
            transformed scale (default 4; see the module docstring).
        level: the likelihood-ratio interval's level (default 0.95: the cut
            `chi2_1(0.95) / 2 = 1.92` above the minimum).
        data: the fit's dataset, when `fit` is a path whose data file moved.

    Returns:
        A [`Profile`][epifit.fitting.Profile]: the grid, the profile values,
        the re-optimised parameters, the interval and its identifiability,
        with the Laplace interval beside it.

    Raises:
        ProfileError: an unknown, fixed or derived parameter, or one with
            several free entries (naming them); bad `points` or `span`.
    """
    fit, path = _fit_of(fit, data)
    file = path or "profile"
    _check_grid_settings(points, span, file)
    if not (isinstance(level, float | int) and 0.0 < level < 1.0):
        raise ProfileError(
            f"must be in (0, 1); got {level!r}", file=file, location="level"
        )
    objective = profile_objective(fit)
    j = _entry(fit, objective, parameter, file)
    label = objective.free.labels[j]
    d = objective.data()
    x_hat = np.asarray(fit.x, np.float64)
    scale, se, note = _scale_and_se(fit, objective, x_hat, d, j)
    grid = _grid(float(x_hat[j]), se, points, span)
    centre = int(np.flatnonzero(grid == x_hat[j])[0])
    order, restart = _walk(points, centre)
    labels, reported = _reported(objective, fit)
    run = profile_program(objective, j, reported)
    dtype = objective.free.x0.dtype
    outs = run(
        jnp.asarray(x_hat, dtype),
        jnp.asarray(grid[order], dtype),
        jnp.asarray(restart),
        jnp.asarray(order == centre),
        jnp.asarray(scale, dtype),
        d,
    )
    back = np.argsort(order)  # walk order -> grid order
    value, xs, ok, steps, rep = (np.asarray(o)[back] for o in outs)
    notes = [note] if note else []
    free = objective.free
    if scale != 1.0 and (free.priors or free.l2 or free.smoothing):
        notes.append(
            "least_squares with an estimated noise variance: the priors and "
            "penalties are divided by 2 s² with the sum of squares, as the fit "
            "and the Laplace approximation weigh them (noise = 'known' keeps "
            "their stated scale)"
        )
    if not (math.isfinite(se) and se > 0):
        notes.append(
            f"no finite Laplace standard error for {label}: the grid spans "
            f"± {FALLBACK_WIDTH:g} on the transformed scale"
        )
    return Profile.build(
        fit=fit,
        fit_path=path,
        constrain=_entry_transform(objective, j),
        grid_x=grid,
        value=value.astype(np.float64),
        centre=centre,
        cut=NormalDist().inv_cdf(0.5 + level / 2.0) ** 2 / 2.0,
        parameter=label,
        index=j,
        x=xs.astype(np.float64),
        converged=ok.astype(bool),
        steps=steps.astype(np.int64),
        reported_labels=labels,
        reported=rep.astype(np.float64),
        level=float(level),
        se_x=se,
        span=float(span),
        grid_points=points,
        scale=scale,
        free_labels=list(objective.free.labels),
        notes=notes,
    )


def _entry_transform(objective: Objective, j: int):
    """NumPy `u -> c(u)`: the transform of free entry `j` (its parameter's,
    elementwise; the identity for neural weights)."""
    name = objective.free.names[j]
    spec = {p.name: p for p in objective.problem.spec.parameters}.get(name)

    def c(u):
        # in float64 whatever the session's precision (as the audit's
        # reference: `jnp.asarray(u, float64)` alone warned and truncated)
        with jax.enable_x64(True):
            u = jnp.asarray(u, jnp.float64)
            if spec is None:
                out = u
            elif spec.per_time is not None:  # levels only (periodic refused)
                out = constrain_coefficients(spec, jnp.atleast_1d(u))
                out = out.reshape(u.shape)
            else:
                out = constrain(spec.transform, u, *spec.bounds)
            return np.asarray(out, np.float64)

    return c


def profile_output(fit_path: str | os.PathLike, parameter: str) -> Path:
    """`FIT.profile-gamma.nc` beside `FIT.nc` (other characters of a label
    than letters, digits, `_` and `-` become `_`)."""
    safe = "".join(c if c.isalnum() or c in "_-" else "_" for c in parameter)
    p = Path(fit_path)
    return p.with_name(f"{p.stem}.profile-{safe.strip('_')}.nc")
