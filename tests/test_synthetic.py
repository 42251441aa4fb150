"""The synthetic metapopulation generator, `epifit.simulation.synthetic_metapopulation`.

References the library did not compute: the reference vector field written out
in NumPy and solved with scipy's DOP853, an MLP evaluated in NumPy from the
weights stored as JSON, and the moments of the noise distributions.

Every generated dataset here has 3 patches and 30 days, so the solve compiles
once per session.
"""

import importlib.util
import json

import equinox as eqx
import jax
import numpy as np
import pytest
import xarray as xr
from helpers import MODELS, REPO, tree_allclose
from scipy.integrate import solve_ivp

from epifit.data import open_dataset, validate_dataset
from epifit.model import compile_model, load_model
from epifit.simulation import Problem, synthetic_metapopulation

MODEL = MODELS / "seird_metapop_mobility.toml"
COMMITTED = REPO / "data" / "synthetic_metapop_20.nc"
N_PATCHES, N_DAYS = 3, 30
GENERATOR_RTOL = 1e-10  # synthetic_metapopulation's solver tolerance
CHAINS = {"ID": 7, "IR": 5}


def generate(**kw):
    kw = {"seed": 0, **kw}
    return synthetic_metapopulation(MODEL, N_PATCHES, N_DAYS, **kw)


@pytest.fixture(scope="module")
def model():
    return compile_model(load_model(MODEL))


@pytest.fixture(scope="module")
def generated():
    return generate()


def model_needs(model):
    """What the reference model reads from a dataset, as validate_dataset wants it."""
    return dict(
        observations={o.name: ("time", "patch") for o in model.observations},
        covariates={c.name: c.dims for c in model.covariates}
        | {"population": ("patch",)},
        sizes={"feature": 7},
    )


# -- NumPy references ---------------------------------------------------------------
def softplus(x):
    return np.logaddexp(0.0, x)


def mlp_numpy(layers, x):
    """The true MLP from its JSON weights: swish hidden layers, softplus output."""
    h = x
    for k, layer in enumerate(layers):
        h = h @ np.asarray(layer["weight"]).T + np.asarray(layer["bias"])
        h = h / (1.0 + np.exp(-h)) if k < len(layers) - 1 else softplus(h)
    return h[..., 0]


def reference_series(ds):
    """New infections and deaths (fractions) of the reference model, from the
    dataset's covariates, initial state and JSON parameters, solved with scipy."""
    p = json.loads(ds.attrs["true_parameters"])
    kappa, alpha, gamma = p["kappa"], p["alpha"], p["gamma"]
    scaler = np.asarray(p["scaler"])
    eta = -np.log(-np.expm1(-kappa * alpha)) / gamma  # as in the model file
    beta = mlp_numpy(p["beta"]["layers"], ds["mobility"].values)  # (time, patch)
    coupling = ds["coupling"].transpose("time", "patch", "patch_to").values
    n = ds.sizes["patch"]

    def rhs(t, u, day):
        s, e, idc, d, irc, r = np.split(u.reshape(16, n), [1, 2, 9, 10, 15])
        i = idc[:3].sum(0) + irc.sum(0)
        force = beta[day] * (i + 2.0 * scaler * (coupling[day] @ i))  # counted twice
        du = np.empty((16, n))
        du[0] = -force * s[0]
        du[1] = force * s[0] - (kappa * alpha + gamma * eta) * e[0]
        du[2] = kappa * (alpha * e[0] - idc[0])
        du[3:9] = kappa * (idc[:-1] - idc[1:])
        du[9] = kappa * idc[-1]
        du[10] = gamma * (eta * e[0] - irc[0])
        du[11:15] = gamma * (irc[:-1] - irc[1:])
        du[15] = gamma * irc[-1]
        return du.ravel()

    u = np.concatenate(
        [np.atleast_2d(ds[f"initial_{c}"].values) for c in ("S", "E", "ID", "D")]
        + [np.atleast_2d(ds[f"initial_{c}"].values) for c in ("IR", "R")]
    ).ravel()
    out = [u]
    t_end = ds.sizes["time"] - 1
    for k in range(t_end):
        # "nearest" rule: day k holds on [k - 1/2, k + 1/2)
        for day, (t0, t1) in ((k, (k, k + 0.5)), (k + 1, (k + 0.5, k + 1))):
            sol = solve_ivp(
                rhs, (t0, t1), u, method="DOP853", rtol=1e-12, atol=1e-15, args=(day,)
            )
            u = sol.y[:, -1]
        out.append(u)
    ys = np.stack(out).reshape(-1, 16, n)
    return {
        "new_infections": -np.diff(ys[:, 0], axis=0),
        "new_deaths": np.diff(ys[:, 9], axis=0),
    }


# -- reproducibility ----------------------------------------------------------------
def test_same_seed_gives_identical_dataset(generated):
    ds, truth = generated
    again, truth_again = generate()
    xr.testing.assert_identical(ds, again)
    assert ds.attrs == again.attrs
    arrays = eqx.filter(truth, eqx.is_array), eqx.filter(truth_again, eqx.is_array)
    assert tree_allclose(*arrays, rtol=0.0)


def test_different_seeds_differ(generated):
    ds, _ = generated
    other, _ = generate(seed=1, noise="negative_binomial", dispersion=5.0)
    for name in ("mobility", "coupling", "population", "true_new_infections"):
        assert not np.allclose(ds[name].values, other[name].values, equal_nan=True)
    assert ds.attrs["true_parameters"] != other.attrs["true_parameters"]


# -- conventions --------------------------------------------------------------------
def test_dims_coords_and_validation(generated, model):
    ds, _ = generated
    expected_dims = {
        "new_infections": ("time", "patch"),
        "true_new_infections": ("time", "patch"),
        "new_deaths": ("time", "patch"),
        "true_new_deaths": ("time", "patch"),
        "mobility": ("time", "patch", "feature"),
        "coupling": ("time", "patch", "patch_to"),
        "population": ("patch",),
        "initial_S": ("patch",),
        "initial_E": ("patch",),
        "initial_ID": ("stage_ID", "patch"),
        "initial_D": ("patch",),
        "initial_IR": ("stage_IR", "patch"),
        "initial_R": ("patch",),
    }
    assert {k: ds[k].dims for k in ds.data_vars} == expected_dims
    assert dict(ds.sizes) == {
        "time": N_DAYS,
        "patch": N_PATCHES,
        "patch_to": N_PATCHES,
        "feature": 7,
        "stage_ID": 7,
        "stage_IR": 5,
    }
    assert np.issubdtype(ds["time"].dtype, np.datetime64)
    assert (np.diff(ds["time"].values) == np.timedelta64(1, "D")).all()
    assert ds["patch"].values.tolist() == ["p0", "p1", "p2"]
    assert ds["patch_to"].values.tolist() == ds["patch"].values.tolist()
    bound = validate_dataset(ds, patches=N_PATCHES, **model_needs(model))
    assert bound.times.tolist() == list(range(N_DAYS))
    # incidence has no value on day 0: masked, and only there
    for name in ("new_infections", "new_deaths"):
        assert not bound.mask[name][0].any() and bound.mask[name][1:].all()
    problem = Problem(model, ds)  # the fitting layer binds it as it is
    assert problem.n_patches == N_PATCHES
    assert problem.initial_data["initial_ID"].shape == (7, N_PATCHES)


def test_covariates_and_initial_state(generated):
    ds, _ = generated
    mobility = ds["mobility"].values
    assert mobility.min() >= 0.0 and mobility.max() <= 1.0
    # the lockdown dip: mean mobility on days 25-29 below days 0-4
    daily = mobility.mean(axis=(1, 2))
    assert daily[25:].mean() < daily[:5].mean() - 0.1
    coupling = ds["coupling"].values
    assert (coupling >= 0).all()
    assert (np.diagonal(coupling, axis1=1, axis2=2) == 0).all()  # self is local
    row_sums = coupling.sum(axis=2)
    assert 0.01 < row_sums.min() and row_sums.max() < 0.5  # 0.05-0.3, modulated
    assert (ds["population"].values >= 1000).all()
    total = sum(
        ds[f"initial_{c}"].values.reshape(-1, N_PATCHES).sum(0)
        for c in ("S", "E", "ID", "D", "IR", "R")
    )
    np.testing.assert_allclose(total, 1.0, rtol=1e-15)  # fractions of each patch
    seeded = ds["initial_E"].values > 0
    assert seeded.sum() == 2  # 5 % of the patches, at least 2
    assert (
        (ds["initial_E"].values[seeded] >= 2e-4)
        & (ds["initial_E"].values[seeded] <= 1e-3)
    ).all()


def test_true_parameters_in_attributes(generated, model):
    ds, truth = generated
    stored = json.loads(ds.attrs["true_parameters"])
    values = model.constrain(truth)
    assert {k: stored[k] for k in ("kappa", "alpha", "gamma")} == pytest.approx(
        {k: float(values[k]) for k in ("kappa", "alpha", "gamma")}, rel=1e-15
    )
    assert stored["kappa"] == pytest.approx(0.5) and stored["gamma"] == pytest.approx(
        1.5
    )
    np.testing.assert_array_equal(stored["scaler"], np.asarray(values["scaler"]))
    for layer, linear in zip(
        stored["beta"]["layers"], truth["beta"].layers, strict=True
    ):
        np.testing.assert_array_equal(layer["weight"], np.asarray(linear.weight))
        np.testing.assert_array_equal(layer["bias"], np.asarray(linear.bias))
    eta = json.loads(ds.attrs["true_derived"])["eta"]
    kappa, alpha, gamma = stored["kappa"], stored["alpha"], stored["gamma"]
    assert eta == pytest.approx(-np.log(-np.expm1(-kappa * alpha)) / gamma, rel=1e-14)
    assert ds.attrs["observation_scale"] == "population"


def test_true_beta_is_realistic_and_rises_with_mobility(generated):
    ds, _ = generated
    layers = json.loads(ds.attrs["true_parameters"])["beta"]["layers"]
    mobility = ds["mobility"].values
    beta = mlp_numpy(layers, mobility)
    lo, hi = np.percentile(beta, [2.0, 98.0])
    # calibrated on the pre-activation; percentiles commute with softplus only up
    # to the linear interpolation between neighbouring points
    assert lo == pytest.approx(0.22, abs=2e-3) and hi == pytest.approx(0.55, abs=2e-3)
    assert np.corrcoef(beta.ravel(), mobility.mean(-1).ravel())[0, 1] > 0


def test_params_override_the_drawn_truth(generated):
    ds, truth = generated
    mlp = eqx.tree_at(lambda m: m.layers[-1].bias, truth["beta"], np.array([-1.0]))
    scaler = [0.5, 1.0, 2.0]
    other, _ = generate(params={"kappa": 0.4, "scaler": scaler, "beta": mlp})
    stored = json.loads(other.attrs["true_parameters"])
    assert stored["kappa"] == pytest.approx(0.4, rel=1e-14)
    assert stored["scaler"] == pytest.approx(scaler, rel=1e-14)
    assert stored["beta"]["layers"][-1]["bias"] == [-1.0]
    before = json.loads(ds.attrs["true_parameters"])
    assert stored["alpha"] == before["alpha"] and stored["gamma"] == before["gamma"]
    # the other draws are unchanged
    for name in ("mobility", "coupling", "population", "initial_E"):
        xr.testing.assert_identical(other[name], ds[name])
    assert not np.allclose(
        other["true_new_deaths"][1:], ds["true_new_deaths"][1:], rtol=1e-3
    )


# -- the truth against an independent solve -------------------------------------------
def test_noise_free_series_match_scipy(generated):
    ds, _ = generated
    reference = reference_series(ds)
    population = ds["population"].values
    for name, expected in reference.items():
        truth = ds[f"true_{name}"].values
        assert np.isnan(truth[0]).all()  # no incidence before the first day
        fraction = truth[1:] / population
        # the states are fractions <= 1, solved at rtol 1e-10 (scipy at 1e-12):
        # 10 x rtol bounds the error of a daily difference; incidence peaks are
        # 1e-4 (deaths) to 5e-2 (infections) per day (measured error: ~1e-13)
        np.testing.assert_allclose(fraction, expected, rtol=0, atol=10 * GENERATOR_RTOL)


# -- noise ---------------------------------------------------------------------------
def test_poisson_noise_is_unbiased(generated):
    ds, _ = generated
    mu = np.concatenate(
        [ds[f"true_{n}"].values[1:].ravel() for n in ("new_infections", "new_deaths")]
    )
    y = np.concatenate(
        [ds[n].values[1:].ravel() for n in ("new_infections", "new_deaths")]
    )
    assert np.isnan(ds["new_infections"].values[0]).all()
    assert (y >= 0).all() and (y == np.round(y)).all()
    # the total of independent Poisson counts is Poisson(sum mu): 4-sigma bounds
    assert abs(y.sum() - mu.sum()) < 4.0 * np.sqrt(mu.sum())
    big = mu > 1.0  # Pearson residuals have variance 1
    pearson = (y[big] - mu[big]) / np.sqrt(mu[big])
    n = big.sum()
    assert n > 50
    assert abs(pearson.mean()) < 4.0 / np.sqrt(n)
    assert abs(np.mean(pearson**2) - 1.0) < 4.0 * np.sqrt(3.0 / n)  # var <= 2 + 1/mu


def test_negative_binomial_noise_is_overdispersed():
    ds, _ = generate(seed=1, noise="negative_binomial", dispersion=5.0)
    assert ds.attrs["noise"] == "negative_binomial" and ds.attrs["dispersion"] == 5.0
    mu = ds["true_new_infections"].values[1:].ravel()
    y = ds["new_infections"].values[1:].ravel()
    variance = mu + mu**2 / 5.0
    assert abs(y.sum() - mu.sum()) < 4.0 * np.sqrt(variance.sum())
    big = mu > 20.0  # there, the Poisson part alone would give a ratio near 0.05-0.2
    ratio = np.mean((y[big] - mu[big]) ** 2 / variance[big])
    assert 0.5 < ratio < 2.0


def test_gaussian_noise_keeps_the_truth(generated):
    ds, _ = generated
    gauss, _ = generate(noise="gaussian", dispersion=0.1)
    for name in ("new_infections", "new_deaths"):
        xr.testing.assert_identical(gauss[f"true_{name}"], ds[f"true_{name}"])
        mu = ds[f"true_{name}"].values[1:]
        sd = 0.1 * mu.mean()
        y = gauss[name].values[1:]
        far = mu > 4.0 * sd  # never clipped at 0
        z = (y[far] - mu[far]) / sd
        assert far.sum() > 20
        assert abs(z.mean()) < 4.0 / np.sqrt(far.sum())
        assert 0.6 < z.std() < 1.4


# -- errors ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw, error, match",
    [
        ({"noise": "lognormal"}, ValueError, "Unknown noise 'lognormal'; choose one"),
        ({"dispersion": 2.0}, ValueError, "noise='poisson' has no dispersion"),
        (
            {"noise": "negative_binomial", "dispersion": 0.0},
            ValueError,
            "dispersion must be > 0",
        ),
        ({"params": {"kapa": 0.4}}, ValueError, r"Unknown parameters \['kapa'\]"),
        ({"params": {"scaler": [1.0, 2.0]}}, ValueError, "'scaler' has shape"),
    ],
)
def test_bad_arguments(kw, error, match):
    with pytest.raises(error, match=match):
        generate(**kw)


@pytest.mark.parametrize("n_patches, n_days", [(0, 10), (3, 1)])
def test_bad_sizes(n_patches, n_days):
    with pytest.raises(ValueError, match="must be >= "):
        synthetic_metapopulation(MODEL, n_patches, n_days, seed=0)


# -- the script and the committed dataset --------------------------------------------
def test_script_writes_the_library_dataset(tmp_path, generated):
    spec = importlib.util.spec_from_file_location(
        "make_synthetic", REPO / "data" / "make_synthetic.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "s.nc"
    argv = ["--patches", "3", "--days", "30", "--seed", "0", "--out", str(out)]
    assert module.main(argv) == 0
    written = open_dataset(out)
    assert written.attrs.pop("history").startswith("data/make_synthetic.py --patches 3")
    xr.testing.assert_identical(written, generated[0])


def test_committed_dataset(model):
    assert COMMITTED.stat().st_size < 2_000_000
    ds = open_dataset(COMMITTED)
    assert dict(ds.sizes)["patch"] == 20 and dict(ds.sizes)["time"] == 90
    assert ds.attrs["seed"] == 0 and ds.attrs["noise"] == "poisson"
    validate_dataset(ds, patches=20, **model_needs(model))
    stored = json.loads(ds.attrs["true_parameters"])
    assert len(stored["scaler"]) == 20
    assert [np.shape(layer["weight"]) for layer in stored["beta"]["layers"]] == [
        (7, 7),
        (7, 7),
        (7, 7),
        (1, 7),
    ]


def test_load_params_keeps_neural_submodels(generated):
    """Overriding some rates of a model with an MLP keeps the MLP as it was;
    naming the MLP in the values is a clear error."""
    from epifit.data import DataError
    from epifit.simulation import load_params

    problem = Problem(MODEL, generated[0])
    base = problem.init_params()
    params = load_params(problem, {"kappa": 0.6, "gamma": 1.4})
    values = problem.model.constrain(params)
    assert np.isclose(float(values["kappa"]), 0.6)
    assert np.isclose(float(values["gamma"]), 1.4)
    leaves = [
        jax.tree_util.tree_leaves(eqx.filter(p["beta"], eqx.is_array))
        for p in (params, base)
    ]
    assert len(leaves[0]) == 8 and tree_allclose(leaves[0], leaves[1], rtol=0.0)
    with pytest.raises(DataError, match="'beta'.*neural sub-model"):
        load_params(problem, {"beta": 0.3})
