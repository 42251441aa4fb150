"""`models/seird_metapop_mobility.toml` against the posted reference model."""

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest
from helpers import (
    MODELS,
    params_from_flat,
    reference_covariates,
    reference_initial_data,
    reference_state,
    state_to_reference,
)

from epifit.model import compile_model, load_model

N_PATCHES, N_DAYS = 20, 30
# float64 throughout; the two implementations differ only in the order of
# floating-point operations (~1e-16 relative), far inside the required 1e-10.
RTOL = 1e-10


@pytest.fixture(scope="module")
def problem(reference_problem):
    return reference_problem.make_problem(n_patches=N_PATCHES, days=N_DAYS, seed=0)


@pytest.fixture(scope="module")
def model():
    return compile_model(load_model(MODELS / "seird_metapop_mobility.toml"))


@pytest.fixture(scope="module")
def prepared(model, problem):
    params = params_from_flat(model, problem["p_init"], N_PATCHES)
    args, inputs = model.precompute(params, reference_covariates(problem))
    return params, args, inputs


def _times(rng: np.random.Generator) -> np.ndarray:
    """50 times over the day grid, including the second half of days (where the
    reference's rint(t) moves to the next day) and the clamped ends.

    Exact half-days t = k + 1/2 are ties: rint rounds them to the even day, the
    `nearest` rule always to day k + 1. They agree only for odd k, so the exact
    ties used here are k + 1/2 with k odd; other fractions are kept 1e-3 away
    from 1/2 (the reference also rounds t to float32 before rint).
    """
    frac = rng.uniform(0.0, 1.0, size=40)
    frac = np.where(np.abs(frac - 0.5) < 1e-3, 0.25, frac)
    days = rng.integers(0, N_DAYS - 1, size=40)
    ties = np.array([1.5, 3.5, 9.5, 17.5, 27.5])
    ends = np.array([-0.3, 0.0, 0.49, N_DAYS - 1.0, N_DAYS - 0.7])
    half = np.array([4.6, 12.51, 20.75, 28.9, 6.999])
    return np.concatenate([days + frac, ties, ends, half])[:50]


def test_times_cover_half_days():
    t = _times(np.random.default_rng(0))
    assert t.size == 50
    assert np.sum(t - np.floor(t) > 0.5) >= 10


def test_nearest_rule_is_rint(prepared):
    _, _, inputs = prepared
    for t in _times(np.random.default_rng(0)):
        day = min(max(int(np.rint(np.float32(t))), 0), N_DAYS - 1)
        assert inputs.index(t) == day


def test_transmission_rate_matches_reference_mlp(reference_problem, problem, prepared):
    _, _, inputs = prepared
    beta = inputs.values["infections[0].transmission"]
    assert beta.shape == (N_DAYS, N_PATCHES)
    p_mlp = jnp.asarray(problem["p_init"][3 + N_PATCHES :])
    for day in (0, 13, N_DAYS - 1):
        ref = reference_problem.transmission_rate(
            p_mlp, jnp.asarray(problem["mobility"][..., day])
        )
        np.testing.assert_allclose(beta[day], ref, rtol=RTOL)


def test_coupling_passed_through_untouched(problem, prepared):
    _, args, inputs = prepared
    cube = inputs.values["couplings.travel.matrix"]
    np.testing.assert_array_equal(cube, reference_covariates(problem)["coupling"])
    scale = args["couplings.travel.scale"]
    assert scale.shape == (N_PATCHES,)


def test_vector_field_matches_reference(reference_problem, problem, model, prepared):
    params, args, inputs = prepared
    p = jnp.asarray(problem["p_init"])
    mobility = jnp.asarray(problem["mobility"])
    coupling = jnp.asarray(problem["coupling"])
    reference = jax.jit(reference_problem.vector_field)
    vector_field = jax.jit(model.vector_field)
    rng = np.random.default_rng(1)
    for t in _times(rng):
        u = rng.uniform(0.0, 1.0, size=(16, N_PATCHES))
        u[0] = rng.uniform(0.5, 1.0, size=N_PATCHES)  # susceptible-heavy states
        expected = reference(jnp.asarray(u), jnp.asarray(t), p, mobility, coupling)
        k = inputs.index(float(t))
        today = jtu.tree_map(lambda v, k=k: v[k], inputs.values)
        dy = vector_field(jnp.asarray(t), reference_state(u), args, today)
        got = state_to_reference(dy)
        assert got.dtype == jnp.float64
        # the exposed row is a difference of comparable terms: allow absolute
        # error at the rounding level of those terms (1e-14 of the largest)
        atol = 1e-14 * np.max(np.abs(expected))
        np.testing.assert_allclose(
            got, expected, rtol=RTOL, atol=atol, err_msg=f"t={t}"
        )


def test_initial_state_from_data(problem, model, prepared):
    params, _, _ = prepared
    y0 = model.initial_state(params, reference_initial_data(problem["u0"]), N_PATCHES)
    assert {k: v.shape for k, v in y0.items()} == model.state_shapes(N_PATCHES)
    np.testing.assert_array_equal(state_to_reference(y0), problem["u0"])


def test_observations_reproduce_reference_loss(reference_problem, problem, model):
    sol = problem["sol_true"]  # (time, 16, patch)
    data = problem["data"]  # (time - 1, 2, patch)
    predicted = model.observe(reference_state(sol))
    loss = 0.0
    for obs in model.observations:
        column = {"new_infections": 0, "new_deaths": 1}[obs.name]
        assert predicted[obs.name].shape == (N_DAYS - 1, N_PATCHES)
        loss += obs.weight * jnp.sum((predicted[obs.name] - data[:, column]) ** 2)
    expected = reference_problem.loss_from_solution(jnp.asarray(sol), jnp.asarray(data))
    np.testing.assert_allclose(loss, expected, rtol=1e-12)


def test_params_from_flat_constrains_like_reference(problem, model, prepared):
    params, _, _ = prepared
    values = model.constrain(params)
    p = problem["p_init"]
    softplus = np.logaddexp(0.0, p[:3])
    np.testing.assert_allclose(
        [values["kappa"], values["alpha"], values["gamma"]], softplus, rtol=1e-14
    )
    k, a, g = softplus
    np.testing.assert_allclose(
        values["eta"], -np.log(-np.expm1(-k * a)) / g, rtol=1e-13
    )
    np.testing.assert_allclose(
        values["scaler"], np.logaddexp(0.0, p[3 : 3 + N_PATCHES]), rtol=1e-14
    )
