"""NUTS posteriors (`epifit.sample`): a linear ODE with Gaussian
observations and Gaussian priors, whose posterior is known in closed form;
the ArviZ groups; checkpoints that resume to the same draws; bad settings."""

import arviz as az
import numpy as np
import pytest
import xarray as xr

import epifit
from epifit.model import loads_model
from epifit.sampling import SamplerCheckpointError

K, SD = 0.15, 4.0
PRIOR = {"A0": (90.0, 20.0), "B0": (25.0, 10.0)}
TRUTH = {"A0": 100.0, "B0": 20.0}
DECAY = f"""
name = "decay"
compartments = ["A", "B"]
[parameters]
k = {{ value = {K}, fixed = true }}
A0 = {{ value = 90.0, transform = "identity" }}
B0 = {{ value = 25.0, transform = "identity" }}
[[transitions]]
from = "A"
to = "B"
rate = "k"
[initial]
A = "A0"
B = "B0"
[[observations]]
name = "a_obs"
kind = "prevalence"
compartments = ["A"]
family = "gaussian"
sd = "{SD}"
[[observations]]
name = "b_obs"
kind = "prevalence"
compartments = ["B"]
family = "gaussian"
sd = "{SD}"
"""
FIT = {
    "rtol": 1e-10,
    "atol": 1e-10,
    "parameters": {
        p: {"prior": {"family": "normal", "mean": m, "sd": s}}
        for p, (m, s) in PRIOR.items()
    },
}
DAYS = 12


def _design(days):
    """`(A(t), B(t)) = M @ (A0, B0)`, stacked as the observations are."""
    e = np.exp(-K * np.arange(days))
    return np.vstack([np.c_[e, 0 * e], np.c_[1 - e, 1 + 0 * e]])


@pytest.fixture(scope="module")
def decay():
    rng = np.random.default_rng(5)
    M = _design(DAYS)
    y = M @ np.array([TRUTH["A0"], TRUTH["B0"]]) + rng.normal(0, SD, 2 * DAYS)
    dates = np.datetime64("2021-01-01") + np.arange(DAYS).astype("timedelta64[D]")
    ds = xr.Dataset(
        {"a_obs": ("time", y[:DAYS]), "b_obs": ("time", y[DAYS:])},
        coords={"time": dates},
    )
    spec = loads_model(DECAY, path="decay.toml")
    fit = epifit.calibrate(spec, ds, fit=FIT, progress=False)
    # the exact posterior: Gaussian, precision M'M / sd^2 + the prior's
    m = np.array([PRIOR["A0"][0], PRIOR["B0"][0]])
    s = np.array([PRIOR["A0"][1], PRIOR["B0"][1]])
    precision = M.T @ M / SD**2 + np.diag(1 / s**2)
    cov = np.linalg.inv(precision)
    mean = cov @ (M.T @ y / SD**2 + m / s**2)
    return fit, mean, cov


@pytest.mark.slow
def test_linear_gaussian_posterior_matches_the_closed_form(decay):
    fit, mean, cov = decay
    post = epifit.sample(init=fit, chains=4, warmup=300, draws=500, progress=False)
    table = post.diagnostics()
    for i, p in enumerate(("A0", "B0")):
        row = table.loc[p]
        assert abs(row["mean"] - mean[i]) <= 3 * row["mcse_mean"], (p, row)
        assert abs(row["sd"] - np.sqrt(cov[i, i])) <= 3 * row["mcse_sd"], (p, row)
        assert row["r_hat"] <= 1.01
    assert not any("divergent" in w for w in post.warnings())
    # the groups ArviZ needs, with the draws' shapes
    idata = post.data
    for group in (
        "posterior",
        "sample_stats",
        "log_likelihood",
        "posterior_predictive",
        "observed_data",
    ):
        assert hasattr(idata, group), group
    assert idata.posterior["A0"].shape == (4, 500)
    assert idata.log_likelihood["a_obs"].dims == ("chain", "draw", "time", "patch")
    assert idata.log_likelihood["a_obs"].shape == (4, 500, DAYS, 1)
    assert "k" not in idata.posterior  # fixed
    assert set(idata.sample_stats.data_vars) >= {
        "diverging",
        "tree_depth",
        "energy",
        "step_size",
        "lp",
    }
    loo = az.loo(idata, var_name="a_obs")
    assert np.isfinite(loo.elpd_loo)
    # the predictive draws scatter with the observation sd around the mean
    pp = idata.posterior_predictive["a_obs"].values
    assert np.std(pp - pp.mean(axis=(0, 1))) == pytest.approx(SD, rel=0.1)


def test_resumed_chains_give_the_same_draws(decay, tmp_path, monkeypatch):
    fit, _, _ = decay
    kw = dict(init=fit, chains=2, warmup=30, draws=40, chunk=10, progress=False)
    whole = epifit.sample(**kw)
    ckpt = tmp_path / "chains.npz"
    from epifit.sampling import _nuts

    real = _nuts.Programs.__init__
    calls = {"n": 0}

    def interrupted(self, *a, **k):
        real(self, *a, **k)
        chunk = self.chunk

        def stop_after_three(*args):
            calls["n"] += 1
            if calls["n"] == 6:  # chain 1, its second chunk
                raise KeyboardInterrupt
            return chunk(*args)

        self.chunk = stop_after_three

    monkeypatch.setattr(_nuts.Programs, "__init__", interrupted)
    with pytest.raises(KeyboardInterrupt):
        epifit.sample(**kw, checkpoint=ckpt)
    monkeypatch.setattr(_nuts.Programs, "__init__", real)
    resumed = epifit.sample(**kw, checkpoint=ckpt, resume=True)
    np.testing.assert_array_equal(
        resumed.data.posterior["x"].values, whole.data.posterior["x"].values
    )
    # a checkpoint of another run is refused, naming the file
    with pytest.raises(SamplerCheckpointError, match="chains.npz.*another run"):
        epifit.sample(**{**kw, "seed": 9}, checkpoint=ckpt, resume=True)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"chains": 0}, "chains must be an int >= 1"),
        ({"draws": 2.5}, "draws must be an int"),
        ({"mass_matrix": "full"}, "mass_matrix must be one of"),
        ({"target_accept": 1.0}, "target_accept must lie in"),
        ({"resume": True}, "resume=True needs a checkpoint file"),
    ],
)
def test_bad_settings_are_refused(decay, kw, match):
    fit, _, _ = decay
    with pytest.raises(ValueError, match=match):
        epifit.sample(init=fit, progress=False, **{"warmup": 5, "draws": 5, **kw})


# -- the command ---------------------------------------------------------------------
@pytest.fixture
def decay_files(decay, tmp_path, monkeypatch):
    """The decay model, its data and its fit as files; no persistent cache."""
    monkeypatch.setenv("EPIFIT_NO_CACHE", "1")
    fit, _, _ = decay
    model = tmp_path / "decay.toml"
    model.write_text(DECAY)
    data = tmp_path / "decay.nc"
    epifit.write_dataset(fit.problem.dataset, data)
    fit_toml = tmp_path / "fit.toml"
    fit_toml.write_text(
        "rtol = 1e-10\natol = 1e-10\n[parameters]\n"
        + "".join(
            f'{p} = {{ prior = {{ family = "normal", mean = {m}, sd = {s} }} }}\n'
            for p, (m, s) in PRIOR.items()
        )
    )
    return model, data, fit_toml


def test_cli_samples_and_writes_arviz_netcdf(decay_files, tmp_path, capsys):
    import json

    from epifit.cli import main

    model, data, fit_toml = decay_files
    fit_nc = tmp_path / "FIT.nc"
    assert main(["calibrate", str(model), "--data", str(data), "--fit", str(fit_toml),
                 "--out", str(fit_nc), "--no-progress"]) == 0  # fmt: skip
    capsys.readouterr()
    out = tmp_path / "POSTERIOR.nc"
    argv = ["sample", "--init", str(fit_nc), "--out", str(out), "--chains", "2",
            "--warmup", "40", "--draws", "30", "--json"]  # fmt: skip
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert {r["parameter"] for r in summary["summary"]} == {"A0", "B0"}
    idata = az.from_netcdf(out)
    assert idata.posterior["A0"].shape == (2, 30)
    assert "epifit sample --init" in idata.posterior.attrs["command"]
    # the input is never the output, and stays as it was
    before = fit_nc.read_bytes()
    code = main(["sample", "--init", str(fit_nc), "--out", str(fit_nc), "--draws", "5"])
    assert code == 2
    assert "FIT.nc" in capsys.readouterr().err
    assert fit_nc.read_bytes() == before


@pytest.mark.parametrize(
    "extra, message",
    [
        ([], "needs a model and --data, or --init"),
        (["--resume"], "--resume needs --checkpoint"),
        (["--target-accept", "1.5"], "--target-accept must lie in"),
    ],
)
def test_cli_bad_flags_are_one_line(decay_files, tmp_path, capsys, extra, message):
    from epifit.cli import main

    model, data, _ = decay_files
    argv = ["sample", "--out", str(tmp_path / "p.nc"), *extra]
    if extra:
        argv += [str(model), "--data", str(data)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
