"""Open populations (issue 20): inflows from outside (births, importations),
per-capita outflows (deaths), forcing through a covariate, and rates that
read the state (a compartment's total in a rate: vaccination by doses per
day, a prevalence-dependent transmission), against closed forms and
`solve_ivp` (their gradients across adjoints: test_adjoints_models.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pandas as pd
import pytest
import xarray as xr
from scipy.integrate import solve_ivp

from epifit.model import (
    ModelBuilder,
    ModelSpecError,
    break_days,
    compile_model,
    loads_model,
)
from epifit.ode import PIDController, solve
from epifit.simulation import Problem, SolverSettings

TIGHT = SolverSettings(rtol=1e-10, atol=1e-10)
MU = 1.0 / (50 * 365)  # a life expectancy of 50 years

SIR_VITAL = f"""
name = "sir_vital"
compartments = ["S", "I", "R"]

[parameters]
beta = {{ value = 0.5, transform = "softplus" }}
gamma = {{ value = 0.1, transform = "softplus" }}
mu = {{ value = {MU!r}, fixed = true }}
N = {{ value = 1000000.0, fixed = true }}

[[infections]]
from = "S"
to = "I"
transmission = "beta"
infectious = ["I"]
normalize = "population"
population = "N"

[[transitions]]
from = "I"
to = "R"
rate = "gamma"

[[inflows]]
name = "births"
to = "S"
rate = "mu * N"

[[outflows]]
name = "deaths"
rate = "mu"

[initial]
S = "N - 100"
I = "100"
"""


def model_of(text: str, path: str = "models/x.toml"):
    return compile_model(loads_model(text, path=path))


def ode_solve(model, ts, covariates=None, rtol=1e-9, atol=1e-6):
    """The model solved by the ODE core at save times `ts` (sparse saves)."""
    params = model.init_params(1)
    args, inputs = model.precompute(params, covariates or {}, 1)
    y0 = model.initial_state(params, None, 1)
    ctrl = PIDController(rtol=rtol, atol=atol)
    run = jax.jit(
        lambda y0, args, inputs: solve(
            model.vector_field,
            y0,
            args,
            ts=ts,
            inputs=inputs,
            stepsize_controller=ctrl,
            max_steps=100_000,
        )
    )
    return run, (y0, args, inputs)


# -- births and deaths ------------------------------------------------------------
def test_births_equal_deaths_keep_n_and_reach_the_endemic_equilibrium():
    """dS = mu N - beta S I / N - mu S, dI = beta S I / N - (gamma + mu) I,
    dR = gamma I - mu R: N stays at its start, and the equilibrium is
    S* = N / R0, I* = mu N (R0 - 1) / beta, R* = gamma I* / mu with
    R0 = beta / (gamma + mu) (from dI = 0 and dS = 0)."""
    model = model_of(SIR_VITAL)
    ts = np.arange(0.0, 200 * 365 + 1, 365.0)
    run, operands = ode_solve(model, ts)
    sol = run(*operands)
    got = {c: np.asarray(sol.ys[c][:, 0, 0]) for c in "SIR"}
    N, beta, gamma = 1e6, 0.5, 0.1
    np.testing.assert_allclose(sum(got.values()), N, rtol=1e-12)
    R0 = beta / (gamma + MU)
    want = {"S": N / R0, "I": MU * N * (R0 - 1) / beta}
    want["R"] = gamma * want["I"] / MU
    for c, w in want.items():
        assert abs(got[c][-1] / w - 1) < 0.01, (c, got[c][-1], w)
    assert abs(got["I"][-1] / want["I"] - 1) < 2e-3  # measured 8e-4
    assert got["I"].min() < 1e-6 * want["I"]  # the first epidemic burnt out deeply
    # the flows of births and deaths are observable (accumulated exactly)
    observed = SIR_VITAL + (
        '\n[[observations]]\nname = "b"\nkind = "flow"\ntransition = "births->S"\n'
        '[[observations]]\nname = "d"\nkind = "flow"\ntransition = "I->deaths"\n'
    )
    model = model_of(observed)
    run, operands = ode_solve(model, np.arange(0.0, 31.0), rtol=1e-11, atol=1e-9)
    sol = run(*operands)
    np.testing.assert_allclose(sol.ys["births->S"][:, 0, 0], MU * N * sol.ts, rtol=1e-9)
    daily = model.observe(sol.ys)
    np.testing.assert_allclose(daily["b"][:, 0], MU * N, rtol=1e-9)
    assert daily["d"].shape == (30, 1) and float(daily["d"].min()) > 0


def _reference(f, y0, days, rtol=1e-12):
    sol = solve_ivp(
        f,
        (0, days - 1),
        y0,
        t_eval=np.arange(days),
        method="DOP853",
        rtol=rtol,
        atol=1e-12,
    )
    assert sol.success
    return sol.y


def test_importations_start_an_epidemic_and_agree_with_solve_ivp():
    text = """
    name = "seir_imported"
    compartments = ["S", "E", "I", "R"]
    [parameters]
    beta = { value = 0.4, transform = "softplus" }
    iota = { value = 0.5, transform = "softplus" }
    [[infections]]
    from = "S"
    to = "E"
    transmission = "beta"
    infectious = ["I"]
    normalize = "population"
    population = 1000.0
    [[transitions]]
    from = "E"
    to = "I"
    rate = 0.25
    [[transitions]]
    from = "I"
    to = "R"
    rate = 0.2
    [[inflows]]
    name = "imported"
    to = "E"
    rate = "iota"
    [initial]
    S = 1000.0
    [[observations]]
    name = "imports"
    kind = "flow"
    transition = "imported->E"
    """
    days = 120
    problem = Problem(model_of(text), None, days=days)
    params = problem.init_params()
    sol = problem.solve(params, TIGHT)

    def f(t, y):
        s, e, i, r = y
        new = 0.4 * s * i / 1000.0
        return [-new, new - 0.25 * e + 0.5, 0.25 * e - 0.2 * i, 0.2 * i]

    ref = _reference(f, [1000.0, 0, 0, 0], days)
    for k, c in enumerate("SEIR"):
        np.testing.assert_allclose(sol.ys[c][:, 0, 0], ref[k], rtol=1e-7, atol=1e-8)
    total = sum(sol.ys[c][:, 0, 0] for c in "SEIR")
    np.testing.assert_allclose(total, 1000.0 + 0.5 * problem.ts, rtol=1e-10)
    imports = problem.predict(params, sol.ys)["imports"][:, 0]
    np.testing.assert_allclose(imports, 0.5, rtol=1e-9)
    # an epidemic from no one: far above the 0.5 / 0.2 imports alone would hold
    assert float(sol.ys["I"].max()) > 10 * 0.5 / 0.2


def test_deaths_from_chosen_compartments_only():
    text = """
    name = "sir_deaths"
    compartments = ["S", "I", "R"]
    [parameters]
    beta = { value = 0.3, transform = "softplus" }
    alpha = { value = 0.02, transform = "softplus" }
    [[infections]]
    from = "S"
    to = "I"
    transmission = "beta"
    infectious = ["I"]
    [[transitions]]
    from = "I"
    to = "R"
    rate = 0.1
    [[outflows]]
    name = "died"
    from = ["I"]
    rate = "alpha"
    [initial]
    S = 0.99
    I = 0.01
    [[observations]]
    name = "deaths"
    kind = "flow"
    transition = "I->died"
    """
    days = 200
    model = model_of(text)
    assert [r.compartment for r in model.plan.removals] == ["I"]
    problem = Problem(model, None, days=days)
    params = problem.init_params()
    sol = problem.solve(params, TIGHT)

    def f(t, y):
        s, i, r, d = y
        new = 0.3 * s * i
        return [-new, new - 0.1 * i - 0.02 * i, 0.1 * i, 0.02 * i]

    ref = _reference(f, [0.99, 0.01, 0, 0], days)
    for k, c in enumerate("SIR"):
        np.testing.assert_allclose(sol.ys[c][:, 0, 0], ref[k], rtol=1e-7, atol=1e-10)
    total = sum(sol.ys[c][:, 0, 0] for c in "SIR")
    # what left the population is what the observed flow counts
    np.testing.assert_allclose(1.0 - total, sol.ys["I->died"][:, 0, 0], atol=1e-12)
    deaths = problem.predict(params, sol.ys)["deaths"][:, 0]
    np.testing.assert_allclose(deaths, np.diff(ref[3]), rtol=1e-6, atol=1e-12)


def test_chains_get_inflows_into_stage_one_and_lose_every_stage():
    spec = (
        ModelBuilder("chain")
        .compartment("S")
        .compartment("E", 3)
        .compartment("R")
        .parameter("mu", 0.1, fixed=True)
        .transition("E", "R", rate=0.3, rate_per="stage")
        .inflow("E", "2 * mu", name="imported")
        .outflow("mu", from_=["E", "R"])
        .build()
    )
    model = compile_model(spec)
    args, _ = model.precompute(model.init_params(2), {}, 2)
    y = {
        "S": jnp.full((1, 2), 5.0),
        "E": jnp.asarray([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]),
        "R": jnp.full((1, 2), 7.0),
    }
    dy = model.vector_field(0.0, y, args, None)
    E = np.asarray(y["E"])
    want = np.zeros((3, 2))
    want[0] += 0.2  # the inflow enters stage 1
    want[1:] += 0.3 * E[:-1]  # progression
    want -= (0.3 + 0.1) * E  # progression and deaths from every stage
    np.testing.assert_allclose(dy["E"], want, rtol=1e-14)
    np.testing.assert_allclose(dy["S"], 0.0)  # not listed in `from`
    np.testing.assert_allclose(dy["R"][0], 0.3 * E[-1] - 0.1 * 7.0, rtol=1e-14)
    # the open balance: d(total)/dt = inflow - outflow
    total = sum(v.sum(axis=0) for v in dy.values())
    np.testing.assert_allclose(total, 0.2 - 0.1 * (E.sum(axis=0) + 7.0), rtol=1e-13)
    assert not spec.closed


# -- forcing through a covariate ----------------------------------------------------
SEIR_FORCED = f"""
name = "seir_forced"
compartments = ["S", "E", "I", "R"]
[parameters]
beta = {{ value = 3.0, transform = "softplus" }}
b1 = {{ value = 0.2, transform = "softplus" }}
sigma = {{ value = 0.125, fixed = true }}
gamma = {{ value = 0.2, fixed = true }}
mu = {{ value = {MU!r}, fixed = true }}
N = {{ value = 1000000.0, fixed = true }}
[covariates]
term = {{ dims = ["time"], rule = "floor" }}
[[infections]]
from = "S"
to = "E"
transmission = "beta * (1 + b1 * term)"
infectious = ["I"]
normalize = "population"
population = "N"
[[transitions]]
from = "E"
to = "I"
rate = "sigma"
[[transitions]]
from = "I"
to = "R"
rate = "gamma"
[[inflows]]
to = "S"
rate = "mu * N"
[[outflows]]
rate = "mu"
[initial]
S = "0.07 * N"
E = "400"
I = "250"
R = "0.93 * N - 650"
"""


def school_term(days: int) -> np.ndarray:
    """+1 in term, -1 in the holidays: three terms a year, 6 changes."""
    doy = np.arange(days) % 365
    term = ((doy >= 6) & (doy < 100)) | ((doy >= 115) & (doy < 200))
    term |= (doy >= 252) & (doy < 356)
    return np.where(term, 1.0, -1.0)


def term_reference(term: np.ndarray) -> dict[int, float]:
    """`I` of SEIR_FORCED on the days `d % 365 == 0` before the last day, by
    `solve_ivp` (DOP853, rtol 1e-11) run piece by piece between the term's
    changes (the term constant on each piece)."""
    beta, b1, sigma, gamma, N = 3.0, 0.2, 0.125, 0.2, 1e6
    days = term.size
    changes = np.concatenate([[0], np.nonzero(np.diff(term))[0] + 1, [days - 1]])
    y = [0.07 * N, 400.0, 250.0, 0.93 * N - 650.0]
    yearly = {}
    for a, b in zip(changes[:-1], changes[1:], strict=True):
        force = beta * (1 + b1 * term[a])

        def f(t, y, force=force):
            s, e, i, r = y
            new = force * s * i / N
            return [
                MU * N - new - MU * s,
                new - (sigma + MU) * e,
                sigma * e - (gamma + MU) * i,
                gamma * i - MU * r,
            ]

        at = [d for d in range(a, b) if d % 365 == 0] + [b]
        piece = solve_ivp(
            f, (a, b), y, method="DOP853", rtol=1e-11, atol=1e-9, t_eval=at
        )
        yearly |= {d: piece.y[2, k] for k, d in enumerate(at[:-1])}
        y = piece.y[:, -1]
    return yearly


def term_problem(days: int, term: np.ndarray | None = None) -> Problem:
    """SEIR_FORCED bound to a daily `term` covariate (default `school_term`)."""
    term = school_term(days) if term is None else term
    time_axis = pd.date_range("2000-01-01", periods=days)
    data = xr.Dataset({"term": ("time", term)}, {"time": time_axis})
    return Problem(model_of(SEIR_FORCED), data)


def test_seasonal_forcing_by_a_term_covariate_over_20_years():
    """The transmission `beta * (1 + b1 * term)` of a daily covariate: the
    solve agrees with `solve_ivp` run piece by piece between the term's
    changes. `Problem` merges the per-day inputs onto the term's 120
    changes (`Problem.breaks`), so with daily saves (7299 segments, each
    save a segment end) the solver restarts on 120 days only and hands its
    last stage on elsewhere. Measured (2 cores, float64, rtol 1e-8): 8372
    steps, 51079 right-hand sides, 16 ms a solve; 58257 right-hand sides
    and 35 ms on the daily grid (`Problem.breaks = None`, a restart every
    day), the same states."""
    days = 20 * 365
    term = school_term(days)
    problem = term_problem(days, term)
    params = problem.init_params()
    settings = SolverSettings(rtol=1e-8, atol=1e-6)
    run = jax.jit(lambda p, a: problem.solve(p, settings, arrays=a))
    sol = jax.block_until_ready(run(params, problem.arrays))
    assert int(sol.stats["num_segments"]) == days - 1
    assert int(sol.stats["num_input_changes"]) == np.count_nonzero(np.diff(term))
    states = {c: np.asarray(sol.ys[c][:, 0, 0]) for c in "SEIR"}
    np.testing.assert_allclose(sum(states.values()), 1e6, rtol=1e-10)
    infectious = states["I"]
    yearly = term_reference(term)
    days_saved = np.asarray(sorted(yearly))
    want = np.asarray([yearly[d] for d in days_saved])
    np.testing.assert_allclose(infectious[days_saved], want, rtol=1e-5)
    assert infectious.max() > 3 * infectious.min() > 0  # epidemics every year or two


def test_merged_term_days_give_the_same_solve_in_fewer_segments():
    """Saved once a year, the ODE core's solve of the inputs merged onto the
    term's changes (`precompute(..., breaks=break_days(...))`) has 133
    segments instead of 7299 (the daily grid) and equals the daily grid's
    solve."""
    days = 20 * 365
    term = school_term(days)
    model = model_of(SEIR_FORCED)
    covariates = {"term": jnp.asarray(term)}
    ts = np.arange(0.0, days, 365.0)
    run, (y0, args, inputs) = ode_solve(model, ts, covariates, rtol=1e-8)
    daily = run(y0, args, inputs)
    changes = np.concatenate([[0], np.nonzero(np.diff(term))[0] + 1])
    breaks = break_days(model, covariates, days)
    assert breaks == tuple(changes)
    _, merged = model.precompute(model.init_params(1), covariates, 1, breaks=breaks)
    assert merged.times == tuple(changes.astype(float))
    fewer = run(y0, args, merged)
    assert int(daily.stats["num_segments"]) == ts[-1]
    bounds = np.union1d(ts, changes[changes < ts[-1]])
    assert int(fewer.stats["num_segments"]) == bounds.size - 1 == 133
    # a different grid: the same solution within the solver's tolerance
    np.testing.assert_allclose(fewer.ys["I"], daily.ys["I"], rtol=1e-6)


# -- rates that read the state ------------------------------------------------
SIRV = """
name = "sirv"
compartments = ["S", "I", "R", "V"]
[parameters]
beta = { value = 0.3, transform = "softplus" }
gamma = { value = 0.1, transform = "softplus" }
k = { value = 20.0, transform = "softplus" }
eff = { value = 0.9, transform = "sigmoid" }
N = { value = 1000.0, fixed = true }
[covariates]
doses = { dims = ["time"], rule = "floor" }
[[infections]]
from = "S"
to = "I"
transmission = "beta * exp(-k * I / N)"
infectious = ["I"]
normalize = "population"
population = "N"
[[transitions]]
from = "I"
to = "R"
rate = "gamma"
[[transitions]]
from = "S"
to = "V"
rate = "eff * doses / S"
[initial]
S = "N - 10"
I = "10"
[[observations]]
name = "cases"
kind = "flow"
transition = "S->I"
family = "poisson"
[[observations]]
name = "vaccinated"
kind = "flow"
transition = "S->V"
"""


def _sirv_dataset(days: int, cases=None) -> xr.Dataset:
    doses = np.where(np.arange(days) < 20, 0.0, 3.0)  # a campaign from day 20
    cases = np.full(days, 5.0) if cases is None else cases
    vaccinated = np.r_[np.nan, 0.8 * doses[:-1] + 0.1]
    return xr.Dataset(
        {
            "doses": ("time", doses),
            "cases": ("time", cases),
            "vaccinated": ("time", vaccinated),
        },
        coords={"time": pd.date_range("2021-01-04", periods=days)},
    )


def test_vaccination_by_doses_and_behaviour_change_agree_with_solve_ivp():
    """`rate = "eff * doses / S"` moves `eff * doses` a day out of S; the
    transmission `beta * exp(-k * I / N)` falls with prevalence. Both read
    the state, so they are evaluated in the vector field (the plan marks
    them), with `eff`, `beta`, `k`, `N` from `args` and `doses` from the
    day's inputs."""
    days = 100
    model = model_of(SIRV)
    assert {s.key: s.state for s in model.plan.state_slots} == {
        "transitions[1].rate": ("S",),
        "infections[0].transmission": ("I",),
    }
    ds = _sirv_dataset(days)
    problem = Problem(model, ds)
    params = problem.init_params()
    args, inputs = model.precompute(params, problem.covariates, 1)
    assert "transitions[1].rate" not in args and "names.eff" in args
    assert set(inputs.values) == {"names.doses"}
    sol = problem.solve(params, TIGHT)
    doses = ds["doses"].values

    def f(t, y):
        s, i, r, v, c = y
        new = 0.3 * np.exp(-20.0 * i / 1000.0) * s * i / 1000.0
        vacc = 0.9 * doses[min(int(np.floor(t)), days - 1)]
        return [-new - vacc, new - 0.1 * i, 0.1 * i, vacc, new]

    y = [990.0, 10.0, 0.0, 0.0, 0.0]
    ref = []
    for day in range(days - 1):  # day by day: the doses jump on day 20
        piece = solve_ivp(f, (day, day + 1), y, method="DOP853", rtol=1e-12, atol=1e-12)
        ref.append(y)
        y = piece.y[:, -1]
    ref = np.asarray([*ref, y]).T
    for k, c in enumerate("SIRV"):
        np.testing.assert_allclose(sol.ys[c][:, 0, 0], ref[k], rtol=1e-8, atol=1e-8)
    assert float(sol.ys["S"].min()) > 100  # the doses never exhaust S here
    pred = problem.daily_predictions(params, sol.ys)
    np.testing.assert_allclose(pred["vaccinated"][:, 0], 0.9 * doses[:-1], atol=1e-9)
    np.testing.assert_allclose(pred["cases"][:, 0], np.diff(ref[4]), rtol=1e-7)
    # without the behaviour change (k = 0) the epidemic is larger
    assert float(pred["cases"].sum()) < 0.8 * _cases_without_behaviour(problem)


def _cases_without_behaviour(problem) -> float:
    params = problem.init_params()
    values = problem.model.constrain(params)
    params = problem.model.unconstrain({**values, "k": 1e-9})
    sol = problem.solve(params, TIGHT)
    return float(problem.daily_predictions(params, sol.ys)["cases"].sum())


def test_a_rate_dividing_by_an_empty_compartment_is_finite():
    """At `S = 0` exactly, `doses / S` is 0 by the safe division (the flow
    `rate * S` is 0, not `inf * 0 = NaN`), and so are its derivatives."""
    model = model_of(SIRV)
    params = model.init_params(2)
    covariates = {"doses": jnp.full((5,), 3.0)}
    args, inputs = model.precompute(params, covariates, 2)
    u = jax.tree_util.tree_map(lambda v: v[1], inputs.values)
    y = {
        "S": jnp.asarray([[0.0, 500.0]]),
        "I": jnp.full((1, 2), 10.0),
        "R": jnp.zeros((1, 2)),
        "V": jnp.zeros((1, 2)),
        "S->I": jnp.zeros((1, 2)),
        "S->V": jnp.zeros((1, 2)),
    }
    dy = model.vector_field(1.0, y, args, u)
    assert all(bool(jnp.all(jnp.isfinite(v))) for v in dy.values())
    np.testing.assert_allclose(dy["S->V"][0], [0.0, 0.9 * 3.0], rtol=1e-12)
    np.testing.assert_allclose(dy["V"][0], [0.0, 0.9 * 3.0], rtol=1e-12)

    def total(params, y):
        args, inputs = model.precompute(params, covariates, 2)
        u = jax.tree_util.tree_map(lambda v: v[1], inputs.values)
        return sum(v.sum() for v in model.vector_field(1.0, y, args, u).values())

    grads = jax.grad(total, argnums=(0, 1))(params, y)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))


# The gradients through rates that read the state (`eff * doses / S`,
# `beta * exp(-k * I / N)`) across the five adjoints, against finite
# differences: test_adjoints_models.py::
# test_gradients_of_reported_open_and_time_varying_pieces_agree_across_adjoints
# (one model with the pieces of issues 19 and 20, one compiled gradient per
# adjoint).


def test_frequency_dependence_on_a_changing_total_agrees_with_solve_ivp():
    """`population = "S + I + R"`: the force of infection divides by the
    live total, which births at a constant 20 a day and deaths at 1% a day
    move from 1000 towards 2000."""
    text = """
    name = "sir_growing"
    compartments = ["S", "I", "R"]
    [parameters]
    beta = { value = 0.4, transform = "softplus" }
    [[infections]]
    from = "S"
    to = "I"
    transmission = "beta"
    infectious = ["I"]
    normalize = "population"
    population = "S + I + R"
    [[transitions]]
    from = "I"
    to = "R"
    rate = 0.2
    [[inflows]]
    to = "S"
    rate = 20.0
    [[outflows]]
    rate = 0.01
    [initial]
    S = 990.0
    I = 10.0
    """
    days = 150
    model = model_of(text)
    assert [s.state for s in model.plan.state_slots] == [("I", "R", "S")]
    problem = Problem(model, None, days=days)
    sol = problem.solve(problem.init_params(), TIGHT)

    def f(t, y):
        s, i, r = y
        new = 0.4 * s * i / (s + i + r)
        return [20.0 - new - 0.01 * s, new - 0.21 * i, 0.2 * i - 0.01 * r]

    ref = _reference(f, [990.0, 10.0, 0.0], days)
    for k, c in enumerate("SIR"):
        np.testing.assert_allclose(sol.ys[c][:, 0, 0], ref[k], rtol=1e-7, atol=1e-8)
    total = ref.sum(axis=0)
    np.testing.assert_allclose(total, 2000.0 - 1000.0 * np.exp(-0.01 * problem.ts))


# -- reading -------------------------------------------------------------------
def test_the_builder_writes_the_same_open_model_as_toml():
    built = (
        ModelBuilder("sir_vital")
        .compartment("S")
        .compartment("I")
        .compartment("R")
        .parameter("beta", 0.5, transform="softplus")
        .parameter("gamma", 0.1, transform="softplus")
        .parameter("mu", MU, fixed=True)
        .parameter("N", 1e6, fixed=True)
        .infection(
            "S",
            "I",
            transmission="beta",
            infectious=["I"],
            normalize="population",
            population="N",
        )
        .transition("I", "R", rate="gamma")
        .inflow("S", "mu * N", name="births")
        .outflow("mu", name="deaths")
        .initial("S", "N - 100")
        .initial("I", "100")
        .build()
    )
    spec = loads_model(SIR_VITAL, path="x.toml")
    assert built == spec
    assert spec.outflows[0].sources == ("S", "I", "R")  # default: every one
    assert spec.inflows[0].name == "births" and not spec.closed


BASE = """
name = "x"
compartments = ["S", "I", "R"]
[parameters]
beta = { value = 0.3, transform = "softplus" }
mu = { value = 0.01, fixed = true }
[[infections]]
from = "S"
to = "I"
transmission = "beta"
infectious = ["I"]
"""


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            '[[inflows]]\nto = "Q"\nrate = "mu"',
            r"inflows\[0\]\.to: unknown compartment 'Q'; known: S, I, R",
        ),
        (
            '[[inflows]]\nto = "S"',
            r"inflows\[0\]\.rate: missing required field 'rate'",
        ),
        (
            '[[inflows]]\nto = "S"\nrate = "mu"\nnumber = 3',
            r"inflows\[0\]\.number: unknown field 'number'; expected one of: to, rate, "
            "name",
        ),
        (
            '[[inflows]]\nto = "S"\nrate = "-mu"',
            r"inflows\[0\]\.rate: a rate must be >= 0, but '-mu' is -0\.01",
        ),
        (
            '[[inflows]]\nname = "I"\nto = "S"\nrate = "mu"',
            r"inflows\[0\]\.name: 'I' is already a compartment; the label names",
        ),
        (
            '[[outflows]]\nfrom = ["S", "S"]\nrate = "mu"',
            r"outflows\[0\]\.from: repeated compartment in \['S', 'S'\]",
        ),
        (
            '[[outflows]]\nfrom = "X"\nrate = "mu"',
            r"outflows\[0\]\.from: unknown compartment 'X'",
        ),
        (
            '[[outflows]]\nrate = "mu / T"',
            r"outflows\[0\]\.rate: unknown name 'T' in expression 'mu / T'; known: S, "
            r"I, R, beta, mu",
        ),
        (  # a derived series (it reads I) cannot feed a rate
            '[derived]\nprevalence = "I / 1000"\n[[outflows]]\nrate = "prevalence"',
            r"outflows\[0\]\.rate: 'prevalence' \(a derived series\) cannot be used",
        ),
        (
            '[initial]\nS = "1 - I"',
            r"initial\.S: 'I' \(a compartment\) cannot be used in an initial "
            "condition",
        ),
        (
            '[[outflows]]\nrate = "mu"\n[[observations]]\nname = "d"\nkind = "flow"\n'
            'transition = "I->died"',
            r"observations\[0\]\.transition: unknown compartment 'died'",
        ),
        (
            '[[outflows]]\nrate = "mu"\n[[observations]]\nname = "d"\nkind = "flow"\n'
            'transition = "outside->I"',
            r"observations\[0\]\.transition: the model has no flow outside->I; its "
            r"flows: S->I, S->outside, "
            r"I->outside, R->outside",
        ),
        (
            '[[inflows]]\nname = "births"\nto = "S"\nrate = "mu"\n[[observations]]\n'
            'name = "c"\nkind = "incidence"\ncompartments = ["S"]\nsign = -1',
            r"observations\[0\]\.compartments: kind = \"incidence\" observes minus the "
            r"daily change of S, which is not a count of events: they also have "
            r"inflows births->S",
        ),
    ],
)
def test_reading_errors_name_the_field(extra, message):
    with pytest.raises(ModelSpecError, match=r"^models/x\.toml: " + message):
        loads_model(BASE + extra, path="models/x.toml")


def test_a_state_rate_may_read_a_time_varying_covariate_and_a_chain_total():
    """A compartment's name is its total over its stages; inflow rates may
    read a time-varying covariate (evaluated per day in precompute)."""
    spec = (
        ModelBuilder("x")
        .compartment("S")
        .compartment("E", 2)
        .covariate("arrivals", ["time"], rule="floor")
        .parameter("c", 0.5, fixed=True)
        .transition("S", "E", rate="c * E / (S + E)")
        .transition("E", "S", rate=0.0, rate_per="stage")
        .inflow("E", "arrivals")
        .build()
    )
    model = compile_model(spec)
    args, inputs = model.precompute(model.init_params(1), {"arrivals": [1.0, 4.0]})
    assert set(inputs.values) == {"inflows[0].rate"}  # precomputed per day
    y = {"S": jnp.full((1, 1), 3.0), "E": jnp.asarray([[1.0], [2.0]])}
    u = jax.tree_util.tree_map(lambda v: v[1], inputs.values)
    dy = model.vector_field(1.0, y, args, u)
    rate = 0.5 * 3.0 / 6.0  # E's total is 3
    np.testing.assert_allclose(dy["S"][0, 0], -rate * 3.0, rtol=1e-14)
    np.testing.assert_allclose(dy["E"][:, 0], [rate * 3.0 + 4.0, 0.0], rtol=1e-14)
