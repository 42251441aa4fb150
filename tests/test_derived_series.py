"""`[derived]` expressions that read compartment totals or covariates are
derived *series* (issue 20, item 3): evaluated along the trajectory and
written as `(time, patch)` variables by simulate and into FIT.nc; other
expressions may not use them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import xarray as xr
from test_cookbook import vaccination_dataset

import epifit
from epifit.cli import main
from epifit.model import ModelSpecError, loads_model
from epifit.plotting import plot_fit

REPO = Path(__file__).resolve().parents[1]

TEXT = (
    (REPO / "models" / "seir_vaccination.toml")
    .read_text()
    .replace(
        "[covariates]",
        '[derived]\nprevalence = "I / N"\n'
        'per_dose = "prevalence * 1000 / (doses + 1)"\nR0 = "beta / gamma"\n\n'
        "[covariates]",
    )
)


def test_series_are_evaluated_along_the_trajectory():
    spec = loads_model(TEXT, path="vs.toml")
    assert [d.name for d in spec.series] == ["prevalence", "per_dose"]
    assert [d.name for d in spec.derived] == ["R0"]  # a quantity, not a series
    ds = vaccination_dataset()
    out = epifit.simulate(spec, ds)
    assert out["prevalence"].dims == ("time", "patch")
    i = out["I"].values[:, 0]
    np.testing.assert_allclose(out["prevalence"].values[:, 0], i / 1e5, rtol=1e-12)
    want = i / 1e5 * 1000 / (ds["doses"].values + 1)
    np.testing.assert_allclose(out["per_dose"].values[:, 0], want, rtol=1e-12)


def test_fit_files_carry_the_series(tmp_path):
    spec = loads_model(TEXT, path="vs.toml")
    ds = vaccination_dataset()
    out = epifit.simulate(spec, ds)
    for name in ("cases", "vaccinated"):  # the model's own expected counts
        ds[name] = ("time", np.round(out[f"predicted_{name}"].values[:, 0]))
    model = tmp_path / "vs.toml"  # from a file: FIT.nc keeps its text
    model.write_text(TEXT)
    fit = epifit.calibrate(
        model, ds, max_iterations=2, uncertainty=False, progress=False
    )
    fit.to_netcdf(tmp_path / "FIT.nc")
    with xr.open_dataset(tmp_path / "FIT.nc") as f:
        np.testing.assert_allclose(
            f["prevalence"].values, f["I"].values / 1e5, rtol=1e-12
        )
        assert json.loads(f.attrs["derived_series"]) == ["prevalence", "per_dose"]
    # `epifit plot` draws a row per series after the observed ones
    png = tmp_path / "fit.png"
    assert main(["plot", str(tmp_path / "FIT.nc"), "--out", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    fig = plot_fit(tmp_path / "FIT.nc")
    titles = [ax.get_title() for ax in fig.axes]
    # observed series with a residual panel (no title) under each
    assert titles == [
        "cases — p0",
        "",
        "vaccinated — p0",
        "",
        "prevalence — p0",
        "per_dose — p0",
        "loss history",
    ]
    assert [ax.get_ylabel() for ax in fig.axes][1] == "Pearson\nresidual"
    # no covariance (uncertainty=False): the noise at the fitted mean only
    heading = " ".join(fig.legends[0].get_title().get_text().split())
    assert (
        "Bands: central 95% predictive intervals (cases, vaccinated: Poisson "
        "noise at the fitted mean, no parameter draws)" in heading
    )
    assert "The fit has no finite covariance (fitted without uncertainty" in heading
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels[:3] == ["model at the fitted parameters", "observed", "95% band"]


def test_a_series_cannot_feed_another_expression():
    bad = TEXT.replace('rate = "sigma"', 'rate = "sigma * (1 + prevalence)"', 1)
    with pytest.raises(
        ModelSpecError,
        match=r"'prevalence' \(a derived series\) "
        r"cannot be used in a rate",
    ):
        loads_model(bad, path="b.toml")


# -- forecasts and plots ------------------------------------------------------
FORCE = TEXT.replace(
    'R0 = "beta / gamma"', 'R0 = "beta / gamma"\nforce = "beta * I / N"'
).replace(
    "I0 = { value = 20.0, fixed = true }",
    "I0 = { value = [20.0, 5.0], fixed = true, per_patch = true }",
)
PATCHES = ["north", "south"]


def two_patches() -> xr.Dataset:
    """`vaccination_dataset` on two patches: the doses shared, the counts per
    patch (their values do not matter: nothing is fitted)."""
    ds = vaccination_dataset()
    ones = (("time", "patch"), np.ones((ds.sizes["time"], 2)))
    return ds.assign(cases=ones, vaccinated=ones).assign_coords(patch=PATCHES)


@pytest.fixture(scope="module")
def forecast_of_series():
    """Two patches (north starts with 20 infected, south with 5), 20 draws of
    (beta, eff); `half` halves beta on days 125-129, `nodose` stops the doses
    from day 122 (the baseline carries the last day's 800 forward)."""
    from epifit.forecasting import Change, Scenario, forecast
    from epifit.simulation import Problem

    problem = Problem(loads_model(FORCE, path="vs.toml"), two_patches())
    params = problem.init_params()
    scenarios = [
        Scenario("half", [Change(parameter="beta", scale=0.5, start=125, end=130)]),
        Scenario("nodose", [Change(covariate="doses", value=0.0, start=122)]),
    ]
    return forecast(
        problem,
        scenarios,
        params=params,
        covariance=np.diag([0.01, 0.01]),
        samples=20,
        days=14,
        compartments=["I"],
    )


def test_forecasts_carry_the_series_at_each_scenarios_values(forecast_of_series):
    fc = forecast_of_series
    assert json.loads(fc.attrs["derived_series"]) == ["prevalence", "per_dose", "force"]
    dims = ("scenario", "quantile", "time", "patch")
    for name in ("prevalence", "per_dose", "force"):
        assert fc[name].dims == dims
        assert fc[f"estimate_{name}"].dims == ("scenario", "time", "patch")
        for absent in (f"{name}_total", f"peak_{name}", f"cumulative_{name}"):
            assert absent not in fc  # a ratio per patch has no sum or peak
    assert fc["force"].attrs["long_name"] == (
        "quantiles of derived series force = beta * I / N"
    )
    # I / N with N fixed: the quantiles of I over the same draws, divided by N
    np.testing.assert_allclose(fc["prevalence"], fc["I"] / 1e5, rtol=1e-12)
    i = fc["estimate_I"].values  # (scenario, time, patch)
    beta = 0.45  # beta's value at the point estimate (the model's initial value)
    ones = np.ones(fc.sizes["time"])
    half = np.where(
        (np.arange(ones.size) >= 125) & (np.arange(ones.size) < 130), 0.5, 1
    )
    for k, (name, factor) in enumerate(
        (("baseline", ones), ("half", half), ("nodose", ones))
    ):
        want = beta * factor[:, None] * i[k] / 1e5
        np.testing.assert_allclose(
            fc["estimate_force"].sel(scenario=name).values, want, rtol=1e-12
        )
    doses = np.r_[vaccination_dataset()["doses"].values, np.full(14, 800.0)]
    stopped = np.where(np.arange(doses.size) >= 122, 0.0, doses)
    for k, name, d in ((0, "baseline", doses), (2, "nodose", stopped)):
        want = i[k] / 1e5 * 1000 / (d[:, None] + 1)
        got = fc["estimate_per_dose"].sel(scenario=name).values
        np.testing.assert_allclose(got, want, rtol=1e-12)


def test_plot_forecast_draws_a_row_per_series_and_names_its_bands(
    forecast_of_series, tmp_path
):
    from epifit.forecasting import plot_forecast

    path = tmp_path / "FORECAST.nc"
    forecast_of_series.to_netcdf(path)
    png = tmp_path / "fc.png"
    assert main(["plot", str(path), "--out", str(png), "--patches", "south"]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    fig = plot_forecast(path, patches=["south"])
    titles = [ax.get_title() for ax in fig.axes]
    # one panel per series and area, the three scenarios overlaid
    assert "force — south (draws only)" in titles
    # no sum over patches: the panel for all patches draws each patch's median
    assert "prevalence — median of each patch" in titles
    assert "cases — all patches (draws + Poisson noise)" in titles
    panel = fig.axes[titles.index("prevalence — median of each patch")]
    assert len(panel.get_lines()) == 3 * 2 + 1  # scenarios x patches, the start
    # the legend's title (wrapped to the width) says what the bands are
    heading = " ".join(fig.legends[0].get_title().get_text().split())
    assert "bands: central 50%/95% predictive intervals" in heading
    assert (
        "cases, vaccinated: 20 parameter draws + Poisson noise; prevalence, "
        "per_dose, force: 20 parameter draws only" in heading
    )


def test_a_series_named_like_a_forecast_variable_is_refused():
    from epifit.forecasting import forecast
    from epifit.simulation import Problem

    bad = TEXT.replace('R0 = "beta / gamma"', 'R0 = "beta / gamma"\ncases = "I / N"')
    problem = Problem(loads_model(bad, path="b.toml"), vaccination_dataset())
    with pytest.raises(
        ValueError,
        match=r"^The derived series 'cases' of model 'seir_vaccination' would be "
        r"written to the forecast as 'cases', which the observed series 'cases' "
        r"also writes; rename it in the model's \[derived\]\.$",
    ):
        forecast(problem, days=7, samples=0)


@pytest.mark.parametrize("name", ["state", "R_eff", "predicted_cases", "cases_total"])
def test_a_series_named_like_an_output_variable_is_refused_at_load(name):
    """simulate and FIT.nc would write the series over their own variable."""
    bad = TEXT.replace('R0 = "beta / gamma"', f'R0 = "beta / gamma"\n{name} = "I / N"')
    with pytest.raises(
        ModelSpecError,
        match=rf"^b\.toml: derived\.{name}: derived series '{name}' would be "
        "written over the output variable of that name",
    ):
        loads_model(bad, path="b.toml")
    fine = TEXT.replace('R0 = "beta / gamma"', 'R0 = "beta / gamma"\nstate_x = "I / N"')
    assert "state_x" in [d.name for d in loads_model(fine, path="b.toml").series]


def test_a_series_of_a_stratified_model_reads_each_cells_values():
    """Per-region and per-age parameters and a `(patch, age)` covariate on
    the cells (it failed on their shapes before)."""
    from test_cookbook import age_region_dataset

    text = (REPO / "models" / "seir_age_region.toml").read_text()
    text = text.replace(
        "[covariates]",
        '[derived]\nrisk = "q * susceptibility * I / population"\n\n[covariates]',
        1,
    )
    ds = age_region_dataset()
    out = epifit.simulate(loads_model(text, path="ar.toml"), ds)
    assert out["risk"].dims == ("time", "patch", "age")
    susceptibility = np.array([0.8, 1.0, 1.2])  # the model file's, per age
    want = 0.05 * susceptibility * out["I"].values / ds["population"].values
    np.testing.assert_allclose(out["risk"].values, want, rtol=1e-12)
