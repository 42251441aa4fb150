"""The explicit Runge-Kutta step's hand-organised VJP (`AbstractERK.step_vjp`:
the state cotangents by the stage recursion, the parameters' once per step by
a pull-back batched over the stages) against plain reverse-mode autodiff of
the step, on the flat vector fields of compiled models, float64."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import params_from_flat, reference_covariates, reference_initial_data

import epifit.model as em
from epifit.ode import RK4, PIDController, Tsit5
from epifit.ode._solve import _integrator

TOL = 1e-12  # the same sums in another order: float64 rounding


def _sir():
    model = em.compile_model(em.load_model("models/sir.toml"))
    params = model.init_params(1)
    return model, params, {}, {}, 1


def _boxcar():  # a box-car chain, a probability split with its remainder
    model = em.compile_model(em.load_model("models/seird_boxcar.toml"))
    params = model.init_params(3)
    return model, params, {}, {}, 3


def _reference(problem, sparse: bool):  # an MLP rate, a coupling matrix
    n = 6
    P = problem.make_problem(n, 10, 0)
    model = em.compile_model(em.load_model("models/seird_metapop_mobility.toml"))
    cov = {k: jnp.asarray(v) for k, v in reference_covariates(P).items()}
    if sparse:
        cov["coupling"] = em.sparse_coupling(cov["coupling"], max_density=1.0)
    init = {k: jnp.asarray(v) for k, v in reference_initial_data(P["u0"]).items()}
    return model, params_from_flat(model, P["p_init"], n), init, cov, n


def _flat_field(name, reference_problem):
    """`(f(t, y, theta), y, theta)`: a model's vector field on the solver's
    buffer with its floating arguments `theta`, at a perturbed state."""
    if name == "sir":
        case = _sir()
    elif name == "boxcar":
        case = _boxcar()
    else:
        case = _reference(reference_problem, name.endswith("sparse"))
    model, params, init, cov, n = case
    y0 = model.initial_state(params, init, n)
    args, inputs = model.precompute(params, cov, n)
    integ, args, flat0, _ = _integrator(
        model.vector_field, y0, args, Tsit5(), PIDController(), 16, True
    )
    u = None if inputs is None else jax.tree.map(lambda v: v[3], inputs.values)
    theta, fixed = eqx.partition((args, u), eqx.is_inexact_array)

    def f(t, y, th):
        a, u_ = eqx.combine(th, fixed)
        return integ.vf(t, y, a, u_)

    key = jax.random.PRNGKey(0)
    y = flat0 * (1.0 + 0.1 * jax.random.uniform(key, flat0.shape)) + 1e-3
    return f, y, theta


def _rel(a, b):
    return max(
        float(jnp.max(jnp.abs(x - y)) / (jnp.max(jnp.abs(y)) + 1e-300))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


@pytest.mark.parametrize(
    "name, solver",  # first-same-as-last (Tsit5) or not (RK4)
    [
        ("sir", RK4()),
        ("boxcar", Tsit5()),
        # 40-60 s each on the shared 2-core machine (two compiles of the
        # reference model's step and its pull-backs)
        pytest.param("reference-dense", RK4(), marks=pytest.mark.slow),
        pytest.param("reference-sparse", Tsit5(), marks=pytest.mark.slow),
    ],
)
def test_step_vjp_matches_autodiff(name, solver, reference_problem):
    """Unrolled from `y0` (the checkpoint adjoint's one-step segments) and in
    the run-time stage loop from kept stage states (its replayed steps)."""
    f, y, theta = _flat_field(name, reference_problem)
    t0, t1 = jnp.asarray(0.5), jnp.asarray(0.8)
    ct = jax.random.normal(jax.random.PRNGKey(1), y.shape, y.dtype)

    @jax.jit
    def check(y, theta, ct):
        def step(y, th):
            vf = lambda t, y_, a, u: f(t, y_, a)  # noqa: E731
            return solver.fresh_step(vf, t0, t1, y, th, None)

        want = jax.vjp(step, y, theta)[1](ct)
        unrolled = solver.step_vjp(f, t0, t1, y, theta, ct, unroll=True)
        _, kept = solver.loop_step(f, t0, t1, y, theta)
        looped = solver.step_vjp(f, t0, t1, y, theta, ct, stage_states=kept)
        return want, unrolled, looped

    want, unrolled, looped = check(y, theta, ct)
    assert _rel(unrolled, want) < TOL
    assert _rel(looped, want) < TOL
    assert np.all(np.isfinite(np.asarray(want[0])))
