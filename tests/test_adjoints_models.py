"""Every adjoint's gradient on epidemic models: a box-car SEIRD against finite
differences, and the reference metapopulation model at 20 patches against
diffrax, directional derivatives and the covariates' (absent) cotangents.
(Split from `test_adjoints.py` so that the two halves run on both test
workers.)"""

from __future__ import annotations

import diffrax
import equinox as eqx
import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from adjoint_cases import ADJOINTS, CTRL, GRAD_RTOL
from adjoint_cases import finite_differences as _fd
from adjoint_cases import rel_error as _rel
from helpers import params_from_flat, reference_covariates, reference_initial_data

import epifit.model as em
from epifit.ode import (
    CheckpointAdjoint,
    solve,
)


# ------------------------------------------------------------------- box-car SEIRD
def test_boxcar_seird_gradients_agree():
    model = em.compile_model(em.load_model("models/seird_boxcar.toml"))
    params = model.init_params(3)
    y0 = model.initial_state(params, {}, 3)
    free, static = eqx.partition(params, eqx.is_inexact_array)

    def loss(free, adjoint):
        p = eqx.combine(free, static)
        args, inputs = model.precompute(p, {}, 3)
        sol = solve(
            model.vector_field,
            y0,
            args,
            ts=np.arange(0.0, 60.0, 3.0),
            inputs=inputs,
            adjoint=adjoint,
            stepsize_controller=CTRL,
        )
        return jnp.sum(sol.ys["D"] ** 2) * 1e4 + jnp.sum(sol.ys["IR"])

    flat, unravel = jax.flatten_util.ravel_pytree(free)
    fd = _fd(jax.jit(lambda v: loss(unravel(v), CheckpointAdjoint())), flat)
    for name in ("checkpoint", "backsolve", "interpolating", "quadrature", "forward"):
        g = jax.jit(jax.grad(lambda f, a=ADJOINTS[name]: loss(f, a)))(free)
        # Backsolving the box-car chains backwards amplifies the local errors by
        # up to exp(1.5/day * 3 days) ~ 90 per 3-day segment (the chains decay
        # forwards, so they grow backwards): its tolerance is 100x looser.
        tol = 100 * GRAD_RTOL if name == "backsolve" else GRAD_RTOL
        assert _rel(g, fd) < tol, name


# --------------------------------------------------- the reference model at 20 patches
@pytest.fixture(scope="module")
def reference20(reference_problem):
    P = reference_problem.make_problem(20, 30, 0)
    model = em.compile_model(em.load_model("models/seird_metapop_mobility.toml"))
    cov = {k: jnp.asarray(v) for k, v in reference_covariates(P).items()}
    init = {k: jnp.asarray(v) for k, v in reference_initial_data(P["u0"]).items()}
    params = params_from_flat(model, P["p_init"], 20)
    return P, model, cov, init, params


def _reference_loss(model, cov, init, data, sm, adjoint, ctrl=CTRL):
    def loss(p_flat):
        params = params_from_flat(model, p_flat, 20)
        y0 = model.initial_state(params, init, 20)
        args, inputs = model.precompute(params, cov, 20)
        sol = solve(
            model.vector_field,
            y0,
            args,
            ts=np.arange(30.0),
            inputs=inputs,
            adjoint=adjoint,
            stepsize_controller=ctrl,
        )
        return sm.loss_from_s_d(sol.ys["S"][:, 0], sol.ys["D"][:, 0], data)

    return loss


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", ["checkpoint", "backsolve", "interpolating", "quadrature"]
)
def test_reference_model_gradient_matches_diffrax(reference20, reference_problem, name):
    """The reference at 20 patches with its MLP: epifit's gradients w.r.t. the flat
    parameter vector against diffrax's (Tsit5 at tight tolerance restarted on each
    half day, where the day index is constant, with the reference's own vector
    field)."""
    P, model, cov, init, _ = reference20
    sm = reference_problem
    data = jnp.asarray(P["data"])
    mob, cpl = jnp.asarray(P["mobility"]), jnp.asarray(P["coupling"])

    def diffrax_loss(p):
        # The day index is constant on each half-day [j/2, (j+1)/2]: restart
        # diffrax on each (as the reference's own numpy_solve does), passing
        # t = day to the reference vector field, which reads its day from t.
        def segment(y, j):
            day = jnp.floor(j * 0.5 + 0.5)

            def f(t, y, args):
                return sm.vector_field(y, day, args, mob, cpl)

            sol = diffrax.diffeqsolve(
                diffrax.ODETerm(f),
                diffrax.Tsit5(),
                j * 0.5,
                j * 0.5 + 0.5,
                None,
                y,
                args=p,
                stepsize_controller=diffrax.PIDController(rtol=1e-11, atol=1e-13),
                max_steps=10_000,
            )
            y1 = sol.ys[-1]
            return y1, y1

        u0 = jnp.asarray(P["u0"])
        _, ys = jax.lax.scan(segment, u0, jnp.arange(58.0))
        sol = jnp.concatenate([u0[None], ys[1::2]])
        return sm.loss_from_solution(sol, data)

    p0 = jnp.asarray(P["p_init"])
    g_ref = jax.jit(jax.grad(diffrax_loss))(p0)
    loss = _reference_loss(model, cov, init, data, sm, ADJOINTS[name])
    g = jax.jit(jax.grad(loss))(p0)
    assert _rel(g, g_ref) < 1e-5


@pytest.mark.slow
def test_reference_model_directional_derivatives(reference20, reference_problem):
    """Directional finite differences along random directions, all adjoints."""
    P, model, cov, init, _ = reference20
    data = jnp.asarray(P["data"])
    p0 = jnp.asarray(P["p_init"])
    rng = np.random.default_rng(0)
    dirs = rng.normal(size=(3, p0.size))
    base = jax.jit(_reference_loss(model, cov, init, data, reference_problem, None))
    for name in ("checkpoint", "backsolve", "interpolating", "quadrature"):
        loss = _reference_loss(
            model, cov, init, data, reference_problem, ADJOINTS[name]
        )
        g = np.asarray(jax.jit(jax.grad(loss))(p0))
        for d in dirs:
            eps = 1e-6
            fd = (float(base(p0 + eps * d)) - float(base(p0 - eps * d))) / (2 * eps)
            assert abs(g @ d - fd) <= 1e-5 * abs(fd), name


def test_covariates_get_no_cotangent(reference20, reference_problem):
    """No array the size of the coupling cube is formed in the gradient, other
    than the cube itself: covariates are data."""
    P, model, cov, init, _ = reference20
    data = jnp.asarray(P["data"])

    def loss(p_flat, cov):
        return _reference_loss(model, cov, init, data, reference_problem, None)(p_flat)

    jaxpr = jax.make_jaxpr(jax.grad(loss))(jnp.asarray(P["p_init"]), cov)
    cube = cov["coupling"].shape

    def shapes(jp):
        for eqn in jp.eqns:
            for v in eqn.outvars:
                yield tuple(getattr(v.aval, "shape", ()))
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                yield from shapes(sub)

    assert cube not in set(shapes(jaxpr.jaxpr))
