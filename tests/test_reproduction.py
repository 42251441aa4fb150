"""The reproduction number from the declared model (`epifit.model._reproduction`):
closed forms, hand-built next-generation matrices, gradients, the reference
metapopulation model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import MODELS

from epifit.model import (
    basic_reproduction_number,
    compile_model,
    has_reproduction_number,
    load_model,
    loads_model,
    reproduction_number,
)
from epifit.model._reproduction import infected_states
from epifit.ode import solve


def _model(text: str):
    return compile_model(loads_model('name = "m"\n' + text))


def _values(model, n_patches=1, **values):
    """Unconstrained parameters with these constrained values."""
    v = model.constrain(model.init_params(n_patches))
    v = {k: v[k] for k in [p.name for p in model.spec.parameters]}
    v.update({k: jnp.asarray(x, float) for k, x in values.items()})
    return model.unconstrain(v)


SEIR = """
compartments = [
    "S", {{ name = "E", stages = {k} }}, {{ name = "I", stages = {m} }}, "R"
]
[parameters]
N = {{ value = 1000.0, fixed = true }}
beta = {{ value = 0.6, transform = "softplus" }}
sigma = {{ value = 0.4, transform = "softplus" }}
gamma = {{ value = 0.2, transform = "softplus" }}
[[infections]]
from = "S"
to = "E"
transmission = "beta"
infectious = ["I"]
normalize = "population"
population = "N"
[[transitions]]
from = "E"
to = "I"
rate = "sigma"
{per_e}
[[transitions]]
from = "I"
to = "R"
rate = "gamma"
{per_i}
[initial]
S = "N - 1"
I = 1.0
"""


def _seir(k=1, m=1, rate_per="chain"):
    per = f'rate_per = "{rate_per}"'
    return _model(
        SEIR.format(k=k, m=m, per_e=per if k > 1 else "", per_i=per if m > 1 else "")
    )


def test_r0_sir_is_beta_over_gamma():
    model = compile_model(load_model(MODELS / "sir.toml"))
    params = _values(model, beta=1.7, gamma=0.45)
    r0 = basic_reproduction_number(model, params)
    np.testing.assert_allclose(r0["R0"], [1.7 / 0.45], rtol=1e-12)
    np.testing.assert_allclose(r0["R0_total"], 1.7 / 0.45, rtol=1e-12)


@pytest.mark.parametrize("k, m", [(1, 1), (3, 1), (1, 4), (3, 4)])
def test_r0_boxcar_seir_chain_convention_is_beta_over_gamma(k, m):
    model = _seir(k, m, "chain")
    params = _values(model, beta=0.6, sigma=0.4, gamma=0.2)
    assert len(infected_states(model.plan, model.stages)) == k + m
    r0 = basic_reproduction_number(model, params)
    np.testing.assert_allclose(r0["R0_total"], 0.6 / 0.2, rtol=1e-12)


def test_r0_seir_per_stage_rates():
    # each of the m stages left at gamma: mean time infectious m / gamma
    model = _seir(2, 3, "stage")
    params = _values(model, beta=0.6, sigma=0.4, gamma=0.2)
    r0 = basic_reproduction_number(model, params)
    np.testing.assert_allclose(r0["R0_total"], 0.6 * 3 / 0.2, rtol=1e-12)


BRANCHED = """
compartments = [
    "S", "E", { name = "I", stages = 3 }, { name = "H", stages = 2 }, "R", "D"
]
[parameters]
beta = { value = 0.5, transform = "softplus" }
sigma = { value = 0.3, transform = "softplus" }
gamma = { value = 0.25, transform = "softplus" }
eta = { value = 0.1, transform = "softplus" }
p = { value = 0.2, transform = "sigmoid" }
w = { value = 0.3, transform = "softplus" }
[[infections]]
from = "S"
to = "E"
transmission = "beta"
infectious = [
    { compartment = "I", stages = [1, 3] }, { compartment = "H", weight = "w" }
]
[[transitions]]
from = "E"
to = "I"
rate = "sigma"
[[transitions]]
from = "I"
rate = "gamma"
rate_per = "stage"
branches = [{ to = "H", probability = "p" }, { to = "R" }]
[[transitions]]
from = "H"
rate_per = "chain"
branches = [{ to = "D", rate = "0.25 * eta" }, { to = "R", rate = "0.75 * eta" }]
[initial]
S = 0.99
E = 0.01
"""


def test_r0_with_a_branch_and_infectious_weights():
    model = _model(BRANCHED)
    params = model.init_params(1)
    b, g, eta, p, w = 0.5, 0.25, 0.1, 0.2, 0.3
    # I: 3 stages at gamma each (1/gamma per stage), stages 1 and 3
    # infectious (stage 2 leads to 3: infected); a fraction p goes on to H: 2
    # stages left at 2 * eta (rates summed over branches), 1 / eta in all,
    # weight w
    expected = b * 0.99 * (2 / g + p * w / eta)
    r = reproduction_number(
        model, {c: y[None] for c, y in _state(model).items()}, params
    )
    np.testing.assert_allclose(r["R_eff_total"], [expected], rtol=1e-12)
    states = infected_states(model.plan, model.stages)
    assert ("R", 0) not in states and ("D", 0) not in states
    assert states[0] == ("E", 0) and len(states) == 1 + 3 + 2


def _state(model, n_patches=1):
    return {
        c: jnp.asarray(v)
        for c, v in model.initial_state(
            model.init_params(n_patches), None, n_patches
        ).items()
    }


def _solve(model, params, days, covariates=None):
    n = 1
    args, inputs = model.precompute(params, covariates, n)
    y0 = model.initial_state(params, None, n)
    sol = solve(
        model.vector_field, y0, args, ts=np.arange(days, dtype=float), inputs=inputs
    )
    return sol.ys


def test_r_eff_of_sir_is_r0_times_susceptible_fraction():
    model = compile_model(load_model(MODELS / "sir.toml"))
    params = _values(model, beta=1.7, gamma=0.45, I0=3.0)
    ys = _solve(model, params, 20)
    r = reproduction_number(model, ys, params)
    s = np.asarray(ys["S"][:, 0, 0])
    assert s[-1] < 0.5 * s[0]  # the epidemic has run: R_eff fell
    np.testing.assert_allclose(r["R_eff"][:, 0], 1.7 / 0.45 * s / 763, rtol=1e-12)
    np.testing.assert_allclose(r["R_eff_total"], r["R_eff"][:, 0], rtol=1e-12)


COUPLED = """
compartments = ["S", "E", "I", "R"]
[parameters]
beta = {{ value = [0.5, 0.8, 0.3], transform = "softplus", per_patch = true }}
sigma = {{ value = 0.4, transform = "softplus" }}
gamma = {{ value = [0.2, 0.25, 0.3], transform = "softplus", per_patch = true }}
scale = {{ value = [1.0, 0.5, 2.0], transform = "softplus", per_patch = true }}
[covariates]
N = {{ dims = ["patch"] }}
C = {{ dims = ["patch", "patch_to"] }}
[couplings.mix]
covariate = "C"
scale = "scale"
multiplier = {multiplier}
local = {local}
symmetrize = {symmetrize}
[[infections]]
from = "S"
to = "E"
transmission = "beta"
infectious = ["I"]
normalize = "population"
population = "N"
coupling = "mix"
[[transitions]]
from = "E"
to = "I"
rate = "sigma"
[[transitions]]
from = "I"
to = "R"
rate = "gamma"
[initial]
S = "N"
"""


def _hand_ngm(values, S, N, C, local, multiplier, symmetrize):
    """F V^-1 over (state in E, I) x patch, built with NumPy."""
    P = S.size
    beta, gamma = np.asarray(values["beta"]), np.asarray(values["gamma"])
    sigma, scale = float(values["sigma"]), np.asarray(values["scale"])
    Cs = C + C.T if symmetrize else C
    M = (
        beta[:, None]
        * S[:, None]
        * (local * np.eye(P) + multiplier * scale[:, None] * Cs)
        / N[None, :]
    )
    F = np.zeros((2 * P, 2 * P))
    F[:P, P:] = M  # new E from I
    V = np.zeros((2 * P, 2 * P))
    V[:P, :P] = sigma * np.eye(P)
    V[P:, :P] = -sigma * np.eye(P)
    V[P:, P:] = np.diag(gamma)
    return F @ np.linalg.inv(V)


@pytest.mark.parametrize(
    "local, multiplier, symmetrize", [(1.0, 1.0, "false"), (0.5, 2.0, "true")]
)
def test_coupled_patches_agree_with_a_hand_built_ngm(local, multiplier, symmetrize):
    model = _model(
        COUPLED.format(local=local, multiplier=multiplier, symmetrize=symmetrize)
    )
    params = model.init_params(3)
    rng = np.random.default_rng(1)
    N = np.array([1000.0, 500.0, 2000.0])
    C = rng.uniform(0.0, 0.3, (3, 3))
    S = N * np.array([0.9, 0.6, 0.8])
    ys = {c: jnp.zeros((1, 1, 3)) for c in model.compartments}
    ys["S"] = jnp.asarray(S)[None, None, :]
    values = model.constrain(params)
    K = _hand_ngm(values, S, N, C, local, multiplier, symmetrize == "true")
    expected = np.max(np.abs(np.linalg.eigvals(K)))
    cov = {"N": N, "C": C}
    for method in ("dense", "noda", "power"):
        r = reproduction_number(model, ys, params, cov, method=method)
        np.testing.assert_allclose(r["R_eff_total"], [expected], rtol=1e-9)
    # per patch: the new infections (anywhere) from one new infection in the
    # patch, the column sums of K over the E rows of the E columns
    np.testing.assert_allclose(r["R_eff"][0], K[:3, :3].sum(axis=0), rtol=1e-12)
    lo, hi = float(r["R_eff"].min()), float(r["R_eff"].max())
    assert lo <= float(r["R_eff_total"][0]) <= hi


GROUPS = """
compartments = ["S", "I", "R"]
[parameters]
q = { value = 0.05, transform = "softplus" }
gamma = { value = 0.2, transform = "softplus" }
[covariates]
N = { dims = ["patch"] }
contacts = { dims = ["patch", "patch_to"] }
[couplings.age]
covariate = "contacts"
local = 0.0
[[infections]]
from = "S"
to = "I"
transmission = "q"
infectious = ["I"]
normalize = "population"
population = "N"
coupling = "age"
[[transitions]]
from = "I"
to = "R"
rate = "gamma"
[initial]
S = "N"
"""


def test_three_groups_with_a_contact_matrix_agree_with_numpy():
    # patches as age groups: lambda_a = q * sum_b c[a, b] I_b / N_b
    model = _model(GROUPS)
    params = model.init_params(3)
    c = np.array([[12.0, 4.0, 1.0], [4.0, 8.0, 2.0], [1.0, 2.0, 5.0]])
    N = np.array([300.0, 500.0, 200.0])
    S = N.copy()
    K = 0.05 * S[:, None] * c / N[None, :] / 0.2
    r0 = basic_reproduction_number(
        model, params, {"N": N, "contacts": c}, initial={"N": N}, n_patches=3
    )
    np.testing.assert_allclose(
        r0["R0_total"], np.max(np.abs(np.linalg.eigvals(K))), rtol=1e-10
    )
    np.testing.assert_allclose(r0["R0"], K.sum(axis=0), rtol=1e-12)


def test_gradients_agree_with_finite_differences():
    model = _model(COUPLED.format(local=1.0, multiplier=1.5, symmetrize="false"))
    params = model.init_params(3)
    rng = np.random.default_rng(2)
    cov = {"N": np.array([1000.0, 500.0, 2000.0]), "C": rng.uniform(0, 0.3, (3, 3))}
    ys = {c: jnp.zeros((2, 1, 3)) for c in model.compartments}
    ys["S"] = jnp.asarray(cov["N"] * rng.uniform(0.5, 1.0, (2, 1, 3)))
    for method in ("dense", "noda", "power"):

        def total(p, method=method):
            return reproduction_number(model, ys, p, cov, method=method)[
                "R_eff_total"
            ].sum()

        grad = jax.grad(total)(params)
        for name in ("beta", "gamma", "sigma", "scale"):
            x = np.asarray(params[name], float)
            for i in np.ndindex(x.shape):
                h = 1e-6
                up, down = x.copy(), x.copy()
                up[i] += h
                down[i] -= h
                fd = (
                    total({**params, name: jnp.asarray(up)})
                    - total({**params, name: jnp.asarray(down)})
                ) / (2 * h)
                np.testing.assert_allclose(grad[name][i], fd, rtol=1e-6, atol=1e-9)


REFERENCE_INFECTED = (("E", 0), *(("ID", j) for j in range(3)))
REFERENCE_INFECTED += tuple(("IR", j) for j in range(5))


def _reference(n_patches, n_days, seed):
    """The reference model with random covariates and a random state."""
    model = compile_model(load_model(MODELS / "seird_metapop_mobility.toml"))
    rng = np.random.default_rng(seed)
    params = model.init_params(n_patches, key=jax.random.key(seed))
    cov = {
        "mobility": rng.normal(size=(n_days, n_patches, 7)),
        "coupling": rng.uniform(0, 0.2, (n_days, n_patches, n_patches)),
    }
    ys = {
        c: jnp.asarray(rng.uniform(0.0, 0.05, (n_days, k, n_patches)))
        for c, k in model.stages.items()
    }
    ys["S"] = jnp.asarray(rng.uniform(0.3, 0.95, (n_days, 1, n_patches)))
    return model, params, cov, ys


def _ngm_from_vector_field(model, params, cov, ys, day):
    """F V^-1 over the infected states x patches from the Jacobian of the
    vector field: in the reference model only the E rows receive new
    infections and no transition enters E, so F is the E rows of the
    Jacobian without their diagonal, and V = F - J."""
    n = ys["S"].shape[-1]
    args, inputs = model.precompute(params, cov, n)
    u = jax.tree.map(lambda a: a[day], inputs.values)
    y = {c: ys[c][day] for c in model.compartments}

    def f(x):
        z = dict(y)
        for i, (c, j) in enumerate(REFERENCE_INFECTED):
            z[c] = z[c].at[j].set(x[i])
        dy = model.vector_field(0.0, z, args, u)
        return jnp.stack([dy[c][j] for c, j in REFERENCE_INFECTED])

    x0 = jnp.stack([y[c][j] for c, j in REFERENCE_INFECTED])
    m = len(REFERENCE_INFECTED)
    J = np.asarray(jax.jacfwd(f)(x0)).reshape(m * n, m * n)
    F = np.zeros_like(J)
    F[:n] = J[:n]
    F[np.arange(n), np.arange(n)] = 0.0
    return F @ np.linalg.inv(F - J)


def test_reference_model_agrees_with_the_ngm_of_its_vector_field():
    model, params, cov, ys = _reference(5, 4, seed=3)
    assert infected_states(model.plan, model.stages) == REFERENCE_INFECTED
    dense = reproduction_number(model, ys, params, cov, method="dense")
    power = reproduction_number(model, ys, params, cov, method="power")
    noda = reproduction_number(model, ys, params, cov, method="noda")
    for day in range(4):
        K = _ngm_from_vector_field(model, params, cov, ys, day)
        rho = np.max(np.abs(np.linalg.eigvals(K)))
        np.testing.assert_allclose(dense["R_eff_total"][day], rho, rtol=1e-10)
        np.testing.assert_allclose(power["R_eff_total"][day], rho, rtol=1e-10)
        np.testing.assert_allclose(noda["R_eff_total"][day], rho, rtol=1e-10)
        # column sums of the E rows: new infections from one new one in p
        np.testing.assert_allclose(
            dense["R_eff"][day], K[:5, :5].sum(axis=0), rtol=1e-10
        )


def test_reference_metapopulation_runs_on_its_data():
    from epifit.simulation import Problem

    problem = Problem(
        MODELS / "seird_metapop_mobility.toml",
        MODELS.parent / "data" / "synthetic_metapop_20.nc",
    )
    params = problem.init_params()
    sol = problem.solve(params)
    r = reproduction_number(
        problem.model, sol.ys, params, problem.covariates, ts=problem.ts
    )
    total, patch = np.asarray(r["R_eff_total"]), np.asarray(r["R_eff"])
    noda = reproduction_number(
        problem.model, sol.ys, params, problem.covariates, ts=problem.ts, method="noda"
    )
    np.testing.assert_allclose(noda["R_eff_total"], total, rtol=1e-10)
    assert total.shape == (problem.ts.size,) and patch.shape == (problem.ts.size, 20)
    assert np.all(np.isfinite(total)) and np.all(total > 0)
    # the spectral radius of a non-negative matrix lies between its smallest
    # and largest column sums
    assert np.all(patch.min(axis=1) <= total * (1 + 1e-12))
    assert np.all(total <= patch.max(axis=1) * (1 + 1e-12))
    # the susceptibles are depleted: R_eff falls
    assert total[-1] < total[0]


def test_errors():
    sir = compile_model(load_model(MODELS / "sir.toml"))
    ys = {c: jnp.ones((1, 1, 1)) for c in sir.compartments}
    with pytest.raises(ValueError, match="method must be"):
        reproduction_number(sir, ys, sir.init_params(1), method="eig")
    closed = _model(
        'compartments = ["A", "B"]\n[[transitions]]\nfrom = "A"\nto = "B"\nrate = 1.0\n'
    )
    with pytest.raises(ValueError, match="no \\[\\[infections\\]\\]"):
        reproduction_number(closed, {"A": ys["S"], "B": ys["S"]}, {})


def test_simulate_writes_r_eff_and_plot_fit_draws_it(tmp_path):
    from epifit.plotting import plot_fit
    from epifit.simulation import simulate

    ds = simulate(MODELS / "sir.toml", days=15, values={"beta": 1.5, "gamma": 0.5})
    s = ds["S"].values[:, 0]
    np.testing.assert_allclose(ds["R_eff"].values[:, 0], 3.0 * s / 763, rtol=1e-12)
    np.testing.assert_allclose(ds["R_eff_total"].values, 3.0 * s / 763, rtol=1e-12)
    assert ds["R_eff"].dims == ("time", "patch") and ds["R_eff"].attrs["units"] == "1"
    fig = plot_fit(ds, tmp_path / "fig.png")
    assert [ax.get_title() for ax in fig.axes][-1] == "R_eff — p0"


def test_forecast_r_eff_follows_a_scenario_that_halves_transmission():
    from epifit.forecasting import Change, Scenario, forecast
    from epifit.simulation import Problem

    problem = Problem(
        MODELS / "sir.toml", MODELS.parent / "data" / "boarding_school_1978.nc"
    )
    params = _values(problem.model, beta=1.7, gamma=0.45, I0=2.0)
    closed = Scenario(
        "closed", [Change(transmission=True, scale=0.5, start=16, end=20)]
    )
    ds = forecast(
        problem, [closed], days=10, samples=0, params=params, compartments=["S"]
    )
    for name, days in (("baseline", []), ("closed", [16, 17, 18, 19])):
        one = ds.sel(scenario=name)
        ratio = one["estimate_R_eff"].values[:, 0] / (
            1.7 / 0.45 * one["estimate_S"].values[:, 0] / 763
        )
        expected = np.ones_like(ratio)
        expected[days] = 0.5
        np.testing.assert_allclose(ratio, expected, rtol=1e-12)
        np.testing.assert_allclose(
            one["R_eff_total"].values[0], one["estimate_R_eff_total"].values, rtol=1e-12
        )


# -- several infections ---------------------------------------------------------------
VECTOR = """
compartments = ["Sh", "Ih", "Rh", "Sv", "Iv"]
[parameters]
a = { value = [0.3, 0.2], transform = "softplus", per_patch = true }
bh = { value = 0.4, transform = "softplus" }
bv = { value = 0.5, transform = "softplus" }
gamma = { value = 0.1, transform = "softplus" }
mu = { value = [0.12, 0.2], transform = "softplus", per_patch = true }
Nh = { value = [1000.0, 800.0], fixed = true, per_patch = true }
[[infections]]
from = "Sh"
to = "Ih"
transmission = "a * bh"
infectious = ["Iv"]
normalize = "population"
population = "Nh"
[[infections]]
from = "Sv"
to = "Iv"
transmission = "a * bv"
infectious = ["Ih"]
normalize = "population"
population = "Nh"
[[transitions]]
from = "Ih"
to = "Rh"
rate = "gamma"
[[transitions]]
from = "Iv"
to = "Sv"
rate = "mu"
[initial]
Sh = "Nh - 1"
Ih = 1.0
Sv = "5 * Nh"
"""


def test_vector_borne_r_eff_agrees_with_the_ngm_of_two_infections():
    """Hosts infected by vectors and vectors by hosts (Ross-Macdonald), two
    uncoupled patches: F V^-1 over (Ih, Iv) x patch, built with NumPy from the
    trajectory's susceptibles; its Perron root is the geometric mean of the
    two transmissions, not either of them."""
    model = _model(VECTOR)
    params = model.init_params(2)
    args, inputs = model.precompute(params, None, 2)
    y0 = model.initial_state(params, None, 2)
    ts = np.arange(60.0)
    ys = solve(model.vector_field, y0, args, ts=ts, inputs=inputs).ys
    r = reproduction_number(model, ys, params)
    v = {k: np.asarray(x) for k, x in model.constrain(params).items()}
    sh, sv = np.asarray(ys["Sh"][:, 0]), np.asarray(ys["Sv"][:, 0])
    assert sh[-1, 0] < 0.9 * sh[0, 0]  # an outbreak: R_eff moves
    for t in range(ts.size):
        F, V = np.zeros((4, 4)), np.zeros((4, 4))  # rows: Ih (patches), Iv
        for p in range(2):
            F[p, 2 + p] = v["a"][p] * v["bh"] * sh[t, p] / v["Nh"][p]
            F[2 + p, p] = v["a"][p] * v["bv"] * sv[t, p] / v["Nh"][p]
            V[p, p], V[2 + p, 2 + p] = v["gamma"], v["mu"][p]
        K = F @ np.linalg.inv(V)
        rho = np.max(np.abs(np.linalg.eigvals(K)))
        np.testing.assert_allclose(r["R_eff_total"][t], rho, rtol=1e-10)
        for p in range(2):  # no coupling: each patch's own block
            block = K[np.ix_([p, 2 + p], [p, 2 + p])]
            want = np.max(np.abs(np.linalg.eigvals(block)))
            np.testing.assert_allclose(r["R_eff"][t, p], want, rtol=1e-10)
    # the closed form: host -> vector -> host over two generations, square-rooted
    closed = (
        v["a"] * np.sqrt(v["bh"] * v["bv"] * sh * sv / (v["gamma"] * v["mu"])) / v["Nh"]
    )
    np.testing.assert_allclose(r["R_eff"], closed, rtol=1e-10)


def test_off_the_cpu_noda_takes_the_place_of_eigvals(monkeypatch):
    """JAX does not lower `eigvals` on a TPU (every fit's outputs failed
    there): off the CPU (`has_eig` false) each patch's root over several
    infections and `auto`'s dense method are Noda's iteration, with the same
    values; `method="dense"` is refused with the reason."""
    import re

    import jax

    import epifit.model._reproduction as rep

    vector = _model(VECTOR)  # two infections, each feeding the other
    params = vector.init_params(2)
    args, inputs = vector.precompute(params, None, 2)
    y0 = vector.initial_state(params, None, 2)
    ys = solve(vector.vector_field, y0, args, ts=np.arange(60.0), inputs=inputs).ys
    strains = compile_model(load_model(MODELS / "two_strain.toml"))  # a diagonal K
    p2 = _values(strains, b1=0.4, b2=0.35, c=0.6, omega=0.02)
    cases = [(vector, ys, params), (strains, _solve(strains, p2, 120), p2)]

    def traced(model, ys, params):
        jaxpr = jax.make_jaxpr(lambda p: reproduction_number(model, ys, p))(params)
        return re.findall(r"\beig\[", str(jaxpr))

    want = [reproduction_number(*case) for case in cases]  # eigvals, on this CPU
    assert all(traced(*case) for case in cases)  # the check can tell the paths apart
    monkeypatch.setattr(rep, "has_eig", lambda: False)
    rep._compiled.cache_clear()
    try:
        got = [reproduction_number(*case) for case in cases]
        assert not any(traced(*case) for case in cases)
        with pytest.raises(ValueError, match="does not lower eigvals.*use 'noda'"):
            reproduction_number(vector, ys, params, method="dense")
    finally:
        rep._compiled.cache_clear()
    for w, g in zip(want, got, strict=True):
        for key in ("R_eff", "R_eff_total"):
            np.testing.assert_allclose(g[key], w[key], rtol=1e-10)


def test_two_strains_r_eff_agrees_with_the_ngm_of_three_infections():
    """`models/two_strain.toml`: strain 1 from S, strain 2 from S and (at
    reduced susceptibility c) from R1; F V^-1 over (I1, I2) from the
    trajectory, built with NumPy."""
    model = compile_model(load_model(MODELS / "two_strain.toml"))
    params = _values(model, b1=0.4, b2=0.35, c=0.6, omega=0.02)
    ys = _solve(model, params, 120)
    r = reproduction_number(model, ys, params)
    v = {k: float(np.asarray(x)) for k, x in model.constrain(params).items()}
    s, r1 = np.asarray(ys["S"][:, 0, 0]), np.asarray(ys["R1"][:, 0, 0])
    assert r1.max() > 0.1  # strain 1 has left immune people for strain 2
    for t in range(s.size):
        F = np.diag([v["b1"] * s[t], v["b2"] * (s[t] + v["c"] * r1[t])])
        K = F @ np.linalg.inv(np.diag([v["gamma"], v["gamma"]]))
        rho = np.max(np.abs(np.linalg.eigvals(K)))
        np.testing.assert_allclose(r["R_eff_total"][t], rho, rtol=1e-10)
        np.testing.assert_allclose(r["R_eff"][t, 0], rho, rtol=1e-10)


# -- the other helpers' structures: open populations, state rates, strata -----------
def test_r0_with_deaths_from_every_compartment_is_beta_over_gamma_plus_mu():
    seir = SEIR.format(k=2, m=3, per_e='rate_per = "chain"', per_i='rate_per = "chain"')
    text = seir.replace(
        "[initial]",
        '[[outflows]]\nname = "deaths"\nrate = "mu"\n[[inflows]]\nname = "births"\n'
        'to = "S"\nrate = "mu * N"\n[initial]',
    ).replace("[parameters]\n", "[parameters]\nmu = { value = 0.05, fixed = true }\n")
    model = _model(text)
    r0 = basic_reproduction_number(model, _values(model))
    # E (2 stages at 2 sigma) then I (3 stages at 3 gamma), each stage also left at mu
    p_e = (2 * 0.4 / (2 * 0.4 + 0.05)) ** 2
    t_i = sum((3 * 0.2 / (3 * 0.2 + 0.05)) ** j / (3 * 0.2 + 0.05) for j in range(3))
    np.testing.assert_allclose(r0["R0_total"], 0.6 * p_e * t_i, rtol=1e-10)


def test_no_reproduction_number_for_rates_that_read_the_state():
    model = compile_model(load_model(MODELS / "seir_vaccination.toml"))
    assert not has_reproduction_number(model)
