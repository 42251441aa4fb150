"""Every adjoint's gradient on epidemic models: a box-car SEIRD against finite
differences, the reference metapopulation model at 20 patches against
diffrax, directional derivatives and the covariates' (absent) cotangents, and
one model holding the reported, open-population and time-varying pieces of
issues 19 and 20 against finite differences.
(Split from `test_adjoints.py` so that the two halves run on both test
workers.)"""

from __future__ import annotations

import functools
from pathlib import Path

import diffrax
import equinox as eqx
import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pandas as pd
import pytest
import xarray as xr
from adjoint_cases import ADJOINT_NAMES, ADJOINTS, CTRL, GRAD_RTOL
from adjoint_cases import finite_differences as _fd
from adjoint_cases import rel_error as _rel
from helpers import (
    params_from_flat,
    reference_covariates,
    reference_initial_data,
    to_toml,
)

import epifit.model as em
from epifit.fitting import FreeParameters, Objective
from epifit.ode import (
    CheckpointAdjoint,
    PIDController,
    solve,
)
from epifit.simulation import Problem, SolverSettings


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


@pytest.fixture(scope="module")
def gradient20(reference20, reference_problem):
    """epifit's gradient of the reference loss at 20 patches at `p_init`, by
    adjoint name: compiled once for the comparison with diffrax and the
    directional derivatives."""
    P, model, cov, init, _ = reference20
    data, p0 = jnp.asarray(P["data"]), jnp.asarray(P["p_init"])

    @functools.cache
    def gradient(name):
        adjoint = ADJOINTS[name]
        loss = _reference_loss(model, cov, init, data, reference_problem, adjoint)
        return np.asarray(jax.jit(jax.grad(loss))(p0))

    return gradient


@pytest.fixture(scope="module")
def diffrax_gradient20(reference20, reference_problem):
    """diffrax's gradient of the reference loss at 20 patches at `p_init`
    (Tsit5 at tight tolerance restarted on each half day, where the day index
    is constant, with the reference's own vector field): computed once for
    every adjoint's test."""
    P = reference20[0]
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

    return jax.jit(jax.grad(diffrax_loss))(jnp.asarray(P["p_init"]))


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", ["checkpoint", "backsolve", "interpolating", "quadrature"]
)
def test_reference_model_gradient_matches_diffrax(gradient20, diffrax_gradient20, name):
    """The reference at 20 patches with its MLP: epifit's gradients w.r.t. the flat
    parameter vector against diffrax's (`diffrax_gradient20`)."""
    assert _rel(gradient20(name), diffrax_gradient20) < 1e-5


@pytest.mark.slow
def test_reference_model_directional_derivatives(
    reference20, reference_problem, gradient20
):
    """Directional finite differences along random directions, all adjoints."""
    P, model, cov, init, _ = reference20
    data = jnp.asarray(P["data"])
    p0 = jnp.asarray(P["p_init"])
    rng = np.random.default_rng(0)
    dirs = rng.normal(size=(3, p0.size))
    base = jax.jit(_reference_loss(model, cov, init, data, reference_problem, None))
    for name in ("checkpoint", "backsolve", "interpolating", "quadrature"):
        g = gradient20(name)
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


# ------------------------------------ reported, open and time-varying pieces at once
# One model holding the pieces of issues 19 and 20 whose gradients the adjoints
# must get right: a delayed, ascertained negative-binomial report with a fitted
# week effect and weekly totals (test_observation_flows.py), rates that read the
# state (`eff * doses / S`, `beta * exp(-k * I / N)`; test_open_population.py),
# and a weekly-piece beta under a random-walk prior (test_time_varying.py). One
# compiled gradient per adjoint covers them all (a model each compiled five
# gradients each).
OPEN_REPORTED_TV = {
    "name": "open_reported_tv",
    "compartments": ["S", "E", "I", "R", "V"],
    "parameters": {
        "beta": {
            "value": 0.5,
            "transform": "softplus",
            "per_time": 10,
            "smoothing": {"kind": "random_walk", "sd": 0.3, "order": 1},
        },
        "sigma": {"value": 0.25, "transform": "softplus"},
        "gamma": {"value": 0.2, "transform": "softplus"},
        "omega": {"value": 0.01, "transform": "softplus"},
        "k": {"value": 20.0, "transform": "softplus"},
        "eff": {"value": 0.9, "transform": "sigmoid"},
        "N": {"value": 1000.0, "fixed": True},
        "phi": {"value": 20.0, "transform": "softplus"},
        "dmean": {"value": 5.0, "transform": "softplus"},
        "dsd": {"value": 2.5, "transform": "softplus"},
        "rho": {"value": 0.6, "transform": "sigmoid"},
        "s": {"value": 2.0, "transform": "softplus"},
    },
    "covariates": {
        "testing": {"dims": ["time"], "rule": "floor"},
        "doses": {"dims": ["time"], "rule": "floor"},
    },
    "transitions": [
        {"from": "E", "to": "I", "rate": "sigma"},
        {"from": "I", "to": "R", "rate": "gamma"},
        {"from": "R", "to": "S", "rate": "omega"},
        {"from": "S", "to": "V", "rate": "eff * doses / S"},
    ],
    "infections": [
        {
            "from": "S",
            "to": "E",
            "transmission": "beta * exp(-k * I / N)",
            "infectious": ["I"],
            "normalize": "population",
            "population": "N",
        }
    ],
    "initial": {"S": "N - 10", "I": "10"},
    "observations": [
        {
            "name": "cases",
            "kind": "flow",
            "transition": "S->E",
            "family": "negative_binomial",
            "dispersion": "phi",
            "delay": {"family": "gamma", "mean": "dmean", "sd": "dsd", "max_days": 20},
            "ascertainment": "rho * testing",
            "week_effect": "dow",
        },
        {
            "name": "weekly",
            "kind": "flow",
            "transition": "R->S",
            "family": "gaussian",
            "sd": "s",
            "period": 7,
        },
        {
            "name": "vaccinated",
            "kind": "flow",
            "transition": "S->V",
            "family": "poisson",
        },
    ],
}
# the parameters each issue's pieces bring, checked against finite differences
# group by group (a wrong gradient in one group cannot hide behind the others)
# (a name ending in "_" or "[t" stands for all its labels)
PIECES = {
    "reported": ("phi", "dmean", "dsd", "rho", "dow_", "s"),
    "state-reading rates": ("k", "eff"),
    "time-varying beta": ("beta[t",),
}
_DOW = (0.2, 0.1, -0.1, 0.0, 0.05, -0.15)  # Monday to Saturday; Sunday is the rest


def _of(label: str, names) -> bool:
    return any(
        label.startswith(n) if n.endswith(("_", "[t")) else label == n for n in names
    )


@pytest.mark.slow
def test_gradients_of_reported_open_and_time_varying_pieces_agree_across_adjoints():
    days = 40
    rng = np.random.default_rng(1)
    doses = np.where(np.arange(days) < 20, 1.0, 3.0)  # a campaign from day 20
    ds = xr.Dataset(
        {
            "testing": ("time", 0.8 + 0.4 * rng.random(days)),
            "doses": ("time", doses),
            "cases": ("time", rng.poisson(8.0, days).astype(float)),
            "weekly": ("time", np.where(np.arange(days) % 7 == 6, 3.0, np.nan)),
            "vaccinated": ("time", np.r_[np.nan, 0.8 * doses[:-1] + 0.1]),
        },
        coords={"time": pd.date_range("2021-03-01", periods=days)},  # a Monday
    )
    ds["weekly"].attrs["period"] = 7
    model = em.loads_model(to_toml(OPEN_REPORTED_TV), path="models/x.toml")
    problem = Problem(model, ds)
    params = problem.init_params()
    dow = dict(zip(("mon", "tue", "wed", "thu", "fri", "sat"), _DOW, strict=True))
    params = {
        **params,
        "beta": params["beta"] + jnp.asarray([0.1, -0.2, 0.3, 0.0]),
        **{f"dow_{d}": jnp.asarray(v) for d, v in dow.items()},
    }
    free = FreeParameters(problem, params)
    x = free.x0
    labels = free.labels
    assert sum(lab.startswith("beta[t") for lab in labels) == 4
    assert sum(lab.startswith("dow_") for lab in labels) == 6
    assert {"dmean", "dsd", "rho", "k", "eff", "gamma"} <= set(labels)
    grads, value_and_grad = {}, {}
    for adjoint in ADJOINT_NAMES:
        settings = SolverSettings(rtol=1e-10, atol=1e-10, adjoint=adjoint)
        objective = Objective(problem, free, settings)
        data = objective.data()
        f = jax.jit(jax.value_and_grad(objective.loss))
        value_and_grad[adjoint] = functools.partial(f, data=data)
        grads[adjoint] = np.asarray(f(x, data)[1])
    # the loss is the same function for every adjoint: the checkpoint's
    # compiled value gives the finite differences (no sixth compile)
    fd = _fd(lambda v: value_and_grad["checkpoint"](v)[0], x)
    assert np.all(np.abs(fd) > 1e-3)  # every parameter moves the loss
    for piece, names in PIECES.items():
        rows = [i for i, lab in enumerate(labels) if _of(lab, names)]
        assert rows, piece
        for adjoint, g in grads.items():
            assert _rel(g[rows], fd[rows]) < 1e-5, (piece, adjoint)
    for adjoint, g in grads.items():
        assert _rel(g, fd) < 1e-5, adjoint
        assert _rel(g, grads["checkpoint"]) < 1e-5, adjoint


def _coupled_boxcar():
    """`models/seird_boxcar.toml` with its force of infection coupled across
    three patches through a `travel` matrix covariate scaled per patch."""
    text = Path("models/seird_boxcar.toml").read_text()
    text = text.replace(
        "[[infections]]",
        'mix = { value = 0.3, transform = "softplus", per_patch = true }\n\n'
        "[covariates]\n"
        'travel = { dims = ["patch", "patch_to"] }\n\n'
        "[couplings.mixing]\n"
        'covariate = "travel"\n'
        'scale = "mix"\n\n'
        "[[infections]]\n"
        'coupling = "mixing"',
        1,
    )
    return em.compile_model(em.loads_model(text, name="seird_boxcar_coupled"))


@pytest.mark.parametrize(
    ("spacing", "rtol", "sparse"), [(1.0, 1e-3, False), (3.0, 1e-6, True)]
)
def test_kept_products_give_the_recomputed_gradient(spacing, rtol, sparse, monkeypatch):
    """The checkpoint adjoint keeps the coupling products of the forward
    pass (`keep_values`; `computed_once` around the product) and its
    pull-back takes them instead of computing them again: the gradient is
    the same to rounding (float64) on segments of about one step (daily)
    and of several (every 3 days, replayed), with a dense and a sparse
    coupling. The kept values are taken by Tsit5's six stage
    linearisations (the first stage's from one evaluation of the product)
    and by the parameters' batched pull-back, once each in the one
    pull-back program that serves one-step and replayed segments."""
    import epifit.model._coupling as coupling
    import epifit.model._once as once
    import epifit.ode._solve as solve_module

    taken = []
    take = once.kept_value

    def counting_take():
        v = take()
        if v is not None:
            taken.append(v)
        return v

    monkeypatch.setattr(once, "kept_value", counting_take)
    # three patches: a product this small is computed where it is read
    # unless the threshold says otherwise
    monkeypatch.setattr(coupling, "ONCE_MIN_WORK", 0)
    model = _coupled_boxcar()
    params = model.init_params(3)
    y0 = model.initial_state(params, {}, 3)
    free, static = eqx.partition(params, eqx.is_inexact_array)
    ctrl = PIDController(rtol=rtol, atol=1e-9)
    ts = np.arange(0.0, 30.0 + spacing / 2, spacing)
    travel = np.array([[0.0, 0.4, 0.0], [0.2, 0.0, 0.3], [0.5, 0.1, 0.0]])
    cov = {"travel": em.sparse_coupling(travel) if sparse else jnp.asarray(travel)}

    def trajectory(free, adjoint):
        p = eqx.combine(free, static)
        args, inputs = model.precompute(p, cov, 3)
        return solve(
            model.vector_field,
            y0,
            args,
            ts=ts,
            inputs=inputs,
            adjoint=adjoint,
            stepsize_controller=ctrl,
        )

    def loss(free, adjoint):
        sol = trajectory(free, adjoint)
        return jnp.sum(sol.ys["D"] ** 2) * 1e4 + jnp.sum(sol.ys["IR"])

    steps = int(trajectory(free, None).stats["num_accepted_steps"])
    if spacing == 1.0:
        assert steps < 1.5 * (ts.size - 1)  # mostly one step a segment
    else:
        assert steps > 2 * (ts.size - 1)  # several: replayed

    plain = jax.grad(lambda f: loss(f, CheckpointAdjoint(keep_values=False)))(free)
    assert not taken
    g = jax.grad(lambda f: loss(f, CheckpointAdjoint()))(free)
    # the vector field is traced once per signature (`traced_once`), so the
    # products are taken once at trace time ...
    assert len(taken) == 1
    # ... and, traced at every evaluation, once by each of the seven
    taken.clear()
    monkeypatch.setattr(solve_module, "traced_once", lambda vf: vf)
    g_each = jax.grad(lambda f: loss(f, CheckpointAdjoint()))(free)
    assert len(taken) == 7  # six stages, and the parameters' pull-back
    assert np.all(np.abs(np.asarray(plain["mix"])) > 0)  # the coupling matters
    for a, b, c in zip(*map(jax.tree.leaves, (g, plain, g_each)), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-300)
        np.testing.assert_array_equal(a, c)
