"""The reference problem: a coupled metapopulation box-car SEIRD model whose
transmission rate is a small MLP of mobility, fitted to daily new infections
and deaths.

Provenance: a public JAX issue, "Any suggestions on how to improve performance
for gradient step with odeint?". A user fitted this model (280 patches; 500 in
their real one) with `jax.experimental.ode.odeint(..., rtol=1e-3, atol=1e-6)`
and found the gradient of the loss 300x slower than the loss. The vector field,
the MLP and the loss follow the code posted there, quirks included; the data
are synthetic (the issue's were not public), made by [`make_problem`][], a pure
function of `(n_patches, days, seed)`.

**State** `u (16, patch)`: the rows `STATE_ROWS` (`s, e, id1..id7, d,
ir1..ir5, r`), fractions of each patch's population.

**Parameters**, one flat vector `p` of `3 + n_patches + N_MLP` (176) values,
all unconstrained: `softplus(p[:3])` are `kappa, alpha, gamma`;
`softplus(p[3:3 + n])` the per-patch coupling scalers; `p[3 + n:]` the
weights of an MLP with layers `LAYERS = (7, 7, 7, 7, 1)` and activations
swish, swish, swish, softplus, packed layer by layer as `W (out, in)`
row-major, then `b (out,)`. `eta = -log(-expm1(-kappa alpha)) / gamma` splits
the exposed outflow into the death chain (rate `kappa alpha`) and the
recovery chain (rate `gamma eta`).

**Inputs** are indexed by `day = int32(rint(float32(t)))`, so the vector field
jumps at every half day (an index past the last day is clamped, by JAX's
gather and by the NumPy twin alike): `mobility (patch, 7, day)` feeds the MLP
per patch, giving `beta (patch,)`; `coupling (patch, patch, day)` is scaled
by rows, `cm = scaler[:, None] * coupling[..., day]`.

**Force of infection**, as posted: `beta s i + beta s (i @ cm.T + cm @ i)`
with `i = id1 + id2 + id3 + ir1 + ... + ir5`. As `i @ cm.T == cm @ i`, the
coupling term counts twice; the quirk is kept on purpose.

**Loss**, as posted, on the daily solution `sol (day, 16, patch)` and the data
`(day - 1, 2, patch)` (column 0 daily new infections `diff(1 - s)`, column 1
daily new deaths `diff(d)`): the sum over days and patches of
`(diff(1 - s) - data[:, 0]) ** 2 + 20000 (diff(d) - data[:, 1]) ** 2`.

**Synthetic data**: patches at random points of the unit square; coupling by
10-nearest-neighbour gravity weights with row sums drawn from U(0.05, 0.3),
times a slow daily modulation (a lockdown factor from 1 to 0.5 around day 22,
a partial reopening around day 70, a +-10% weekly rhythm, +-20% drift per
patch); 7 mobility features per patch in [0, 1] that dip around day 20 and
recover after day 70; `kappa, alpha, gamma = 0.5, 0.07, 1.5` per day
(infection fatality ratio about 1%); random MLP weights whose output layer is
sign-fixed (beta rises with mobility) and calibrated so that the 2nd-98th
percentiles of beta are 0.22-0.55 per day; 5% of patches seeded with exposed
fractions U(2e-4, 1e-3). The true trajectory is integrated in float64 NumPy
(classical RK4, 8 sub-steps per half day, the day index held on each half
day: the piecewise-smooth solution up to RK4 error), then multiplied by
log-normal noise (sd 0.05), so the data do not depend on JAX's configuration.
`p_init` perturbs `p_true` by N(0, 0.15) (epidemic), N(0, 0.2) (scalers) and
N(0, 0.05) (MLP) in the unconstrained coordinates. For 280 patches, 120 days
and seed 0 the first wave peaks around day 29 (patch median) with a mean
final attack rate of about 0.41.

This module imports only NumPy and JAX. `../shared/bench/seed_metapop.py`,
when present, is an independent definition of the same problem;
`tests/test_reference_crosscheck.py` checks that both give the same numbers.

    import jax, jax.numpy as jnp
    from jax.experimental.ode import odeint
    P = make_problem(280, 120, 0)
    a = {k: jnp.asarray(P[k], jnp.float32) for k in ("u0", "t_days", "data")}
    def loss(p):
        sol = odeint(vector_field, a["u0"], a["t_days"], p, mobility, coupling,
                     rtol=1e-3, atol=1e-6)
        return loss_from_solution(sol, a["data"])
"""

from __future__ import annotations

import functools
import itertools
import operator
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "LAYERS",
    "N_MLP",
    "STATE_ROWS",
    "Rates",
    "loss_from_s_d",
    "loss_from_solution",
    "make_problem",
    "numpy_solve",
    "numpy_transmission_rate",
    "numpy_vector_field",
    "softplus_inverse",
    "transmission_rate",
    "vector_field",
    "vector_field_tuple",
]

LAYERS = (7, 7, 7, 7, 1)
N_MLP = sum(n_out * n_in + n_out for n_in, n_out in itertools.pairwise(LAYERS))
STATE_ROWS = ("s", "e", *(f"id{k}" for k in range(1, 8)), "d")
STATE_ROWS += (*(f"ir{k}" for k in range(1, 6)), "r")
DEATHS_WEIGHT = 20000.0  # the posted loss's weight on the deaths residual
_ID, _IR = slice(2, 9), slice(10, 15)  # the death and recovery chains' rows
_INFECTIOUS = (2, 3, 4, 10, 11, 12, 13, 14)  # id1..id3, ir1..ir5
_ACTIVATIONS = (jax.nn.swish, jax.nn.swish, jax.nn.swish, jax.nn.softplus)


def _layers(p):
    """The MLP's `(W (out, in), b (out,))` per layer from its flat weights."""
    out, offset = [], 0
    for n_in, n_out in itertools.pairwise(LAYERS):
        w = p[offset : offset + n_out * n_in].reshape(n_out, n_in)
        offset += n_out * n_in
        out.append((w, p[offset : offset + n_out]))
        offset += n_out
    return out


# -- the model in JAX, as posted ---------------------------------------------------
def transmission_rate(p_mlp, features):
    """`beta (patch,)` of one day's mobility `features (patch, 7)`."""
    h = features
    for (w, b), activation in zip(_layers(p_mlp), _ACTIVATIONS, strict=True):
        h = activation(h @ w.T + b[None, :])
    return h[:, 0]


def _derivative(u, t, p, mobility, coupling):
    """The 16 rows of du/dt from the 16 rows of `u` (an array or a tuple)."""
    rows = list(u)
    kappa, alpha, gamma = (jax.nn.softplus(p[k]) for k in range(3))
    eta = -jnp.log(-jnp.expm1(-kappa * alpha)) / gamma
    n = coupling.shape[0]
    day = jnp.rint(jnp.asarray(t).astype(jnp.float32)).astype(jnp.int32)
    cm = jax.nn.softplus(p[3 : 3 + n])[:, None] * coupling[..., day]
    beta = transmission_rate(p[3 + n :], mobility[..., day])
    s, e, i_d, i_r = rows[0], rows[1], rows[_ID], rows[_IR]
    i = functools.reduce(operator.add, [rows[k] for k in _INFECTIOUS])
    force = beta * s * i + beta * s * (i @ cm.T + cm @ i)  # coupling counted twice
    d_id = [kappa * (x - y) for x, y in zip([alpha * e, *i_d[:-1]], i_d, strict=True)]
    d_ir = [gamma * (x - y) for x, y in zip([eta * e, *i_r[:-1]], i_r, strict=True)]
    de = force - kappa * alpha * e - gamma * eta * e
    return [-force, de, *d_id, kappa * i_d[-1], *d_ir, gamma * i_r[-1]]


def vector_field(u, t, p, mobility, coupling):
    """du/dt `(16, patch)` of the state `u (16, patch)`, in `odeint`'s argument
    order: `mobility (patch, 7, day)`, `coupling (patch, patch, day)`."""
    return jnp.stack(_derivative(u, t, p, mobility, coupling))


def vector_field_tuple(u, t, p, mobility, coupling):
    """[`vector_field`][] on a pytree state: a tuple of 16 rows `(patch,)`."""
    return tuple(_derivative(u, t, p, mobility, coupling))


def loss_from_s_d(s, d, data):
    """The posted loss from the daily `s` and `d` rows, each `(day, patch)`."""
    infections = jnp.square(jnp.diff(1 - s, axis=0) - data[:, 0, :])
    deaths = jnp.square(jnp.diff(d, axis=0) - data[:, 1, :])
    return jnp.sum(infections + DEATHS_WEIGHT * deaths)


def loss_from_solution(sol, data):
    """The posted loss from the daily solution `sol (day, 16, patch)`."""
    return loss_from_s_d(sol[:, 0, :], sol[:, 9, :], data)


# -- the float64 NumPy twin that makes the data ------------------------------------
class Rates(NamedTuple):
    """Everything of one day that the NumPy vector field reads."""

    kappa: float
    alpha: float
    gamma: float
    eta: float
    beta: np.ndarray  # (patch,)
    coupling: np.ndarray  # (patch, patch), scaled by rows


def _np_softplus(x):
    return np.logaddexp(0.0, x)


def softplus_inverse(y):
    """The inverse of softplus, in NumPy float64."""
    y = np.asarray(y, dtype=np.float64)
    return y + np.log(-np.expm1(-y))


def _np_preactivation(p_mlp, x):
    """The MLP's last pre-activation `(...)` of features `x (..., 7)`."""
    h = x
    layers = _layers(p_mlp)
    for k, (w, b) in enumerate(layers):
        h = h @ w.T + b
        if k < len(layers) - 1:
            h = h / (1.0 + np.exp(-h))  # swish
    return h[..., 0]


def numpy_transmission_rate(p_mlp, mobility):
    """`beta (patch, day)` of every day's `mobility (patch, 7, day)`."""
    features = np.transpose(mobility, (0, 2, 1))  # (patch, day, 7)
    return _np_softplus(_np_preactivation(p_mlp, features))


def numpy_vector_field(u, rates: Rates):
    """du/dt `(16, patch)` of `u (16, patch)` with one day's `rates`."""
    kappa, alpha, gamma, eta, beta, cm = rates
    s, e, i_d, i_r = u[0], u[1], u[_ID], u[_IR]
    i = i_d[0] + i_d[1] + i_d[2] + i_r.sum(axis=0)
    force = beta * s * i + beta * s * (i @ cm.T + cm @ i)
    du = np.empty_like(u)
    du[0] = -force
    du[1] = force - kappa * alpha * e - gamma * eta * e
    du[2] = kappa * (alpha * e - i_d[0])
    du[3:9] = kappa * (i_d[:-1] - i_d[1:])
    du[9] = kappa * i_d[-1]
    du[10] = gamma * (eta * e - i_r[0])
    du[11:15] = gamma * (i_r[:-1] - i_r[1:])
    du[15] = gamma * i_r[-1]
    return du


def _rk4(u, rates: Rates, h: float, steps: int):
    for _ in range(steps):
        k1 = numpy_vector_field(u, rates)
        k2 = numpy_vector_field(u + 0.5 * h * k1, rates)
        k3 = numpy_vector_field(u + 0.5 * h * k2, rates)
        k4 = numpy_vector_field(u + h * k3, rates)
        u = u + (h / 6.0) * (k1 + 2 * k2 + 2 * k3 + k4)
    return u


def numpy_solve(u0, p, mobility, coupling, days: int, substeps: int = 8):
    """The daily solution `(day, 16, patch)` on `t = 0, ..., days - 1`: float64
    RK4 with `substeps` steps per half day, on which the day index `rint(t)`
    is constant (`[k, k + 1/2]` reads day k, `[k + 1/2, k + 1]` day k + 1)."""
    p = np.asarray(p, dtype=np.float64)
    n = coupling.shape[0]
    kappa, alpha, gamma = _np_softplus(p[:3])
    eta = -np.log(-np.expm1(-kappa * alpha)) / gamma
    scaler = _np_softplus(p[3 : 3 + n])
    beta = numpy_transmission_rate(p[3 + n :], mobility)
    last = coupling.shape[-1] - 1
    out = np.empty((days, 16, n))
    u = np.array(u0, dtype=np.float64)
    out[0] = u
    for k in range(days - 1):
        for day in (min(k, last), min(k + 1, last)):
            cm = scaler[:, None] * coupling[..., day]
            rates = Rates(kappa, alpha, gamma, eta, beta[:, day], cm)
            u = _rk4(u, rates, 0.5 / substeps, substeps)
        out[k + 1] = u
    return out


# -- the synthetic problem ---------------------------------------------------------
def _slow_waves(rng, lead: tuple[int, ...], days: int, modes: int = 3):
    """A sum of `modes` sinusoids of periods 20-120 days, `lead + (day,)`,
    roughly in [-1, 1]."""
    t = np.arange(days, dtype=np.float64)
    out = np.zeros(lead + (days,))
    for _ in range(modes):
        period = rng.uniform(20.0, 120.0, size=lead)
        phase = rng.uniform(0, 2 * np.pi, size=lead)
        amplitude = rng.uniform(0.3, 1.0, size=lead) / modes
        wave = np.sin(2 * np.pi * t / period[..., None] + phase[..., None])
        out += amplitude[..., None] * wave
    return out


def _logistic(t, height: float, centre: float, width: float):
    return height / (1.0 + np.exp(-(t - centre) / width))


def _coupling(rng, n: int, t):
    """`(patch, patch, day)`: k-nearest-neighbour gravity weights between
    random points, row sums U(0.05, 0.3), times a daily modulation."""
    xy = rng.uniform(0.0, 1.0, size=(n, 2))
    dist = np.sqrt(((xy[:, None, :] - xy[None, :, :]) ** 2).sum(-1))
    population = rng.lognormal(mean=0.0, sigma=1.0, size=n)
    k = min(10, n - 1)
    rows = np.repeat(np.arange(n), k)
    cols = np.argsort(dist, axis=1)[:, 1 : k + 1].reshape(-1)  # not itself
    weights = np.zeros((n, n))
    weights[rows, cols] = population[cols] * np.exp(-dist[rows, cols] / 0.1)
    weights = weights / weights.sum(axis=1, keepdims=True)
    base = weights * rng.uniform(0.05, 0.3, size=n)[:, None]
    lockdown = 1.0 - _logistic(t, 0.5, 22.0, 4.0) + _logistic(t, 0.3, 70.0, 6.0)
    weekly = 1.0 + 0.1 * np.sin(2 * np.pi * t / 7.0)
    drift = 1.0 + 0.2 * _slow_waves(rng, (n,), t.size)  # per origin patch
    modulation = (lockdown * weekly)[None, :] * drift  # (patch, day), > 0
    return base[:, :, None] * modulation[:, None, :]


def _mobility(rng, n: int, t):
    """`(patch, 7, day)` in [0, 1]: a base level per feature, a lockdown dip
    around day 20 recovering after day 70, a weekly rhythm in features 0, 1
    and 4 (retail, transit, workplace) and slow noise."""
    base = rng.uniform(0.3, 0.8, size=(n, 7))
    sensitivity = rng.uniform(0.2, 0.6, size=(n, 7))
    dip = _logistic(t, 1.0, 20.0, 4.0) - _logistic(t, 0.6, 70.0, 8.0)
    weekly = np.zeros(7)
    weekly[[0, 1, 4]] = 0.08
    mobility = (
        base[..., None]
        - sensitivity[..., None] * dip[None, None, :]
        + weekly[None, :, None] * np.sin(2 * np.pi * t / 7.0)[None, None, :]
        + 0.08 * _slow_waves(rng, (n, 7), t.size)
    )
    return np.clip(mobility, 0.0, 1.0)


def _true_mlp(rng, mobility):
    """Random swish layers whose output layer is sign-fixed (beta rises with
    mobility) and scaled so that beta's 2nd-98th percentiles are 0.22-0.55."""
    p = np.empty(N_MLP)
    offset = 0
    for n_in, n_out in itertools.pairwise(LAYERS):
        p[offset : offset + n_out * n_in] = rng.normal(
            0.0, 1.0 / np.sqrt(n_in), n_out * n_in
        )
        offset += n_out * n_in
        p[offset : offset + n_out] = rng.normal(0.0, 0.1, n_out)
        offset += n_out
    features = np.transpose(mobility, (0, 2, 1))
    z = _np_preactivation(p, features)
    last_w = slice(N_MLP - 1 - LAYERS[-2], N_MLP - 1)  # the last W (1, 7)
    if np.corrcoef(z.ravel(), mobility.mean(axis=1).ravel())[0, 1] < 0:
        p[last_w] *= -1.0
        p[N_MLP - 1] *= -1.0
        z = -z
    lo, hi = np.percentile(z, [2.0, 98.0])
    z_lo, z_hi = softplus_inverse(0.22), softplus_inverse(0.55)
    scale = (z_hi - z_lo) / max(hi - lo, 1e-12)
    p[last_w] *= scale
    p[N_MLP - 1] = (p[N_MLP - 1] - lo) * scale + z_lo
    return p


def make_problem(n_patches: int = 280, days: int = 120, seed: int = 0) -> dict:
    """The synthetic fitting problem, a pure function of its arguments.

    Returns:
        NumPy float64 arrays `u0 (16, patch)`, `t_days (day,)`, `mobility
        (patch, 7, day)`, `coupling (patch, patch, day)`, `p_true` and
        `p_init` (`3 + patch + N_MLP`), `data (day - 1, 2, patch)` (noisy
        daily new infections and deaths), `sol_true (day, 16, patch)` (the
        noise-free solution at `p_true`), and the ints `n_c`, `T`, `seed`.
    """
    rng = np.random.default_rng(seed)
    n = n_patches
    t = np.arange(days, dtype=np.float64)
    coupling = _coupling(rng, n, t)
    mobility = _mobility(rng, n, t)
    # kappa 0.5/day (7 death stages: ~14 days to death), alpha 0.07 (an
    # infection fatality ratio ~1%), gamma 1.5/day (5 recovery stages: ~3.3
    # infectious days)
    epidemic = np.array([0.5, 0.07, 1.5])
    scaler = rng.uniform(0.7, 1.3, size=n)
    p_mlp = _true_mlp(rng, mobility)
    p_true = np.concatenate(
        [softplus_inverse(epidemic), softplus_inverse(scaler), p_mlp]
    )
    n_seeded = max(1, int(round(0.05 * n)))
    seeded = rng.choice(n, size=n_seeded, replace=False)
    u0 = np.zeros((16, n))
    u0[1, seeded] = rng.uniform(2e-4, 1e-3, size=n_seeded)  # exposed
    u0[0] = 1.0 - u0[1]
    sol_true = numpy_solve(u0, p_true, mobility, coupling, days)
    clean = np.stack(
        [np.diff(1.0 - sol_true[:, 0, :], axis=0), np.diff(sol_true[:, 9, :], axis=0)],
        axis=1,
    )
    data = np.maximum(clean * rng.lognormal(0.0, 0.05, size=(days - 1, 2, n)), 0.0)
    p_init = p_true.copy()
    p_init[:3] += rng.normal(0.0, 0.15, size=3)
    p_init[3 : 3 + n] += rng.normal(0.0, 0.2, size=n)
    p_init[3 + n :] += rng.normal(0.0, 0.05, size=N_MLP)
    return dict(
        u0=u0,
        t_days=t,
        mobility=mobility,
        coupling=coupling,
        p_true=p_true,
        p_init=p_init,
        data=data,
        sol_true=sol_true,
        n_c=n,
        T=days,
        seed=seed,
    )
