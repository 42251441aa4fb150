"""Scenarios on the 20-patch synthetic metapopulation (counts model, true
parameters from the data's attributes, no fit needed): mobility reductions
and changes to the coupling of one patch."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import equinox as eqx
import jax.numpy as jnp
import numpy as np
import pytest

import epifit
from epifit.forecasting import Change, Scenario, forecast
from epifit.ode import ConstantStepSize, Tsit5
from epifit.simulation import Problem

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "models" / "seird_metapop_counts.toml"
SYNTHETIC = REPO / "data" / "synthetic_metapop_20.nc"
N_FIT, DAYS = 90, 30


def true_params(problem: Problem, ds) -> dict:
    """The generator's parameters (`true_parameters`: constrained values, the
    MLP as nested lists) in the model's unconstrained coordinates."""
    truth = json.loads(ds.attrs["true_parameters"])
    model = problem.model
    params = problem.init_params()
    values = dict(model.constrain(params))
    for p in problem.spec.parameters:
        values[p.name] = jnp.asarray(truth[p.name], float)
    out = model.unconstrain(values)
    mlp = params["beta"]
    for k, layer in enumerate(truth["beta"]["layers"]):
        w, b = jnp.asarray(layer["weight"]), jnp.asarray(layer["bias"])
        mlp = eqx.tree_at(
            lambda m, k=k: (m.layers[k].weight, m.layers[k].bias), mlp, (w, b)
        )
    out["beta"] = mlp
    return out


@pytest.fixture(scope="module")
def data():
    return epifit.open_dataset(SYNTHETIC)


@pytest.fixture(scope="module")
def problem(data):
    return Problem(MODEL, data)


def test_true_parameters_reproduce_the_noise_free_data(problem, data):
    params = true_params(problem, data)
    ds = forecast(problem, params=params, days=1, samples=0)
    got = ds["estimate_new_infections"].sel(scenario="baseline").values[1:N_FIT]
    want = data["true_new_infections"].values[1:]
    # the generator solved at rtol 1e-10, the forecast at rtol 1e-6
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-2)


def test_mobility_reduction_lowers_the_final_size_monotonically(problem, data):
    factors = (1.0, 0.8, 0.6, 0.4, 0.2)
    scenarios = [
        Scenario(f"mobility_{f:g}", [Change(covariate="mobility", scale=f)])
        for f in factors
    ]
    ds = forecast(
        problem,
        scenarios,
        params=true_params(problem, data),
        days=DAYS,
        samples=0,
        compartments=["S"],
        baseline=False,
    )
    cases = ds["cumulative_new_infections_total"].sel(quantile=0.5).values
    deaths = ds["cumulative_new_deaths_total"].sel(quantile=0.5).values
    s_end = ds["estimate_S"].values[:, -1, :]  # (scenario, patch) fractions
    assert np.all(np.diff(cases) < 0), cases
    assert np.all(np.diff(deaths) < 0), deaths
    # every patch keeps more susceptibles the lower the mobility
    assert np.all(np.diff(s_end, axis=0) > 0)
    # the fit window is untouched (with the nearest rule, day 90 starts at t = 89.5)
    est = ds["estimate_new_infections"].values
    assert np.array_equal(
        est[:, :N_FIT],
        np.broadcast_to(est[0, :N_FIT], est[:, :N_FIT].shape),
        equal_nan=True,
    )


def test_inflow_change_reaches_only_coupled_patches(data):
    # p18 (seeded: an epidemic of its own) cut off from every other patch
    cut = data.copy(deep=True)
    k = list(cut["patch"].values).index("p18")
    cut["coupling"][:, k, :] = 0.0
    cut["coupling"][:, :, k] = 0.0
    problem = Problem(MODEL, cut)
    scenarios = [
        Scenario(
            "p03_imports_x3", [Change(covariate="coupling", inflow=["p03"], scale=3.0)]
        ),
        Scenario(
            "p03_isolated",
            [Change(covariate="coupling", inflow=["p03"], outflow=["p03"], scale=0.0)],
        ),
    ]
    # fixed steps: the step sequence then does not depend on the other patches,
    # and a patch that sees none of them computes the very same numbers
    ds = forecast(
        problem,
        scenarios,
        params=true_params(problem, data),
        days=DAYS,
        samples=0,
        compartments=["S", "E"],
        solver=Tsit5(),
        stepsize_controller=ConstantStepSize(0.25),
    )
    est = ds["estimate_new_infections"]
    base = est.sel(scenario="baseline")
    for name in ("p03_imports_x3", "p03_isolated"):
        sc = est.sel(scenario=name)
        p18 = np.abs(sc.sel(patch="p18") - base.sel(patch="p18")).max()
        assert float(p18) <= 1e-12 * float(np.abs(base.sel(patch="p18")).max())
        for c in ("S", "E"):
            a = ds[f"estimate_{c}"].sel(scenario=name, patch="p18").values
            b = ds[f"estimate_{c}"].sel(scenario="baseline", patch="p18").values
            assert np.max(np.abs(a - b)) <= 1e-12 * np.max(np.abs(b))
        # p03 itself and its neighbours change (by more than solver tolerance)
        for p in ("p03", "p02", "p04"):
            rel = (
                np.abs(sc.sel(patch=p) - base.sel(patch=p)).max()
                / base.sel(patch=p).max()
            )
            assert float(rel) > 1e-3, (name, p, float(rel))
        # nothing changes before the forecast start
        assert np.array_equal(sc.values[:N_FIT], base.values[:N_FIT], equal_nan=True)
    more = ds["cumulative_new_infections"].sel(quantile=0.5, patch="p03")
    assert more.sel(scenario="p03_imports_x3") > more.sel(scenario="baseline")
    assert more.sel(scenario="p03_isolated") < more.sel(scenario="baseline")


def test_example_scenarios_and_an_ensemble_in_chunks(problem, data):
    params = true_params(problem, data)
    # a small diagonal covariance around the truth for the 3 + 20 + 176 free entries
    n = 3 + 20 + 176
    cov = np.diag(np.full(n, 0.02**2))
    kw = dict(params=params, covariance=cov, samples=5, seed=0, days=30)
    a = forecast(
        problem, REPO / "models" / "scenarios_example.toml", **kw, chunk_size=2
    )
    assert list(a.scenario.values) == [
        "baseline",
        "distancing",
        "lockdown_p03",
        "travel_restrictions",
    ]
    assert a.attrs["days"] == 30 and a.sizes["time"] == N_FIT + 30
    assert a["failed_samples"].values.tolist() == [0, 0, 0, 0]
    cum = a["cumulative_new_infections"].sel(quantile=0.5)
    assert cum.sel(scenario="distancing", patch="p03") < cum.sel(
        scenario="baseline", patch="p03"
    )
    assert cum.sel(scenario="lockdown_p03", patch="p03") < cum.sel(
        scenario="baseline", patch="p03"
    )
    b = forecast(
        problem, REPO / "models" / "scenarios_example.toml", **kw, chunk_size=6
    )
    # chunks of 2 (the last padded) or one chunk: the same draws, the same result
    np.testing.assert_allclose(
        a["new_infections"].values, b["new_infections"].values, rtol=1e-6
    )


def test_sparse_and_dense_coupling_give_the_same_forecast(problem, data):
    from epifit.forecasting import prepare_forecast
    from epifit.model import SparseCoupling, sparse_coupling

    dense = np.asarray(problem.covariates["coupling"])
    sparse = copy.copy(problem)
    sparse.covariates = {
        **problem.covariates,
        "coupling": sparse_coupling(dense, max_density=1.0),
    }
    assert isinstance(sparse.covariates["coupling"], SparseCoupling)
    scenarios = [
        Scenario(
            "s",
            [
                Change(covariate="coupling", inflow=["p03"], scale=0.0, end=100),
                Change(covariate="coupling", outflow=["p05"], value=0.01, start=100),
            ],
        )
    ]
    params = true_params(problem, data)
    kw = dict(params=params, days=DAYS, samples=0)
    prep = prepare_forecast(problem, scenarios, **kw)
    c = prep.bound.data(1)["covariates"]["coupling"]
    linked = np.any(dense != 0, axis=0)[:, 5]  # who receives from p05 at all
    assert np.all(c[100:, linked, 5] == 0.01)
    assert np.all(c[100:, ~linked, 5] == 0)  # a value creates no new links
    assert np.all(c[N_FIT:100, 3, :] == 0)
    a = prep.run()
    b = forecast(sparse, scenarios, **kw)
    # the same model; only the order of the coupling sums differs
    np.testing.assert_allclose(
        b["estimate_new_infections"].values,
        a["estimate_new_infections"].values,
        rtol=1e-8,
        atol=1e-6,
    )
