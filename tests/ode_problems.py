"""Reference problems for the ODE-core tests, each with an independent NumPy
right-hand side for scipy (written separately, not derived from the JAX one)."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
from scipy.integrate import solve_ivp

from epifit import jit
from epifit.ode import solve

# Compiling, not running, is what these tests spend their time on: `epifit.jit`
# (XLA's classic CPU emitters) halves it.


def jit_solve(vector_field, **static):
    """`solve(vector_field, y0, args, inputs=...)` compiled, with `static`
    (ts, solver, controller, ...) fixed."""
    return jit(functools.partial(solve, vector_field, **static))


# scipy's reference: DOP853 at tolerances far below any tested solver's
REF_RTOL, REF_ATOL = 1e-10, 1e-12


def scipy_reference(rhs, y0, ts, method="DOP853", rtol=REF_RTOL, atol=REF_ATOL):
    """`(len(ts), n)` states from scipy's `solve_ivp`, saved at `ts`."""
    ts = np.asarray(ts, dtype=np.float64)
    out = solve_ivp(
        rhs,
        (ts[0], ts[-1]),
        np.asarray(y0, dtype=np.float64),
        method=method,
        t_eval=ts,
        rtol=rtol,
        atol=atol,
    )
    assert out.success, out.message
    return out.y.T


# -- SIR: scalar leaves ------------------------------------------------------------
SIR_TS = np.linspace(0.0, 60.0, 13)


def sir_args():
    return {"beta": jnp.asarray(0.5), "gamma": jnp.asarray(0.2)}


def sir_y0():
    return {"S": jnp.asarray(0.99), "I": jnp.asarray(0.01), "R": jnp.asarray(0.0)}


def sir(t, y, args, u):
    infection = args["beta"] * y["S"] * y["I"]
    recovery = args["gamma"] * y["I"]
    return {"S": -infection, "I": infection - recovery, "R": recovery}


def sir_np(t, x, beta=0.5, gamma=0.2):
    s, i, _ = x
    return np.array([-beta * s * i, beta * s * i - gamma * i, gamma * i])


def sir_flat(y):
    """Pytree (with a leading time axis) -> `(time, 3)` as in `sir_np`."""
    return np.stack([np.asarray(y[k]) for k in ("S", "I", "R")], axis=-1)


@functools.cache
def sir_reference():
    return scipy_reference(sir_np, [0.99, 0.01, 0.0], SIR_TS)


# -- box-car SEIRD: leaves of shapes (1,), (K_E,), (K_I,), (1,), (1,) ----------------
K_E, K_I = 3, 4
SEIRD_TS = np.linspace(0.0, 80.0, 17)
SEIRD_PARAMS = {"beta": 0.6, "sigma": 1 / 3, "gamma": 1 / 5, "ifr": 0.01}


def seird_args():
    return {k: jnp.asarray(v) for k, v in SEIRD_PARAMS.items()}


def seird_y0():
    return {
        "S": jnp.array([0.999]),
        "E": jnp.array([1e-3, 0.0, 0.0]),
        "I": jnp.zeros(K_I),
        "R": jnp.zeros(1),
        "D": jnp.zeros(1),
    }


def seird(t, y, args, u):
    r_e = K_E * args["sigma"]  # per-stage rates: mean latent 1/sigma in K_E stages
    r_i = K_I * args["gamma"]
    incidence = args["beta"] * y["S"] * jnp.sum(y["I"], keepdims=True)
    out_e = r_e * y["E"]
    out_i = r_i * y["I"]
    d_e = jnp.concatenate([incidence, out_e[:-1]]) - out_e
    d_i = jnp.concatenate([out_e[-1:], out_i[:-1]]) - out_i
    return {
        "S": -incidence,
        "E": d_e,
        "I": d_i,
        "R": (1 - args["ifr"]) * out_i[-1:],
        "D": args["ifr"] * out_i[-1:],
    }


def seird_np(t, x, beta=0.6, sigma=1 / 3, gamma=1 / 5, ifr=0.01):
    s = x[0]
    e = x[1 : 1 + K_E]
    i = x[1 + K_E : 1 + K_E + K_I]
    dx = np.zeros_like(x)
    inc = beta * s * i.sum()
    dx[0] = -inc
    for j in range(K_E):
        dx[1 + j] = (inc if j == 0 else K_E * sigma * e[j - 1]) - K_E * sigma * e[j]
    for j in range(K_I):
        inflow = K_E * sigma * e[-1] if j == 0 else K_I * gamma * i[j - 1]
        dx[1 + K_E + j] = inflow - K_I * gamma * i[j]
    dx[-2] = (1 - ifr) * K_I * gamma * i[-1]
    dx[-1] = ifr * K_I * gamma * i[-1]
    return dx


def seird_flat(y):
    return np.concatenate(
        [np.asarray(y[k]) for k in ("S", "E", "I", "R", "D")], axis=-1
    )


@functools.cache
def seird_reference():
    x0 = seird_flat({k: np.asarray(v) for k, v in seird_y0().items()})
    return scipy_reference(seird_np, x0, SEIRD_TS)


# -- Robertson's stiff chemical kinetics: leaves of shapes (2,) and () ---------------
ROBERTSON_TS = np.array([0.0, 1e-3, 1e-2, 0.1, 1.0, 3.0, 10.0])


def robertson_y0():
    return {"y12": jnp.array([1.0, 0.0]), "y3": jnp.asarray(0.0)}


def robertson(t, y, args, u):
    y1, y2 = y["y12"][0], y["y12"][1]
    fast = 1e4 * y2 * y["y3"]
    very_fast = 3e7 * y2**2
    d1 = -0.04 * y1 + fast
    return {"y12": jnp.stack([d1, 0.04 * y1 - fast - very_fast]), "y3": very_fast}


def robertson_np(t, x):
    y1, y2, y3 = x
    return np.array(
        [
            -0.04 * y1 + 1e4 * y2 * y3,
            0.04 * y1 - 1e4 * y2 * y3 - 3e7 * y2**2,
            3e7 * y2**2,
        ]
    )


def robertson_flat(y):
    return np.concatenate([np.asarray(y["y12"]), np.asarray(y["y3"])[..., None]], -1)


@functools.cache
def robertson_reference():
    return scipy_reference(robertson_np, [1.0, 0.0, 0.0], ROBERTSON_TS)
