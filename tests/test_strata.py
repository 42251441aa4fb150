"""Strata beside patches (`[strata]`): the cell axis, binding, observations."""

import jax
import jax.numpy as jnp
import numpy as np
import pandas as pd
import pytest
import xarray as xr
from adjoint_cases import ADJOINT_NAMES, finite_differences
from scipy.integrate import solve_ivp

import epifit
from epifit.data import DataError
from epifit.model import ModelSpecError, loads_model
from epifit.simulation import Problem, SolverSettings

AGES = ["0-19", "20-64", "65+"]
C = np.array([[7.0, 5.0, 1.0], [2.0, 8.0, 2.0], [1.0, 4.0, 3.0]])
POP = np.array([[20000.0, 55000.0, 25000.0], [10000.0, 30000.0, 5000.0]])
T = 60
TIGHT = SolverSettings(rtol=1e-10, atol=1e-10)
REGION = "models/seir_age_region.toml"


def region_data(pop=POP, **extra) -> xr.Dataset:
    n = pop.shape[0]
    return xr.Dataset(
        {
            "population": (("patch", "age"), pop),
            "contacts": (("age", "age_to"), C),
            "cases": (("time", "patch"), np.ones((T, n))),
            "cases_by_age": (("time", "patch", "age"), np.ones((T, n, 3))),
            **extra,
        },
        coords={
            "patch": [f"r{i}" for i in range(n)],
            "age": AGES,
            "age_to": AGES,
            "time": pd.date_range("2021-01-04", periods=T),
        },
    )


def test_strata_equal_ages_laid_along_the_patch_axis():
    text = open("models/seir_age3.toml").read()
    laid = xr.Dataset(
        {
            "population": ("patch", POP[0]),
            "contacts": (("patch", "patch_to"), C),
            "cases": (("time", "patch"), np.ones((T, 3))),
        },
        coords={"patch": AGES, "patch_to": AGES, "time": np.arange(T)},
    )
    strata = text.replace(
        "[parameters]", '[strata]\nage = ["0-19", "20-64", "65+"]\n\n[parameters]'
    )
    strata = strata.replace('dims = ["patch"]', 'dims = ["age"]')
    strata = strata.replace('["patch", "patch_to"]', '["age", "age_to"]')
    strata = strata.replace("per_patch = true", "per_stratum = true")
    strata = strata.replace('family = "poisson"', 'family = "poisson"\nstrata = "each"')
    spec = loads_model(strata, name="seir_age3_strata")
    by_age = xr.Dataset(
        {
            "population": ("age", POP[0]),
            "contacts": (("age", "age_to"), C),
            "cases": (("time", "age"), np.ones((T, 3))),
        },
        coords={"age": AGES, "age_to": AGES, "time": np.arange(T)},
    )
    a = Problem("models/seir_age3.toml", laid)
    b = Problem(spec, by_age)
    assert b.n_patches == 1 and b.n_cells == 3
    sa = a.solve(a.init_params(), TIGHT).ys
    sb = b.solve(b.init_params(), TIGHT).ys
    for k in ("S", "E", "I", "R"):
        np.testing.assert_allclose(sb[k], sa[k], rtol=1e-10, atol=1e-10)
    pa = a.predict(a.init_params(), sa)["cases"]
    pb = b.predict(b.init_params(), sb)["cases"]
    np.testing.assert_allclose(pb, pa, rtol=1e-10)


def test_age_by_region_matches_a_hand_written_right_hand_side():
    problem = Problem(REGION, region_data())
    params = problem.init_params()
    values = problem.model.constrain(params)
    q, susc = np.asarray(values["q"]), np.asarray(values["susceptibility"])
    assert q.shape == (2,) and susc.shape == (3,)

    def rhs(t, y):
        S, E, inf_, R = y.reshape(4, 2, 3)
        lam = q[:, None] * susc[None, :] * ((inf_ / POP) @ C.T)
        inf = lam * S
        return np.stack(
            [-inf, inf - 0.25 * E, 0.25 * E - 0.2 * inf_, 0.2 * inf_]
        ).ravel()

    y0 = np.stack([POP - 10, 0 * POP, 0 * POP + 10, 0 * POP]).ravel()
    ref = solve_ivp(rhs, (0, T - 1), y0, t_eval=np.arange(T), rtol=1e-11, atol=1e-9)
    out = epifit.simulate(REGION, region_data(), rtol=1e-10, atol=1e-10)
    want = ref.y.T.reshape(T, 4, 2, 3)
    for j, k in enumerate("SEIR"):
        assert out[k].dims == ("time", "patch", "age")
        np.testing.assert_allclose(out[k].values, want[:, j], rtol=1e-7, atol=1e-5)


def test_observations_summed_and_per_stratum():
    problem = Problem(REGION, region_data())
    params = problem.init_params()
    pred = problem.predict(params, problem.solve(params, TIGHT).ys)
    each, total = np.asarray(pred["cases_by_age"]), np.asarray(pred["cases"])
    assert each.shape == (T - 1, 6) and total.shape == (T - 1, 2)
    np.testing.assert_allclose(each.reshape(T - 1, 2, 3).sum(-1), total, rtol=1e-12)
    assert problem.observed["cases_by_age"].shape == (T - 1, 6)


def test_per_stratum_and_per_patch_parameters_reach_their_cells():
    problem = Problem(REGION, region_data())
    params = problem.init_params()
    params = {**params, "q": params["q"] + jnp.array([0.0, 1.0])}
    cells = problem.model.cell_values(params)
    np.testing.assert_allclose(cells["susceptibility"], [0.8, 1.0, 1.2] * 2)
    q = np.asarray(problem.model.constrain(params)["q"])
    np.testing.assert_allclose(cells["q"], np.repeat(q, 3))


# The gradient in per-stratum parameters against central differences, for the
# default (checkpoint) adjoint and the other four:
# test_gradient_in_per_stratum_parameters_agrees_across_adjoints below (one
# compiled gradient per adjoint; it replaces an uncompiled copy of its
# checkpoint case, the same assertion at a third of its time).


def _strata_model(extra: str, strata: str = '[strata]\nage = ["a", "b"]\n') -> str:
    return (
        'name = "m"\ncompartments = ["S", "I"]\n'
        + strata
        + "[parameters]\nbeta = { value = 0.1 }\n"
        + extra
        + '[[infections]]\nfrom = "S"\nto = "I"\ntransmission = "beta"\n'
        'infectious = ["I"]\n'
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            _strata_model("", "[strata]\nage = []\n"),
            "strata.age: expected a non-empty array",
        ),
        (_strata_model("", '[strata]\nage = ["a", "a"]\n'), "labels repeat"),
        (_strata_model("", '[strata]\npatch = ["a"]\n'), "not a usable axis name"),
        (
            _strata_model("g = { value = [1.0, 2.0, 3.0], per_stratum = true }\n"),
            "parameters.g.value: has 3 values but [strata] age has 2 strata",
        ),
        (
            _strata_model("g = { value = 1.0, per_stratum = true }\n", ""),
            "parameters.g.per_stratum: per_stratum = true needs a [strata] table",
        ),
    ],
)
def test_reading_errors_name_the_field(text, message):
    with pytest.raises(ModelSpecError) as e:
        loads_model(text)
    assert message in str(e.value)


def test_binding_refuses_strata_labels_other_than_the_model_s():
    data = region_data().assign_coords(age=["kids", "adults", "old"], age_to=AGES)
    with pytest.raises(DataError, match=r"dim 'age' of .* has labels"):
        Problem(REGION, data)


def test_binding_reorders_strata_labels():
    data = region_data()
    flipped = data.isel(age=[2, 1, 0])
    a, b = Problem(REGION, data), Problem(REGION, flipped)
    np.testing.assert_array_equal(
        a.covariates["population"], b.covariates["population"]
    )


@pytest.mark.slow  # five adjoints compiled (~43 s on one core, with a sixth)
def test_gradient_in_per_stratum_parameters_agrees_across_adjoints():
    """The same gradient from each of the five adjoints, within the error of
    the adjoint ODE's tolerance, and each against central differences."""
    problem = Problem(REGION, region_data())
    params = problem.init_params()
    x0 = params["susceptibility"]

    def loss(x, settings):
        p = {**params, "susceptibility": x}
        return jnp.sum(problem.predict(p, problem.solve(p, settings).ys)["cases"])

    grads, value_and_grad = {}, {}
    for adjoint in ADJOINT_NAMES:
        settings = SolverSettings(rtol=1e-10, atol=1e-10, adjoint=adjoint)
        f = jax.jit(jax.value_and_grad(lambda x, s=settings: loss(x, s)))
        value_and_grad[adjoint] = f
        grads[adjoint] = np.asarray(f(x0)[1])
    # the loss is the same function for every adjoint: the checkpoint's compiled
    # value gives the central differences (no sixth compile)
    fd = finite_differences(lambda x: value_and_grad["checkpoint"](x)[0], x0, eps=1e-5)
    for adjoint, g in grads.items():
        np.testing.assert_allclose(g, fd, rtol=1e-5, err_msg=adjoint)
        np.testing.assert_allclose(g, grads["checkpoint"], rtol=1e-6, err_msg=adjoint)
