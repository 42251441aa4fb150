"""Save times interpolated by the solver's dense output
(`solve(..., interpolate_saves=True)`): the grid, the interpolants, the
saved states against tight solves, and the checkpoint adjoint's gradient
against `jax.grad` through the same steps written out."""

from __future__ import annotations

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import epifit.model as em
from epifit.ode import (
    BacksolveAdjoint,
    Bosh3,
    CheckpointAdjoint,
    ConstantStepSize,
    ForwardAdjoint,
    Kvaerno5,
    PIDController,
    PiecewiseConstant,
    Tsit5,
    solve,
)
from epifit.ode._grid import make_grid
from epifit.ode._loop import Integrator
from epifit.simulation import SolverSettings


def _lv(t, y, args, u):
    """Lotka-Volterra with the predation scaled by the input."""
    a, b, c, d = args[0], args[1], args[2], args[3]
    x, z = y[0], y[1]
    return jnp.stack([a * x - b * x * z * u, -c * z + d * x * z])


LV_TS = np.linspace(0.0, 15.0, 31)
LV_INPUT_TIMES = np.array([0.0, 4.3, 9.1])
LV_INPUTS = jnp.array([1.0, 0.8, 1.1])
LV_P = jnp.array([1.1, 0.4, 0.9, 0.3, 1.0, 1.0])
LV_WEIGHTS = jnp.sin(jnp.arange(62.0).reshape(31, 2))


def _lv_y0(p):
    return jnp.array([1.0, 0.5]) * p[4]


def _lv_loss(p, solver, ctrl, adjoint=None):
    sol = solve(
        _lv,
        _lv_y0(p),
        p[:4],
        ts=LV_TS,
        inputs=PiecewiseConstant(LV_INPUT_TIMES, LV_INPUTS * p[5]),
        solver=solver,
        stepsize_controller=ctrl,
        adjoint=adjoint,
        interpolate_saves=True,
    )
    return jnp.sum(LV_WEIGHTS * sol.ys)


def _accepted_steps(p, solver, ctrl):
    """The grid and each segment's accepted step end times of the solve."""
    grid = make_grid(LV_TS, LV_INPUT_TIMES, None, inner=7)
    integ = Integrator(_lv, solver, ctrl, 4096)
    out = integ.run(grid, _lv_y0(p), p[:4], LV_INPUTS * p[5], None, record=True)
    times, n_acc = out[3], out[4]
    return grid, [np.asarray(times[k][: int(n)]) for k, n in enumerate(n_acc)]


def _written_out_loss(p, solver, grid, steps):
    """The same steps, each a fresh solver step (a `lax.scan` over the
    mesh, so it compiles once), and the same interpolants: what `jax.grad`
    differentiates here is the discrete solution on this mesh, as the
    checkpoint adjoint does."""
    t0s = np.concatenate([np.r_[grid.bounds[k], e[:-1]] for k, e in enumerate(steps)])
    t1s = np.concatenate(steps)
    seg = np.concatenate([np.full(len(e), k) for k, e in enumerate(steps)])
    us = (LV_INPUTS * p[5])[grid.input_index[seg]]

    def body(y, x):
        t0, t1, u = x
        f0, _ = solver.init(_lv, t0, y, p[:4], u)
        out = solver.step_with_stages(_lv, t0, t1, y, p[:4], u, f0, slopes=True)
        return out[0], (y, out[0], jnp.stack(out[5]))

    _, (y_start, y_end, ks) = jax.lax.scan(body, _lv_y0(p), (t0s, t1s, us))
    rows = []
    for s in LV_TS:
        if s == LV_TS[0]:
            rows.append(_lv_y0(p))
        elif np.any(np.isclose(grid.bounds, s, rtol=0, atol=1e-12)):
            rows.append(y_end[int(np.argmin(np.abs(t1s - s)))])
        else:  # an inner save: in the step that holds it
            i = int(np.searchsorted(t1s, s - 1e-12))
            h = t1s[i] - t0s[i]
            w = solver.dense_weights(jnp.asarray((s - t0s[i]) / h))
            rows.append(y_start[i] + h * jnp.tensordot(w, ks[i], 1))
    return jnp.sum(LV_WEIGHTS * jnp.stack(rows))


# ------------------------------------------------------------------- the grid
def test_inner_saves_leave_boundaries_at_the_input_breaks_and_every_kth_save():
    """Input break times stay boundaries; of the other save times, one in
    `K + 1` is a boundary and the others are inner saves; `save_index`
    finds each save time's state among the boundaries' and then the inner
    ones'."""
    ts = np.arange(0.0, 12.0)
    grid = make_grid(ts, np.array([0.0, 5.5]), None, inner=3)
    np.testing.assert_array_equal(grid.bounds, [0.0, 4.0, 5.5, 9.0, 11.0])
    inf = np.inf
    np.testing.assert_array_equal(
        grid.inner, [[1, 2, 3], [5, inf, inf], [6, 7, 8], [10, inf, inf]]
    )
    states = np.concatenate([grid.bounds, grid.inner.ravel()])
    np.testing.assert_array_equal(states[grid.save_index], ts)
    np.testing.assert_array_equal(grid.input_index, [0, 0, 1, 1])
    exact = make_grid(ts, np.array([0.0, 5.5]), None)
    assert exact.inner is None and exact.n_inner == 0
    np.testing.assert_array_equal(exact.bounds, np.union1d(ts, [5.5]))


# ---------------------------------------------------------------- interpolants
@pytest.mark.parametrize("solver, order", [(Tsit5(), 4), (Bosh3(), 3)])
def test_dense_output_has_the_interpolants_order(solver, order):
    """Inside one step of `y' = -y`, the interpolant's error shrinks as
    `h^(order + 1)`; its weights sum to `theta`, vanish at the start and
    are the method's `b` at the end."""
    w = solver.dense_weights(jnp.array([0.0, 0.37, 1.0]))
    np.testing.assert_allclose(w.sum(-1), [0.0, 0.37, 1.0], atol=1e-12)
    np.testing.assert_allclose(w[0], 0.0, atol=1e-15)
    np.testing.assert_allclose(w[2], solver.tableau.b, atol=1e-12)

    def vf(t, y, args, u):
        return -y

    def error(h):
        y0 = jnp.array([1.0])
        f0, _ = solver.init(vf, 0.0, y0, None, None)
        ks = solver.step_with_stages(vf, 0.0, h, y0, None, None, f0, slopes=True)
        ks = jnp.stack(ks[5])
        return max(
            abs(float((y0 + h * solver.dense_weights(th) @ ks)[0]) - np.exp(-th * h))
            for th in (0.3, 0.7)
        )

    ratio = error(0.2) / error(0.1)
    assert 2.0 ** (order + 1) * 0.7 < ratio < 2.0 ** (order + 1) * 1.4


# ------------------------------------------------------------ saved states
def _seir(days, rtol, interp, ts=None, dtype=jnp.float64):
    model = em.compile_model(em.load_model("models/seir.toml")).bind_days(days)
    p = model.init_params(1)
    args, inputs = model.precompute(p, {}, 1)

    def cast(tree):
        return jax.tree.map(lambda x: jnp.asarray(x, dtype), tree)

    return solve(
        model.vector_field,
        cast(model.initial_state(p, {}, 1)),
        cast(args),
        ts=np.arange(days + 1.0) if ts is None else ts,
        inputs=inputs,
        stepsize_controller=PIDController(rtol=rtol, atol=rtol * 1e-3),
        interpolate_saves=interp,
    )


def test_interpolated_saves_take_fewer_steps_and_agree_with_a_tight_solve():
    """A smooth SEIR epidemic saved daily: stepping to every day takes about
    200 steps at rtol 1e-3, the interpolated saves fewer than half of them
    (45 measured); at rtol 1e-9 both agree with each other to 1e-6."""
    exact = _seir(200, 1e-3, False)
    interp = _seir(200, 1e-3, True)
    assert int(exact.stats["num_accepted_steps"]) >= 200
    assert int(interp.stats["num_accepted_steps"]) < 100
    assert int(interp.stats["num_segments"]) == 25  # 200 days, 7 inner saves
    tight = [_seir(200, 1e-9, flag).ys for flag in (False, True)]
    for key in tight[0]:
        a, b = np.asarray(tight[0][key]), np.asarray(tight[1][key])
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-6 * np.abs(a).max())
    for key in exact.ys:  # the loose solves agree to their tolerance
        a, b = np.asarray(exact.ys[key]), np.asarray(interp.ys[key])
        np.testing.assert_allclose(b, a, rtol=2e-2, atol=1e-3 * np.abs(a).max())


def test_a_long_first_segment_in_float32_takes_small_first_steps():
    """Saved only at its end, a 200-day float32 solve starts with steps far
    below 16 ulps of day 200 (the step floor was once taken at the segment's
    end, and this solve failed with 'the step size fell below its
    minimum'); the floor is relative to the time reached."""
    sol = _seir(200, 1e-3, False, ts=np.array([0.0, 200.0]), dtype=jnp.float32)
    assert sol.ys["S"].dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(sol.ys["S"])))
    assert 0 < int(sol.stats["num_accepted_steps"]) < 100


# --------------------------------------------------------------- gradients
@pytest.mark.parametrize(
    "solver, rtol, one_step",
    [(Tsit5(), 1e-3, True), (Tsit5(), 1e-5, False), (Bosh3(), 1e-3, False)],
)
def test_checkpoint_gradient_through_interpolated_saves_is_exact(
    solver, rtol, one_step
):
    """The checkpoint adjoint's gradient (parameters, initial state and the
    inputs) equals `jax.grad` through the same accepted steps and the same
    interpolants written out, to rounding: segments of one step and of
    many (replayed), saves in the last step of a segment and before it."""
    p = jnp.asarray(LV_P, jnp.float64)
    ctrl = PIDController(rtol=rtol, atol=rtol * 1e-3)
    grid, steps = _accepted_steps(p, solver, ctrl)
    counts = [len(s) for s in steps]
    assert max(counts) > 4, counts  # replayed segments
    if one_step:
        assert min(counts) == 1, counts  # and one-step ones
    value, g = jax.value_and_grad(_lv_loss)(p, solver, ctrl)
    written_out = functools.partial(
        _written_out_loss, solver=solver, grid=grid, steps=steps
    )
    ref_value, ref = jax.jit(jax.value_and_grad(written_out))(p)
    np.testing.assert_allclose(value, ref_value, rtol=1e-12)
    np.testing.assert_allclose(g, ref, rtol=1e-10, atol=1e-12)
    if rtol <= 1e-5:
        # Forward sensitivities also differentiate the step-size control: at
        # rtol 1e-5 they agree to 2.4e-3 (measured). At 1e-3 the steps, no
        # longer clipped at the save times, move with the parameters and the
        # loss ripples (its slope in `b` is -58 over 1e-7 and 4.9 over 1e-3,
        # central differences): the mesh-frozen gradient is the smooth one.
        g_fwd = jax.grad(_lv_loss)(p, solver, ctrl, ForwardAdjoint())
        np.testing.assert_allclose(g_fwd, g, rtol=1e-2)


def test_kept_values_give_the_same_gradient_through_interpolated_saves(monkeypatch):
    """A coupled box-car SEIRD whose coupling product is computed once: the
    checkpoint adjoint that keeps the forward pass's products (and computes
    the last stage's once for the interpolants' pull-back) gives the
    gradient of the one that recomputes them, to rounding."""
    from test_adjoints_models import _coupled_boxcar

    import epifit.model._coupling as coupling

    monkeypatch.setattr(coupling, "ONCE_MIN_WORK", 0)
    model = _coupled_boxcar()
    params = model.init_params(3)
    y0 = model.initial_state(params, {}, 3)
    free, static = eqx.partition(params, eqx.is_inexact_array)
    travel = np.array([[0.0, 0.4, 0.0], [0.2, 0.0, 0.3], [0.5, 0.1, 0.0]])
    cov = {"travel": jnp.asarray(travel)}

    def loss(free, adjoint):
        args, inputs = model.precompute(eqx.combine(free, static), cov, 3)
        sol = solve(
            model.vector_field,
            y0,
            args,
            ts=np.arange(31.0),
            inputs=inputs,
            adjoint=adjoint,
            stepsize_controller=PIDController(rtol=1e-6, atol=1e-9),
            interpolate_saves=True,
        )
        return jnp.sum(sol.ys["D"] ** 2) * 1e4 + jnp.sum(sol.ys["IR"])

    plain = jax.grad(loss)(free, CheckpointAdjoint(keep_values=False))
    kept = jax.grad(loss)(free, CheckpointAdjoint())
    for a, b in zip(jax.tree.leaves(kept), jax.tree.leaves(plain), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-14)
    assert any(float(jnp.max(jnp.abs(a))) > 0 for a in jax.tree.leaves(kept))


def test_a_failed_solve_leaves_its_interpolated_saves_nan():
    """With `throw=False`, the saves after the failure, interpolated or
    not, are NaN, and those before it are finite."""
    sol = solve(
        _lv,
        _lv_y0(LV_P),
        LV_P[:4],
        ts=LV_TS,
        inputs=PiecewiseConstant(LV_INPUT_TIMES, LV_INPUTS),
        stepsize_controller=PIDController(rtol=1e-8, atol=1e-11),
        max_steps=20,
        throw=False,
        interpolate_saves=True,
    )
    assert int(sol.result) != 0
    finite = np.isfinite(np.asarray(sol.ys)).all(axis=1)
    assert finite[0] and not finite[-1]
    assert np.all(np.diff(finite.astype(int)) <= 0)  # no finite save after a NaN


# ------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"stepsize_controller": ConstantStepSize(0.5)}, "adaptive step-size"),
        ({"solver": Kvaerno5()}, "dense output"),
        ({"adjoint": BacksolveAdjoint()}, "CheckpointAdjoint"),
        ({"adjoint": CheckpointAdjoint(keep_first=True)}, "CheckpointAdjoint"),
        ({"adjoint": CheckpointAdjoint(unroll_first=False)}, "CheckpointAdjoint"),
    ],
)
def test_interpolated_saves_refuse_what_cannot_interpolate(kwargs, match):
    with pytest.raises(ValueError, match=match):
        solve(
            _lv,
            _lv_y0(LV_P),
            LV_P[:4],
            ts=LV_TS,
            inputs=PiecewiseConstant(LV_INPUT_TIMES, LV_INPUTS),
            interpolate_saves=True,
            **kwargs,
        )


def test_solver_settings_carry_interpolated_saves():
    """`SolverSettings(interpolate_saves=True)` reaches `solve` and the
    provenance record; unset, the record is as before."""
    on = SolverSettings(interpolate_saves=True)
    assert on.solve_kwargs()["interpolate_saves"] is True
    assert on.to_dict()["interpolate_saves"] is True
    assert "interpolate_saves" not in SolverSettings().to_dict()
    with pytest.raises(TypeError, match="interpolate_saves"):
        SolverSettings(interpolate_saves="yes")


def test_settings_refuse_interpolated_saves_they_cannot_differentiate():
    """The needs of `interpolate_saves` are checked when the settings are
    made (a fit file's or `calibrate`'s), not at the first solve."""
    with pytest.raises(ValueError, match="checkpoint adjoint"):
        SolverSettings(interpolate_saves=True, adjoint="backsolve")
    with pytest.raises(ValueError, match="dense output"):
        SolverSettings(interpolate_saves=True, solver="kvaerno5")
    with pytest.raises(ValueError, match="adaptive"):
        SolverSettings(
            interpolate_saves=True, stepsize_controller=ConstantStepSize(0.5)
        )


def test_a_fit_file_sets_interpolated_saves_and_the_fit_records_them():
    """`interpolate_saves = true` in a fit file reaches the fit's solves and
    its recorded settings (absent when unset, as in earlier records); a
    value that is not a boolean is refused naming the field."""
    import epifit
    from epifit.fitting import FitConfigError, parse_fit_config

    assert parse_fit_config({"interpolate_saves": True}).interpolate_saves is True
    assert parse_fit_config({}).interpolate_saves is None
    with pytest.raises(FitConfigError, match="interpolate_saves"):
        parse_fit_config({"interpolate_saves": "yes"}, file="fit.toml")
    model, data = "models/sir.toml", "data/boarding_school_1978.nc"
    fits = {
        flag: epifit.calibrate(
            model,
            data,
            fit={"interpolate_saves": flag, "rtol": 1e-8, "atol": 1e-8},
            uncertainty=False,
            progress=False,
        )
        for flag in (False, True)
    }
    assert fits[True].settings["interpolate_saves"] is True
    assert "interpolate_saves" not in fits[False].settings
    # the same optimum, to the solver's tolerance
    for name in ("beta", "gamma"):
        want = fits[False].parameters[name]
        assert fits[True].parameters[name] == pytest.approx(want, rel=1e-5)
