"""The figures' layout, read as a reader would: the legend off the data and
inside the figure, the y axis over the data and the bands, scenarios in
colours of their own, a residual panel under a fit, a line at R_eff = 1,
date labels that do not collide. Small synthetic fit and forecast datasets,
no model runs (the fit has no covariance, so its bands are the noise at the
fitted mean)."""

from itertools import combinations
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import xarray as xr

from epifit.fitting import Profile, plot_profile
from epifit.forecasting import plot_forecast
from epifit.plotting import plot_fit

REPO = Path(__file__).resolve().parents[1]
N_FIT, DAYS = 40, 20
LEVELS = np.array([0.025, 0.25, 0.5, 0.75, 0.975])
DATES = pd.date_range("2021-03-20", periods=N_FIT + DAYS, freq="D")


def _forecast() -> xr.Dataset:
    """Two scenarios over two patches: a peak of ~500 in the fit window, a
    forecast tail of tens, the second scenario lower from the start."""
    t = np.arange(N_FIT + DAYS)
    curve = 500.0 * np.exp(-0.5 * ((t - 15) / 6.0) ** 2) + 30.0  # (time,)
    spread = np.array([0.6, 0.85, 1.0, 1.15, 1.4])[:, None]
    base = spread * curve  # (quantile, time)
    lower = base.copy()
    lower[:, N_FIT:] *= 0.5
    q = np.stack([base, lower])[..., None] * np.array([1.0, 0.4])  # (sc, q, t, p)
    dims = ("scenario", "quantile", "time", "patch")
    reff = np.broadcast_to(np.linspace(3.0, 0.6, t.size)[:, None], q.shape).copy()
    reff[1, :, N_FIT:] *= 0.7
    observed = np.where(t < N_FIT, curve, np.nan)[:, None] * np.array([1.0, 0.4])
    draws = {"bands": "40 parameter draws and Poisson observation noise"}
    only = {"bands": "40 parameter draws only (not observed: no observation noise)"}
    return xr.Dataset(
        {
            "cases": (dims, q, draws),
            "cases_total": (dims[:3], q.sum(-1), draws),
            "R_eff": (dims, reff, only),
            "R_eff_total": (dims[:3], reff[..., 0], only),
            "observed_cases": (("time", "patch"), observed),
            # the point estimates (the medians): where the scenarios part
            "estimate_cases": (("scenario", "time", "patch"), q[:, 2]),
            "estimate_R_eff": (("scenario", "time", "patch"), reff[:, 2]),
            "estimate_R_eff_total": (("scenario", "time"), reff[:, 2, :, 0]),
        },
        coords={
            "scenario": ["baseline", "distancing"],
            "quantile": LEVELS,
            "time": DATES,
            "patch": ["north", "south"],
        },
        attrs={
            "epifit_kind": "forecast",
            "model": "toy",
            "days": DAYS,
            "forecast_start": str(DATES[N_FIT].date()),
            "forecast_start_day": N_FIT,
            "series": '["cases", "R_eff"]',
            "observations": '["cases"]',
            "samples": 40,
        },
    )


def _fit() -> xr.Dataset:
    """A Poisson SIR 'fit' of one patch without a covariance: the fitted
    curve, data around it, R_eff and a loss history."""
    text = (REPO / "models" / "sir.toml").read_text()
    text = text.replace('family = "least_squares"', 'family = "poisson"')
    t = np.arange(N_FIT)
    mu = 300.0 * np.exp(-0.5 * ((t - 14) / 5.0) ** 2) + 2.0
    rng = np.random.default_rng(3)
    y = rng.poisson(mu).astype(float)
    names = ["N", "beta", "gamma", "I0"]
    return xr.Dataset(
        {
            "predicted_in_bed": (("time", "patch"), mu[:, None]),
            "observed_in_bed": (("time", "patch"), y[:, None]),
            "R_eff": (("time", "patch"), np.linspace(3.8, 0.2, N_FIT)[:, None]),
            "loss_history": ("iteration", np.geomspace(200.0, 60.0, 30)),
            "estimate": ("parameter", [763.0, 1.9, 0.48, 1.5]),
        },
        coords={
            "time": DATES[:N_FIT],
            "patch": ["p0"],
            "iteration": np.arange(1, 31),
            "parameter": names,
            "parameter_name": ("parameter", names),
        },
        attrs={"epifit_kind": "fit", "model": "sir", "model_text": text, "loss": 60.0},
    )


def _drawn(fig):
    fig.canvas.draw()
    return fig.canvas.get_renderer()


def _legend_faults(fig) -> list[str]:
    """What is wrong with the figure legend's place: outside the figure, or
    over an axes (empty when it is off the data)."""
    renderer = _drawn(fig)
    (legend,) = fig.legends
    box = legend.get_window_extent(renderer)
    whole = fig.bbox
    faults = []
    if not (whole.x0 <= box.x0 and box.x1 <= whole.x1):
        faults.append(f"legend {box} sticks out sideways of the figure {whole}")
    if not (whole.y0 <= box.y0 and box.y1 <= whole.y1):
        faults.append(f"legend {box} sticks out vertically of the figure {whole}")
    for ax in fig.axes:
        if box.overlaps(ax.get_window_extent(renderer)):
            faults.append(f"legend over the axes {ax.get_title()!r}")
    return faults


def _tick_label_boxes(fig, ax) -> list:
    """The window extents of `ax`'s visible, non-empty x tick labels."""
    renderer = _drawn(fig)
    return [
        label.get_window_extent(renderer)
        for label in ax.get_xticklabels()
        if label.get_visible() and label.get_text()
    ]


def _overlapping(boxes) -> list:
    return [(a, b) for a, b in combinations(boxes, 2) if a.overlaps(b)]


def _axes(fig, title: str):
    return next(ax for ax in fig.axes if ax.get_title() == title)


def _has_line_at_one(ax) -> bool:
    return any(
        np.allclose(np.asarray(ln.get_ydata(), float), 1.0) and len(ln.get_ydata()) == 2
        for ln in ax.get_lines()
    )


@pytest.fixture(scope="module")
def fan():
    ds = _forecast()
    return ds, plot_forecast(ds, patches=["south"])


def test_the_fan_chart_legend_is_inside_the_figure_and_off_the_data(fan):
    _, fig = fan
    assert _legend_faults(fig) == []
    assert all(ax.get_legend() is None for ax in fig.axes)
    title = fig.legends[0].get_title().get_text()
    assert "central 50%/95% predictive intervals" in " ".join(title.split())
    assert "\n" not in fig.get_suptitle()  # details in the legend, one line on top


def test_the_fan_chart_y_axis_covers_the_data_and_the_forecast_bands(fan):
    ds, fig = fan
    for area, ax in (
        ("total", _axes(fig, "cases — all patches (draws + Poisson noise)")),
        ("south", _axes(fig, "cases — south (draws + Poisson noise)")),
    ):
        if area == "total":
            q, obs = ds["cases_total"], ds["observed_cases"].sum("patch")
        else:
            q, obs = (
                ds["cases"].sel(patch="south"),
                ds["observed_cases"].sel(patch=area),
            )
        bottom, top = ax.get_ylim()
        assert top >= np.nanmax(obs.values)  # the fit window's peak is not clipped
        window = q.isel(time=slice(N_FIT, None))
        assert top >= float(window.max()) and bottom <= float(window.min())
        # the forecast window is the right end of the x axis
        assert ax.get_xlim()[1] == pytest.approx(ax.convert_xunits(DATES[-1]))


def test_each_scenario_has_its_own_colour_and_line_style(fan):
    _, fig = fan
    ax = _axes(fig, "cases — south (draws + Poisson noise)")
    medians = [ln for ln in ax.get_lines() if ln.get_linewidth() == 1.8]
    styles = {(ln.get_color(), ln.get_linestyle()) for ln in medians}
    colours = {c for c, _ in styles}
    # baseline, distancing, and grey where they agree (the fit window)
    assert len(colours) == 3 and len({s for _, s in styles}) >= 2
    # grey up to the day the point estimates part (the forecast start)
    (shared,) = [ln for ln in medians if ln.get_color() == "0.35"]
    assert ax.convert_xunits(shared.get_xdata()[-1]) == pytest.approx(
        ax.convert_xunits(DATES[N_FIT])
    )
    # the bands are tinted: the forecast window's fills carry both colours
    fills = {tuple(np.round(pc.get_facecolor()[0][:3], 3)) for pc in ax.collections}
    assert len(fills) >= 3


def test_the_r_eff_panel_has_a_line_at_one_and_its_band(fan):
    _, fig = fan
    ax = _axes(fig, "R_eff — south (draws only)")
    assert _has_line_at_one(ax)
    assert len(ax.collections) >= 2  # bands
    assert ax.get_ylim()[1] >= 3.0  # the early values are not cut


def test_date_tick_labels_do_not_overlap(fan):
    _, fig = fan
    boxes = _tick_label_boxes(fig, fig.axes[-1])
    assert len(boxes) >= 2
    assert _overlapping(boxes) == []


@pytest.fixture(scope="module")
def fit_figure():
    ds = _fit()
    return ds, plot_fit(ds)


def test_the_fit_plot_has_a_residual_panel_of_pearson_residuals(fit_figure):
    ds, fig = fit_figure
    (res,) = [ax for ax in fig.axes if "residual" in ax.get_ylabel()]
    mu = ds["predicted_in_bed"].values[:, 0]
    y = ds["observed_in_bed"].values[:, 0]
    dots = next(ln for ln in res.get_lines() if ln.get_marker() == "o")
    np.testing.assert_allclose(dots.get_ydata(), (y - mu) / np.sqrt(mu), rtol=1e-12)
    assert "Pearson" in fig.legends[0].get_title().get_text()
    boxes = _tick_label_boxes(fig, res)
    assert len(boxes) >= 2 and _overlapping(boxes) == []


def test_the_fit_plot_y_axis_covers_data_and_band_and_is_labelled(fit_figure):
    ds, fig = fit_figure
    ax = _axes(fig, "in_bed — p0")
    assert ax.get_ylim()[1] >= ds["observed_in_bed"].max()
    (band,) = ax.collections
    top = max(float(np.max(p.vertices[:, 1])) for p in band.get_paths())
    assert ax.get_ylim()[1] >= top > ds["predicted_in_bed"].max()
    assert ax.get_ylabel() == "in_bed (number on the day)"
    reff = _axes(fig, "R_eff — p0")
    assert _has_line_at_one(reff) and reff.get_ylim()[1] >= 3.8
    assert _legend_faults(fig) == []
    title = " ".join(fig.legends[0].get_title().get_text().split())
    assert "no parameter draws" in title and "Poisson noise at the fitted mean" in title


def test_the_profile_legend_is_off_the_curve(tmp_path):
    grid = np.linspace(0.4, 0.6, 9)
    delta = 80.0 * (grid - 0.5) ** 2
    profile = Profile(
        parameter="gamma",
        grid=grid,
        grid_x=np.log(grid),
        value=delta + 10.0,
        delta=delta,
        x=np.zeros((9, 3)),
        estimates=np.zeros((9, 3)),
        estimate_labels=["I0", "beta", "gamma"],
        converged=np.ones(9, bool),
        steps=np.ones(9, int),
        estimate=0.5,
        minimum=10.0,
        level=0.95,
        cut=1.92,
        lower=0.345,
        upper=0.655,
        identifiable=(True, True),
        laplace_lower=0.35,
        laplace_upper=0.65,
        free_labels=["I0", "beta", "gamma"],
        notes=[],
        attrs={},
    )
    assert _legend_faults(plot_profile(profile)) == []
