"""NUTS posteriors (`epifit.sample`): a linear ODE with Gaussian
observations and Gaussian priors, whose posterior is known in closed form;
the ArviZ groups; checkpoints that resume to the same draws; bad settings."""

import arviz as az
import numpy as np
import pytest
import xarray as xr
from scipy import stats

import epifit
from epifit.fitting import FitResult
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


def _decay_data(y):
    """The observations `y` (A's days, then B's) as a daily dataset."""
    dates = np.datetime64("2021-01-01") + np.arange(DAYS).astype("timedelta64[D]")
    return xr.Dataset(
        {"a_obs": ("time", y[:DAYS]), "b_obs": ("time", y[DAYS:])},
        coords={"time": dates},
    )


@pytest.fixture(scope="module")
def decay():
    rng = np.random.default_rng(5)
    M = _design(DAYS)
    y = M @ np.array([TRUTH["A0"], TRUTH["B0"]]) + rng.normal(0, SD, 2 * DAYS)
    ds = _decay_data(y)
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
@pytest.mark.parametrize("adjoint", [None, "checkpoint"])
def test_linear_gaussian_posterior_matches_the_closed_form(decay, adjoint):
    """With the default settings the density's gradient is taken in forward
    mode (2 parameters, 2 states); a fit file's adjoint is obeyed."""
    fit, mean, cov = decay
    config = None if adjoint is None else FIT | {"adjoint": adjoint}
    post = epifit.sample(init=fit, fit=config, chains=4, warmup=300, draws=500,
                         progress=False)  # fmt: skip
    gradient = "forward" if adjoint is None else "adjoint"
    assert post.data.posterior.attrs["gradient"] == gradient
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


def test_a_fit_that_fixes_a_parameter_samples_the_conditional_posterior(decay):
    """`fit` fixing B0 at the MAP's value: the chains sample A0 | B0, whose
    exact law is Gaussian with variance 1 / P[A0, A0] (P the posterior
    precision) and mean E[A0] + cov[A0, B0] / var[B0] (B0 - E[B0]); they
    start from the Schur complement of the MAP's covariance, which is it."""
    from epifit.sampling._sample import _conditioned

    fit, mean, cov = decay
    b0 = float(fit.params["B0"])
    var = 1.0 / np.linalg.inv(cov)[0, 0]
    centre = mean[0] + cov[0, 1] / cov[1, 1] * (b0 - mean[1])
    assert var < 0.95 * cov[0, 0]  # the conditional law is not the marginal one
    config = {**FIT, "parameters": {"A0": FIT["parameters"]["A0"],
                                    "B0": {"fixed": True}}}  # fmt: skip
    objective = epifit.fitting.resolve_fit(
        fit.problem, epifit.fitting.fit_config(config), init=fit.params
    ).objective
    x, start_cov = _conditioned(fit, objective.free)
    assert x.tolist() == pytest.approx([float(fit.params["A0"])], rel=1e-12)
    assert start_cov == pytest.approx(np.array([[var]]), rel=1e-4)  # the fit's Laplace
    post = epifit.sample(init=fit, fit=config, chains=2, warmup=200, draws=500,
                         progress=False)  # fmt: skip
    row = post.diagnostics().loc["A0"]
    assert "B0" not in post.data.posterior
    assert abs(row["mean"] - centre) <= 3 * row["mcse_mean"], row
    assert abs(row["sd"] - np.sqrt(var)) <= 3 * row["mcse_sd"], row
    # its forecast: A0's draws, B0 at the fit's value (what the draws had)
    fc = epifit.forecast(fit, days=5, samples=1000, posterior=post,
                         observation_noise=False, quantiles=[0.0, 1.0])  # fmt: skip
    assert fc.attrs["posterior_fixed_at_fit"] == 1
    a0 = post.data.posterior["A0"].values.ravel()
    t = fc.sizes["time"] - 1
    last = fc["b_obs"].sel(scenario="baseline").isel(time=-1, patch=0).values
    span = (1 - np.exp(-K * t)) * np.array([a0.min(), a0.max()])
    np.testing.assert_allclose(last, b0 + span, rtol=1e-6)


# a_obs far more precise than b_obs: A0's posterior sd is ~5e-4, B0's ~2, so
# that the window adaptation's regularisation towards 1e-3 I (~5e-5 at its last
# slow window) swamps A0's variance on the unconstrained coordinates
SD_A = 1e-3


@pytest.mark.slow
def test_whitened_chains_sample_scales_the_adaptation_swamps():
    """A posterior whose standard deviations differ by 4000x: the default
    chains (on the Laplace approximation's whitened coordinates) agree with
    the exact Gaussian posterior within 3 MCSE, and take far fewer leapfrog
    steps per draw than the same chains on the parameters themselves
    (`whiten=False`), whose adapted inverse mass for A0 the regularisation
    holds far above A0's posterior variance."""
    rng = np.random.default_rng(7)
    M = _design(DAYS)
    sd = np.r_[np.full(DAYS, SD_A), np.full(DAYS, SD)]
    y = M @ np.array([TRUTH["A0"], TRUTH["B0"]]) + rng.normal(0, 1, 2 * DAYS) * sd
    spec = loads_model(DECAY.replace(f'sd = "{SD}"', f'sd = "{SD_A}"', 1),
                       path="decay.toml")  # fmt: skip
    fit = epifit.calibrate(spec, _decay_data(y), fit=FIT, progress=False)
    m = np.array([PRIOR["A0"][0], PRIOR["B0"][0]])
    s = np.array([PRIOR["A0"][1], PRIOR["B0"][1]])
    cov = np.linalg.inv(M.T @ (M / sd[:, None] ** 2) + np.diag(1 / s**2))
    mean = cov @ (M.T @ (y / sd**2) + m / s**2)
    assert np.sqrt(cov[1, 1] / cov[0, 0]) > 1000
    kw = {"init": fit, "chains": 2, "warmup": 200, "draws": 400, "progress": False}
    white, plain = epifit.sample(**kw), epifit.sample(**kw, whiten=False)
    assert white.data.posterior.attrs["whitening"] == "laplace"
    assert plain.data.posterior.attrs["whitening"] == "none"
    table = white.diagnostics()
    for i, p in enumerate(("A0", "B0")):
        row = table.loc[p]
        assert abs(row["mean"] - mean[i]) <= 3 * row["mcse_mean"], (p, row)
        assert abs(row["sd"] - np.sqrt(cov[i, i])) <= 3 * row["mcse_sd"], (p, row)
    steps = [float(p.data.sample_stats["n_steps"].mean()) for p in (white, plain)]
    assert steps[0] < 0.5 * steps[1], steps


def test_whiten_is_checked(decay):
    fit, _, _ = decay
    kw = {"progress": False, "warmup": 5, "draws": 5}
    with pytest.raises(ValueError, match="whiten must be True, False or None"):
        epifit.sample(init=fit, whiten="yes", **kw)
    values = {"A0": float(fit.params["A0"]), "B0": float(fit.params["B0"])}
    with pytest.raises(ValueError, match="whiten=True needs a positive definite"):
        epifit.sample(fit.problem, values=values, whiten=True, **kw)


# measured: the NUTS transitions are bit for bit the same vmapped, but the
# window adaptation's arithmetic is not (the adapted step size differs by 2e-11
# relative after 30 warm-up steps), so vectorized chains follow the sequential
# ones to ~1e-11 relative; 1e-8 leaves room for a longer divergence of the
# rounding, far below any difference a wrong key or state would make (O(1))
VECTORIZED_RTOL = 1e-8


@pytest.mark.slow
def test_chains_give_the_same_draws_whatever_runs_or_resumes_them(
    decay, tmp_path, monkeypatch
):
    """Chain c's draws depend on the seed, c and the draw's index alone: three
    chains in two threads (the default on a CPU of two cores) equal them one
    after another; interrupted in chain 1 and resumed in two worker
    processes, or in two threads, they equal the uninterrupted run bit for
    bit; resumed vectorized (chain 2's warm-up, then the chains behind,
    vmapped), to the rounding of the vmapped adaptation; the checkpoint of
    another run is refused."""
    import shutil

    from epifit._workers import cpu_cores
    from epifit.sampling import _nuts

    fit, _, _ = decay
    kw = dict(init=fit, chains=3, warmup=20, draws=20, chunk=10, progress=False)
    whole = epifit.sample(**kw, chain_method="sequential")
    threaded = epifit.sample(**kw)
    default = "threads" if cpu_cores() > 1 else "sequential"
    assert threaded.data.posterior.attrs["chain_method"] == default
    for group in ("posterior", "sample_stats"):
        xr.testing.assert_identical(threaded.data[group].drop_attrs(),
                                    whole.data[group].drop_attrs())  # fmt: skip
    ckpt = tmp_path / "chains.npz"
    real = _nuts.Programs.__init__
    calls = {"n": 0}

    def interrupted(self, *a, **k):
        real(self, *a, **k)
        steps = self.steps

        def stop(*args):
            calls["n"] += 1
            if calls["n"] == 8:  # chain 1, its fourth chunk (its second of draws)
                raise KeyboardInterrupt
            return steps(*args)

        self.steps = stop

    monkeypatch.setattr(_nuts.Programs, "__init__", interrupted)
    with pytest.raises(KeyboardInterrupt):
        epifit.sample(**kw, checkpoint=ckpt, chain_method="sequential")
    monkeypatch.setattr(_nuts.Programs, "__init__", real)
    copy = shutil.copy(ckpt, tmp_path / "copy.npz")
    again = shutil.copy(ckpt, tmp_path / "again.npz")
    x = whole.data.posterior["x"].values
    depth = whole.data.sample_stats["tree_depth"].values
    # in processes: chains 0 (complete) and 2 (not begun) in one, 1 in the other
    resumed = dict(checkpoint=ckpt, resume=True, progress=True)
    by_workers = epifit.sample(**{**kw, **resumed}, chain_method="processes",
                               workers=2)  # fmt: skip
    np.testing.assert_array_equal(by_workers.data.posterior["x"].values, x)
    assert by_workers.data.posterior.attrs["workers"] == "2"
    by_threads = epifit.sample(**kw, checkpoint=again, resume=True,
                               chain_method="threads", workers=2)  # fmt: skip
    np.testing.assert_array_equal(by_threads.data.posterior["x"].values, x)
    vmapped = epifit.sample(**kw, checkpoint=copy, resume=True,
                            chain_method="vectorized")  # fmt: skip
    xv = vmapped.data.posterior["x"].values
    np.testing.assert_array_equal(xv[0], x[0])  # resumed complete
    np.testing.assert_array_equal(xv[1, :10], x[1, :10])  # drawn before the stop
    np.testing.assert_allclose(xv, x, rtol=VECTORIZED_RTOL)
    np.testing.assert_array_equal(vmapped.data.sample_stats["tree_depth"], depth)
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
        ({"chain_method": "fibers"}, "chain_method must be one of"),
        (
            {"chain_method": "sequential", "workers": 2},
            "workers is for chain_method='threads' or 'processes'",
        ),
        ({"chain_method": "processes", "workers": 0}, "workers must be an int >= 1"),
        ({"values": {}}, "give init .* or values, not both"),
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
            "--warmup", "40", "--draws", "30", "--json", "--no-whiten"]  # fmt: skip
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert {r["parameter"] for r in summary["summary"]} == {"A0", "B0"}
    idata = az.from_netcdf(out)
    assert idata.posterior["A0"].shape == (2, 30)
    assert "epifit sample --init" in idata.posterior.attrs["command"]
    assert idata.posterior.attrs["command"].endswith("--no-whiten")
    assert idata.posterior.attrs["whitening"] == "none"
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
        (["--chain-method", "fibers"], "--chain-method invalid choice"),
        (
            ["--chain-method", "vectorized", "--workers", "2"],
            "--workers needs --chain-method threads or processes",
        ),
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


# -- the boarding school, against importance sampling over a NumPy RK4 ----------------
BOARDING_PRIORS = {"beta": (1.7, 0.5), "gamma": (0.45, 0.5), "I0": (2.0, 1.0)}
# the fit configuration of the boarding-school posterior and of `school_run`:
# the same problem and settings, so the second loads the first's calibrate
# and sampler-chunk programs from the session's compilation cache
BOARDING_FIT = {
    "rtol": 1e-9,
    "atol": 1e-9,
    "parameters": {
        p: {"prior": {"family": "lognormal", "median": m, "sdlog": s}}
        for p, (m, s) in BOARDING_PRIORS.items()
    },
}


def _boarding_log_posterior(theta, y, dt=0.01):
    """log p(beta, gamma, I0 | in_bed) + log Jacobian of log-coordinates, for
    each row of `theta` (log values) at once: Poisson prevalence, log-normal
    priors, the SIR by classical RK4 at a fixed step of `dt` days in NumPy (at
    0.01 its log density is within 1e-7 of a step of 0.001)."""
    from scipy.special import gammaln

    beta, gamma, i0 = np.exp(np.atleast_2d(theta)).T
    n = 763.0

    def f(s, i):
        new = beta * s * i / n
        return np.stack([-new, new - gamma * i])

    u = np.stack([n - i0, i0])
    mu = [u[1]]
    for _ in range(13):
        for _ in range(round(1 / dt)):
            k1 = f(*u)
            k2 = f(*(u + dt / 2 * k1))
            k3 = f(*(u + dt / 2 * k2))
            k4 = f(*(u + dt * k3))
            u = u + dt / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
        mu.append(u[1])
    mu = np.maximum(np.array(mu), 1e-300)
    ll = (y[:, None] * np.log(mu) - mu - gammaln(y + 1)[:, None]).sum(0)
    # log-normal densities of the values, times d value / d log value
    lp = sum(
        -0.5 * ((t - np.log(median)) / s) ** 2
        for t, (median, s) in zip(
            np.atleast_2d(theta).T, BOARDING_PRIORS.values(), strict=True
        )
    )
    return ll + lp


def _importance_moments(y, centre, cov, n, rng):
    """Posterior means and sds of the values by self-normalised importance
    sampling from a Student-t (5 degrees of freedom, covariance inflated 1.5x)
    in log-coordinates, with their Monte-Carlo standard errors (the delta
    method on the weighted sums) and the effective sample size."""
    proposal = stats.multivariate_t(loc=centre, shape=1.5 * cov, df=5, seed=rng)
    theta = proposal.rvs(n)
    logw = _boarding_log_posterior(theta, y) - proposal.logpdf(theta)
    w = np.exp(logw - logw.max())
    w /= w.sum()
    values = np.exp(theta)
    mean = w @ values
    dev = values - mean
    var = w @ dev**2
    mean_se = np.sqrt(w**2 @ dev**2)
    var_se = np.sqrt(w**2 @ (dev**2 - var) ** 2)
    return mean, mean_se, np.sqrt(var), var_se / (2 * np.sqrt(var)), 1 / np.sum(w**2)


@pytest.mark.slow
def test_boarding_school_posterior_agrees_with_importance_sampling():
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    text = (repo / "models" / "sir.toml").read_text()
    spec = loads_model(
        text.replace('family = "least_squares"', 'family = "poisson"'), path="sir.toml"
    )
    data = repo / "data" / "boarding_school_1978.nc"
    # from a fit (the chains start at Laplace draws around the MAP): started
    # from the priors' medians instead, 400 warm-up steps left R-hat at
    # 1.0166 for I0 in one full run (1.01 is asserted), so the cheaper start
    # was not kept
    post = epifit.sample(spec, data, fit=BOARDING_FIT, chains=4, warmup=400, draws=500,
                         seed=3, progress=False)  # fmt: skip
    table = post.diagnostics()
    assert (table.loc[list(BOARDING_PRIORS), "r_hat"] <= 1.01).all(), table
    y = xr.open_dataset(data)["in_bed"].values.astype(float)
    # the reference: importance sampling (a different method, a different solver),
    # its proposal centred on the NUTS draws (any proposal with heavier tails
    # than the posterior gives the same limit)
    draws = {p: post.data.posterior[p].values.ravel() for p in BOARDING_PRIORS}
    logs = np.log(np.column_stack(list(draws.values())))
    rng = np.random.default_rng(0)
    mean, mean_se, sd, sd_se, ess = _importance_moments(
        y, logs.mean(0), np.cov(logs.T), 40000, rng
    )
    assert ess > 5000, ess  # the proposal is not degenerate
    for j, p in enumerate(BOARDING_PRIORS):
        se = np.hypot(table.loc[p, "mcse_mean"], mean_se[j])
        assert abs(table.loc[p, "mean"] - mean[j]) <= 3 * se, (p, mean[j], table)
        # and the spread: within 3 combined MCSEs of the sd
        sd_err = np.hypot(table.loc[p, "mcse_sd"], sd_se[j])
        assert abs(table.loc[p, "sd"] - sd[j]) <= 3 * sd_err, (p, sd[j], table)


def test_forecast_draws_from_the_posterior(decay, tmp_path):
    """`forecast(..., posterior=...)` runs the posterior's draws: its
    quantiles are those of the trajectories at the chosen draws."""
    fit, _, _ = decay
    post = epifit.sample(init=fit, chains=2, warmup=40, draws=30, progress=False)
    path = post.to_netcdf(tmp_path / "POSTERIOR.nc")
    fc = epifit.forecast(fit, days=5, samples=60, posterior=path,
                         observation_noise=False, quantiles=[0.0, 1.0])  # fmt: skip
    assert fc.attrs["draws_from"] == "posterior"
    assert fc.attrs["posterior_draws"] == 60
    # with every draw chosen, the envelope of A(t) is the draws' own: A0 e^{-kt}
    a0 = post.data.posterior["A0"].values.ravel()
    last = fc["a_obs"].sel(scenario="baseline").isel(time=-1, patch=0).values
    t = fc.sizes["time"] - 1
    np.testing.assert_allclose(
        last, [a0.min() * np.exp(-K * t), a0.max() * np.exp(-K * t)], rtol=1e-6
    )
    with pytest.raises(ValueError, match="holds 60 draws"):
        epifit.forecast(fit, days=5, samples=61, posterior=path)
    # a posterior of other parameters is refused, naming the first difference
    other = post.data.posterior.assign_coords(free=["A0", "C0"])
    with pytest.raises(ValueError, match="not the fit's.*'C0' vs 'B0'"):
        epifit.forecast(fit, days=5, samples=5, posterior=type(post)(
            type(post.data)(posterior=other)))  # fmt: skip


def _without_fit(idata, path):
    """A posterior file as written before posteriors embedded their fit."""
    old = type(idata)(**{g: getattr(idata, g) for g in idata.groups() if g != "fit"})
    old.to_netcdf(str(path))
    return path


def test_a_posterior_alone_forecasts_with_its_fit(decay, tmp_path, capsys):
    """`forecast(POSTERIOR)`: the draws with the fit the file embeds, the same
    forecast as `forecast(fit, posterior=POSTERIOR)`; a posterior without its
    fit, or a posterior with `posterior=`, is a one-line error."""
    from epifit.cli import main

    fit, _, _ = decay
    post = epifit.sample(init=fit, chains=2, warmup=40, draws=30, progress=False)
    path = post.to_netcdf(tmp_path / "POSTERIOR.nc")
    kw = dict(days=5, samples=60, seed=4)
    ref = epifit.forecast(fit, posterior=path, **kw)
    # in memory: the fit sample ran from
    alone = epifit.forecast(post, **kw)
    assert alone.attrs["draws_from"] == "posterior"
    assert alone.attrs["fit_group"] == "fit"
    assert set(alone.data_vars) == set(ref.data_vars)
    for v in ref.data_vars:
        np.testing.assert_array_equal(alone[v].values, ref[v].values, err_msg=v)
    # the file's `fit` group is that fit (a model built in Python stores no
    # model text, and its data were in memory: both are given here)
    back = FitResult.from_netcdf(
        path, group="fit", model=fit.problem.spec, data=fit.problem.dataset
    )
    assert back.labels == fit.labels and back.loss == fit.loss
    np.testing.assert_array_equal(back.x, fit.x)
    np.testing.assert_array_equal(back.covariance, fit.covariance)
    assert epifit.Posterior.from_netcdf(path).data.fit.attrs["epifit_kind"] == "fit"
    # a file written before: readable, no fit, and a one-line error to forecast
    old = _without_fit(post.data, tmp_path / "OLD.nc")
    assert epifit.Posterior.from_netcdf(old).fit is None
    with pytest.raises(ValueError, match="OLD.nc holds no fit.*--posterior"):
        epifit.forecast(old, **kw)
    out = str(tmp_path / "fc.nc")
    for argv in (
        ["forecast", str(old), "--days", "5", "--out", out],
        ["forecast", str(path), "--posterior", str(path), "--days", "5", "--out", out],
    ):
        assert main(argv) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 2, errors
    assert "holds no fit" in errors[0] and "--posterior" in errors[0]
    assert "is a posterior" in errors[1] and "drop it" in errors[1]
    assert not (tmp_path / "fc.nc").exists()


@pytest.fixture(scope="module")
def school_run(tmp_path_factory):
    """The boarding-school SIR (Poisson, log-normal priors; `BOARDING_FIT`)
    fitted in a folder of its own with the data beside it (a relative path),
    `FIT.nc`, and a tiny posterior, `POSTERIOR.nc`: 2 chains x (50 warm-up +
    50 draws)."""
    import os
    import shutil
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    run = tmp_path_factory.mktemp("school")
    text = (repo / "models" / "sir.toml").read_text()
    (run / "sir.toml").write_text(
        text.replace('family = "least_squares"', 'family = "poisson"')
    )
    shutil.copy(repo / "data" / "boarding_school_1978.nc", run / "school.nc")
    here = os.getcwd()
    os.chdir(run)
    try:
        fit = epifit.calibrate(
            "sir.toml", "school.nc", fit=BOARDING_FIT, progress=False
        )
        fit.to_netcdf("FIT.nc")
        post = epifit.sample(init=fit, chains=2, warmup=50, draws=50, seed=1,
                             progress=False)  # fmt: skip
        post.to_netcdf("POSTERIOR.nc")
    finally:
        os.chdir(here)
    return run


@pytest.mark.slow
def test_cli_forecasts_a_posterior_file_alone(school_run, tmp_path, monkeypatch):
    """`epifit forecast POSTERIOR.nc` equals `epifit forecast FIT.nc --posterior
    POSTERIOR.nc` bit for bit; moved with its data to another folder, the
    posterior finds them again by their path relative to it; ArviZ reads the
    file with its `fit` group without a warning about it."""
    import shutil
    import warnings
    from pathlib import Path

    from epifit.cli import main

    run = school_run
    monkeypatch.setenv("EPIFIT_NO_CACHE", "1")
    monkeypatch.chdir(tmp_path)
    post = run / "POSTERIOR.nc"
    args = ["--days", "7", "--samples", "60", "--seed", "3"]
    assert main(["forecast", str(run / "FIT.nc"), "--posterior", str(post), *args,
                 "--out", "a.nc"]) == 0  # fmt: skip
    assert main(["forecast", str(post), *args, "--out", "b.nc"]) == 0
    a, b = xr.load_dataset("a.nc"), xr.load_dataset("b.nc")
    assert b.attrs["draws_from"] == "posterior" and b.attrs["posterior_draws"] == 100
    assert b.attrs["posterior_file"] == str(post)
    assert set(a.data_vars) == set(b.data_vars)
    for v in a.data_vars:
        np.testing.assert_array_equal(a[v].values, b[v].values, err_msg=v)
    # moved with its data: the absolute path is gone, the relative one is found
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    for name in ("POSTERIOR.nc", "school.nc"):
        shutil.copy(run / name, moved / name)
    (tmp_path / "away").mkdir()
    monkeypatch.chdir(tmp_path / "away")
    (run / "school.nc").rename(run / "school.nc.gone")
    try:
        fc = epifit.forecast(moved / "POSTERIOR.nc", days=7, samples=60, seed=3)
    finally:
        (run / "school.nc.gone").rename(run / "school.nc")
    assert Path(fc.attrs["data_file"]).resolve() == (moved / "school.nc").resolve()
    for v in a.data_vars:
        np.testing.assert_array_equal(fc[v].values, a[v].values, err_msg=v)
    # ArviZ: the `fit` group is read along, unwarned; summary and LOO work
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        idata = az.from_netcdf(post)
        table = az.summary(idata, var_names=list(BOARDING_PRIORS))
        loo = az.loo(idata, var_name="in_bed")
    assert "fit" in idata.groups() and idata.fit.attrs["epifit_kind"] == "fit"
    assert not [w for w in caught if "group" in str(w.message)], caught
    assert np.isfinite(table["mean"]).all() and np.isfinite(loo.elpd_loo)


def test_non_finite_starts_are_pulled_towards_the_map():
    """A chain begins where the density and its gradient are finite: at its
    start, else halfway to the MAP (`anchor`) and so on, else at the MAP;
    in the chains' program, by the evaluation that begins the chain."""
    import jax
    import jax.numpy as jnp

    from epifit.sampling._nuts import MAX_SHRINKS, begin_state, check_begun

    def logp(x):  # finite inside the unit box only
        return jnp.where(jnp.max(jnp.abs(x)) < 1.0, -0.5 * jnp.sum(x**2), -jnp.inf)

    begin = jax.jit(lambda x0, anchor: begin_state(x0, anchor, logp, jnp.float64))
    x_map = np.array([0.0, 0.0])
    starts = np.array([[0.5, -0.5], [4.0, 0.0], [1e5, -1e5], [1e300, 0.0]])
    out = [begin(x, x_map) for x in starts]
    np.testing.assert_array_equal(out[0].position, starts[0])  # a finite start is kept
    np.testing.assert_array_equal(out[1].position, [0.5, 0.0])  # 4 -> 2 -> 1 -> 0.5
    np.testing.assert_allclose(out[2].position, starts[2] * 0.5**17)  # the first finite
    np.testing.assert_array_equal(out[3].position, x_map)  # the last resort: the MAP
    assert MAX_SHRINKS < 1000
    for state in out:  # the density and its gradient where the chain begins
        x = np.asarray(state.position)
        assert float(state.logdensity) == pytest.approx(-0.5 * np.sum(x**2))
        np.testing.assert_allclose(state.logdensity_grad, -x)
    bad = begin(starts[1], np.array([2.0, 0.0]))  # not finite at the MAP either
    assert not np.isfinite(float(bad.logdensity))
    with pytest.raises(FloatingPointError, match="not finite at the MAP"):
        check_begun((bad,))


def test_starts_far_below_the_map_density_are_pulled_towards_it():
    """A start whose log density is finite but more than `max_drop` below the
    MAP's (a draw of a Laplace approximation at a saddle) is pulled in like
    a non-finite one; a start a Gaussian posterior's Laplace draws reach is
    kept; with the MAP's density not finite, finiteness alone is asked."""
    import jax
    import jax.numpy as jnp
    from scipy.stats import chi2

    from epifit.sampling._nuts import begin_state, max_drop

    def logp(x):
        return -0.5 * jnp.sum(x**2)

    begin = jax.jit(lambda x0, anchor: begin_state(x0, anchor, logp, jnp.float64))
    x_map = np.zeros(2)
    assert max_drop(2) == pytest.approx(21.0)
    edge = np.sqrt(2 * max_drop(2))  # log density exactly max_drop below the MAP's
    kept = np.array([0.999 * edge, 0.0])
    np.testing.assert_array_equal(begin(kept, x_map).position, kept)
    # 100 -> 50 -> 25 -> 12.5 -> 6.25, the first within sqrt(42) = 6.48
    far = begin(np.array([100.0, 0.0]), x_map)
    np.testing.assert_array_equal(far.position, [6.25, 0.0])
    assert float(far.logdensity) == pytest.approx(-0.5 * 6.25**2)
    np.testing.assert_allclose(far.logdensity_grad, [-6.25, 0.0])
    for n in (1, 3, 199, 10_000):  # Laplace draws of a Gaussian are never moved
        assert chi2.sf(2 * max_drop(n), n) < 1e-8
    # the MAP outside the support: any finite start is kept, however far
    boxed = jax.jit(
        lambda x0, anchor: begin_state(
            x0,
            anchor,
            lambda x: jnp.where(x[0] < 50.0, logp(x), -jnp.inf),
            jnp.float64,
        )
    )
    np.testing.assert_array_equal(
        boxed(np.array([40.0, 0.0]), np.array([60.0, 0.0])).position, [40.0, 0.0]
    )


@pytest.mark.slow
def test_chains_leave_a_wide_laplace_approximation_from_finite_starts():
    """Laplace draws where the density is -inf (Poisson counts of a negative
    prevalence) would leave the chains stuck: the starts are pulled in."""
    import dataclasses

    text = DECAY.replace('family = "gaussian"\nsd = "4.0"', 'family = "poisson"')
    rng = np.random.default_rng(3)
    M = _design(DAYS)
    ds = _decay_data(rng.poisson(M @ np.array([TRUTH["A0"], TRUTH["B0"]])))
    spec = loads_model(text, path="d.toml")
    fit = epifit.calibrate(spec, ds, fit=FIT, progress=False)
    wide = dataclasses.replace(fit, covariance=fit.covariance * 1e6)
    post = epifit.sample(init=wide, chains=2, warmup=40, draws=40, seed=1,
                         progress=False)  # fmt: skip
    lp = post.data.sample_stats["lp"].values
    assert np.all(np.isfinite(lp))
    assert post.data.sample_stats["diverging"].values.mean() < 0.5
    a0 = post.data.posterior["A0"].values
    assert np.all(a0 > 0) and np.std(a0) > 0
