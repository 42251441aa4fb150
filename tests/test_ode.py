"""The ODE core against answers it did not compute: scipy's DOP853 at tight
tolerance, closed forms, measured convergence orders, finite differences and an
unrolled fixed-step reference. Stiff solvers are in `test_ode_stiff.py`."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import ode_problems as P
import pytest
from scipy.integrate import solve_ivp
from scipy.stats import linregress

from epifit import jit
from epifit.ode import (
    RK4,
    Bosh3,
    ConstantStepSize,
    Dopri5,
    Euler,
    PIDController,
    PiecewiseConstant,
    Result,
    SolverError,
    Tsit5,
    solve,
)

# Solver tolerances of the agreement tests.
RTOL, ATOL = 1e-8, 1e-10
# The controller bounds the *local* error of each step by rtol * |y| + atol; the
# global error is that accumulated over hundreds to thousands of steps (partly
# cancelling, damped by the dynamics). Measured worst case on these problems:
# ~34x (Bosh3, box-car SEIRD); 100x leaves headroom and still catches any
# wrong coefficient, which costs orders of magnitude.
GLOBAL = 100
# Runge-Kutta methods conserve linear invariants up to rounding.
CONSERVATION = 1e-12

EXPLICIT = [Tsit5(), Dopri5(), Bosh3()]
PROBLEMS = {
    "sir": (P.sir, P.sir_y0, P.sir_args, P.SIR_TS, P.sir_reference, P.sir_flat),
    "seird": (
        P.seird,
        P.seird_y0,
        P.seird_args,
        P.SEIRD_TS,
        P.seird_reference,
        P.seird_flat,
    ),
}


def _name(x):
    return type(x).__name__


def _decay(t, y, args, u):
    return -args * y


# --------------------------------------------------------------------- agreement
@pytest.mark.parametrize("solver", EXPLICIT, ids=_name)
@pytest.mark.parametrize("problem", sorted(PROBLEMS))
def test_agrees_with_scipy(problem, solver):
    vf, y0, args, ts, reference, flat = PROBLEMS[problem]
    ctrl = PIDController(rtol=RTOL, atol=ATOL)
    sol = P.jit_solve(vf, ts=ts, solver=solver, stepsize_controller=ctrl)(y0(), args())
    assert int(sol.result) == Result.SUCCESSFUL
    ys = flat(sol.ys)
    np.testing.assert_allclose(ys, reference(), rtol=GLOBAL * RTOL, atol=GLOBAL * ATOL)
    np.testing.assert_allclose(ys.sum(-1), 1.0, rtol=0, atol=CONSERVATION)


# ------------------------------------------------- the reference metapopulation
METAPOP_PATCHES, METAPOP_DAYS = 20, 40
# The reference's own float64 RK4 (8 sub-steps per half day, h = 1/16): its
# error ~ h^4 * |y''''| is ~1e-7 here, far above DOP853's.
METAPOP_RK4_ATOL = 1e-6


def _mlp(layers, w, x):
    """The reference's MLP on `(..., 7)` features: per layer `W (out, in)` then
    `b (out,)` packed in `w`; swish activations, softplus output."""
    h, off = x, 0
    for k, (n_in, n_out) in enumerate(zip(layers[:-1], layers[1:], strict=True)):
        weight = w[off : off + n_out * n_in].reshape(n_out, n_in)
        off += n_out * n_in
        bias = w[off : off + n_out].reshape((1,) * (h.ndim - 1) + (n_out,))
        h = h @ weight.T + bias
        off += n_out
        h = jax.nn.softplus(h) if k == len(layers) - 2 else jax.nn.swish(h)
    return h[..., 0]


def _metapop_rates(layers, p, mobility, coupling):
    """Everything that depends only on (parameters, day), hoisted out of the
    vector field: `args` (scalar rates) and the daily `values` of the inputs."""
    n = coupling.shape[0]
    kappa, alpha, gamma = (jax.nn.softplus(p[k]) for k in range(3))
    eta = -jnp.log(-jnp.expm1(-kappa * alpha)) / gamma
    scaler = jax.nn.softplus(p[3 : 3 + n])
    args = {"kappa": kappa, "alpha": alpha, "gamma": gamma, "eta": eta}
    values = {
        "beta": _mlp(layers, p[3 + n :], jnp.moveaxis(mobility, -1, 0)),  # (day, n)
        "coupling": scaler[None, :, None] * jnp.moveaxis(coupling, -1, 0),
    }
    return args, values


def _metapop_vf(t, y, args, u):
    """The reference vector field (`reference.problem.vector_field`, quirks
    included: the coupling term is counted twice) on a pytree state."""
    kappa, alpha, gamma, eta = (args[k] for k in ("kappa", "alpha", "gamma", "eta"))
    beta, cm = u["beta"], u["coupling"]
    s, e, i_d, i_r = y["S"], y["E"], y["ID"], y["IR"]
    i = i_d[0] + i_d[1] + i_d[2] + jnp.sum(i_r, axis=0)
    force = beta * s * i + beta * s * (i @ cm.T + cm @ i)
    out_d = kappa * i_d
    out_r = gamma * i_r
    return {
        "S": -force,
        "E": force - kappa * alpha * e - gamma * eta * e,
        "ID": jnp.concatenate([(kappa * alpha * e)[None], out_d[:-1]]) - out_d,
        "D": out_d[-1],
        "IR": jnp.concatenate([(gamma * eta * e)[None], out_r[:-1]]) - out_r,
        "R": out_r[-1],
    }


def _to_tree(u):
    """Reference rows `(..., 16, patch)` -> the pytree state of `_metapop_vf`."""
    return {
        "S": u[..., 0, :],
        "E": u[..., 1, :],
        "ID": u[..., 2:9, :],
        "D": u[..., 9, :],
        "IR": u[..., 10:15, :],
        "R": u[..., 15, :],
    }


def _to_rows(y):
    y = {k: np.asarray(v) for k, v in y.items()}
    return np.concatenate(
        [
            y["S"][..., None, :],
            y["E"][..., None, :],
            y["ID"],
            y["D"][..., None, :],
            y["IR"],
            y["R"][..., None, :],
        ],
        axis=-2,
    )


def test_metapopulation_agrees_with_scipy_by_half_days(reference_problem):
    sm = reference_problem
    n, T = METAPOP_PATCHES, METAPOP_DAYS
    prob = sm.make_problem(n, T, 0)
    p, u0 = prob["p_true"], prob["u0"]
    mob, cm = prob["mobility"], prob["coupling"]  # (n, 7, T), (n, n, T)
    args, values = _metapop_rates(sm.LAYERS, jnp.asarray(p), mob, cm)
    vf = _metapop_vf

    # The reference's float64 NumPy twin of its vector field (what generated
    # its data), with day `k`'s covariates.
    kappa, alpha, gamma = np.logaddexp(0.0, p[:3])
    eta = -np.log(-np.expm1(-kappa * alpha)) / gamma
    scaler = np.logaddexp(0.0, p[3 : 3 + n])
    beta = sm.numpy_transmission_rate(p[3 + n :], mob)  # (n, day)

    def rhs(day):
        cm_day = scaler[:, None] * cm[..., day]
        rates = sm.Rates(kappa, alpha, gamma, eta, beta[:, day], cm_day)
        return lambda t, x: sm.numpy_vector_field(x.reshape(16, n), rates).ravel()

    # The transcription above is the reference vector field (day 7, a mid state).
    u_mid = prob["sol_true"][7]
    day7 = jtu.tree_map(lambda v: v[7], values)
    np.testing.assert_allclose(
        _to_rows(vf(7.0, _to_tree(jnp.asarray(u_mid)), args, day7)).ravel(),
        rhs(7)(7.0, u_mid.ravel()),
        rtol=1e-12,
        atol=1e-18,
    )

    # epifit: daily covariates with the `nearest` rule, segments of half days.
    inputs = PiecewiseConstant(np.arange(T) - 0.5, values)
    ts = np.arange(T, dtype=np.float64)
    ctrl = PIDController(rtol=RTOL, atol=ATOL)
    sol = P.jit_solve(vf, ts=ts, stepsize_controller=ctrl)(
        _to_tree(jnp.asarray(u0)), args, inputs=inputs
    )
    assert int(sol.result) == Result.SUCCESSFUL
    assert int(sol.stats["num_segments"]) == 2 * (T - 1)
    ys = _to_rows(sol.ys)

    # scipy: DOP853 restarted on every half day, day k held on [k - 1/2, k + 1/2].
    expected = [u0]
    x = u0.ravel()
    for k in range(T - 1):
        for day, (a, b) in ((k, (k, k + 0.5)), (k + 1, (k + 0.5, k + 1))):
            out = solve_ivp(
                rhs(day), (a, b), x, method="DOP853", rtol=P.REF_RTOL, atol=P.REF_ATOL
            )
            assert out.success
            x = out.y[:, -1]
        expected.append(x.reshape(16, n))
    expected = np.stack(expected)

    np.testing.assert_allclose(ys, expected, rtol=GLOBAL * RTOL, atol=GLOBAL * ATOL)
    np.testing.assert_allclose(ys, prob["sol_true"], rtol=0, atol=METAPOP_RK4_ATOL)


# ----------------------------------------------------------- convergence order
T_ORDER = 2.0


def _forced_pendulum(t, y, args, u):
    return {"q": y["p"], "p": -jnp.sin(y["q"]) + 0.3 * jnp.cos(t)}


@pytest.fixture(scope="module")
def pendulum_reference():
    out = solve_ivp(
        lambda t, x: [x[1], -np.sin(x[0]) + 0.3 * np.cos(t)],
        (0.0, T_ORDER),
        [1.0, 0.0],
        method="DOP853",
        rtol=2.3e-14,  # scipy's floor; its error is ~1e-14 here
        atol=1e-16,
    )
    return out.y[:, -1]


# (solver, theoretical order, numbers of steps on [0, T_ORDER]): step sizes in
# the asymptotic range, errors (>= 3e-11) well above the reference's ~1e-14.
# Tsit5's sixth-order terms are relatively large: at 4-8 steps its measured
# order is still ~5.6, so it starts at 16 steps.
ORDER_CASES = [
    (Euler(), 1, (32, 64, 128, 256)),
    (RK4(), 4, (8, 16, 32, 64)),
    (Bosh3(), 3, (8, 16, 32, 64)),
    (Tsit5(), 5, (16, 32, 64)),
    (Dopri5(), 5, (8, 16, 32, 64)),
]
ORDER_SLACK = 0.3


@pytest.mark.parametrize("solver, order, n_steps", ORDER_CASES, ids=_name)
def test_fixed_step_convergence_order(solver, order, n_steps, pendulum_reference):
    y0 = {"q": jnp.asarray(1.0), "p": jnp.asarray(0.0)}

    @jit
    def final_states(y0):
        out = []
        for n in n_steps:
            ctrl = ConstantStepSize(T_ORDER / n)
            sol = solve(
                _forced_pendulum,
                y0,
                ts=[0.0, T_ORDER],
                solver=solver,
                stepsize_controller=ctrl,
            )
            out.append(jnp.stack([sol.ys["q"][-1], sol.ys["p"][-1]]))
        return jnp.stack(out)

    errors = np.linalg.norm(np.asarray(final_states(y0)) - pendulum_reference, axis=1)
    fit = linregress(np.log(T_ORDER / np.asarray(n_steps)), np.log(errors))
    assert abs(fit.slope - order) < ORDER_SLACK, (fit.slope, errors)


# ------------------------------------------------------------------ breakpoints
T_JUMP = 0.37
RATES = (0.8, -1.5)
BREAK_RTOL = 1e-10


def _exact_growth(t, y0=2.0):
    t = np.asarray(t)
    before = y0 * np.exp(RATES[0] * t)
    after = y0 * np.exp(RATES[0] * T_JUMP + RATES[1] * (t - T_JUMP))
    return np.where(t <= T_JUMP, before, after)


def test_input_jump_inside_a_save_interval_is_a_segment_boundary():
    seen = []

    def growth(t, y, args, u):
        jax.debug.callback(lambda t, r: seen.append((float(t), float(r))), t, u["r"])
        return u["r"] * y

    inputs = PiecewiseConstant([0.0, T_JUMP], {"r": jnp.asarray(RATES)})
    ts = [0.0, 0.5, 1.0]
    ctrl = PIDController(rtol=BREAK_RTOL, atol=1e-14)
    sol = solve(
        growth, jnp.asarray(2.0), ts=ts, inputs=inputs, stepsize_controller=ctrl
    )
    jax.effects_barrier()
    np.testing.assert_allclose(sol.ys, _exact_growth(ts), rtol=GLOBAL * BREAK_RTOL)
    # Segments [0, 0.37], [0.37, 0.5], [0.5, 1]: no step crosses the jump, so
    # every evaluation with the first rate is at t <= 0.37 and vice versa.
    assert int(sol.stats["num_segments"]) == 3
    t_seen, r_seen = np.array(seen).T
    assert set(r_seen) == set(RATES)
    assert t_seen[r_seen == RATES[0]].max() <= T_JUMP
    assert t_seen[r_seen == RATES[1]].min() >= T_JUMP


def test_input_before_and_after_the_grid_is_clamped():
    # value k holds on [times[k], times[k+1]); the first also before times[0]
    inputs = PiecewiseConstant([0.5, T_JUMP + 1.0], {"r": jnp.asarray(RATES)})
    sol = solve(
        lambda t, y, args, u: u["r"] * y,
        jnp.asarray(1.0),
        ts=[0.0, 0.5],
        inputs=inputs,
        stepsize_controller=PIDController(rtol=1e-10, atol=1e-14),
    )
    np.testing.assert_allclose(sol.ys[-1], np.exp(0.5 * RATES[0]), rtol=1e-8)


# --------------------------------------------------------------------- failures
# A decay whose rate jumps from 1 to 1e5 at t = 1: explicit steps on [1, 2] are
# limited by stability to ~3e-5.
STIFF_AFTER_1 = PiecewiseConstant([0.0, 1.0], jnp.asarray([1.0, 1e5]))


def _rate_decay(t, y, args, u):
    return -u * y


NAN_AFTER_1 = PiecewiseConstant([0.0, 1.0], jnp.asarray([1.0, jnp.nan]))
SEGMENT_1 = r"segment 1 \[t=1, 2\] at t="


def test_max_steps_raises_naming_segment_time_and_cause():
    with pytest.raises(
        SolverError,
        match=SEGMENT_1 + r"1\.\d+: the maximum number of steps per segment \(200\)",
    ):
        solve(
            _rate_decay,
            jnp.asarray(1.0),
            ts=[0.0, 1.0, 2.0],
            inputs=STIFF_AFTER_1,
            max_steps=200,
        )


def test_fixed_step_max_steps_raises():
    with pytest.raises(SolverError, match=r"segment 0 .*maximum number of steps"):
        solve(
            _decay,
            jnp.asarray(1.0),
            1.0,
            ts=[0.0, 1.0],
            solver=RK4(),
            stepsize_controller=ConstantStepSize(0.01),
            max_steps=50,
        )


def test_dtmin_raises_naming_segment_time_and_cause():
    ctrl = PIDController(rtol=1e-6, atol=1e-9, dtmin=1e-3)
    with pytest.raises(
        SolverError, match=SEGMENT_1 + r"1\S*: the step size fell below its minimum"
    ):
        solve(
            _rate_decay,
            jnp.asarray(1.0),
            ts=[0.0, 1.0, 2.0],
            inputs=STIFF_AFTER_1,
            stepsize_controller=ctrl,
        )


def test_nonfinite_state_raises_naming_segment_time_and_cause():
    with pytest.raises(
        SolverError, match=SEGMENT_1 + r"1: the state became non-finite"
    ):
        solve(_rate_decay, jnp.asarray(1.0), ts=[0.0, 1.0, 2.0], inputs=NAN_AFTER_1)


def test_throw_false_reports_the_failure_and_nans_after_it():
    ts = [0.0, 0.5, 1.0, 2.0, 3.0]
    ctrl = PIDController(rtol=RTOL, atol=ATOL)
    sol = solve(
        _rate_decay,
        jnp.asarray(1.0),
        ts=ts,
        inputs=NAN_AFTER_1,
        stepsize_controller=ctrl,
        throw=False,
    )
    assert int(sol.result) == Result.NONFINITE_STATE
    assert int(sol.failed_segment) == 2  # segments [0, .5], [.5, 1], [1, 2], ...
    assert float(sol.failed_t) == 1.0
    np.testing.assert_allclose(
        sol.ys[:3], np.exp(-np.asarray(ts[:3])), rtol=GLOBAL * RTOL
    )
    assert np.all(np.isnan(sol.ys[3:]))


def test_failure_under_jit_raises_at_run_time():
    @jax.jit
    def run(y0):
        return solve(
            _rate_decay, y0, ts=[0.0, 1.0, 2.0], inputs=STIFF_AFTER_1, max_steps=200
        ).ys

    # The SolverError is raised inside a callback; the runtime re-raises it as
    # a JaxRuntimeError carrying the message.
    with pytest.raises((SolverError, jax.errors.JaxRuntimeError)) as info:
        jax.block_until_ready(run(jnp.asarray(1.0)))
    message = str(info.value)
    assert "ODE solve failed in segment 1 [t=1, 2]" in message
    assert "maximum number of steps per segment (200)" in message


def test_failure_check_adds_no_effect_and_raises_under_vmap():
    """The run-time failure check is a callback tied to the saved states,
    not an effect (an effect sends every call of the compiled program through
    JAX's Python dispatch); under `vmap` a failed lane raises too."""

    def run(y0):
        return solve(
            _rate_decay, y0, ts=[0.0, 1.0, 2.0], inputs=STIFF_AFTER_1, max_steps=200
        ).ys

    assert not jax.make_jaxpr(run)(jnp.asarray(1.0)).effects
    with pytest.raises((SolverError, jax.errors.JaxRuntimeError)) as info:
        jax.block_until_ready(jax.jit(jax.vmap(run))(jnp.asarray([1.0, 2.0])))
    assert "ODE solve failed in segment 1 [t=1, 2]" in str(info.value)
    # the states' tangents pass through the check
    ok = jax.jit(jax.grad(lambda y0: solve(_decay, y0, 0.5, ts=[0.0, 1.0]).ys[-1]))
    np.testing.assert_allclose(ok(jnp.asarray(1.0)), np.exp(-0.5), rtol=1e-5)


def test_jit_without_failure_returns_normally():
    run = jax.jit(lambda y0: solve(_decay, y0, 0.5, ts=[0.0, 1.0]).ys)
    np.testing.assert_allclose(run(jnp.asarray(1.0))[-1], np.exp(-0.5), rtol=1e-5)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(ts=[0.0, 2.0, 1.0]), ValueError, "strictly increasing"),
        (dict(ts=[0.0, 1.0, 1.0]), ValueError, "strictly increasing"),
        (dict(ts=[1.0]), ValueError, "at least 2 times"),
        (dict(ts=[[0.0, 1.0]]), ValueError, "1-D"),
        (
            dict(solver=RK4()),
            ValueError,
            r"PIDController needs an adaptive solver such as Tsit5\(\); got RK4\(\)"
            r".*ConstantStepSize",
        ),
        (dict(solver="tsit5"), TypeError, "solver must be an epifit.ode solver"),
        (dict(stepsize_controller=0.1), TypeError, "PIDController or a ConstantStep"),
        (dict(adjoint="checkpoint"), TypeError, "adjoint must be"),
        (dict(inputs=jnp.ones(3)), TypeError, "inputs must be a PiecewiseConstant"),
        (dict(max_steps=0), ValueError, "max_steps must be >= 1"),
    ],
)
def test_bad_arguments_raise_helpful_errors(kwargs, error, match):
    kwargs = {"ts": [0.0, 1.0], **kwargs}
    with pytest.raises(error, match=match):
        solve(_decay, jnp.asarray(1.0), 1.0, **kwargs)


def test_traced_ts_raise_a_type_error():
    with pytest.raises(TypeError, match="ts must be concrete"):
        jax.jit(lambda ts: solve(_decay, jnp.asarray(1.0), 1.0, ts=ts))(
            jnp.array([0.0, 1.0])
        )


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: PIDController(rtol=-1.0), "rtol >= 0"),
        (lambda: PIDController(factormin=2.0), "factormin < 1 < factormax"),
        (lambda: PIDController(dtmin=1.0, dtmax=0.5), "dtmin < dtmax"),
        (lambda: ConstantStepSize(0.0), "dt0 > 0"),
        (lambda: PiecewiseConstant([0.0, 1.0], jnp.ones(3)), "leading axis"),
        (lambda: PiecewiseConstant([1.0, 0.0], jnp.ones(2)), "strictly increasing"),
    ],
)
def test_bad_configuration_raises_at_construction(make, match):
    with pytest.raises(ValueError, match=match):
        make()


# ------------------------------------------------------------------------ stats
def test_tsit5_counts_match_a_python_counter():
    calls = []

    def counted(t, y, args, u):
        jax.debug.callback(lambda: calls.append(1))
        return P.sir(t, y, args, u)

    ts = [0.0, 1.0, 5.0, 20.0]
    ctrl = PIDController(rtol=1e-6, atol=1e-9)
    sol = P.jit_solve(counted, ts=ts, stepsize_controller=ctrl)(
        P.sir_y0(), P.sir_args()
    )
    jax.effects_barrier()
    st = {k: int(v) for k, v in sol.stats.items()}
    steps = st["num_accepted_steps"] + st["num_rejected_steps"]
    assert st["num_segments"] == 3
    assert st["num_rhs_evals"] == len(calls)
    # Six new stages per step (first same as last) and one evaluation to
    # start; a boundary that is only a save time hands the last stage on, so
    # nothing restarts there. The first step size is chosen from the first
    # evaluation, at no extra cost.
    assert st["num_rhs_evals"] == 6 * steps + 1


def test_tsit5_restarts_where_the_inputs_change():
    calls = []

    def counted(t, y, args, u):
        jax.debug.callback(lambda: calls.append(1))
        return -u * y

    # Segments [0, 1], [1, 3], [3, 5], [5, 20]; the input changes at 3 only.
    inputs = PiecewiseConstant([0.0, 3.0], jnp.array([0.5, 0.2]))
    ctrl = PIDController(rtol=1e-6, atol=1e-9)
    sol = jax.jit(
        lambda y0: solve(
            counted,
            y0,
            ts=[0.0, 1.0, 5.0, 20.0],
            inputs=inputs,
            stepsize_controller=ctrl,
        )
    )(jnp.array([1.0, 2.0]))
    jax.effects_barrier()
    st = {k: int(v) for k, v in sol.stats.items()}
    steps = st["num_accepted_steps"] + st["num_rejected_steps"]
    assert st["num_segments"] == 4
    assert st["num_rhs_evals"] == len(calls) == 6 * steps + 2
    # Handing the stage on changes no value: the exact solution, piecewise.
    expected = jnp.exp(-0.5 * 3.0 - 0.2 * (20.0 - 3.0)) * jnp.array([1.0, 2.0])
    np.testing.assert_allclose(sol.ys[-1], expected, rtol=1e-4)
    np.testing.assert_allclose(
        sol.ys[1], jnp.exp(-0.5) * jnp.array([1.0, 2.0]), rtol=1e-5
    )


def test_fixed_step_counts():
    ts = [0.0, 0.3, 1.0]  # segments of 3 and 7 steps of at most 0.1
    sol = solve(
        _decay,
        jnp.asarray(1.0),
        1.0,
        ts=ts,
        solver=RK4(),
        stepsize_controller=ConstantStepSize(0.1),
    )
    st = {k: int(v) for k, v in sol.stats.items()}
    assert st["num_accepted_steps"] == 10
    assert st["num_rejected_steps"] == 0
    assert st["num_rhs_evals"] == 4 * 10
    np.testing.assert_allclose(sol.ys, np.exp(-np.asarray(ts)), rtol=1e-6)


# -------------------------------------------------------------------- gradients
GRAD_RTOL, GRAD_ATOL = 1e-12, 1e-14  # solver tolerances for finite differences
FD_STEP = 1e-4  # relative; truncation ~ FD_STEP**2, step-selection noise
# ~ GRAD_RTOL / FD_STEP: both ~1e-8
FD_AGREEMENT = 1e-6


def _central_difference(fn, x, direction, h):
    return (fn(x + h * direction) - fn(x - h * direction)) / (2 * h)


def _value_and_grad(loss):
    """One compiled function for both the gradient and the finite differences
    (compilation, not evaluation, is what these tests spend their time on)."""
    vg = jit(jax.value_and_grad(loss))
    return (lambda x: vg(x)[0]), (lambda x: np.asarray(vg(x)[1]))


def _sir_loss(ys):
    return jnp.sum(ys["I"] ** 2) + jnp.sum(ys["R"])


def test_gradient_matches_finite_differences_on_sir():
    ctrl = PIDController(rtol=GRAD_RTOL, atol=GRAD_ATOL)
    ts = np.linspace(0.0, 30.0, 7)

    def loss(theta):  # theta = (beta, gamma, S0, I0)
        args = {"beta": theta[0], "gamma": theta[1]}
        y0 = {"S": theta[2], "I": theta[3], "R": jnp.zeros_like(theta[0])}
        return _sir_loss(solve(P.sir, y0, args, ts=ts, stepsize_controller=ctrl).ys)

    loss, grad_fn = _value_and_grad(loss)
    theta = jnp.array([0.5, 0.2, 0.99, 0.01])
    grad = grad_fn(theta)
    fd = [
        _central_difference(loss, theta, jnp.eye(4)[i], FD_STEP * float(theta[i]))
        for i in range(4)
    ]
    np.testing.assert_allclose(grad, np.asarray(fd), rtol=FD_AGREEMENT)


def _rk4_unrolled(vf, y0, args, dt, n_steps):
    """Classical RK4 as a plain Python loop over pytrees (no epifit code)."""

    def axpy(y, h, k):
        return jtu.tree_map(lambda a, b: a + h * b, y, k)

    ys, y, t = [y0], y0, 0.0
    for _ in range(n_steps):
        k1 = vf(t, y, args, None)
        k2 = vf(t + dt / 2, axpy(y, dt / 2, k1), args, None)
        k3 = vf(t + dt / 2, axpy(y, dt / 2, k2), args, None)
        k4 = vf(t + dt, axpy(y, dt, k3), args, None)
        incr = jtu.tree_map(
            lambda a, b, c, d: (a + 2 * b + 2 * c + d) / 6, k1, k2, k3, k4
        )
        y = axpy(y, dt, incr)
        t += dt
        ys.append(y)
    return ys


# Same arithmetic up to the order of floating-point operations.
UNROLLED_AGREEMENT = 1e-10


def test_gradient_matches_an_unrolled_rk4_reference():
    dt, per_save, n_save = 0.5, 2, 4
    ts = np.arange(n_save + 1, dtype=np.float64)

    def epifit_loss(args, y0):
        sol = solve(
            P.sir,
            y0,
            args,
            ts=ts,
            solver=RK4(),
            stepsize_controller=ConstantStepSize(dt),
        )
        return _sir_loss(sol.ys)

    def unrolled_loss(args, y0):
        ys = _rk4_unrolled(P.sir, y0, args, dt, n_save * per_save)[::per_save]
        return _sir_loss(jtu.tree_map(lambda *v: jnp.stack(v), *ys))

    args, y0 = P.sir_args(), P.sir_y0()
    value, got = jit(jax.value_and_grad(epifit_loss, argnums=(0, 1)))(args, y0)
    # the reference runs op by op: compiling its unrolled graph costs more
    value_ref, want = jax.value_and_grad(unrolled_loss, argnums=(0, 1))(args, y0)
    np.testing.assert_allclose(value, value_ref, rtol=UNROLLED_AGREEMENT)
    for g, w in zip(jtu.tree_leaves(got), jtu.tree_leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=UNROLLED_AGREEMENT, atol=1e-14)


def test_gradient_with_respect_to_input_values_matches_finite_differences():
    # a daily transmission rate under the `floor` rule: day k holds on [k, k+1)
    days = 6
    ts = np.arange(days + 1, dtype=np.float64)
    ctrl = PIDController(rtol=GRAD_RTOL, atol=GRAD_ATOL)

    def sir_u(t, y, args, u):
        return P.sir(t, y, {"beta": u["beta"], "gamma": args}, u)

    def loss(beta_daily):
        inputs = PiecewiseConstant(ts[:-1], {"beta": beta_daily})
        y0 = {"S": jnp.asarray(0.9), "I": jnp.asarray(0.1), "R": jnp.asarray(0.0)}
        sol = solve(
            sir_u, y0, jnp.asarray(0.2), ts=ts, inputs=inputs, stepsize_controller=ctrl
        )
        return _sir_loss(sol.ys)

    loss, grad_fn = _value_and_grad(loss)
    beta = jnp.linspace(0.4, 0.7, days)
    grad = grad_fn(beta)
    fd = [
        _central_difference(loss, beta, jnp.eye(days)[k], FD_STEP * float(beta[k]))
        for k in range(days)
    ]
    np.testing.assert_allclose(grad, np.asarray(fd), rtol=FD_AGREEMENT)
    # later days act on fewer saved states: the gradient is not uniform
    assert np.ptp(grad) > 1e-3 * np.abs(grad).max()


def test_pytree_parameters_with_an_mlp_differentiate():
    key = jr.key(0)
    net = eqx.nn.MLP(1, 1, 4, 1, activation=jax.nn.relu, key=key)
    net = jtu.tree_map(lambda x: x.astype(jnp.float64) if eqx.is_array(x) else x, net)
    # not weakly typed: the perturbed copies below must hit the same compilation
    args = {"gamma": jnp.asarray(0.2, jnp.float64), "net": net}
    ctrl = PIDController(rtol=GRAD_RTOL, atol=GRAD_ATOL)
    ts = np.linspace(0.0, 10.0, 6)

    def vf(t, y, args, u):
        beta = 0.5 + 0.1 * args["net"](jnp.stack([t / 10.0]))[0]
        infection = beta * y[0] * y[1]
        return jnp.stack([-infection, infection - args["gamma"] * y[1]])

    def loss(args):
        sol = solve(vf, jnp.array([0.99, 0.01]), args, ts=ts, stepsize_controller=ctrl)
        return jnp.sum(sol.ys[:, 1] ** 2)

    # what eqx.filter_jit(eqx.filter_value_and_grad(loss)) does, with epifit.jit
    params, static = eqx.partition(args, eqx.is_inexact_array)
    value_and_grad = jit(jax.value_and_grad(lambda p: loss(eqx.combine(p, static))))
    _, grad = value_and_grad(params)
    # the directional derivative along a random direction in parameter space
    rng = np.random.default_rng(1)
    direction = jtu.tree_map(lambda x: rng.standard_normal(x.shape), params)

    def along(h):
        moved = jtu.tree_map(lambda p, d: p + h * d, params, direction)
        return value_and_grad(moved)[0]

    h = FD_STEP
    fd = (along(h) - along(-h)) / (2 * h)
    g_leaves = jtu.tree_leaves(eqx.filter(grad, eqx.is_inexact_array))
    d_leaves = jtu.tree_leaves(direction)
    dot = sum(jnp.vdot(g, d) for g, d in zip(g_leaves, d_leaves, strict=True))
    assert all(np.all(np.isfinite(g)) for g in g_leaves)
    np.testing.assert_allclose(dot, fd, rtol=FD_AGREEMENT)
