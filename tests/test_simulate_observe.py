"""`epifit simulate --observe` and `epifit.simulate(observe=...)`: noise drawn
from each observation's family, a dated time axis, the model's inputs copied,
and a file that `calibrate` reads back."""

import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import xarray as xr

import epifit
from epifit.cli import main
from epifit.simulation import Problem, load_params
from epifit.simulation._noise import noise_of, observation_key, sample_noise

REPO = Path(__file__).resolve().parents[1]
SEIR = REPO / "models" / "seir.toml"

# every family, a weekly series, a covariate and the initial state from data
SIR_DATA = """\
name = "sir_data"
compartments = ["S", "I", "R"]

[parameters]
beta = { value = 0.6, transform = "softplus" }
gamma = { value = 0.2, transform = "softplus" }
phi = { value = 4.0, transform = "softplus" }
s = { value = 2.0, transform = "softplus" }

[covariates]
population = { dims = ["patch"] }
contact = { dims = ["time", "patch"], rule = "floor" }

[[infections]]
from = "S"
to = "I"
transmission = "beta * contact"
infectious = ["I"]
normalize = "population"
population = "population"

[[transitions]]
from = "I"
to = "R"
rate = "gamma"

[initial]
S = { data = "initial_S" }
I = { data = "initial_I" }

[[observations]]
name = "cases"
kind = "incidence"
compartments = ["S"]
sign = -1
family = "negative_binomial"
dispersion = "phi"

[[observations]]
name = "weekly"
kind = "incidence"
compartments = ["S"]
sign = -1
family = "poisson"
period = "week"

[[observations]]
name = "beds"
kind = "prevalence"
compartments = ["I"]
family = "gaussian"
sd = "s"

[[observations]]
name = "level"
kind = "prevalence"
compartments = ["R"]
weight = 2.0
"""
DAYS = 30


@pytest.fixture(autouse=True)
def _no_persistent_cache(monkeypatch):
    """`main` would enable JAX's persistent compilation cache for the session."""
    monkeypatch.setenv("EPIFIT_NO_CACHE", "1")


@pytest.fixture
def sir(tmp_path):
    """The model and its data: 2 patches, 20 undated days of `contact` (the
    simulation runs 30: the last day carries forward), no observations."""
    model = tmp_path / "sir_data.toml"
    model.write_text(SIR_DATA)
    contact = np.linspace(1.0, 0.6, 20)[:, None] * np.array([1.0, 0.8])
    data = xr.Dataset(
        {
            "population": ("patch", [10000.0, 5000.0], {"units": "persons"}),
            "contact": (("time", "patch"), contact),
            "initial_S": ("patch", [9990.0, 5000.0], {"units": "persons"}),
            "initial_I": ("patch", [10.0, 0.0], {"units": "persons"}),
        },
        coords={"time": np.arange(20), "patch": ["a", "b"]},
    )
    return model, epifit.write_dataset(data, tmp_path / "inputs.nc")


def error_line(capsys) -> str:
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("epifit: error: ")
    return lines[0]


# ------------------------------------------------------------------ the draws
N_DRAWS = 200_000
Z = 5.0  # standard errors allowed: a false alarm about once in 3 million


def check_moments(y, mean, var):
    """The sample mean and variance of `y` agree with `mean` and `var` within
    `Z` standard errors for `N_DRAWS` draws (the variance's from the sample's
    fourth central moment)."""
    assert y.shape == (N_DRAWS,)
    assert abs(y.mean() - mean) < Z * np.sqrt(var / N_DRAWS)
    centred = y - y.mean()
    s2 = centred.var()
    se_var = np.sqrt((np.mean(centred**4) - s2**2) / N_DRAWS)
    assert abs(s2 - var) < Z * se_var


# a JAX key (simulate, forecasts) or a NumPy generator (a posterior's
# predictive draws): the same families either way
KEYS = {
    "jax": observation_key,
    "numpy": lambda seed, index: np.random.default_rng([seed, index]),
}


@pytest.mark.parametrize("key", KEYS.values(), ids=KEYS.keys())
def test_poisson_moments(key):
    y = sample_noise(key(0, 0), "poisson", np.full(N_DRAWS, 7.5))
    assert y.dtype == np.float64 and np.array_equal(y, np.round(y))
    check_moments(y, 7.5, 7.5)


@pytest.mark.parametrize("key", KEYS.values(), ids=KEYS.keys())
def test_negative_binomial_moments(key):
    mean, phi = 20.0, 3.0
    y = sample_noise(
        key(0, 1),
        "negative_binomial",
        np.full(N_DRAWS, mean),
        dispersion=phi,
    )
    assert np.array_equal(y, np.round(y)) and y.min() >= 0
    check_moments(y, mean, mean + mean**2 / phi)


@pytest.mark.parametrize("key", KEYS.values(), ids=KEYS.keys())
def test_gaussian_moments_and_per_patch_sd(key):
    # mean 25 sd from 0: the clip at 0 never acts
    y = sample_noise(key(0, 2), "gaussian", np.full(N_DRAWS, 100.0), sd=4.0)
    check_moments(y, 100.0, 16.0)
    # a (patch,) sd broadcasts over (stamp, patch)
    y = sample_noise(
        key(0, 3),
        "gaussian",
        np.full((N_DRAWS, 2), 100.0),
        sd=np.array([1.0, 3.0]),
    )
    check_moments(y[:, 1], 100.0, 9.0)
    check_moments(y[:, 0], 100.0, 1.0)


@pytest.mark.parametrize("key", KEYS.values(), ids=KEYS.keys())
def test_draws_are_reproducible_by_seed_and_clip_at_zero(key):
    mean = np.linspace(0.0, 50.0, 100)
    a = sample_noise(key(7, 0), "poisson", mean)
    assert np.array_equal(a, sample_noise(key(7, 0), "poisson", mean))
    assert not np.array_equal(a, sample_noise(key(8, 0), "poisson", mean))
    assert not np.array_equal(a, sample_noise(key(7, 1), "poisson", mean))
    assert a[0] == 0.0  # a mean of 0 draws 0
    g = sample_noise(key(7, 0), "gaussian", np.zeros(1000), sd=1.0)
    assert g.min() == 0.0 and (g > 0).mean() == pytest.approx(0.5, abs=0.07)


def test_noise_of_reads_each_observations_family(sir):
    model, _ = sir
    spec = epifit.load_model(model)
    obs = {o.name: o for o in spec.observations}
    values = {"phi": np.float64(4.0), "s": np.float64(2.0)}
    family, kw = noise_of(obs["cases"], values, "model")
    assert (family, float(kw["dispersion"])) == ("negative_binomial", 4.0)
    assert noise_of(obs["weekly"], values, "model") == ("poisson", {})
    family, kw = noise_of(obs["beds"], values, "model")
    assert (family, float(kw["sd"])) == ("gaussian", 2.0)
    # least squares of weight 2: sd = sqrt(1 / (2 * 2))
    family, kw = noise_of(obs["level"], values, "model")
    assert (family, float(kw["sd"])) == ("gaussian", 0.5)
    # one family for all
    assert noise_of(obs["cases"], values, "poisson") == ("poisson", {})
    family, kw = noise_of(obs["level"], values, "gaussian")
    assert (family, float(kw["sd"])) == ("gaussian", 0.5)
    with pytest.raises(ValueError, match=r"'weekly' has no dispersion parameter"):
        noise_of(obs["weekly"], values, "negative_binomial")
    with pytest.raises(ValueError, match=r"'cases' \(negative_binomial\) has no sd"):
        noise_of(obs["cases"], values, "gaussian")


# ------------------------------------------------------------- the simulation
def test_observe_writes_noisy_series_inputs_and_dates(sir):
    model, data = sir
    ds = epifit.simulate(model, data, days=DAYS, observe="model", seed=3)
    # dated from the default start, as the data are not
    dates = ds["time"].values.astype("datetime64[D]")
    assert str(dates[0]) == "2020-01-01" and ds.sizes["time"] == DAYS
    assert json.loads(ds.attrs["observation_noise"]) == {
        "cases": "negative_binomial",
        "weekly": "poisson",
        "beds": "gaussian",
        "level": "gaussian",
    }
    assert ds.attrs["observation_seed"] == 3
    for name, period in (("cases", 1), ("weekly", 7), ("beds", 1), ("level", 1)):
        noisy, predicted = ds[name], ds[f"predicted_{name}"]
        assert noisy.dims == ("time", "patch")
        assert noisy.attrs["period"] == period
        assert noisy.attrs["units"] == predicted.attrs["units"]
        assert "seed 3" in noisy.attrs["long_name"]
        # NaN exactly off the stamps
        assert np.array_equal(np.isnan(noisy.values), np.isnan(predicted.values))
        assert np.nanmin(noisy.values) >= 0
    weekly = ds["weekly"].values
    assert np.flatnonzero(~np.isnan(weekly[:, 0])).tolist() == [7, 14, 21, 28]
    for name in ("cases", "weekly"):  # counts are whole numbers
        v = ds[name].values
        assert np.array_equal(v[~np.isnan(v)], np.round(v[~np.isnan(v)]))
    assert "negative_binomial noise (seed 3)" in ds["cases"].attrs["long_name"]
    # the inputs the model reads, on the simulated days (the last one carried)
    for name in ("population", "initial_S", "initial_I"):
        assert ds[name].attrs["units"] == "persons"
    contact = ds["contact"].values
    assert contact.shape == (DAYS, 2)
    np.testing.assert_allclose(contact[20:], np.tile(contact[19], (10, 1)))


def test_the_output_binds_as_data_with_the_same_predictions(sir):
    model, data = sir
    ds = epifit.simulate(model, data, days=DAYS, observe="model", seed=3)
    problem = Problem(model, ds)
    problem.require_observations()
    assert problem.dates is not None and problem.ts.size == DAYS
    params = load_params(problem, json.loads(ds.attrs["parameters"]))
    predicted = problem.predict(params, problem.solve(params).ys)
    for name, stamps in problem.stamps.items():
        mask = np.asarray(problem.mask[name])
        observed = np.asarray(problem.observed[name])
        np.testing.assert_array_equal(
            observed[mask], ds[name].values[stamps.days][mask]
        )
        # a weekly series is compared on every day, NaN but on its stamps
        found = ds[f"predicted_{name}"].values[stamps.days][mask]
        np.testing.assert_allclose(np.asarray(predicted[name])[mask], found, rtol=1e-6)
    assert np.asarray(problem.mask["weekly"]).sum(axis=0).tolist() == [4, 4]


def test_same_seed_same_draws_another_seed_others(sir):
    model, data = sir
    a = epifit.simulate(model, data, days=DAYS, observe="model", seed=5)
    b = epifit.simulate(model, data, days=DAYS, observe="model", seed=5)
    c = epifit.simulate(model, data, days=DAYS, observe="model", seed=6)
    for name in ("cases", "weekly", "beds", "level"):
        xr.testing.assert_identical(a[name], b[name])
        assert not np.array_equal(a[name].values, c[name].values, equal_nan=True)


def test_one_family_for_all_and_start(sir):
    model, data = sir
    ds = epifit.simulate(
        model, data, days=DAYS, observe="poisson", seed=0, start="2021-03-04"
    )
    assert set(json.loads(ds.attrs["observation_noise"]).values()) == {"poisson"}
    assert str(ds["time"].values[0].astype("datetime64[D]")) == "2021-03-04"
    v = ds["beds"].values
    assert np.array_equal(v[~np.isnan(v)], np.round(v[~np.isnan(v)]))


def test_dated_data_keep_their_dates_and_observations(tmp_path):
    model = tmp_path / "decay.toml"
    model.write_text(
        'name = "decay"\ncompartments = ["I", "R"]\n'
        '[parameters]\ngamma = { value = 0.3, transform = "softplus" }\n'
        '[[transitions]]\nfrom = "I"\nto = "R"\nrate = "gamma"\n'
        '[initial]\nI = { data = "initial_I" }\n'
        '[[observations]]\nname = "cases"\nkind = "prevalence"\n'
        'compartments = ["I"]\nfamily = "poisson"\n'
    )
    data = xr.Dataset(
        {
            "cases": (("time", "patch"), [[100.0], [70.0], [55.0], [40.0]]),
            "initial_I": ("patch", [100.0]),
        },
        coords={"time": pd.date_range("2021-02-01", periods=4), "patch": ["x"]},
    )
    ds = epifit.simulate(model, data, observe="model", seed=1)
    assert ds["time"].values.astype("datetime64[D]").astype(str).tolist() == [
        "2021-02-01",
        "2021-02-02",
        "2021-02-03",
        "2021-02-04",
    ]
    assert "observed_cases" in ds and "cases" in ds and "initial_I" in ds
    Problem(model, ds).require_observations()  # binds beside observed_cases
    with pytest.raises(ValueError, match=r"--start 2020-05-01: the data are dated"):
        epifit.simulate(model, data, observe="model", start="2020-05-01")


def test_start_without_observe_dates_the_output(sir):
    ds = epifit.simulate(SEIR, days=3, start="2022-12-31")
    assert str(ds["time"].values[-1].astype("datetime64[D]")) == "2023-01-02"
    assert "cases" not in ds and "observation_seed" not in ds.attrs


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"start": "2020-02-30"}, r"--start must be a date YYYY-MM-DD"),
        ({"observe": "binomial"}, r"unknown --observe family 'binomial'"),
        ({"observe": "model", "seed": -1}, r"--seed must be an integer >= 0"),
    ],
)
def test_library_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        epifit.simulate(SEIR, days=3, **kwargs)


def test_an_observation_named_as_a_compartment_is_refused(tmp_path):
    model = tmp_path / "clash.toml"
    model.write_text(
        SEIR.read_text().replace(
            'name = "cases"\nkind = "incidence"', 'name = "I"\nkind = "incidence"'
        )
    )
    assert 'name = "I"' in model.read_text()
    with pytest.raises(epifit.DataError, match=r"observations and inputs \['I'\]"):
        epifit.simulate(model, days=3, observe="model")


# -------------------------------------------------------------------- the CLI
def test_cli_round_trip_recovers_the_parameters(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("truth.toml").write_text("beta = 0.5\ngamma = 0.2\nE0 = 20.0\n")
    # sigma and gamma trade off in new infections alone: hold sigma at its value
    Path("fit.toml").write_text(
        '[parameters]\nsigma = { fixed = true }\n[[phases]]\nmethod = "lbfgs"\n'
        "iterations = 200\n"
    )
    argv = ["simulate", str(SEIR), "--days", "120", "--params", "truth.toml"]
    assert main([*argv, "--observe", "--seed", "1", "--out", "X.nc"]) == 0
    assert re.fullmatch(
        r"wrote X\.nc: .*; simulated observations cases \(poisson\), seed 1\n",
        capsys.readouterr().out,
    )
    with xr.open_dataset("X.nc") as ds:
        assert np.issubdtype(ds["time"].dtype, np.datetime64)
        assert ds.attrs["command"].endswith("--observe model --seed 1")
        assert ds["cases"].attrs["period"] == 1
    argv = ["calibrate", str(SEIR), "--data", "X.nc", "--fit", "fit.toml"]
    argv += ["--out", "FIT.nc", "--no-progress", "--no-uncertainty", "--json"]
    assert main(argv) == 0
    fitted = json.loads(capsys.readouterr().out)["parameters"]
    # started from the model's values (beta 0.6, gamma 0.25, E0 10)
    assert fitted["beta"] == pytest.approx(0.5, rel=0.05)
    assert fitted["gamma"] == pytest.approx(0.2, rel=0.05)
    assert fitted["R0"] == pytest.approx(2.5, rel=0.05)
    assert fitted["E0"] == pytest.approx(20.0, rel=0.2)


def test_cli_same_seed_same_file(tmp_path, capsys):
    argv = ["simulate", str(SEIR), "--days", "20", "--observe", "--seed", "2"]
    assert main([*argv, "--out", str(tmp_path / "a.nc")]) == 0
    assert main([*argv, "--out", str(tmp_path / "b.nc"), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert (summary["observed"], summary["seed"]) == ({"cases": "poisson"}, 2)
    with (
        xr.open_dataset(tmp_path / "a.nc") as a,
        xr.open_dataset(tmp_path / "b.nc") as b,
    ):
        xr.testing.assert_identical(a.drop_attrs(), b.drop_attrs())


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--observe", "--start", "2020-13-01"], r"--start must be a date YYYY-MM-DD"),
        (
            ["--observe", "negative_binomial"],
            r"observation 'cases' has no dispersion parameter, which --observe "
            r"negative_binomial needs",
        ),
        (["--observe", "gaussian"], r"observation 'cases' \(poisson\) has no sd"),
        (
            ["--seed", "1"],
            r"--seed seeds the observation noise; give it with --observe",
        ),
        (["--observe", "binomial"], r"--observe invalid choice: .binomial."),
    ],
)
def test_cli_errors_are_one_line(tmp_path, capsys, extra, message):
    out = tmp_path / "X.nc"
    assert main(["simulate", str(SEIR), "--days", "5", "--out", str(out), *extra]) == 2
    assert re.search(message, error_line(capsys))
    assert not out.exists()


def test_noise_quantiles_are_scipys():
    import scipy.stats

    from epifit.simulation import noise_quantile

    mean = np.array([0.0, 0.3, 2.5, 17.0, 123.4, 5e4])
    for q in (0.025, 0.5, 0.975):
        np.testing.assert_array_equal(
            noise_quantile("poisson", q, mean), scipy.stats.poisson.ppf(q, mean)
        )
        np.testing.assert_array_equal(
            noise_quantile("negative_binomial", q, mean, dispersion=3.0),
            scipy.stats.nbinom.ppf(q, 3.0, 3.0 / (3.0 + mean)),
        )
        np.testing.assert_allclose(
            noise_quantile("gaussian", q, mean + 10.0, sd=2.0),
            np.maximum(scipy.stats.norm.ppf(q, mean + 10.0, 2.0), 0.0),
            rtol=1e-12,
        )
    assert np.isnan(noise_quantile("poisson", 0.5, [np.nan]))[0]
    with pytest.raises(ValueError, match=r"a level in \(0, 1\); got 1.5"):
        noise_quantile("poisson", 1.5, mean)
