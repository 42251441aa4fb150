"""Patch couplings in a model with strata: `kron(M, C)` (a coupling naming a
matrix over patches and a contact matrix over strata), applied without the
(cell x cell) matrix. References: the dense `np.kron(M, C)` built by hand, a
right-hand side written out for scipy's `solve_ivp`, numpy eigenvalues of the
next-generation matrix, central finite differences."""

import jax
import jax.numpy as jnp
import numpy as np
import pandas as pd
import pytest
import xarray as xr
from adjoint_cases import finite_differences, rel_error
from scipy.integrate import solve_ivp

import epifit
from epifit.model import (
    KronCoupling,
    ModelSpecError,
    SparseCoupling,
    basic_reproduction_number,
    loads_model,
    reproduction_number,
    sparse_coupling,
)
from epifit.model._coupling import coupled_mass
from epifit.simulation import Problem, SolverSettings

AGES = ["0-19", "20-64", "65+"]
C = np.array([[7.0, 5.0, 1.0], [2.0, 8.0, 2.0], [1.0, 4.0, 3.0]])
POP = np.array([[20000.0, 55000.0, 25000.0], [10000.0, 30000.0, 5000.0]])
M = np.array([[0.9, 0.1], [0.05, 0.95]])
T = 60
TIGHT = SolverSettings(rtol=1e-10, atol=1e-10)
TRAVEL = "models/seir_age_travel.toml"
SIGMA, GAMMA = 0.25, 0.2  # the model file's fixed rates


def travel_data(pop=POP, travel=M, contacts=C, **extra) -> xr.Dataset:
    n = pop.shape[0]
    regions = [f"r{i}" for i in range(n)]
    t_dims = (
        ("patch", "patch_to") if np.ndim(travel) == 2 else ("time", "patch", "patch_to")
    )
    c_dims = ("age", "age_to") if np.ndim(contacts) == 2 else ("time", "age", "age_to")
    return xr.Dataset(
        {
            "population": (("patch", "age"), pop),
            "contacts": (c_dims, contacts),
            "travel": (t_dims, travel),
            "cases": (("time", "patch"), np.ones((T, n))),
            "cases_by_age": (("time", "patch", "age"), np.ones((T, n, 3))),
            **extra,
        },
        coords={
            "patch": regions,
            "patch_to": regions,
            "age": AGES,
            "age_to": AGES,
            "time": pd.date_range("2021-01-04", periods=T),
        },
    )


def _model_text(**edits) -> str:
    text = open(TRAVEL).read()
    for old, new in edits.items():
        text = text.replace(old, new)
    return text


def test_kron_product_equals_the_dense_kronecker_matrix():
    rng = np.random.default_rng(0)
    P, S = 12, 3
    ring = np.eye(P) + np.roll(np.eye(P), 1, axis=1) + np.roll(np.eye(P), -1, axis=1)
    dense_m = ring * rng.uniform(size=(P, P))  # 3 links per row: sparse
    sparse_m = sparse_coupling(dense_m)
    assert isinstance(sparse_m, SparseCoupling)
    c = rng.uniform(size=(S, S))
    i = jnp.asarray(rng.uniform(size=P * S))
    scale = jnp.asarray(rng.uniform(size=P * S))
    K = np.kron(dense_m, c)
    for m in (jnp.asarray(dense_m), sparse_m):
        for sym in (False, True):
            got = coupled_mass(
                i,
                KronCoupling(m, jnp.asarray(c)),
                scale,
                symmetrize=sym,
                multiplier=1.5,
            )
            want = 1.5 * np.asarray(scale) * ((K + K.T if sym else K) @ np.asarray(i))
            np.testing.assert_allclose(got, want, rtol=1e-13)


def test_age_by_travelling_regions_matches_a_hand_written_right_hand_side():
    problem = Problem(TRAVEL, travel_data())
    assert problem.covariates["travel"].shape == (2, 2)  # never on the cells
    assert problem.covariates["contacts"].shape == (3, 3)
    values = problem.model.cell_values(problem.init_params())
    beta = np.asarray(values["q"]) * np.asarray(values["susceptibility"])
    K = np.kron(M, C)
    N = POP.ravel()

    def rhs(t, y):
        S, E, inf_, R = y.reshape(4, 6)
        new = beta * (K @ (inf_ / N)) * S
        return np.concatenate(
            [-new, new - SIGMA * E, SIGMA * E - GAMMA * inf_, GAMMA * inf_]
        )

    y0 = np.concatenate([N - 10, 0 * N, 0 * N + 10, 0 * N])
    ref = solve_ivp(rhs, (0, T - 1), y0, t_eval=np.arange(T), rtol=1e-11, atol=1e-9)
    out = epifit.simulate(TRAVEL, travel_data(), rtol=1e-10, atol=1e-10)
    want = ref.y.T.reshape(T, 4, 2, 3)
    for j, k in enumerate("SEIR"):
        assert out[k].dims == ("time", "patch", "age")
        np.testing.assert_allclose(out[k].values, want[:, j], rtol=1e-7, atol=1e-5)
    # travel couples the regions: without it (M = I) region r1 runs its own course
    alone = epifit.simulate(TRAVEL, travel_data(travel=np.eye(2)), rtol=1e-10)
    assert np.max(np.abs(alone["I"].values - out["I"].values)) > 1.0


def _vector_field_against_dense(problem, day, travel_of_day, contacts_of_day):
    params = problem.init_params()
    args, inputs = problem.model.precompute(params, problem.covariates, problem.n_cells)
    u = None if inputs is None else jax.tree.map(lambda a: a[day], inputs.values)
    rng = np.random.default_rng(day)
    y = {c: jnp.asarray(rng.uniform(1, 1000, (1, problem.n_cells))) for c in "SEIR"}
    dy = problem.model.vector_field(float(day), y, args, u)
    values = problem.model.cell_values(params)
    beta = np.asarray(values["q"]) * np.asarray(values["susceptibility"])
    K = np.kron(travel_of_day, contacts_of_day)
    N = np.asarray(problem.covariates["population"])
    want = -beta * (K @ (np.asarray(y["I"][0]) / N)) * np.asarray(y["S"][0])
    return np.asarray(dy["S"][0]), want


def test_time_varying_travel_and_contacts_are_read_per_day():
    rng = np.random.default_rng(3)
    travel = M[None] * rng.uniform(0.5, 1.5, (T, 1, 1))
    contacts = C[None] * rng.uniform(0.5, 1.5, (T, 1, 1))
    text = _model_text(
        **{
            'contacts = { dims = ["age", "age_to"] }': 'contacts = { dims = ["time", '
            '"age", "age_to"], rule = "floor" }',
            'travel = { dims = ["patch", "patch_to"] }': 'travel = { dims = ["time", '
            '"patch", "patch_to"], rule = "floor" }',
        }
    )
    spec = loads_model(text)
    problem = Problem(spec, travel_data(travel=travel, contacts=contacts))
    got = {}
    for day in (0, 17, T - 1):
        got[day], want = _vector_field_against_dense(
            problem, day, travel[day], contacts[day]
        )
        np.testing.assert_allclose(got[day], want, rtol=1e-12)
    # the days' matrices differ, and so do the infection terms read on them
    assert not np.allclose(got[0], got[17]) and not np.allclose(got[17], got[T - 1])


def test_a_sparse_travel_matrix_stays_sparse_and_agrees():
    P = 8
    ring = np.eye(P) * 0.8 + np.roll(np.eye(P), 1, axis=1) * 0.2  # k = 2 per row
    pop = np.tile(POP[:1], (P, 1))
    problem = Problem(TRAVEL, travel_data(pop=pop, travel=ring))
    assert isinstance(problem.covariates["travel"], SparseCoupling)
    got, want = _vector_field_against_dense(problem, 0, ring, C)
    np.testing.assert_allclose(got, want, rtol=1e-12)


def _ngm(problem, params, S):
    """The next-generation matrix of SEIR over the cells, by hand: a new
    infection in cell j spends 1/gamma days infectious (E leads to I only),
    infecting cell i at beta_i S_i kron(M, C)[i, j] / N_j per day."""
    values = problem.model.cell_values(params)
    beta = np.asarray(values["q"]) * np.asarray(values["susceptibility"])
    N = np.asarray(problem.covariates["population"])
    return (beta * S)[:, None] * np.kron(M, C) / N[None, :] / GAMMA


def test_r0_agrees_with_numpy_eigenvalues_of_the_next_generation_matrix():
    problem = Problem(TRAVEL, travel_data())
    params = problem.init_params()
    initial = {"population": problem.covariates["population"]}
    r0 = basic_reproduction_number(
        problem.model, params, problem.covariates, initial=initial, n_patches=6
    )
    K = _ngm(problem, params, POP.ravel())
    np.testing.assert_allclose(r0["R0_total"], np.max(np.linalg.eigvals(K).real))
    np.testing.assert_allclose(r0["R0"], K.sum(axis=0), rtol=1e-12)
    # along a trajectory, at each day's susceptibles; every method agrees
    sol = problem.solve(params, TIGHT)
    S = np.asarray(sol.ys["S"][:, 0])
    for method in ("dense", "noda", "power"):
        r = reproduction_number(
            problem.model, sol.ys, params, problem.covariates, method=method
        )
        for day in (0, 30, T - 1):
            K = _ngm(problem, params, S[day])
            want = np.max(np.linalg.eigvals(K).real)
            # power iteration stops at a relative change of 1e-10
            np.testing.assert_allclose(r["R_eff_total"][day], want, rtol=1e-9)
            np.testing.assert_allclose(r["R_eff"][day], K.sum(axis=0), rtol=1e-12)


def test_gradients_agree_with_finite_differences():
    problem = Problem(TRAVEL, travel_data())
    params = problem.init_params()
    initial = {"population": problem.covariates["population"]}

    def r0_total(x):
        p = {**params, "susceptibility": jnp.asarray(x)}
        return basic_reproduction_number(
            problem.model, p, problem.covariates, initial=initial, n_patches=6
        )["R0_total"]

    def cases(x):
        p = {**params, "susceptibility": jnp.asarray(x)}
        pred = problem.predict(p, problem.solve(p, TIGHT).ys)
        return jnp.sum(pred["cases"]) + jnp.sum(pred["cases_by_age"][-1])

    x0 = np.asarray(params["susceptibility"])
    for f in (jax.jit(r0_total), jax.jit(cases)):
        grad = jax.jit(jax.grad(f))(jnp.asarray(x0))
        fd = finite_differences(f, x0, eps=1e-6)
        # central differences of step 1e-6: error ~ 1e-10 relative to f
        assert rel_error(grad, fd) < 1e-6, f.__name__


@pytest.mark.parametrize(
    ("edits", "message"),
    [
        (
            {'contacts = "contacts"': 'contacts = "travel"'},
            "couplings.mixing.contacts: 'travel' is not a covariate with dims "
            "['age', 'age_to']",
        ),
        (
            {'covariate = "travel"': 'covariate = "contacts"'},
            "couplings.mixing.covariate: with contacts, the covariate is the matrix "
            "over patches",
        ),
        (
            {
                "[[infections]]": '[couplings.home]\ncovariate = "contacts"\n\n'
                "[[infections]]"
            },
            "couplings.home.covariate: covariate 'contacts' is an operand of "
            "kron(M, C) in coupling 'mixing'",
        ),
    ],
)
def test_reading_errors_name_the_field(edits, message):
    with pytest.raises(ModelSpecError) as e:
        loads_model(_model_text(**edits))
    assert message in str(e.value)


def test_contacts_without_strata_are_refused():
    text = (
        'name = "m"\ncompartments = ["S", "I"]\n[parameters]\nbeta = { value = 0.1 }\n'
        '[covariates]\nM = { dims = ["patch", "patch_to"] }\n'
        '[couplings.c]\ncovariate = "M"\ncontacts = "M"\n'
        '[[infections]]\nfrom = "S"\nto = "I"\ntransmission = "beta"\n'
        'infectious = ["I"]\ncoupling = "c"\n'
    )
    with pytest.raises(
        ModelSpecError, match=r"couplings.c.contacts: .*needs a \[strata\]"
    ):
        loads_model(text)


def test_precompute_errors_name_the_covariate():
    problem = Problem(TRAVEL, travel_data())
    params = problem.init_params()
    cov = {**problem.covariates, "contacts": jnp.ones((2, 2))}
    with pytest.raises(ModelSpecError, match=r"covariates.contacts: .*over 3 strata"):
        problem.model.precompute(params, cov, 6)
    cov = {**problem.covariates, "travel": jnp.ones((3, 3))}
    with pytest.raises(
        ModelSpecError,
        match=r"covariates.travel: 3 patches x 3 strata are 9 cells, but "
        r"covariates.population has 6 cells",
    ):
        problem.model.precompute(params, cov, 6)
    cov = {**problem.covariates, "travel": jnp.ones((2, 3))}
    with pytest.raises(ModelSpecError, match=r"covariates.travel: .*not square"):
        problem.model.precompute(params, cov, 6)
