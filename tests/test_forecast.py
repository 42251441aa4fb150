"""Forecasts of a fitted SIR model (the 1978 boarding-school outbreak).

One short calibration (Levenberg-Marquardt, about 15 s) serves the module.
References: the fit's own trajectories (computed by `calibrate`, not by the
forecasting code), chained solves of the ODE core over the intervals between
parameter-change days, and the Laplace covariance.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import xarray as xr

import epifit
from epifit.cli import main
from epifit.fitting import FitResult
from epifit.forecasting import Change, Scenario, forecast, plot_forecast
from epifit.ode import PIDController, solve

REPO = Path(__file__).resolve().parents[1]
SIR = REPO / "models" / "sir.toml"
SCHOOL = REPO / "data" / "boarding_school_1978.nc"
RTOL, ATOL = 1e-6, 1e-9  # the fit's solver tolerances
N_FIT = 14


@pytest.fixture(scope="module")
def fit():
    return epifit.calibrate(SIR, SCHOOL, progress=False)


@pytest.fixture(scope="module")
def fit_file(fit, tmp_path_factory):
    path = tmp_path_factory.mktemp("fit") / "FIT.nc"
    fit.to_netcdf(path)
    return path


SCENARIOS = [
    Scenario("half_beta", [Change(parameter="beta", scale=0.5, start=16, end=20)]),
    Scenario("school_closed", [Change(transmission=True, scale=0.5, start=16, end=20)]),
]


@pytest.fixture(scope="module")
def ensemble(fit):
    return forecast(
        fit, SCENARIOS, days=14, samples=40, seed=7, compartments=["S", "I", "R"]
    )


def test_baseline_reproduces_the_fitted_trajectory(fit, ensemble):
    predicted = fit.trajectories["predicted_in_bed"].values[:, 0]
    est = ensemble["estimate_in_bed"].sel(scenario="baseline").values[:N_FIT, 0]
    # same solver and tolerances as the fit; the forecast only saves more days
    np.testing.assert_allclose(est, predicted, rtol=10 * RTOL, atol=ATOL)
    for c in ("S", "I", "R"):
        np.testing.assert_allclose(
            ensemble[f"estimate_{c}"].sel(scenario="baseline").values[:N_FIT, 0],
            fit.trajectories[c].values[:, 0],
            rtol=10 * RTOL,
            atol=ATOL,
        )
    # the observations come along for context, NaN after the fit window
    obs = ensemble["observed_in_bed"].values[:, 0]
    np.testing.assert_array_equal(obs[:N_FIT], fit.problem.observed["in_bed"][:, 0])
    assert np.isnan(obs[N_FIT:]).all()


def test_zero_covariance_collapses_every_quantile_onto_the_fit(fit):
    n = len(fit.labels)
    ds = forecast(
        fit.problem,
        params=fit.params,
        covariance=np.zeros((n, n)),
        days=5,
        samples=8,
    )
    q = ds["in_bed"].sel(scenario="baseline").values[:, :, 0]
    est = ds["estimate_in_bed"].sel(scenario="baseline").values[:, 0]
    np.testing.assert_array_equal(q, np.broadcast_to(est, q.shape))
    np.testing.assert_allclose(
        est[:N_FIT],
        fit.trajectories["predicted_in_bed"].values[:, 0],
        rtol=10 * RTOL,
        atol=ATOL,
    )


def test_quantiles_are_ordered_and_bracket_the_estimate(ensemble):
    for name, var in ensemble.data_vars.items():
        if "quantile" not in var.dims:
            continue
        d = np.diff(var.transpose("quantile", ...).values, axis=0)
        assert np.all((d >= 0) | np.isnan(d)), name
    lo = ensemble["in_bed"].sel(quantile=0.025).values
    hi = ensemble["in_bed"].sel(quantile=0.975).values
    est = ensemble["estimate_in_bed"].values
    inside = (lo <= est) & (est <= hi)
    assert inside[:, 1:].all()  # the 95% band holds the point trajectory
    assert np.all(hi[:, 5:] - lo[:, 5:] > 0)  # and has some width
    assert ensemble["failed_samples"].values.tolist() == [0, 0, 0]


def test_draws_follow_the_laplace_covariance(fit):
    from epifit.forecasting import draw_samples

    xs = draw_samples(fit.x, fit.covariance, 4000, seed=0)
    # sampling error of a covariance from 4000 draws: ~ 2.5% of its scale
    np.testing.assert_allclose(np.cov(xs.T), fit.covariance, rtol=0.1, atol=1e-3)
    np.testing.assert_allclose(xs.mean(axis=0), fit.x, atol=0.1)


def test_the_same_seed_gives_identical_output(fit, ensemble):
    again = forecast(
        fit, SCENARIOS, days=14, samples=40, seed=7, compartments=["S", "I", "R"]
    )
    for name in ensemble.data_vars:
        np.testing.assert_array_equal(again[name].values, ensemble[name].values)
    other = forecast(
        fit, SCENARIOS, days=14, samples=40, seed=8, compartments=["S", "I", "R"]
    )
    assert not np.allclose(
        other["in_bed"].values[:, 0], ensemble["in_bed"].values[:, 0]
    )


def _piece(model, ts, ctrl):
    """One solve over the save times `ts`, compiled."""

    @epifit.jit
    def piece(p, y):
        args, inputs = model.precompute(p, {}, 1)
        return solve(
            model.vector_field, y, args, ts=ts, inputs=inputs, stepsize_controller=ctrl
        )

    return piece


def _chained(model, params, changes, days, rtol, atol):
    """The reference: solve piecewise over the intervals between the change
    days, each with its own (constant) parameters, the state carried across."""
    import jax.numpy as jnp

    y = model.initial_state(params, {}, 1)
    ctrl = PIDController(rtol=rtol, atol=atol)
    cuts = sorted({0, days - 1, *(d for c in changes for d in (c[0], c[1]))})
    out = [y["I"][None]]
    for a, b in zip(cuts[:-1], cuts[1:], strict=True):
        values = dict(model.constrain(params))
        for start, end, name, factor in changes:
            if start <= a < end:
                values[name] = values[name] * factor
        p = {**params, **model.unconstrain(values)}

        sol = _piece(model, np.arange(a, b + 1.0), ctrl)(p, y)
        out.append(sol.ys["I"][1:])
        y = {k: v[-1] for k, v in sol.ys.items()}
    return np.asarray(jnp.concatenate(out))[:, 0, 0]


def test_time_limited_parameter_changes_match_chained_solves(fit):
    tight = dict(rtol=1e-10, atol=1e-10)
    ds = forecast(fit, SCENARIOS, days=14, samples=0, compartments=["I"], **tight)
    model, T = fit.problem.model, N_FIT + 14
    ref = _chained(model, fit.params, [(16, 20, "beta", 0.5)], T, **tight)
    base = _chained(model, fit.params, [], T, **tight)
    for name in ("half_beta", "school_closed"):  # for SIR, transmission is beta
        got = ds["estimate_I"].sel(scenario=name).values[:, 0]
        np.testing.assert_allclose(got, ref, rtol=1e-7, atol=1e-8)
    got = ds["estimate_I"].sel(scenario="baseline").values[:, 0]
    np.testing.assert_allclose(got, base, rtol=1e-7, atol=1e-8)
    # before day 16 the scenarios are the baseline, bit for bit
    est = ds["estimate_I"].values[:, :17, 0]
    assert (est[1:] == est[0]).all()
    assert np.all(np.abs(ds["estimate_I"].values[1:, 17:, 0] - est[0, -1]) > 0)


def test_summaries_are_consistent_with_the_trajectories(ensemble):
    start = ensemble.attrs["forecast_start_day"]
    assert start == N_FIT
    # a scenario that halves transmission for four days cuts cumulative cases
    cum = ensemble["cumulative_I_total"].sel(quantile=0.5)
    assert cum.sel(scenario="half_beta") < cum.sel(scenario="baseline")
    # peak day of the (one-patch) total is that of the patch; the epidemic
    # peaked inside the fit window
    peak = ensemble["peak_day_in_bed_total"].sel(scenario="baseline", quantile=0.5)
    assert 3 <= float(peak) <= 8
    est = ensemble["estimate_in_bed"].sel(scenario="baseline").values[:, 0]
    assert ensemble["peak_in_bed"].sel(scenario="baseline").values.min() <= est.max()


def test_round_trip_and_fan_chart(ensemble, tmp_path):
    path = epifit.write_dataset(ensemble, tmp_path / "F.nc")
    back = epifit.open_dataset(path)
    assert back.attrs["epifit_kind"] == "forecast"
    xr.testing.assert_allclose(back.drop_vars("time"), ensemble.drop_vars("time"))
    assert json.loads(back.attrs["scenarios"])["half_beta"]["changes"] == [
        {"parameter": "beta", "scale": 0.5, "start": 16, "end": 20}
    ]
    fig = plot_forecast(back, tmp_path / "fan.png", series=["in_bed", "I"])
    assert (tmp_path / "fan.png").stat().st_size > 10_000
    # one panel per series (one patch: no total), the scenarios overlaid
    assert [ax.get_title() for ax in fig.axes] == [
        "in_bed — p0 (draws only)",
        "I — p0 (draws only)",
    ]
    # scenarios x 50%, 95% bands, and the days they all share once, in grey
    assert len(fig.axes[0].collections) == 3 * 2 + 2
    # the legend's title says what the bands are (the heading is one line)
    heading = " ".join(fig.legends[0].get_title().get_text().split())
    assert "(in_bed, I: 40 parameter draws only, covariance" in heading
    assert back["in_bed"].attrs["bands"] == (
        "40 parameter draws only (least_squares has no noise model: the "
        "expected observations)"
    )
    with pytest.raises(ValueError, match=r"Unknown series \['cases'\]"):
        plot_forecast(back, series=["cases"])


def test_fit_file_provenance(fit_file):
    ds = forecast(fit_file, days=3, samples=5, seed=1)
    import hashlib

    assert ds.attrs["fit_file"] == str(fit_file)
    assert ds.attrs["fit_sha256"] == hashlib.sha256(fit_file.read_bytes()).hexdigest()
    assert ds.attrs["seed"] == 1 and ds.attrs["samples"] == 5
    assert ds.attrs["covariance"] == "laplace (gauss_newton)"
    assert ds.attrs["version_jax"] and ds.attrs["model_sha256"]
    assert list(ds.scenario.values) == ["baseline"]


def test_a_fit_file_without_its_data(fit_file, tmp_path):
    ds = epifit.open_dataset(fit_file)
    ds.attrs["data_file"] = str(tmp_path / "moved.nc")
    moved = epifit.write_dataset(ds, tmp_path / "FIT.nc")
    with pytest.raises(FileNotFoundError, match="is not bound to its data"):
        forecast(moved, days=3, samples=0)
    out = forecast(moved, days=3, samples=0, data=SCHOOL)
    assert out.sizes["time"] == N_FIT + 3


def test_cli_forecast_and_plot(fit_file, tmp_path, capsys):
    scen = tmp_path / "s.toml"
    scen.write_text(
        "days = 10\n[scenarios.closure]\n"
        "changes = [{ parameter = 'beta', scale = 0.6, start = 1978-02-05 }]\n"
    )
    out = tmp_path / "F.nc"
    argv = ["forecast", str(fit_file), "--scenarios", str(scen), "--samples", "12"]
    rc = main([*argv, "--seed", "3", "--out", str(out), "--json"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["out"] == str(out) and summary["days"] == 10
    closure = summary["scenarios"]["closure"]["in_bed"]["cumulative"]["0.5"]
    base = summary["scenarios"]["baseline"]["in_bed"]["cumulative"]["0.5"]
    assert closure < base
    ds = epifit.open_dataset(out)
    assert ds.attrs["seed"] == 3 and ds.sizes["time"] == N_FIT + 10
    rc = main([*argv, "--out", str(out), "--quantiles", "0.1,0.5,0.9"])
    assert rc == 0 and "wrote" in capsys.readouterr().out
    assert epifit.open_dataset(out)["quantile"].values.tolist() == [0.1, 0.5, 0.9]
    rc = main(["plot", str(out), "--out", str(tmp_path / "fan.png")])
    assert rc == 0 and (tmp_path / "fan.png").exists()
    rc = main([*argv, "--out", str(out), "--no-observation-noise"])
    ds = epifit.open_dataset(out)
    assert rc == 0 and ds.attrs["command"].endswith("--no-observation-noise")
    assert ds.attrs["observation_noise_enabled"] == 0
    assert ds["in_bed"].attrs["bands"] == (
        "12 parameter draws only (observation noise off: the expected observations)"
    )


def test_cli_errors(fit_file, tmp_path, capsys):
    scen = tmp_path / "bad.toml"
    scen.write_text("[scenarios.x]\nchanges = [{ parameter = 'bta', scale = 0.6 }]\n")
    rc = main(
        ["forecast", str(fit_file), "--scenarios", str(scen), "--days", "3"]
        + ["--out", str(tmp_path / "F.nc")]
    )
    err = capsys.readouterr().err
    assert rc == 2
    assert f"epifit: error: {scen}: scenarios.x.changes[0].parameter: unknown " in err
    rc = main(["forecast", str(fit_file), "--out", str(tmp_path / "F.nc")])
    assert rc == 2 and "Give the forecast horizon" in capsys.readouterr().err
    assert not (tmp_path / "F.nc").exists()


def test_fit_result_from_file_is_equivalent(fit, fit_file):
    a = forecast(fit, days=4, samples=6, seed=2)
    b = forecast(FitResult.from_netcdf(fit_file), days=4, samples=6, seed=2)
    np.testing.assert_allclose(a["in_bed"].values, b["in_bed"].values, rtol=1e-12)


def test_r_eff_in_the_fit_file_and_the_forecast(fit, fit_file, ensemble):
    # the fitted trajectory's R_eff (beta S / (gamma N) for the SIR), written
    # to FIT.nc and read back; the forecast's estimate continues it
    v = fit.values
    s = fit.trajectories["S"].values[:, 0]
    r = fit.trajectories["R_eff"].values[:, 0]
    np.testing.assert_allclose(r, v["beta"] / v["gamma"] * s / 763, rtol=1e-12)
    back = FitResult.from_netcdf(fit_file).trajectories
    r_total = fit.trajectories["R_eff_total"].values
    np.testing.assert_allclose(r_total, r, rtol=1e-12)
    np.testing.assert_array_equal(back["R_eff_total"].values, r_total)
    est = ensemble["estimate_R_eff"].sel(scenario="baseline").values[:, 0]
    np.testing.assert_allclose(est[:N_FIT], r, rtol=10 * RTOL)
    lo, hi = ensemble["R_eff_total"].sel(scenario="baseline", quantile=[0.025, 0.975])
    assert np.all(lo.values <= hi.values) and np.any(lo.values < hi.values)
    assert "peak_R_eff" not in ensemble and "cumulative_R_eff" not in ensemble
