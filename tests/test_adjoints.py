"""Every adjoint's gradient against answers epifit did not compute.

References: central finite differences of the loss, diffrax's gradients
(RecursiveCheckpointAdjoint at tight tolerance, steps stopped at the input
jumps), forward-mode sensitivities, and the memory plan of the compiled
checkpoint gradient.
"""

from __future__ import annotations

import functools

import diffrax
import helpers
import jax
import jax.extend.core
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest
from adjoint_cases import ADJOINTS, CTRL, GRAD_RTOL
from adjoint_cases import finite_differences as _fd
from adjoint_cases import rel_error as _rel

from epifit.ode import (
    BacksolveAdjoint,
    CheckpointAdjoint,
    ConstantStepSize,
    ForwardAdjoint,
    InterpolatingAdjoint,
    PIDController,
    PiecewiseConstant,
    SolverError,
    Tsit5,
    forward_gradient,
    jacobian,
    solve,
)


# ---------------------------------------------------------------------------- SIR
def _sir(t, y, args, u):
    beta = args["beta"] if u is None else args["beta"] * u
    inf = beta * y["S"] * y["I"]
    return {"S": -inf, "I": inf - args["gamma"] * y["I"], "R": args["gamma"] * y["I"]}


SIR_TS = np.arange(0.0, 31.0)
SIR_INPUT_TIMES = np.arange(31.0) - 0.5
SIR_U = jnp.asarray(1.0 - 0.4 / (1.0 + np.exp(-(np.arange(31.0) - 12.0) / 2.0)))
SIR_Y0 = {"S": jnp.array(0.99), "I": jnp.array(0.01), "R": jnp.array(0.0)}


def _sir_solve(x, adjoint=None, u=SIR_U, ctrl=CTRL, y0=SIR_Y0, max_steps=4096):
    return solve(
        _sir,
        y0,
        {"beta": x[0], "gamma": x[1]},
        ts=SIR_TS,
        inputs=PiecewiseConstant(SIR_INPUT_TIMES, u),
        adjoint=adjoint,
        stepsize_controller=ctrl,
        max_steps=max_steps,
    )


def _sir_loss(x, adjoint, u=SIR_U, ctrl=CTRL, y0=SIR_Y0, max_steps=4096):
    sol = _sir_solve(x, adjoint, u, ctrl, y0, max_steps)
    return jnp.sum(sol.ys["I"] ** 2) + 0.1 * jnp.sum(sol.ys["R"])


X_SIR = jnp.array([0.6, 0.2])


@pytest.fixture(scope="module")
def sir_loss_of_x_and_u():
    """The SIR loss as a function of the parameters and of the inputs, compiled
    once for the finite differences of every adjoint's test."""
    return jax.jit(lambda x, u: _sir_loss(x, CheckpointAdjoint(), u))


@pytest.mark.parametrize("name", list(ADJOINTS))
def test_sir_gradient_matches_finite_differences(name, sir_loss_of_x_and_u):
    g = jax.jit(jax.grad(lambda x: _sir_loss(x, ADJOINTS[name])))(X_SIR)
    fd = _fd(lambda x: sir_loss_of_x_and_u(x, SIR_U), X_SIR)
    assert _rel(g, fd) < GRAD_RTOL


@pytest.mark.parametrize("name", list(ADJOINTS))
def test_sir_input_gradient_matches_finite_differences(name, sir_loss_of_x_and_u):
    """Cotangents of differentiated inputs are scattered to the right days."""
    g = jax.jit(jax.grad(lambda u: _sir_loss(X_SIR, ADJOINTS[name], u)))(SIR_U)
    for day in (0, 5, 12, 30):
        e = np.zeros(SIR_U.shape)
        e[day] = 1e-6
        f = sir_loss_of_x_and_u
        fd = (float(f(X_SIR, SIR_U + e)) - float(f(X_SIR, SIR_U - e))) / 2e-6
        assert abs(float(g[day]) - fd) <= GRAD_RTOL * max(abs(fd), 1e-3)


def test_sir_gradient_matches_diffrax():
    """diffrax at tight tolerance, stepping to the input jumps (jump_ts), its
    derivative in forward mode (`ForwardMode`, `jacfwd`: the same discrete
    solution's derivative as its default reverse mode, at half the compile)."""

    def loss(x):
        def f(t, y, args):
            day = jnp.clip(jnp.floor(t + 0.5).astype(int), 0, 30)
            return _sir(t, y, args, SIR_U[day])

        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(f),
            diffrax.Tsit5(),
            0.0,
            30.0,
            None,
            SIR_Y0,
            args={"beta": x[0], "gamma": x[1]},
            saveat=diffrax.SaveAt(ts=jnp.asarray(SIR_TS)),
            stepsize_controller=diffrax.PIDController(
                rtol=1e-11, atol=1e-13, jump_ts=jnp.asarray(SIR_INPUT_TIMES[1:])
            ),
            max_steps=100_000,
            adjoint=diffrax.ForwardMode(),
        )
        return jnp.sum(sol.ys["I"] ** 2) + 0.1 * jnp.sum(sol.ys["R"])

    g_ref = jax.jit(jax.jacfwd(loss))(X_SIR)
    g = jax.jit(jax.grad(lambda x: _sir_loss(x, CheckpointAdjoint())))(X_SIR)
    assert _rel(g, g_ref) < GRAD_RTOL


def test_forward_and_reverse_agree():
    """The forward-mode Jacobian of the trajectory contracts to the reverse gradient."""

    def traj(x):
        sol = solve(
            _sir,
            SIR_Y0,
            {"beta": x[0], "gamma": x[1]},
            ts=SIR_TS,
            inputs=PiecewiseConstant(SIR_INPUT_TIMES, SIR_U),
            stepsize_controller=CTRL,
        )
        return sol.ys["I"]

    J = jacobian(traj)(X_SIR)  # (time, 2)
    ct = jnp.linspace(0.5, 1.5, SIR_TS.size)
    g_rev = jax.grad(lambda x: jnp.vdot(ct, traj(x)))(X_SIR)
    np.testing.assert_allclose(ct @ J, g_rev, rtol=1e-9)


def _loss_xu(x, u):
    return _sir_loss(x, CheckpointAdjoint(), u)


def test_forward_gradient_is_the_gradient_with_no_backward_pass(monkeypatch):
    """`forward_gradient(f)`: `f`'s value, its gradient (and Hessian, vmap)
    from one batched forward-mode solve: the checkpoint adjoint's backward
    pass is never traced. Where the second argument is differentiated too,
    the derivative is `f`'s own (the adjoint's pull-back)."""
    traced = helpers.backward_traces(monkeypatch)
    f = forward_gradient(_loss_xu)
    np.testing.assert_allclose(f(X_SIR, SIR_U), _loss_xu(X_SIR, SIR_U), rtol=1e-14)
    value, g = jax.jit(jax.value_and_grad(f))(X_SIR, SIR_U)
    assert not traced
    # the references compiled (each a program of its own, not hundreds of
    # eager operations); the first value above is `f`'s eager call
    grad_ref = jax.jit(jax.grad(_loss_xu))
    g_ref = grad_ref(X_SIR, SIR_U)
    assert traced  # the reference went through the adjoint
    np.testing.assert_allclose(value, _loss_xu(X_SIR, SIR_U), rtol=1e-14)
    # forward mode also differentiates the step-size control: 3e-10, measured
    np.testing.assert_allclose(g, g_ref, rtol=1e-8)
    xs = jnp.stack([X_SIR, 1.1 * X_SIR])
    gs = jax.jit(jax.vmap(jax.grad(f), (0, None)))(xs, SIR_U)
    np.testing.assert_allclose(gs[1], grad_ref(xs[1], SIR_U), rtol=1e-8)
    hessians = [jax.jit(jax.hessian(h))(X_SIR, SIR_U) for h in (f, _loss_xu)]
    np.testing.assert_allclose(*hessians, rtol=1e-8)
    gx, gu = jax.jit(jax.grad(f, argnums=(0, 1)))(X_SIR, SIR_U)
    gx_ref, gu_ref = jax.jit(jax.grad(_loss_xu, argnums=(0, 1)))(X_SIR, SIR_U)
    np.testing.assert_allclose(gx, gx_ref, rtol=1e-12)
    np.testing.assert_allclose(gu, gu_ref, rtol=1e-12)
    assert float(jnp.max(jnp.abs(gu))) > 0


CHECKPOINT_VARIANTS = {
    "default": CheckpointAdjoint(),
    "keep_first": CheckpointAdjoint(keep_first=True),
    "loop": CheckpointAdjoint(unroll_first=False),
    "buffer1": CheckpointAdjoint(buffer=1),
}


@functools.cache
def _unrolled_tsit5(dt):
    """`(loss, gradient)` at `X_SIR` of jax.grad through an unrolled loop of
    fixed Tsit5 steps of size `dt`, computed once for all the checkpoint
    variants. The loop runs eagerly (compiling the unrolled gradient takes
    minutes) over one jitted step, whose forward and pull-back programs are
    compiled once each rather than as hundreds of eager operations."""
    step = jax.jit(functools.partial(Tsit5().fresh_step, _sir))

    def unrolled(x):
        args = {"beta": x[0], "gamma": x[1]}
        y, out = SIR_Y0, []
        for k in range(10):
            out.append(y["I"])
            # day k holds on [k - 1/2, k + 1/2): two half-day segments per day
            for t0 in np.arange(k, k + 1, dt):
                day = int(np.floor(t0 + 0.5))
                u = SIR_U[day]
                y = step(t0, t0 + dt, y, args, u)
        out.append(y["I"])
        return jnp.sum(jnp.stack(out) ** 2)

    value, grad = jax.value_and_grad(unrolled)(X_SIR)
    return np.asarray(value), np.asarray(grad)


@pytest.mark.parametrize("variant", sorted(CHECKPOINT_VARIANTS))
@pytest.mark.parametrize("dt", [0.25, 0.5])
def test_checkpoint_is_the_exact_gradient_of_the_discrete_solution(dt, variant):
    """With fixed steps, the checkpoint adjoint equals jax.grad through an unrolled
    loop of the same Tsit5 steps, to rounding: half-day segments of one step
    (dt 0.5, pulled back without a replay loop) and of two (dt 0.25, replayed)."""
    adjoint = CHECKPOINT_VARIANTS[variant]

    def epifit_loss(x):
        sol = solve(
            _sir,
            SIR_Y0,
            {"beta": x[0], "gamma": x[1]},
            ts=np.arange(11.0),
            inputs=PiecewiseConstant(SIR_INPUT_TIMES, SIR_U),
            stepsize_controller=ConstantStepSize(dt),
            adjoint=adjoint,
        )
        return jnp.sum(sol.ys["I"] ** 2)

    value, grad = _unrolled_tsit5(dt)
    np.testing.assert_allclose(epifit_loss(X_SIR), value, rtol=1e-13)
    g = jax.grad(epifit_loss)(X_SIR)
    np.testing.assert_allclose(g, grad, rtol=1e-10)


def test_checkpoint_variants_agree_on_an_adaptive_solve():
    """Kept, recomputed-unrolled and looped pull-backs of one-step segments,
    and replays of longer ones with any buffer, are the same discrete
    gradient: they agree to rounding. At rtol 1e-4 the daily segments mix
    one-step and several-step ones (checked from the solve's statistics)."""
    ctrl = PIDController(rtol=1e-4, atol=1e-8)
    sol = _sir_solve(X_SIR, ctrl=ctrl)
    n_seg = 2 * (SIR_TS.size - 1)  # save times and input jumps interleave
    assert n_seg < int(sol.stats["num_accepted_steps"]) < 2 * n_seg
    grads = {
        k: jax.jit(jax.grad(lambda x, a=a: _sir_loss(x, a, ctrl=ctrl)))(X_SIR)
        for k, a in CHECKPOINT_VARIANTS.items()
    }
    for k, g in grads.items():
        np.testing.assert_allclose(g, grads["keep_first"], rtol=1e-12, err_msg=k)


def test_float32_gradients_are_close_to_float64():
    x32 = X_SIR.astype(jnp.float32)
    y0 = jtu.tree_map(lambda v: v.astype(jnp.float32), SIR_Y0)
    ctrl = PIDController(rtol=1e-5, atol=1e-7)

    def loss(x, adjoint):
        return _sir_loss(x, adjoint, SIR_U.astype(jnp.float32), ctrl, y0)

    g64 = jax.grad(lambda x: _sir_loss(x, CheckpointAdjoint()))(X_SIR)
    for name in ("checkpoint", "backsolve", "interpolating", "quadrature"):
        g = jax.jit(jax.grad(lambda x, a=ADJOINTS[name]: loss(x, a)))(x32)
        assert g.dtype == jnp.float32
        # float32 solves at rtol 1e-5: agreement to ~1e-3 is what the precision allows
        assert _rel(np.asarray(g, np.float64), g64) < 2e-3, name


def test_checkpoint_memory_is_bounded_by_the_buffer_not_the_steps():
    """The compiled gradient's temporary memory grows with the replay buffer
    (`buffer` kept steps) and not with `max_steps`: 4000 more allowed steps
    per segment cost only their step times (a few scalars each), where a
    store of every step's state would cost 4000 states. A kept step is its
    start state (the unrolled pull-back recomputes its stages); with
    `unroll_first=False` the stage loop keeps Tsit5's six stage states."""
    n = 500  # patches: the state is 3 x 500 float64, 12 kB
    y0 = jtu.tree_map(lambda v: jnp.full((n,), v), SIR_Y0)
    state_bytes = 3 * n * 8

    def temp_bytes(max_steps, buffer, unroll_first=True):
        def loss(x):
            sol = solve(
                _sir,
                y0,
                {"beta": x[0], "gamma": x[1]},
                ts=[0.0, 10.0],
                stepsize_controller=ConstantStepSize(0.025),
                adjoint=CheckpointAdjoint(buffer=buffer, unroll_first=unroll_first),
                max_steps=max_steps,
            )
            return jnp.sum(sol.ys["I"][-1])

        compiled = jax.jit(jax.grad(loss)).lower(X_SIR).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    base = temp_bytes(1000, 16)
    more_steps = temp_bytes(5000, 16)
    bigger_buffer = temp_bytes(1000, 64)
    assert 0 <= more_steps - base <= 4000 * 8 * 4
    # 48 more kept steps: 48 states (measured: exactly), not 48 stage stacks
    assert 48 * state_bytes <= bigger_buffer - base <= 48 * 1.5 * state_bytes
    assert base < 16 * 3 * state_bytes
    looped = temp_bytes(1000, 64, False) - temp_bytes(1000, 16, False)
    assert looped >= 48 * 6 * state_bytes


def _sir_grad(adjoint, *, throw=True, max_steps=4096, rtol=1e-6):
    """The gradient of an SIR loss over one 30-day segment (no inputs)."""

    def loss(x):
        sol = solve(
            _sir,
            SIR_Y0,
            {"beta": x[0], "gamma": x[1]},
            ts=[0.0, 30.0],
            stepsize_controller=PIDController(rtol=rtol, atol=1e-9),
            adjoint=adjoint,
            max_steps=max_steps,
            throw=throw,
        )
        return sol.ys["I"][-1]

    return jax.block_until_ready(jax.jit(jax.grad(loss))(X_SIR))


def test_forward_sensitivities_in_one_pass_equal_the_chunked_ones():
    """`ForwardAdjoint` with at most `chunk` directions solves the primal and
    the tangents in its forward pass; with more, its backward pass solves
    them chunk by chunk: the same gradient, and the checkpoint adjoint's to
    the solver's tolerance (forward mode also differentiates the step-size
    control)."""
    one_pass = _sir_grad(ForwardAdjoint())  # 2 directions, chunk 16
    chunked = _sir_grad(ForwardAdjoint(chunk=1))
    np.testing.assert_allclose(one_pass, chunked, rtol=1e-12, atol=0)
    np.testing.assert_allclose(one_pass, _sir_grad(CheckpointAdjoint()), rtol=1e-5)


def test_a_backward_pass_failure_names_the_adjoint_segment_and_cause():
    """The forward solve succeeds; the backward pass cannot (its replay takes
    more steps than the interpolation buffer holds, or its own controller needs
    more steps than allowed). It raises at run time, naming the adjoint, the
    segment and the cause, instead of returning a NaN gradient."""
    with pytest.raises((SolverError, jax.errors.JaxRuntimeError)) as info:
        _sir_grad(InterpolatingAdjoint(buffer=4))
    message = str(info.value)
    assert "backward pass of InterpolatingAdjoint over segment 0 [t=0, 30]" in message
    assert "more than buffer=4 steps" in message

    strict = PIDController(rtol=1e-12, atol=1e-14)
    forward = _sir_grad(BacksolveAdjoint(), max_steps=60)  # the forward fits
    assert np.all(np.isfinite(forward))
    with pytest.raises((SolverError, jax.errors.JaxRuntimeError)) as info:
        _sir_grad(BacksolveAdjoint(stepsize_controller=strict), max_steps=60)
    message = str(info.value)
    assert "backward pass of BacksolveAdjoint over segment 0 [t=0, 30]" in message
    assert "maximum number of steps per segment (60)" in message


def test_a_backward_pass_failure_gives_nan_with_throw_false():
    g = _sir_grad(InterpolatingAdjoint(buffer=4), throw=False)
    assert np.all(np.isnan(g))
    # the same solve with room for its replay: the NaN came from the failure
    ok = _sir_grad(InterpolatingAdjoint(buffer=64), throw=False)
    assert np.all(np.isfinite(ok)) and np.all(ok != 0)


# ----------------------------------------------------- a failed forward solve
def _stiffening(t, y, args, u):
    """Decay whose rate jumps 10^5-fold at t = 2: there an explicit solver
    needs far more than `max_steps`."""
    return -args * u * y


def _stiffening_solve(x, ts, adjoint=None, calls=None):
    def vf(t, y, args, u):
        if calls is not None:
            jax.debug.callback(lambda: calls.append(1))
        return _stiffening(t, y, args, u)

    return solve(
        vf,
        jnp.array([1.0, 2.0]),
        x,
        ts=ts,
        inputs=PiecewiseConstant([0.0, 2.0], jnp.array([1.0, 1e5])),
        stepsize_controller=PIDController(rtol=1e-8, atol=1e-10),
        adjoint=adjoint,
        max_steps=300,
        throw=False,
    )


def _counted_gradient(adjoint, ts, used, x):
    """`(loss, gradient, forward evaluations, all evaluations)` of
    `sum(ys[used] ** 2)`; the evaluations are counted by a callback."""
    calls = []

    def loss(x):
        sol = _stiffening_solve(x, ts, adjoint, calls)
        return jnp.sum(sol.ys[used] ** 2), (sol.result, sol.stats["num_rhs_evals"])

    fn = jax.jit(jax.value_and_grad(loss, has_aux=True))
    jax.block_until_ready(fn(x))
    jax.effects_barrier()
    calls.clear()
    (val, (result, n_forward)), g = jax.block_until_ready(fn(x))
    jax.effects_barrier()
    return float(val), float(g), int(result), int(n_forward), len(calls)


@pytest.mark.parametrize(
    "name", [n for n in ADJOINTS if not isinstance(ADJOINTS[n], ForwardAdjoint)]
)
def test_a_failed_forward_solve_is_not_pulled_back(name):
    """The forward solve stops at `max_steps` in its third segment, [2, 3].
    Those steps are not replayed: the gradient evaluates the vector field for
    the pull-back of the first two segments only, as the same solve stopped
    at t = 2 does. A loss of the states before the failure has that solve's
    gradient; a loss of a failed state has a NaN gradient, like the loss.
    (Before, the checkpoint adjoint replayed the failed segment's steps in
    chunks of its buffer: seconds for a solve of milliseconds.)"""
    adjoint, x = ADJOINTS[name], jnp.asarray(0.7)
    ts = [0.0, 1.0, 2.0, 3.0, 4.0]
    val, g, result, n_forward, n_all = _counted_gradient(adjoint, ts, slice(0, 3), x)
    ok_val, ok_g, ok_result, ok_forward, ok_all = _counted_gradient(
        adjoint, ts[:3], slice(0, 3), x
    )
    assert result != 0 and ok_result == 0
    assert n_forward > 300  # the failed segment's attempted steps
    np.testing.assert_allclose(val, ok_val, rtol=1e-14)
    np.testing.assert_allclose(g, ok_g, rtol=1e-12)
    assert np.isfinite(g) and g != 0.0
    assert n_all - n_forward == ok_all - ok_forward > 0

    val, g, *_ = _counted_gradient(adjoint, ts, 3, x)
    assert np.isnan(val) and np.isnan(g)


@pytest.mark.parametrize("name", ["interpolating", "quadrature"])
def test_dense_buffer_larger_than_max_steps(name):
    """A `buffer` (default 64) above `max_steps` is cut to what the forward
    pass can take; it used to fail at trace time on mismatched shapes."""

    def loss(x, adjoint):
        return _sir_loss(x, adjoint, max_steps=12)

    adjoint = ADJOINTS[name]
    assert adjoint.buffer > 12
    g = jax.jit(jax.grad(lambda x: loss(x, adjoint)))(X_SIR)
    ref = jax.jit(jax.grad(lambda x: loss(x, CheckpointAdjoint())))(X_SIR)
    assert _rel(g, ref) < GRAD_RTOL
