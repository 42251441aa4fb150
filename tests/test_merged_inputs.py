"""Per-day inputs merged onto their break days (issue 20): `Problem` reads
the days on which its inputs can change from its concrete covariates and the
model (`epifit.model.break_days`), `precompute(..., breaks=...)` evaluates
the inputs there only, so the solver restarts there only, and a run-time
guard raises where traced covariates change on another day. Checked against
the daily grid (`breaks=None`), the change days counted here in NumPy, and
`solve_ivp` run piece by piece."""

from __future__ import annotations

import copy

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pandas as pd
import pytest
import xarray as xr
from adjoint_cases import rel_error
from helpers import to_toml
from test_open_population import (
    SEIR_FORCED,
    model_of,
    school_term,
    term_problem,
    term_reference,
)

import epifit
from epifit.fitting import FreeParameters, Objective
from epifit.model import break_days, loads_model
from epifit.ode import PIDController, solve
from epifit.simulation import Problem, SolverSettings

# Merged and daily grids share their segments when every day is saved (each
# save is a segment end): the solves take the same steps, and the stage
# handed on across a save equals the fresh evaluation the daily grid makes,
# so the two agree to rounding.
SAME_STEPS = 1e-12
RUNTIME = (ValueError, jax.errors.JaxRuntimeError)


def change_days(a: np.ndarray) -> np.ndarray:
    """Day 0 and the days on which `a (time, ...)` differs from the day before."""
    flat = a.reshape(a.shape[0], -1)
    return np.r_[0, np.nonzero(np.any(flat[1:] != flat[:-1], axis=1))[0] + 1]


def daily_twin(problem: Problem) -> Problem:
    """The same problem solved on the daily grid."""
    twin = copy.copy(problem)
    twin.breaks = None
    return twin


def solve_both(problem, settings, params=None):
    params = problem.init_params() if params is None else params
    out = []
    for p in (problem, daily_twin(problem)):
        run = eqx.filter_jit(lambda x, a, p=p: p.solve(x, settings, arrays=a))
        out.append(run(params, problem.arrays))
    return out


# -- the segment grid follows the inputs --------------------------------------------
def test_a_20_year_term_problem_restarts_only_where_the_term_changes():
    """The seasonally forced SEIR over 20 years through `Problem.solve`
    (daily saves): 120 input changes instead of one a day, the daily grid's
    states, and `solve_ivp` piece by piece between the term's changes."""
    days = 20 * 365
    term = school_term(days)
    problem = term_problem(days, term)
    assert problem.breaks == tuple(change_days(term))
    assert len(problem.breaks) == 121
    merged, daily = solve_both(problem, SolverSettings(rtol=1e-8, atol=1e-6))
    assert int(merged.stats["num_input_changes"]) == 120
    assert int(daily.stats["num_input_changes"]) == days - 2
    assert int(merged.stats["num_segments"]) == days - 1
    # one fresh first stage per restart instead of per day
    fewer = int(daily.stats["num_rhs_evals"]) - int(merged.stats["num_rhs_evals"])
    assert fewer == days - 2 - 120
    for c in "SEIR":
        np.testing.assert_allclose(merged.ys[c], daily.ys[c], rtol=SAME_STEPS)
    yearly = term_reference(term)
    saved = np.asarray(sorted(yearly))
    want = np.asarray([yearly[d] for d in saved])
    got = np.asarray(merged.ys["I"][saved, 0, 0])
    np.testing.assert_allclose(got, want, rtol=1e-5)  # as the daily grid's test


def test_a_covariate_that_changes_every_day_keeps_the_daily_grid():
    days = 200
    term = np.random.default_rng(0).uniform(-1.0, 1.0, days)
    problem = term_problem(days, term)
    assert problem.breaks is None
    sol = problem.solve(problem.init_params())
    assert int(sol.stats["num_input_changes"]) == days - 2


def test_change_days_count_nan_as_equal_to_nan():
    model = model_of(SEIR_FORCED)
    term = np.array([np.nan, np.nan, 1.0, 1.0, np.nan, np.nan, -1.0, -1.0])
    assert break_days(model, {"term": term}, term.size) == (0, 2, 4, 6)
    # past its last day a covariate carries its last day forward
    assert break_days(model, {"term": term}, 20) == (0, 2, 4, 6)
    assert break_days(model, {"term": jnp.ones(5)}, 5) == (0,)
    with pytest.raises(ValueError, match="no covariate 'term' given; found: 'x'"):
        break_days(model, {"x": term}, term.size)


TV = {
    "name": "seir_pieces_term",
    "compartments": ["S", "E", "I", "R"],
    "parameters": {
        "N": {"value": 10000.0, "fixed": True},
        "beta": {"value": 0.5, "transform": "softplus", "per_time": 14},
        "b1": {"value": 0.3, "transform": "softplus"},
        "sigma": {"value": 0.25, "transform": "softplus"},
        "gamma": {"value": 0.2, "transform": "softplus"},
    },
    "covariates": {"term": {"dims": ["time"], "rule": "floor"}},
    "infections": [
        {
            "from": "S",
            "to": "E",
            "transmission": "beta * (1 + b1 * term)",
            "infectious": ["I"],
            "normalize": "population",
            "population": "N",
        }
    ],
    "transitions": [
        {"from": "E", "to": "I", "rate": "sigma"},
        {"from": "I", "to": "R", "rate": "gamma"},
    ],
    "initial": {"S": "N - 20", "E": "20"},
    "observations": [
        {"name": "cases", "kind": "flow", "transition": "S->E", "family": "poisson"}
    ],
}


def tv_problem(days: int, term=None, cases=None, **fields) -> Problem:
    data = {**TV, "parameters": {**TV["parameters"]}}
    data["parameters"]["beta"] = {**TV["parameters"]["beta"], **fields}
    time = pd.date_range("2021-03-01", periods=days)
    term = np.where(np.arange(days) % 60 < 25, 1.0, -1.0) if term is None else term
    cases = np.ones(days) if cases is None else cases
    ds = xr.Dataset({"term": ("time", term), "cases": ("time", cases)}, {"time": time})
    return Problem(loads_model(to_toml(data), path="models/x.toml"), ds)


def test_pieces_break_at_their_starts_beside_the_covariates_changes():
    days = 84
    problem = tv_problem(days)
    term = np.asarray(problem.covariates["term"])
    want = sorted(set(range(0, days, 14)) | set(change_days(term).tolist()))
    assert problem.breaks == tuple(want)
    params = problem.init_params()
    params["beta"] = params["beta"] + jnp.linspace(-0.3, 0.3, 6)
    merged, daily = solve_both(problem, SolverSettings(rtol=1e-9), params)
    assert int(merged.stats["num_input_changes"]) == len(want) - 1
    np.testing.assert_allclose(merged.ys["I"], daily.ys["I"], rtol=SAME_STEPS)
    # a spline changes every day: the daily grid
    assert tv_problem(days, per_time={"kind": "spline", "knots": 5}).breaks is None


# -- gradients -----------------------------------------------------------------------
@pytest.mark.parametrize("adjoint", ["checkpoint", "backsolve", "forward"])
def test_gradients_on_merged_inputs_equal_the_daily_grid(adjoint):
    """The forced SEIR over 3 years saved weekly (the merged grid has 1/7 of
    the segments): d(loss)/d(beta, b1) of both grids agree to the solver's
    tolerance, for each adjoint."""
    from epifit.simulation import ADJOINTS

    days = 3 * 365
    model = model_of(SEIR_FORCED)
    covariates = {"term": jnp.asarray(school_term(days))}
    breaks = break_days(model, covariates, days)
    ts = np.arange(0.0, days, 7.0)
    ctrl = PIDController(rtol=1e-10, atol=1e-8)
    y0 = model.initial_state(model.init_params(1), None, 1)

    def loss(params, breaks):
        args, inputs = model.precompute(params, covariates, 1, breaks=breaks)
        sol = solve(
            model.vector_field,
            y0,
            args,
            ts=ts,
            inputs=inputs,
            stepsize_controller=ctrl,
            adjoint=ADJOINTS[adjoint](),
            max_steps=100_000,
        )
        return jnp.sum(jnp.log(sol.ys["I"]))

    params = model.init_params(1)
    grads = {}
    for label, b in (("merged", breaks), ("daily", None)):
        grad = jax.jit(jax.grad(lambda p, b=b: loss(p, b)))
        g = grad(params)
        grads[label] = {k: g[k] for k in ("beta", "b1")}
        assert np.all(np.isfinite(jax.flatten_util.ravel_pytree(grads[label])[0]))
    assert rel_error(grads["merged"], grads["daily"]) < 1e-6  # 100 x rtol


def test_a_fit_is_unchanged_by_the_merge():
    """The loss, its gradient and a short calibration of a model with weekly
    pieces and a covariate: the same numbers merged and on the daily grid."""
    days = 56
    cases = np.random.default_rng(1).poisson(20.0, days).astype(float)
    problem = tv_problem(days, cases=cases)
    assert problem.breaks is not None and len(problem.breaks) < days / 4
    twin = daily_twin(problem)
    settings = SolverSettings(rtol=1e-8, atol=1e-8)
    values = {}
    for label, p in (("merged", problem), ("daily", twin)):
        free = FreeParameters(p, p.init_params())
        objective = Objective(p, free, settings)
        data = objective.data()
        x = free.x0 + 0.05
        values[label] = jax.jit(jax.value_and_grad(objective.loss))(x, data)
    np.testing.assert_allclose(values["merged"][0], values["daily"][0], rtol=1e-12)
    np.testing.assert_allclose(values["merged"][1], values["daily"][1], rtol=1e-12)
    fits = [
        epifit.calibrate(p, max_iterations=5, uncertainty=False, progress=False)
        for p in (problem, twin)
    ]
    np.testing.assert_allclose(fits[0].x, fits[1].x, rtol=1e-12)
    np.testing.assert_allclose(fits[0].loss, fits[1].loss, rtol=1e-12)


# -- the guard -----------------------------------------------------------------------
def test_traced_covariates_with_other_change_days_are_refused():
    problem = term_problem(3 * 365)
    params = problem.init_params()
    good = problem.arrays
    bad = {**good, "covariates": {"term": good["covariates"]["term"].at[50].set(0.3)}}
    message = r"covariate 'term' .*changes on day 50, which is not one of the 19"
    run = jax.jit(lambda p, a: problem.solve(p, arrays=a).ys["I"])
    jax.block_until_ready(run(params, good))
    with pytest.raises(RUNTIME, match=message):
        jax.block_until_ready(run(params, bad))
    with pytest.raises(ValueError, match=message):  # not traced: at once
        problem.solve(params, arrays=bad)
    # a vmap over datasets: one with other change days fails the batch
    both = jax.tree.map(lambda a, b: jnp.stack([a, b]), good, bad)
    batched = jax.jit(jax.vmap(run, in_axes=(None, 0)))
    with pytest.raises(RUNTIME, match=message):
        jax.block_until_ready(batched(params, both))
    same = jax.tree.map(lambda a: jnp.stack([a, a]), good)
    ys = batched(params, same)
    # each lane is the unbatched solve, to rounding: XLA CPU does not promise
    # bit-identical lanes (their elementwise kernels are vectorised across
    # the batch; a few ulps apart here)
    single = run(params, good)
    np.testing.assert_allclose(ys[0], single, rtol=1e-13, atol=0)
    np.testing.assert_allclose(ys[1], single, rtol=1e-13, atol=0)
    # the daily grid takes any covariates
    assert np.all(np.isfinite(daily_twin(problem).solve(params, arrays=bad).ys["I"]))


@pytest.mark.parametrize(
    ("breaks", "message"),
    [
        ((1, 5), r"starting at 0, e\.g\. \(0, 94, 109\); got \(1, 5\)"),
        ((0, 5, 5), r"strictly increasing .*got \(0, 5, 5\)"),
        ((0.0, 2.5), r"whole days .*got \(0\.0, 2\.5\)"),
        ((), r"starting at 0.*got \(\)"),
    ],
)
def test_bad_breaks_are_refused_naming_them(breaks, message):
    model = model_of(SEIR_FORCED)
    with pytest.raises(ValueError, match=message):
        model.precompute(model.init_params(1), {"term": jnp.ones(10)}, breaks=breaks)


def test_breaks_that_miss_a_piece_or_merge_a_spline_are_refused():
    problem = tv_problem(42)
    params = problem.init_params()
    cov = problem.covariates
    with pytest.raises(ValueError, match=r"piece of .*'beta' starts on day 14, "):
        problem.model.precompute(params, cov, breaks=(0, 25, 28))
    spline = tv_problem(42, per_time={"kind": "spline", "knots": 5})
    with pytest.raises(ValueError, match=r"'beta' \(spline\) changes every day"):
        spline.model.precompute(spline.init_params(), cov, breaks=(0, 25))


# -- neural sub-models and sparse couplings ------------------------------------------
METAPOP = """
name = "metapop_weekly"
compartments = ["S", "I", "R"]
[parameters]
gamma = { value = 0.2, transform = "softplus" }
[covariates]
mobility = { dims = ["time", "patch", "feature"], rule = "nearest" }
coupling = { dims = ["time", "patch", "patch_to"], rule = "nearest" }
[neural.beta]
covariate = "mobility"
layers = [2, 4, 1]
activation = "tanh"
[couplings.travel]
covariate = "coupling"
[[infections]]
from = "S"
to = "I"
transmission = "beta"
infectious = ["I"]
coupling = "travel"
[[transitions]]
from = "I"
to = "R"
rate = "gamma"
[initial]
S = "0.99"
I = "0.01"
"""


def metapop_problem(days: int = 60) -> Problem:
    """Four patches; the MLP's features change weekly, the (sparse: one
    neighbour a row) coupling every ten days."""
    rng = np.random.default_rng(4)
    weekly = rng.uniform(0.0, 1.0, (-(-days // 7), 4, 2))
    mobility = np.repeat(weekly, 7, axis=0)[:days]
    shift = np.roll(np.eye(4), 1, axis=1)
    weights = np.repeat(rng.uniform(0.1, 0.5, -(-days // 10)), 10)[:days]
    coupling = weights[:, None, None] * shift
    patches = ["a", "b", "c", "d"]
    ds = xr.Dataset(
        {
            "mobility": (("time", "patch", "feature"), mobility),
            "coupling": (("time", "patch", "patch_to"), coupling),
        },
        {
            "time": pd.date_range("2021-01-01", periods=days),
            "patch": patches,
            "patch_to": patches,
        },
    )
    return Problem(loads_model(METAPOP, path="models/metapop.toml"), ds)


def test_a_neural_rate_and_a_sparse_coupling_break_where_their_covariates_change():
    days = 60
    problem = metapop_problem(days)
    assert type(problem.covariates["coupling"]).__name__ == "SparseCoupling"
    want = sorted(set(range(0, days, 7)) | set(range(0, days, 10)))
    assert problem.breaks == tuple(want)
    merged, daily = solve_both(problem, SolverSettings(rtol=1e-9))
    assert int(merged.stats["num_input_changes"]) == len(want) - 1
    # the nearest rule breaks at half-days: the daily grid has two segments a
    # day, the merged one a segment a day plus one per break after day 0
    assert int(daily.stats["num_segments"]) == 2 * (days - 1)
    assert int(merged.stats["num_segments"]) == days - 1 + len(want) - 1
    # different grids, each solve within its tolerance: 1000 x rtol
    np.testing.assert_allclose(merged.ys["I"], daily.ys["I"], rtol=1e-6)
    # the guard reads a sparse coupling's weights
    cov = problem.arrays["covariates"]
    c = cov["coupling"]
    moved = type(c)(c.values.at[3].multiply(2.0), c.columns)
    bad = {**problem.arrays, "covariates": {**cov, "coupling": moved}}
    with pytest.raises(ValueError, match=r"covariate 'coupling' .*changes on day 3,"):
        problem.solve(problem.init_params(), arrays=bad)


def test_a_neural_time_input_keeps_the_daily_grid():
    text = METAPOP.replace(
        "layers = [2, 4, 1]", "layers = [3, 4, 1]\ntime_input = true"
    )
    problem = metapop_problem()
    model = loads_model(text, path="models/metapop.toml")
    tv = Problem(model, problem.dataset)
    assert tv.breaks is None
    with pytest.raises(ValueError, match=r"'beta' reads the day \(time_input"):
        tv.model.precompute(tv.init_params(), tv.covariates, breaks=(0, 7))


def test_both_matrices_of_a_kron_coupling_break_where_they_change():
    """Strata coupled by `kron(M, C)`: a travel matrix `M` changing every ten
    days and a contact matrix `C` over ages changing weekly."""
    from test_strata_coupling import C, M, T, _model_text, travel_data

    floor = 'rule = "floor" }'
    text = _model_text(
        **{
            'contacts = { dims = ["age", "age_to"] }': 'contacts = { dims = ["time", '
            f'"age", "age_to"], {floor}',
            'travel = { dims = ["patch", "patch_to"] }': 'travel = { dims = ["time", '
            f'"patch", "patch_to"], {floor}',
        }
    )
    rng = np.random.default_rng(5)
    days = np.arange(T)
    travel = M[None] * rng.uniform(0.5, 1.5, -(-T // 10))[days // 10, None, None]
    contacts = C[None] * rng.uniform(0.5, 1.5, -(-T // 7))[days // 7, None, None]
    data = travel_data(travel=travel, contacts=contacts)
    problem = Problem(loads_model(text, path="models/travel.toml"), data)
    want = sorted(set(range(0, T, 7)) | set(range(0, T, 10)))
    assert problem.breaks == tuple(want)
    merged, daily = solve_both(problem, SolverSettings(rtol=1e-9))
    assert int(merged.stats["num_input_changes"]) == len(want) - 1
    np.testing.assert_allclose(merged.ys["I"], daily.ys["I"], rtol=SAME_STEPS)
    cov = problem.arrays["covariates"]
    moved = {**cov, "contacts": cov["contacts"].at[3].multiply(2.0)}
    with pytest.raises(ValueError, match=r"covariate 'contacts' .*changes on day 3,"):
        problem.solve(
            problem.init_params(), arrays={**problem.arrays, "covariates": moved}
        )
