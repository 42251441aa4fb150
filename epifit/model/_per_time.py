"""Time-varying parameters (`per_time`): their bases, coefficients and prior.

A time-varying parameter holds coefficients `c` on the unconstrained scale,
shape `(coefficient,)` or `(coefficient, patch)`; its value on day `d` is
`transform(B[d] @ c)`, with `B` the basis matrix `(day, coefficient)`:

* pieces of `days` days: `B[d, k] = 1` for `k = min(d // days, K - 1)`, with
  `K = ceil(horizon / days)`;
* a clamped cubic B-spline with `K = knots` basis functions on
  `[0, horizon - 1]` (uniform interior knots), evaluated at
  `min(d, horizon - 1)`;
* a Fourier series: `[1, cos(w d), sin(w d), cos(2 w d), ...]`, `w = 2 pi /
  period`, `K = 1 + 2 harmonics`.

`horizon` is the number of days the model is bound to (the fitted days, see
`CompiledModel.bind_days`). Beyond it, pieces and splines keep the value of
day `horizon - 1`; the Fourier series goes on with its period. The basis is
NumPy, built once per trace from static sizes, so a solve sees one
`(day, coefficient)` constant and one matrix product per parameter.

The coefficients' constrained values (`constrain_coefficients`) are the
transform of each *level* coefficient (every coefficient of pieces and
splines: a spline's value lies between its coefficients' values, its basis
being non-negative and summing to one; the mean `c0` of a Fourier series) and
the amplitudes of a Fourier series as they are.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike

from epifit.model._spec import ParameterSpec, SmoothingSpec, TimeBasisSpec
from epifit.model._transform import constrain, unconstrain

__all__ = [
    "basis_matrix",
    "bspline_basis",
    "coefficient_labels",
    "constrain_coefficients",
    "daily_values",
    "level_mask",
    "n_coefficients",
    "random_walk_nll",
    "random_walk_residuals",
    "spline_knots",
    "unconstrain_coefficients",
]

SPLINE_DEGREE = 3


def n_coefficients(basis: TimeBasisSpec, horizon: int) -> int:
    """The number of coefficients over `horizon` days."""
    if basis.kind == "pieces":
        return max(1, -(-int(horizon) // basis.days))
    if basis.kind == "spline":
        return basis.knots
    return 1 + 2 * basis.harmonics


def spline_knots(n_basis: int, horizon: int) -> np.ndarray:
    """The clamped knot vector of `n_basis` cubic B-splines on
    `[0, max(horizon - 1, 1)]`: the ends repeated 4 times, `n_basis - 4`
    uniform interior knots (`n_basis + 4` knots)."""
    end = float(max(horizon - 1, 1))
    inner = np.linspace(0.0, end, n_basis - SPLINE_DEGREE + 1)[1:-1]
    k1 = SPLINE_DEGREE + 1
    return np.concatenate([np.zeros(k1), inner, np.full(k1, end)])


def bspline_basis(x: ArrayLike, knots: np.ndarray, degree: int = SPLINE_DEGREE):
    """The B-spline basis `(x, len(knots) - degree - 1)` at points `x` inside
    the knots' span (Cox-de Boor; the right end belongs to the last span)."""
    x = np.asarray(x, np.float64)
    t = np.asarray(knots, np.float64)
    spans = len(t) - 1
    B = np.zeros((x.size, spans))
    for i in range(spans):
        B[:, i] = (t[i] <= x) & (x < t[i + 1])
    last = max(i for i in range(spans) if t[i] < t[i + 1])
    B[x >= t[last + 1], last] = 1.0
    for d in range(1, degree + 1):
        nxt = np.zeros((x.size, spans - d))
        for i in range(spans - d):
            left, right = t[i + d] - t[i], t[i + d + 1] - t[i + 1]
            if left > 0:
                nxt[:, i] += (x - t[i]) / left * B[:, i]
            if right > 0:
                nxt[:, i] += (t[i + d + 1] - x) / right * B[:, i + 1]
        B = nxt
    return B


def basis_matrix(basis: TimeBasisSpec, horizon: int, n_days: int) -> np.ndarray:
    """`B (day, coefficient)` for days `0 .. n_days - 1` of a parameter bound
    to `horizon` days (NumPy, float64)."""
    days = np.arange(n_days)
    K = n_coefficients(basis, horizon)
    if basis.kind == "pieces":
        B = np.zeros((n_days, K))
        B[days, np.minimum(days // basis.days, K - 1)] = 1.0
        return B
    if basis.kind == "spline":
        end = max(horizon - 1, 1)
        return bspline_basis(np.minimum(days, end), spline_knots(K, horizon))
    w = 2.0 * math.pi / basis.period
    cols = [np.ones(n_days)]
    for k in range(1, basis.harmonics + 1):
        cols += [np.cos(k * w * days), np.sin(k * w * days)]
    return np.stack(cols, axis=1)


def level_mask(basis: TimeBasisSpec, K: int) -> np.ndarray:
    """Which coefficients are levels (transformed by `constrain_coefficients`):
    all but a Fourier series' amplitudes."""
    mask = np.ones(K, bool)
    if basis.kind == "periodic":
        mask[1:] = False
    return mask


def _levels(p: ParameterSpec, x: Array) -> Array:
    mask = level_mask(p.per_time, x.shape[0])
    return jnp.asarray(mask.reshape((-1,) + (1,) * (x.ndim - 1)))


def constrain_coefficients(p: ParameterSpec, x: ArrayLike) -> Array:
    """The coefficients' constrained values (levels transformed, a Fourier
    series' amplitudes as they are)."""
    x = jnp.asarray(x)
    if p.per_time.kind != "periodic":
        return constrain(p.transform, x, *p.bounds)
    return jnp.where(_levels(p, x), constrain(p.transform, x, *p.bounds), x)


def unconstrain_coefficients(p: ParameterSpec, v: ArrayLike) -> Array:
    """Inverse of [`constrain_coefficients`][]."""
    v = jnp.asarray(v)
    if p.per_time.kind != "periodic":
        return unconstrain(p.transform, v, *p.bounds)
    levels = _levels(p, v)
    safe = jnp.where(levels, v, jnp.asarray(_inside(p), v.dtype))
    return jnp.where(levels, unconstrain(p.transform, safe, *p.bounds), v)


def _inside(p: ParameterSpec) -> float:
    """A value inside the transform's range (for the branch not taken)."""
    v = np.ravel(np.asarray(p.value, np.float64))
    return float(v[0])


def daily_values(
    p: ParameterSpec, x: ArrayLike, horizon: int, n_days: int, scale=None
) -> Array:
    """The constrained value on each day `0 .. n_days - 1`, `(day,)` or
    `(day, patch)`: `transform(B @ x)`, times `scale` (`()` or `(patch,)`,
    the same on every day) clipped to the bounds when given."""
    x = jnp.asarray(x)
    B = jnp.asarray(basis_matrix(p.per_time, horizon, n_days), x.dtype)
    if x.ndim not in (1, 2) or x.shape[0] != B.shape[1]:
        raise ValueError(
            f"time-varying parameter {p.name!r} has coefficients of shape "
            f"{x.shape}; over {horizon} days it has {B.shape[1]} along time"
        )
    value = constrain(p.transform, B @ x, *p.bounds)
    if scale is None:
        return value
    scale = jnp.asarray(scale, value.dtype)
    scale = scale if scale.ndim == 0 else scale[None, :]  # one factor a day
    return jnp.clip(value * scale, *p.bounds)


def coefficient_labels(basis: TimeBasisSpec, K: int) -> list[str]:
    """Labels of the coefficients along time: `t0, t1, ...` (pieces and spline
    basis functions), `c0, a1, b1, a2, b2, ...` (a Fourier series)."""
    if basis.kind != "periodic":
        return [f"t{k}" for k in range(K)]
    out = ["c0"]
    for k in range(1, (K - 1) // 2 + 1):
        out += [f"a{k}", f"b{k}"]
    return out


def random_walk_residuals(smoothing: SmoothingSpec, x: ArrayLike) -> Array:
    """`diff(x, order) / (sd sqrt(2))` along time, flattened: their sum of
    squares is the quadratic part of [`random_walk_nll`][]."""
    d = jnp.diff(jnp.asarray(x), n=smoothing.order, axis=0)
    return jnp.ravel(d / (smoothing.sd * math.sqrt(2.0)))


def random_walk_nll(smoothing: SmoothingSpec, x: ArrayLike) -> Array:
    """The negative log-density of the random-walk prior: the `order`-th
    differences along time (per patch) are independent `Normal(0, sd)`, so
    `sum(0.5 (diff / sd)^2 + log(sd) + 0.5 log(2 pi))` (the first `order`
    coefficients are left free: an improper flat prior)."""
    r = random_walk_residuals(smoothing, x)
    const = math.log(smoothing.sd) + 0.5 * math.log(2.0 * math.pi)
    return jnp.sum(jnp.square(r)) + r.size * const
