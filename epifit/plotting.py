"""Figures of fits and simulations (matplotlib, imported lazily).

Figures are built on `matplotlib.figure.Figure` with the Agg canvas, so nothing
here touches pyplot's global state or needs a display; in a notebook,
`display(fig)` shows one.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import xarray as xr

from epifit._figure import (
    cover_y,
    date_axis,
    figure_legend,
    short_bands,
    unit_label,
)
from epifit._fit_figure import draw_loss, fitted_values, heading, percent
from epifit._paths import save_figure
from epifit._schema import PATCH, TIME

__all__ = ["plot_fit", "select_patches"]

# the effective reproduction number along the trajectory (a row of panels,
# with a line at 1; not a weight in choosing the largest patches)
REFF = "R_eff"
LEVEL = 0.95  # a fit's band without draws: the central 95% of each point's noise
FAMILY_NAMES = {"poisson": "Poisson", "negative_binomial": "NB", "gaussian": "Gaussian"}
BAND_LEVELS = (0.025, 0.25, 0.5, 0.75, 0.975)  # the draws' quantiles: 95%, 50%
PANEL = (3.2, 2.1)  # inches of one panel (width, height); a residual panel is
RESIDUAL = 0.8  # this tall, under its panel
LOSS = 1.7
MIN_WIDTH = 5.6  # inches: room for the legend beside a single column


def _derived(ds: xr.Dataset) -> list[str]:
    """The derived series of the file (`[derived]` reading the state or
    covariates; the `derived_series` attribute): a row of panels each, like
    `R_eff`, not a weight in choosing the largest patches."""
    return [s for s in json.loads(ds.attrs.get("derived_series", "[]")) if s in ds]


def _series(ds: xr.Dataset) -> list[tuple[str, str | None, str | None]]:
    """`(title, predicted variable, observed variable)` for every panel row."""
    out = []
    for name in ds.data_vars:
        if name.startswith("predicted_"):
            obs = name[len("predicted_") :]
            observed = f"observed_{obs}" if f"observed_{obs}" in ds else None
            out.append((obs, name, observed))
    for name in ds.data_vars:
        if name.startswith("observed_") and f"predicted_{name[9:]}" not in ds:
            out.append((name[9:], None, name))
    if out:
        if REFF in ds:
            out.append((REFF, REFF, None))
        return out + [(s, s, None) for s in _derived(ds)]
    skip = ("predicted_", "observed_", "residual_")
    return [
        (name, name, None)
        for name in ds.data_vars
        if set(ds[name].dims) == {TIME, PATCH} and not name.startswith(skip)
    ]


def select_patches(
    ds: xr.Dataset, patches: list[str] | None = None, max_patches: int = 12
) -> tuple[list[str], str]:
    """The patches to draw: the given ones (checked), or all of them up to
    `max_patches`, else the `max_patches` with the largest observed (or
    predicted) totals. Returns the labels and a note for the title."""
    available = [str(p) for p in ds[PATCH].values] if PATCH in ds.coords else []
    if patches:
        unknown = [p for p in patches if p not in available]
        if unknown:
            shown = available if len(available) <= 20 else available[:20] + ["..."]
            raise ValueError(
                f"Unknown patch(es) {unknown}; the file has {len(available)} "
                f"patches: {', '.join(shown)}"
            )
        return list(patches), ""
    if len(available) <= max_patches:
        return available, ""
    weights = np.zeros(len(available))
    levels = {REFF, *_derived(ds)}
    for title, pred, obs in _series(ds):
        if title in levels and pred == title:
            continue
        var = ds[obs if obs is not None else pred]
        weights += np.nan_to_num(var.sum(TIME, skipna=True).values)
    order = np.argsort(-weights, kind="stable")[:max_patches]
    chosen = [available[i] for i in sorted(order)]
    return chosen, f"{max_patches} of {len(available)} patches (largest)"


def plot_fit(
    source: xr.Dataset | str | os.PathLike,
    out: str | os.PathLike | None = None,
    *,
    patches: list[str] | None = None,
    max_patches: int = 12,
    columns: int = 4,
    samples: int = 100,
    seed: int = 0,
) -> Any:
    """Draw a fit (`FIT.nc`) or a simulation against its data.

    One block of panels per observed series, then `R_eff` (with a line at
    1) and each derived series, one panel per patch (small multiples, or
    the chosen `patches`): the model at the fitted parameters as a line,
    the observations as dots; under each observed series of a fit its
    Pearson residuals (`(observed - fitted) / sd` by the series' noise
    model; else `observed - fitted`); a last panel with the loss history.

    The bands of a fit with a covariance are predictive: the central 50%
    and 95% intervals over `samples` draws from its Laplace approximation,
    each with its observation noise (least-squares series: the draws only),
    by [`forecast`][epifit.forecasting.forecast] over the data's days (one
    compile of the model). Without draws a series with a noise model gets
    the 95% interval of its noise at the fitted mean; the legend says which.
    Bands reaching over two spans above the data and line are cut there,
    with a note of their top. Cost: one axes (two with residuals) per series
    and patch drawn, at most `max_patches` patches unless chosen.

    Args:
        source: a dataset, or a netCDF file from `epifit calibrate` or
            `epifit simulate`.
        out: write the figure here (PNG, PDF or SVG by suffix) when given.
        patches: labels of the patches to draw (default: all, or the
            `max_patches` largest).
        max_patches: the most patches drawn when none are chosen.
        columns: panels per row.
        samples: parameter draws for the predictive bands (0: none).
        seed: the seed of the draws.

    Returns:
        The `matplotlib.figure.Figure`.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from epifit.data import open_dataset

    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 0:
        raise ValueError(f"samples must be an integer >= 0; got {samples!r}")
    ds = open_dataset(source) if isinstance(source, str | os.PathLike) else source
    series = _series(ds)
    if not series:
        raise ValueError(
            "Nothing to plot: the file has no predicted_/observed_ variables and no "
            f"(time, patch) variables; found {sorted(map(str, ds.data_vars))}"
        )
    chosen, note = select_patches(ds, patches, max_patches)
    spec = _spec(ds)
    draws, why = _draws(source, ds, samples, seed)
    bands = _draw_bands(ds, draws) if draws is not None else predictive_bands(ds)
    if not chosen:
        chosen = [None]
    ncols = max(1, min(columns, len(chosen)))
    rows_per = math.ceil(len(chosen) / ncols)
    is_fit = ds.attrs.get("epifit_kind") == "fit"
    has_loss = "loss_history" in ds and ds["loss_history"].size > 0
    heights: list[float] = []
    for _, pred, obs in series:
        with_residuals = is_fit and pred is not None and obs is not None
        heights += ([PANEL[1], RESIDUAL] if with_residuals else [PANEL[1]]) * rows_per
    heights += [LOSS] if has_loss else []
    fig = Figure(
        figsize=(max(PANEL[0] * ncols + 0.6, MIN_WIDTH), sum(heights) + 1.4),
        layout="constrained",
    )
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(len(heights), ncols, height_ratios=heights)
    row = 0
    for entry in series:
        with_residuals = is_fit and entry[1] is not None and entry[2] is not None
        _draw_series(
            fig,
            grid,
            ds,
            entry,
            chosen,
            first_row=row,
            band=bands.get(entry[0]),
            obs_spec=_observation(spec, entry[0]),
            residuals=_residuals(ds, spec, entry[0]) if with_residuals else None,
        )
        row += rows_per * (2 if with_residuals else 1)
    if has_loss:
        draw_loss(fig.add_subplot(grid[row, :]), ds)
    fig.suptitle(heading(ds, note), fontsize=10)
    figure_legend(fig, _handles(ds, bands, spec), title=_explain(ds, bands, spec, why))
    if out is not None:
        save_figure(fig, out)
    return fig


def _spec(ds: xr.Dataset) -> Any:
    """The model spec from the file's model text, or None."""
    if not ds.attrs.get("model_text"):
        return None
    from epifit.model import loads_model

    return loads_model(str(ds.attrs["model_text"]), path="FIT.nc model_text")


def _observation(spec: Any, name: str) -> Any:
    if spec is None:
        return None
    return next((o for o in spec.observations if o.name == name), None)


def _draws(
    source: Any, ds: xr.Dataset, samples: int, seed: int
) -> tuple[xr.Dataset | None, str]:
    """The fit's predictive quantiles over the data's days (a forecast of 0
    days past them, baseline only), or None and why not ("" where nothing
    was asked for: a simulation, `samples=0`)."""
    if samples == 0 or ds.attrs.get("epifit_kind") != "fit":
        return None, ""
    cov = ds["covariance"].values if "covariance" in ds else np.full(1, np.nan)
    if not np.all(np.isfinite(np.asarray(cov, float))):
        return None, (
            "the fit has no finite covariance (fitted without uncertainty, or "
            "its Laplace approximation failed)"
        )
    from epifit.data import write_dataset
    from epifit.forecasting import forecast

    with tempfile.TemporaryDirectory(prefix="epifit-plot-") as tmp:
        path = source
        if not isinstance(source, str | os.PathLike):
            path = write_dataset(ds, Path(tmp) / "FIT.nc")
        try:
            fc = forecast(
                path, days=0, samples=samples, seed=seed, quantiles=BAND_LEVELS
            )
        except (ValueError, OSError, KeyError, NotImplementedError) as e:
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            return None, f"no parameter draws ({first[:120]})"
    if fc.sizes[TIME] != ds.sizes[TIME]:
        return None, "no parameter draws (the forecast's days differ from the fit's)"
    return fc, ""


def _draw_bands(ds: xr.Dataset, fc: xr.Dataset) -> dict[str, tuple[str, list]]:
    """Per series of the forecast `fc` over the fit's days: `(what the bands
    are over, [(width, lower, upper), ...] outermost first)`."""
    levels = np.asarray(fc["quantile"].values, float)
    pairs = [(0, 4), (1, 3)] if levels.size == 5 else []
    out = {}
    for name in json.loads(fc.attrs.get("series", "[]")):
        if name not in fc:
            continue
        q = fc[name].sel(scenario="baseline").drop_vars("scenario", errors="ignore")
        q = q.assign_coords({TIME: ds[TIME].values})
        found = [
            (
                f"{100 * (levels[hi] - levels[lo]):g}%",
                q.isel(quantile=lo, drop=True),
                q.isel(quantile=hi, drop=True),
            )
            for lo, hi in pairs
        ]
        out[name] = (str(fc[name].attrs.get("bands", "parameter draws")), found)
    return out


def predictive_bands(ds: xr.Dataset) -> dict[str, tuple[str, list]]:
    """Per observed series of a fit (`epifit_kind = "fit"`) with a noise
    model: `(what, [(width, lower, upper)])`, the central `LEVEL` interval
    of its family at the fitted mean (`predicted_NAME`) and the fitted
    dispersion or sd (`epifit.simulation.noise_quantile`), without the
    parameters' uncertainty. None for a least-squares series, a simulation,
    or a file without its model text."""
    if ds.attrs.get("epifit_kind") != "fit" or not ds.attrs.get("model_text"):
        return {}
    from epifit.simulation import noise_of, noise_quantile

    spec = _spec(ds)
    values = fitted_values(ds)
    out = {}
    for obs in spec.observations:
        pred = ds.get(f"predicted_{obs.name}")
        if obs.family == "least_squares" or pred is None:
            continue
        try:
            family, kw = noise_of(obs, values, "model")
        except (KeyError, ValueError):  # an sd reading covariates: not in the
            continue  # file's parameter table, so no band for this series
        lo, hi = (
            pred.copy(data=noise_quantile(family, q, pred.values, **kw))
            for q in ((1 - LEVEL) / 2, (1 + LEVEL) / 2)
        )
        what = f"{FAMILY_NAMES[family]} noise at the fitted mean, no parameter draws"
        out[obs.name] = (what, [(f"{100 * LEVEL:g}%", lo, hi)])
    return out


def _residuals(ds: xr.Dataset, spec: Any, name: str) -> tuple[xr.DataArray, str]:
    """`(residuals, kind)` of observed series `name`: Pearson residuals
    `(observed - fitted) / sd` with the sd of its noise model at the fit
    (poisson `sqrt(mu)`, negative binomial `sqrt(mu + mu^2 / phi)`,
    gaussian `sd`, least squares `sqrt(s^2 / weight)` from the Gauss-Newton
    residual variance `s^2`), else `observed - fitted`."""
    raw = ds[f"observed_{name}"] - ds[f"predicted_{name}"]
    obs = _observation(spec, name)
    mu = np.maximum(np.asarray(ds[f"predicted_{name}"].values, float), 1e-12)
    sd = None
    if obs is not None and obs.family == "least_squares":
        s2 = json.loads(ds.attrs.get("uncertainty", "{}") or "{}").get("noise_variance")
        if s2 is not None and math.isfinite(s2) and s2 > 0:
            sd = np.sqrt(s2 / obs.weight)
    elif obs is not None:
        from epifit.simulation import noise_of

        try:
            family, kw = noise_of(obs, fitted_values(ds), "model")
        except (KeyError, ValueError):
            family, kw = "", {}
        if family == "poisson":
            sd = np.sqrt(mu)
        elif family == "negative_binomial":
            sd = np.sqrt(mu + mu**2 / kw["dispersion"])
        elif family == "gaussian":
            sd = np.broadcast_to(kw["sd"], mu.shape)
    if sd is None:
        return raw, "observed − fitted"
    return raw / sd, "Pearson"


def _draw_series(
    fig: Any,
    grid: Any,
    ds: xr.Dataset,
    row: tuple[str, str | None, str | None],
    chosen: list[str | None],
    *,
    first_row: int,
    band: tuple[str, list] | None = None,
    obs_spec: Any = None,
    residuals: tuple[xr.DataArray, str] | None = None,
) -> None:
    """One block of panels, one per patch (`None`: no patch dim), from grid row
    `first_row`: the observations as dots, the prediction as a line, the
    `band` `(what, [(width, lower, upper), ...])` shaded, and under each
    panel its `residuals` when given."""
    title, pred, obs = row
    ncols = grid.ncols
    step = 2 if residuals is not None else 1
    t = ds[TIME].values
    for j, patch in enumerate(chosen):
        r, c = first_row + step * (j // ncols), j % ncols
        ax = fig.add_subplot(grid[r, c])
        sel = {} if patch is None else {PATCH: patch}
        shown, outer = [], []
        if band is not None:
            for k, (_, lo, hi) in enumerate(band[1]):
                lo, hi = (lo.sel(sel).values, hi.sel(sel).values) if sel else (lo, hi)
                lo, hi = np.asarray(lo, float), np.asarray(hi, float)
                keep = np.isfinite(lo) & np.isfinite(hi)
                alpha = 0.18 + 0.17 * k
                ax.fill_between(
                    t[keep], lo[keep], hi[keep], color="C0", alpha=alpha, lw=0
                )
                outer.extend([lo, hi])
        if obs is not None:
            y = ds[obs].sel(sel).values if sel else ds[obs].values
            ax.plot(t, y, "o", ms=3, color="0.15", zorder=3)
            shown.append(y)
        if pred is not None:
            y = ds[pred].sel(sel).values if sel else ds[pred].values
            keep = np.isfinite(y)  # weekly totals are NaN between their dates
            ax.plot(t[keep], y[keep], "-", color="C0", lw=1.6)
            shown.append(y)
        if title == REFF:
            ax.axhline(1.0, color="0.35", ls=":", lw=1)
        cover_y(ax, shown, lines=[1.0] if title == REFF else [], outer=outer)
        name = title if patch is None else f"{title} — {patch}"
        ax.set_title(name, fontsize=9)
        if c == 0:
            ax.set_ylabel(unit_label(title, obs_spec), fontsize=8)
        date_axis(ax, t)
        if residuals is not None:
            ax.tick_params(labelbottom=False)
            res_ax = fig.add_subplot(grid[r + 1, c], sharex=ax)
            _draw_residuals(res_ax, t, residuals, sel, first=c == 0)


def _draw_residuals(
    ax: Any, t: np.ndarray, residuals: tuple[xr.DataArray, str], sel: dict, first: bool
) -> None:
    """Residuals as stems from 0; Pearson ones with dotted lines at +-2."""
    values, kind = residuals
    r = np.asarray(values.sel(sel).values if sel else values.values, float)
    keep = np.isfinite(r)
    ax.axhline(0.0, color="0.35", lw=0.8)
    ax.vlines(t[keep], 0.0, r[keep], color="0.45", lw=1)
    ax.plot(t[keep], r[keep], "o", ms=2.5, color="0.15")
    if kind == "Pearson":
        for y in (-2.0, 2.0):
            ax.axhline(y, color="0.6", ls=":", lw=0.8)
        lim = max(2.5, 1.1 * float(np.max(np.abs(r[keep]), initial=0.0)))
        ax.set_ylim(-lim, lim)
    if first:
        ax.set_ylabel(
            "Pearson\nresidual" if kind == "Pearson" else "obs − fit", fontsize=7.5
        )
    date_axis(ax, t)


def _handles(ds: xr.Dataset, bands: dict, spec: Any) -> list[tuple[Any, str]]:
    """The legend's entries: the line, the dots, each band width and the
    line at 1 where drawn."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    kind = ds.attrs.get("epifit_kind", "simulation")
    line = "model at the fitted parameters" if kind == "fit" else "the simulation"
    entries = [(Line2D([], [], color="C0", lw=1.6), line)]
    if any(n.startswith("observed_") for n in ds.data_vars):
        dot = Line2D([], [], ls="", marker="o", ms=3, color="0.15")
        entries.append((dot, "observed"))
    widths = sorted(
        {w for _, found in bands.values() for w, _, _ in found}, key=percent
    )
    for k, w in enumerate(widths[::-1]):
        entries.append((Patch(color="C0", alpha=0.18 + 0.17 * k, lw=0), f"{w} band"))
    if REFF in ds:
        entries.append((Line2D([], [], color="0.35", ls=":", lw=1), "R_eff = 1"))
    return entries


def _explain(ds: xr.Dataset, bands: dict, spec: Any, why: str) -> str:
    """The legend's title: what the bands are, per group of series, and
    which residuals are drawn."""
    if not bands:
        text = "No uncertainty bands"
        text += f": {why}." if why else "."
    else:
        groups: dict[str, list[str]] = {}
        for name, (what, found) in bands.items():
            if found:
                groups.setdefault(short_bands(what), []).append(name)
        widths = sorted({w for _, f in bands.values() for w, _, _ in f}, key=percent)
        over = "; ".join(f"{', '.join(n)}: {w}" for w, n in groups.items())
        text = f"Bands: central {'/'.join(widths)} predictive intervals ({over})."
        if why:
            text += f" {why[0].upper()}{why[1:]}."
    if ds.attrs.get("epifit_kind") == "fit" and any(
        n.startswith("observed_") for n in ds.data_vars
    ):
        kinds = {
            _residuals(ds, spec, n[9:])[1]
            for n in ds.data_vars
            if n.startswith("observed_") and f"predicted_{n[9:]}" in ds
        }
        if kinds:
            text += " Residuals: " + (
                "Pearson, (observed − fitted) / sd of the noise at the fit."
                if kinds == {"Pearson"}
                else "observed − fitted (Pearson where the noise sd is known)."
            )
    return text
