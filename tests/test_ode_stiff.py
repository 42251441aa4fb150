"""Stiff problems and the implicit (ESDIRK) solvers Kvaerno3 and Kvaerno5,
against scipy's DOP853 at tight tolerance, closed forms and finite differences."""

from __future__ import annotations

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import ode_problems as P
import pytest
from scipy.integrate import solve_ivp
from scipy.stats import linregress

from epifit import jit
from epifit.ode import (
    AbstractImplicitSolver,
    BacksolveAdjoint,
    Bosh3,
    CheckpointAdjoint,
    ConstantStepSize,
    Dopri5,
    InterpolatingAdjoint,
    Kvaerno3,
    Kvaerno5,
    PIDController,
    QuadratureAdjoint,
    Result,
    Tsit5,
    solve,
)
from epifit.ode._loop import Integrator

# Solver tolerances on the non-stiff problems; the global error bound is as in
# test_ode.py (local error accumulated over the steps; measured worst ~16x,
# Kvaerno5 on SIR, whose Newton iterations stop at 1e-2 of the tolerance).
RTOL, ATOL = 1e-8, 1e-10
GLOBAL = 100
# Robertson: y2 is ~1e-5 and swings over five decades, so atol sits far below
# it; rtol is looser because explicit solvers need thousands of steps.
STIFF_RTOL, STIFF_ATOL = 1e-6, 1e-10
STIFF_MAX_STEPS = 20_000

IMPLICIT = [Kvaerno3(), Kvaerno5()]
EXPLICIT = [Tsit5(), Dopri5(), Bosh3()]


def _name(x):
    return type(x).__name__


@pytest.mark.parametrize("solver", IMPLICIT, ids=_name)
@pytest.mark.parametrize(
    "vf, y0, args, ts, reference, flat",
    [
        (P.sir, P.sir_y0, P.sir_args, P.SIR_TS, P.sir_reference, P.sir_flat),
        (
            P.seird,
            P.seird_y0,
            P.seird_args,
            P.SEIRD_TS,
            P.seird_reference,
            P.seird_flat,
        ),
    ],
    ids=["sir", "seird"],
)
def test_implicit_solvers_agree_with_scipy(vf, y0, args, ts, reference, flat, solver):
    ctrl = PIDController(rtol=RTOL, atol=ATOL)
    sol = P.jit_solve(vf, ts=ts, solver=solver, stepsize_controller=ctrl)(y0(), args())
    assert int(sol.result) == Result.SUCCESSFUL
    ys = flat(sol.ys)
    np.testing.assert_allclose(ys, reference(), rtol=GLOBAL * RTOL, atol=GLOBAL * ATOL)
    # Linear invariants survive the Newton iteration too: if c.f = 0 then
    # c.J = 0, so every increment keeps c.z = c.psi, converged or not.
    np.testing.assert_allclose(ys.sum(-1), 1.0, rtol=0, atol=1e-12)


@pytest.fixture(scope="module")
def robertson_solutions():
    """Robertson's problem solved once per solver, shared by the tests below."""
    cache = {}

    def get(solver):
        key = repr(solver)
        if key not in cache:
            ctrl = PIDController(rtol=STIFF_RTOL, atol=STIFF_ATOL)
            cache[key] = P.jit_solve(
                P.robertson,
                ts=P.ROBERTSON_TS,
                solver=solver,
                stepsize_controller=ctrl,
                max_steps=STIFF_MAX_STEPS,
            )(P.robertson_y0())
        return cache[key]

    return get


@pytest.mark.parametrize("solver", IMPLICIT + EXPLICIT, ids=_name)
def test_robertson_agrees_with_scipy(solver, robertson_solutions):
    sol = robertson_solutions(solver)
    assert int(sol.result) == Result.SUCCESSFUL
    ys = P.robertson_flat(sol.ys)
    np.testing.assert_allclose(
        ys,
        P.robertson_reference(),
        rtol=GLOBAL * STIFF_RTOL,
        atol=GLOBAL * STIFF_ATOL,
    )
    np.testing.assert_allclose(ys.sum(-1), 1.0, rtol=0, atol=1e-12)


def _steps(sol):
    return int(sol.stats["num_accepted_steps"]) + int(sol.stats["num_rejected_steps"])


@pytest.mark.parametrize("stiff", IMPLICIT, ids=_name)
def test_stiff_solver_takes_far_fewer_steps_than_tsit5(stiff, robertson_solutions):
    # Tsit5's steps are capped by stability (|dt * lambda| < ~3.5 with lambda
    # up to ~-1e4 here): ~7000 steps. An L-stable method follows the accuracy
    # of the slow dynamics: tens (Kvaerno5) to a few hundred (Kvaerno3).
    n_stiff = _steps(robertson_solutions(stiff))
    n_tsit5 = _steps(robertson_solutions(Tsit5()))
    assert 20 * n_stiff < n_tsit5, (n_stiff, n_tsit5)


# --------------------------------------------------------- Newton iteration
def test_newton_tolerances_come_from_the_controller():
    solver = Kvaerno5().with_default_tolerances(1e-5, 1e-9)
    assert (solver.newton_rtol, solver.newton_atol) == (1e-5, 1e-9)
    mine = Kvaerno3(newton_rtol=1e-7).with_default_tolerances(1e-5, 1e-9)
    assert (mine.newton_rtol, mine.newton_atol) == (1e-7, 1e-9)
    assert isinstance(mine, AbstractImplicitSolver)


def _square(t, y, args, u):
    return y**2  # y(t) = 1 / (1 - t) from y(0) = 1


@pytest.mark.parametrize("solver", IMPLICIT, ids=_name)
def test_unconverged_newton_gives_an_infinite_error_estimate(solver):
    y0 = jnp.asarray(1.0)
    y1, err, _, _ = solver.step(_square, 0.0, 0.01, y0, None, None, None)
    np.testing.assert_allclose(y1, 1 / 0.99, rtol=1e-8)
    assert np.isfinite(err) and abs(err) < 1e-6
    # dt = 0.5: the Jacobian at y0 is far from the one at the stages (and the
    # blow-up at t = 1 is near); six simplified Newton iterations do not
    # converge, so the controller must reject.
    _, err, _, _ = solver.step(_square, 0.0, 0.5, y0, None, None, None)
    assert np.isinf(err)


def test_rejected_newton_failures_still_give_the_right_answer(robertson_solutions):
    # At most two Newton iterations per stage: many steps fail to converge and
    # are rejected, and the accepted ones are as accurate as before.
    tight = robertson_solutions(Kvaerno5(newton_max_steps=2))
    assert int(tight.result) == Result.SUCCESSFUL
    default = robertson_solutions(Kvaerno5())
    assert int(tight.stats["num_rejected_steps"]) > 10 * max(
        1, int(default.stats["num_rejected_steps"])
    )
    np.testing.assert_allclose(
        P.robertson_flat(tight.ys),
        P.robertson_reference(),
        rtol=GLOBAL * STIFF_RTOL,
        atol=GLOBAL * STIFF_ATOL,
    )


def test_implicit_evaluation_count_matches_a_python_counter():
    calls = []

    def counted(t, y, args, u):
        jax.debug.callback(lambda: calls.append(1))
        return P.robertson(t, y, args, u)

    ctrl = PIDController(rtol=STIFF_RTOL, atol=STIFF_ATOL)
    sol = P.jit_solve(
        counted, ts=[0.0, 0.1, 1.0], solver=Kvaerno5(), stepsize_controller=ctrl
    )(P.robertson_y0())
    jax.effects_barrier()
    st = {k: int(v) for k, v in sol.stats.items()}
    steps = st["num_accepted_steps"] + st["num_rejected_steps"]
    n = 3  # state elements
    # epifit counts a Jacobian as n evaluations (its n JVP columns); jacfwd
    # evaluates the vector field once, batched over the n columns, so the
    # callback fires once per Jacobian.
    assert st["num_rhs_evals"] == len(calls) + (n - 1) * steps
    # per step at least: the Jacobian, the explicit stage, one Newton
    # iteration per implicit stage; plus two for the initial step size
    assert st["num_rhs_evals"] >= (n + 1 + 6) * steps + 2


# ------------------------------------------------------------- orders, grads
T_ORDER = 1.0


def _brusselator(t, y, args, u):
    u_, v = y["uv"][0], y["uv"][1]
    return {"uv": jnp.stack([1.0 + u_**2 * v - 4.0 * u_, 3.0 * u_ - u_**2 * v])}


@pytest.mark.parametrize(
    "solver, order, n_steps",
    [
        (Kvaerno3(newton_rtol=1e-13, newton_atol=1e-15), 3, (8, 16, 32, 64)),
        (Kvaerno5(newton_rtol=1e-13, newton_atol=1e-15), 5, (4, 8, 16, 32)),
    ],
    ids=["Kvaerno3", "Kvaerno5"],
)
def test_implicit_convergence_order(solver, order, n_steps):
    reference = solve_ivp(
        lambda t, x: [1 + x[0] ** 2 * x[1] - 4 * x[0], 3 * x[0] - x[0] ** 2 * x[1]],
        (0.0, T_ORDER),
        [1.5, 3.0],
        method="DOP853",
        rtol=2.3e-14,
        atol=1e-16,
    ).y[:, -1]

    @jit
    def final_states(y0):
        return jnp.stack(
            [
                solve(
                    _brusselator,
                    y0,
                    ts=[0.0, T_ORDER],
                    solver=solver,
                    stepsize_controller=ConstantStepSize(T_ORDER / n),
                ).ys["uv"][-1]
                for n in n_steps
            ]
        )

    errors = np.linalg.norm(
        np.asarray(final_states({"uv": jnp.array([1.5, 3.0])})) - reference, axis=1
    )
    fit = linregress(np.log(T_ORDER / np.asarray(n_steps)), np.log(errors))
    assert abs(fit.slope - order) < 0.3, (fit.slope, errors)


GRAD_RTOL, GRAD_ATOL = 1e-10, 1e-12
# relative; truncation ~FD_STEP**2 = 1e-8, step-selection noise ~GRAD_RTOL / FD_STEP
FD_STEP = 1e-4
FD_AGREEMENT = 1e-5


def test_implicit_gradient_matches_finite_differences():
    ctrl = PIDController(rtol=GRAD_RTOL, atol=GRAD_ATOL)
    ts = np.linspace(0.0, 20.0, 5)

    def loss(theta):  # theta = (beta, gamma, I0); the step is relative to each
        args = {"beta": theta[0], "gamma": theta[1]}
        y0 = {"S": 1 - theta[2], "I": theta[2], "R": jnp.zeros_like(theta[0])}
        sol = solve(P.sir, y0, args, ts=ts, solver=Kvaerno5(), stepsize_controller=ctrl)
        return jnp.sum(sol.ys["I"] ** 2)

    # one compilation for the gradient and the finite differences
    value_and_grad = jit(jax.value_and_grad(loss))
    theta = jnp.array([0.5, 0.2, 0.01])
    grad = np.asarray(value_and_grad(theta)[1])
    eye = jnp.eye(3)
    fd = [
        (value_and_grad(theta + h * eye[i])[0] - value_and_grad(theta - h * eye[i])[0])
        / (2 * h)
        for i, h in enumerate(FD_STEP * np.asarray(theta))
    ]
    np.testing.assert_allclose(grad, np.asarray(fd), rtol=FD_AGREEMENT)


def _sir_gradient(adjoint):
    def loss(args):
        sol = solve(
            P.sir,
            P.sir_y0(),
            args,
            ts=P.SIR_TS,
            stepsize_controller=PIDController(rtol=1e-9, atol=1e-11),
            adjoint=adjoint,
        )
        return jnp.sum(sol.ys["I"] ** 2)

    return jit(jax.grad(loss))(P.sir_args())


@functools.cache
def _checkpoint_sir_gradient():
    return _sir_gradient(CheckpointAdjoint())


@pytest.mark.parametrize(
    "kind",
    [BacksolveAdjoint, InterpolatingAdjoint, QuadratureAdjoint],
    ids=lambda k: k.__name__,
)
def test_a_stiff_solver_integrates_the_backward_pass(kind):
    """A continuous adjoint with Kvaerno5 for its backward pass (and the
    Newton tolerances taken from its backward controller) gives the gradient
    the checkpoint adjoint gives through Tsit5."""
    back = PIDController(rtol=1e-8, atol=1e-10)
    stiff = kind(solver=Kvaerno5(), stepsize_controller=back)
    got, want = _sir_gradient(stiff), _checkpoint_sir_gradient()
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, err_msg=k)
    ctx = types.SimpleNamespace(integ=Integrator(None, Tsit5(), PIDController(), 16))
    solver = stiff._backward_integrator(ctx, None, None).solver
    assert (solver.newton_rtol, solver.newton_atol) == (1e-8, 1e-10)
